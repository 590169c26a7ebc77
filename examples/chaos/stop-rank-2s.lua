-- SIGSTOP rank 1 of a tensor-parallel group for 2 s, then SIGCONT: the leader waits in the
-- group's collective (its timeout is longer than the watchdog's bound), the watchdog pauses the
-- replica, and once w1 answers again the replica resumes; every request must finish, and equal.
--   shoal chaos examples/chaos/stop-rank-2s.lua -c examples/chaos/cluster-tp.lua --max-tokens 32
at(1.0, stop { node = "w1", lasting = 2 })
