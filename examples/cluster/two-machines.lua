-- One replica of the default model split over two machines over plain tcp://: machine A runs
-- the front (gateway, batcher, kvmgr) and worker w0 (layers 0-14), machine B runs worker w1
-- (layers 15-29). EDIT the two addresses below to your machines' (each node listens on its own
-- address, so A must be an address of machine A and B one of machine B, reachable from each
-- other on ports 7000-7002). Copy this same file, and the same model file at the same path
-- relative to it, to both machines: every node computes every address from the script, and the
-- front refuses a worker whose model file differs. The commands for each machine are in
-- README.md beside this file. Give every node the same cluster key (--cluster-key-file, README.md)
-- so that only nodes holding it are served; tcp:// itself is not encrypted (tls+tcp:// with
-- certificates is, docs/cluster.md).
local A = "10.0.0.1" -- machine A: front and w0
local B = "10.0.0.2" -- machine B: w1
local m = model { path = "../../models/smollm2-135m-instruct-q4_1.gguf", name = "smollm2" }
return cluster {
  nodes = {
    node { name = "front", listen = "tcp://" .. A .. ":7000" },
    node { name = "w0", listen = "tcp://" .. A .. ":7001" },
    node { name = "w1", listen = "tcp://" .. B .. ":7002" },
  },
  -- Where clients connect (on machine A). 127.0.0.1 accepts local clients only; use A's address
  -- (or --host on the front's command line) to serve other machines.
  gateway = { node = "front", http = "127.0.0.1:8080" },
  replicas = { replica { model = m, stages = pipeline(m, { "w0", "w1" }) } },
  batcher = { max_step_tokens = 4096, max_seqs = 64, max_wait_ms = 50 },
  kv = { block_tokens = 16, prefix_cache = true, memory = "512MiB" },
}
