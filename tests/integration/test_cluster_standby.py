"""Standby nodes (docs/cluster.md "Standby nodes") on real processes: two `shoal node` workers
holding the two pipeline stages of stories260K, a third `shoal node` declared standby = true, and
a `shoal serve -c` front, over ipc://, under a load of greedy requests (streaming and not). Every
request must end with the undisturbed run's text.

Cases:
- a hot standby (preload = "w1") replaces w1 after kill -9 (w1 is not restarted): the front's
  watchdog sees the link break, promotes the standby (its stages are already loaded, so it only
  spawns them), reroutes w0's stage to it and resumes the replica;
- a cold standby replaces w0, the first stage, after kill -9: it loads the layers on promotion,
  and the batcher's steps go to its new address;
- the promoted standby is then killed and started again: the new process takes the same stages
  back (promoted in place) and the replica resumes.
"""

import os
import re
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402
from test_cluster_pipeline import STORIES, Node  # noqa: E402
from test_cluster_watchdog import Load, check, reference, stop_all, wait_log  # noqa: E402


def write_script(d, name, preload):
    path = os.path.join(d, f"{name}.lua")
    pre = f", preload = '{preload}'" if preload else ""
    with open(path, "w") as f:
        f.write(f"local m = model {{ path = '{STORIES}', name = 'm' }}\n"
                "return cluster {\n"
                f"  nodes = {{ node {{ name = 'front', listen = 'ipc://{d}/{name}-front.sock' }},\n"
                f"    node {{ name = 'w0', listen = 'ipc://{d}/{name}-w0.sock' }},\n"
                f"    node {{ name = 'w1', listen = 'ipc://{d}/{name}-w1.sock' }},\n"
                f"    node {{ name = 'spare', listen = 'ipc://{d}/{name}-spare.sock', "
                f"standby = true{pre} }} }},\n"
                "  gateway = { node = 'front', http = '127.0.0.1:8080' },\n"
                "  replicas = { replica { model = m, stages = pipeline(m, { 'w0', 'w1' }) } },\n"
                "  batcher = { max_seqs = 16, max_step_tokens = 512 },\n"
                "  kv = { memory = '32MiB' },\n"
                "}\n")
    return path


def start(d, name, preload):
    path = write_script(d, name, preload)
    nodes = {w: Node(path, w) for w in ("w0", "w1", "spare")}
    try:
        for nd in nodes.values():
            nd.wait_ready()
        srv = su.start("-c", path, "--join-timeout", "60", "--recover-timeout", "30", model=None)
    except BaseException:
        for nd in nodes.values():
            nd.stop()
        raise
    return path, srv, nodes


def replaced(d, name, preload, victim, then_restart_spare=False):
    path, srv, nodes = start(d, name, preload)
    problems = []
    try:
        sp = nodes["spare"].text()
        want = "hot standby for node w1: preloaded stage 2" if preload else "cold standby"
        assert want in sp, sp
        ref = reference(srv.url)
        with Load(srv.url) as load:
            while load.count() < 8:
                time.sleep(0.01)
            t0 = time.monotonic()
            nodes[victim].proc.kill()
            nodes[victim].proc.wait()
            t_rep, off = wait_log(srv, rf"node {victim} was replaced by standby spare in "
                                  r"[0-9.]+ s; replica 1 resumed", 30)
            n_at = load.count()
            note = f"{victim} killed: replaced and resumed {t_rep - t0:.2f} s after the kill"
            if then_restart_spare:
                time.sleep(0.5)
                t1 = time.monotonic()
                nodes["spare"].proc.kill()
                nodes["spare"].proc.wait()
                wait_log(srv, r"node spare \([^)]*\) was lost", 5, off)
                nodes["spare"] = Node(path, "spare")
                nodes["spare"].wait_ready()
                t_back, _ = wait_log(srv, r"node spare was replaced by standby spare in [0-9.]+ s; "
                                     r"replica 1 resumed", 30, off)
                note += f"; the standby killed and restarted took its stages back " \
                        f"{t_back - t1:.2f} s after its kill"
            time.sleep(1.0)
        across = check(load, ref, t0, t_rep)
        assert load.count() > n_at, "no request finished after the promotion"
        sp = nodes["spare"].text()
        assert re.search(r"node spare promoted: serving stage [12]", sp), sp[-2000:]
        su.log(f"note: {note}; {len(load.results)} requests ({across} across the first kill), "
               "all equal to the undisturbed run")
        del nodes[victim]
    finally:
        problems += stop_all(srv, nodes)
    assert not problems, "\n".join(problems)


def main():
    if not os.path.exists(STORIES):
        su.skip(f"{STORIES} missing")
    r = su.Runner("test_cluster_standby")
    d = tempfile.mkdtemp(prefix="shsb-", dir="/tmp")  # ipc:// paths stay short
    try:
        r.case("a hot standby replaces the last stage's node after kill -9, every output equal",
               replaced, d, "hot", "w1", "w1")
        r.case("a cold standby replaces the first stage's node after kill -9, every output equal",
               replaced, d, "cold", None, "w0")
        r.case("the promoted standby killed and restarted takes its stages back, every output "
               "equal", replaced, d, "again", "w1", "w1", True)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    r.finish()


if __name__ == "__main__":
    main()
