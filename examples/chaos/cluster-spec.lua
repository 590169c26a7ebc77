-- cluster.lua with speculative decoding: the same 2-stage stories260K pipeline behind the front,
-- whose batcher drafts with n-gram lookup (batcher.spec = "ngram"), so that the steps a fault
-- interrupts carry drafted tokens and the resumed sequences draft again:
--   shoal chaos examples/chaos/kill-decode-spec.lua -c examples/chaos/cluster-spec.lua
-- The model path is relative to this script's directory; tests/integration/test_chaos.py writes
-- copies with their own socket paths.
local m = model { path = "../../tests/data/stories260K/stories260K.gguf", name = "stories" }
return cluster {
  nodes = {
    node { name = "front", listen = "ipc:///tmp/shoal-chaos-spec-front.sock" },
    node { name = "w0", listen = "ipc:///tmp/shoal-chaos-spec-w0.sock" },
    node { name = "w1", listen = "ipc:///tmp/shoal-chaos-spec-w1.sock" },
  },
  gateway = { node = "front", http = "127.0.0.1:8080" },
  replicas = { replica { model = m, stages = pipeline(m, { "w0", "w1" }) } },
  batcher = { max_seqs = 16, max_step_tokens = 64, spec = "ngram", spec_k = 8 },
  kv = { memory = "32MiB" },
}
