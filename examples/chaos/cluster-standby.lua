-- cluster.lua plus a hot standby node: when a stage's node dies the watchdog promotes 'spare'
-- (kill-standby.lua kills the spare while it is being promoted).
local m = model { path = "../../tests/data/stories260K/stories260K.gguf", name = "stories" }
return cluster {
  nodes = {
    node { name = "front", listen = "ipc:///tmp/shoal-chaos-front.sock" },
    node { name = "w0", listen = "ipc:///tmp/shoal-chaos-w0.sock" },
    node { name = "w1", listen = "ipc:///tmp/shoal-chaos-w1.sock" },
    node { name = "spare", listen = "ipc:///tmp/shoal-chaos-spare.sock", standby = true },
  },
  gateway = { node = "front", http = "127.0.0.1:8080" },
  replicas = { replica { model = m, stages = pipeline(m, { "w0", "w1" }) } },
  batcher = { max_seqs = 16, max_step_tokens = 64 },
  kv = { memory = "32MiB" },
}
