"""`shoal cluster status [URL]` and GET /admin/cluster against real processes (issue 11,
docs/cluster.md, "Watching a cluster").

Cases:
- a 2-stage stories260K cluster over ipc:// (two `shoal node` workers, a `shoal serve -c` front
  with an API key): the table shows the front and both workers joined with their links up, no
  reconnects, each stage with its node and layer range; the replica's counters follow the
  requests served (steps, prompt and generated tokens); without the key it exits 2 naming the
  URL, with --api-key or SHOAL_API_KEY it answers; --json prints the document.
- while a worker is stopped (SIGSTOP) with requests in flight, status still answers at once and
  shows them running with their KV blocks held; its link stays up (a stopped process keeps its
  connection: the step timeout is what notices it, docs/cluster.md); after SIGCONT they finish.
- a single-process `shoal serve -m` answers too: one node, one stage holding every layer.
- an unreachable URL, a bad URL: one `error:` line naming the URL, exit 2.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402
from test_cluster_pipeline import STORIES, Node, script  # noqa: E402

KEY = "status-test-key"


def status(*args, env=None, timeout=30):
    """Runs `shoal cluster status ARGS`; returns the CompletedProcess."""
    full_env = dict(os.environ)
    full_env.pop("SHOAL_API_KEY", None)
    full_env.update(env or {})
    return subprocess.run([su.shoal_binary(), "cluster", "status", *args], cwd=su.ROOT,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout, env=full_env)


def doc_of(url, key=None):
    """The status document, through the command's --json."""
    args = [url, "--json"] + (["--api-key", key] if key else [])
    p = status(*args)
    assert p.returncode == 0, f"exit {p.returncode}: {p.stderr}"
    return json.loads(p.stdout)


def rows(text, first):
    """The table rows whose first column is `first`, split on blanks."""
    return [ln.split() for ln in text.splitlines() if ln.split()[:1] == [first]]


def one_error(p, *want):
    assert p.returncode == 2, f"exit {p.returncode}, want 2: {p.stdout} {p.stderr}"
    errs = [ln for ln in p.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errs) == 1 and len(p.stderr.splitlines()) == 1, f"want one error line: {p.stderr}"
    for w in want:
        assert w in errs[0], f"{errs[0]!r} lacks {w!r}"


def complete(url, prompt, n, timeout=120):
    st, parsed, raw = su.post_json(url, "/v1/completions", {
        "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True},
        headers={"Authorization": f"Bearer {KEY}"}, timeout=timeout)
    assert st == 200, f"status {st}: {raw[:300]!r}"
    return parsed


def cluster_case(d):
    path = script(os.path.join(d, "st.lua"), STORIES, ["w0", "w1"])
    nodes = [Node(path, w) for w in ("w0", "w1")]
    problems = []
    try:
        for nd in nodes:
            nd.wait_ready()
        srv = su.start("-c", path, "--api-key", KEY, model=None)
        try:
            problems += check_cluster(srv, nodes)
        finally:
            problems += su.stop(srv)
    finally:
        for nd in nodes:
            if nd.proc.poll() is None:
                os.kill(nd.proc.pid, signal.SIGCONT)
            problems += nd.stop()
    assert not problems, "\n".join(problems)


def check_cluster(srv, nodes):
    # The key: refused without it (one error line naming the URL, exit 2).
    one_error(status(srv.url), srv.url, "401")
    p = status(srv.url, env={"SHOAL_API_KEY": f"{KEY}:3"})
    assert p.returncode == 0, f"SHOAL_API_KEY: exit {p.returncode}: {p.stderr}"
    p = status(srv.url, "--api-key", KEY)
    assert p.returncode == 0, f"exit {p.returncode}: {p.stderr}"
    out = p.stdout
    su.log("status of a fresh 2-stage cluster:\n" + out)
    assert "a cluster fronted by this node" in out and "model m (5 layers)" in out, out
    front = rows(out, "front")
    assert front and front[0][1] == "front" and "self" in front[0], out
    for w in ("w0", "w1"):
        r = rows(out, w)
        assert r and r[0][1] == "worker" and r[0][2].endswith(f"/{w}.sock"), out
        assert r[0][3:6] == ["yes", "up", "0"], f"{w}: {r[0]}"
    st = [r for r in rows(out, "0") if len(r) == 6 and r[1] in ("1", "2")]
    assert [(r[1], r[2], " ".join(r[3:5]), r[5]) for r in st] == [
        ("1", "w0", "[0, 2)", "2"), ("2", "w1", "[2, 5)", "3")], st
    doc = doc_of(srv.url, KEY)
    assert doc["mode"] == "cluster" and doc["node"] == "front", doc
    assert [n["state"] for n in doc["nodes"]] == ["self", "up", "up"], doc["nodes"]
    assert all(not n["lost"] and n["reconnects"] == 0 for n in doc["nodes"]), doc["nodes"]
    assert [n["stages"] for n in doc["nodes"]] == [[], [1], [2]], doc["nodes"]
    rep = doc["replicas"][0]
    assert rep["kv_blocks_total"] > 0 and rep["running"] == 0 and rep["waiting"] == 0, rep
    steps0, gen0 = rep["steps"], rep["generation_tokens"]

    # Counters follow the requests served.
    for prompt in ("Once upon a time", "The little dog"):
        complete(srv.url, prompt, 20)
    rep = doc_of(srv.url, KEY)["replicas"][0]
    assert rep["generation_tokens"] >= gen0 + 40, rep
    assert rep["steps"] >= steps0 + 20 and rep["prompt_tokens"] > 0, rep
    assert rep["running"] == 0 and rep["kv_blocks_used"] == 0, rep

    # A stopped worker: status answers at once and shows the requests in flight.
    w1 = nodes[1]
    os.kill(w1.proc.pid, signal.SIGSTOP)
    results = [None] * 3

    def one(i):
        try:
            results[i] = complete(srv.url, f"The cat {i}", 30)
        except Exception as exc:  # noqa: BLE001
            results[i] = exc

    ts = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(3)]
    try:
        for t in ts:
            t.start()
        deadline = time.monotonic() + 10
        while True:
            t0 = time.monotonic()
            doc = doc_of(srv.url, KEY)
            took = time.monotonic() - t0
            assert took < 5, f"status took {took:.1f} s while a worker is stopped"
            rep = doc["replicas"][0]
            if rep["running"] + rep["waiting"] == 3 and rep["kv_blocks_used"] > 0:
                break
            assert time.monotonic() < deadline, f"requests not shown in flight: {rep}"
            time.sleep(0.1)
        assert rep["running"] >= 1, rep
        assert doc["nodes"][2]["state"] == "up", doc["nodes"][2]
        p = status(srv.url, "--api-key", KEY)
        assert p.returncode == 0, p.stderr
        su.log("status with w1 stopped and 3 requests in flight:\n" + p.stdout)
    finally:
        os.kill(w1.proc.pid, signal.SIGCONT)
    for t in ts:
        t.join(120)
    bad = [r for r in results if not isinstance(r, dict)]
    assert not bad, bad
    rep = doc_of(srv.url, KEY)["replicas"][0]
    assert rep["running"] == 0 and rep["waiting"] == 0, rep
    return []


def single_case():
    with su.server("-m", STORIES, "-t", "1", "--kv-mem", "32M", model=None) as srv:
        p = status(srv.url)
        assert p.returncode == 0, f"exit {p.returncode}: {p.stderr}"
        su.log("status of a single process:\n" + p.stdout)
        assert "one process (no worker nodes)" in p.stdout, p.stdout
        r = rows(p.stdout, "serve")
        assert r and r[0][1] == "single" and "self" in r[0], p.stdout
        doc = doc_of(srv.url)
        assert doc["mode"] == "single" and len(doc["nodes"]) == 1, doc
        assert doc["replicas"][0]["stages"] == [
            {"stage": 1, "node": "serve", "ranks": ["serve"], "first_layer": 0,
             "last_layer": 5}], doc
        # The endpoint itself, as any HTTP client sees it.
        st, hdrs, body = su.get(srv.url, "/admin/cluster")
        assert st == 200 and hdrs.get("content-type", "").startswith("application/json"), st
        assert json.loads(body)["object"] == "shoal.cluster"
        st, _, _ = su.request(srv.url, "POST", "/admin/cluster", b"{}")
        assert st == 405, st


def bad_urls():
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nobody listens there now
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    one_error(status(url), url, "cannot connect")
    assert time.monotonic() - t0 < 5
    one_error(status(f"127.0.0.1:{port}"), f"127.0.0.1:{port}", "cannot connect")
    one_error(status("https://127.0.0.1:8080"), "https://127.0.0.1:8080", "only http://")
    one_error(status("http://127.0.0.1:99999"), "99999", "port")
    one_error(status("http://no-such-host.invalid:8080"), "no-such-host.invalid")
    p = status("--bogus")
    assert p.returncode == 2 and "unknown option" in p.stderr, p.stderr
    p = status("--help")
    assert p.returncode == 0 and "usage: shoal cluster status" in p.stdout, p.stdout


def main():
    if not os.path.exists(STORIES):
        su.skip(f"{STORIES} missing")
    r = su.Runner("test_cluster_status")
    d = tempfile.mkdtemp(prefix="shst-", dir="/tmp")  # ipc:// paths stay short
    try:
        r.case("bad or unreachable URLs: one error line naming them, exit 2", bad_urls)
        r.case("single-process serve: one node, one stage holding every layer", single_case)
        r.case("2-stage cluster: nodes, links, stages, load; a stopped worker", cluster_case, d)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    r.finish()


if __name__ == "__main__":
    main()
