-- Lose 1% of the frames of a tensor-parallel group's network collective, both ways between its
-- ranks w0 and w1, for the whole run (coll = true: the collective's frames only, not the nodes'
-- messages). The collective asks for a lost frame again within milliseconds, so no call fails, the
-- group never re-forms, and every request must finish with the undisturbed greedy text.
--   shoal chaos examples/chaos/drop-coll-1pct.lua -c examples/chaos/cluster-tp-net.lua
at(0.5, drop { link = "w0->w1", p = 0.01, coll = true })
at(0.5, drop { link = "w1->w0", p = 0.01, coll = true })
