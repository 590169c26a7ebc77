-- cluster.lua: topology. Functions and loops are allowed; the result is data.
-- Model paths are relative to this script's directory (absolute ones are used as is).
local m = model { path = "../../models/smollm2-135m-instruct-q4_1.gguf", name = "smollm2" }
return cluster {
  nodes = {
    node { name = "front", listen = "ipc:///tmp/shoal-demo/front" },
    node { name = "w0", listen = "tcp://127.0.0.1:7101" },
    node { name = "w1", listen = "tcp://127.0.0.1:7102" },
    node { name = "spare", listen = "tcp://127.0.0.1:7103", standby = true },
  },
  gateway = { node = "front", http = "127.0.0.1:8080" },
  replicas = { replica { model = m, stages = pipeline(m, { "w0", "w1" }), tp = 1 } },
  batcher = { max_step_tokens = 4096, max_seqs = 64, max_wait_ms = 50 },
  kv = { block_tokens = 16, prefix_cache = true },
  watchdog = { heartbeat_ms = 100, dead_after = 3, policy = "lua/policy/default.lua" },
}
