-- A 2-stage pipeline of the default model on one machine: the front (gateway, batcher, kvmgr)
-- and two worker nodes, each holding half of the layers, over ipc:// sockets in /tmp.
-- Run it with the commands in README.md beside this file; docs/cluster.md explains each setting.
-- The model path is relative to this script's directory.
local m = model { path = "../../models/smollm2-135m-instruct-q4_1.gguf", name = "smollm2" }
return cluster {
  nodes = {
    node { name = "front", listen = "ipc:///tmp/shoal-pipeline-front.sock" },
    node { name = "w0", listen = "ipc:///tmp/shoal-pipeline-w0.sock" },
    node { name = "w1", listen = "ipc:///tmp/shoal-pipeline-w1.sock" },
  },
  gateway = { node = "front", http = "127.0.0.1:8080" },
  -- pipeline() splits the layers evenly in node order; explicit ranges work too:
  --   stages = { { node = "w0", first_layer = 0, last_layer = 20 },
  --              { node = "w1", first_layer = 20, last_layer = 30 } }
  replicas = { replica { model = m, stages = pipeline(m, { "w0", "w1" }) } },
  batcher = { max_step_tokens = 4096, max_seqs = 64, max_wait_ms = 50 },
  -- KV memory per stage; every stage gets the same block count (sized for the largest stage).
  kv = { block_tokens = 16, prefix_cache = true, memory = "512MiB" },
}
