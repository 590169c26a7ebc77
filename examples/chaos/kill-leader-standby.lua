-- Kill the leader (rank 0) of a tensor-parallel group while requests decode: the front promotes
-- the hot standby into rank 0 (it preloaded w0's slices), tells both ranks of the new group,
-- reroutes the batcher to it and resumes every sequence by recompute; `cluster up` restarts w0,
-- which is not used again. Every request must finish with the undisturbed greedy text.
--   shoal chaos examples/chaos/kill-leader-standby.lua -c examples/chaos/cluster-tp-standby.lua
at(1.0, kill "w0")
