"""A replica's drafter on a node of its own (issue 27; docs/cluster.md, "Speculative decoding"):
`shoal serve -c` with a worker node holding the whole default model and another holding only the
drafter (replica{ drafter = { node = "d0", model = ... } }), against real processes over ipc://.

(a) Greedy completions (8 prompts x 32 tokens, one by one and then all at once) through
    front -> drafter node -> stage node equal a single-process `shoal serve -m` without
    speculation (text, finish reason and token count); the drafter node's
    shoal_drafter_tokens_total (rendered by the front's /metrics with node="d0") and the front's
    shoal_spec_accepted_tokens_total move, and no answer failed to fit its drafts; the one-by-one
    part again with a cluster key on every node.
(b) The drafter's node dies (kill -9) under --recover-timeout with a long request in flight: the
    replica is paused and a request sent meanwhile waits; the node is started again, rejoins, the
    replica resumes (its sequences recomputed through the new drafter), and both requests' outputs
    are the reference's.
(c) Bad drafts: a draft of another vocabulary (stories260K's GGUF) or a missing file makes
    `shoal node` on the drafter's node exit 2 with one error line saying why; a drafter on a node
    that also holds a stage makes the front exit 2.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402
import test_cluster_pipeline as tcp  # noqa: E402  (Node, front_exits)

STORIES = os.path.join(su.ROOT, "tests", "data", "stories260K", "stories260K.gguf")
# Edit-style and free prompts: a draft of the model itself has most of its drafts accepted.
PROMPTS = ["Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
           "Count from one to twenty: one, two, three, four,", "The capital of France is",
           "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n", "Once upon a time",
           "List the days of the week: Monday, Tuesday,", "Water boils at", "Hello, my name is"]
TOKENS = 32


def script(path, draft, stage_node="d0", extra=""):
    d = os.path.dirname(path)
    with open(path, "w") as f:
        f.write(f"local m = model {{ path = '{su.MODEL}', name = 'm' }}\n"
                "return cluster {\n"
                f"  nodes = {{ node {{ name = 'front', listen = 'ipc://{d}/front.sock' }},\n"
                f"            node {{ name = 'w0', listen = 'ipc://{d}/w0.sock' }},\n"
                f"            node {{ name = 'd0', listen = 'ipc://{d}/d0.sock' }} }},\n"
                "  gateway = { node = 'front', http = '127.0.0.1:8080' },\n"
                "  replicas = { replica { model = m, stages = pipeline(m, { 'w0' }),\n"
                f"    drafter = {{ node = '{stage_node}', model = '{draft}' }} }} }},\n"
                "  batcher = { max_seqs = 16, max_step_tokens = 512, spec_k = 4 },\n"
                f"  kv = {{ memory = '32MiB' }},\n{extra}"
                "}\n")
    return path


def complete(url, prompt, n):
    """A greedy completion without logprobs (a request asking for top logprobs is never drafted
    for): its text, finish reason and token count."""
    status, parsed, raw = su.post_json(url, "/v1/completions", {
        "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}, timeout=300)
    assert status == 200, f"status {status}: {raw[:300]!r}"
    ch = parsed["choices"][0]
    return (ch["text"], ch["finish_reason"], parsed["usage"]["completion_tokens"])


def toks(results):
    return [tuple(r) for r in results]


def reference():
    with su.server("-m", su.MODEL, "-t", "1", "--kv-mem", "32M", "--max-seqs", "16",
                   "--step-tokens", "512", "--spec", "off", model=None) as srv:
        one = [complete(srv.url, p, TOKENS) for p in PROMPTS]
        return toks(one)


def compare(want, got, what):
    bad = [f"prompt {i} ({PROMPTS[i]!r}): one process {a} vs {what} {b}"
           for i, (a, b) in enumerate(zip(want, got)) if a != b]
    assert not bad, "\n".join(bad)


def drafted(url):
    text = su.metrics(url)
    return (su.metric(text, "shoal_drafter_tokens_total", node="d0") or 0,
            su.metric(text, "shoal_spec_accepted_tokens_total") or 0)


def wait_drafted(url, above):
    """The node's metrics reach the front once a second: waits for the counter to pass above."""
    deadline = time.monotonic() + su.scaled(10)
    while True:
        got = drafted(url)
        if got[0] > above or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def equal_through_drafter(d, want, keyed=False):
    path = script(os.path.join(d, "c.lua"), su.MODEL, "d0")
    key = []
    if keyed:  # every node proves the cluster key: the stage takes the drafter node's STEPs
        key = ["--cluster-key-file", os.path.join(d, "cluster.key")]
        with open(key[1], "w") as f:
            f.write("the-key-only-the-cluster-holds\n")
        os.chmod(key[1], 0o600)
    nodes = [tcp.Node(path, "w0", *key), tcp.Node(path, "d0", *key)]
    problems = []
    try:
        for nd in nodes:
            nd.wait_ready()
        assert "drafter of m" in nodes[1].text(), nodes[1].text()[-1000:]
        srv = su.start("-c", path, "--join-timeout", f"{su.scaled(60):g}", *key, model=None)
        try:
            one = toks([complete(srv.url, p, TOKENS) for p in PROMPTS])
            compare(want, one, "one by one through the drafter node")
            n1, acc1 = wait_drafted(srv.url, 0)
            assert n1 > 0, f"shoal_drafter_tokens_total{{node=\"d0\"}} = {n1}"
            assert acc1 > 0, f"shoal_spec_accepted_tokens_total = {acc1}"
            if not keyed:
                many = toks(su.at_once(srv.url, PROMPTS, TOKENS, complete))
                compare(want, many, "all at once through the drafter node")
                n2, acc2 = wait_drafted(srv.url, n1)
                assert n2 > n1 and acc2 > acc1, f"drafted {n1} -> {n2}, accepted {acc1} -> {acc2}"
                su.log(f"note: {n2:.0f} tokens drafted on d0, {acc2:.0f} accepted")
                bad = [ln for ln in srv.log_text().splitlines() if "step_answer_bad" in ln]
                assert not bad, "\n".join(bad[:5])
        finally:
            problems += su.stop(srv)
    finally:
        for nd in nodes:
            problems += nd.stop()
    assert not problems, "\n".join(problems)


def drafter_node_dies(d, want):
    path = script(os.path.join(d, "k.lua"), su.MODEL, "d0",
                  extra="  watchdog = { heartbeat_ms = 100, dead_after = 3 },\n")
    w0, d0 = tcp.Node(path, "w0"), tcp.Node(path, "d0")
    problems = []
    try:
        w0.wait_ready()
        d0.wait_ready()
        srv = su.start("-c", path, "--join-timeout", f"{su.scaled(60):g}",
                       "--recover-timeout", f"{su.scaled(60):g}", model=None)
        try:
            compare(want[:1], [complete(srv.url, PROMPTS[0], TOKENS)], "before the kill")
            out = {}

            def bg(key, prompt, n):
                out[key] = complete(srv.url, prompt, n)
            # A long request in flight when the node dies, another sent while it is down.
            long_req = threading.Thread(target=bg, args=("long", PROMPTS[3], 5 * TOKENS))
            long_req.start()
            time.sleep(0.3)
            d0.proc.kill()
            d0.proc.wait()
            deadline = time.monotonic() + su.scaled(10)
            while "d0 (" not in srv.log_text() or "was lost" not in srv.log_text():
                assert time.monotonic() < deadline, "the front did not judge d0 lost:\n" + \
                    srv.log_text()[-2000:]
                time.sleep(0.05)
            t = threading.Thread(target=bg, args=("late", PROMPTS[1], TOKENS))
            t.start()
            time.sleep(1.0)
            assert t.is_alive(), "a request finished while the drafter's node was down"
            d0 = tcp.Node(path, "d0")
            d0.wait_ready()
            t.join(su.scaled(120))
            long_req.join(su.scaled(120))
            assert not t.is_alive() and not long_req.is_alive(), \
                "a request did not finish after d0 came back"
            compare(want[1:2], [out["late"]], "sent while the drafter's node was down")
            # Greedy: the long request's first TOKENS tokens are the reference's.
            assert out["long"][0].startswith(want[3][0]) and out["long"][2] == 5 * TOKENS, \
                f"in flight at the kill: {out['long']!r} vs {want[3]!r}"
            assert "d0" in srv.log_text() and "resumed" in srv.log_text(), srv.log_text()[-2000:]
        finally:
            problems += su.stop(srv)
    finally:
        problems += w0.stop()
        problems += d0.stop()
    assert not problems, "\n".join(problems)


def node_exits(path, want):
    p = subprocess.run([su.shoal_binary(), "node", "-c", path, "--name", "d0", "-t", "1"],
                       cwd=su.ROOT, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       timeout=su.scaled(60))
    assert p.returncode == 2, f"exit {p.returncode}, want 2:\n{p.stderr}"
    errs = [ln for ln in p.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errs) == 1, f"want one error line:\n{p.stderr}"
    for w in want:
        assert w in errs[0], f"{errs[0]!r} lacks {w!r}"


def bad_drafts(d):
    node_exits(script(os.path.join(d, "vocab.lua"), STORIES), ["drafter", "vocabulary"])
    missing = os.path.join(d, "missing.gguf")
    node_exits(script(os.path.join(d, "missing.lua"), missing), ["drafter", "missing.gguf"])
    tcp.front_exits(script(os.path.join(d, "shared.lua"), su.MODEL, stage_node="w0"),
                    ["node 'w0'", "holds only the drafter"])


def main():
    if not os.path.exists(su.MODEL) or not os.path.exists(STORIES):
        su.skip("the default model or stories260K is missing")
    r = su.Runner("test_cluster_drafter")
    d = tempfile.mkdtemp(prefix="shdr-", dir="/tmp")  # ipc:// paths stay short
    try:
        want = reference()
        r.case("(a) front + stage node + drafter node == one process without speculation",
               equal_through_drafter, d, want)
        r.case("(a) the same with a cluster key, one by one", equal_through_drafter, d, want, True)
        r.case("(b) the drafter's node dies and comes back: the replica waits and resumes",
               drafter_node_dies, d, want)
        r.case("(c) bad drafts exit 2 with the reason", bad_drafts, d)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    r.finish()


if __name__ == "__main__":
    main()
