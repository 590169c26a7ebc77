"""`shoal serve` and what OpenAI and llama.cpp clients send beside the core endpoints (issue 28).

Real server processes, raw HTTP (stdlib only). Checks:
- the OpenAI paths without /v1 (/chat/completions, /completions, /models) answer as their /v1/
  forms, behind the API keys like them;
- system_fingerprint in chat and completion responses and every stream chunk: the same string
  for every request to a server, "shoal-<version>-<hash>";
- usage.prompt_tokens_details.cached_tokens: 0 for a first prompt, most of the prompt when the
  same long prompt comes again (prefix cache); in the final stream chunk with
  stream_options.include_usage too;
- CORS with --cors-origin: a preflight OPTIONS is 204 before the keys with the Allow headers, an
  allowed Origin gets Access-Control-Allow-Origin and Vary on responses, errors and SSE; an
  Origin not listed gets none; without the flag OPTIONS is 405 (401 with keys) and no header;
- POST /tokenize and /detokenize (llama.cpp's fields): ids equal `shoal tokenize`, with_pieces
  strings or byte arrays, round trip, 400s naming the field;
- /v1/models: max_model_len, meta.n_ctx_train, capabilities;
- response_format: an unknown type is a 400 naming response_format.type; json_object and
  json_schema are accepted.
"""

import json
import os
import subprocess
import sys

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402

MODEL = su.MODEL_NAME
ORIGIN = "http://page.example:8123"
KEY = "sk-compat-test"
AUTH = {"Authorization": "Bearer " + KEY}
LONG = ("You are a helpful assistant. Here is some context that repeats across requests, "
        "long enough to fill several KV blocks of the prefix cache. " * 6)


def chat_body(**kw):
    b = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4,
         "temperature": 0}
    b.update(kw)
    return b


def check(cond, msg):
    if not cond:
        raise AssertionError(msg)


# ---- path aliases ---------------------------------------------------------------------------

def aliases(url):
    for p in ("/models", "/v1/models"):
        st, _, data = su.get(url, p)
        check(st == 200, f"GET {p}: {st} {data[:200]!r}")
        check(json.loads(data)["data"][0]["id"] == MODEL, f"GET {p}: {data[:200]!r}")
    a = su.post_json(url, "/chat/completions", chat_body())
    b = su.post_json(url, "/v1/chat/completions", chat_body())
    check(a[0] == 200 and b[0] == 200, f"chat: {a[0]} {a[2][:200]!r} / {b[0]}")
    check(a[1]["object"] == "chat.completion", repr(a[1]))
    check(a[1]["choices"][0]["message"]["content"] == b[1]["choices"][0]["message"]["content"],
          "greedy chat differs between /chat/completions and /v1/chat/completions")
    c = {"model": MODEL, "prompt": "The sky is", "max_tokens": 4, "temperature": 0}
    a = su.post_json(url, "/completions", c)
    b = su.post_json(url, "/v1/completions", c)
    check(a[0] == 200 and a[1]["object"] == "text_completion", f"{a[0]} {a[2][:200]!r}")
    check(a[1]["choices"][0]["text"] == b[1]["choices"][0]["text"], "greedy completion differs")
    st, _, ev = su.stream(url, "/chat/completions", chat_body(stream=True))
    check(st == 200 and ev[-1] == "[DONE]", f"stream on the alias: {st} {ev[:2]}")
    # Not every path gains an alias: an unknown one stays 404, and a bad one stays bad.
    st, parsed, raw = su.post_json(url, "/chat/completion", chat_body())
    check(st == 404, f"/chat/completion: {st} {raw[:200]!r}")
    st, parsed, raw = su.post_json(url, "/completions", {"model": MODEL})
    check(st == 400, f"/completions without a prompt: {st} {raw[:200]!r}")


def aliases_keyed(url):
    st, _, _ = su.request(url, "GET", "/models")
    check(st == 401, f"GET /models without a key: {st}")
    st, _, _ = su.request(url, "GET", "/models", headers=AUTH)
    check(st == 200, f"GET /models with a key: {st}")
    st, _, _ = su.request(url, "POST", "/chat/completions", chat_body())
    check(st == 401, f"POST /chat/completions without a key: {st}")


# ---- system_fingerprint ---------------------------------------------------------------------

def fingerprint(url):
    st, a, raw = su.post_json(url, "/v1/chat/completions", chat_body())
    check(st == 200, f"{st} {raw[:200]!r}")
    fp = a.get("system_fingerprint")
    check(isinstance(fp, str) and fp.startswith("shoal-") and len(fp) > 12, f"chat: {fp!r}")
    st, b, _ = su.post_json(url, "/v1/completions",
                            {"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    check(b.get("system_fingerprint") == fp, f"completion: {b.get('system_fingerprint')!r}")
    st, _, ev = su.stream(url, "/v1/chat/completions",
                          chat_body(stream=True, stream_options={"include_usage": True}))
    chunks = [e for e in ev if e != "[DONE]"]
    check(chunks and all(c.get("system_fingerprint") == fp for c in chunks),
          f"stream chunks: {[c.get('system_fingerprint') for c in chunks]}")
    return fp


# ---- cached_tokens --------------------------------------------------------------------------

def cached_of(u):
    d = u.get("prompt_tokens_details")
    check(isinstance(d, dict) and isinstance(d.get("cached_tokens"), int), f"usage: {u}")
    return d["cached_tokens"]


def cached_tokens(url):
    body = {"model": MODEL, "prompt": LONG, "max_tokens": 2, "temperature": 0}
    st, a, raw = su.post_json(url, "/v1/completions", body)
    check(st == 200, f"{st} {raw[:200]!r}")
    n_prompt = a["usage"]["prompt_tokens"]
    first = cached_of(a["usage"])
    check(first == 0, f"first request: cached_tokens {first}")
    su.wait_idle(url)
    st, b, _ = su.post_json(url, "/v1/completions", body)
    second = cached_of(b["usage"])
    check(n_prompt > 64 and n_prompt // 2 <= second < n_prompt,
          f"repeat: cached_tokens {second} of {n_prompt}")
    su.wait_idle(url)
    st, _, ev = su.stream(url, "/v1/completions",
                          dict(body, stream=True, stream_options={"include_usage": True}))
    usage = [e["usage"] for e in ev if e != "[DONE]" and e.get("usage")]
    check(len(usage) == 1 and cached_of(usage[0]) == second,
          f"stream usage chunk: {usage} (non-stream said {second})")


# ---- CORS -----------------------------------------------------------------------------------

def preflight(url, origin, path="/v1/chat/completions"):
    return su.request(url, "OPTIONS", path, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"})


def cors_on(url):
    for path in ("/v1/chat/completions", "/chat/completions", "/v1/models", "/tokenize"):
        st, h, data = preflight(url, ORIGIN, path)
        check(st == 204, f"preflight {path} with keys set and no key: {st} {data[:200]!r}")
        check(h.get("access-control-allow-origin") == ORIGIN, f"{path}: {h}")
        check("POST" in h.get("access-control-allow-methods", ""), f"{path}: {h}")
        allow_h = h.get("access-control-allow-headers", "").lower()
        check("authorization" in allow_h and "x-stainless-os" in allow_h, f"{path}: {h}")
        check(int(h.get("access-control-max-age", "0")) > 0, f"{path}: {h}")
        check("content-length" not in h and data == b"", f"204 with a body: {h} {data!r}")
    # The actual request: ACAO and Vary on success, on an error, on a 401 and on SSE.
    hdr = dict(AUTH, Origin=ORIGIN)
    st, h, _ = su.request(url, "POST", "/v1/chat/completions", chat_body(), headers=hdr)
    check(st == 200 and h.get("access-control-allow-origin") == ORIGIN, f"{st} {h}")
    check("origin" in h.get("vary", "").lower(), f"Vary: {h}")
    st, h, _ = su.request(url, "POST", "/v1/chat/completions", {"model": MODEL}, headers=hdr)
    check(st == 400 and h.get("access-control-allow-origin") == ORIGIN, f"error: {st} {h}")
    st, h, _ = su.request(url, "POST", "/v1/chat/completions", chat_body(),
                          headers={"Origin": ORIGIN})
    check(st == 401 and h.get("access-control-allow-origin") == ORIGIN, f"401: {st} {h}")
    st, h, data = su.request(url, "POST", "/v1/chat/completions", chat_body(stream=True),
                             headers=hdr)
    check(st == 200 and h.get("access-control-allow-origin") == ORIGIN
          and b"[DONE]" in data, f"SSE: {st} {h}")
    # An origin not listed: no ACAO, on the preflight or the request.
    st, h, _ = preflight(url, "http://evil.example")
    check("access-control-allow-origin" not in h, f"other origin's preflight: {st} {h}")
    st, h, _ = su.request(url, "POST", "/v1/chat/completions", chat_body(),
                          headers=dict(AUTH, Origin="http://evil.example"))
    check(st == 200 and "access-control-allow-origin" not in h, f"other origin: {st} {h}")
    # Still a server: OPTIONS on an unknown path is 404.
    st, h, _ = preflight(url, ORIGIN, "/v1/nothing")
    check(st == 404, f"OPTIONS /v1/nothing: {st}")


def cors_star(url):
    st, h, _ = preflight(url, "https://anything.example")
    check(st == 204 and h.get("access-control-allow-origin") == "*", f"{st} {h}")


def cors_off(url, keyed):
    st, h, _ = preflight(url, ORIGIN)
    want = 401 if keyed else 405
    check(st == want, f"OPTIONS without --cors-origin: {st}, want {want}")
    check("access-control-allow-origin" not in h, f"ACAO without --cors-origin: {h}")
    st, h, _ = su.request(url, "POST", "/v1/chat/completions", chat_body(),
                          headers=dict(AUTH, Origin=ORIGIN))
    check("access-control-allow-origin" not in h, f"ACAO without --cors-origin: {h}")


def cors_bad_flag():
    for bad in ("example.com", "http://x.example/path", "ftp://x", ""):
        p = subprocess.run([su.shoal_binary(), "serve", "-m", su.MODEL, "--cors-origin", bad],
                           capture_output=True, text=True, timeout=su.scaled(60))
        check(p.returncode == 2 and "--cors-origin" in p.stderr,
              f"--cors-origin {bad!r}: exit {p.returncode} {p.stderr[-300:]!r}")


# ---- tokenize -------------------------------------------------------------------------------

TEXTS = ["Hello, world!", "  leading spaces and\ttabs\n", "naïve café — 東京 🚀",
         "<|im_start|>user\nhi<|im_end|>"]


def shoal_tokenize(text, *flags):
    p = subprocess.run([su.shoal_binary(), "tokenize", "-m", su.MODEL, "-p", text, *flags],
                       capture_output=True, text=True, timeout=su.scaled(60))
    check(p.returncode == 0, f"shoal tokenize: {p.stderr}")
    return [int(x) for x in p.stdout.split()]


def tokenize(url):
    for t in TEXTS:
        st, a, raw = su.post_json(url, "/tokenize", {"content": t})
        check(st == 200, f"{st} {raw[:200]!r}")
        want = shoal_tokenize(t, "--special", "--no-bos")
        check(a["tokens"] == want, f"{t!r}: /tokenize {a['tokens']} != shoal tokenize {want}")
        st, a, _ = su.post_json(url, "/tokenize", {"content": t, "add_special": True})
        want = shoal_tokenize(t, "--special")
        check(a["tokens"] == want, f"{t!r} add_special: {a['tokens']} != {want}")
        st, a, _ = su.post_json(url, "/tokenize", {"content": t, "parse_special": False})
        want = shoal_tokenize(t, "--no-bos")
        check(a["tokens"] == want, f"{t!r} parse_special false: {a['tokens']} != {want}")
        st, d, raw = su.post_json(url, "/detokenize", {"tokens": want})
        check(st == 200 and d["content"] == t, f"round trip {t!r}: {st} {raw[:200]!r}")
    st, a, _ = su.post_json(url, "/tokenize", {"content": "<|im_start|>", "parse_special": True})
    check(len(a["tokens"]) == 1, f"special token: {a}")
    st, a, _ = su.post_json(url, "/tokenize", {"content": TEXTS[2], "with_pieces": True})
    check(st == 200, f"{st}")
    pieces = a["tokens"]
    check(all(set(p) == {"id", "piece"} for p in pieces), f"with_pieces: {pieces}")
    raw = b""
    for p in pieces:
        pc = p["piece"]
        check(isinstance(pc, str) or (isinstance(pc, list) and all(0 <= x < 256 for x in pc)),
              f"piece {pc!r}")
        raw += pc.encode() if isinstance(pc, str) else bytes(pc)
    check(raw.decode() == TEXTS[2], f"pieces join to {raw!r}")
    # An emoji split across byte tokens: some piece must be a byte array.
    check(any(isinstance(p["piece"], list) for p in pieces), f"no byte-array piece: {pieces}")
    ids = [p["id"] for p in pieces]
    st, d, _ = su.post_json(url, "/detokenize", {"tokens": ids[:-1]})
    check(st == 200 and isinstance(d["content"], str), f"a cut character: {st} {d}")


def tokenize_bad(url):
    cases = [("/tokenize", {}, "content"), ("/tokenize", {"content": 5}, "content"),
             ("/tokenize", {"content": "x", "with_pieces": "yes"}, "with_pieces"),
             ("/tokenize", {"content": "x", "add_special": 1}, "add_special"),
             ("/tokenize", {"content": "x" * ((1 << 20) + 1)}, "content"),
             ("/detokenize", {}, "tokens"), ("/detokenize", {"tokens": "1 2"}, "tokens"),
             ("/detokenize", {"tokens": [1, "2"]}, "tokens[1]"),
             ("/detokenize", {"tokens": [1, 2.5]}, "tokens[1]"),
             ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
             ("/detokenize", {"tokens": [0, 10 ** 9]}, "tokens[1]"),
             ("/detokenize", {"tokens": [0] * 70000}, "tokens")]
    for path, body, param in cases:
        st, parsed, raw = su.post_json(url, path, body)
        check(st == 400 and parsed and parsed["error"]["param"] == param,
              f"{path} {str(body)[:60]}: {st} {raw[:200]!r} (want 400 naming {param})")
    st, parsed, raw = su.post_json(url, "/tokenize", "{not json")
    check(st == 400, f"malformed: {st}")
    st, parsed, raw = su.post_json(url, "/tokenize", {"content": "x", "model": "nope"})
    check(st == 404, f"unknown model: {st} {raw[:200]!r}")
    st, _, _ = su.get(url, "/tokenize")
    check(st == 405, f"GET /tokenize: {st}")
    st, a, _ = su.post_json(url, "/tokenize", {"content": ""})
    check(st == 200 and a["tokens"] == [], f"empty content: {st} {a}")
    # Large content (under the 1 MiB bound) is tokenized on the worker pool and answered whole.
    big = "lorem ipsum dolor " * 50000
    st, a, raw = su.post_json(url, "/tokenize", {"content": big})
    check(st == 200 and len(a["tokens"]) > 50000, f"900 KB content: {st} {raw[:200]!r}")
    st, d, _ = su.post_json(url, "/detokenize", {"tokens": a["tokens"][:60000]})
    check(st == 200 and big.startswith(d["content"]), f"detokenize of 60000 ids: {st}")


def tokenize_keyed(url):
    st, _, _ = su.request(url, "POST", "/tokenize", {"content": "x"})
    check(st == 401, f"/tokenize without a key: {st}")
    st, _, _ = su.request(url, "POST", "/tokenize", {"content": "x"}, headers=AUTH)
    check(st == 200, f"/tokenize with a key: {st}")


# ---- /v1/models -----------------------------------------------------------------------------

def models(url):
    st, _, data = su.get(url, "/v1/models")
    m = json.loads(data)["data"][0]
    check(m["id"] == MODEL and m["object"] == "model" and m["owned_by"] == "shoal", f"{m}")
    check(m["max_model_len"] == 512, f"max_model_len {m.get('max_model_len')} (served --ctx 512)")
    check(m["meta"]["n_ctx_train"] >= 2048, f"meta {m.get('meta')}")
    check(m["meta"]["n_vocab"] == 49152, f"meta {m.get('meta')}")
    check(m["capabilities"] == ["completion", "chat", "embeddings"],
          f"capabilities {m.get('capabilities')}")
    # What capabilities says is served: an embedding works here.
    st, p, raw = su.post_json(url, "/v1/embeddings", {"model": MODEL, "input": "hello"})
    check(st == 200 and p["data"][0]["embedding"], f"/v1/embeddings: {st} {raw[:200]!r}")


# ---- response_format ------------------------------------------------------------------------

def response_format(url):
    for rf, param in [({"type": "yaml"}, "response_format.type"),
                      ("json", "response_format"),
                      ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
                          "type": "object", "if": {}}}}, "response_format.json_schema.schema")]:
        st, parsed, raw = su.post_json(url, "/v1/chat/completions",
                                       chat_body(response_format=rf))
        check(st == 400 and parsed["error"]["param"] == param,
              f"response_format {rf}: {st} {raw[:300]!r} (want 400 naming {param})")
    st, parsed, raw = su.post_json(url, "/v1/chat/completions",
                                   chat_body(response_format={"type": "yaml"}))
    check("yaml" in parsed["error"]["message"], f"message does not name the type: {raw!r}")
    for rf in ({"type": "text"}, {"type": "json_object"},
               {"type": "json_schema", "json_schema": {"name": "p", "schema": {
                   "type": "object", "properties": {"a": {"type": "integer"}}}}}):
        st, _, raw = su.post_json(url, "/v1/chat/completions", chat_body(response_format=rf))
        check(st == 200, f"response_format {rf}: {st} {raw[:300]!r}")
    st, _, raw = su.post_json(url, "/v1/completions",
                              {"model": MODEL, "prompt": "x", "max_tokens": 1,
                               "response_format": {"type": "xml"}})
    check(st == 400, f"completions with an unknown type: {st} {raw[:200]!r}")


def run(r):
    with su.server("--ctx", "512", "--cors-origin", ORIGIN, "--cors-origin",
                   "http://other.example", "--api-key", KEY, runner=r) as srv:
        r.case("cors: preflight before keys, headers on responses", cors_on, srv.url)
        r.case("aliases behind the keys", aliases_keyed, srv.url)
        r.case("tokenize behind the keys", tokenize_keyed, srv.url)
    fp = []
    with su.server("--ctx", "512", runner=r) as srv:
        r.case("aliases without /v1", aliases, srv.url)
        r.case("system_fingerprint", lambda u: fp.append(fingerprint(u)), srv.url)
        r.case("cached_tokens", cached_tokens, srv.url)
        r.case("cors off", cors_off, srv.url, False)
        r.case("tokenize and detokenize", tokenize, srv.url)
        r.case("tokenize: bad input", tokenize_bad, srv.url)
        r.case("/v1/models: context and capabilities", models, srv.url)
        r.case("response_format validated", response_format, srv.url)
    with su.server("--ctx", "512", "--api-key", KEY, "--cors-origin", "*",
                   runner=r) as srv:
        r.case("cors *", cors_star, srv.url)
        if fp:
            r.case("system_fingerprint stable across servers", fingerprint_stable_keyed, srv.url,
                   fp[0])
    with su.server("--ctx", "512", "--no-prefix-cache", "--api-key", KEY, runner=r) as srv:
        r.case("cors off with keys", cors_off, srv.url, True)
    r.case("--cors-origin refuses what is not an origin", cors_bad_flag)


def fingerprint_stable_keyed(url, fp_before):
    st, a, raw = su.post_json(url, "/v1/chat/completions", chat_body(), headers=AUTH)
    check(st == 200, f"{st} {raw[:200]!r}")
    check(a["system_fingerprint"] == fp_before,
          f"another server of the same build and model: {a['system_fingerprint']!r} != "
          f"{fp_before!r}")


def main():
    r = su.Runner("serve_compat")
    try:
        run(r)
    except AssertionError as e:
        r.fail("server", str(e))
    r.finish()


if __name__ == "__main__":
    main()
