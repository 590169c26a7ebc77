"""`shoal serve` shutdown and reload signals (stdlib only).

1. Drain (--drain-timeout 4): SIGTERM with a short stream, a long stream and a long plain
   request in flight. While draining /health answers 503 {"status":"draining"} and a new
   completion gets 503; the short stream finishes normally (finish_reason, [DONE]); at the
   deadline the long stream ends with an error event and `data: [DONE]`, the plain request gets a
   503 JSON error; the process exits 0.
2. A second signal (SIGTERM, then SIGINT, --drain-timeout 30) stops at once: the long stream
   still gets its error event and [DONE], the process exits 0 within seconds.
3. SIGHUP re-reads --api-key-file: a new key works and the old one is refused; a broken file
   keeps the old keys; the server stays up.
"""

import http.client
import json
import os
import signal
import sys
import tempfile
import threading
import time

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402

NO_EOS = {"0": -100, "2": -100}  # the test model's end tokens: never stop early
DRAIN_S = 4


class Stream(threading.Thread):
    """A streamed completion read event by event; records events, status and when it ended."""

    def __init__(self, srv, max_tokens, stream=True):
        super().__init__(daemon=True)
        self.srv = srv
        self.body = {"model": su.MODEL_NAME, "prompt": "Once upon a time", "max_tokens": max_tokens,
                     "temperature": 0, "logit_bias": NO_EOS, "stream": stream}
        self.stream = stream
        self.events = []
        self.status = None
        self.raw = b""
        self.error = None
        self.ended_at = None
        self.first = threading.Event()

    def run(self):
        host, port = self.srv.host, self.srv.port
        conn = http.client.HTTPConnection(host, port, timeout=120)
        try:
            conn.request("POST", "/v1/completions", body=json.dumps(self.body).encode(),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            self.status = resp.status
            if not self.stream or resp.status != 200:
                self.first.set()
                self.raw = resp.read()
                return
            while True:
                line = resp.readline()
                if not line:
                    break
                line = line.decode().rstrip("\r\n")
                if line.startswith("data:"):
                    p = line[5:].strip()
                    self.events.append(p if p == "[DONE]" else json.loads(p))
                    self.first.set()
        except Exception as exc:  # noqa: BLE001 - reported by the checks
            self.error = exc
        finally:
            self.ended_at = time.monotonic()
            self.first.set()
            conn.close()


def finish_reasons(events):
    return [ch.get("finish_reason") for e in events if isinstance(e, dict)
            for ch in e.get("choices", []) if ch.get("finish_reason")]


def wait_exit(srv, timeout):
    try:
        srv.proc.wait(timeout=timeout)
    except Exception:  # noqa: BLE001
        return None
    return srv.proc.returncode


def run_drain(r):
    srv = su.start("--drain-timeout", DRAIN_S)
    r.srv = srv
    try:
        short = Stream(srv, 10)
        long_ = Stream(srv, 4000)
        plain = Stream(srv, 4000, stream=False)
        for t in (short, long_, plain):
            t.start()
        for t in (short, long_):
            assert t.first.wait(30), "no first event within 30 s"
        time.sleep(0.1)
        t_sig = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)

        def health_draining():
            time.sleep(0.2)
            status, _, raw = su.get(srv.url, "/health", timeout=5)
            assert status == 503, f"/health while draining: {status} {raw[:200]!r}"
            assert json.loads(raw).get("status") == "draining", raw[:200]

        def new_request_503():
            status, parsed, raw = su.post_json(srv.url, "/v1/completions", {
                "model": su.MODEL_NAME, "prompt": "Hello", "max_tokens": 4}, timeout=10)
            su.check_error(status, parsed, raw, 503, None, "a completion while draining")

        def short_finishes():
            short.join(DRAIN_S + 10)
            assert short.error is None, f"short stream: {short.error!r}"
            assert short.events and short.events[-1] == "[DONE]", \
                f"short stream lacks [DONE]: {short.events[-2:]}"
            assert finish_reasons(short.events) == ["length"], \
                f"short stream finish_reasons {finish_reasons(short.events)}"
            assert not any(isinstance(e, dict) and "error" in e for e in short.events)

        def long_ends_with_error_and_done():
            long_.join(DRAIN_S + 10)
            assert long_.error is None, f"long stream: {long_.error!r}"
            dt = long_.ended_at - t_sig
            assert long_.events and long_.events[-1] == "[DONE]", \
                f"the cut stream lacks [DONE]: last events {long_.events[-2:]}"
            last = long_.events[-2]
            assert isinstance(last, dict) and isinstance(last.get("error"), dict), \
                f"the cut stream's last event is not an error: {last}"
            assert last["error"].get("message"), last
            assert DRAIN_S - 1 < dt < DRAIN_S + 3, f"the cut stream ended {dt:.1f} s after SIGTERM"

        def plain_gets_503():
            plain.join(DRAIN_S + 10)
            assert plain.error is None, f"plain request: {plain.error!r}"
            parsed = json.loads(plain.raw) if plain.raw else None
            su.check_error(plain.status, parsed, plain.raw, 503, None, "a plain request cut")

        def exits_0():
            rc = wait_exit(srv, DRAIN_S + 15)
            assert rc == 0, f"exit status {rc} after the drain"

        r.case("drain: /health answers 503 draining", health_draining)
        r.case("drain: a new completion gets 503", new_request_503)
        r.case("drain: a short stream finishes with finish_reason and [DONE]", short_finishes)
        r.case(f"drain: a long stream ends at --drain-timeout {DRAIN_S} with an error and [DONE]",
               long_ends_with_error_and_done)
        r.case("drain: a long plain request gets a 503 error", plain_gets_503)
        r.case("drain: exit 0", exits_0)
    finally:
        r.srv = None
        problems = su.stop(srv, signal.SIGTERM, already_sent=True)
        if problems:
            r.fail("drain: clean exit", "\n".join(problems))


def run_second_signal(r):
    srv = su.start("--drain-timeout", 30)
    r.srv = srv
    try:
        long_ = Stream(srv, 4000)
        long_.start()
        assert long_.first.wait(30), "no first event within 30 s"
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGINT)

        def stops_at_once():
            rc = wait_exit(srv, 10)
            dt = time.monotonic() - t0
            assert rc == 0, f"exit status {rc} ({dt:.1f} s after the second signal)"
            assert dt < 5, f"exited {dt:.1f} s after the second signal"
            long_.join(5)
            assert long_.events and long_.events[-1] == "[DONE]", \
                f"the stream lacks [DONE]: {long_.events[-2:]}"
            assert isinstance(long_.events[-2], dict) and "error" in long_.events[-2], \
                f"no error event before [DONE]: {long_.events[-2]}"

        r.case("second signal: stops at once, the stream gets an error and [DONE]", stops_at_once)
    finally:
        r.srv = None
        problems = su.stop(srv, signal.SIGTERM, already_sent=True)
        if problems:
            r.fail("second signal: clean exit", "\n".join(problems))


def run_sighup(r):
    fd, path = tempfile.mkstemp(prefix="shoal-keys-")
    os.close(fd)
    os.chmod(path, 0o600)

    def write(text):
        with open(path + ".new", "w") as f:
            f.write(text)
        os.replace(path + ".new", path)

    def models(key):
        status, _, _ = su.get(srv.url, "/v1/models", headers={"Authorization": f"Bearer {key}"})
        return status

    write("# first\nold-key\n")
    try:
        with su.server("--api-key-file", path, runner=r) as srv:
            def reload():
                assert models("old-key") == 200
                assert models("new-key") == 401
                write("# rotated\n\nnew-key:3\n")
                srv.proc.send_signal(signal.SIGHUP)
                deadline = time.monotonic() + 5
                while models("new-key") != 200:
                    assert srv.alive(), f"the server exited on SIGHUP ({srv.proc.returncode})"
                    assert time.monotonic() < deadline, "the new key is refused 5 s after SIGHUP"
                    time.sleep(0.05)
                assert models("old-key") == 401, "the old key still works after the reload"

            def broken_file_keeps_keys():
                write("new-key:high\n")
                srv.proc.send_signal(signal.SIGHUP)
                time.sleep(0.5)
                assert srv.alive(), "the server exited on SIGHUP with a broken key file"
                assert models("new-key") == 200, "a broken key file dropped the working keys"
                assert "not reloaded" in srv.log_text(), "no log line for the broken key file"
                assert "new-key" not in srv.log_text(), "a key was printed in the log"

            r.case("SIGHUP: --api-key-file is re-read (new key in, old key out)", reload)
            r.case("SIGHUP: a broken key file keeps the old keys", broken_file_keeps_keys)
    finally:
        os.unlink(path)


def main():
    r = su.Runner("serve_drain")
    for part in (run_drain, run_second_signal, run_sighup):
        try:
            part(r)
        except AssertionError as e:
            r.fail(f"{part.__name__}: setup", str(e))
    r.finish()


if __name__ == "__main__":
    main()
