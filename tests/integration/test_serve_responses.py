"""`shoal serve`'s Responses API (POST /v1/responses, issue 28) through the official `openai`
client (1.x), on the default model.

Needs the venv from scripts/test-venv.sh (openai and jsonschema; run through run_py.sh); skips
(77) without them unless SH_REQUIRE_OPENAI is set. Checks:
- plain: greedy output_text equals the chat completion's content for the same messages (with
  instructions as the system message), usage equals chat's, the object's shape, status
  "incomplete" exactly when chat's finish_reason is "length";
- streaming: the events come in a valid order (response.created, in_progress, item and part
  added, deltas, done events, response.completed last) with sequence numbers 0, 1, 2, ...; the
  deltas concatenate to the non-streamed text; the client's responses.stream() helper (which
  checks the order itself) returns the same text; the raw `event:` names equal each data's type;
- tools: tool_choice required and a named function, streamed and not, at temperature 1.0: every
  function_call's arguments validate against the tool's parameters with jsonschema (answers cut
  by max_output_tokens excepted); a round trip with the previous output and a
  function_call_output item continues the conversation;
- text.format json_schema at temperature 1.0: every completed output parses and validates;
- a stream cut by the drain deadline (--drain-timeout 2, SIGTERM mid-answer) ends with an
  `error` event and response.failed, in sequence, and the server exits 0;
- bad input: an unknown input item type, previous_response_id, store true, a built-in tool,
  malformed input: each a 400 naming the field, and the server keeps serving; /responses
  (without /v1) answers too.
"""

import concurrent.futures
import http.client
import json
import os
import signal
import sys
import threading
import time

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
N = int(os.environ.get("SH_RESPONSES_N", "8"))  # requests per sampled case

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 40},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
SEARCH = {
    "type": "object",
    "properties": {"query": {"type": "string", "maxLength": 60}},
    "required": ["query"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Get the weather for a city",
     "parameters": WEATHER, "strict": True},
    {"type": "function", "name": "web_search", "description": "Search the web",
     "parameters": SEARCH, "strict": True},
]
SCHEMAS = {"get_weather": WEATHER, "web_search": SEARCH}
ASK = "What is the weather like in Paris today?"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def check(cond, msg):
    if not cond:
        raise AssertionError(msg)


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def plain(c):
    for instr, q in ((None, "What is the capital of France?"),
                     ("Answer in one short sentence.", "Name a primary colour.")):
        msgs = ([{"role": "system", "content": instr}] if instr else []) + \
            [{"role": "user", "content": q}]
        ch = c.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=40)
        kw = {"instructions": instr} if instr else {}
        r = c.responses.create(model=MODEL, input=q, temperature=0, max_output_tokens=40, **kw)
        want = ch.choices[0].message.content
        check(r.output_text == want, f"output_text {r.output_text!r} != chat's {want!r}")
        check(r.id.startswith("resp_") and r.object == "response", f"id {r.id!r} {r.object!r}")
        check(r.model == MODEL, f"model {r.model!r}")
        cut = ch.choices[0].finish_reason == "length"
        check(r.status == ("incomplete" if cut else "completed"), f"status {r.status!r}")
        if cut:
            check(r.incomplete_details.reason == "max_output_tokens",
                  f"incomplete_details {r.incomplete_details}")
        check(r.usage.input_tokens == ch.usage.prompt_tokens,
              f"input_tokens {r.usage.input_tokens} != {ch.usage.prompt_tokens}")
        check(r.usage.output_tokens == ch.usage.completion_tokens,
              f"output_tokens {r.usage.output_tokens} != {ch.usage.completion_tokens}")
        check(r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens, "total")
        check(r.usage.output_tokens_details.reasoning_tokens == 0, "reasoning_tokens")
        check(r.usage.input_tokens_details.cached_tokens >= 0, "cached_tokens")
        check(r.instructions == instr, f"instructions {r.instructions!r}")
        check(r.temperature == 0 and r.tools == [] and r.tool_choice == "auto",
              f"echo: {r.temperature} {r.tools} {r.tool_choice}")
        msg = r.output[0]
        check(msg.type == "message" and msg.role == "assistant", f"item {msg}")
        check(msg.content[0].type == "output_text" and msg.content[0].annotations == [],
              f"part {msg.content[0]}")
    # the same as input items, with content parts and metadata echoed
    r = c.responses.create(model=MODEL, temperature=0, max_output_tokens=40,
                           metadata={"k": "v"},
                           input=[{"role": "user", "content": [
                               {"type": "input_text", "text": "What is the capital of France?"}]}])
    ch = c.chat.completions.create(model=MODEL, temperature=0, max_tokens=40, messages=[
        {"role": "user", "content": "What is the capital of France?"}])
    check(r.output_text == ch.choices[0].message.content, "input items differ from a string")
    check(r.metadata == {"k": "v"}, f"metadata {r.metadata}")


ORDER = ["response.created", "response.in_progress", "response.output_item.added",
         "response.content_part.added"]


def streaming(c, url):
    kw = dict(model=MODEL, input="Write one sentence about the sea.", temperature=0,
              max_output_tokens=48)
    r = c.responses.create(**kw)
    events = list(c.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    check([e.sequence_number for e in events] == list(range(len(events))),
          f"sequence numbers {[e.sequence_number for e in events]}")
    check(types[:4] == ORDER, f"first events {types[:4]}")
    last = "response.incomplete" if r.status == "incomplete" else "response.completed"
    tail = ["response.output_text.done", "response.content_part.done",
            "response.output_item.done", last]
    check(types[-4:] == tail, f"last events {types[-4:]}")
    mid = types[4:-4]
    check(mid and all(t == "response.output_text.delta" for t in mid), f"middle {set(mid)}")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    check(text == r.output_text, f"streamed {text!r} != {r.output_text!r}")
    check(events[-4].text == text, "output_text.done's text")
    final = events[-1].response
    check(final.output_text == text and final.status == r.status, "the final response")
    check(final.usage.output_tokens == r.usage.output_tokens, "streamed usage")
    item_id = events[2].item.id
    check(all(e.item_id == item_id for e in events if e.type == "response.output_text.delta"),
          "delta item ids")
    # the helper, which checks the order itself (1.109.1's get_final_response() takes only
    # response.completed; a cut answer ends with response.incomplete, as OpenAI's do)
    with c.responses.stream(**kw) as s:
        helper_text = "".join(e.delta for e in s if e.type == "response.output_text.delta")
        if r.status == "completed":
            check(s.get_final_response().output_text == r.output_text, "stream() final text")
    check(helper_text == r.output_text, "responses.stream() text")
    # raw: event names equal the data's type; /responses without /v1 answers too
    st, _, raw = su.request(url, "POST", "/responses", dict(stream=True, **kw))
    check(st == 200, f"status {st}")
    blocks = [b for b in raw.decode().split("\n\n") if b.strip()]
    check(len(blocks) == len(events), f"{len(blocks)} raw events, {len(events)} parsed")
    for b in blocks:
        lines = b.split("\n")
        check(lines[0].startswith("event: ") and lines[1].startswith("data: "), f"block {b!r}")
        check(json.loads(lines[1][6:])["type"] == lines[0][7:], f"event name in {b[:80]!r}")


def calls_of(r):
    return [o for o in r.output if o.type == "function_call"]


def read_calls(events):
    """The function calls of a streamed response, checked against the final one."""
    calls, final = {}, None
    for e in events:
        if e.type == "response.output_item.added" and e.item.type == "function_call":
            calls[e.output_index] = {"name": e.item.name, "call_id": e.item.call_id, "args": ""}
        elif e.type == "response.function_call_arguments.delta":
            calls[e.output_index]["args"] += e.delta
        elif e.type == "response.function_call_arguments.done":
            check(e.arguments == calls[e.output_index]["args"], "arguments.done")
        elif e.type in ("response.completed", "response.incomplete"):
            final = e.response
    check(final is not None, "no final event")
    fin = calls_of(final)
    check([(f.name, f.call_id, f.arguments) for f in fin] ==
          [(v["name"], v["call_id"], v["args"]) for _, v in sorted(calls.items())],
          "streamed calls differ from the final response's")
    return final


def each_at_once(one):
    """one(i) for i < N, the N requests sent at once (the server batches them; each is checked
    alone): one returns None (valid), "cut" (stopped by max_output_tokens) or a problem. Fails
    unless some answer was whole and every whole one was valid."""
    with concurrent.futures.ThreadPoolExecutor(N) as pool:
        got = list(pool.map(one, range(N)))
    bad = [g for g in got if g not in (None, "cut")]
    check(got.count("cut") < N, "every answer was cut by max_output_tokens")
    check(not bad, f"{len(bad)} of {N} invalid:\n" + "\n".join(bad[:5]))


def forced(c, seed, choice, stream, want_name=None):
    def one(i):
        kw = dict(model=MODEL, input=ASK, tools=TOOLS, tool_choice=choice, temperature=1.0,
                  max_output_tokens=120, parallel_tool_calls=False, extra_body={"seed": seed + i})
        try:
            r = read_calls(c.responses.create(stream=True, **kw)) if stream \
                else c.responses.create(**kw)
            if r.status == "incomplete":
                return "cut"
            check(r.status == "completed", f"status {r.status}")
            calls = calls_of(r)
            check(len(calls) == 1, f"{len(calls)} calls: {r.output}")
            check(not r.output_text.strip(), f"text {r.output_text!r} beside a forced call")
            f = calls[0]
            check(f.call_id.startswith("call_") and f.id.startswith("fc_"), f"ids {f}")
            check(f.name in SCHEMAS, f"unknown function {f.name!r}")
            if want_name:
                check(f.name == want_name, f"called {f.name}, want {want_name}")
            jsonschema.validate(json.loads(f.arguments), SCHEMAS[f.name])
            return None
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            return f"request {i}: {str(e)[:300]}"
    each_at_once(one)


def round_trip(c):
    r = c.responses.create(model=MODEL, input=ASK, tools=TOOLS, temperature=0,
                           tool_choice={"type": "function", "name": "get_weather"},
                           max_output_tokens=120)
    calls = calls_of(r)
    check(r.status == "completed" and len(calls) == 1, f"no call: {r.output}")
    items = [{"role": "user", "content": ASK}] + [o.model_dump() for o in r.output] + [
        {"type": "function_call_output", "call_id": calls[0].call_id,
         "output": json.dumps({"temperature": 21, "sky": "sunny"})}]
    r2 = c.responses.create(model=MODEL, input=items, tools=TOOLS, temperature=0,
                            max_output_tokens=48)
    check(r2.output_text.strip() or calls_of(r2), "empty answer after the tool output")
    check(r2.usage.input_tokens > r.usage.input_tokens,
          f"input_tokens {r2.usage.input_tokens} <= {r.usage.input_tokens}: the call and its "
          "output missing?")
    # streamed, with tool_choice none (text only)
    events = list(c.responses.create(model=MODEL, input=items, tools=TOOLS, tool_choice="none",
                                     temperature=0, max_output_tokens=48, stream=True))
    final = read_calls(events)
    check(not calls_of(final), "a call with tool_choice none")


def schema(c, stream):
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}

    def one(i):
        kw = dict(model=MODEL, input="Describe a fictional person as JSON.",
                  text={"format": fmt}, temperature=1.0, max_output_tokens=120,
                  extra_body={"seed": 500 + i})
        r = None
        try:
            if stream:
                events = list(c.responses.create(stream=True, **kw))
                r = events[-1].response
                text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
                check(text == r.output_text, "streamed text differs from the final")
            else:
                r = c.responses.create(**kw)
            if r.status == "incomplete":
                return "cut"
            check(r.text.format.type == "json_schema", f"text echo {r.text}")
            jsonschema.validate(json.loads(r.output_text), PERSON)
            return None
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            out = r.output_text[:200] if r is not None else ""
            return f"request {i}: {str(e)[:200]} in {out!r}"
    each_at_once(one)
    # json_object: a JSON object
    r = c.responses.create(model=MODEL, input="A JSON object about a cat.", temperature=0,
                           text={"format": {"type": "json_object"}}, max_output_tokens=60)
    if r.status == "completed":
        check(isinstance(json.loads(r.output_text), dict), f"not an object: {r.output_text!r}")


def bad_input(c, url):
    def expect_400(param, what, **kw):
        kw.setdefault("model", MODEL)
        kw.setdefault("input", "hi")
        try:
            c.responses.create(max_output_tokens=4, **kw)
        except openai.BadRequestError as e:
            body = e.body if isinstance(e.body, dict) else {}
            got = body.get("param") or body.get("error", {}).get("param")
            check(got == param, f"{what}: param {got!r}, want {param!r} ({e})")
            return
        raise AssertionError(f"{what}: no 400")

    expect_400("input[0].type", "unknown input item type",
               input=[{"type": "reasoning", "id": "rs_1", "summary": []}])
    expect_400("previous_response_id", "previous_response_id", previous_response_id="resp_1")
    expect_400("store", "store true", store=True)
    expect_400("tools[0].type", "a built-in tool", tools=[{"type": "web_search_preview"}])
    expect_400("input", "malformed input", input=openai.NOT_GIVEN, extra_body={"input": 42})
    expect_400("input[0].content[0]", "an image",
               input=[{"role": "user", "content": [
                   {"type": "input_image", "image_url": "http://x/y.png"}]}])
    expect_400("tools[0].parameters", "unsupported keyword",
               tools=[{"type": "function", "name": "f",
                       "parameters": {"type": "object", "if": {"type": "object"}}}])
    expect_400("tool_choice", "tool_choice naming no tool", tools=TOOLS,
               tool_choice={"type": "function", "name": "launch"})
    expect_400("text.format.schema", "a bad schema",
               text={"format": {"type": "json_schema", "name": "x",
                                "schema": {"type": "object", "if": {}}}})
    st, parsed, raw = su.post_json(url, "/v1/responses", b'{"model": "m", "input": [')
    check(st == 400 and "error" in (parsed or {}), f"malformed JSON: {st} {raw[:200]!r}")
    # still serving
    r = c.responses.create(model=MODEL, input="hi", max_output_tokens=4, temperature=0)
    check(r.status in ("completed", "incomplete"), f"not serving: {r.status}")


def read_sse(srv, body, out, started):
    """Reads a raw Responses stream into out as (event name, data dict); sets started at the
    first text delta (or at the end)."""
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=su.scaled(120))
    try:
        conn.request("POST", "/v1/responses", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        name = None
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.decode().rstrip("\r\n")
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                out.append((name, json.loads(line[6:])))
                if name == "response.output_text.delta":
                    started.set()
    finally:
        started.set()
        conn.close()


def drain_cut():
    srv = su.start("--drain-timeout", 2)
    try:
        events, started = [], threading.Event()
        body = {"model": MODEL, "input": "Tell me a long story.", "max_output_tokens": 4000,
                "ignore_eos": True, "stream": True}
        t = threading.Thread(target=read_sse, args=(srv, body, events, started), daemon=True)
        t.start()
        check(started.wait(60), "no text within 60 s")
        time.sleep(0.2)
        srv.proc.send_signal(signal.SIGTERM)
        t.join(30)
        check(not t.is_alive(), "the stream did not end after the drain deadline")
        problems = su.stop(srv, already_sent=True)
        check(not problems, "\n".join(problems))
        names = [n for n, _ in events]
        check([d["sequence_number"] for _, d in events] == list(range(len(events))),
              "sequence numbers")
        check(all(n == d["type"] for n, d in events), "event names")
        check(names[-2:] == ["error", "response.failed"], f"last events {names[-3:]}")
        err, failed = events[-2][1], events[-1][1]["response"]
        check(err["message"] and failed["status"] == "failed", f"{err} {failed['status']}")
        check(failed["error"]["code"] == "server_error" and failed["error"]["message"],
              f"response.failed error {failed['error']}")
        check("response.completed" not in names, "completed and failed")
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()


def main():
    r = su.Runner("serve_responses")
    try:
        with su.server(runner=r) as srv:
            c = client(srv.url)
            r.case("plain: greedy output_text equals chat's", plain, c)
            r.case("streaming: event order, deltas equal the text", streaming, c, srv.url)
            r.case("tool_choice required", forced, c, 1000, "required", False)
            r.case("tool_choice required, streamed", forced, c, 2000, "required", True)
            named = {"type": "function", "name": "web_search"}
            r.case("named function", forced, c, 3000, named, False, "web_search")
            r.case("named function, streamed", forced, c, 4000, named, True, "web_search")
            r.case("round trip with function_call_output", round_trip, c)
            r.case("text.format json_schema", schema, c, False)
            r.case("text.format json_schema, streamed", schema, c, True)
            r.case("bad input: 400s naming the field", bad_input, c, srv.url)
    except AssertionError as e:
        r.fail("server start", str(e))
    r.case("a stream cut by the drain deadline: error, response.failed", drain_cut)
    r.finish()


if __name__ == "__main__":
    main()
