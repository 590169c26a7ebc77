-- cluster.lua with a memory budget on w1 (docs/cluster.md, "Memory budgets"): the front's
-- watchdog drains w1 once its resident memory passes 150 MiB, w1 exits 75 and `shoal cluster up`
-- starts it again at once (leak.lua makes it leak):
--   shoal chaos examples/chaos/leak.lua -c examples/chaos/cluster-leak.lua
local m = model { path = "../../tests/data/stories260K/stories260K.gguf", name = "stories" }
return cluster {
  nodes = {
    node { name = "front", listen = "ipc:///tmp/shoal-chaos-front.sock" },
    node { name = "w0", listen = "ipc:///tmp/shoal-chaos-w0.sock" },
    node { name = "w1", listen = "ipc:///tmp/shoal-chaos-w1.sock", memory_budget = "150MiB" },
  },
  gateway = { node = "front", http = "127.0.0.1:8080" },
  replicas = { replica { model = m, stages = pipeline(m, { "w0", "w1" }) } },
  -- 64 tokens per step: a prompt of a few hundred tokens is prefilled over several steps, so a
  -- fault can land in the middle of a prefill (kill-prefill.lua).
  batcher = { max_seqs = 16, max_step_tokens = 64 },
  kv = { memory = "32MiB" },
}
