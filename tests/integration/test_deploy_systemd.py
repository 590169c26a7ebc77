"""systemd (issue 29, docs/deploy.md "systemd"), against real processes:

- the units of examples/deploy/systemd/ pass `systemd-analyze verify` (their ExecStart pointed at
  this build's shoal; skipped with 77 when systemd-analyze is absent);
- sd_notify: this test binds real Unix datagram sockets as each process's NOTIFY_SOCKET (a path
  for the workers, the abstract namespace for the front) with WATCHDOG_USEC set, starts the two
  workers and the front of a 2-stage pipeline of the default model, and checks that each worker
  sends READY=1 only once the front greeted it (none before the front started), the front once it
  listens, WATCHDOG=1 from each about every WATCHDOG_USEC/2, and STOPPING=1 from each on SIGTERM;
  after the front stops, each worker says so in STATUS= and sends READY=1 again once a new front
  greeted it; a one-process `shoal serve` with WATCHDOG_PID naming another process sends READY=1
  and STOPPING=1 but no WATCHDOG=1; a NOTIFY_SOCKET that is no socket address and a
  WATCHDOG_USEC that is no number are one line each, and the server serves.
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deploy_util as du  # noqa: E402
import serve_util as su  # noqa: E402

UNITS = os.path.join(su.ROOT, "examples", "deploy", "systemd")
WATCHDOG_USEC = 400000  # pings every 200 ms


class Listener:
    """A bound datagram socket and the messages it received, each with its arrival time."""

    def __init__(self, addr):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(addr)
        self.sock.settimeout(0.1)
        self.msgs = []
        self.lock = threading.Lock()
        self.done = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.done:
            try:
                data = self.sock.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                return
            with self.lock:
                self.msgs.append((time.monotonic(), data.decode("utf-8", "replace")))

    def lines(self, since=0.0):
        with self.lock:
            return [(t, m) for t, m in self.msgs if t >= since]

    def first(self, var, since=0.0):
        for t, m in self.lines(since):
            if var in m.split("\n"):
                return t
        return None

    def wait(self, var, timeout, since=0.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            t = self.first(var, since)
            if t is not None:
                return t
            time.sleep(0.02)
        raise AssertionError(f"no {var} within {timeout} s; got {self.lines(since)[-6:]}")

    def close(self):
        self.done = True
        self.thread.join()
        self.sock.close()


def verify_units(d):
    sa = shutil.which("systemd-analyze")
    ud = os.path.join(d, "units")
    os.makedirs(ud)
    names = ["shoal-node@.service", "shoal-front.service"]
    for n in names:
        with open(os.path.join(UNITS, n)) as f:
            text = f.read()
        assert "/usr/local/bin/shoal " in text, f"{n}: no ExecStart=/usr/local/bin/shoal"
        with open(os.path.join(ud, n), "w") as f:
            f.write(text.replace("/usr/local/bin/shoal ", su.shoal_binary() + " "))
    for unit in ("shoal-front.service", "shoal-node@w0.service", "shoal-node@1.service"):
        p = subprocess.run([sa, "verify", "--man=no", os.path.join(ud, unit)],
                           capture_output=True, text=True, timeout=60)
        out = (p.stdout + p.stderr).strip()
        assert p.returncode == 0, f"{unit}: systemd-analyze verify exit {p.returncode}:\n{out}"
        bad = [ln for ln in out.splitlines() if "shoal" in ln]
        assert not bad, f"{unit}: {bad}"
        su.log(f"  {unit}: verified")
    # The check is real: a unit with an unknown directive or a missing binary fails it.
    with open(os.path.join(ud, "shoal-front.service")) as f:
        broken = f.read().replace(su.shoal_binary() + " ", "/nonexistent/shoal ")
    with open(os.path.join(ud, "broken.service"), "w") as f:
        f.write(broken)
    p = subprocess.run([sa, "verify", "--man=no", os.path.join(ud, "broken.service")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0, "systemd-analyze verify passed a unit whose binary is missing"


def pings(lst, since, until):
    ts = [t for t, m in lst.lines(since) if t <= until and "WATCHDOG=1" in m.split("\n")]
    gaps = [b - a for a, b in zip(ts, ts[1:])]
    return ts, max(gaps) if gaps else None


def notify(d):
    s = du.script(os.path.join(d, "sd.lua"),
                  {n: f"ipc://{d}/{n}.sock" for n in ("front", "w0", "w1")})
    lw = {w: Listener(os.path.join(d, f"notify-{w}.sock")) for w in ("w0", "w1")}
    abstract = f"shoal-test-notify-{os.getpid()}"
    lf = Listener("\0" + abstract)
    env = {"WATCHDOG_USEC": str(WATCHDOG_USEC)}
    workers = {w: du.Proc(["node", "-c", s, "--name", w, "-t", "1"], w,
                          dict(env, NOTIFY_SOCKET=os.path.join(d, f"notify-{w}.sock")))
               for w in ("w0", "w1")}
    front = None
    try:
        for w, p in workers.items():
            p.wait_for("serving")
        t_front = time.monotonic()
        for w in workers:
            st = [m for _, m in lw[w].lines() if "STATUS=" in m]
            assert st and "waiting for the front" in st[-1], f"{w}: {lw[w].lines()}"
            assert lw[w].first("READY=1") is None, f"{w}: READY=1 before the front started"
        front = du.Proc(["serve", "-c", s, "--port", "0", "--join-timeout", f"{su.scaled(60):g}"],
                        "front", dict(env, NOTIFY_SOCKET="@" + abstract))
        front.wait_for("listening on")
        t_listen = time.monotonic()
        ready = lf.wait("READY=1", 10)
        assert ready >= t_front, "the front's READY=1 came before it started"
        rmsg = [m for t, m in lf.lines() if "READY=1" in m.split("\n")][0]
        assert "STATUS=serving on http://" in rmsg, rmsg
        for w in workers:
            t = lw[w].wait("READY=1", 10)
            assert t >= t_front, f"{w}: READY=1 before the front started"
            m = [m for t2, m in lw[w].lines() if "READY=1" in m.split("\n")][0]
            assert f"node {w} joined its front" in m, m
        su.log(f"  READY=1 from the front {ready - t_front:.2f} s after it started "
               f"(listening {t_listen - t_front:.2f} s)")
        text, n = du.complete(front.url(), du.PROMPTS[0])
        assert n == du.TOKENS, n
        # Pings: every WATCHDOG_USEC/2 from each process, over a window of 2 s.
        t0 = time.monotonic()
        time.sleep(2.0)
        t1 = time.monotonic()
        for who, lst in list(lw.items()) + [("front", lf)]:
            ts, gap = pings(lst, t0, t1)
            # Every 200 ms; the bounds leave room for a loaded machine's scheduling.
            assert len(ts) >= 6, f"{who}: {len(ts)} WATCHDOG=1 in 2 s, want about 10"
            assert gap < 0.8, f"{who}: {gap:.2f} s between two WATCHDOG=1"
            su.log(f"  {who}: {len(ts)} WATCHDOG=1 in {t1 - t0:.1f} s, largest gap {gap:.2f} s")
        t_stop = time.monotonic()
        front.stop()
        front = None
        lf.wait("STOPPING=1", 5, since=t_stop)
        # The front restarts (as its unit would): each worker says it lost it, then is ready again
        # once the new front greeted it.
        for w in workers:
            gone = None
            for _ in range(100):
                gone = [m for _, m in lw[w].lines(t_stop) if "connection is gone" in m]
                if gone:
                    break
                time.sleep(0.05)
            assert gone, f"{w}: no STATUS after the front stopped: {lw[w].lines(t_stop)}"
        t_again = time.monotonic()
        front = du.Proc(["serve", "-c", s, "--port", "0", "--join-timeout", f"{su.scaled(60):g}"],
                        "front2", dict(env, NOTIFY_SOCKET="@" + abstract))
        front.wait_for("listening on")
        lf.wait("READY=1", 10, since=t_again)
        for w in workers:
            lw[w].wait("READY=1", 10, since=t_again)
        t_stop = time.monotonic()
        front.stop()
        front = None
        lf.wait("STOPPING=1", 5, since=t_stop)
        for w, p in workers.items():
            t = time.monotonic()
            p.stop()
            lw[w].wait("STOPPING=1", 5, since=t)
    finally:
        if front:
            front.stop()
        for p in workers.values():
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
                p.proc.wait(timeout=30)
        for lst in list(lw.values()) + [lf]:
            lst.close()


def not_mine(d):
    """WATCHDOG_PID naming another process: READY=1 (a one-process `shoal serve`) but no pings."""
    lst = Listener(os.path.join(d, "notify-one.sock"))
    p = du.Proc(["serve", "--port", "0", "-m", su.MODEL, "-t", "1"], "one",
                {"NOTIFY_SOCKET": os.path.join(d, "notify-one.sock"),
                 "WATCHDOG_USEC": str(WATCHDOG_USEC), "WATCHDOG_PID": "1"})
    try:
        p.wait_for("listening on")
        lst.wait("READY=1", 10)
        time.sleep(1.0)
        ts, _ = pings(lst, 0.0, time.monotonic())
        assert not ts, f"{len(ts)} WATCHDOG=1 with WATCHDOG_PID=1"
        t = time.monotonic()
        p.stop()
        lst.wait("STOPPING=1", 5, since=t)
    finally:
        if p.proc.poll() is None:
            p.proc.kill()
            p.proc.wait()
        lst.close()


def bad_env(d):
    """A NOTIFY_SOCKET that is no socket address and a WATCHDOG_USEC that is no number: one line
    each, and the server serves without notifications."""
    p = du.Proc(["serve", "--port", "0", "-m", su.MODEL, "-t", "1"], "bad-env",
                {"NOTIFY_SOCKET": "relative/notify.sock", "WATCHDOG_USEC": "soon"})
    p.wait_for("listening on")
    text = p.text()
    assert "NOTIFY_SOCKET=relative/notify.sock is not a Unix socket path" in text, text[-800:]
    assert "WATCHDOG_USEC=soon is not a whole number" in text, text[-800:]
    p.stop()


def main():
    """`units`: systemd-analyze verify (77 without it); `notify`: the sd_notify case."""
    what = sys.argv[1] if len(sys.argv) > 1 else "notify"
    if what == "units" and not shutil.which("systemd-analyze"):
        su.skip("no systemd-analyze")
    if what == "notify":
        su.require_model()
    d = tempfile.mkdtemp(prefix="shsd-", dir="/tmp")
    r = su.Runner(f"test_deploy_systemd {what}")
    try:
        if what == "units":
            r.case("the units pass systemd-analyze verify", verify_units, d)
        else:
            r.case("sd_notify: READY=1 after the join / when serving, WATCHDOG=1, STOPPING=1, "
                   "READY=1 again for a restarted front", notify, d)
            r.case("sd_notify: WATCHDOG_PID of another process: READY=1, no pings",
                   not_mine, d)
            r.case("sd_notify: a bad NOTIFY_SOCKET and WATCHDOG_USEC: one line each, serving",
                   bad_env, d)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    r.finish()


if __name__ == "__main__":
    main()
