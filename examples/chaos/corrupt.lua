-- 0.1% of the frames leaving each worker get one byte flipped, for 8 s: a corrupted frame must
-- be refused (never decoded into wrong tokens) and its step retried.
--   shoal chaos examples/chaos/corrupt.lua -c examples/chaos/cluster.lua
at(0.5, corrupt { link = "*", p = 0.001, bytes = 1, lasting = 8 })
