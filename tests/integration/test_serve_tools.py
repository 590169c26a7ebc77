"""`shoal serve` tool calls (issue 28) through the official `openai` client (1.x).

Needs the venv from scripts/test-venv.sh (openai and jsonschema; run through run_py.sh); skips
(77) without them unless SH_REQUIRE_OPENAI is set. The default model (SmolLM2, ChatML: the
Hermes <tool_call> syntax). Checks:
- tool_choice auto, not streamed and streamed: whatever the model writes comes back well formed
  (tool_calls with "call_" ids, type function, a known name, arguments a JSON object text;
  finish_reason tool_calls exactly when there are calls), and the greedy stream reassembles to
  the non-streamed message (content and calls);
- tool_choice required (one call, and with parallel_tool_calls) and a named function, streamed
  and not, at temperature 1.0: every call's arguments validate against its tool's parameters
  with jsonschema, 100% (answers cut by max_tokens excepted, finish_reason "length"); the named
  function is the one called. These are forced by the grammar the request carries, so they need
  the grammar wired into sampling;
- tool_choice none: no tool_calls;
- a round trip: the assistant's calls and a tool message sent back continue the conversation;
- bad input: a tool whose parameters are not a supported schema, tool_choice naming no tool,
  tool_choice without tools, a tool message without tool_call_id, bad tool_calls: each a 400
  naming the field, and the server keeps serving.
"""

import concurrent.futures
import json
import os
import sys

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402

try:
    import jsonschema  # noqa: E402
    import openai  # noqa: E402
except ImportError:
    if os.environ.get("SH_REQUIRE_OPENAI"):
        print("FAIL: openai or jsonschema is missing and SH_REQUIRE_OPENAI is set "
              "(run scripts/test-venv.sh)", flush=True)
        sys.exit(1)
    su.skip("the openai or jsonschema package is missing (run scripts/test-venv.sh)")

for var in ("NO_PROXY", "no_proxy"):
    parts = (os.environ.get(var), "127.0.0.1", "localhost", "::1")
    os.environ[var] = ",".join(x for x in parts if x)

MODEL = su.MODEL_NAME
N_FORCED = int(os.environ.get("SH_TOOLS_N", "10"))  # requests per forced case

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 40},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
SEARCH = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "maxLength": 60},
        "filters": {"type": "array", "items": {"type": "string", "maxLength": 12},
                    "maxItems": 3},
    },
    "required": ["query"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather",
                                      "description": "Get the current weather for a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "web_search", "description": "Search the web",
                                      "parameters": SEARCH}},
    {"type": "function", "function": {"name": "get_time",
                                      "description": "The current time (no arguments)"}},
]
SCHEMAS = {"get_weather": WEATHER, "web_search": SEARCH,
           "get_time": {"type": "object", "properties": {}, "additionalProperties": False}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(c, **kw):
    kw.setdefault("model", MODEL)
    kw.setdefault("messages", ASK)
    kw.setdefault("tools", TOOLS)
    return c.chat.completions.create(**kw)


def check(cond, msg):
    if not cond:
        raise AssertionError(msg)


def check_call(call, validate):
    """A well-formed call; with validate, its arguments validate against the tool's schema."""
    check(call.id.startswith("call_") and len(call.id) > 8, f"id {call.id!r}")
    check(call.type == "function", f"type {call.type!r}")
    name = call.function.name
    check(name in SCHEMAS, f"unknown function {name!r}")
    args = json.loads(call.function.arguments)
    check(isinstance(args, dict), f"arguments {call.function.arguments!r} is not an object")
    if validate:
        jsonschema.validate(args, SCHEMAS[name])
    return name, args


def check_message(msg, finish, validate=False):
    """Returns [(name, args)] of a non-streamed choice, checking its shape."""
    calls = msg.tool_calls or []
    check(finish in ("stop", "length", "tool_calls"), f"finish_reason {finish!r}")
    if calls:
        check(finish == "tool_calls", f"calls made, finish_reason {finish!r}")
        ids = [c.id for c in calls]
        check(len(set(ids)) == len(ids), f"ids repeat: {ids}")
    else:
        check(finish != "tool_calls", "finish_reason tool_calls without calls")
        check(isinstance(msg.content, str), f"content {msg.content!r} without calls")
    return [check_call(c, validate) for c in calls]


def read_stream(stream):
    """Reassembles a streamed chat: (content, [(id, name, arguments)], finish_reason)."""
    content, calls, finish = "", {}, None
    for ch in stream:
        for choice in ch.choices:
            d = choice.delta
            if d and d.content:
                content += d.content
            for tc in (d.tool_calls or []) if d else []:
                slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                if tc.id:
                    check(slot["id"] is None, f"call {tc.index} got a second id")
                    slot["id"] = tc.id
                    check(tc.type == "function", f"delta type {tc.type!r}")
                if tc.function and tc.function.name:
                    slot["name"] += tc.function.name
                if tc.function and tc.function.arguments:
                    slot["arguments"] += tc.function.arguments
            if choice.finish_reason is not None:
                check(finish is None, "two finish_reasons")
                finish = choice.finish_reason
    check(sorted(calls) == list(range(len(calls))), f"call indexes {sorted(calls)}")
    return content, [(calls[i]["id"], calls[i]["name"], calls[i]["arguments"])
                     for i in range(len(calls))], finish


def auto(c):
    r = chat(c, temperature=0, max_tokens=96)
    ch = r.choices[0]
    got = check_message(ch.message, ch.finish_reason)
    content, calls, finish = read_stream(chat(c, temperature=0, max_tokens=96, stream=True))
    check(finish == ch.finish_reason, f"streamed finish {finish!r} != {ch.finish_reason!r}")
    check([(n, json.loads(a)) for _, n, a in calls] == got,
          f"streamed calls {calls} != {got}")
    check(content.strip() == (ch.message.content or ""),
          f"streamed content {content!r} != {ch.message.content!r}")
    for i, n, a in calls:
        check(i.startswith("call_"), f"streamed id {i!r}")
    su.log(f"auto: {len(got)} call(s), content {(ch.message.content or '')[:60]!r}")


def forced(c, seed, choice, parallel, stream, want_name=None):
    """N_FORCED requests sent at once (the server batches them; each is checked alone)."""
    def one(i):
        kw = dict(temperature=1.0, max_tokens=160, tool_choice=choice, seed=seed + i)
        if parallel is not None:
            kw["parallel_tool_calls"] = parallel
        try:
            if stream:
                content, calls, finish = read_stream(chat(c, stream=True, **kw))
                if finish == "length":
                    return "cut"
                check(finish == "tool_calls", f"finish_reason {finish!r}, content {content!r}")
                check(not content.strip(), f"content {content!r} beside a forced call")
                names = []
                for cid, name, args in calls:
                    check(cid.startswith("call_"), f"id {cid!r}")
                    check(name in SCHEMAS, f"unknown function {name!r}")
                    jsonschema.validate(json.loads(args), SCHEMAS[name])
                    names.append(name)
            else:
                r = chat(c, **kw)
                ch = r.choices[0]
                if ch.finish_reason == "length":
                    return "cut"
                check(ch.finish_reason == "tool_calls",
                      f"finish_reason {ch.finish_reason!r}, content {ch.message.content!r}")
                check(ch.message.content is None, f"content {ch.message.content!r}")
                names = [n for n, _ in check_message(ch.message, ch.finish_reason, True)]
            check(len(names) >= 1, "no call")
            if parallel is False or want_name:
                check(len(names) == 1, f"{len(names)} calls, want 1")
            if want_name:
                check(names == [want_name], f"called {names}, want {want_name}")
            return None
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            return f"request {i}: {str(e)[:300]}"

    with concurrent.futures.ThreadPoolExecutor(N_FORCED) as pool:
        got = list(pool.map(one, range(N_FORCED)))
    cut = got.count("cut")
    bad = [g for g in got if g not in (None, "cut")]
    check(cut < N_FORCED, "every answer was cut by max_tokens")
    check(not bad, f"{len(bad)} of {N_FORCED} invalid:\n" + "\n".join(bad[:5]))


def none(c):
    r = chat(c, temperature=0, max_tokens=48, tool_choice="none")
    ch = r.choices[0]
    check(not ch.message.tool_calls, f"tool_calls with tool_choice none: {ch.message.tool_calls}")
    check(ch.finish_reason in ("stop", "length"), f"finish_reason {ch.finish_reason!r}")
    check(isinstance(ch.message.content, str), "no content")


def round_trip(c):
    # The assistant's call as the client would send it back, then the tool's answer.
    call = {"id": "call_abc123", "type": "function",
            "function": {"name": "get_weather",
                         "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}
    msgs = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_abc123",
         "content": json.dumps({"temperature": 21, "sky": "sunny"})},
    ]
    r = chat(c, messages=msgs, temperature=0, max_tokens=48)
    ch = r.choices[0]
    check_message(ch.message, ch.finish_reason)
    check(ch.message.content or ch.message.tool_calls, "empty answer after the tool message")
    check(r.usage.prompt_tokens > 100, f"prompt_tokens {r.usage.prompt_tokens}: tools missing?")
    # The same conversation streamed, and with an assistant text beside its call.
    msgs[1] = {"role": "assistant", "content": "Let me look.", "tool_calls": [call]}
    content, calls, finish = read_stream(chat(c, messages=msgs, temperature=0, max_tokens=48,
                                              stream=True))
    check(finish in ("stop", "length", "tool_calls"), f"finish {finish!r}")
    check(content or calls, "empty streamed answer")


def bad_input(c):
    def expect_400(param, what, **kw):
        try:
            chat(c, max_tokens=4, **kw)
        except openai.BadRequestError as e:
            body = e.body if isinstance(e.body, dict) else {}
            got = body.get("param") or body.get("error", {}).get("param")
            check(got == param, f"{what}: param {got!r}, want {param!r} ({e})")
            return
        raise AssertionError(f"{what}: no 400")

    expect_400("tools[0].function.parameters", "unsupported keyword",
               tools=[{"type": "function", "function": {
                   "name": "calc", "parameters": {"type": "object", "if": {"type": "object"}}}}])
    expect_400("tools[0].function.parameters", "parameters not an object",
               tools=[{"type": "function", "function": {"name": "calc", "parameters": "x"}}])
    expect_400("tool_choice", "tool_choice naming no tool",
               tool_choice={"type": "function", "function": {"name": "launch"}})
    expect_400("tool_choice", "tool_choice without tools", tools=openai.NOT_GIVEN,
               tool_choice="required")
    expect_400("tool_choice", "tool_choice unknown string", tool_choice="sometimes")
    expect_400("tools[0].function.name", "bad name",
               tools=[{"type": "function", "function": {"name": "has space"}}])
    expect_400("messages[1].tool_call_id", "tool message without id",
               messages=ASK + [{"role": "tool", "content": "21"}])
    expect_400("messages[1].tool_calls[0].function", "arguments not a string",
               messages=ASK + [{"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "x"}}}]}])
    expect_400("parallel_tool_calls", "parallel_tool_calls not a boolean",
               extra_body={"parallel_tool_calls": "yes"})
    # Still serving.
    r = chat(c, max_tokens=4, temperature=0)
    check(r.choices[0].finish_reason in ("stop", "length", "tool_calls"), "not serving")


def main():
    r = su.Runner("serve_tools")
    try:
        with su.server(runner=r) as srv:
            c = client(srv.url)
            r.case("auto, streamed and not", auto, c)
            r.case("tool_choice none", none, c)
            r.case("round trip with a tool message", round_trip, c)
            r.case("bad input: 400s naming the field", bad_input, c)
            r.case("required, one call", forced, c, 1000, "required", False, False)
            r.case("required, parallel, streamed", forced, c, 2000, "required", True, True)
            named = {"type": "function", "function": {"name": "get_weather"}}
            r.case("named function", forced, c, 3000, named, None, False, "get_weather")
            named = {"type": "function", "function": {"name": "web_search"}}
            r.case("named function, streamed", forced, c, 4000, named, None, True, "web_search")
    except AssertionError as e:
        r.fail("server start", str(e))
    r.finish()


if __name__ == "__main__":
    main()
