"""Helpers for the deployment tests (docs/deploy.md): a 2-stage pipeline script of the default
model, worker and front processes started with chosen environments, greedy completions and the
single-process reference they must equal. Stdlib only."""

import os
import signal
import subprocess
import tempfile
import time

import serve_util as su

PROMPTS = ["Once upon a time", "The capital of France is", "def add(a, b):",
           "A list of colours: red,"]
TOKENS = 16
START = su.scaled(120.0)


def script(path, urls, http="127.0.0.1:8080", workers=("w0", "w1")):
    """A cluster script at path: nodes front and the workers (w0, w1 unless said) listening on
    urls (a dict by name; the front's node is listed first, as the gateway's), a pipeline of the
    default model with one stage per worker."""
    nodes = ", ".join(f"node {{ name = '{n}', listen = '{urls[n]}' }}"
                      for n in ("front",) + tuple(workers))
    stages = ", ".join(f"'{w}'" for w in workers)
    with open(path, "w") as f:
        f.write(f"local m = model {{ path = '{su.MODEL}', name = 'm' }}\n"
                "return cluster {\n"
                f"  nodes = {{ {nodes} }},\n"
                f"  gateway = {{ node = 'front', http = '{http}' }},\n"
                f"  replicas = {{ replica {{ model = m, stages = pipeline(m, {{ {stages} }}) }} }},\n"
                "  batcher = { max_seqs = 8, max_step_tokens = 256 },\n"
                "  kv = { memory = '32MiB' },\n"
                "}\n")
    return path


def clean_env(extra=None):
    """This process's environment without SHOAL_* variables and HOSTNAME, plus extra."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SHOAL_") and k not in ("HOSTNAME", "NOTIFY_SOCKET",
                                                        "WATCHDOG_USEC", "WATCHDOG_PID")}
    env.update(extra or {})
    return env


class Proc:
    """A `shoal` process with its output in a temporary file."""

    def __init__(self, argv, name, env=None, wrap=()):
        fd, self.logpath = tempfile.mkstemp(prefix=f"shoal-deploy-{name}-", suffix=".log")
        with os.fdopen(fd, "wb") as logf:
            self.proc = subprocess.Popen(list(wrap) + [su.shoal_binary(), *argv], cwd=su.ROOT,
                                         stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                                         env=clean_env(env))
        self.name = name

    def text(self):
        with open(self.logpath, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def wait_for(self, want, timeout=START):
        deadline = time.monotonic() + timeout
        while want not in self.text():
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited {self.proc.returncode}:\n"
                                     + self.text()[-2000:])
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: no {want!r}:\n" + self.text()[-2000:])
            time.sleep(0.05)

    def url(self):
        m = su.LISTEN_RE.search(self.text())
        assert m, self.text()[-1500:]
        return f"http://{m.group(1)}:{m.group(2)}"

    def stop(self, want_rc=0, sig=signal.SIGTERM):
        """Stops it (sig) and checks its exit status and that its log shows no crash."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=su.scaled(45))
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"{self.name} did not stop on signal {sig}")
        crash = su._crash_lines(self.text())
        assert not crash, f"{self.name}: {crash[:3]}"
        assert self.proc.returncode == want_rc, \
            f"{self.name} exited {self.proc.returncode}, want {want_rc}:\n{self.text()[-1500:]}"
        os.unlink(self.logpath)


def complete(url, prompt):
    status, parsed, raw = su.post_json(url, "/v1/completions", {
        "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True},
        timeout=su.scaled(120))
    assert status == 200, f"status {status}: {raw[:300]!r}"
    ch = parsed["choices"][0]
    return ch["text"], parsed["usage"]["completion_tokens"]


def completions(url):
    return [complete(url, p) for p in PROMPTS]


def reference():
    """The prompts' greedy completions from one process (`shoal serve -m`), sized like the
    script's stages (F16 KV, as they keep it)."""
    with su.server("-t", "1", "--kv-mem", "32M", "--max-seqs", "8", "--step-tokens", "256") as srv:
        return completions(srv.url)


def fails_with(argv, want, env=None, timeout=30, wrap=()):
    """`shoal ARGV` must exit 2 with exactly one `error:` line containing each of want; returns
    that line."""
    p = subprocess.run(list(wrap) + [su.shoal_binary(), *argv], cwd=su.ROOT,
                       stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       timeout=su.scaled(timeout), env=clean_env(env))
    errs = [ln for ln in p.stderr.splitlines() if ln.startswith("error: ")]
    assert p.returncode == 2, f"exit {p.returncode}, want 2:\n{p.stderr[-1500:]}"
    assert len(errs) == 1, f"want one error line:\n{p.stderr[-1500:]}"
    for w in want:
        assert w in errs[0], f"{errs[0]!r} lacks {w!r}"
    crash = su._crash_lines(p.stderr)
    assert not crash, crash[:3]
    return errs[0]
