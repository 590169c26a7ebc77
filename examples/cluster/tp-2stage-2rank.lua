-- One replica of the default model in 2 pipeline stages, each on a tensor-parallel group of 2
-- ranks, on one machine: stage 1 (layers 0-14) on w0 (its leader) and w1, stage 2 (layers
-- 15-29) on w2 (its leader) and w3. The front sends each step to w0; w0 sends its hidden rows
-- as ACT to w2; each leader hands the step to its other rank, and the ranks of a group exchange
-- through shared memory (docs/cluster.md, "Tensor parallelism"). Commands in README.md beside
-- this file.
-- The model path is relative to this script's directory.
local m = model { path = "../../models/smollm2-135m-instruct-q4_1.gguf", name = "smollm2" }
return cluster {
  nodes = {
    node { name = "front", listen = "ipc:///tmp/shoal-tp2-front.sock" },
    node { name = "w0", listen = "ipc:///tmp/shoal-tp2-w0.sock" },
    node { name = "w1", listen = "ipc:///tmp/shoal-tp2-w1.sock" },
    node { name = "w2", listen = "ipc:///tmp/shoal-tp2-w2.sock" },
    node { name = "w3", listen = "ipc:///tmp/shoal-tp2-w3.sock" },
  },
  gateway = { node = "front", http = "127.0.0.1:8080" },
  -- Consecutive pairs of nodes form each stage's group; the same as
  -- pipeline(m, { { "w0", "w1" }, { "w2", "w3" } }).
  replicas = { replica { model = m, stages = pipeline(m, { "w0", "w1", "w2", "w3" }), tp = 2 } },
  batcher = { max_step_tokens = 4096, max_seqs = 64, max_wait_ms = 50 },
  -- KV memory of each rank.
  kv = { block_tokens = 16, prefix_cache = true, memory = "512MiB" },
}
