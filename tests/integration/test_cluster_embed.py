"""POST /v1/embeddings through a cluster: a `shoal serve -c` front and two `shoal node` workers
holding the default model's two pipeline stages over ipc:// (as test_cluster_pipeline). The last
stage's node pools each prefill chunk (step_out.embd) and the front's batcher combines them.

Cases:
- the 32 texts of test_serve_embed (a long one among them, prefilled in several chunks) embed,
  in one request and alone, the same as a single-process `shoal serve -m` (within 1e-5), with the
  same usage; /v1/models lists the "embeddings" capability; the official `openai` client's
  embeddings.create works (skipped without the package unless SH_REQUIRE_OPENAI);
- the last stage's worker killed (SIGKILL) while a request of 12 long inputs is in flight and
  started again by hand: the front (--recover-timeout 30) pauses the replica, greets the new
  process and resumes; the request ends with 200 and vectors equal to the reference, and the
  front goes on serving. No 503 is accepted: the steps abandoned at the pause that still waited
  in the stages' queues used to run ahead of the resumed ones, which on a loaded machine took the
  first resumed step past the batcher's 30 s step timeout (about 1 run in 12); the stages now
  drop them once a step of the new epoch arrives;
- the last stage's worker killed mid-request and not started again (--recover-timeout 1): the
  request ends with a 503 saying a stage node was lost (the front's log names it), and the
  front exits 3 (fail-stop, as for completions);
- 2 replicas of one stage each behind the router: the batch of 32 equals one process's, and
  both replicas took inputs;
- a tensor-parallel group (one stage of 2 ranks, stories260K): the group's leader pools the
  all-reduced final hidden states; alone and in a batch of 8 agree within 1e-5, and a single
  process's vectors within TP_TOL (the split matrices sum in another order, and the F16 KV
  cache rounds the difference on: 1.7e-5 measured).
"""

import json
import os
import shutil
import sys
import tempfile
import threading
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402
from test_cluster_pipeline import STORIES, Node, script  # noqa: E402
from test_serve_embed import DIM, LONG, TEXTS, check, maxdiff, norm, openai, vecs  # noqa: E402

TOL = 1e-5
TP_TOL = 1e-4
N_LONG = 12  # inputs of the request a worker dies under


def batch():
    b = list(TEXTS)
    b[20] = LONG
    return b


def post(url, body, timeout=300):
    st, a, raw = su.post_json(url, "/v1/embeddings", body, timeout=timeout)
    check(st == 200, f"/v1/embeddings: {st} {raw[:300]!r}")
    return a


def embed_all(url):
    """The batch in one request, TEXTS[7] and LONG alone, LONG x N_LONG: vectors and usage."""
    many = post(url, {"input": batch()})
    out = {"many": vecs(many), "usage": many["usage"]}
    for i in (7, 20):
        out[i] = vecs(post(url, {"input": batch()[i]}))[0]
    return out


def reference():
    with su.server("-m", su.MODEL, "-t", "1", "--kv-mem", "32M", "--max-seqs", "16",
                   "--step-tokens", "512", model=None) as srv:
        return embed_all(srv.url)


def start(d, name):
    path = script(os.path.join(d, f"{name}.lua"), su.MODEL, ["w0", "w1"])
    nodes = {w: Node(path, w) for w in ("w0", "w1")}
    try:
        for nd in nodes.values():
            nd.wait_ready()
        srv = su.start("-c", path, "--join-timeout", f"{su.scaled(60):g}", "--recover-timeout",
                       "30", model=None)
    except BaseException:
        for nd in nodes.values():
            nd.stop()
        raise
    return path, srv, nodes


def stop_all(srv, nodes):
    problems = su.stop(srv) if srv.proc.poll() is None else [
        f"the front exited {srv.proc.returncode}:\n{srv.log_tail(30)}"]
    for nd in nodes.values():
        if nd.proc.poll() is None:
            problems += nd.stop()
    return problems


def compare(ref, got, what):
    worst = 0.0
    check(len(got["many"]) == 32, f"{what}: {len(got['many'])} vectors")
    for i, (a, b) in enumerate(zip(ref["many"], got["many"])):
        check(len(b) == DIM and abs(norm(b) - 1) < TOL, f"{what}: input {i}: {len(b)} numbers, "
              f"norm {norm(b)}")
        d = maxdiff(a, b)
        check(d <= TOL, f"{what}: input {i} in a batch of 32 differs from one process by {d}")
        worst = max(worst, d)
    for i in (7, 20):
        d = maxdiff(ref[i], got[i])
        check(d <= TOL, f"{what}: input {i} alone differs from one process by {d}")
        d2 = maxdiff(got[i], got["many"][i])
        check(d2 <= TOL, f"{what}: input {i} alone vs in the batch differ by {d2}")
        worst = max(worst, d, d2)
    check(got["usage"] == ref["usage"], f"{what}: usage {got['usage']} vs {ref['usage']}")
    return worst


def equal_to_one_process(d, ref):
    _, srv, nodes = start(d, "eq")
    problems = []
    try:
        st, _, raw = su.get(srv.url, "/v1/models")
        check(st == 200, f"/v1/models: {st}")
        caps = json.loads(raw)["data"][0]["capabilities"]
        check("embeddings" in caps, f"/v1/models capabilities {caps}")
        worst = compare(ref, embed_all(srv.url), "2 stages")
        su.log(f"note: 2 stages vs one process: largest |diff| {worst:.3g} "
               f"(usage {ref['usage']})")
        if openai is None:
            check(not os.environ.get("SH_REQUIRE_OPENAI"), "the openai package is missing")
            su.log("     openai client part skipped: the package is missing")
        else:
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0,
                              timeout=120)
            r = c.embeddings.create(model="m", input=[batch()[7]])
            dd = maxdiff(ref[7], r.data[0].embedding)
            check(dd <= TOL, f"openai client through the cluster: differs by {dd}")
            check(r.usage.prompt_tokens > 0, str(r.usage))
    finally:
        problems += stop_all(srv, nodes)
    check(not problems, "\n".join(problems))


def killed_mid_request(d, ref):
    path, srv, nodes = start(d, "kill")
    problems = []
    res = {}

    def run():
        try:
            res["r"] = su.post_json(srv.url, "/v1/embeddings", {"input": [LONG] * N_LONG},
                                    timeout=su.scaled(300))
        except Exception as e:  # noqa: BLE001 (reported below)
            res["r"] = e

    try:
        th = threading.Thread(target=run, daemon=True)
        th.start()
        time.sleep(1.0)
        check(th.is_alive(), "the request ended before the kill: nothing was tested")
        nodes["w1"].proc.kill()
        nodes["w1"].proc.wait()
        t0 = time.monotonic()
        nodes["w1"] = Node(path, "w1")
        nodes["w1"].wait_ready()
        t_up = time.monotonic() - t0
        deadline = time.monotonic() + su.scaled(60)
        while "resumed" not in srv.log_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        t_res = time.monotonic() - t0
        th.join(su.scaled(300))
        check(not th.is_alive(), "the request still open 300 s after the kill: it hangs")
        r = res["r"]
        check(not isinstance(r, Exception), f"request: {r!r}")
        st, a, raw = r
        check(st == 200, f"after the kill and restart: {st} {raw[:300]!r}\n" + srv.log_tail(40))
        got = vecs(a)
        check(len(got) == N_LONG, f"{len(got)} vectors")
        worst = max(maxdiff(ref[20], v) for v in got)
        check(worst <= TOL, f"vectors after the recovery differ from one process by {worst}")
        log = srv.log_text()
        check("was lost" in log and "resumed" in log, "no loss/resume in the log:\n"
              + srv.log_tail(30))
        su.log(f"note: w1 killed mid-request, restarted: the request of {N_LONG} inputs "
               f"ended {time.monotonic() - t0:.1f} s after the kill (w1 up after {t_up:.1f} "
               f"s, the replica resumed after {t_res:.1f} s), 200, largest |diff| "
               f"{worst:.3g}")
        # still serving
        v = vecs(post(srv.url, {"input": batch()[7]}))[0]
        check(maxdiff(ref[7], v) <= TOL, "after the recovery: a new request differs")
    finally:
        problems += stop_all(srv, nodes)
    check(not problems, "\n".join(problems))


def not_back(d):
    path = script(os.path.join(d, "notback.lua"), su.MODEL, ["w0", "w1"])
    nodes = {w: Node(path, w) for w in ("w0", "w1")}
    problems = []
    srv = None
    res = {}

    def run():
        res["r"] = su.post_json(srv.url, "/v1/embeddings", {"input": [LONG] * N_LONG},
                                timeout=su.scaled(120))

    try:
        for nd in nodes.values():
            nd.wait_ready()
        srv = su.start("-c", path, "--join-timeout", f"{su.scaled(60):g}", "--recover-timeout",
                       "1", model=None)
        th = threading.Thread(target=run, daemon=True)
        th.start()
        time.sleep(1.0)
        check(th.is_alive(), "the request ended before the kill: nothing was tested")
        nodes["w1"].proc.kill()
        nodes["w1"].proc.wait()
        th.join(su.scaled(60))
        check(not th.is_alive(), "the request still open 60 s after the kill: it hangs")
        st, a, raw = res["r"]
        msg = ((a or {}).get("error") or {}).get("message", "")
        check(st == 503 and "was lost" in msg, f"after the kill: {st} {raw[:300]!r}")
        check("node w1" in srv.log_text(), "the front's log does not name w1:\n"
              + srv.log_tail(20))
        su.log(f"note: w1 killed, not back: {st} {msg!r}")
        rc = srv.proc.wait(timeout=su.scaled(30))
        check(rc == 3, f"the front exited {rc}, want 3:\n{srv.log_tail(20)}")
    finally:
        if srv and srv.proc.poll() is None:
            problems += su.stop(srv)
        problems += nodes["w0"].stop()
        if nodes["w1"].proc.poll() is None:
            problems += nodes["w1"].stop()
        else:
            os.unlink(nodes["w1"].logpath)
    check(not problems, "\n".join(problems))


def replicas(d, ref):
    path = script(os.path.join(d, "rep.lua"), su.MODEL, ["w0", "w1"],
                  replicas=[["w0"], ["w1"]])
    nodes = {w: Node(path, w) for w in ("w0", "w1")}
    problems = []
    srv = None
    try:
        for nd in nodes.values():
            nd.wait_ready()
        srv = su.start("-c", path, "--join-timeout", f"{su.scaled(60):g}", model=None)
        many = vecs(post(srv.url, {"input": batch()}))
        worst = max(maxdiff(a, b) for a, b in zip(ref["many"], many))
        check(len(many) == 32 and worst <= TOL, f"2 replicas: {len(many)} vectors, |diff| {worst}")
        text = su.metrics(srv.url)
        routed = [su.metric(text, "shoal_router_routed_total", replica=str(k)) for k in (0, 1)]
        check(all(x and x > 0 for x in routed), f"inputs per replica: {routed}")
        su.log(f"note: 2 replicas: largest |diff| {worst:.3g}, inputs per replica {routed}")
    finally:
        if srv:
            problems += stop_all(srv, nodes)
        else:
            for nd in nodes.values():
                problems += nd.stop()
    check(not problems, "\n".join(problems))


def tp_group(d):
    texts = batch()[:8]
    with su.server("-m", STORIES, "-t", "1", "--kv-mem", "32M", "--max-seqs", "16",
                   "--step-tokens", "512", model=None) as srv:
        want = vecs(post(srv.url, {"input": texts}))
    path = script(os.path.join(d, "tp.lua"), STORIES, ["w0", "w1"],
                  stages="pipeline(m, { { 'w0', 'w1' } })")
    nodes = {w: Node(path, w) for w in ("w0", "w1")}
    problems = []
    srv = None
    try:
        for nd in nodes.values():
            nd.wait_ready()
        srv = su.start("-c", path, "--join-timeout", f"{su.scaled(60):g}", model=None)
        got = vecs(post(srv.url, {"input": texts}))
        alone = vecs(post(srv.url, {"input": texts[3]}))[0]
        d_self = maxdiff(alone, got[3])
        check(d_self <= TOL, f"in the group, alone and in a batch of 8 differ by {d_self}")
        worst = max(maxdiff(a, b) for a, b in zip(want, got))
        worst = max(worst, maxdiff(want[3], alone))
        su.log(f"note: tensor-parallel group of 2 (stories260K) vs one process: largest |diff| "
               f"{worst:.3g}; alone vs batch in the group {d_self:.3g}")
        check(worst <= TP_TOL, f"the group's vectors differ from one process's by {worst}")
        check(all(len(v) == 64 and abs(norm(v) - 1) < TOL for v in got), "not unit vectors")
    finally:
        if srv:
            problems += stop_all(srv, nodes)
        else:
            for nd in nodes.values():
                problems += nd.stop()
    check(not problems, "\n".join(problems))


def main():
    su.require_model()
    r = su.Runner("test_cluster_embed")
    d = tempfile.mkdtemp(prefix="shce-", dir="/tmp")  # ipc:// paths stay short
    try:
        ref = reference()
        r.case("2 stages over ipc:// embed as one process (alone and in a batch of 32, usage, "
               "capabilities, openai client)", equal_to_one_process, d, ref)
        r.case("the last stage's worker killed mid-request and restarted: the request resumes "
               "with the same vectors, the front serves on", killed_mid_request, d, ref)
        r.case("the last stage's worker killed, not back within --recover-timeout 1: 503, the "
               "front exits 3", not_back, d)
        r.case("2 replicas behind the router embed as one process", replicas, d, ref)
        r.case("a tensor-parallel group of 2 ranks embeds as one process", tp_group, d)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    r.finish()


if __name__ == "__main__":
    main()
