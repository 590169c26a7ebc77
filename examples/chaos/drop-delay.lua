-- A lossy, slow network for 5 s: every link leaving a worker drops 1% of its frames and delays
-- the rest by 50 ms. A dropped STEP, ACT or STEP_DONE must not lose a request.
--   shoal chaos examples/chaos/drop-delay.lua -c examples/chaos/cluster.lua --concurrency 16
at(0.5, drop { link = "*", p = 0.01, lasting = 5 })
at(0.5, delay { link = "*", ms = 50, lasting = 5 })
