-- Default degradation policy (DESIGN.md section 7): level(m) maps the current metrics to a level,
-- 0 (normal) to 4 (shed load). The watchdog actor that is to call it every tick and apply the
-- level is not written yet; today only tests/unit/test_lua_policy.c calls it.
function level(m)
  if m.queue_wait_p99_ms > 5000 or m.kv_used > 0.98 then return 4 end  -- shed non-priority work
  if m.queue_wait_p99_ms > 2000 then return 3 end                      -- route to the light model
  if m.queue_wait_p99_ms > 1000 then return 2 end                      -- cap max_tokens
  if m.queue_wait_p99_ms > 500 then return 1 end                       -- no logprobs
  return 0
end
