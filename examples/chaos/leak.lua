-- Worker w1 leaks 50 MiB a second for 5 s (allocated and touched, so its RSS grows): a memory
-- watchdog should drain and restart it with no request lost.
--   shoal chaos examples/chaos/leak.lua -c examples/chaos/cluster.lua
at(1.0, leak { node = "w1", mb_per_s = 50, lasting = 5 })
