"""Replicas of different models behind one front (issue 11, docs/cluster.md "Several replicas
and the router"), against real processes: worker 'a' serves stories260K as "stories", worker 'b'
the default SmolLM2 as "smollm2", both behind one `shoal serve -c` front over ipc://.

Cases:
- GET /v1/models lists both names, each with the "embeddings" capability;
- POST /v1/embeddings naming each model gives that model's vector (its width), equal within 1e-5
  to the single process's;
- greedy completions to each name equal a single-process `shoal serve -m` of that model (text),
  and chat completions use each model's own chat template (equal to the single process's too);
- a request naming neither gets 404 model_not_found naming both; one without "model" a 400;
- `shoal cluster status --json` and GET /admin/cluster show both replicas with their models;
- a script that puts stages of both models on one worker is refused by `shoal node` by name.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402
from test_cluster_pipeline import Node  # noqa: E402

STORIES = os.path.join(su.ROOT, "tests", "data", "stories260K", "stories260K.gguf")
PROMPTS = ["Once upon a time", "The little dog"]
CHAT = [{"role": "user", "content": "Say hello."}]
EMB_TEXT = "The little dog ran to the park."


def embed(url, model):
    status, parsed, raw = su.post_json(url, "/v1/embeddings", {"model": model,
                                                                "input": EMB_TEXT})
    assert status == 200, f"{model}: /v1/embeddings {status}: {raw[:300]!r}"
    return parsed["data"][0]["embedding"]


def write(path, text):
    with open(path, "w") as f:
        f.write(text)
    return path


def two_models(d, name, b_node="b"):
    return write(os.path.join(d, name), f"""
local s = model {{ path = '{STORIES}', name = 'stories' }}
local m = model {{ path = '{su.MODEL}', name = 'smollm2' }}
return cluster {{
  nodes = {{ node {{ name = 'front', listen = 'ipc://{d}/{name}-front.sock' }},
            node {{ name = 'a', listen = 'ipc://{d}/{name}-a.sock' }},
            node {{ name = 'b', listen = 'ipc://{d}/{name}-b.sock' }} }},
  gateway = {{ node = 'front', http = '127.0.0.1:8080' }},
  replicas = {{ replica {{ model = s, stages = pipeline(s, {{ 'a' }}) }},
               replica {{ model = m, stages = pipeline(m, {{ '{b_node}' }}) }} }},
  batcher = {{ max_seqs = 8, max_step_tokens = 512 }},
  kv = {{ memory = '64MiB' }},
}}
""")


def complete(url, model, prompt, n=12):
    status, parsed, raw = su.post_json(url, "/v1/completions", {
        "model": model, "prompt": prompt, "max_tokens": n, "temperature": 0})
    assert status == 200, f"{model}: status {status}: {raw[:300]!r}"
    assert parsed["model"] == model, parsed
    return parsed["choices"][0]["text"]


def chat(url, model, n=12):
    status, parsed, raw = su.post_json(url, "/v1/chat/completions", {
        "model": model, "messages": CHAT, "max_tokens": n, "temperature": 0})
    assert status == 200, f"{model}: status {status}: {raw[:300]!r}"
    return parsed["choices"][0]["message"]["content"], parsed["usage"]["prompt_tokens"]


def reference(model_path, name):
    """Greedy texts and chat of one model from a single-process `shoal serve -m`."""
    srv = su.start("-m", model_path, "--model-name", name, model=None)
    try:
        texts = [complete(srv.url, name, p) for p in PROMPTS]
        return texts, chat(srv.url, name), embed(srv.url, name)
    finally:
        problems = su.stop(srv)
        assert not problems, "\n".join(problems)


def served(d, refs):
    path = two_models(d, "models.lua")
    nodes, srv, problems = [], None, []
    try:
        nodes = [Node(path, "a"), Node(path, "b")]
        for nd in nodes:
            nd.wait_ready()
        srv = su.start("-c", path, "--join-timeout", f"{su.scaled(60):g}", model=None)
        st, _, body = su.get(srv.url, "/v1/models")
        assert st == 200, body
        ids = [m["id"] for m in json.loads(body)["data"]]
        assert ids == ["stories", "smollm2"], ids
        caps = [m["capabilities"] for m in json.loads(body)["data"]]
        assert all("embeddings" in c for c in caps), caps
        for name in ("stories", "smollm2"):
            texts, (ctext, cprompt), want = refs[name]
            v = embed(srv.url, name)
            worst = max(abs(x - y) for x, y in zip(v, want))
            assert len(v) == len(want) and worst <= 1e-5, \
                f"{name}: embedding of {len(v)} numbers differs by {worst} (want {len(want)})"
            got = [complete(srv.url, name, p) for p in PROMPTS]
            assert got == texts, f"{name}: {got!r} != single process {texts!r}"
            gtext, gprompt = chat(srv.url, name)
            assert (gtext, gprompt) == (ctext, cprompt), \
                f"{name} chat: {(gtext, gprompt)!r} != single process {(ctext, cprompt)!r}"
        # The two templates differ, so the same messages give different prompt lengths.
        assert refs["stories"][1][1] != refs["smollm2"][1][1], refs
        status, parsed, raw = su.post_json(srv.url, "/v1/completions", {
            "model": "nope", "prompt": "hi", "max_tokens": 2})
        err = su.check_error(status, parsed, raw, 404, "model_not_found", "unknown model")
        assert "'stories'" in err["message"] and "'smollm2'" in err["message"], err
        status, parsed, raw = su.post_json(srv.url, "/v1/completions", {
            "prompt": "hi", "max_tokens": 2})
        su.check_error(status, parsed, raw, 400, None, "no model")
        st, _, body = su.get(srv.url, "/admin/cluster")
        assert st == 200, body
        doc = json.loads(body)
        reps = [(r["model"], [s["node"] for s in r["stages"]]) for r in doc["replicas"]]
        assert reps == [("stories", ["a"]), ("smollm2", ["b"])], reps
        p = subprocess.run([su.shoal_binary(), "cluster", "status", srv.url], cwd=su.ROOT,
                           stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           timeout=su.scaled(30))
        assert p.returncode == 0, f"exit {p.returncode}: {p.stderr}"
        assert "a" in p.stdout and "b" in p.stdout, p.stdout
    finally:
        if srv:
            problems += su.stop(srv)
        for nd in nodes:
            problems += nd.stop()
    assert not problems, "\n".join(problems)


def one_worker_two_models(d):
    path = two_models(d, "shared.lua", b_node="a")
    p = subprocess.run([su.shoal_binary(), "node", "-c", path, "--name", "a"], cwd=su.ROOT,
                       stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       timeout=su.scaled(30))
    assert p.returncode == 2, f"exit {p.returncode}: {p.stderr}"
    assert "node 'a' holds stages of replica 1 (model 'stories') and replica 2 (model " \
           "'smollm2'): a worker node serves one model" in p.stderr, p.stderr


def main():
    if not os.path.exists(STORIES):
        su.skip(f"{STORIES} missing")
    if not os.path.exists(su.MODEL):
        su.skip(f"{su.MODEL} missing")
    r = su.Runner("test_cluster_models")
    d = tempfile.mkdtemp(prefix="shmm-", dir="/tmp")
    try:
        refs = {}
        r.case("single-process references", lambda: refs.update(
            stories=reference(STORIES, "stories"), smollm2=reference(su.MODEL, "smollm2")))
        r.case("two models behind one front: /v1/models, greedy text and chat equal one "
               "process each, 404 naming both, cluster status", served, d, refs)
        r.case("a worker holding stages of two models is refused", one_worker_two_models, d)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    r.finish()


if __name__ == "__main__":
    main()
