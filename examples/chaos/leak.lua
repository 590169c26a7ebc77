-- Worker w1 leaks 50 MiB a second for 5 s (allocated and touched, so its RSS grows). Against
-- cluster-leak.lua, whose w1 has a 150 MiB budget, the front's watchdog drains it, it exits 75
-- and cluster up restarts it, with no request lost:
--   shoal chaos examples/chaos/leak.lua -c examples/chaos/cluster-leak.lua
at(1.0, leak { node = "w1", mb_per_s = 50, lasting = 5 })
