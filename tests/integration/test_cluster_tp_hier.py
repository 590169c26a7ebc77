"""A tensor-parallel group over two levels (issue 26: "a two-level scheme when a group spans hosts
with several ranks each"; docs/cluster.md "Tensor parallelism"), with real processes: four
`shoal node` ranks of one stage and a `shoal serve -c` front, greedy completions (all sent at
once, 5 top logprobs per token) against a single-process `shoal serve -m` of the same file.

Cases:
- stories260K, one stage of 4 ranks with `tp_link = "hier"`, w0 and w1 on tcp://127.0.0.1, w2
  and w3 on tcp://127.0.0.2: two pseudo-hosts, as "hier" takes each URL's host part as written.
  Each host's ranks exchange through a shared-memory segment, its leader (w0, w2) over the
  network collective on its port + 1000. Tokens and text must equal one process's (a split only
  at a near-tie, top-2 gap < 1e-3), logprobs within 5e-3 (test_cluster_tp_eq.py's bounds); every
  rank logs a hier group and prints itself as "two levels"; the leaders' series count bytes on the
  wire and the other ranks' none.
- the same nodes with `tp_link = "auto"`: every 127.x address is this host, so the group links
  over shared memory (kind=shm), and its completions are the same.
- `tp_link = "hier"`, the second host's leader (w2) killed with SIGKILL under 8 requests of 256
  tokens: its host's other rank and, through the leaders' group, the first host's ranks fail
  their call; the replica pauses, w2 is started again, the group forms anew (a new epoch) and
  every request ends with one process's text (up to near-ties, as above).
"""

import os
import random
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402
from test_cluster_pipeline import PROMPTS, Node  # noqa: E402
from test_cluster_tp import STORIES, Cluster, at_once, complete_top  # noqa: E402
from test_cluster_tp_eq import EXACT_LP, NEAR_TIE, agree, reference  # noqa: E402

RANKS = ["w0", "w1", "w2", "w3"]
HOSTS = ["127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.2"]


def free_ports(n):
    """n ports P with P and P + 1000 free on both addresses, from 20000-26999 (below the
    ephemeral range; random, so that parallel tests do not pick the same)."""
    out, taken = [], set()
    rng = random.Random(os.getpid() ^ int.from_bytes(os.urandom(4), "little"))
    while len(out) < n:
        p = rng.randrange(20000, 26000)
        if p in taken or p + 1000 in taken:
            continue
        ok = True
        for host in ("127.0.0.1", "127.0.0.2"):
            for q in (p, p + 1000):
                with socket.socket() as s:
                    try:
                        s.bind((host, q))
                    except OSError:
                        ok = False
        if ok:
            out.append(p)
            taken |= {p, p + 1000}
    return out


def script(path, link):
    ports = free_ports(1 + len(RANKS))
    ns = [f"node {{ name = 'front', listen = 'tcp://127.0.0.1:{ports[0]}' }}"]
    ns += [f"node {{ name = '{w}', listen = 'tcp://{h}:{p}' }}"
           for w, h, p in zip(RANKS, HOSTS, ports[1:])]
    group = ", ".join(f"'{w}'" for w in RANKS)
    with open(path, "w") as f:
        f.write(f"local m = model {{ path = '{STORIES}', name = 'm' }}\n"
                "return cluster {\n"
                f"  nodes = {{ {', '.join(ns)} }},\n"
                "  gateway = { node = 'front', http = '127.0.0.1:8080' },\n"
                f"  replicas = {{ replica {{ model = m, stages = pipeline(m, {{ {{ {group} }} }}), "
                f"tp_link = '{link}' }} }},\n"
                "  batcher = { max_seqs = 16, max_step_tokens = 512 },\n"
                "  kv = { memory = '32MiB' },\n"
                "}\n")
    su.log(f"note: {link}: ports {ports} (the leaders' collective links on +1000)")
    return path


def wire_bytes(url):
    """Each rank's shoal_tp_collective_wire_bytes_total on the front's /metrics, by node."""
    text = su.metrics(url)
    return {w: su.metric(text, "shoal_tp_collective_wire_bytes_total", node=w) for w in RANKS}


def run(d, link, kind, printed, want):
    c = Cluster(script(os.path.join(d, f"{link}.lua"), link), RANKS)
    try:
        c.start()
        got = at_once(c.srv.url, PROMPTS, 64, complete_top)
        for w, nd in c.nodes.items():
            t = nd.text()
            assert "event=tp_group" in t and f"kind={kind}" in t, \
                f"{w} formed no {kind} group:\n{t[-1500:]}"
            assert f"of 4, {printed})" in t, f"{w} does not print '{printed}':\n{t[-1500:]}"
        if kind == "hier":
            deadline = time.monotonic() + su.scaled(15)
            while True:  # the nodes report their series each second
                wb = wire_bytes(c.srv.url)
                if None not in wb.values() and wb["w0"] > 0 and wb["w2"] > 0:
                    break
                assert time.monotonic() < deadline, f"wire bytes by node: {wb}"
                time.sleep(0.2)
            assert wb["w1"] == 0 and wb["w3"] == 0, f"non-leaders sent on the wire: {wb}"
            su.log(f"note: wire bytes by node {wb}")
    finally:
        c.stop()
    assert all(r[2] == 64 for r in got), [r[2] for r in got]
    return agree(want, got, f"s1x4 {link}", NEAR_TIE, EXACT_LP)


def leader_killed(d, want):
    path = script(os.path.join(d, "kill.lua"), "hier")
    c = Cluster(path, RANKS)
    try:
        c.start()
        out = [None] * 8

        def one(i):
            try:
                out[i] = complete_top(c.srv.url, PROMPTS[i], 256)
            except Exception as exc:  # noqa: BLE001
                out[i] = exc

        ts = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(8)]
        for t in ts:
            t.start()
        time.sleep(0.15)
        w2 = c.nodes["w2"]
        w2.proc.send_signal(signal.SIGKILL)
        w2.proc.wait()
        su.log(f"note: {sum(1 for x in out if x is not None)} of 8 requests had ended at the kill")
        deadline = time.monotonic() + su.scaled(10)
        while "node w2" not in c.srv.log_text() or "was lost" not in c.srv.log_text():
            assert time.monotonic() < deadline, c.srv.log_tail()
            time.sleep(0.05)
        c.nodes["w2"] = Node(path, "w2").wait_ready()
        for t in ts:
            t.join(su.scaled(120))
        for i, r in enumerate(out):
            assert not isinstance(r, Exception) and r is not None, f"prompt {i}: {r!r}"
        assert "replica 1 resumed" in c.srv.log_text(), c.srv.log_tail()
        for w in ("w0", "w1", "w3"):
            epochs = {ln.split("epoch=")[1].split()[0] for ln in c.nodes[w].text().splitlines()
                      if "event=tp_group" in ln and "kind=hier" in ln}
            assert len(epochs) >= 2, f"{w} formed its group once only: {epochs}"
    finally:
        c.stop()
    assert all(r[2] == 256 for r in out), [r[2] for r in out]
    return agree(want, out, "s1x4 hier, w2 killed", NEAR_TIE, EXACT_LP)


def main():
    if not os.path.exists(STORIES):
        su.skip(f"{STORIES} missing")
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.2", 0))
        except OSError:
            su.skip("127.0.0.2 is not a local address here")
    r = su.Runner("test_cluster_tp_hier")
    d = tempfile.mkdtemp(prefix="shtph-", dir="/tmp")
    try:
        want = reference(STORIES, PROMPTS, 64)
        r.case("stories260K: one stage of 4 ranks over 2 pseudo-hosts (tp_link = 'hier': shared "
               "memory within each, the leaders over tcp) equals one process", run, d, "hier",
               "hier", "two levels", want)
        r.case("the same nodes with tp_link = 'auto' (127.x is this host: shared memory) equal "
               "one process", run, d, "auto", "shm", "shared memory", want)
        want_long = reference(STORIES, PROMPTS[:8], 256)
        r.case("the second host's leader killed under load: paused, restarted, regrouped over two "
               "levels, every text one process's", leader_killed, d, want_long)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    r.finish()


if __name__ == "__main__":
    main()
