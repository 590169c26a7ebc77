-- The cluster the chaos scenarios of this folder run against: a 2-stage pipeline of the tiny
-- stories260K test model (5 layers: w0 holds [0, 2), w1 [2, 5)) behind the front, over ipc://
-- sockets in /tmp. Small and fast, so that a scenario of a few hundred requests takes seconds:
--   shoal chaos examples/chaos/kill-decode.lua -c examples/chaos/cluster.lua
-- The model path is relative to this script's directory. Two chaos runs at once need their own
-- copies with other socket paths (tests/integration/test_chaos.py writes them).
local m = model { path = "../../tests/data/stories260K/stories260K.gguf", name = "stories" }
return cluster {
  nodes = {
    node { name = "front", listen = "ipc:///tmp/shoal-chaos-front.sock" },
    node { name = "w0", listen = "ipc:///tmp/shoal-chaos-w0.sock" },
    node { name = "w1", listen = "ipc:///tmp/shoal-chaos-w1.sock" },
  },
  gateway = { node = "front", http = "127.0.0.1:8080" },
  replicas = { replica { model = m, stages = pipeline(m, { "w0", "w1" }) } },
  -- 64 tokens per step: a prompt of a few hundred tokens is prefilled over several steps, so a
  -- fault can land in the middle of a prefill (kill-prefill.lua).
  batcher = { max_seqs = 16, max_step_tokens = 64 },
  kv = { memory = "32MiB" },
}
