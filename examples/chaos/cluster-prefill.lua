-- cluster.lua without the prefix cache, for kill-prefill.lua: its prompts repeat, and with the
-- cache a repeated prompt would skip its prefill. 64 tokens per step, so a prompt of a hundred
-- tokens or more is prefilled over several steps and a fault can land in the middle of one.
local m = model { path = "../../tests/data/stories260K/stories260K.gguf", name = "stories" }
return cluster {
  nodes = {
    node { name = "front", listen = "ipc:///tmp/shoal-chaos-front.sock" },
    node { name = "w0", listen = "ipc:///tmp/shoal-chaos-w0.sock" },
    node { name = "w1", listen = "ipc:///tmp/shoal-chaos-w1.sock" },
  },
  gateway = { node = "front", http = "127.0.0.1:8080" },
  replicas = { replica { model = m, stages = pipeline(m, { "w0", "w1" }) } },
  batcher = { max_seqs = 16, max_step_tokens = 64 },
  kv = { memory = "32MiB", prefix_cache = false },
}
