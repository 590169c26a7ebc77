-- Kill the last stage's worker while requests decode speculatively (cluster-spec.lua: n-gram
-- drafts verified by w1): steps in flight carry drafts when w1 dies; `cluster up` restarts it,
-- the front resumes every sequence by recompute, and every request must finish with the
-- undisturbed greedy text (test_chaos.py also checks that drafts were accepted).
--   shoal chaos examples/chaos/kill-decode-spec.lua -c examples/chaos/cluster-spec.lua --max-tokens 48
at(1.0, kill "w1")
