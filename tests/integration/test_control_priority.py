"""The control path's priority over compute (--control-nice; docs/cluster.md, "Heartbeats under
load") on real processes: a `shoal node` worker, the `shoal serve -c` front beside it (over
ipc://, and over tls+tcp://, which runs on NNG's threads), a one-process `shoal serve`, and the
nodes of `shoal cluster up --control-nice 4`. Each thread's nice value is read from
/proc/PID/task/TID/stat and its name from .../comm: the CPU backend's compute threads
(shoal-cpu-N) must run N nice steps below every other thread (the runtime's loops shoal-loop-N,
NNG's nng:* threads, the main thread).

Where this test may raise a priority (root, CAP_SYS_NICE or RLIMIT_NICE) the control threads must
be raised by N and the compute threads left at the starting nice; where it may not, the compute
threads must be lowered by N instead when --control-nice was given, and every thread left alike
without it (lowered compute threads would yield to every other program too). As root, both are
also run with CAP_SYS_NICE dropped (setpriv), so every path is checked on one machine. --control-nice 0 leaves every thread
alike; a bad value is refused with exit 2.
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402
from test_cluster_pipeline import STORIES, Node, script  # noqa: E402
from test_cluster_tls import make_ca, make_node  # noqa: E402
from test_cluster_tls import script as tls_script  # noqa: E402

GAP = 10  # the default --control-nice
ORIG = os.getpriority(os.PRIO_PROCESS, 0)  # what the children start from (they inherit it)


class PNode(Node):
    """test_cluster_pipeline's Node at -t 2, optionally under a command prefix (setpriv)."""

    def __init__(self, script_path, name, *extra, prefix=()):
        fd, self.logpath = tempfile.mkstemp(prefix=f"shoal-node-{name}-", suffix=".log")
        logf = os.fdopen(fd, "wb")
        self.name = name
        self.script = script_path
        self.proc = subprocess.Popen([*prefix, su.shoal_binary(), "node", "-c", script_path,
                                      "--name", name, "-t", "2", *extra], cwd=su.ROOT,
                                     stdin=subprocess.DEVNULL, stdout=logf, stderr=logf)
        logf.close()


def can_raise(preexec=None, argv_prefix=()):
    """Whether a child started like the nodes may lower its nice value (raise its priority)."""
    code = ("import os; p = os.getpriority(os.PRIO_PROCESS, 0); "
            "os.setpriority(os.PRIO_PROCESS, 0, max(-20, p - 1)) if p > -20 else exit(1)")
    r = subprocess.run([*argv_prefix, sys.executable, "-c", code], stderr=subprocess.DEVNULL,
                       preexec_fn=preexec)
    return r.returncode == 0


def threads(pid):
    """{tid: (name, nice)} of a live process."""
    out = {}
    base = f"/proc/{pid}/task"
    for tid in os.listdir(base):
        try:
            with open(f"{base}/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"{base}/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended meanwhile
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(tid)] = (name, int(fields[16]))  # field 19 of stat: nice
    return out


def expect(raised, gap=GAP, asked=True):
    """(control nice, compute nice) the process should show (asked: --control-nice was given)."""
    if gap == 0 or (not raised and not asked):
        return ORIG, ORIG
    if raised:
        ctl = max(-20, ORIG - gap)
        return ctl, ORIG
    return ORIG, min(19, ORIG + gap)


def check_threads(what, pid, ctl, comp, n_compute, want_nng=False):
    """Every shoal-cpu-* thread at comp and every other at ctl; the expected threads present."""
    ts = threads(pid)
    table = ", ".join(f"{n}={v}" for n, v in sorted(ts.values()))
    compute = [(n, v) for n, v in ts.values() if n.startswith("shoal-cpu-")]
    control = [(n, v) for n, v in ts.values() if not n.startswith("shoal-cpu-")]
    assert len(compute) == n_compute, \
        f"{what}: {len(compute)} compute threads (shoal-cpu-*), want {n_compute}: {table}"
    loops = [n for n, _ in control if n.startswith("shoal-loop-")]
    assert len(loops) >= 2, f"{what}: fewer than 2 loop threads (shoal-loop-*): {table}"
    if want_nng:
        assert any(n.startswith("nng:") for n, _ in control), \
            f"{what}: no NNG thread (nng:*): {table}"
    bad = [f"{n}={v}" for n, v in compute if v != comp] + \
        [f"{n}={v}" for n, v in control if v != ctl]
    assert not bad, (f"{what}: want control threads at nice {ctl} and compute threads at nice "
                     f"{comp}; these differ: {', '.join(bad)} (all: {table})")
    su.log(f"     {what}: {len(control)} control threads at nice {ctl}, {len(compute)} compute "
           f"at nice {comp}")


def wait_text(get, want, timeout=2.0):
    deadline = time.monotonic() + timeout
    while want not in get():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {want!r} in the log:\n{get()[-2000:]}")
        time.sleep(0.05)


def front(path, *extra):
    return su.start("-c", path, "--recover-timeout", "30", *extra, model=None)


def stop_all(node, srv):
    problems = su.stop(srv) if srv else []
    if node:
        problems += node.stop()
    assert not problems, "\n".join(problems)


def case_cluster(d, raised, label, extra=(), setpriv=(), tls=False):
    """A worker and the front, started with extra flags (and under setpriv when given), over
    ipc:// (the runtime's stream engine, on the loops) or tls+tcp:// (NNG's threads)."""
    path = tls_script(d, f"c-{label}.lua") if tls else \
        script(os.path.join(d, f"c-{label}.lua"), STORIES, ["w0"])
    node = srv = None
    try:
        node = PNode(path, "w0", *extra, prefix=setpriv)
        node.wait_ready()
        gap = GAP
        asked = "--control-nice" in extra
        if asked:
            gap = int(extra[extra.index("--control-nice") + 1])
        ctl, comp = expect(raised, gap, asked)
        # One line says what was chosen.
        if gap == 0:
            wait_text(node.text, "priorities: every thread at nice")
        elif not raised and not asked:
            wait_text(node.text, f"every thread at nice {ORIG} (pass --control-nice N to lower")
        elif raised:
            wait_text(node.text, f"control threads (loops, network, heartbeats) at nice {ctl}, "
                      f"compute threads at nice {comp}")
        else:
            wait_text(node.text, f"so the compute threads run lower, at nice {comp}")
        check_threads(f"node w0 ({label})", node.proc.pid, ctl, comp, 2, want_nng=tls)
        if not setpriv:
            srv = front(path, *extra)
            status, parsed, raw = su.post_json(srv.url, "/v1/completions", {
                "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}, timeout=60)
            assert status == 200, f"completion: {status} {raw[:200]!r}"
            check_threads(f"node w0 ({label}, after a request)", node.proc.pid, ctl, comp, 2,
                          want_nng=tls)
            # The front computes nothing: every thread of it runs at the control priority.
            check_threads(f"front ({label})", srv.proc.pid, ctl, comp, 0, want_nng=tls)
    finally:
        stop_all(node, srv)


def case_serve(raised):
    """One-process `shoal serve`: its compute threads below its loops and HTTP."""
    ctl, comp = expect(raised, GAP, False)
    srv = su.start("-m", STORIES, "-t", "2", model=None)
    try:
        wait_text(srv.log_text, "priorities:")
        status, parsed, raw = su.post_json(srv.url, "/v1/completions", {
            "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}, timeout=60)
        assert status == 200, f"completion: {status} {raw[:200]!r}"
        check_threads("serve", srv.proc.pid, ctl, comp, 2, want_nng=False)
    finally:
        problems = su.stop(srv)
        assert not problems, "\n".join(problems)


def case_cluster_up(d, raised):
    """`shoal cluster up --control-nice 4`: every node it starts takes the flag."""
    path = script(os.path.join(d, "up.lua"), STORIES, ["w0"])
    pid_dir = os.path.join(d, "pids")
    os.makedirs(pid_dir, exist_ok=True)
    fd, logpath = tempfile.mkstemp(prefix="shoal-prio-up-", suffix=".log")
    with os.fdopen(fd, "wb") as logf:
        proc = subprocess.Popen([su.shoal_binary(), "cluster", "up", path, "-t", "2",
                                 "--control-nice", "4", "--pid-dir", pid_dir, "--", "--port", "0"],
                                cwd=su.ROOT, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                                start_new_session=True)

    def text():
        with open(logpath, "rb") as f:
            return f.read().decode("utf-8", "replace")
    try:
        wait_text(text, "cluster: up", timeout=60)
        ctl, comp = expect(raised, 4)
        for name, n_compute in (("w0", 2), ("front", 0)):
            with open(os.path.join(pid_dir, f"{name}.pid")) as f:
                pid = int(f.read().strip())
            check_threads(f"cluster up's {name}", pid, ctl, comp, n_compute)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, f"cluster up exited {proc.returncode}:\n{text()[-2000:]}"
    os.unlink(logpath)


def case_bad_values(d):
    path = script(os.path.join(d, "bad.lua"), STORIES, ["w0"])
    for argv in ([su.shoal_binary(), "node", "-c", path, "--name", "w0", "--control-nice", "20"],
                 [su.shoal_binary(), "node", "-c", path, "--name", "w0", "--control-nice", "x"],
                 [su.shoal_binary(), "serve", "-m", STORIES, "--control-nice", "-1"],
                 [su.shoal_binary(), "cluster", "up", path, "--control-nice", "99"]):
        r = subprocess.run(argv, cwd=su.ROOT, capture_output=True, text=True, timeout=30)
        assert r.returncode == 2 and "--control-nice" in r.stderr, \
            f"{' '.join(argv[1:])}: exit {r.returncode}, stderr {r.stderr!r} (want 2 and a line " \
            "naming --control-nice)"


def main():
    if not sys.platform.startswith("linux"):
        su.skip("reads /proc")
    if not os.path.exists(STORIES):
        su.skip(f"{STORIES} missing")
    raised = can_raise()
    su.log(f"test nice {ORIG}; may raise priority: {raised}")
    r = su.Runner("control_priority")
    d = tempfile.mkdtemp(prefix="shoal-prio-", dir="/tmp")
    try:
        r.case("node and front: compute threads below the control path",
               case_cluster, d, raised, "default")
        if shutil.which("openssl"):
            make_ca(d, "ca")
            make_node(d, "ca", "front")
            make_node(d, "ca", "w0")
            r.case("over tls+tcp://: NNG's threads with the control path", case_cluster, d,
                   raised, "tls", tls=True)
        else:
            su.log("     (tls+tcp:// case not run: no openssl CLI to make certificates)")
        r.case("--control-nice 4 sets the gap", case_cluster, d, raised, "gap4",
               ("--control-nice", "4"))
        r.case("--control-nice 0: every thread alike", case_cluster, d, raised, "off",
               ("--control-nice", "0"))
        r.case("serve: compute threads below the control path", case_serve, raised)
        drop = ["setpriv", "--inh-caps=-sys_nice", "--bounding-set=-sys_nice", "--"]
        if raised and shutil.which("setpriv") and not can_raise(argv_prefix=drop):
            r.case("node without CAP_SYS_NICE, --control-nice 10: the compute threads are "
                   "lowered instead", case_cluster, d, False, "fallback", ("--control-nice", "10"),
                   drop)
            r.case("node without CAP_SYS_NICE, no flag: every thread alike", case_cluster, d,
                   False, "fallback-default", (), drop)
        elif raised:
            su.log("     (fallback case not run: setpriv cannot drop CAP_SYS_NICE here)")
        r.case("cluster up --control-nice 4 reaches every node", case_cluster_up, d, raised)
        r.case("bad --control-nice values exit 2", case_bad_values, d)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    r.finish()


if __name__ == "__main__":
    main()
