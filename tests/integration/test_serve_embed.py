"""POST /v1/embeddings on `shoal serve`, driven by the official `openai` client (1.x) and raw HTTP.

Checks: the client's embeddings.create (its default base64 encoding and "float") gives unit
vectors of the model's width; float and base64 answers are the same numbers; the same text embeds
the same alone and in a batch of 32 (within 1e-5), also a long text whose prefill is split into
chunks differently (--step-tokens 64 on a second server); token-id inputs; usage; the /embeddings
alias; bad inputs (empty, wrong types, too long, dimensions, encoding_format, unknown model) are
400/404 naming the problem and the server goes on serving; a client that leaves is cancelled; a
request past --request-timeout is a 504; and the vectors of the tiny
stories260K model (F32 KV cache, a 100-token input prefilled in two chunks, and a 9-token one)
equal, within 1e-5, the NumPy reference forward pass's (tests/reference) final normed hidden
states pooled and normalised: mean (the file as it is), and CLS and last token (copies whose
metadata says llama.pooling_type 2 and 3, written with the gguf package).
"""

import base64
import json
import math
import os
import struct
import sys
import tempfile
import time

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


def client_leaves(url):
    """A client that goes away with 300 long inputs (120k tokens) queued on the --step-tokens 64
    server: its inputs are cancelled (the server is idle within 10 s, where embedding them all
    takes minutes at 64 tokens a step) and the server goes on serving."""
    import socket
    def cancels():
        return su.metric(su.metrics(url), "shoal_requests_finished_total", reason="cancel") or 0

    before = cancels()
    host, port = su._hostport(url)
    body = json.dumps({"input": [LONG] * 300}).encode()
    sk = socket.create_connection((host, port), timeout=10)
    sk.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    time.sleep(0.5)
    sk.close()
    su.wait_idle(url, timeout=10)
    check(cancels() - before >= 32, f"{cancels() - before} inputs cancelled, not the window's 64")
    shape(url)


def deadline(url):
    """--request-timeout 1 with 16-token steps: 200 long inputs (80k tokens) cannot all be
    embedded in a second: 504 naming an input and the timeout; then a short one still works."""
    st, a, raw = su.post_json(url, "/v1/embeddings", {"input": [LONG] * 200})
    check(st == 504, f"{st}, not 504: {raw[:300]!r}")
    check("within the request timeout" in a["error"]["message"], str(a)[:300])
    su.wait_idle(url, timeout=10)
    st, a, raw = su.post_json(url, "/v1/embeddings", {"input": "short"})
    check(st == 200, f"after the timeout: {st} {raw[:200]!r}")


def ref_rows(path, ids):
    """The NumPy reference forward pass's final normed hidden states of ids (what the head
    reads), one row per position; None without numpy and gguf."""
    try:
        import numpy as np
        sys.path.insert(0, os.path.join(su.ROOT, "tests", "reference"))
        import ref_forward
        import ref_model
    except ImportError as e:
        su.log(f"     skipped: {e} (run scripts/test-venv.sh)")
        return None
    m = ref_model.Model(path)
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
    return np.array(rows)


# Prefilled in two chunks under --step-tokens 64.
REF_IDS = [1] + [(37 * i + 11) % 500 + 2 for i in range(99)]


def reference(url, pooling, path):
    """stories260K (F32 KV cache, --step-tokens 64: the 100 ids run in two chunks): the pooled
    final normed hidden states, L2-normalised, against the NumPy reference: mean, CLS (first
    row) or last row as the file's pooling_type says."""
    import numpy as np
    (v,) = vecs(embed(url, {"input": REF_IDS}))
    (short,) = vecs(embed(url, {"input": REF_IDS[:9]}))
    for ids, got in ((REF_IDS, v), (REF_IDS[:9], short)):
        rows = ref_rows(path, ids)
        if rows is None:
            return
        ref = {1: rows.mean(axis=0), 2: rows[0], 3: rows[-1]}[pooling]
        ref = ref / np.linalg.norm(ref)
        d = float(np.max(np.abs(ref - np.asarray(got))))
        su.log(f"     stories260K pooling {pooling}, {len(ids)} ids: max |engine - reference| "
               f"{d:.3g}")
        check(d < 1e-5, f"the engine's embedding differs from the reference by {d}")
    many = vecs(embed(url, {"input": [REF_IDS[:9], REF_IDS, REF_IDS[:40]]}))
    check(maxdiff(many[1], v) <= 1e-5 and maxdiff(many[0], short) <= 1e-5,
          "stories260K: batch differs")


def with_pooling(pooling, tmp):
    """A copy of stories260K whose metadata says llama.pooling_type = pooling."""
    import contextlib
    import io

    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata
    out = os.path.join(tmp, f"stories260K-pool{pooling}.gguf")
    r = gguf.GGUFReader(STORIES)
    w = gguf.GGUFWriter(out, arch="llama", endianess=r.endianess)
    with contextlib.redirect_stderr(io.StringIO()):
        copy_with_new_metadata(
            r, w, {"llama.pooling_type": MetadataDetails(gguf.GGUFValueType.UINT32, pooling)}, [])
    return out


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
                r.case("a client that leaves is cancelled", client_leaves, small.url)
        with su.server("--ctx", "512", "--step-tokens", "16", "--request-timeout", "1",
                       runner=r) as slow:
            r.case("request timeout: 504", deadline, slow.url)
        if not os.path.exists(STORIES):
            su.log(f"     skipped the reference checks: no {STORIES}")
        else:
            with tempfile.TemporaryDirectory() as tmp:
                for pooling in (1, 2, 3):
                    try:
                        path = STORIES if pooling == 1 else with_pooling(pooling, tmp)
                    except ImportError as e:
                        su.log(f"     skipped pooling {pooling}: {e} (run scripts/test-venv.sh)")
                        continue
                    with su.server("--ctx", "256", "--kv-f32", "--step-tokens", "64", model=path,
                                   runner=r) as st:
                        r.case(f"reference: stories260K pooling {pooling}", reference, st.url,
                               pooling, path)
    except AssertionError as e:
        r.fail("server", str(e))
    r.finish()


if __name__ == "__main__":
    main()
