-- Default degradation policy (DESIGN.md section 7): level(m) maps the metrics
-- to a level, 0 (normal) to 4 (shed load). `shoal serve --policy default` (or a
-- cluster script's watchdog = { policy = 'default' }) evaluates it every tick.
-- shoal carries a copy of this file (lua/policy.c; test_lua_policy checks that
-- they are equal), so an installed binary needs no file. docs/serving.md tells
-- what each level does.
function level(m)
  if m.queue_wait_p99_ms > 5000 or m.kv_used > 0.98 then return 4 end -- shed
  if m.queue_wait_p99_ms > 2000 then return 3 end -- route to the light model
  if m.queue_wait_p99_ms > 1000 then return 2 end -- cap max_tokens
  if m.queue_wait_p99_ms > 500 then return 1 end -- no logprobs
  return 0
end
