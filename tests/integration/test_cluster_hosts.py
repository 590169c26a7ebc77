"""A front and a worker on separate "hosts" over tcp:// (issue 11): two network namespaces
joined by a veth pair (10.x.y.1 and 10.x.y.2), made by this test with names of its own and
always removed at the end. Where `ip netns` cannot be used (not root, no iproute2, no namespace
support), the two nodes listen on distinct loopback addresses (127.0.0.2 and 127.0.0.3) instead;
the test prints which mode ran and skips (77) only when neither works.

Cases: with the same cluster key on both sides, the worker joins and the cluster serves a
greedy completion of stories260K equal to a single process's; with a wrong key the front exits 2
naming the worker, and the worker logs its refusal of the front.
"""

import json
import os
import random
import shutil
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
TAG = f"sht{os.getpid() % 100000}"  # unique per run; interface names stay under 16 bytes


def run(*argv, check=True):
    p = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {p.returncode}: {p.stderr.strip()}")
    return p


class Netns:
    """Two namespaces, <TAG>a (the front) and <TAG>b (the worker), and a veth pair."""

    def __init__(self):
        self.a, self.b = f"{TAG}a", f"{TAG}b"
        x, y = random.randint(16, 250), random.randint(1, 250)
        self.ip_a, self.ip_b = f"10.{x}.{y}.1", f"10.{x}.{y}.2"
        self.made = []

    def up(self):
        for ns in (self.a, self.b):
            run("ip", "netns", "add", ns)
            self.made.append(ns)
            run("ip", "-n", ns, "link", "set", "lo", "up")
        va, vb = f"{TAG}va", f"{TAG}vb"
        run("ip", "link", "add", va, "netns", self.a, "type", "veth", "peer", "name", vb,
            "netns", self.b)
        run("ip", "-n", self.a, "addr", "add", f"{self.ip_a}/24", "dev", va)
        run("ip", "-n", self.b, "addr", "add", f"{self.ip_b}/24", "dev", vb)
        run("ip", "-n", self.a, "link", "set", va, "up")
        run("ip", "-n", self.b, "link", "set", vb, "up")
        # The pair works both ways before any node starts.
        run("ip", "netns", "exec", self.a, "ping", "-c", "1", "-W", "2", self.ip_b, check=False)

    def down(self):
        # Deleting a namespace deletes its end of the pair, and with it the other end.
        for ns in self.made:
            run("ip", "netns", "del", ns, check=False)
        self.made = []

    def wrap(self, where):
        return ["ip", "netns", "exec", self.a if where == "front" else self.b]

    def port(self, ip, base):
        return base  # fresh namespaces: every port is free


class Loopback:
    """The fallback: each node on its own loopback address of this namespace."""

    def __init__(self):
        self.ip_a, self.ip_b = "127.0.0.2", "127.0.0.3"

    def up(self):
        for ip in (self.ip_a, self.ip_b):
            with socket.socket() as s:
                s.bind((ip, 0))

    def down(self):
        pass

    def wrap(self, where):
        return []

    def port(self, ip, base):
        with socket.socket() as s:  # shared with other tests: take a free one
            s.bind((ip, 0))
            return s.getsockname()[1]


def netns_usable():
    if os.geteuid() != 0 or not shutil.which("ip"):
        return False, "not root" if os.geteuid() != 0 else "no `ip` command (iproute2)"
    probe = f"{TAG}p"
    p = run("ip", "netns", "add", probe, check=False)
    if p.returncode != 0:
        return False, p.stderr.strip()
    run("ip", "netns", "del", probe, check=False)
    return True, ""


def remove_stale():
    """Namespaces left by an earlier run that was killed (SIGKILL skips `finally`)."""
    p = run("ip", "netns", "list", check=False)
    for line in p.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith("sht") and name[-1] in "abp" and not name.startswith(TAG):
            pid = name[3:-1]
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                run("ip", "netns", "del", name, check=False)


def script(d, net, port_a, port_b, http_port):
    port_a, port_b = net.port(net.ip_a, port_a), net.port(net.ip_b, port_b)
    path = os.path.join(d, "hosts.lua")
    with open(path, "w") as f:
        f.write(f"local m = model {{ path = '{STORIES}', name = 'm' }}\n"
                "return cluster {\n"
                f"  nodes = {{ node {{ name = 'front', listen = 'tcp://{net.ip_a}:{port_a}' }},\n"
                f"            node {{ name = 'w0', listen = 'tcp://{net.ip_b}:{port_b}' }} }},\n"
                f"  gateway = {{ node = 'front', http = '{net.ip_a}:{http_port}' }},\n"
                "  replicas = { replica { model = m, stages = pipeline(m, { 'w0' }) } },\n"
                "  batcher = { max_seqs = 8, max_step_tokens = 256 },\n"
                "  kv = { memory = '16MiB' },\n"
                "}\n")
    return path


def key(d, name, text):
    p = os.path.join(d, name)
    with open(p, "w") as f:
        f.write(text + "\n")
    os.chmod(p, 0o600)
    return p


class Proc:
    def __init__(self, argv, name):
        fd, self.logpath = tempfile.mkstemp(prefix=f"shoal-hosts-{name}-", suffix=".log")
        env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
        with os.fdopen(fd, "wb") as logf:
            self.proc = subprocess.Popen(argv, cwd=su.ROOT, stdin=subprocess.DEVNULL,
                                         stdout=logf, stderr=logf, env=env)
        self.name = name

    def text(self):
        with open(self.logpath, "rb") as f:
            return f.read().decode("utf-8", "replace")

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
            f"{self.name} exited {self.proc.returncode}:\n{self.text()[-1500:]}"
        os.unlink(self.logpath)


CLIENT = r"""
import json, sys, urllib.request
req = urllib.request.Request(sys.argv[1] + "/v1/completions", data=sys.argv[2].encode(),
                             headers={"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=60) as r:
    print(r.read().decode())
"""


def completion(net, url):
    body = json.dumps({"prompt": PROMPT, "max_tokens": N_TOKENS, "temperature": 0,
                       "ignore_eos": True})
    p = subprocess.run(net.wrap("front") + [sys.executable, "-c", CLIENT, url, body],
                       capture_output=True, text=True, timeout=90)
    assert p.returncode == 0, f"client: {p.stderr[-1500:]}"
    parsed = json.loads(p.stdout)
    return parsed["choices"][0]["text"], parsed["usage"]["completion_tokens"]


def reference():
    with su.server("-m", STORIES, "-t", "1", "--kv-mem", "16M", "--max-seqs", "8",
                   "--step-tokens", "256", model=None) as srv:
        status, parsed, raw = su.post_json(srv.url, "/v1/completions", {
            "prompt": PROMPT, "max_tokens": N_TOKENS, "temperature": 0, "ignore_eos": True})
        assert status == 200, raw[:300]
        return parsed["choices"][0]["text"], parsed["usage"]["completion_tokens"]


def right_key(d, net, want):
    k = key(d, "right.key", "a-key-both-hosts-were-given")
    http = net.port(net.ip_a, 8181)
    s = script(d, net, 7101, 7102, http)
    w = Proc(net.wrap("worker") + [su.shoal_binary(), "node", "-c", s, "--name", "w0", "-t", "1",
                                   "--cluster-key-file", k], "w0")
    f = None
    try:
        w.wait_for("serving")
        f = Proc(net.wrap("front") + [su.shoal_binary(), "serve", "-c", s, "-t", "1",
                                      "--join-timeout", "30", "--cluster-key-file", k], "front")
        f.wait_for("listening on")
        assert "node w0 joined" in f.text(), f.text()[-1500:]
        got = completion(net, f"http://{net.ip_a}:{http}")
        assert got == want, f"cluster {got!r} != one process {want!r}"
        assert "refused" not in w.text(), w.text()[-1500:]
    finally:
        if f:
            f.stop()
        w.stop()


def wrong_key(d, net):
    ka = key(d, "a.key", "the-key-the-worker-host-holds")
    kb = key(d, "b.key", "the-key-the-front-host-holds")
    s = script(d, net, 7201, 7202, net.port(net.ip_a, 8282))
    w = Proc(net.wrap("worker") + [su.shoal_binary(), "node", "-c", s, "--name", "w0", "-t", "1",
                                   "--cluster-key-file", ka], "w0")
    try:
        w.wait_for("serving")
        t0 = time.monotonic()
        p = subprocess.run(net.wrap("front") + [su.shoal_binary(), "serve", "-c", s,
                                                "--join-timeout", "30",
                                                "--cluster-key-file", kb],
                           cwd=su.ROOT, capture_output=True, text=True, timeout=BOUND)
        dt = time.monotonic() - t0
        errs = [ln for ln in p.stderr.splitlines() if ln.startswith("error: ")]
        assert p.returncode == 2, f"exit {p.returncode}:\n{p.stderr[-1500:]}"
        assert len(errs) == 1 and "node 'w0'" in errs[0] and "wrong cluster key" in errs[0], \
            p.stderr[-1500:]
        su.log(f"  front: {errs[0]} ({dt:.1f} s)")
        w.wait_for("event=hello_refused", 10)
        assert "wrong cluster key" in w.text(), w.text()[-1500:]
    finally:
        w.stop()


def main():
    if not os.path.exists(STORIES):
        su.skip(f"{STORIES} missing")
    ok, why = netns_usable()
    net = None
    if ok:
        remove_stale()
        net = Netns()
        mode = f"network namespaces {net.a} and {net.b} joined by a veth pair"
    else:
        net = Loopback()
        mode = f"loopback addresses 127.0.0.2 and 127.0.0.3 (no network namespaces: {why})"
    d = tempfile.mkdtemp(prefix="shhosts-", dir="/tmp")
    r = su.Runner("test_cluster_hosts")
    try:
        try:
            net.up()
        except (RuntimeError, OSError) as exc:
            net.down()
            if isinstance(net, Netns):
                su.log(f"note: network namespaces failed ({exc}); trying loopback addresses")
                net = Loopback()
                mode = "loopback addresses 127.0.0.2 and 127.0.0.3 (namespaces failed)"
                try:
                    net.up()
                except OSError as exc2:
                    su.skip(f"neither network namespaces nor loopback addresses: {exc2}")
            else:
                su.skip(f"neither network namespaces ({why}) nor loopback addresses: {exc}")
        su.log(f"mode: {mode}")
        want = reference()
        r.case("the same key on both hosts: joins and serves what one process serves",
               right_key, d, net, want)
        r.case("a wrong key: the front exits 2 naming the worker, the worker logs it",
               wrong_key, d, net)
    finally:
        net.down()
        shutil.rmtree(d, ignore_errors=True)
    r.finish()


if __name__ == "__main__":
    main()
