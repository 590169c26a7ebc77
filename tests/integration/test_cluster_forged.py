"""Hostile peers against a keyed cluster (issue 25): an outsider that can merely connect to a
node's tcp:// port sends frames whose envelope claims another node. A front and two workers
(stories260K in two stages) share a cluster key; shoal_test_forge (forge_node.c) is the outsider.

1. STEP with epoch 2^64-1 claiming the front, sent to w0's stage actors: later requests still
   succeed (before: every request failed with 503 while /health stayed 200).
2. METRICS claiming to be w0's reporter (every actor id 1..8 of node 2), sent to the front's
   collector: no fake series on the front's /metrics (before: shoal_forged_total{node="w0"}
   appeared), and shoal_frames_refused_total{reason="unproved"} counts them.
3. CONTROL SHUTDOWN claiming the front, sent to w0's hello actor: the keyed worker keeps serving
   (before: it exited 75). Run last, since before the fix it ends w0.
Throughout, every greedy completion equals the undisturbed cluster's first one.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402

STORIES = os.path.join(su.ROOT, "tests", "data", "stories260K", "stories260K.gguf")
PROMPT = "Once upon a time"
N_TOKENS = 24
BOUND = 60.0


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    def __init__(self, argv, name):
        fd, self.logpath = tempfile.mkstemp(prefix=f"shoal-forged-{name}-", suffix=".log")
        env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
        with os.fdopen(fd, "wb") as logf:
            self.proc = subprocess.Popen(argv, cwd=su.ROOT, stdin=subprocess.DEVNULL,
                                         stdout=logf, stderr=logf, env=env)
        self.name = name

    def text(self):
        with open(self.logpath, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def alive(self):
        return self.proc.poll() is None

    def wait_for(self, want, timeout=BOUND):
        deadline = time.monotonic() + timeout
        while want not in self.text():
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited {self.proc.returncode}:\n"
                                     + self.text()[-2000:])
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: no {want!r}:\n" + self.text()[-2000:])
            time.sleep(0.05)

    def stop(self, want_rc=0):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"{self.name} did not stop on SIGTERM")
        crash = su._crash_lines(self.text())
        assert not crash, f"{self.name}: {crash[:3]}"
        assert self.proc.returncode == want_rc, \
            f"{self.name} exited {self.proc.returncode}, want {want_rc}:\n{self.text()[-1500:]}"
        os.unlink(self.logpath)


class Cluster:
    """A keyed front + w0 + w1 on loopback tcp:// ports (node ids 1, 2, 3 in script order)."""

    def __init__(self, d):
        self.urls = {n: f"tcp://127.0.0.1:{free_port()}" for n in ("front", "w0", "w1")}
        self.http = free_port()
        self.script = os.path.join(d, "forged.lua")
        with open(self.script, "w") as f:
            f.write(f"local m = model {{ path = '{STORIES}', name = 'm' }}\n"
                    "return cluster {\n  nodes = {\n"
                    + "".join(f"    node {{ name = '{n}', listen = '{u}' }},\n"
                              for n, u in self.urls.items())
                    + "  },\n"
                    f"  gateway = {{ node = 'front', http = '127.0.0.1:{self.http}' }},\n"
                    "  replicas = { replica { model = m, stages = pipeline(m, { 'w0', 'w1' }) } },\n"
                    "  batcher = { max_seqs = 8, max_step_tokens = 256 },\n"
                    "  kv = { memory = '16MiB' },\n}\n")
        self.key = os.path.join(d, "cluster.key")
        with open(self.key, "w") as f:
            f.write("the-key-only-the-cluster-holds\n")
        os.chmod(self.key, 0o600)
        self.procs = {}

    def start(self):
        for w in ("w0", "w1"):
            self.procs[w] = Proc([su.shoal_binary(), "node", "-c", self.script, "--name", w,
                                  "-t", "1", "--cluster-key-file", self.key], w)
        for w in ("w0", "w1"):
            self.procs[w].wait_for("serving")
        self.procs["front"] = Proc([su.shoal_binary(), "serve", "-c", self.script, "-t", "1",
                                    "--join-timeout", "30", "--cluster-key-file", self.key],
                                   "front")
        self.procs["front"].wait_for("listening on")

    @property
    def url(self):
        return f"http://127.0.0.1:{self.http}"

    def completion(self):
        status, parsed, raw = su.post_json(self.url, "/v1/completions", {
            "prompt": PROMPT, "max_tokens": N_TOKENS, "temperature": 0, "ignore_eos": True},
            timeout=60)
        assert status == 200, f"completion: HTTP {status}: {raw[:300]}"
        return parsed["choices"][0]["text"], parsed["usage"]["completion_tokens"]

    def stop(self):
        for n in ("front", "w0", "w1"):
            if n in self.procs:
                self.procs[n].stop()


def forge(as_node, to_node, url, kind, *rng):
    exe = os.environ.get("SH_TEST_FORGE") or os.path.join(su.ROOT, "build", "shoal_test_forge")
    p = subprocess.run([exe, str(as_node), str(to_node), url, kind, *map(str, rng)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "SENT" in p.stdout, f"forge {kind}: {p.stdout}{p.stderr}"


def refused(c, reason="unproved"):
    text = su.metrics(c.url)
    return su.metric(text, "shoal_frames_refused_total", node="1", reason=reason) or 0


def forged_control(c, want):
    forge(1, 2, c.urls["w0"], "control_shutdown")
    time.sleep(1.0)
    w0 = c.procs["w0"]
    assert w0.alive(), f"w0 exited {w0.proc.returncode} on a forged CONTROL:\n{w0.text()[-1500:]}"
    assert "forged by a test" not in w0.text(), w0.text()[-1500:]
    assert "event=frame_refused" in w0.text() and "reason=unproved" in w0.text(), \
        w0.text()[-1500:]
    got = c.completion()
    assert got == want, f"after the forged CONTROL {got!r} != {want!r}"


def forged_metrics(c, want):
    before = refused(c)
    forge(2, 1, c.urls["front"], "metrics", 1, 8)
    time.sleep(1.5)  # the real reporters report each second
    text = su.metrics(c.url)
    assert "shoal_forged" not in text, \
        [ln for ln in text.splitlines() if "shoal_forged" in ln][:3]
    after = refused(c)
    assert after >= before + 8, f"shoal_frames_refused_total{{reason=unproved}} {before} -> {after}"
    assert "event=frame_refused" in c.procs["front"].text()
    got = c.completion()
    assert got == want, f"after the forged METRICS {got!r} != {want!r}"


def forged_step(c, want):
    forge(1, 2, c.urls["w0"], "step_epoch", 2, 4)
    time.sleep(0.5)
    for _ in range(3):
        got = c.completion()
        assert got == want, f"after the forged STEP {got!r} != {want!r}"


def main():
    if not os.path.exists(STORIES):
        su.skip(f"no {STORIES}")
    d = tempfile.mkdtemp(prefix="shforged-", dir="/tmp")
    c = Cluster(d)
    r = su.Runner("test_cluster_forged")
    try:
        c.start()
        want = c.completion()
        assert want[1] == N_TOKENS, want
        # The CONTROL case last: before the fix it makes w0 exit.
        r.case("forged STEP with epoch 2^64-1: requests still succeed, outputs equal",
               forged_step, c, want)
        r.case("forged METRICS as w0: no fake series on the front's /metrics, refusals counted",
               forged_metrics, c, want)
        r.case("forged CONTROL SHUTDOWN as the front: the keyed worker keeps serving",
               forged_control, c, want)
    finally:
        c.stop()
    for f in os.listdir(d):
        os.unlink(os.path.join(d, f))
    os.rmdir(d)
    return r.finish()


if __name__ == "__main__":
    sys.exit(main())
