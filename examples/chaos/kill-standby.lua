-- Kill a stage, then kill the hot standby while it is being promoted to replace it: the
-- watchdog must fall back (restart under `cluster up`) and still lose no request.
--   shoal chaos examples/chaos/kill-standby.lua -c examples/chaos/cluster-standby.lua
at(1.0, kill "w1")
at(1.15, kill "spare")
