-- cluster-tp.lua with the group's ranks linked over the network collective (tp_link = "net": NNG
-- sockets beside the nodes' ipc:// URLs) rather than shared memory, so that the fault layer's
-- rules reach its frames (docs/cluster.md, "Tensor parallelism"); drop-coll-1pct.lua loses some:
--   shoal chaos examples/chaos/drop-coll-1pct.lua -c examples/chaos/cluster-tp-net.lua
local m = model { path = "../../tests/data/stories260K/stories260K.gguf", name = "stories" }
return cluster {
  nodes = {
    node { name = "front", listen = "ipc:///tmp/shoal-chaos-front.sock" },
    node { name = "w0", listen = "ipc:///tmp/shoal-chaos-w0.sock" },
    node { name = "w1", listen = "ipc:///tmp/shoal-chaos-w1.sock" },
  },
  gateway = { node = "front", http = "127.0.0.1:8080" },
  replicas = { replica { model = m, stages = pipeline(m, { { "w0", "w1" } }), tp_link = "net" } },
  batcher = { max_seqs = 16, max_step_tokens = 64 },
  kv = { memory = "32MiB" },
}
