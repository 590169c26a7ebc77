-- 5% of the frames leaving every node are sent twice, for 5 s: a duplicated STEP, ACT or
-- STEP_DONE must be ignored (steps carry ids and an epoch), never decoded into extra tokens.
--   shoal chaos examples/chaos/duplicate.lua -c examples/chaos/cluster.lua
at(0.5, duplicate { link = "*", p = 0.05, lasting = 5 })
