-- Test of the Lua module `shoal` against the real stories260K model, run by the system lua5.4
-- (ctest test_lua_module; LUA_CPATH points at the built shoal.so).
-- Usage: lua5.4 test_shoal_lua.lua MODEL.gguf EXPECTED_IDS.txt
local shoal = require "shoal"

local model, expected_path = arg[1], arg[2]
assert(model and expected_path, "usage: test_shoal_lua.lua MODEL EXPECTED_IDS")
if model:sub(1, 1) ~= "/" then model = os.getenv("PWD") .. "/" .. model end

local failures = 0
local function check(cond, what, ...)
  if not cond then
    failures = failures + 1
    io.stderr:write("FAIL: ", what, " ", table.concat({ ... }, " "), "\n")
  end
end
local function eq(got, want, what)
  check(got == want, what, "got", tostring(got), "want", tostring(want))
end

-- Greedy ids llama2.c's run.c generated from BOS (tests/data/stories260K/README).
local expected = {}
for w in io.open(expected_path):read("a"):gmatch("%d+") do expected[#expected + 1] = tonumber(w) end
assert(#expected >= 32, "expected ids file too short")

-- Misuse raises; failures reported by the library return nil, message, code.
eq(pcall(shoal.open, "not a table"), false, "open with a string raises")
local ok, msg = pcall(shoal.open, { model = model, modle = 1 })
check(not ok and msg:find("unknown option 'modle'"), "open: unknown key named", tostring(msg))
ok, msg = pcall(shoal.open, { model = model .. "\0.txt" })
check(not ok and msg:find("option 'model' holds a NUL byte", 1, true), "open: model path with NUL raises",
  tostring(msg))
local e0, m0, c0 = shoal.open { model = "/nonexistent/model.gguf", threads = 1 }
eq(e0, nil, "open of a missing file fails")
check(type(m0) == "string" and #m0 > 0, "open failure has a message", tostring(m0))
check(c0 == "ENOTFOUND" or c0 == "EIO", "open failure code", tostring(c0))
local e1, _, c1 = shoal.open { threads = 1 }
eq(e1, nil, "open with neither model nor cluster fails")
eq(c1, "EINVAL", "no model: code")

-- thread placement for hosts that share the CPU: a bad policy raises; an out-of-range nice is
-- the library's SH_EINVAL; a placed engine opens and closes
local okp, pmsg = pcall(shoal.open, { model = model, threads = 1, sched = "fifo" })
check(not okp and pmsg:find("normal, batch or idle"), "open: bad sched named", tostring(pmsg))
local en, _, cn = shoal.open { model = model, threads = 1, nice = 20 }
check(en == nil and cn == "EINVAL", "open: nice 20 refused", tostring(cn))
local ep = assert(shoal.open { model = model, threads = 1, sched = "idle", nice = 2,
  no_spin = true, cpu_mask = 1 })
ep:close()
-- a cluster front's wait for a lost worker: out of range is the library's SH_EINVAL naming it,
-- a wrong type raises, a good value opens (a model run here ignores it)
local er, rmsg, rcode = shoal.open { model = model, threads = 1, recover_timeout_ms = -2 }
check(er == nil and rcode == "EINVAL" and tostring(rmsg):find("opts.recover_timeout_ms", 1, true),
  "open: recover_timeout_ms -2 refused", tostring(rmsg))
local okr, rerr = pcall(shoal.open, { model = model, recover_timeout_ms = "soon" })
check(not okr and rerr:find("option 'recover_timeout_ms' must be an integer", 1, true),
  "open: recover_timeout_ms of a wrong type raises", tostring(rerr))
local e3 = assert(shoal.open { model = model, threads = 1, recover_timeout_ms = 5000 })
e3:close()
local eng = assert(shoal.open { model = model, threads = 1 })
check(tostring(eng):find("open"), "tostring", tostring(eng))
check(type(shoal.version) == "string", "shoal.version")

-- info, tokenize, detokenize.
local info = assert(eng:info())
eq(info.n_vocab, 512, "info.n_vocab")
eq(info.n_layers, 5, "info.n_layers")
eq(info.dim, 64, "info.dim")
eq(info.bos, 1, "info.bos")
local ids = assert(eng:tokenize("Once upon a time", true))
eq(ids[1], 1, "tokenize adds BOS")
check(#ids >= 3, "tokenize count", #ids)
local text = assert(eng:detokenize({ table.unpack(ids, 2) }))
check(text:find("Once upon a time", 1, true), "detokenize round trip", text)
local bad, bmsg, bcode = eng:tokenize("bad \xff utf8")
eq(bad, nil, "tokenize of invalid UTF-8 fails")
eq(bcode, "EINVAL", "invalid UTF-8 code")
check(type(bmsg) == "string", "invalid UTF-8 message")
check(type(eng:fd()) == "number" and eng:fd() >= 0, "fd", tostring(eng:fd()))
eq(eng:pending(), 0, "nothing pending at start")

-- Poll until fn() is true, at most `seconds`.
local function poll_until(fn, seconds)
  local deadline = os.time() + seconds
  while not fn() do
    assert(eng:poll(50))
    if os.time() > deadline then return false end
  end
  return true
end

-- 1. Greedy from BOS equals llama2.c's ids; streamed text equals the detokenized ids.
local got, streamed, done_info, nfinal = {}, {}, nil, 0
local id = assert(eng:submit({ prompt_tokens = { 1 }, max_tokens = 32, ignore_eos = true }, {
  token = function(t, tids, rid)
    streamed[#streamed + 1] = t
    for _, v in ipairs(tids) do got[#got + 1] = v end
  end,
  done = function(inf, rid) done_info = inf; nfinal = nfinal + 1 end,
  error = function(code, m) nfinal = nfinal + 1; check(false, "greedy run error", code, m) end,
}))
check(math.type(id) == "integer" and id ~= 0, "submit returns an id", tostring(id))
eq(eng:pending(), 1, "one pending")
check(poll_until(function() return nfinal > 0 end, 60), "greedy run finished in 60 s")
eq(nfinal, 1, "exactly one final callback")
eq(#got, 32, "32 tokens generated")
local same = true
for i = 1, 32 do if got[i] ~= expected[i] then same = false end end
check(same, "greedy ids equal llama2.c's", table.concat(got, " "))
eq(done_info and done_info.finish, "length", "finish reason")
eq(done_info and done_info.completion_tokens, 32, "usage.completion_tokens")
eq(table.concat(streamed), assert(eng:detokenize(got)), "streamed text == detokenize(ids)")
eq(eng:pending(), 0, "nothing pending after done")
local c_ok, _, c_code = eng:cancel(id)
eq(c_ok, nil, "cancel of a finished request fails")
eq(c_code, "ENOTFOUND", "cancel finished: code")

-- 2. Cancel: once is fine, twice is ECANCELED, and the request ends with finish "cancel"
-- (or as it would have, if it ended first).
local cfin, cdone = nil, 0
local cid = assert(eng:submit({ prompt = "Once upon a time", max_tokens = 400, ignore_eos = true },
  { done = function(inf) cfin = inf.finish; cdone = cdone + 1 end,
    error = function(code, m) cdone = cdone + 1; check(false, "cancel run error", code, m) end }))
assert(eng:cancel(cid))
local c2, _, c2code = eng:cancel(cid)
eq(c2, nil, "second cancel fails")
eq(c2code, "ECANCELED", "second cancel code")
check(poll_until(function() return cdone > 0 end, 60), "cancelled request ended")
eq(cdone, 1, "cancelled request: one final callback")
-- The header allows "as it would have" when it ended before the cancel took effect; 400 tokens
-- cannot all be generated before the cancel here, so "cancel" is what must come.
eq(cfin, "cancel", "cancelled finish reason")

-- 3. Re-entrant calls from a callback: submit works, poll and close answer EBUSY.
local chain_done, inner_poll_code, inner_close_code = 0, nil, nil
local function chained(n)
  return {
    done = function()
      chain_done = chain_done + 1
      local _, _, pc = eng:poll(0)
      inner_poll_code = pc
      local _, _, cc = eng:close()
      inner_close_code = cc
      if n > 1 then assert(eng:submit({ prompt = "The cat", max_tokens = 4 }, chained(n - 1))) end
    end,
    error = function(code, m) check(false, "chained error", code, m) end,
  }
end
assert(eng:submit({ prompt = "The cat", max_tokens = 4 }, chained(3)))
check(poll_until(function() return chain_done == 3 end, 60), "three chained requests finished")
eq(inner_poll_code, "EBUSY", "poll from a callback")
eq(inner_close_code, "EBUSY", "close from a callback")

-- 4. An error raised by a Lua callback comes out of poll, after the C call returned.
local raised = false
assert(eng:submit({ prompt = "The dog", max_tokens = 2 }, {
  done = function() error("boom from done") end }))
local deadline = os.time() + 60
while eng:pending() > 0 and os.time() <= deadline do
  local pok, perr = pcall(eng.poll, eng, 50)
  if not pok then
    raised = true
    check(tostring(perr):find("boom from done"), "callback error text", tostring(perr))
  end
end
check(raised, "callback error re-raised by poll")

-- 5. Bad requests: misuse raises, bad values return nil, msg, code and run no callback.
check(not pcall(eng.submit, eng, { prompt = "x", max_tokns = 3 }, {}), "unknown request key raises")
check(not pcall(eng.submit, eng, { prompt = 5 }, {}), "non-string prompt raises")
-- A NUL byte would cut a C string without a word: every string that becomes one raises.
local nok, nmsg = pcall(eng.submit, eng, { prompt = "Once\0 upon" }, {})
check(not nok and nmsg:find("option 'prompt' holds a NUL byte", 1, true), "prompt with NUL raises", tostring(nmsg))
check(not pcall(eng.submit, eng, { prompt = "x", stop = "a\0b" }, {}), "stop with NUL raises")
check(not pcall(eng.submit, eng, { prompt = "x", stop = { "ok", "a\0" } }, {}), "stop list with NUL raises")
check(not pcall(eng.submit, eng, { messages = { { role = "user", content = "hi\0there" } } }, {}),
  "message content with NUL raises")
check(not pcall(eng.submit, eng, { ["prompt\0x"] = "x" }, {}), "option name with NUL raises")
check(not pcall(eng.submit, eng, { prompt = "x" }, { token = 3 }), "non-function callback raises")
local r, rmsg, rcode = eng:submit({ prompt = "bad \xc3\x28 utf8" }, {})
eq(r, nil, "invalid UTF-8 prompt refused")
eq(rcode, "EINVAL", "invalid UTF-8 prompt code")
r, rmsg, rcode = eng:submit({ max_tokens = 3 }, {})
eq(r, nil, "no prompt refused")
eq(rcode, "EINVAL", "no prompt code")
check(type(rmsg) == "string" and #rmsg > 0, "no prompt message")
r, rmsg, rcode = eng:submit({ prompt = "x", typical_p = 1.5 }, {})
eq(rcode, "EINVAL", "typical_p 1.5 refused")
check(tostring(rmsg):find("typical_p", 1, true), "typical_p named", tostring(rmsg))
r, rmsg, rcode = eng:submit({ prompt = "x", min_tokens = -1 }, {})
eq(rcode, "EINVAL", "min_tokens -1 refused")
r, rmsg, rcode = eng:submit({ prompt = "x", repeat_last_n = -2 }, {})
eq(rcode, "EINVAL", "repeat_last_n -2 refused")
eq(eng:pending(), 0, "refused requests are not pending")
local samp_done = 0
assert(eng:submit({ prompt = "Once upon a time", max_tokens = 8, temperature = 1, seed = 3,
                    typical_p = 0.5, repeat_last_n = -1, repeat_penalty = 1.2, min_tokens = 8 }, {
  done = function(info)
    samp_done = samp_done + 1
    eq(info.completion_tokens, 8, "min_tokens 8")
  end,
  error = function(code, m) check(false, "sampling fields run error", code, m) end }))
check(poll_until(function() return samp_done > 0 end, 60), "sampling fields run finished")

-- 5b. logprobs, a stop list, stats, metrics; chat_apply on a model without a template.
local nlp, lp_ok = 0, true
local lid = assert(eng:submit({ prompt = "Once upon a time", max_tokens = 6, logprobs = true,
  stop = { "zzzz", "qqqq" } }, {
  token = function(_, tids, _, lps)
    nlp = nlp + 1
    if not lps or #lps ~= #tids then lp_ok = false end
    for _, v in ipairs(lps or {}) do if v > 0 then lp_ok = false end end
  end }))
check(poll_until(function() return eng:pending() == 0 end, 60), "logprobs request finished", lid)
check(nlp > 0 and lp_ok, "token callbacks carry one log-probability <= 0 per id", nlp)
local st = assert(eng:stats())
check(st.requests_total >= 6 and st.tokens_generated_total >= 32, "stats totals",
  st.requests_total, st.tokens_generated_total)
eq(st.pending, 0, "stats.pending")
local mt = assert(eng:metrics())
check(mt:find("# TYPE", 1, true), "metrics is Prometheus text")
local ca, _, cacode = eng:chat_apply({ { role = "user", content = "Hi" } })
if info.has_chat_template then
  check(type(ca) == "string" and ca:find("Hi", 1, true), "chat_apply", tostring(ca))
else
  eq(cacode, "EUNSUPPORTED", "chat_apply without a template")
end
eq(shoal.strerror("EBUSY"), "busy", "shoal.strerror")
check(not pcall(shoal.strerror, "NOPE"), "strerror of an unknown name raises")

-- 5c. Structured output: a grammar-constrained greedy request gives text the grammar accepts
-- (three to six lowercase words of 1 to 10 letters, each after a space, then a full stop), checked
-- here with Lua patterns; response_format's JSON schema gives {"n": digit}; a grammar with a
-- syntax error is the library's SH_EINVAL naming its line and column; a schema keyword outside
-- the coverage is named.
do
  local gtext, gfin = "", nil
  assert(eng:submit({ prompt = "Once upon a time", max_tokens = 96,
                      grammar = 'root ::= (" " [a-z]{1,10}){3,6} "."' }, {
    token = function(t) gtext = gtext .. t end,
    done = function(i) gfin = i.finish end,
    error = function(code, m) check(false, "grammar request error", code, m) end }))
  check(poll_until(function() return gfin ~= nil end, 60), "grammar request finished")
  eq(gfin, "stop", "the grammar ends the text")
  local words = 0
  local rest = gtext:gsub(" [a-z]+", function() words = words + 1; return "" end)
  check(rest == "." and words >= 3 and words <= 6 and gtext:match("^[ a-z]+%.$") and
    not gtext:match("[a-z][a-z][a-z][a-z][a-z][a-z][a-z][a-z][a-z][a-z][a-z]"),
    "the text follows the grammar", gtext)
  local jtext, jfin = "", nil
  -- at most 20 white-space characters between tokens: it ends before 160
  assert(eng:submit({ prompt = "Once upon a time", max_tokens = 160, response_format =
      '{"type":"json_schema","json_schema":{"schema":{"type":"object","properties":' ..
      '{"n":{"type":"integer","minimum":0,"maximum":9}},"required":["n"]}}}' }, {
    token = function(t) jtext = jtext .. t end,
    done = function(i) jfin = i.finish end,
    error = function(code, m) check(false, "response_format request error", code, m) end }))
  check(poll_until(function() return jfin ~= nil end, 60), "response_format request finished")
  eq(jfin, "stop", "the schema's grammar ends the text")
  check(jtext:match('^{%s*"n"%s*:%s*%d%s*}$'), "the text follows the schema", jtext)
  -- response_format as a table (written as JSON by the module): the same text
  local ttext, tfin = "", nil
  assert(eng:submit({ prompt = "Once upon a time", max_tokens = 160, response_format =
      { type = "json_schema", json_schema = { schema = { type = "object", properties =
        { n = { type = "integer", minimum = 0, maximum = 9 } }, required = { "n" } } } } }, {
    token = function(t) ttext = ttext .. t end,
    done = function(i) tfin = i.finish end,
    error = function(code, m) check(false, "response_format table request error", code, m) end }))
  check(poll_until(function() return tfin ~= nil end, 60), "response_format table finished")
  eq(ttext, jtext, "response_format as a table gives the same text")
  local br, bmsg, bcode = eng:submit({ prompt = "x", grammar = 'root ::= "a"\nb ::= [a-' }, {})
  check(br == nil and bcode == "EINVAL" and tostring(bmsg):find("line 2", 1, true) and
    tostring(bmsg):find("column", 1, true), "a bad grammar names its line and column",
    tostring(bmsg))
  br, bmsg, bcode = eng:submit({ prompt = "x", response_format =
      '{"type":"json_schema","json_schema":{"schema":{"type":"string","if":{}}}}' }, {})
  check(br == nil and bcode == "EINVAL" and tostring(bmsg):find("if", 1, true),
    "an unsupported keyword is named", tostring(bmsg))
  check(not pcall(eng.submit, eng, { prompt = "x", grammar = 5 }, {}), "a grammar not a string raises")
  eq(eng:pending(), 0, "refused grammar requests are not pending")
end

-- 6. Close with requests in flight: each gets its error callback (ECLOSED) once, during close.
local closed_codes = {}
for i = 1, 3 do
  assert(eng:submit({ prompt = "Once upon a time", max_tokens = 400, ignore_eos = true }, {
    done = function() check(false, "in-flight request finished instead of ECLOSED") end,
    error = function(code) closed_codes[#closed_codes + 1] = code end }))
end
assert(eng:close())
eq(#closed_codes, 3, "three error callbacks on close")
for _, c in ipairs(closed_codes) do eq(c, "ECLOSED", "close error code") end
assert(eng:close()) -- closing twice is fine
check(not pcall(eng.submit, eng, { prompt = "x" }, {}), "submit after close raises")
check(not pcall(eng.poll, eng, 0), "poll after close raises")

-- 6b. Embeddings: eng:embed returns the C API's unit vector (sh_done_info.embedding, as
-- submit{embed=true} hands it to done) of the model's width, the same for the text and its ids,
-- alone and among 8 requests in flight (within 1e-5); bad input fails clearly. Section 7 compares
-- an engine on a cluster script with it.
local EMBED_WORDS = "The little dog ran to the park and found a red ball under a tree"
local embed_ref
do
  local eng <close> = assert(shoal.open { model = model, threads = 1 })
  local function poll_until(fn, seconds)
    local deadline = os.time() + seconds
    while not fn() do
      assert(eng:poll(50))
      if os.time() > deadline then return false end
    end
    return true
  end
  local function norm(v)
    local s = 0
    for _, x in ipairs(v) do s = s + x * x end
    return math.sqrt(s)
  end
  local function maxdiff(a, b)
    local d = #a == #b and 0 or math.huge
    for i = 1, math.min(#a, #b) do d = math.max(d, math.abs(a[i] - b[i])) end
    return d
  end
  local words = EMBED_WORDS
  local v, ntok = eng:embed(words)
  check(type(v) == "table", "embed returns a table", tostring(ntok))
  v = v or {}
  eq(#v, info.dim, "embedding width")
  check(math.abs(norm(v) - 1) < 1e-5, "embedding is a unit vector", norm(v))
  local wids = assert(eng:tokenize(words, true))
  eq(ntok, #wids, "embed's token count is the prompt's")
  local vi, ni = eng:embed(wids)
  eq(ni, #wids, "token-id input: count")
  eq(maxdiff(v, vi or {}), 0, "text and its token ids embed the same")
  -- submit{embed=true}: done's info.embedding, while 7 other embeddings run in the same steps
  local infos, errs = {}, 0
  for k = 1, 8 do
    local p = k == 1 and words or string.rep("Once upon a time there was a cat. ", k)
    assert(eng:submit({ prompt = p, embed = true }, {
      done = function(inf) infos[k] = inf end,
      error = function(code, m) errs = errs + 1; check(false, "embed submit error", code, m) end }))
  end
  check(poll_until(function()
    local n = errs
    for k = 1, 8 do if infos[k] then n = n + 1 end end
    return n == 8
  end, 60), "8 embeddings ended in 60 s")
  local b = infos[1] or {}
  eq(b.completion_tokens, 0, "an embedding generates nothing")
  eq(b.prompt_tokens, ntok, "submit{embed}: prompt_tokens")
  local d = maxdiff(v, b.embedding or {})
  check(d <= 1e-5, "alone (eng:embed) vs in a batch of 8 (submit)", d)
  check(maxdiff(v, (infos[2] or {}).embedding or {}) > 1e-3, "different texts embed differently")
  local vo = eng:embed(words, { priority = 1, timeout_ms = 60000 })
  eq(maxdiff(v, vo or {}), 0, "embed with priority and timeout_ms: the same vector")
  -- from a callback: EBUSY (it cannot poll), and nothing is left in flight
  local inner_code
  assert(eng:submit({ prompt = "Hi", max_tokens = 2 }, {
    done = function() inner_code = select(3, eng:embed("inner")) end }))
  check(poll_until(function() return inner_code ~= nil end, 60), "callback ran")
  eq(inner_code, "EBUSY", "embed from a callback")
  local okx, xmsg = pcall(eng.embed, eng, 42)
  check(not okx and tostring(xmsg):find("string or table", 1, true), "embed(42) raises",
    tostring(xmsg))
  local oko, omsg = pcall(eng.embed, eng, "hi", { max_tokens = 3 })
  check(not oko and tostring(omsg):find("unknown option 'max_tokens'", 1, true),
    "embed: an unknown option raises", tostring(omsg))
  local ve, emsg, ecode = eng:embed({})
  check(ve == nil and ecode == "EINVAL" and type(emsg) == "string",
    "embed of no tokens: nil, msg, EINVAL", tostring(emsg), tostring(ecode))
  eq(eng:pending(), 0, "nothing pending after the embeddings")
  embed_ref = v
end

-- 7. An engine on a cluster script whose one replica runs in this process gives the same
-- greedy ids as the model path; a script that does not load returns nil, message, "ELUA".
local script = os.tmpname()
local f = assert(io.open(script, "w"))
f:write(([[
local m = model { path = "%s", name = "stories" }
return cluster {
  nodes = { node { name = "solo", listen = "ipc:///tmp/shoal-lua-test-%d.sock" } },
  gateway = { node = "solo", http = "127.0.0.1:8080" },
  replicas = { replica { model = m, stages = pipeline(m, { "solo" }) } },
}
]]):format(model, os.time()))
f:close()
local ce, cmsg = shoal.open { cluster = script, threads = 1 }
check(ce, "open on a one-process cluster script", tostring(cmsg))
if ce then
  local cgot, cfinal = {}, 0
  assert(ce:submit({ prompt_tokens = { 1 }, max_tokens = 16, ignore_eos = true }, {
    token = function(_, tids) for _, v in ipairs(tids) do cgot[#cgot + 1] = v end end,
    done = function() cfinal = cfinal + 1 end,
    error = function(code, m) cfinal = cfinal + 1; check(false, "cluster engine error", code, m) end }))
  local deadline2 = os.time() + 60
  while cfinal == 0 and os.time() <= deadline2 do assert(ce:poll(50)) end
  local csame = #cgot == 16
  for i = 1, 16 do if cgot[i] ~= expected[i] then csame = false end end
  check(csame, "cluster-script engine: greedy ids equal llama2.c's", table.concat(cgot, " "))
  -- its embedding is the in-process engine's (section 6b)
  local cv, cn = ce:embed(EMBED_WORDS)
  check(type(cv) == "table" and #cv == #embed_ref, "cluster-script engine: an embedding", tostring(cn))
  local cd = 0
  for i = 1, #embed_ref do cd = math.max(cd, math.abs((cv or {})[i] - embed_ref[i])) end
  check(cd <= 1e-5, "cluster-script engine: embedding equals the in-process engine's", cd)
  assert(ce:close())
end
os.remove(script)
-- A script that is not Lua: ELUA; one with a wrong value: refused, naming the script's line.
local bad_script = os.tmpname()
for _, case in ipairs({ { "return cluster {\n", "ELUA" }, { "return cluster { nodes = 3 }\n", nil } }) do
  f = assert(io.open(bad_script, "w"))
  f:write(case[1])
  f:close()
  local be, bmsg2, bcode2 = shoal.open { cluster = bad_script }
  eq(be, nil, "a broken cluster script is refused")
  if case[2] then eq(bcode2, case[2], "broken script code") end
  check(type(bmsg2) == "string" and bmsg2:find(bad_script, 1, true), "the message names the script",
    tostring(bmsg2))
end
os.remove(bad_script)

-- 9. Speculative decoding: a bad kind raises, a bad spec_k is the library's SH_EINVAL; with
-- spec = "ngram" the greedy ids from BOS are still llama2.c's, with speculative = false and
-- {n_max = 1} too; on a prompt that repeats itself {n_max = 1} gives the uncapped ids with one
-- draft in every drafting step (shoal_spec_* counters: drafted tokens == drafting steps, where
-- uncapped steps carry more); a bad speculative raises, an n_max out of range is the library's
-- SH_EINVAL.
local oks, smsg = pcall(shoal.open, { model = model, threads = 1, spec = "draft" })
check(not oks and smsg:find("off or ngram"), "open: bad spec named", tostring(smsg))
local ek, kmsg, ck = shoal.open { model = model, threads = 1, spec = "ngram", spec_k = 17 }
check(ek == nil and ck == "EINVAL" and tostring(kmsg):find("spec_k", 1, true),
  "open: spec_k 17 refused", tostring(kmsg))
do
  local es <close> = assert(shoal.open { model = model, threads = 1, spec = "ngram", spec_k = 4 })
  local function spec_counts()
    local m = assert(es:metrics())
    return tonumber(m:match("\nshoal_spec_drafts_total (%S+)")),
      tonumber(m:match("\nshoal_spec_draft_tokens_total (%S+)"))
  end
  local function run_spec(req)
    local sgot, sdone = {}, false
    assert(es:submit(req, {
      token = function(_, tids) for _, v in ipairs(tids) do sgot[#sgot + 1] = v end end,
      done = function() sdone = true end,
      error = function(code, m) sdone = true; check(false, "spec run error", code, m) end,
    }))
    local deadline = os.time() + 60
    while not sdone and os.time() <= deadline do assert(es:poll(50)) end
    return sgot
  end
  for _, speculative in ipairs({ true, false, { n_max = 1 } }) do
    local sgot = run_spec({ prompt_tokens = { 1 }, max_tokens = 32, ignore_eos = true,
      speculative = speculative })
    local ssame = #sgot == 32
    for i = 1, 32 do if sgot[i] ~= expected[i] then ssame = false end end
    local label = type(speculative) == "table" and "{n_max = 1}" or tostring(speculative)
    check(ssame, "spec ngram: greedy ids equal llama2.c's (speculative = " .. label .. ")",
      table.concat(sgot, " "))
  end
  local rep = "Once upon a time, there was a little girl named Lily. Once upon a time, there was " ..
    "a little girl named Lily. Once upon a time, there was"
  local ids, steps = {}, {}
  for i, speculative in ipairs({ true, { n_max = 1 } }) do
    -- How many drafts an uncapped step takes follows the measured step costs (under ASan once
    -- one a step; with another ASan test beside it, the clean-clone CI at 74f86ff saw one draft a
    -- step in 3 runs): its run is tried up to 10 times for a step that carries more.
    for _ = 1, i == 1 and 10 or 1 do
      local d0, t0 = spec_counts()
      ids[i] = run_spec({ prompt = rep, max_tokens = 48, speculative = speculative })
      local d1, t1 = spec_counts()
      steps[i] = { d1 - d0, t1 - t0 }
      if steps[i][2] > steps[i][1] then break end
    end
  end
  check(table.concat(ids[1], " ") == table.concat(ids[2], " "), "n_max = 1: the uncapped ids",
    table.concat(ids[2], " "))
  check(steps[1][2] > steps[1][1], "uncapped: some step carries more than one draft",
    steps[1][1], steps[1][2])
  check(steps[2][1] > 0 and steps[2][2] == steps[2][1], "n_max = 1: one draft a drafting step",
    steps[2][1], steps[2][2])
  for _, bad in ipairs({ "yes", 1, { n_min = 1 }, { n_max = 1.5 } }) do
    local okb, bmsg = pcall(es.submit, es, { prompt = "Hi", speculative = bad }, {})
    check(not okb and tostring(bmsg):find("speculative", 1, true) ~= nil or
      (not okb and tostring(bmsg):find("n_max", 1, true) ~= nil), "a bad speculative raises",
      tostring(bmsg))
  end
  local nid, nmsg, ncode = es:submit({ prompt = "Hi", speculative = { n_max = 17 } }, {})
  check(nid == nil and ncode == "EINVAL" and tostring(nmsg):find("spec_n_max", 1, true),
    "n_max 17 is the library's SH_EINVAL", tostring(nmsg))
end

-- 8. <close> variables and __gc close the engine too.
do
  local e2 <close> = assert(shoal.open { model = model, threads = 1 })
  assert(e2:submit({ prompt = "Hi", max_tokens = 100 }, {}))
end
local e3 = assert(shoal.open { model = model, threads = 1 })
assert(e3:submit({ prompt = "Hi", max_tokens = 100 }, { error = function() end }))
e3 = nil
collectgarbage()
collectgarbage()

if failures > 0 then
  io.stderr:write(failures, " check(s) failed\n")
  os.exit(1)
end
print("test_shoal_lua: all checks passed")
