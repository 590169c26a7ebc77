-- A Lua host using Shoal through the `shoal` module (require "shoal"), as a game server scripted
-- in Lua would: open an engine, ask for NPC lines with Lua callbacks, and poll from the host's
-- own loop. Run: lua5.4 host.lua MODEL   (LUA_CPATH must reach shoal.so, see README.md)
local shoal = require "shoal"

local model = arg[1] or os.getenv("SHOAL_MODEL")
if not model then
  io.stderr:write("usage: lua5.4 host.lua MODEL\n")
  os.exit(2)
end

local eng, err, code = shoal.open { model = model, threads = 1 }
if not eng then
  io.stderr:write("host.lua: cannot open ", model, ": ", err, " (", code, ")\n")
  os.exit(1)
end
local info = eng:info()
print(("host.lua: %s (%s, %s, %d layers) loaded; shoal %s"):format(
  info.name, info.arch, info.weight_type, info.n_layers, shoal.version))

local npcs = {
  { who = "a blacksmith", ask = "Can you repair my sword by tonight?" },
  { who = "a town guard", ask = "Why is the north gate closed?" },
  { who = "an innkeeper", ask = "What is the cheapest room?" },
}

local open_requests, failed = 0, 0
for i, npc in ipairs(npcs) do
  local parts = {}
  local req = {
    max_tokens = 24,
    temperature = 0.7,
    seed = i,
  }
  if info.has_chat_template then
    req.messages = {
      { role = "system", content = "You are " .. npc.who .. ". Answer in one short sentence." },
      { role = "user", content = npc.ask },
    }
  else
    req.prompt = npc.who .. " was asked: " .. npc.ask .. " The answer was:"
  end
  local id, serr = eng:submit(req, {
    token = function(text) parts[#parts + 1] = text end,
    done = function(d)
      open_requests = open_requests - 1
      print(("%s (%s, %d tokens): %s"):format(npc.who, d.finish, d.completion_tokens,
        (table.concat(parts):gsub("\n", " "))))
    end,
    error = function(ecode, msg)
      open_requests = open_requests - 1
      failed = failed + 1
      io.stderr:write(npc.who, ": ", ecode, ": ", msg, "\n")
    end,
  })
  if id then
    open_requests = open_requests + 1
  else
    failed = failed + 1
    io.stderr:write("submit failed: ", serr, "\n")
  end
end

-- The host's loop: a real game would do a tick's work here and poll with timeout 0.
local frames = 0
while open_requests > 0 do
  frames = frames + 1
  eng:poll(16)
end
print(("host.lua: all lines in %d frames; %d failed"):format(frames, failed))
eng:close()
os.exit(failed == 0 and 0 or 1)
