-- Tool calls through the Lua module `shoal` on the default model (SmolLM2, ChatML: the Hermes
-- tool syntax), run by the system lua5.4 (ctest test_lua_module_tools). tool_choice "required"
-- gives a call of the weather tool whose arguments follow its schema (finish "tool_calls", done's
-- info.tool_calls JSON text, no call text in token callbacks); a round trip with the call as the
-- assistant's tool_calls and a role "tool" message continues the chat; bad fields are the
-- library's SH_EINVAL naming them. JSON is checked with Lua patterns (no JSON library here).
-- Usage: lua5.4 test_shoal_lua_tools.lua MODEL.gguf
local shoal = require "shoal"

local model = arg[1]
assert(model, "usage: test_shoal_lua_tools.lua MODEL")
if model:sub(1, 1) ~= "/" then model = os.getenv("PWD") .. "/" .. model end
local f = io.open(model, "rb")
if not f then
  print("skipped: " .. model .. " is absent (scripts/get-model.sh)")
  os.exit(77)
end
f:close()

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

local eng = assert(shoal.open { model = model, threads = 2 })
local function poll_until(fn, seconds)
  local deadline = os.time() + seconds
  while not fn() do
    assert(eng:poll(50))
    if os.time() > deadline then return false end
  end
  return true
end

local tools = '[{"type":"function","function":{"name":"get_weather","description":' ..
  '"The current weather in a city","parameters":{"type":"object","properties":{"city":' ..
  '{"type":"string","maxLength":24},"unit":{"type":"string","enum":["celsius","fahrenheit"]}},' ..
  '"required":["city","unit"]}}}]'
local question = { role = "user", content = "What is the weather like in Paris? Use celsius." }

-- Runs one request to its end: its streamed text and done's info (or the error).
local function run(req)
  local text, info, err = "", nil, nil
  local id, msg, code = eng:submit(req, {
    token = function(t) text = text .. t end,
    done = function(i) info = i end,
    error = function(c, m) err = c .. ": " .. m end })
  if not id then return nil, nil, code .. ": " .. msg end
  check(poll_until(function() return info ~= nil or err ~= nil end, 120), "request finished")
  return text, info, err
end

-- 1. tool_choice "required", one call.
local text, info, err = run({ messages = { question }, tools = tools, tool_choice = "required",
                              parallel_tool_calls = false, max_tokens = 160 })
check(info, "required: done", tostring(err))
info = info or {}
eq(info.finish, "tool_calls", "required: finish")
local calls = info.tool_calls or ""
check(not text:find("<tool_call>", 1, true), "no call text in the token callbacks", text)
local call_id = calls:match('"id":"(call_[0-9a-f]+)"')
check(call_id, "a call id", calls)
check(calls:match('"name":"get_weather"'), "the weather tool is called", calls)
local args = calls:match('"arguments":"(.-)"}}%]$') or ""
args = args:gsub('\\"', '"')
check(args:match('^{%s*"city"%s*:%s*"[^"]+"%s*,%s*"unit"%s*:%s*"celsius"%s*}$') or
  args:match('^{%s*"city"%s*:%s*"[^"]+"%s*,%s*"unit"%s*:%s*"fahrenheit"%s*}$'),
  "the arguments follow the schema", args)
local _, ncalls = calls:gsub('"type":"function"', "")
eq(ncalls, 1, "parallel_tool_calls = false: one call")

-- 2. The round trip: the call and the tool's answer go back; the chat goes on.
local text2, info2, err2 = run({ messages = {
    question,
    { role = "assistant", tool_calls = calls },
    { role = "tool", tool_call_id = call_id, content = '{"temperature": 21}' } },
  tools = tools, max_tokens = 32 })
check(info2, "round trip: done", tostring(err2))
info2 = info2 or {}
check(info2.completion_tokens and info2.completion_tokens > 0, "round trip: tokens generated")
check((info2.prompt_tokens or 0) > (info.prompt_tokens or 0) + 10,
  "round trip: the call and the answer are in the prompt", tostring(info2.prompt_tokens))
check(info2.finish == "stop" or info2.finish == "length" or info2.finish == "tool_calls",
  "round trip: finish", tostring(info2.finish))
-- The same chat given as messages_json gives the same prompt.
local mj = '[{"role":"user","content":"What is the weather like in Paris? Use celsius."},' ..
  '{"role":"assistant","content":null,"tool_calls":' .. calls .. '},' ..
  '{"role":"tool","tool_call_id":"' .. call_id .. '","content":"{\\"temperature\\": 21}"}]'
local text3, info3 = run({ messages_json = mj, tools = tools, max_tokens = 32 })
eq((info3 or {}).prompt_tokens, info2.prompt_tokens, "messages_json: the same prompt")
eq(text3, text2, "messages_json: the same greedy text")

-- The same request with tools, tool_choice and tool_calls as Lua tables (written as JSON by the
-- module): the same prompt, the same call.
local tools_t = { { type = "function", ["function"] = { name = "get_weather",
  description = "The current weather in a city",
  parameters = { type = "object", properties = {
    city = { type = "string", maxLength = 24 },
    unit = { type = "string", enum = { "celsius", "fahrenheit" } } },
    required = { "city", "unit" } } } } }
-- The module writes object keys in byte order: the same tools as JSON text in that order.
local tools_sorted = '[{"function":{"description":"The current weather in a city","name":' ..
  '"get_weather","parameters":{"properties":{"city":{"maxLength":24,"type":"string"},"unit":' ..
  '{"enum":["celsius","fahrenheit"],"type":"string"}},"required":["city","unit"],"type":' ..
  '"object"}},"type":"function"}]'
local named = '{"type":"function","function":{"name":"get_weather"}}'
local _, info4 = run({ messages = { question }, tools = tools_t,
                       tool_choice = { type = "function", ["function"] = { name = "get_weather" } },
                       max_tokens = 160 })
local _, info4s = run({ messages = { question }, tools = tools_sorted, tool_choice = named,
                        max_tokens = 160 })
info4, info4s = info4 or {}, info4s or {}
eq(info4.prompt_tokens, info4s.prompt_tokens, "tools as a table: the same prompt as its JSON text")
eq(info4.finish, "tool_calls", "tools as a table: finish")
local function no_id(c) return (c or ""):gsub('"id":"call_[0-9a-f]+"', "") end
eq(no_id(info4.tool_calls), no_id(info4s.tool_calls), "tools as a table: the same call")
local t5, info5 = run({ messages = { question,
    { role = "assistant", tool_calls = { { id = call_id, type = "function",
      ["function"] = { name = "get_weather", arguments = '{"city":"Paris","unit":"celsius"}' } } } },
    { role = "tool", tool_call_id = call_id, content = '{"temperature": 21}' } },
  tools = tools_t, max_tokens = 32 })
check(info5 and info5.prompt_tokens > info.prompt_tokens + 10, "tool_calls as a table: round trip",
  tostring(info5 and info5.prompt_tokens))

-- 3. Bad fields: the library's SH_EINVAL naming them; nothing pending.
local bad = {
  { { messages = { question }, tools = "[{" }, "tools is not JSON" },
  { { messages = { question }, tools = tools,
      tool_choice = '{"type":"function","function":{"name":"nope"}}' }, "nope" },
  { { messages = { question }, tools = tools, tool_choice = "sometimes" }, "tool_choice" },
  { { prompt = "Hi", tools = tools }, "need a chat" },
  { { messages = { { role = "assistant", tool_calls = "[{]" } } }, "not JSON" },
}
for i, b in ipairs(bad) do
  local id, msg, code = eng:submit(b[1], {})
  check(id == nil and code == "EINVAL" and tostring(msg):find(b[2], 1, true),
    "bad case " .. i, tostring(msg))
end
check(not pcall(eng.submit, eng, { messages = { question }, tools = 5 }, {}),
  "tools not a string or table raises")
local okm, mmsg = pcall(eng.submit, eng, { messages = { question }, tools = { 1, x = 2 } }, {})
check(not okm and tostring(mmsg):find("tools", 1, true), "a table mixing items and keys raises",
  tostring(mmsg))
local okf, fmsg = pcall(eng.submit, eng, { messages = { question }, tools = { { f = print } } }, {})
check(not okf and tostring(fmsg):find("function", 1, true), "a function in tools raises",
  tostring(fmsg))
local cyc = {}
cyc.self = cyc
local okc, cmsg = pcall(eng.submit, eng, { messages = { question }, tools = cyc }, {})
check(not okc and tostring(cmsg):find("deeper", 1, true), "a cycle raises", tostring(cmsg))
check(not pcall(eng.submit, eng, { messages = { { role = "tool", tool_call_id = 7,
  content = "x" } } }, {}), "tool_call_id not a string raises")
eq(eng:pending(), 0, "refused requests are not pending")
assert(eng:close())

if failures > 0 then
  io.stderr:write(failures, " check(s) failed\n")
  os.exit(1)
end
print("test_shoal_lua_tools: all checks passed")
