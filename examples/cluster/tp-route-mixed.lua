-- Length-aware routing: two replicas of the default model, one on a single worker (w0) and one
-- whose stage is a tensor-parallel group of 2 ranks (w1, w2), all on one machine. Prompts of more
-- than routing.long_prompt tokens go to the tensor-parallel replica, whose ranks share each
-- step's work (a long prompt's prefill finishes sooner); shorter ones go to w0, leaving the group
-- free (docs/cluster.md, "Length-aware routing"). Commands in README.md beside this file.
-- The model path is relative to this script's directory.
local m = model { path = "../../models/smollm2-135m-instruct-q4_1.gguf", name = "smollm2" }
return cluster {
  nodes = {
    node { name = "front", listen = "ipc:///tmp/shoal-rt-front.sock" },
    node { name = "w0", listen = "ipc:///tmp/shoal-rt-w0.sock" },
    node { name = "w1", listen = "ipc:///tmp/shoal-rt-w1.sock" },
    node { name = "w2", listen = "ipc:///tmp/shoal-rt-w2.sock" },
  },
  gateway = { node = "front", http = "127.0.0.1:8080" },
  replicas = {
    replica { model = m, stages = pipeline(m, { "w0" }) },          -- replica 0: 1 rank
    replica { model = m, stages = pipeline(m, { { "w1", "w2" } }) }, -- replica 1: tp = 2
  },
  routing = {
    long_prompt = 512, -- the default; prompts of more tokens are "long"
    -- Optional: route(req, replicas) decides first; nil leaves it to the rule above. Here a
    -- request of priority 0 with a long answer ahead goes to the group too, when it is healthy.
    route = function(req, replicas)
      if req.priority == 0 and req.max_tokens >= 1024 then
        for _, r in ipairs(replicas) do
          if r.tp > 1 and r.healthy then return r.index end
        end
      end
      return nil
    end,
  },
  batcher = { max_step_tokens = 4096, max_seqs = 64, max_wait_ms = 50 },
  kv = { block_tokens = 16, prefix_cache = true, memory = "512MiB" },
}
