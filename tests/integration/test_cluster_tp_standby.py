"""A standby taking a tensor-parallel rank's place (issue 26, docs/cluster.md "Standby nodes" and
"Tensor parallelism"), on real processes: `shoal node` workers w0 and w1 holding the two ranks of
stories260K's one stage, a third `shoal node` declared standby = true, and a `shoal serve -c`
front with --recover-timeout, over ipc://. Eight greedy requests of 256 tokens run at once; a
node holding a rank is killed (kill -9) and not restarted; the front promotes the standby into
that rank (it loads the rank's slices, or preloaded them), tells the group's ranks where the new
one is, the group forms anew with a new epoch and every request ends with the undisturbed run's
text, tokens and logprobs (the nodes keep an F32 KV cache, against `shoal serve --kv-f32`: within
issue 26's 1e-3, as test_cluster_tp's f32 case).

Cases:
- a hot standby (preload = 'w1') replaces rank 1 over shared memory;
- a hot standby (preload = 'w0') replaces the leader (rank 0) over shared memory: the batcher is
  rerouted to it and rank 1 takes its steps from it;
- a cold standby (no preload) replaces rank 1 of a group over the network collective
  (tp_link = 'net'): it loads the slices on promotion and the ranks learn its URL;
- a cold standby replaces the leader over the network collective;
- 2 stages x 2 ranks: a hot standby (preload = 'w2') replaces the second stage's leader: the
  first stage's leader sends its ACT there, and w3 takes its steps from it;
- the promoted hot standby (in rank 1's place) is killed in turn and started again: the new
  process takes rank 1 back;
- a standby started with another script (its group over the network, the front's over shared
  memory) is refused by name at its promotion; the front then waits for the dead rank, which is
  started again, and every request still ends with the undisturbed text.
"""

import os
import re
import shutil
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402
from test_cluster_pipeline import PROMPTS, Node, complete  # noqa: E402
from test_cluster_tp import F32_KV_LP_TOL, STORIES, reference, same  # noqa: E402

N = 8         # requests at once
TOKENS = 384  # per request: long enough to be in flight at the kill


def workers(two):
    return ("w0", "w1", "w2", "w3") if two else ("w0", "w1")


def write(d, name, preload=None, net=False, sock=None, two=False):
    """front, w0 and w1 (one stage of 2 ranks; with two, w2 and w3 as a second stage of 2 ranks)
    and a standby 'spare' over ipc:// in d (sockets named after `sock`, default `name`)."""
    path = os.path.join(d, f"{name}.lua")
    name = sock or name
    pre = f", preload = '{preload}'" if preload else ""
    link = ", tp_link = 'net'" if net else ""
    ws = "".join(f"    node {{ name = '{w}', listen = 'ipc://{d}/{name}-{w}.sock' }},\n"
                 for w in workers(two))
    groups = "{ 'w0', 'w1' }, { 'w2', 'w3' }" if two else "{ 'w0', 'w1' }"
    with open(path, "w") as f:
        f.write(f"local m = model {{ path = '{STORIES}', name = 'm' }}\n"
                "return cluster {\n"
                f"  nodes = {{ node {{ name = 'front', listen = 'ipc://{d}/{name}-front.sock' }},\n"
                f"{ws}"
                f"    node {{ name = 'spare', listen = 'ipc://{d}/{name}-spare.sock', "
                f"standby = true{pre} }} }},\n"
                "  gateway = { node = 'front', http = '127.0.0.1:8080' },\n"
                f"  replicas = {{ replica {{ model = m, stages = pipeline(m, {{ {groups} }})"
                f"{link} }} }},\n"
                "  batcher = { max_seqs = 16, max_step_tokens = 512 },\n"
                "  kv = { memory = '32MiB', type = 'f32' },\n"
                "}\n")
    return path


def wait_for(what, cond, timeout, tail):
    deadline = time.monotonic() + su.scaled(timeout)
    while not cond():
        assert time.monotonic() < deadline, f"no {what} within {timeout} s:\n{tail()}"
        time.sleep(0.02)


def epochs(text):
    return {ln.split("epoch=")[1].split()[0] for ln in text.splitlines()
            if "event=tp_group" in ln}


def under_load(d, name, want, victim, preload=None, net=False, standby_script=None,
               again=False, two=False):
    """Starts the cluster, sends N requests at once, kills `victim` (w0 or w1) with 8 of them
    in flight and checks that the standby took its rank and every request ended as `want`.
    With standby_script, the standby runs another script: its promotion must be refused by
    name, and `victim` is started again instead. With again, the promoted standby is then
    killed and started again: it takes the rank back (promoted in place). With two, the replica
    has a second stage of 2 ranks on w2 and w3."""
    path = write(d, name, preload, net, None, two)
    nodes = {w: Node(standby_script if w == "spare" and standby_script else path, w)
             for w in workers(two) + ("spare",)}
    srv = None
    problems = []
    killed = []  # the nodes killed on purpose (their logs go when the case passes)
    rank = 0 if victim in ("w0", "w2") else 1
    survivor = {"w0": "w1", "w1": "w0", "w2": "w3", "w3": "w2"}[victim]
    try:
        for nd in nodes.values():
            nd.wait_ready()
        sp = nodes["spare"].text()
        if preload:
            pr = 0 if preload in ("w0", "w2") else 1
            assert re.search(rf"hot standby for node {preload}: preloaded stage [12] layers "
                             rf"\[[0-9]+, [0-9]+\) \(rank {pr} of 2\)", sp), sp
        else:
            assert "cold standby" in sp, sp
        srv = su.start("-c", path, "--join-timeout", f"{su.scaled(60):g}", "--recover-timeout",
                       "30", model=None)
        out = [None] * N

        def one(i):
            try:
                out[i] = complete(srv.url, PROMPTS[i], TOKENS)
            except Exception as exc:  # noqa: BLE001
                out[i] = exc

        ts = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(N)]
        for t in ts:
            t.start()
        # Every request has its first tokens (the group formed and ran) before the kill.
        wait_for("group's steps", lambda: len(epochs(nodes["w0"].text())) >= 1, 60,
                 lambda: nodes["w0"].text()[-2000:])
        time.sleep(0.1)
        t0 = time.monotonic()
        killed.append(nodes[victim])
        nodes[victim].proc.kill()
        nodes[victim].proc.wait()
        open_at_kill = sum(1 for x in out if x is None)
        if standby_script:
            wait_for("refusal", lambda: "promotion of standby spare failed" in srv.log_text(),
                     30, srv.log_tail)
            log = srv.log_text()
            assert re.search(r"promotion of standby spare failed: standby spare is refused: "
                             r"stage 1: its group links over the network, the script's over "
                             r"shared memory", log), log[-3000:]
            assert f"waiting for node {victim} instead" in log, log[-3000:]
            nodes[victim] = Node(path, victim).wait_ready()
            wait_for("resume", lambda: "replica 1 resumed" in srv.log_text(), 60, srv.log_tail)
            took = time.monotonic() - t0
        else:
            pat = re.compile(rf"node {victim} was replaced by standby spare in ([0-9.]+) s; "
                             r"replica 1 resumed")
            wait_for("promotion", lambda: pat.search(srv.log_text()), 30, srv.log_tail)
            took = time.monotonic() - t0
        if again:
            time.sleep(0.1)
            t1 = time.monotonic()
            killed.append(nodes["spare"])
            nodes["spare"].proc.kill()
            nodes["spare"].proc.wait()
            open_again = sum(1 for x in out if x is None)
            nodes["spare"] = Node(path, "spare").wait_ready()
            back = re.compile(r"node spare was replaced by standby spare in [0-9.]+ s; replica 1 "
                              r"resumed")
            wait_for("promotion in place", lambda: back.search(srv.log_text()), 30,
                     srv.log_tail)
            su.log(f"note: {name}: the promoted standby killed with {open_again} requests open "
                   f"took rank {rank} back {time.monotonic() - t1:.2f} s after its kill")
        for t in ts:
            t.join(su.scaled(180))
        for i, r in enumerate(out):
            assert not isinstance(r, Exception) and r is not None, f"prompt {i}: {r!r}"
        assert open_at_kill > 0, "every request had ended at the kill: nothing was tested"
        if not standby_script:
            sp = nodes["spare"].text()
            assert re.search(rf"node spare promoted: serving stage [12] layers \[[0-9]+, [0-9]+\) "
                             rf"\(rank {rank} of 2\)", sp), sp[-2000:]
            assert f"event=tp_group rank={rank} size=2" in sp, sp[-2000:]
            assert "event=tp_regroup" in nodes[survivor].text(), nodes[survivor].text()[-2000:]
            # The group formed anew: the survivor joined a group of another epoch.
            ep = epochs(nodes[survivor].text())
            assert len(ep) >= (3 if again else 2), f"{survivor} formed its group in {ep} only"
        su.log(f"note: {name}: {victim} (rank {rank}) killed with {open_at_kill} of {N} requests "
               f"open; resumed {took:.2f} s after the kill")
    finally:
        if srv is not None:
            problems += su.stop(srv) if srv.proc.poll() is None else \
                [f"the front exited {srv.proc.returncode}"]
        for w, nd in nodes.items():
            if nd.proc.poll() is None:
                problems += nd.stop()
            elif nd not in killed:
                problems.append(f"node {w} exited {nd.proc.returncode}:\n{nd.text()[-1500:]}")
    assert not problems, "\n".join(problems)
    for nd in killed:
        os.unlink(nd.logpath)
    same(want, out, f"{name}: {victim} replaced", F32_KV_LP_TOL)


def main():
    if not os.path.exists(STORIES):
        su.skip(f"{STORIES} missing")
    r = su.Runner("test_cluster_tp_standby")
    d = tempfile.mkdtemp(prefix="shtps-", dir="/tmp")  # ipc:// paths stay short
    try:
        want = reference(STORIES, PROMPTS[:N], TOKENS, complete, "--kv-f32")
        r.case("a hot standby takes rank 1's place (shared memory), every output unchanged",
               under_load, d, "hot1", want, "w1", "w1")
        r.case("a hot standby takes the leader's place (shared memory), every output unchanged",
               under_load, d, "hot0", want, "w0", "w0")
        r.case("a cold standby takes rank 1's place (network collective), every output unchanged",
               under_load, d, "net1", want, "w1", None, True)
        r.case("a cold standby takes the leader's place (network collective), every output "
               "unchanged", under_load, d, "net0", want, "w0", None, True)
        other = write(d, "refused-other", None, True, "refused")
        r.case("2 stages x 2 ranks: a hot standby takes the second stage's leader's place (the "
               "first stage's leader rerouted to it), every output unchanged", under_load, d,
               "two", want, "w2", "w2", two=True)
        r.case("the promoted standby killed and restarted takes rank 1 back, every output "
               "unchanged", under_load, d, "again", want, "w1", "w1", False, None, True)
        r.case("a standby whose group links otherwise is refused by name; the rank restarted "
               "instead, every output unchanged", under_load, d, "refused", want, "w1", None,
               False, other)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    r.finish()


if __name__ == "__main__":
    main()
