"""`shoal serve` API keys off the command line, /metrics behind them, clear flag errors (stdlib).

1. Refused at start with exit 2 and a message that says how to write it: `--api-key k:abc` (a
   priority that is not a number), `--api-key k:256`, a key file with such a line (named by
   file:line, the key not printed), an empty key file; `--max-body 1000` and `--port 70000` name
   the allowed range.
2. Keys from --api-key-file (comments, blank lines, priorities, an admin key) and from
   SHOAL_API_KEY (comma separated) all work, others get 401, none is on the command line; /health stays open;
   /metrics needs a key.
3. --metrics-public: /metrics without a key, completions still need one.
"""

import os
import signal
import subprocess
import sys
import tempfile
import time

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402


def refused(args, want, env=None, secret=None):
    """Runs `shoal serve ARGS`, expects exit 2 before listening with every string of want in
    its stderr (and secret nowhere in it)."""
    su.require_model()
    argv = [su.shoal_binary(), "serve", "--port", "0", "-m", su.MODEL] + [str(a) for a in args]
    with tempfile.TemporaryFile() as log:
        p = subprocess.Popen(argv, cwd=su.ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                             env=dict(os.environ, **(env or {})))
        deadline = time.monotonic() + 60
        while p.poll() is None:
            log.seek(0)
            if b"listening on" in log.read() or time.monotonic() > deadline:
                p.kill()  # it started: the value was taken
                p.wait()
                break
            time.sleep(0.05)
        log.seek(0)
        err = log.read().decode("utf-8", "replace")
    if p.returncode != 2:
        if "listening on" in err:
            raise AssertionError(f"{' '.join(args)}: the server started with it")
        raise AssertionError(f"{' '.join(args)}: exit {p.returncode}, want 2: {err[-300:]}")
    for w in want:
        assert w in err, f"{' '.join(args)}: {w!r} not in the message: {err.strip()[:300]}"
    if secret:
        assert secret not in err, f"the key {secret!r} was printed: {err.strip()[:300]}"
    assert err.count("\n") <= 2, f"more than one error line: {err[:400]}"


def run_refusals(r, tmp):
    bad = os.path.join(tmp, "bad-keys")
    with open(bad, "w") as f:
        f.write("# keys\n\ngood-key\nsecret-one:abc\n")
    empty = os.path.join(tmp, "empty-keys")
    with open(empty, "w") as f:
        f.write("# nothing yet\n\n")
    r.case("--api-key k:abc is refused, saying KEY:PRIORITY",
           refused, ["--api-key", "k:abc"], ["--api-key", "KEY:PRIORITY", "0 to 255"])
    r.case("--api-key k:256 is refused", refused, ["--api-key", "k:256"], ["0 to 255"])
    r.case("--api-key k:abc:admin is refused", refused, ["--api-key", "k:abc:admin"],
           ["KEY:PRIORITY:admin", "0 to 255"])
    r.case("--api-key-file with a bad priority: file:line, no key printed",
           refused, ["--api-key-file", bad], [f"{bad}:4", "KEY:PRIORITY"], secret="secret-one")
    r.case("--api-key-file without keys is refused", refused, ["--api-key-file", empty],
           ["no key"])
    r.case("--api-key-file that does not exist is refused", refused,
           ["--api-key-file", os.path.join(tmp, "nope")], ["No such file"])
    fifo = os.path.join(tmp, "keys-fifo")
    os.mkfifo(fifo)
    r.case("--api-key-file that is a FIFO is refused, not waited on", refused,
           ["--api-key-file", fifo], ["not a regular file (a FIFO)"])
    r.case("SHOAL_API_KEY with a bad item is refused", refused, [],
           ["SHOAL_API_KEY (item 2)", "KEY:PRIORITY"], env={"SHOAL_API_KEY": "a1,b2:x"},
           secret="b2")
    r.case("--max-body 1000 names the allowed range", refused, ["--max-body", "1000"],
           ["--max-body", "1K", "1G"])
    r.case("--port 70000 names the allowed range", refused, ["--port", "70000"],
           ["from 0 to 65535"])
    r.case("--drain-timeout -1 names the allowed range", refused, ["--drain-timeout", "-1"],
           ["0 to 3600"])


def run_keys(r, tmp):
    path = os.path.join(tmp, "keys")
    with open(path, "w") as f:
        f.write("# production keys\n\nfile-key-1\n  file-key-2:5  \n# old: revoked-key\n"
                "ops-key:2:admin\n")
    os.chmod(path, 0o600)
    env = {"SHOAL_API_KEY": "env-key-1, env-key-2:1"}
    with su.server("--api-key-file", path, runner=r, env=env) as srv:
        def auth(key, p="/v1/models"):
            h = {"Authorization": f"Bearer {key}"} if key else None
            status, _, _ = su.get(srv.url, p, headers=h)
            return status

        def every_key_works():
            for k in ("file-key-1", "file-key-2", "env-key-1", "env-key-2", "ops-key"):
                assert auth(k) == 200, f"key {k}: {auth(k)}"
            for k in ("revoked-key", "file-key-2:5", "ops-key:2:admin", "ops-key:2", "nope", None):
                assert auth(k) == 401, f"key {k}: {auth(k)}"

        def priority_key_completes():
            status, parsed, raw = su.post_json(srv.url, "/v1/completions", {
                "model": su.MODEL_NAME, "prompt": "Once", "max_tokens": 4},
                headers={"Authorization": "Bearer file-key-2"})
            assert status == 200, f"{status} {raw[:200]!r}"

        def not_in_ps():
            with open(f"/proc/{srv.proc.pid}/cmdline", "rb") as f:
                cmd = f.read()
            assert b"key-1" not in cmd and b"key-2" not in cmd, cmd

        def health_open_metrics_closed():
            assert auth(None, "/health") == 200
            status, _, raw = su.get(srv.url, "/metrics")
            assert status == 401, f"/metrics without a key: {status} {raw[:100]!r}"
            status, _, raw = su.get(srv.url, "/metrics",
                                    headers={"Authorization": "Bearer env-key-1"})
            assert status == 200 and b"shoal_" in raw, f"/metrics with a key: {status}"

        r.case("keys from --api-key-file and SHOAL_API_KEY work, others 401", every_key_works)
        r.case("a key with a priority runs a completion", priority_key_completes)
        r.case("no key on the command line", not_in_ps)
        r.case("/health open, /metrics needs a key", health_open_metrics_closed)


def run_metrics_public(r):
    with su.server("--api-key", "k1", "--metrics-public", runner=r) as srv:
        def public():
            status, _, raw = su.get(srv.url, "/metrics")
            assert status == 200 and b"shoal_" in raw, f"/metrics: {status}"
            status, _, _ = su.get(srv.url, "/v1/models")
            assert status == 401, f"/v1/models without a key: {status}"

        r.case("--metrics-public: /metrics without a key, the API still needs one", public)


def main():
    r = su.Runner("serve_keys")
    with tempfile.TemporaryDirectory(prefix="shoal-keys-") as tmp:
        for part in (lambda r: run_refusals(r, tmp), lambda r: run_keys(r, tmp),
                     run_metrics_public):
            try:
                part(r)
            except AssertionError as e:
                r.fail("server start", str(e))
    r.finish()


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    main()
