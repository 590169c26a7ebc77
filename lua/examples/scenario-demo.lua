-- scenario: fault injection against cluster-demo.lua, times in seconds from the start of the run.
at(2.0, kill "w1")
at(3.0, delay { from = "w0", to = "w1", ms = 50, lasting = 5 })
at(4.0, drop { link = "*", p = 0.01, lasting = 10 })
at(5.0, duplicate { link = "front->w0", p = 0.05 })
at(5.0, corrupt { link = "w0->w1", bytes = 4, p = 0.001, lasting = 2 })
at(6.5, stall { actor = "w0/stage0", ms = 300 })
at(7.0, partition { a = "front", b = "w1", lasting = 3 })
-- Loops are allowed: a flapping link between the workers.
for i = 0, 2 do
  at(12 + i, drop { from = "w0", to = "w1", p = 1, lasting = 0.5 })
end
at(20, heal {})
