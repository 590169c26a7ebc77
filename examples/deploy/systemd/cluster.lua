-- /etc/shoal/cluster.lua for the units beside this file: one replica of the default model split
-- over two worker machines, the front on a third. Every address is a host name, resolved when a
-- node starts (and again before each dial), so the same file serves every machine; EDIT the three
-- names to your machines'. Copy this file to /etc/shoal/cluster.lua and the model file to
-- /var/lib/shoal/models/ on every machine (the front refuses a worker whose model file differs).
local m = model { path = "/var/lib/shoal/models/smollm2-135m-instruct-q4_1.gguf", name = "smollm2" }
return cluster {
  nodes = {
    node { name = "front", listen = "tcp://shoal-front.example.internal:7000" },
    node { name = "w0", listen = "tcp://shoal-w0.example.internal:7001" },
    node { name = "w1", listen = "tcp://shoal-w1.example.internal:7001" },
  },
  -- Where clients connect, on the front's machine (0.0.0.0: every address of it).
  gateway = { node = "front", http = "0.0.0.0:8080" },
  replicas = { replica { model = m, stages = pipeline(m, { "w0", "w1" }) } },
  batcher = { max_step_tokens = 4096, max_seqs = 64, max_wait_ms = 50 },
  kv = { block_tokens = 16, prefix_cache = true, memory = "512MiB" },
}
