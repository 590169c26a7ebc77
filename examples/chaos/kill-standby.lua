-- Kill a stage, then kill the standby while it is being promoted to replace it: the front must
-- fall back to the dead node (restarted by `cluster up`) and still lose no request. With the
-- tiny test model the kill is seen in about 0.015 s and the promotion takes about 0.07 s, so
-- the standby dies 0.04 s after the stage, mostly while it is being promoted; when it was
-- already promoted, the restarted standby takes its stages back instead.
--   shoal chaos examples/chaos/kill-standby.lua -c examples/chaos/cluster-standby.lua
at(1.0, kill "w1")
at(1.04, kill "spare")
