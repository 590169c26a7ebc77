"""A cluster over tls+tcp:// with certificates named in the script (issue 11), against real
processes: certificates are made by the test with the openssl CLI (skipped, 77, without it).

Cases: a front and a worker, each with its own certificate signed by the cluster's CA, join and
serve a greedy completion of stories260K equal to a single process's (and `shoal cluster up` runs
the same script on this machine); a worker whose certificate another CA signed never joins, and
the front exits 2 within --join-timeout naming it; scripts that mix tls+tcp:// and tcp://, or
lack tls_ca or a node's tls_cert, exit 2 at once.
"""

import os
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
N_TOKENS = 16


def sh(cmd, cwd):
    p = subprocess.run(cmd, shell=True, cwd=cwd, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, f"{cmd}: {p.stderr[-800:]}"


def make_ca(d, ca):
    sh(f"openssl req -x509 -newkey rsa:2048 -nodes -keyout {ca}.key -out {ca}.pem -days 2 "
       f"-subj /CN={ca}", d)


def make_node(d, ca, name):
    sh(f"openssl req -newkey rsa:2048 -nodes -keyout {name}.key -out {name}.csr -subj /CN={name} "
       f"&& printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\n' > {name}.cnf "
       f"&& openssl x509 -req -in {name}.csr -CA {ca}.pem -CAkey {ca}.key -CAcreateserial "
       f"-out {name}.pem -days 2 -extfile {name}.cnf", d)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def script(d, name, front="front", worker="w0", scheme="tls+tcp", ca="ca.pem", extra=""):
    """front and w0 on 127.0.0.1; `front`/`worker` name their certificate files (None: none)."""
    def tls(c):
        return f", tls_cert = '{c}.pem', tls_key = '{c}.key'" if c else ""
    path = os.path.join(d, name)
    with open(path, "w") as f:
        f.write(f"local m = model {{ path = '{STORIES}', name = 'm' }}\n"
                "return cluster {\n"
                f"  nodes = {{ node {{ name = 'front', listen = 'tls+tcp://127.0.0.1:{free_port()}'"
                f"{tls(front)} }},\n"
                f"    node {{ name = 'w0', listen = '{scheme}://127.0.0.1:{free_port()}'"
                f"{tls(worker)} }} }},\n"
                "  gateway = { node = 'front', http = '127.0.0.1:8080' },\n"
                "  replicas = { replica { model = m, stages = pipeline(m, { 'w0' }) } },\n"
                "  batcher = { max_seqs = 8, max_step_tokens = 256 },\n"
                "  kv = { memory = '16MiB' },\n"
                + (f"  tls_ca = '{ca}',\n" if ca else "") + extra +
                "}\n")
    return path


class Worker:
    def __init__(self, path):
        fd, self.logpath = tempfile.mkstemp(prefix="shoal-tls-w0-", suffix=".log")
        with os.fdopen(fd, "wb") as logf:
            self.proc = subprocess.Popen([su.shoal_binary(), "node", "-c", path, "--name", "w0",
                                          "-t", "1"], cwd=su.ROOT, stdin=subprocess.DEVNULL,
                                         stdout=logf, stderr=logf)

    def text(self):
        with open(self.logpath, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def wait_ready(self):
        deadline = time.monotonic() + 60
        while "serving" not in self.text():
            assert self.proc.poll() is None, f"w0 exited {self.proc.returncode}:\n{self.text()}"
            assert time.monotonic() < deadline, f"w0 not ready:\n{self.text()}"
            time.sleep(0.05)
        return self

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError("w0 did not stop on SIGTERM")
        assert not su._crash_lines(self.text()), self.text()[-1500:]
        assert self.proc.returncode == 0, f"w0 exited {self.proc.returncode}:\n{self.text()}"
        os.unlink(self.logpath)


def front_exits_2(path, want, *args, bound=30):
    t0 = time.monotonic()
    p = subprocess.run([su.shoal_binary(), "serve", "-c", path, "--port", "0", *args],
                       cwd=su.ROOT, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       timeout=bound)
    errs = [ln for ln in p.stderr.splitlines() if ln.startswith("error: ")]
    assert p.returncode == 2, f"exit {p.returncode}:\n{p.stderr[-1500:]}"
    assert len(errs) == 1, p.stderr[-1500:]
    for w in want:
        assert w in errs[0], f"{errs[0]!r} lacks {w!r}"
    su.log(f"  {errs[0]} ({time.monotonic() - t0:.1f} s)")


def reference():
    with su.server("-m", STORIES, "-t", "1", "--kv-mem", "16M", "--max-seqs", "8",
                   "--step-tokens", "256", model=None) as srv:
        return completion(srv.url)


def completion(url):
    status, parsed, raw = su.post_json(url, "/v1/completions", {
        "prompt": PROMPT, "max_tokens": N_TOKENS, "temperature": 0, "ignore_eos": True})
    assert status == 200, raw[:300]
    return parsed["choices"][0]["text"], parsed["usage"]["completion_tokens"]


def serves(d, want):
    path = script(d, "ok.lua")
    w = Worker(path).wait_ready()
    try:
        srv = su.start("-c", path, "--join-timeout", "30", model=None)
        try:
            assert "node w0 joined" in srv.log_text(), srv.log_text()[-1500:]
            got = completion(srv.url)
            assert got == want, f"over TLS {got!r} != one process {want!r}"
        finally:
            problems = su.stop(srv)
        assert not problems, "\n".join(problems)
    finally:
        w.stop()


def cluster_up(d):
    """`shoal cluster up` counts tls+tcp:// on 127.0.0.1 as local: it starts both nodes, the
    front joins over TLS, and SIGTERM stops them all with status 0."""
    path = script(d, "up.lua")
    fd, logpath = tempfile.mkstemp(prefix="shoal-tls-up-", suffix=".log")
    with os.fdopen(fd, "wb") as logf:
        p = subprocess.Popen([su.shoal_binary(), "cluster", "up", path, "-t", "1", "--",
                              "--port", "0"], cwd=su.ROOT, stdin=subprocess.DEVNULL,
                             stdout=logf, stderr=logf)
    try:
        deadline = time.monotonic() + 60
        while True:
            with open(logpath, "rb") as f:
                text = f.read().decode("utf-8", "replace")
            if "cluster: up:" in text:
                break
            assert p.poll() is None, f"cluster up exited {p.returncode}:\n{text[-1500:]}"
            assert time.monotonic() < deadline, f"cluster up not up:\n{text[-1500:]}"
            time.sleep(0.1)
        assert "node w0 joined" in text, text[-1500:]
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 0, f"exit {p.returncode}"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    os.unlink(logpath)


def other_ca(d):
    path = script(d, "other.lua", worker="stranger")
    w = Worker(path).wait_ready()
    try:
        front_exits_2(path, ["did not join within 3.0 s", "'w0' (tls+tcp://127.0.0.1:",
                             "[never connected: is it running, with a certificate signed by "
                             "cluster.tls_ca?]"], "--join-timeout", "3")
    finally:
        w.stop()


def bad_scripts(d):
    front_exits_2(script(d, "mixed.lua", scheme="tcp"),
                  ["node 'front' listens on tls+tcp://", "node 'w0' on tcp://",
                   "every node must listen on tls+tcp://"])
    front_exits_2(script(d, "noca.lua", ca=None), ["needs cluster.tls_ca"])
    front_exits_2(script(d, "nocert.lua", worker=None),
                  ["node 'w0' listens on tls+tcp://", "give it tls_cert and tls_key"])


def main():
    if not os.path.exists(STORIES):
        su.skip(f"{STORIES} missing")
    if not shutil.which("openssl"):
        su.skip("no openssl CLI to make certificates")
    d = tempfile.mkdtemp(prefix="shtls-", dir="/tmp")
    r = su.Runner("test_cluster_tls")
    try:
        make_ca(d, "ca")
        make_ca(d, "other")
        make_node(d, "ca", "front")
        make_node(d, "ca", "w0")
        make_node(d, "other", "stranger")
        want = reference()
        r.case("front and worker over tls+tcp:// serve what one process serves", serves, d, want)
        r.case("shoal cluster up runs a tls+tcp:// script on this machine", cluster_up, d)
        r.case("a worker certified by another CA never joins: exit 2 naming it", other_ca, d)
        r.case("scripts that mix schemes or lack TLS files exit 2 at once", bad_scripts, d)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    r.finish()


if __name__ == "__main__":
    main()
