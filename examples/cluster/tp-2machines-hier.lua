-- One replica of the default model whose one stage runs on a tensor-parallel group of 4 ranks on
-- two machines, 2 ranks each: machine A runs the front (gateway, batcher, kvmgr) and ranks w0 and
-- w1, machine B runs w2 and w3. The ranks of each machine exchange through shared memory, and each
-- machine's first rank (its leader: w0, w2) with the other's over the network: the two-level
-- scheme (docs/cluster.md, "Tensor parallelism"). EDIT the two addresses below to your machines'
-- (reachable from each other on ports 7000-7004, and 8001 and 8003: the leaders' collective links
-- listen on their node's port + 1000). Copy this same file, and the same model file at the same
-- path relative to it, to both machines. Commands in README.md beside this file.
-- tp_link = "auto" (the default) picks the two levels by itself on two machines; "hier" keeps
-- them when scripts/check-cluster-examples.sh runs this script on one machine with A and B as
-- 127.0.0.1 and 127.0.0.2, which "auto" would count as one host ("hier" takes each address as
-- written as its host).
local A = "10.0.0.1" -- machine A: front, w0, w1
local B = "10.0.0.2" -- machine B: w2, w3
local m = model { path = "../../models/smollm2-135m-instruct-q4_1.gguf", name = "smollm2" }
return cluster {
  nodes = {
    node { name = "front", listen = "tcp://" .. A .. ":7000" },
    node { name = "w0", listen = "tcp://" .. A .. ":7001" },
    node { name = "w1", listen = "tcp://" .. A .. ":7002" },
    node { name = "w2", listen = "tcp://" .. B .. ":7003" },
    node { name = "w3", listen = "tcp://" .. B .. ":7004" },
  },
  -- Where clients connect (on machine A). 127.0.0.1 accepts local clients only.
  gateway = { node = "front", http = "127.0.0.1:8080" },
  replicas = {
    replica { model = m, stages = pipeline(m, { { "w0", "w1", "w2", "w3" } }), tp_link = "hier" },
  },
  batcher = { max_step_tokens = 4096, max_seqs = 64, max_wait_ms = 50 },
  -- KV memory of each rank.
  kv = { block_tokens = 16, prefix_cache = true, memory = "512MiB" },
}
