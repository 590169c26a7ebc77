"""Helpers for the `shoal serve` integration tests (stdlib only, Python 3.11).

    with serve_util.server("--ctx", "512") as srv:
        status, body = serve_util.post_json(srv.url, "/v1/completions", {...})

server() starts `shoal serve --port 0 ARGS` with the default test model, waits for the
`listening on http://127.0.0.1:PORT` line on its stderr (120 s), yields a Server, and at the end
stops it with SIGTERM and checks that it exited 0 with no sanitizer report or crash in its log.
Failures raise AssertionError with the server's log tail.

Environment: SH_SHOAL (the shoal binary; else build/shoal or build-c/shoal), SH_SOURCE_DIR (the
repository root; else two levels above this file), SH_TEST_TIME_SCALE (set by a slower build's
ctest, ThreadSanitizer's: tests/CMakeLists.txt; scaled() multiplies the waits that bound work by
it: starting and stopping a server, every HTTP request's timeout). A missing model file skips
(exit 77).

Cases: Runner.case(name, fn) runs one check, records pass/fail with the reason, and keeps going;
Runner.finish() prints "N passed, N failed" and exits 1 when any failed.
"""

import contextlib
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

SKIP = 77
ROOT = os.environ.get("SH_SOURCE_DIR") or os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "models", "smollm2-135m-instruct-q4_1.gguf")
MODEL_NAME = "smollm2-135m-instruct-q4_1"


def _time_scale():
    try:
        k = float(os.environ.get("SH_TEST_TIME_SCALE") or 1)
    except ValueError:
        k = 1.0
    return k if 1 <= k <= 100 else 1.0


TIME_SCALE = _time_scale()


def scaled(seconds):
    """A wait that bounds work (a process starting, a model computing), stretched in a slower
    build (SH_TEST_TIME_SCALE); as it is in a Release build. Not for a time a check measures."""
    return seconds * TIME_SCALE


START_TIMEOUT = scaled(120.0)
STOP_TIMEOUT = scaled(45.0)  # SIGTERM drains: requests in flight get up to --drain-timeout (30 s)

# Lines in a server log that mean it crashed or a sanitizer found something.
CRASH_PATTERNS = [
    "AddressSanitizer", "LeakSanitizer", "UndefinedBehaviorSanitizer", "ThreadSanitizer",
    "MemorySanitizer", "runtime error:", "panic at", "Segmentation fault", "Assertion `",
    "double free", "stack smashing", "heap-use-after-free", "core dumped",
]

LISTEN_RE = re.compile(r"listening on http://(127\.0\.0\.1|\[::1\]|[0-9.]+):(\d+)")


def log(msg):
    print(msg, flush=True)


def skip(msg):
    log(f"SKIP: {msg}")
    sys.exit(SKIP)


def shoal_binary():
    b = os.environ.get("SH_SHOAL")
    if b:
        return b
    for cand in ("build/shoal", "build-c/shoal"):
        p = os.path.join(ROOT, cand)
        if os.access(p, os.X_OK):
            return p
    skip("no shoal binary: set SH_SHOAL")


def require_model():
    if not os.path.exists(MODEL):
        skip(f"model {MODEL} missing (scripts/get-model.sh)")


class Server:
    def __init__(self, proc, logpath, host, port, argv):
        self.proc = proc
        self.logpath = logpath
        self.host = host
        self.port = port
        self.url = f"http://{host}:{port}"
        self.argv = argv

    def log_text(self):
        try:
            with open(self.logpath, "rb") as f:
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def log_tail(self, n=60):
        lines = self.log_text().splitlines()
        return "\n".join(lines[-n:])

    def alive(self):
        return self.proc.poll() is None


def _crash_lines(text):
    return [ln for ln in text.splitlines() if any(p in ln for p in CRASH_PATTERNS)]


def start(*args, model=MODEL, timeout=START_TIMEOUT, env=None, preexec_fn=None):
    """Starts the server and waits until it listens; returns a Server. Raises AssertionError.
    env (a dict, added to this process's environment) and preexec_fn go to Popen."""
    require_model()
    argv = [shoal_binary(), "serve", "--port", "0"]
    if "-m" not in args and "--model" not in args and model:
        argv += ["-m", model]
    argv += [str(a) for a in args]
    fd, logpath = tempfile.mkstemp(prefix="shoal-serve-", suffix=".log")
    logf = os.fdopen(fd, "wb")
    full_env = dict(os.environ, **env) if env else None
    proc = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                            env=full_env, preexec_fn=preexec_fn)
    logf.close()
    srv = Server(proc, logpath, None, None, argv)
    deadline = time.monotonic() + timeout
    while True:
        m = LISTEN_RE.search(srv.log_text())
        if m:
            host = m.group(1).strip("[]")
            srv.host, srv.port = host, int(m.group(2))
            srv.url = f"http://[{host}]:{srv.port}" if ":" in host else f"http://{host}:{srv.port}"
            return srv
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode} before listening\n"
                                 f"argv: {' '.join(argv)}\n--- log ---\n{srv.log_tail(80)}")
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise AssertionError(f"server did not print 'listening on' within {timeout:.0f} s\n"
                                 f"argv: {' '.join(argv)}\n--- log ---\n{srv.log_tail(80)}")
        time.sleep(0.05)


def stop(srv, sig=signal.SIGTERM, already_sent=False):
    """Stops the server with sig (already_sent: the caller sent it) and checks how it ended;
    returns a list of problems (empty when it exited 0 with a clean log)."""
    problems = []
    if srv.proc.poll() is not None and not already_sent:
        problems.append(f"server had already exited with {srv.proc.returncode}")
    else:
        if not already_sent:
            srv.proc.send_signal(sig)
        try:
            srv.proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            srv.proc.kill()
            srv.proc.wait()
            problems.append(f"server did not exit within {STOP_TIMEOUT:.0f} s of "
                            f"{signal.Signals(sig).name} (killed)")
        else:
            if srv.proc.returncode != 0:
                problems.append(f"server exited with {srv.proc.returncode} after "
                                f"{signal.Signals(sig).name} (want 0)")
    crash = _crash_lines(srv.log_text())
    if crash:
        problems.append("crash/sanitizer output in the server log:\n  " + "\n  ".join(crash[:20]))
    if problems:
        problems.append("--- server log tail ---\n" + srv.log_tail(60))
    else:
        try:
            os.unlink(srv.logpath)
        except OSError:
            pass
    return problems


@contextlib.contextmanager
def server(*args, runner=None, stop_signal=signal.SIGTERM, **kw):
    """Starts a server for the with-block. With a Runner, the runner watches it (cases after a
    crash are reported as not run) and a failed shutdown check is recorded as a failed case
    instead of raised."""
    srv = start(*args, **kw)
    failed = None
    if runner:
        runner.srv = srv
    try:
        yield srv
    except BaseException as exc:
        failed = exc
        raise
    finally:
        if runner:
            runner.srv = None
        problems = stop(srv, stop_signal)
        if problems:
            msg = "\n".join(problems)
            if runner:
                runner.fail(f"clean shutdown ({signal.Signals(stop_signal).name} -> exit 0, "
                            "no crash output)", msg)
            elif failed is None:
                raise AssertionError("server shutdown check failed:\n" + msg)
            else:
                log("server shutdown check failed:\n" + msg)
        elif runner:
            runner.passed += 1
            name = signal.Signals(stop_signal).name
            log(f"ok   {runner.suite}: clean shutdown ({name} -> exit 0, no crash output)")


# ---- HTTP -----------------------------------------------------------------------------------

def _hostport(url):
    m = re.match(r"http://(\[[^\]]+\]|[^:/]+):(\d+)", url)
    return m.group(1).strip("[]"), int(m.group(2))


def request(url, method, path, body=None, headers=None, timeout=120):
    """One request on a fresh connection (timeout: seconds, through scaled()). Returns (status,
    headers dict lowercased, body bytes)."""
    host, port = _hostport(url)
    conn = http.client.HTTPConnection(host, port, timeout=scaled(timeout))
    try:
        h = {"Connection": "close"}
        if isinstance(body, (dict, list)):
            body = json.dumps(body).encode()
            h["Content-Type"] = "application/json"
        elif isinstance(body, str):
            body = body.encode()
        if body is not None and "Content-Type" not in h:
            h["Content-Type"] = "application/json"
        h.update(headers or {})
        conn.request(method, path, body=body, headers=h)
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data
    finally:
        conn.close()


def post_json(url, path, obj, headers=None, timeout=120):
    """POSTs obj (dict, or raw bytes/str) and returns (status, parsed JSON or None, raw bytes)."""
    status, _, data = request(url, "POST", path, obj, headers, timeout)
    try:
        parsed = json.loads(data) if data else None
    except ValueError:
        parsed = None
    return status, parsed, data


def get(url, path, timeout=30, headers=None):
    status, hdrs, data = request(url, "GET", path, None, headers, timeout)
    return status, hdrs, data


def stream(url, path, obj, headers=None, timeout=120):
    """POSTs a streaming request; returns (status, content-type, list of data payloads as str).
    The final "[DONE]" is kept as the string "[DONE]"; JSON payloads are parsed into dicts.
    timeout: seconds, through scaled()."""
    host, port = _hostport(url)
    conn = http.client.HTTPConnection(host, port, timeout=scaled(timeout))
    try:
        h = {"Content-Type": "application/json", "Connection": "close"}
        h.update(headers or {})
        conn.request("POST", path, body=json.dumps(obj).encode(), headers=h)
        resp = conn.getresponse()
        ctype = resp.getheader("Content-Type", "")
        if resp.status != 200:
            return resp.status, ctype, [resp.read().decode("utf-8", "replace")]
        events = []
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.decode("utf-8").rstrip("\r\n")
            if not line.startswith("data:"):
                if line and not line.startswith(":"):
                    raise AssertionError(f"unexpected SSE line {line!r}")
                continue
            payload = line[5:].strip()
            events.append(payload if payload == "[DONE]" else json.loads(payload))
        return resp.status, ctype, events
    finally:
        conn.close()


def check_error(status, parsed, raw, want_status, want_code=None, what=""):
    """Asserts an OpenAI-shaped error: {"error":{"message","type","param","code"}}."""
    ctx = f"{what}: " if what else ""
    assert status == want_status, f"{ctx}status {status}, want {want_status}; body {raw[:300]!r}"
    assert isinstance(parsed, dict) and isinstance(parsed.get("error"), dict), \
        f"{ctx}not an OpenAI error object: {raw[:300]!r}"
    err = parsed["error"]
    for k in ("message", "type", "param", "code"):
        assert k in err, f"{ctx}error lacks {k!r}: {raw[:300]!r}"
    assert isinstance(err["message"], str) and err["message"], f"{ctx}empty message: {raw[:300]!r}"
    assert isinstance(err["type"], str), f"{ctx}type not a string: {raw[:300]!r}"
    if want_code is not None:
        assert err["code"] == want_code, f"{ctx}code {err['code']!r}, want {want_code!r}"
    return err


# ---- metrics --------------------------------------------------------------------------------

_SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_metrics(text):
    """Returns a list of (name, {label: value}, float) samples."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE_RE.match(line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        try:
            out.append((m.group(1), labels, float(m.group(3))))
        except ValueError:
            pass
    return out


def metric(text_or_samples, name, **labels):
    """Sum of the samples named name whose labels include labels; None when there is none."""
    samples = text_or_samples
    if isinstance(samples, str):
        samples = parse_metrics(samples)
    vals = [v for n, lb, v in samples
            if n == name and all(lb.get(k) == x for k, x in labels.items())]
    return sum(vals) if vals else None


def metrics(url):
    status, _, data = get(url, "/metrics")
    assert status == 200, f"GET /metrics: {status}"
    return data.decode("utf-8", "replace")


def at_once(url, prompts, n, fn):
    """Sends every prompt at once, each on its own thread as fn(url, prompt, n), and returns
    their results in order; an exception or a thread that did not finish fails the call."""
    out = [None] * len(prompts)

    def one(i):
        try:
            out[i] = fn(url, prompts[i], n)
        except Exception as exc:  # noqa: BLE001
            out[i] = exc

    ts = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(scaled(300))
    for i, r in enumerate(out):
        if isinstance(r, Exception) or r is None:
            raise AssertionError(f"prompt {i}: {r!r}")
    return out


def wait_idle(url, timeout=10.0):
    """Polls /metrics until shoal_requests_running and shoal_requests_waiting are 0."""
    deadline = time.monotonic() + timeout
    while True:
        text = metrics(url)
        running = metric(text, "shoal_requests_running")
        waiting = metric(text, "shoal_requests_waiting")
        if running == 0 and (waiting or 0) == 0:
            return text
        if time.monotonic() > deadline:
            raise AssertionError(f"not idle after {timeout:.0f} s: shoal_requests_running="
                                 f"{running} shoal_requests_waiting={waiting}")
        time.sleep(0.2)


# ---- cases ----------------------------------------------------------------------------------

def _describe(exc):
    """An unexpected exception in one line plus where in a test file it was raised."""
    where = ""
    for fr in traceback.extract_tb(exc.__traceback__):
        if "tests/integration" in fr.filename.replace(os.sep, "/"):
            where = f" (at {os.path.basename(fr.filename)}:{fr.lineno} {fr.line})"
    return f"{type(exc).__name__}: {exc}{where}"


class Runner:
    def __init__(self, suite):
        self.suite = suite
        self.passed = 0
        self.failed = []
        self.lock = threading.Lock()
        self.srv = None  # the server being tested (set by server(runner=...))

    def _dead(self):
        srv = self.srv
        if srv is None or srv.alive():
            return None
        crash = _crash_lines(srv.log_text())
        return f"the server died (exit {srv.proc.returncode})" + \
            (": " + crash[0] if crash else "")

    def case(self, name, fn, *args, **kw):
        dead = self._dead()
        if dead:
            with self.lock:
                self.failed.append((name, f"not run: {dead}"))
            log(f"FAIL {self.suite}: {name}: not run: {dead}")
            return False
        t0 = time.monotonic()
        try:
            fn(*args, **kw)
        except Exception as exc:  # noqa: BLE001 - every failure is reported, then we go on
            dt = time.monotonic() - t0
            detail = str(exc) if isinstance(exc, AssertionError) else _describe(exc)
            dead = self._dead()
            if dead:
                detail = f"{dead} during this case; {detail}\n--- server log tail ---\n" + \
                    self.srv.log_tail(40)
            with self.lock:
                self.failed.append((name, detail))
            log(f"FAIL {self.suite}: {name} ({dt:.1f} s): {detail}")
            return False
        dt = time.monotonic() - t0
        with self.lock:
            self.passed += 1
        log(f"ok   {self.suite}: {name} ({dt:.1f} s)")
        return True

    def fail(self, name, detail):
        with self.lock:
            self.failed.append((name, detail))
        log(f"FAIL {self.suite}: {name}: {detail}")

    def finish(self):
        if self.failed:
            log(f"\n{self.suite}: failures:")
            for name, detail in self.failed:
                first = detail.splitlines()[0][:240] if detail else ""
                log(f"  - {name}: {first}")
        log(f"{self.suite}: {self.passed} passed, {len(self.failed)} failed")
        sys.exit(1 if self.failed else 0)
