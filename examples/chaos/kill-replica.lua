-- Kill the last stage of one of two replicas while requests decode (cluster-replicas.lua):
-- `cluster up` restarts w1 and replica 1 resumes its sequences by recompute, while replica 2
-- serves on; every request must finish with the undisturbed greedy text.
--   shoal chaos examples/chaos/kill-replica.lua -c examples/chaos/cluster-replicas.lua \
--     --max-tokens 32
at(1.0, kill "w1")
