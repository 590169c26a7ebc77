-- Kill the same stage twice: the second kill lands after the first recovery, on the restarted
-- process (`shoal chaos` reads its new pid from `cluster up --pid-dir`).
--   shoal chaos examples/chaos/kill-twice.lua -c examples/chaos/cluster.lua --max-tokens 32
at(1.0, kill "w1")
at(5.0, kill "w1")
