"""POST /v1/embeddings on `shoal serve`, driven by the official `openai` client (1.x) and raw HTTP.

Checks: the client's embeddings.create (its default base64 encoding and "float") gives unit
vectors of the model's width; float and base64 answers are the same numbers; the same text embeds
the same alone and in a batch of 32 (within 1e-5), also a long text whose prefill is split into
chunks differently (--step-tokens 64 on a second server); token-id inputs; usage; the /embeddings
alias; bad inputs (empty, wrong types, too long, dimensions, encoding_format, unknown model) are
400/404 naming the problem and the server goes on serving; and the mean-pooled vector of the tiny
stories260K model (F32 KV cache) equals, within 1e-5, the NumPy reference forward pass's
(tests/reference) final normed hidden states, averaged and normalised.
"""

import base64
import math
import os
import struct
import sys

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402

try:
    import openai  # noqa: E402
except ImportError:
    openai = None

for var in ("NO_PROXY", "no_proxy"):
    parts = (os.environ.get(var), "127.0.0.1", "localhost", "::1")
    os.environ[var] = ",".join(x for x in parts if x)

DIM = 576  # smollm2-135m's embedding_length
STORIES = os.path.join(su.ROOT, "tests", "data", "stories260K", "stories260K.gguf")
LONG = " ".join(f"Sentence {i} tells of a river that ran past the old mill." for i in range(30))
TEXTS = [f"Text number {i}: the quick brown fox {'jumps ' * (i % 5)}over the lazy dog."
         for i in range(32)]


def check(cond, msg):
    if not cond:
        raise AssertionError(msg)


def embed(url, body, path="/v1/embeddings"):
    st, a, raw = su.post_json(url, path, body)
    check(st == 200, f"{path}: {st} {raw[:300]!r}")
    return a


def vecs(a):
    out = []
    for i, d in enumerate(a["data"]):
        check(d["object"] == "embedding" and d["index"] == i, f"entry {i}: {str(d)[:200]}")
        e = d["embedding"]
        if isinstance(e, str):
            b = base64.b64decode(e)
            e = list(struct.unpack(f"<{len(b) // 4}f", b))
        else:  # the numbers as float32, as the base64 bytes are
            e = list(struct.unpack(f"<{len(e)}f", struct.pack(f"<{len(e)}f", *e)))
        out.append(e)
    return out


def norm(v):
    return math.sqrt(sum(x * x for x in v))


def maxdiff(a, b):
    check(len(a) == len(b), f"lengths {len(a)} != {len(b)}")
    return max(abs(x - y) for x, y in zip(a, b))


def shape(url):
    a = embed(url, {"input": "hello world"})
    check(a["object"] == "list" and a["model"] == su.MODEL_NAME, str(a)[:200])
    check(a["usage"]["prompt_tokens"] > 0
          and a["usage"]["total_tokens"] == a["usage"]["prompt_tokens"], str(a["usage"]))
    (v,) = vecs(a)
    check(len(v) == DIM, f"{len(v)} numbers, not {DIM}")
    check(abs(norm(v) - 1) < 1e-5, f"norm {norm(v)}")


def client_create(url):
    if openai is None:
        check(not os.environ.get("SH_REQUIRE_OPENAI"), "the openai package is missing")
        su.log("     skipped: the openai package is missing (run scripts/test-venv.sh)")
        return
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    r = c.embeddings.create(model=su.MODEL_NAME, input=["hello world", "a second text"])
    check(len(r.data) == 2 and [d.index for d in r.data] == [0, 1], str(r)[:200])
    for d in r.data:
        check(len(d.embedding) == DIM and abs(norm(d.embedding) - 1) < 1e-5,
              f"{len(d.embedding)} numbers, norm {norm(d.embedding)}")
    f = c.embeddings.create(model=su.MODEL_NAME, input="hello world", encoding_format="float")
    f32 = list(struct.unpack(f"<{DIM}f", struct.pack(f"<{DIM}f", *f.data[0].embedding)))
    check(maxdiff(f32, r.data[0].embedding) == 0,
          "float and the client's base64 differ")
    check(r.usage.prompt_tokens > f.usage.prompt_tokens, str(r.usage))
    t = c.embeddings.create(model=su.MODEL_NAME, input=[[1, 2, 3, 4]], dimensions=DIM)
    check(len(t.data[0].embedding) == DIM and t.usage.prompt_tokens == 4, str(t.usage))


def float_base64(url):
    body = {"input": ["hello world", LONG]}
    f = vecs(embed(url, dict(body, encoding_format="float")))
    b = vecs(embed(url, dict(body, encoding_format="base64")))
    for x, y in zip(f, b):
        check(maxdiff(x, y) == 0, "float and base64 answers differ")


def alone_vs_batch(url, other=None):
    """TEXTS[7] and LONG alone, then in one request of 32 inputs (LONG in place of TEXTS[20]):
    the same vectors within 1e-5. With other (a server with another step budget): the same
    there too."""
    batch = list(TEXTS)
    batch[20] = LONG
    many = vecs(embed(url, {"input": batch}))
    check(len(many) == 32, f"{len(many)} vectors")
    for i in (7, 20):
        (alone,) = vecs(embed(url, {"input": batch[i]}))
        d = maxdiff(alone, many[i])
        su.log(f"     input {i}: alone vs in a batch of 32: max |diff| {d:.3g}")
        check(d <= 1e-5, f"input {i}: alone and in a batch of 32 differ by {d}")
        if other:
            (o,) = vecs(embed(other, {"input": batch[i]}))
            d = maxdiff(alone, o)
            su.log(f"     input {i}: --step-tokens 64 vs default: max |diff| {d:.3g}")
            check(d <= 1e-5, f"input {i}: split into other chunks, differs by {d}")
    for i in range(32):
        check(abs(norm(many[i]) - 1) < 1e-5, f"input {i}: norm {norm(many[i])}")
    check(maxdiff(many[0], many[1]) > 1e-3, "different texts embed the same")


def ids_and_alias(url):
    st, tok, raw = su.post_json(url, "/tokenize", {"content": "hello world"})
    check(st == 200, f"/tokenize: {st} {raw[:200]!r}")
    ids = tok["tokens"]
    (a,) = vecs(embed(url, {"input": ids}))
    (b,) = vecs(embed(url, {"input": [ids]}, path="/embeddings"))
    check(maxdiff(a, b) == 0, "ids and [ids] differ")


BAD = [
    ("empty string", {"input": ""}, 400, "input", "input[0] is empty"),
    ("empty list", {"input": []}, 400, "input", "empty"),
    ("empty ids", {"input": [[]]}, 400, "input", "input[0] is empty"),
    ("empty text in a list", {"input": ["a", ""]}, 400, "input", "input[1] is empty"),
    ("number", {"input": 5}, 400, "input", "must be a string"),
    ("mixed", {"input": [[1, 2], 7]}, 400, "input", "input[1]"),
    ("object in ids", {"input": [1, {"a": 1}]}, 400, "input", "input[0][1]"),
    ("id outside the vocabulary", {"input": [1, 10 ** 7]}, 400, "input", "token id"),
    ("missing input", {"model": su.MODEL_NAME}, 400, "input", "'input' is required"),
    ("too long", {"input": [list(range(1, 600))]}, 400, "input", "input[0] has 599 tokens"),
    ("too long text", {"input": ["ok", "word " * 2000]}, 400, None, "input[1] has more than"),
    ("too many", {"input": ["a"] * 2049}, 400, "input", "at most 2048"),
    ("dimensions", {"input": "a", "dimensions": 64}, 400, "dimensions", "must be 576"),
    ("encoding_format", {"input": "a", "encoding_format": "hex"}, 400, "encoding_format",
     "\"float\" or \"base64\""),
    ("unknown model", {"input": "a", "model": "nope"}, 404, "model", "does not exist"),
    ("not json", b"{", 400, None, "not valid JSON"),
]


def bad_inputs(url):
    for name, body, want, param, text in BAD:
        st, a, raw = su.post_json(url, "/v1/embeddings", body)
        check(st == want, f"{name}: {st}, not {want}: {raw[:300]!r}")
        err = (a or {}).get("error") or {}
        check(text in (err.get("message") or ""), f"{name}: message {err.get('message')!r}")
        if param:
            check(err.get("param") == param, f"{name}: param {err.get('param')!r}")
    shape(url)  # still serving
    st, a, raw = su.post_json(url, "/v1/completions",
                              {"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    check(st == 200, f"a completion after the bad inputs: {st} {raw[:200]!r}")


def reference(url):
    """stories260K: the mean of the final normed hidden states, L2-normalised, against the NumPy
    reference forward pass (tests/reference)."""
    try:
        import numpy as np
        sys.path.insert(0, os.path.join(su.ROOT, "tests", "reference"))
        import ref_forward
        import ref_model
    except ImportError as e:
        su.log(f"     skipped: {e} (run scripts/test-venv.sh)")
        return
    ids = [1, 403, 289, 30, 61, 109, 7, 250, 33]
    (v,) = vecs(embed(url, {"input": ids}))
    m = ref_model.Model(STORIES)
    rows = []
    mm = m.mm

    def spy(name, x, w=None):
        if name == "output.weight":
            rows.append(np.asarray(x, dtype=np.float64))
        return mm(name, x, w)

    m.mm = spy
    r = ref_forward.Runner(m)
    for pos, t in enumerate(ids):
        r.step(t, pos)
    check(len(rows) == len(ids), f"{len(rows)} rows captured")
    ref = np.mean(rows, axis=0)
    ref /= np.linalg.norm(ref)
    d = float(np.max(np.abs(ref - np.asarray(v))))
    su.log(f"     stories260K: max |engine - reference| {d:.3g}")
    check(d < 1e-5, f"the engine's embedding differs from the reference by {d}")
    (c,) = vecs(embed(url, {"input": [ids] * 3}))[:1]
    check(maxdiff(c, v) <= 1e-5, "stories260K: batch differs")


def main():
    r = su.Runner("serve_embed")
    try:
        with su.server("--ctx", "512", "--step-tokens", "64", runner=r) as small:
            with su.server("--ctx", "512", runner=r) as srv:
                r.case("shape, unit norm, usage", shape, srv.url)
                r.case("openai client embeddings.create", client_create, srv.url)
                r.case("float and base64 agree", float_base64, srv.url)
                r.case("alone vs batch of 32 (and other chunks)", alone_vs_batch, srv.url,
                       small.url)
                r.case("token ids and the /embeddings alias", ids_and_alias, srv.url)
                r.case("bad input", bad_inputs, srv.url)
        if os.path.exists(STORIES):
            with su.server("--ctx", "256", "--kv-f32", model=STORIES, runner=r) as st:
                r.case("reference: stories260K mean pooling", reference, st.url)
    except AssertionError as e:
        r.fail("server", str(e))
    r.finish()


if __name__ == "__main__":
    main()
