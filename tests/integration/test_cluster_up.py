"""`shoal cluster up`: one command runs every node of a local cluster script as supervised child
processes (issue 11, docs/cluster.md "One machine, one command"), against real processes: a
2-stage stories260K pipeline (workers w0 and w1, front 'front') over ipc:// in a temp dir.

Cases:
- up, 8 greedy streams, kill -9 of worker w1 while they run: the supervisor restarts w1 alone,
  the front (started with --recover-timeout) pauses the replica, greets w1 again and resumes, and
  every stream finishes with the text of an undisturbed run; SIGTERM to `cluster up` stops the
  front and then the workers, it exits 0, and no process of its session is left; no child log
  shows a crash or sanitizer report.
- 2 replicas: kill -9 of replica 2's worker: replica 1 serves meanwhile, then replica 2 resumes
  and takes requests again.
- a node that keeps failing before it is up (a --bin wrapper that makes w1 exit 1): `cluster up`
  gives up after 5 tries, exits 1 naming w1, and leaves no process.
- kill -9 of `cluster up` itself: its children die with it (PR_SET_PDEATHSIG).
- a node whose URL is not on this machine is refused with exit 2 naming it; `cluster status` of
  a URL nobody listens on exits 2 naming it.
"""

import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402
from test_cluster_pipeline import PROMPTS, STORIES, script  # noqa: E402

UP_S = 90.0       # first start (sanitizer builds on a loaded machine are slow)
RECOVER_S = 20.0  # from kill -9 of a worker to a working replica again
STOP_S = 60.0
UP_RE = re.compile(r"^cluster: up: .* listening on (http://127\.0\.0\.1:\d+)", re.M)
PID_RE = re.compile(r"^cluster: started node (\S+) \(\w+, pid (\d+)\)", re.M)


class Cluster:
    def __init__(self, path, *extra, serve=("--port", "0")):
        fd, self.logpath = tempfile.mkstemp(prefix="shoal-cluster-up-", suffix=".log")
        logf = os.fdopen(fd, "wb")
        self.proc = subprocess.Popen(
            [su.shoal_binary(), "cluster", "up", path, "-t", "1", *extra, "--", *serve],
            cwd=su.ROOT, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
            start_new_session=True)
        logf.close()
        self.sid = self.proc.pid

    def text(self):
        with open(self.logpath, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def ups(self):
        return UP_RE.findall(self.text())

    def pids(self):
        """{node: [pid, ...]} in start order."""
        out = {}
        for name, pid in PID_RE.findall(self.text()):
            out.setdefault(name, []).append(int(pid))
        return out

    def wait_for(self, what, cond, timeout):
        deadline = time.monotonic() + timeout
        while True:
            v = cond()
            if v:
                return v
            if self.proc.poll() is not None:
                raise AssertionError(f"cluster up exited {self.proc.returncode} waiting for "
                                     f"{what}:\n{self.text()[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {timeout:.0f} s:\n{self.text()[-3000:]}")
            time.sleep(0.05)

    def wait_exit(self, timeout):
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.sid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError(f"cluster up did not exit within {timeout:.0f} s:\n"
                                 + self.text()[-3000:])

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in session_pids(self.sid):
            os.kill(pid, signal.SIGKILL)


def session_pids(sid):
    """Live processes (not zombies) whose session is sid."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                st = f.read()
        except OSError:
            continue
        fields = st[st.rindex(")") + 2:].split()
        if fields[0] != "Z" and int(fields[3]) == sid:
            out.append(int(d))
    return out


def no_process_left(sid, timeout=10.0):
    deadline = time.monotonic() + timeout
    while session_pids(sid):
        if time.monotonic() > deadline:
            raise AssertionError(f"processes of session {sid} left: {session_pids(sid)}")
        time.sleep(0.05)


def complete(url, prompt="Once upon a time"):
    status, parsed, raw = su.post_json(url, "/v1/completions", {
        "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}, timeout=60)
    assert status == 200, f"status {status}: {raw[:300]!r}"
    return parsed["choices"][0]["text"]


def streams_at_once(url, n, tokens=48):
    """n greedy completions at once in threads; returns a function that joins them and returns
    their texts (or the exceptions)."""
    out = [None] * n

    def one(i):
        try:
            status, parsed, raw = su.post_json(url, "/v1/completions", {
                "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": tokens, "temperature": 0,
                "ignore_eos": True}, timeout=120)
            assert status == 200, f"status {status}: {raw[:300]!r}"
            assert parsed["usage"]["completion_tokens"] == tokens, parsed["usage"]
            out[i] = parsed["choices"][0]["text"]
        except Exception as exc:  # noqa: BLE001
            out[i] = exc

    ts = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in ts:
        t.start()

    def join():
        for t in ts:
            t.join(150)
        return out
    return join


def restart_after_kill(d):
    """kill -9 of a worker while 8 requests stream: cluster up restarts it alone, the front
    (same process) greets it again and resumes every request by recompute: each finishes with
    the undisturbed greedy text."""
    path = script(os.path.join(d, "up.lua"), STORIES, ["w0", "w1"])
    c = Cluster(path)
    try:
        url = c.wait_for("'cluster: up' line", c.ups, UP_S)[0]
        want = streams_at_once(url, 8)()
        assert all(isinstance(w, str) for w in want), want
        join = streams_at_once(url, 8)
        time.sleep(0.05)
        w1 = c.pids()["w1"][-1]
        t0 = time.monotonic()
        os.kill(w1, signal.SIGKILL)
        c.wait_for("exit line for w1",
                   lambda: re.search(r"^cluster: node w1 exited \(signal 9[^)]*\); restarting it",
                                     c.text(), re.M), RECOVER_S)
        c.wait_for("the front's 'resumed' line",
                   lambda: re.search(r"came back .* replica 1 resumed", c.text()), RECOVER_S)
        dt = time.monotonic() - t0
        got = join()
        bad = [(i, g) for i, (g, w) in enumerate(zip(got, want)) if g != w]
        assert not bad, f"after the loss: {bad[:3]}"
        assert complete(url) == complete(url)
        su.log(f"note: replica resumed {dt:.1f} s after kill -9 of w1; 8 streams finished equal")
        pids = c.pids()
        assert len(pids["w1"]) == 2 and len(pids["front"]) == 1, pids
        c.proc.send_signal(signal.SIGTERM)
        rc = c.wait_exit(STOP_S)
        log = c.text()
        assert rc == 0, f"cluster up exited {rc}:\n{log[-3000:]}"
        assert "cluster: stopped: every node exited cleanly" in log, log[-2000:]
        # The front stops before the workers.
        order = re.findall(r"^cluster: node (\S+) stopped \(status 0\)$", log, re.M)
        assert order and order[0] == "front" and sorted(order) == ["front", "w0", "w1"], order
        no_process_left(c.sid, 5)
        crash = su._crash_lines(log)
        assert not crash, "\n".join(crash[:10])
        os.unlink(c.logpath)
    finally:
        c.kill()


def replicas_serve_on(d):
    """2 replicas: kill -9 of replica 2's worker: the router serves every request on replica 1
    while the worker restarts, then replica 2 resumes and takes requests again."""
    path = script(os.path.join(d, "reps.lua"), STORIES, ["w0", "w1"], replicas=[["w0"], ["w1"]])
    c = Cluster(path)
    try:
        url = c.wait_for("'cluster: up' line", c.ups, UP_S)[0]
        want = complete(url)
        os.kill(c.pids()["w1"][-1], signal.SIGKILL)
        c.wait_for("exit line for w1",
                   lambda: re.search(r"^cluster: node w1 exited \(signal 9[^)]*\); restarting it",
                                     c.text(), re.M), RECOVER_S)
        for _ in range(4):
            assert complete(url) == want
        c.wait_for("the front's 'resumed' line",
                   lambda: re.search(r"came back .* replica 2 resumed", c.text()), RECOVER_S)
        # The router takes it back on its next tick (100 ms).
        c.wait_for("replica 2 healthy in the router", lambda: su.metric(
            su.metrics(url), "shoal_router_healthy", replica="1") == 1, RECOVER_S)
        routed = lambda: su.metric(su.metrics(url), "shoal_router_routed_total", replica="1")
        before = routed()
        for _ in range(6):
            assert complete(url) == want
        assert routed() > before, "replica 2 takes no request after it resumed"
        pids = c.pids()
        assert len(pids["front"]) == 1 and len(pids["w1"]) == 2, pids
        c.proc.send_signal(signal.SIGTERM)
        rc = c.wait_exit(STOP_S)
        assert rc == 0, f"cluster up exited {rc}:\n{c.text()[-3000:]}"
        no_process_left(c.sid, 5)
        os.unlink(c.logpath)
    finally:
        c.kill()


def gives_up(d):
    path = script(os.path.join(d, "fail.lua"), STORIES, ["w0", "w1"])
    wrapper = os.path.join(d, "shoal-wrapper.sh")
    with open(wrapper, "w") as f:
        f.write("#!/bin/sh\n"
                'case " $* " in *" --name w1 "*) echo "w1: refusing to start" >&2; exit 1;; esac\n'
                f'exec "{su.shoal_binary()}" "$@"\n')
    os.chmod(wrapper, os.stat(wrapper).st_mode | stat.S_IXUSR)
    c = Cluster(path, "--bin", wrapper)
    try:
        rc = c.wait_exit(60)
        log = c.text()
        assert rc == 1, f"exit {rc}, want 1:\n{log[-3000:]}"
        assert re.search(r"^cluster: node w1 failed 5 times in a row before it was up", log,
                         re.M), log[-3000:]
        assert "[w1] w1: refusing to start" in log, log[-3000:]
        assert len(c.pids()["w1"]) == 5, c.pids()
        no_process_left(c.sid, 5)
        crash = su._crash_lines(log)
        assert not crash, "\n".join(crash[:10])
        os.unlink(c.logpath)
    finally:
        c.kill()


def dies_with_supervisor(d):
    path = script(os.path.join(d, "orphan.lua"), STORIES, ["w0", "w1"])
    c = Cluster(path)
    try:
        c.wait_for("'cluster: up' line", c.ups, UP_S)
        pids = [p for ps in c.pids().values() for p in ps]
        assert len(pids) == 3, pids
        c.proc.kill()
        c.proc.wait()
        no_process_left(c.sid, 10)
    finally:
        c.kill()


def refuses_remote(d):
    path = script(os.path.join(d, "remote.lua"), STORIES, ["w0", "w1"])
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(text.replace(f"'ipc://{d}/w1.sock'", "'tcp://10.11.12.13:7001'")
                    .replace(f"'ipc://{d}/w0.sock'", "'tcp://127.0.0.1:7000'"))
    r = subprocess.run([su.shoal_binary(), "cluster", "up", path], cwd=su.ROOT,
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=20)
    errs = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert r.returncode == 2 and len(errs) == 1, (r.returncode, r.stderr)
    assert "node 'w1'" in errs[0] and "tcp://10.11.12.13:7001" in errs[0] and \
        "not on this machine" in errs[0], errs[0]
    assert "cluster: started" not in r.stderr, r.stderr
    # `cluster status` of a URL nobody listens on (test_cluster_status.py tests it fully).
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()
    r = subprocess.run([su.shoal_binary(), "cluster", "status", url], cwd=su.ROOT,
                       capture_output=True, text=True, timeout=20)
    assert r.returncode == 2 and r.stderr.startswith(f"error: {url}: cannot connect"), \
        (r.returncode, r.stderr)


def main():
    if not os.path.exists(STORIES):
        su.skip(f"{STORIES} missing")
    r = su.Runner("test_cluster_up")
    d = tempfile.mkdtemp(prefix="shcu-", dir="/tmp")  # ipc:// paths stay short
    try:
        r.case("a node that is not local is refused with exit 2", refuses_remote, d)
        r.case("up, kill -9 of a worker mid-stream: restarted alone, every stream resumes and "
               "equals the undisturbed text; SIGTERM stops all",
               restart_after_kill, d)
        r.case("2 replicas: the other serves while a lost worker restarts, then it resumes",
               replicas_serve_on, d)
        r.case("a node failing before it is up, 5 times: cluster up exits 1 naming it",
               gives_up, d)
        r.case("kill -9 of cluster up: no child is left", dies_with_supervisor, d)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    r.finish()


if __name__ == "__main__":
    main()
