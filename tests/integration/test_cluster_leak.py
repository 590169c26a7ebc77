"""The memory watchdog (actors/watchdog.h, docs/cluster.md "Memory budgets") on real processes:
two `shoal node` workers holding the two pipeline stages of stories260K and a `shoal serve -c`
front with --recover-timeout, over ipc://. w1 has a memory budget (node{ memory_budget }) 96 MiB
above what it holds when it starts, and a fault scenario that makes it leak 160 MiB/s for 2 s
under a load of greedy requests. The front's watchdog sees w1's resident memory pass the budget
in its heartbeat answers, drains it (its replica pauses, its requests wait to resume) and asks it
to restart; w1 exits 75, this test starts it again as `shoal cluster up` would, the front greets
the new process and resumes the replica by recompute. No request is lost or differs from the
undisturbed run.
"""

import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402
from test_cluster_pipeline import STORIES, Node, script  # noqa: E402
from test_cluster_watchdog import Load, check, reference, stop_all, wait_log  # noqa: E402

EXIT_RESTART = 75
HEADROOM_MIB = 96


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise AssertionError(f"no VmRSS for pid {pid}")


def leak(d):
    path = os.path.join(d, "leak.lua")
    script(path, STORIES, ["w0", "w1"])
    sc = os.path.join(d, "leak-scenario.lua")
    with open(sc, "w") as f:
        f.write('at(5.0, leak { node = "w1", mb_per_s = 160, lasting = 2 })\n')
    nodes = {"w0": Node(path, "w0"), "w1": Node(path, "w1", "--fault-scenario", sc)}
    problems = []
    srv = None
    try:
        for nd in nodes.values():
            nd.wait_ready()
        budget = int(rss_mib(nodes["w1"].proc.pid)) + HEADROOM_MIB
        # The front reads the budget from the script; the workers' identity does not include it.
        with open(path) as f:
            text = f.read()
        text = text.replace("listen = 'ipc://" + d + "/w1.sock' }",
                            "listen = 'ipc://" + d + f"/w1.sock', memory_budget = '{budget}MiB' }}")
        assert f"memory_budget = '{budget}MiB'" in text, text
        with open(path, "w") as f:
            f.write(text)
        srv = su.start("-c", path, "--join-timeout", "60", "--recover-timeout", "30", model=None)
        ref = reference(srv.url)
        exited = {}

        def supervise():  # what `shoal cluster up` does for a node that exits 75
            code = nodes["w1"].proc.wait()
            exited["code"] = code
            if code == EXIT_RESTART:
                nodes["w1"] = Node(path, "w1")

        sup = threading.Thread(target=supervise, daemon=True)
        sup.start()
        with Load(srv.url) as load:
            t_det, off = wait_log(srv, r"node w1 \([^)]*\) was lost: over its memory budget "
                                  r"\(resident [0-9]+ MiB > " + str(budget) + r" MiB\)", 30)
            n_at = load.count()
            sup.join(30)
            assert exited.get("code") == EXIT_RESTART, \
                f"w1 exited {exited.get('code')} (want {EXIT_RESTART})"
            t_back, _ = wait_log(srv, r"node w1 came back [0-9.]+ s after it was lost \(a new "
                                 r"process\); replica 1 resumed", 30, off)
            time.sleep(1.0)
        across = check(load, ref, t_det, t_back)
        assert load.count() > n_at, "no request finished after the node came back"
        st, _, body = su.get(srv.url, "/admin/status")
        assert st == 200, (st, body[:300])
        kinds = [e["kind"] for e in json.loads(body).get("events", [])]
        assert "drain" in kinds and "resumed" in kinds, kinds
        su.log(f"note: w1 (budget {budget} MiB) drained and restarted; replica resumed "
               f"{t_back - t_det:.2f} s after the drain; {len(load.results)} requests ({across} "
               "across it), all equal to the undisturbed run")
    finally:
        if srv is not None:
            problems += stop_all(srv, nodes)
        else:
            for nd in nodes.values():
                if nd.proc.poll() is None:
                    problems += nd.stop()
    problems = [p for p in problems if not re.search(r"exited with 75", p)]
    assert not problems, "\n".join(problems)


def main():
    if not os.path.exists(STORIES):
        su.skip(f"{STORIES} missing")
    r = su.Runner("test_cluster_leak")
    d = tempfile.mkdtemp(prefix="shlk-", dir="/tmp")  # ipc:// paths stay short
    try:
        r.case("a leaking worker over its memory budget is drained and restarted, no request "
               "lost", leak, d)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    r.finish()


if __name__ == "__main__":
    main()
