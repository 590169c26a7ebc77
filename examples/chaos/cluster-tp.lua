-- cluster.lua with its one stage on a tensor-parallel group of 2 ranks, w0 (the leader) and w1
-- (docs/cluster.md, "Tensor parallelism"): kill-rank.lua and stop-rank-2s.lua take rank 1 away;
-- the replica pauses, and resumes (the group formed anew) once w1 answers again:
--   shoal chaos examples/chaos/kill-rank.lua -c examples/chaos/cluster-tp.lua --max-tokens 32
local m = model { path = "../../tests/data/stories260K/stories260K.gguf", name = "stories" }
return cluster {
  nodes = {
    node { name = "front", listen = "ipc:///tmp/shoal-chaos-front.sock" },
    node { name = "w0", listen = "ipc:///tmp/shoal-chaos-w0.sock" },
    node { name = "w1", listen = "ipc:///tmp/shoal-chaos-w1.sock" },
  },
  gateway = { node = "front", http = "127.0.0.1:8080" },
  replicas = { replica { model = m, stages = pipeline(m, { { "w0", "w1" } }) } },
  batcher = { max_seqs = 16, max_step_tokens = 64 },
  kv = { memory = "32MiB" },
}
