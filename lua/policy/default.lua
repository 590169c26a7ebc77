-- Default degradation policy (DESIGN.md section 7): the watchdog calls level(m) every tick with
-- the current metrics and applies the level it returns, 0 (normal) to 4 (shed load).
function level(m)
  if m.queue_wait_p99_ms > 5000 or m.kv_used > 0.98 then return 4 end  -- shed non-priority work
  if m.queue_wait_p99_ms > 2000 then return 3 end                      -- route to the light model
  if m.queue_wait_p99_ms > 1000 then return 2 end                      -- cap max_tokens
  if m.queue_wait_p99_ms > 500 then return 1 end                       -- no logprobs
  return 0
end
