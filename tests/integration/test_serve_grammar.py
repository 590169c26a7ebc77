"""`shoal serve` with constrained decoding (issue 28): the `grammar` field (GBNF) and
`response_format` make the output follow the grammar, end to end, against real processes.

Cases (default model, temperature 1.0 unless said):
- JSON schemas: 12 schemas (nested, recursive $ref, enums, arrays with bounds, anyOf, string
  and number bounds, const, prefixItems), 5 requests each, all at once: every output whose
  finish_reason is not "length" parses and validates with the `jsonschema` package;
  json_object mode gives a JSON object;
- GBNF grammars: arithmetic expressions and CSV rows, each output checked by a parser written
  here (not the server's grammar engine);
- streaming with a schema: the deltas put together validate;
- n = 2: each choice validates; logprobs are those of the masked row;
- preemption: a KV pool too small for the answers at once; outputs still validate;
- greedy sanity: a grammar that allows exactly the unconstrained greedy output gives that output;
- bad grammars: a syntax error is a 400 naming line and column, an undefined rule a 400,
  `grammar` with `response_format` a 400, a non-string grammar a 400; the server then serves;
- a 2-stage pipeline and one stage on a tensor-parallel group of 2 ranks (`shoal node` workers,
  as test_cluster_pipeline) give valid output, greedy with a grammar too.
Needs jsonschema (scripts/test-venv.sh installs it): skips (77) without it.
"""

import json
import math
import os
import re
import shutil
import sys
import tempfile

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402

try:
    import jsonschema
except ImportError:
    jsonschema = None

PER_SCHEMA = 5
MAX_TOKENS = 160

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "ok": {"type": "boolean"}}, "required": ["color", "ok"]},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
     "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"]}},
     "required": ["point"]},
    {"anyOf": [{"type": "string", "minLength": 1, "maxLength": 8}, {"type": "integer"}]},
    {"type": "object", "properties": {"kind": {"const": "cat"},
                                      "lives": {"type": "integer", "minimum": 1, "maximum": 9}},
     "required": ["kind", "lives"]},
    {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer", "minimum": 0, "maximum": 99},
        "next": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/node"}]}},
        "required": ["v", "next"]}}, "$ref": "#/$defs/node"},
    {"type": "array", "prefixItems": [{"type": "string", "maxLength": 10}, {"type": "boolean"}],
     "items": False, "minItems": 2},
    {"type": ["string", "null"], "maxLength": 12},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {
        "type": "string", "maxLength": 10}, "maxItems": 3}, "id": {"type": "integer"}},
     "required": ["id", "tags"]},
    {"oneOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
               {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}]},
    {"type": "number", "minimum": 0, "maximum": 1},
]

ARITH = r'''
root ::= expr
expr ::= term (("+" | "-") term){0,4}
term ::= factor (("*" | "/") factor){0,3}
factor ::= num | "(" expr ")"
num ::= [1-9] [0-9]{0,2} | "0"
'''

CSV = r'''
root ::= row{2,4}
row ::= field ("," field){2} "\n"
field ::= [a-z]{1,8} | [0-9]{1,4}
'''


def check(cond, msg):
    if not cond:
        raise AssertionError(msg)


def chat(url, content, timeout=300, **kw):
    body = {"messages": [{"role": "user", "content": content}], "temperature": 1.0,
            "max_tokens": MAX_TOKENS}
    body.update(kw)
    return su.post_json(url, "/v1/chat/completions", body, timeout=timeout)


def validate(text, schema, what):
    try:
        v = json.loads(text)
    except ValueError as exc:
        raise AssertionError(f"{what}: not JSON ({exc}): {text!r}")
    try:
        jsonschema.validate(v, schema)
    except jsonschema.ValidationError as exc:
        raise AssertionError(f"{what}: does not validate ({exc.message}): {text!r}")
    return v


# ---- JSON schemas -------------------------------------------------------------------------

def schemas(url):
    jobs = [(i, k) for i in range(len(SCHEMAS)) for k in range(PER_SCHEMA)]

    def one(url, job, _n):
        i, _ = job
        rf = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i]}}
        st, p, raw = chat(url, "Answer with a JSON value.", response_format=rf)
        check(st == 200, f"schema {i}: {st} {raw[:300]!r}")
        ch = p["choices"][0]
        return i, ch["message"]["content"], ch["finish_reason"]

    got = su.at_once(url, jobs, 0, one)
    cut = 0
    for i, text, fin in got:
        if fin == "length":
            cut += 1
            continue
        check(fin == "stop", f"schema {i}: finish_reason {fin!r}")
        validate(text, SCHEMAS[i], f"schema {i}")
    check(cut < len(got) // 4, f"{cut} of {len(got)} outputs cut by max_tokens")
    su.log(f"note: {len(got) - cut} outputs validated, {cut} cut by max_tokens")


def json_object(url):
    st, p, raw = chat(url, "Describe a book as JSON.",
                      response_format={"type": "json_object"})
    check(st == 200, f"{st} {raw[:300]!r}")
    ch = p["choices"][0]
    if ch["finish_reason"] != "length":
        check(isinstance(json.loads(ch["message"]["content"]), dict), repr(ch))


def streaming(url):
    schema = SCHEMAS[0]
    body = {"messages": [{"role": "user", "content": "A person as JSON."}], "temperature": 1.0,
            "max_tokens": MAX_TOKENS, "stream": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p",
                                                                         "schema": schema}}}
    for _ in range(2):
        st, _, events = su.stream(url, "/v1/chat/completions", body, timeout=300)
        check(st == 200, f"{st} {events[:1]!r}")
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                       if e != "[DONE]" and e.get("choices"))
        fins = [e["choices"][0].get("finish_reason") for e in events
                if e != "[DONE]" and e.get("choices") and e["choices"][0].get("finish_reason")]
        check(fins and fins[-1] in ("stop", "length"), f"finish {fins}")
        if fins[-1] == "stop":
            validate(text, schema, "stream")


def logprobs(url):
    """Logprobs are those of the masked row: the top list holds only tokens the grammar allows,
    and their probabilities add up to about 1."""
    st, p, raw = chat(url, "Is the sky blue?", grammar='root ::= "yes" | "no"', logprobs=True,
                      top_logprobs=5, max_tokens=4)
    check(st == 200, f"{st} {raw[:300]!r}")
    ch = p["choices"][0]
    check(ch["message"]["content"] in ("yes", "no"), repr(ch))
    first = ch["logprobs"]["content"][0]
    tops = first["top_logprobs"]
    for t in tops:
        check(t["logprob"] <= -9000 or "yes".startswith(t["token"]) or "no".startswith(t["token"]),
              f"top token {t!r} is outside the grammar")
    total = sum(math.exp(t["logprob"]) for t in tops)
    check(0.98 < total < 1.02, f"top probabilities add up to {total}: {tops!r}")


def n_choices(url):
    schema = SCHEMAS[1]
    st, p, raw = chat(url, "JSON please.", n=2,
                      response_format={"type": "json_schema",
                                       "json_schema": {"name": "c", "schema": schema}})
    check(st == 200, f"{st} {raw[:300]!r}")
    check(len(p["choices"]) == 2, repr(p))
    for ch in p["choices"]:
        if ch["finish_reason"] != "length":
            validate(ch["message"]["content"], schema, f"choice {ch['index']}")


# ---- GBNF grammars, checked by parsers written here ---------------------------------------

def parse_arith(s):
    """Recursive descent over the grammar ARITH; True when s is a whole expression."""
    pos = 0

    def num():
        nonlocal pos
        m = re.compile(r"[1-9][0-9]{0,2}|0").match(s, pos)
        if not m:
            return False
        pos = m.end()
        return True

    def factor(depth):
        nonlocal pos
        if pos < len(s) and s[pos] == "(":
            pos += 1
            if not expr(depth + 1) or pos >= len(s) or s[pos] != ")":
                return False
            pos += 1
            return True
        return num()

    def term(depth):
        nonlocal pos
        if not factor(depth):
            return False
        for _ in range(3):
            if pos < len(s) and s[pos] in "*/":
                pos += 1
                if not factor(depth):
                    return False
            else:
                break
        return True

    def expr(depth):
        nonlocal pos
        if depth > 50 or not term(depth):
            return False
        for _ in range(4):
            if pos < len(s) and s[pos] in "+-":
                pos += 1
                if not term(depth):
                    return False
            else:
                break
        return True

    return expr(0) and pos == len(s)


def parse_csv(s):
    rows = s.split("\n")
    if rows[-1] != "":
        return False
    rows = rows[:-1]
    if not 2 <= len(rows) <= 4:
        return False
    field = re.compile(r"[a-z]{1,8}|[0-9]{1,4}")
    return all(len(r.split(",")) == 3 and all(field.fullmatch(f) for f in r.split(","))
               for r in rows)


def gbnf(url, grammar, prompt, parser, what):
    def one(url, _p, _n):
        st, p, raw = su.post_json(url, "/v1/completions", {
            "prompt": prompt, "grammar": grammar, "temperature": 1.0, "max_tokens": 96},
            timeout=300)
        check(st == 200, f"{what}: {st} {raw[:300]!r}")
        return p["choices"][0]

    for ch in su.at_once(url, list(range(5)), 0, one):
        if ch["finish_reason"] == "length":
            continue
        check(ch["finish_reason"] == "stop", f"{what}: {ch!r}")
        check(parser(ch["text"]), f"{what}: {ch['text']!r} does not parse")


def gbnf_escape(text):
    out = []
    for c in text:
        if c == "\\":
            out.append("\\\\")
        elif c == '"':
            out.append('\\"')
        elif c == "\n":
            out.append("\\n")
        elif c == "\r":
            out.append("\\r")
        elif c == "\t":
            out.append("\\t")
        elif ord(c) < 0x20:
            out.append(f"\\x{ord(c):02x}")
        else:
            out.append(c)
    return "".join(out)


def greedy_same(url):
    body = {"prompt": "The capital of France is", "temperature": 0, "max_tokens": 16}
    st, p, raw = su.post_json(url, "/v1/completions", body)
    check(st == 200, f"{st} {raw[:300]!r}")
    want = p["choices"][0]
    grammar = f'root ::= "{gbnf_escape(want["text"])}"'
    st, p, raw = su.post_json(url, "/v1/completions", dict(body, grammar=grammar))
    check(st == 200, f"{st} {raw[:300]!r}")
    got = p["choices"][0]
    check(got["text"] == want["text"], f"with the grammar {got['text']!r}, "
          f"without {want['text']!r}")


# ---- bad input ----------------------------------------------------------------------------

def bad(url):
    st, p, raw = su.post_json(url, "/v1/completions", {
        "prompt": "x", "grammar": 'root ::= "a"\nb ::= [a-', "max_tokens": 4})
    su.check_error(st, p, raw, 400, what="syntax error")
    msg = p["error"]["message"]
    check("line 2" in msg and "column" in msg, f"no line and column: {msg!r}")
    check(p["error"].get("param") == "grammar", repr(p))
    st, p, raw = su.post_json(url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "grammar": "root ::= undefined-rule",
        "max_tokens": 4})
    su.check_error(st, p, raw, 400, what="undefined rule")
    check("undefined" in p["error"]["message"], repr(p))
    st, p, raw = su.post_json(url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "grammar": 'root ::= "a"',
        "response_format": {"type": "json_object"}, "max_tokens": 4})
    su.check_error(st, p, raw, 400, what="grammar with response_format")
    check("response_format" in p["error"]["message"], repr(p))
    st, p, raw = su.post_json(url, "/v1/completions", {"prompt": "x", "grammar": 5})
    su.check_error(st, p, raw, 400, what="grammar not a string")
    st, p, raw = su.post_json(url, "/v1/completions", {
        "prompt": "x", "grammar": "root ::= " + "(" * 500 + '"a"' + ")" * 500})
    su.check_error(st, p, raw, 400, what="nesting bound")
    st, p, raw = su.post_json(url, "/v1/completions", {
        "prompt": "Hi", "grammar": 'root ::= "yes" | "no"', "max_tokens": 4, "temperature": 1})
    check(st == 200 and p["choices"][0]["text"] in ("yes", "no"), f"{st} {raw[:300]!r}")


# ---- preemption and recompute --------------------------------------------------------------

def preemption(url):
    """A KV pool too small for 8 long answers at once: sequences are preempted and recomputed
    (their matchers replayed from the generated tokens), and every output still validates.
    The pool is 24 blocks (384 tokens): one answer at its longest (a ~35-token prompt and 300
    out) fits alone, while 8 of the shortest the schema allows (10 strings, ~30 tokens, so ~5
    blocks each) need 40. A 40-block pool let 8 short answers at temperature 1 all fit (CI saw
    no preemption once)."""
    schema = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 10,
              "maxItems": 14}
    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}

    def one(url, _j, _n):
        st, p, raw = chat(url, "List fruit names as JSON.", response_format=rf, max_tokens=300)
        check(st == 200, f"{st} {raw[:300]!r}")
        return p["choices"][0]

    got = su.at_once(url, list(range(8)), 0, one)
    for ch in got:
        if ch["finish_reason"] != "length":
            validate(ch["message"]["content"], schema, "preempted")
    pre = su.metric(su.metrics(url), "shoal_preemptions_total")
    check(pre and pre > 0, f"no preemption happened ({pre}): the case tests nothing")
    su.log(f"note: {pre:g} preemptions")


# ---- a 2-stage pipeline and a tensor-parallel group ---------------------------------------

def cluster(d, name, stages):
    """`shoal node` workers w0, w1 and a `shoal serve -c` front (as test_cluster_pipeline):
    schema answers at temperature 1.0 validate, and a greedy one follows a GBNF grammar."""
    import test_cluster_pipeline as cp
    path = cp.script(os.path.join(d, f"{name}.lua"), su.MODEL, ["w0", "w1"], stages=stages)
    nodes = [cp.Node(path, w) for w in ("w0", "w1")]
    problems = []
    try:
        for nd in nodes:
            nd.wait_ready()
        srv = su.start("-c", path, "--join-timeout", f"{su.scaled(60):g}", model=None)
        try:
            schema = SCHEMAS[6]
            rf = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}

            def one(url, _j, _n):
                st, p, raw = chat(url, "A linked list as JSON.", response_format=rf)
                check(st == 200, f"{st} {raw[:300]!r}")
                return p["choices"][0]

            for ch in su.at_once(srv.url, list(range(4)), 0, one):
                if ch["finish_reason"] != "length":
                    validate(ch["message"]["content"], schema, name)
            st, p, raw = su.post_json(srv.url, "/v1/completions", {
                "prompt": "Is the sky blue? Answer:", "grammar": 'root ::= " yes" | " no"',
                "temperature": 0, "max_tokens": 8}, timeout=300)
            check(st == 200, f"{st} {raw[:300]!r}")
            ch = p["choices"][0]
            check(ch["text"] in (" yes", " no") and ch["finish_reason"] == "stop", repr(ch))
        finally:
            problems += su.stop(srv)
    finally:
        for nd in nodes:
            problems += nd.stop()
    check(not problems, "\n".join(problems))


def main():
    su.require_model()
    if jsonschema is None:
        su.skip("the jsonschema package is missing (run scripts/test-venv.sh)")
    r = su.Runner("test_serve_grammar")
    with su.server("--max-seqs", "64", runner=r) as srv:
        r.case("bad", bad, srv.url)
        r.case("greedy_same", greedy_same, srv.url)
        r.case("schemas", schemas, srv.url)
        r.case("json_object", json_object, srv.url)
        r.case("streaming", streaming, srv.url)
        r.case("n_choices", n_choices, srv.url)
        r.case("logprobs", logprobs, srv.url)
        r.case("arith", gbnf, srv.url, ARITH, "Write an arithmetic expression: ", parse_arith,
               "arith")
        r.case("csv", gbnf, srv.url, CSV, "name,city,age\n", parse_csv, "csv")
    with su.server("--kv-blocks", "24", "--no-prefix-cache", runner=r) as srv:
        r.case("preemption", preemption, srv.url)
    d = tempfile.mkdtemp(prefix="shgr-", dir="/tmp")  # ipc:// paths stay short
    try:
        r.case("pipeline", cluster, d, "p2", None)
        # One stage on a tensor-parallel group of 2 ranks: the leader samples with the grammar
        # (a grammar step never takes the group's greedy head).
        r.case("tp2", cluster, d, "tp2", "pipeline(m, { 'w0', 'w1' }), tp = 2")
    finally:
        shutil.rmtree(d, ignore_errors=True)
    r.finish()


if __name__ == "__main__":
    main()
