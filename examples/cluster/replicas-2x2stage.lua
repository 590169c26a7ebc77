-- Two replicas of the default model, each a 2-stage pipeline, on one machine: the front
-- (gateway, router, and each replica's batcher and kvmgr) and four worker nodes over ipc:// in
-- /tmp. Replica 1 runs on w0 and w1, replica 2 on w2 and w3; the router picks a replica per
-- request (the router is in since commit 467533e; before it, a script with two replicas was
-- refused). Commands in README.md beside this file.
-- The model path is relative to this script's directory.
local m = model { path = "../../models/smollm2-135m-instruct-q4_1.gguf", name = "smollm2" }
return cluster {
  nodes = {
    node { name = "front", listen = "ipc:///tmp/shoal-replicas-front.sock" },
    node { name = "w0", listen = "ipc:///tmp/shoal-replicas-w0.sock" },
    node { name = "w1", listen = "ipc:///tmp/shoal-replicas-w1.sock" },
    node { name = "w2", listen = "ipc:///tmp/shoal-replicas-w2.sock" },
    node { name = "w3", listen = "ipc:///tmp/shoal-replicas-w3.sock" },
  },
  gateway = { node = "front", http = "127.0.0.1:8080" },
  replicas = {
    replica { model = m, stages = pipeline(m, { "w0", "w1" }) },
    replica { model = m, stages = pipeline(m, { "w2", "w3" }) },
  },
  batcher = { max_step_tokens = 4096, max_seqs = 64, max_wait_ms = 50 },
  -- KV memory per stage, in each replica.
  kv = { block_tokens = 16, prefix_cache = true, memory = "512MiB" },
}
