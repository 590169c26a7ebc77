-- cluster.lua with two replicas behind the router: replica 1 on w0 and w1, replica 2 on w2 and
-- w3 (kill-replica.lua kills w1: replica 1 pauses and resumes once w1 is back, while replica 2
-- goes on serving and takes the requests that had not started):
--   shoal chaos examples/chaos/kill-replica.lua -c examples/chaos/cluster-replicas.lua
local m = model { path = "../../tests/data/stories260K/stories260K.gguf", name = "stories" }
return cluster {
  nodes = {
    node { name = "front", listen = "ipc:///tmp/shoal-chaos-front.sock" },
    node { name = "w0", listen = "ipc:///tmp/shoal-chaos-w0.sock" },
    node { name = "w1", listen = "ipc:///tmp/shoal-chaos-w1.sock" },
    node { name = "w2", listen = "ipc:///tmp/shoal-chaos-w2.sock" },
    node { name = "w3", listen = "ipc:///tmp/shoal-chaos-w3.sock" },
  },
  gateway = { node = "front", http = "127.0.0.1:8080" },
  replicas = {
    replica { model = m, stages = pipeline(m, { "w0", "w1" }) },
    replica { model = m, stages = pipeline(m, { "w2", "w3" }) },
  },
  batcher = { max_seqs = 16, max_step_tokens = 64 },
  kv = { memory = "32MiB" },
}
