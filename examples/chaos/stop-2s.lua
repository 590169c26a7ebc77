-- SIGSTOP a worker for 2 s, then SIGCONT: its sockets stay open, so only a heartbeat (the
-- watchdog) can tell the node is gone; the requests in flight must still all finish, and equal.
--   shoal chaos examples/chaos/stop-2s.lua -c examples/chaos/cluster.lua --max-tokens 32
at(1.0, stop { node = "w1", lasting = 2 })
