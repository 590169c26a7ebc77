-- One replica of the default model whose one stage runs on a tensor-parallel group of 2 ranks,
-- w0 (rank 0, the leader) and w1, on one machine: the ranks exchange through shared memory, and
-- the front (gateway, batcher, kvmgr) sends each step to w0, which hands it to w1
-- (docs/cluster.md, "Tensor parallelism"); each rank holds and computes its slice of every
-- matrix. Commands in README.md beside this file.
-- The model path is relative to this script's directory.
local m = model { path = "../../models/smollm2-135m-instruct-q4_1.gguf", name = "smollm2" }
return cluster {
  nodes = {
    node { name = "front", listen = "ipc:///tmp/shoal-tp-front.sock" },
    node { name = "w0", listen = "ipc:///tmp/shoal-tp-w0.sock" },
    node { name = "w1", listen = "ipc:///tmp/shoal-tp-w1.sock" },
  },
  gateway = { node = "front", http = "127.0.0.1:8080" },
  -- One stage, its group's ranks in order. Also written pipeline(m, { "w0", "w1" }), tp = 2
  -- as the replica's options; { { "w0", "w1" }, { "w2", "w3" } } would be 2 stages x 2 ranks.
  -- With ranks on hosts joined by a slow network, add tp_link = "net", tp_compress = "f16" to
  -- send the all-reduces as F16 (summed in F32: half their bytes; "int8", a quarter, is lossy):
  -- docs/cluster.md, "Compressed links".
  replicas = { replica { model = m, stages = pipeline(m, { { "w0", "w1" } }) } },
  batcher = { max_step_tokens = 4096, max_seqs = 64, max_wait_ms = 50 },
  -- KV memory of each rank.
  kv = { block_tokens = 16, prefix_cache = true, memory = "512MiB" },
}
