-- Cut the two stages apart for 2 s, both directions (each worker drops what it sends to the
-- other), then heal: steps in flight are lost on the wire and must be retried or recomputed.
--   shoal chaos examples/chaos/partition-2s.lua -c examples/chaos/cluster.lua --max-tokens 32
at(1.0, partition { a = "w0", b = "w1", lasting = 2 })
