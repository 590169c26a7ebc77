-- single-node.lua: what `shoal serve -c lua/examples/single-node.lua` runs. One node holds the
-- gateway and one replica of one stage; the batcher and KV settings apply to that replica.
-- A relative model path is relative to this script's directory (here: the repository's models/),
-- not to where shoal runs; an absolute path is used as is.
local m = model { path = "../../models/smollm2-135m-instruct-q4_1.gguf", name = "smollm2" }
return cluster {
  nodes = { node { name = "local", listen = "inproc://local" } },
  gateway = { node = "local", http = "127.0.0.1:8080" },
  replicas = { replica { model = m, stages = pipeline(m, { "local" }) } },
  batcher = { max_step_tokens = 4096, max_seqs = 64, max_wait_ms = 50 },
  kv = { block_tokens = 16, prefix_cache = true, memory = "512MiB" },
}
