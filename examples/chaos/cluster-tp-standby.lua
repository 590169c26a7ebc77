-- cluster-tp.lua plus a hot standby for the group's leader (docs/cluster.md, "Tensor
-- parallelism", "A standby takes a dead rank's place"): when w0 dies the watchdog promotes
-- 'spare' into rank 0, the batcher's steps go to it and w1 takes its steps from it
-- (kill-leader-standby.lua):
--   shoal chaos examples/chaos/kill-leader-standby.lua -c examples/chaos/cluster-tp-standby.lua
local m = model { path = "../../tests/data/stories260K/stories260K.gguf", name = "stories" }
return cluster {
  nodes = {
    node { name = "front", listen = "ipc:///tmp/shoal-chaos-front.sock" },
    node { name = "w0", listen = "ipc:///tmp/shoal-chaos-w0.sock" },
    node { name = "w1", listen = "ipc:///tmp/shoal-chaos-w1.sock" },
    node { name = "spare", listen = "ipc:///tmp/shoal-chaos-spare.sock", standby = true,
           preload = "w0" },
  },
  gateway = { node = "front", http = "127.0.0.1:8080" },
  replicas = { replica { model = m, stages = pipeline(m, { { "w0", "w1" } }) } },
  batcher = { max_seqs = 16, max_step_tokens = 64 },
  kv = { memory = "32MiB" },
}
