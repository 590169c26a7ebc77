-- Kill the first stage's worker while prompts are being prefilled: long prompts (--prompt-words)
-- and few output tokens, so most steps in flight are prefill chunks (cluster-prefill.lua: 64
-- tokens per step, no prefix cache, so every prompt takes several steps).
--   shoal chaos examples/chaos/kill-prefill.lua -c examples/chaos/cluster-prefill.lua \
--     --prompt-words 60 --max-tokens 4
at(1.0, kill "w0")
