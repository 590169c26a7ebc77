-- Kill rank 1 of a tensor-parallel group while requests decode: `cluster up` restarts w1, the
-- front pauses the replica and resumes every sequence by recompute once w1 is back (the leader
-- forms the group anew); every request must finish with the undisturbed greedy text.
--   shoal chaos examples/chaos/kill-rank.lua -c examples/chaos/cluster-tp.lua --max-tokens 32
at(1.0, kill "w1")
