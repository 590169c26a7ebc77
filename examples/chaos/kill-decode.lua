-- Kill the last stage's worker while requests decode (long outputs, short prompts): `cluster up`
-- restarts w1, the front pauses the replica and resumes every sequence by recompute once w1 is
-- back; every request must finish with the undisturbed greedy text.
--   shoal chaos examples/chaos/kill-decode.lua -c examples/chaos/cluster.lua --max-tokens 48
at(1.0, kill "w1")
