"""`shoal serve` against a corpus of bad requests (stdlib only: raw sockets and http.client).

One server (--max-body 65536 --ctx 512 --header-timeout-ms 2000 --max-tokens 400). Every case
must get the right status with an OpenAI-shaped error JSON ({"error":{"message","type","param",
"code"}}), or a clean close where the brief allows one: malformed JSON, non-object JSON, wrong
types, out-of-range values, unknown model (404), invalid UTF-8 (400), a body over --max-body
(413, by Content-Length and chunked), a prompt over the context (400 context_length_exceeded),
empty messages, unknown paths (404), wrong methods (404/405/501), slow-loris headers (408 or close
within the header timeout), abrupt disconnects mid-stream (20 times) and before the response,
garbage request lines (400 then close), headers too large (431), bad Content-Length, pipelining
and HTTP/1.0. Meanwhile a background thread sends well-formed completions in a loop: each must
succeed (200 with the same greedy text). At the end /health is ok, the cancels are counted, and
shoal_requests_running/waiting return to 0.

Then a server with --max-conns 6 --max-seqs 1 --max-queue 2: one connection too many closes the
longest-idle one and is served, simultaneous requests beyond the queue get 429 rate_limit_error; one with --request-timeout 1,
where long generations end with finish_reason "timeout"; and a server that gets SIGTERM
with three streams in flight: new requests are refused (or 503), the streams end, exit 0.
"""

import http.client as http_client
import json
import os
import signal
import select
import socket
import struct
import sys
import threading
import time

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402

MODEL = su.MODEL_NAME
HEADER_TIMEOUT_MS = 2000
MAX_BODY = 65536
CTX = 512
MAX_TOKENS = 400


# ---- raw sockets ----------------------------------------------------------------------------

def connect(srv, timeout=10):
    s = socket.create_connection((srv.host, srv.port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def read_response(sock, timeout=15):
    """Reads one HTTP response. Returns (status, headers, body, leftover), or None when the
    connection closed (or reset) before any byte of a response."""
    sock.settimeout(timeout)
    buf = b""
    try:
        while b"\r\n\r\n" not in buf:
            d = sock.recv(65536)
            if not d:
                if buf:
                    raise AssertionError(f"connection closed inside a response head: {buf[:200]!r}")
                return None
            buf += d
    except ConnectionResetError:
        if buf:
            raise AssertionError(f"reset inside a response head: {buf[:200]!r}")
        return None
    head, rest = buf.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    assert parts[0].startswith("HTTP/1."), f"bad status line {lines[0]!r}"
    status = int(parts[1])
    headers = {}
    for ln in lines[1:]:
        k, _, v = ln.partition(":")
        headers[k.strip().lower()] = v.strip()
    if status in (100,):
        return read_response_rest(sock, rest, timeout)
    if "content-length" in headers:
        n = int(headers["content-length"])
        while len(rest) < n:
            d = sock.recv(65536)
            if not d:
                raise AssertionError(f"body cut short: {len(rest)} of {n} bytes")
            rest += d
        return status, headers, rest[:n], rest[n:]
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = b""
        while True:
            while b"\r\n" not in rest:
                d = sock.recv(65536)
                if not d:
                    raise AssertionError("chunked body cut short")
                rest += d
            size_line, rest = rest.split(b"\r\n", 1)
            size = int(size_line.split(b";")[0], 16)
            while len(rest) < size + 2:
                d = sock.recv(65536)
                if not d:
                    raise AssertionError("chunk cut short")
                rest += d
            body += rest[:size]
            rest = rest[size + 2:]
            if size == 0:
                return status, headers, body, rest
    # close-delimited
    while True:
        d = sock.recv(65536)
        if not d:
            return status, headers, rest, b""
        rest += d


def read_response_rest(sock, buf, timeout):
    class Pre:
        def __init__(self, s, pre):
            self.s, self.pre = s, pre

        def settimeout(self, t):
            self.s.settimeout(t)

        def recv(self, n):
            if self.pre:
                d, self.pre = self.pre, b""
                return d
            return self.s.recv(n)
    return read_response(Pre(sock, buf), timeout)


def closed_within(sock, seconds):
    """True when the peer closes (EOF or reset) within seconds; data read meanwhile is dropped."""
    deadline = time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        sock.settimeout(left)
        try:
            d = sock.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            return True
        except (socket.timeout, TimeoutError):
            return False
        if not d:
            return True


def json_error(status, headers, body, want_status, want_code=None, what=""):
    try:
        parsed = json.loads(body) if body else None
    except ValueError:
        parsed = None
    ctype = headers.get("content-type", "")
    assert "application/json" in ctype, f"{what}: Content-Type {ctype!r}"
    return su.check_error(status, parsed, body, want_status, want_code, what)


def rst_close(sock):
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


# ---- background traffic ---------------------------------------------------------------------

class Background(threading.Thread):
    """Sends well-formed greedy completions in a loop until stopped; records every outcome."""

    BODY = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}

    def __init__(self, url):
        super().__init__(daemon=True)
        self.url = url
        self.stop = threading.Event()
        self.ok = 0
        self.errors = []
        self.texts = set()

    def run(self):
        while not self.stop.is_set():
            t0 = time.monotonic()
            try:
                status, parsed, raw = su.post_json(self.url, "/v1/completions", self.BODY,
                                                   timeout=60)
            except Exception as exc:  # noqa: BLE001
                self.errors.append(f"{type(exc).__name__}: {exc} after {time.monotonic()-t0:.1f} s")
                time.sleep(0.2)
                continue
            if status != 200 or not isinstance(parsed, dict):
                self.errors.append(f"status {status}: {raw[:200]!r}")
                continue
            try:
                text = parsed["choices"][0]["text"]
            except (KeyError, IndexError, TypeError):
                self.errors.append(f"no choices[0].text: {raw[:200]!r}")
                continue
            if not text:
                self.errors.append(f"empty text: {raw[:200]!r}")
                continue
            self.texts.add(text)
            self.ok += 1


# ---- the corpus -----------------------------------------------------------------------------

def C(prompt="Hello", **kw):
    d = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
    d.update(kw)
    return d


def CH(messages=None, **kw):
    d = {"model": MODEL, "messages": messages if messages is not None else
         [{"role": "user", "content": "Hello"}], "max_tokens": 4}
    d.update(kw)
    return d


def enc(obj):
    return json.dumps(obj).encode() if not isinstance(obj, (bytes, str)) else \
        (obj.encode() if isinstance(obj, str) else obj)


LONG_PROMPT = " ".join(["hello"] * 2000)

# (name, path, body, status, code or None, param or None)
JSON_CASES = [
    ("malformed JSON", "/v1/completions", b'{"model": "x", "prompt": ', 400, None, None),
    ("malformed JSON (trailing garbage)", "/v1/completions", enc(C()) + b"}}", 400, None, None),
    ("malformed JSON chat", "/v1/chat/completions", b"{messages: [}", 400, None, None),
    ("empty body", "/v1/completions", b"", 400, None, None),
    ("JSON array", "/v1/completions", b"[1, 2, 3]", 400, None, None),
    ("JSON string", "/v1/chat/completions", b'"hello"', 400, None, None),
    ("JSON null", "/v1/completions", b"null", 400, None, None),
    ("JSON number", "/v1/completions", b"42", 400, None, None),
    ("max_tokens \"ten\"", "/v1/completions", enc(C(max_tokens="ten")), 400, None, "max_tokens"),
    ("max_tokens 1.5", "/v1/completions", enc(C(max_tokens=1.5)), 400, None, "max_tokens"),
    ("messages not an array", "/v1/chat/completions", enc(CH(messages="hi")), 400, None,
     "messages"),
    ("messages object", "/v1/chat/completions", enc(CH(messages={"role": "user"})), 400, None,
     "messages"),
    ("temperature \"hot\"", "/v1/completions", enc(C(temperature="hot")), 400, None, "temperature"),
    ("temperature 3", "/v1/completions", enc(C(temperature=3)), 400, None, "temperature"),
    ("top_p 1.5", "/v1/completions", enc(C(top_p=1.5)), 400, None, "top_p"),
    ("stop 5", "/v1/completions", enc(C(stop=5)), 400, None, "stop"),
    ("stop [1]", "/v1/chat/completions", enc(CH(stop=[1])), 400, None, None),
    ("5 stop strings", "/v1/completions", enc(C(stop=["a", "b", "c", "d", "e"])), 400, None,
     "stop"),
    ("prompt 5", "/v1/completions", enc(C(prompt=5)), 400, None, "prompt"),
    ("prompt missing", "/v1/completions", enc({"model": MODEL, "max_tokens": 4}), 400, None, None),
    ("negative max_tokens", "/v1/completions", enc(C(max_tokens=-1)), 400, None, "max_tokens"),
    ("huge max_tokens", "/v1/completions", enc(C(max_tokens=100000)), 400, None, "max_tokens"),
    ("max_tokens over --max-tokens", "/v1/chat/completions", enc(CH(max_tokens=MAX_TOKENS + 1)),
     400, None, "max_tokens"),
    ("n=0", "/v1/completions", enc(C(n=0)), 400, None, "n"),
    ("n=9", "/v1/completions", enc(C(n=9)), 400, None, "n"),
    ("n \"two\"", "/v1/chat/completions", enc(CH(n="two")), 400, None, "n"),
    ("logprobs 6", "/v1/completions", enc(C(logprobs=6)), 400, None, "logprobs"),
    ("top_logprobs 21", "/v1/chat/completions", enc(CH(logprobs=True, top_logprobs=21)), 400,
     None, "top_logprobs"),
    ("presence_penalty 3", "/v1/completions", enc(C(presence_penalty=3)), 400, None,
     "presence_penalty"),
    ("logit_bias token out of range", "/v1/completions", enc(C(logit_bias={"99999999": 1})), 400,
     None, None),
    ("logit_bias value 200", "/v1/completions", enc(C(logit_bias={"5": 200})), 400, None, None),
    ("prompt token id out of range", "/v1/completions", enc(C(prompt=[1, 2, 10**9])), 400, None,
     None),
    ("priority 256", "/v1/completions", enc(C(priority=256)), 400, None, "priority"),
    ("stream \"yes\"", "/v1/completions", enc(C(stream="yes")), 400, None, "stream"),
    ("unknown model", "/v1/completions", enc(C(model="gpt-9")), 404, "model_not_found", None),
    ("unknown model chat", "/v1/chat/completions", enc(CH(model="gpt-9")), 404, "model_not_found",
     None),
    ("invalid UTF-8 prompt", "/v1/completions",
     b'{"model":"' + MODEL.encode() + b'","prompt":"abc \xff\xfe def","max_tokens":4}', 400,
     None, None),
    ("invalid UTF-8 chat content", "/v1/chat/completions",
     b'{"model":"' + MODEL.encode() + b'","messages":[{"role":"user","content":"a\xc3\x28b"}]}',
     400, None, None),
    ("overlong UTF-8", "/v1/completions",
     b'{"model":"' + MODEL.encode() + b'","prompt":"\xc0\xaf","max_tokens":4}', 400, None, None),
    ("lone surrogate escape", "/v1/completions",
     b'{"model":"' + MODEL.encode() + b'","prompt":"a\\ud800b","max_tokens":4}', 400, None, None),
    ("invalid UTF-8 stop", "/v1/completions",
     b'{"model":"' + MODEL.encode() + b'","prompt":"hi","stop":["\xff"],"max_tokens":4}', 400,
     None, None),
    ("prompt over the context", "/v1/completions", enc(C(prompt=LONG_PROMPT)), 400,
     "context_length_exceeded", None),
    ("chat over the context", "/v1/chat/completions",
     enc(CH(messages=[{"role": "user", "content": LONG_PROMPT}])), 400,
     "context_length_exceeded", None),
    ("token prompt over the context", "/v1/completions", enc(C(prompt=[100] * (CTX + 50))), 400,
     "context_length_exceeded", None),
    ("empty messages", "/v1/chat/completions", enc(CH(messages=[])), 400, None, "messages"),
    ("message without content", "/v1/chat/completions", enc(CH(messages=[{"role": "user"}])), 400,
     None, None),
    ("message with bad role", "/v1/chat/completions",
     enc(CH(messages=[{"role": "wizard", "content": "hi"}])), 400, None, None),
]


def run_json_case(srv, path, body, want, code, param, name):
    status, hdrs, raw = su.request(srv.url, "POST", path, body, timeout=30)
    err = json_error(status, hdrs, raw, want, code, name)
    if param is not None:
        assert err["param"] in (param, None) or str(err["param"]).startswith(param), \
            f"{name}: param {err['param']!r}, want {param!r}"


def main():
    r = su.Runner("serve_bad")
    for part in (run, run_limits, run_timeout, run_shutdown):
        try:
            part(r)
        except AssertionError as e:  # a server did not start
            r.fail(f"{part.__name__}: server start", str(e))
    r.finish()


def run_limits(r):
    """--max-conns: one connection too many closes the longest-idle one (idle connections
    cannot lock clients out); --max-queue: requests beyond the running sequence and the queue get
    429 (type rate_limit_error); the rest succeed."""
    conns = 6
    with su.server("--max-conns", conns, "--max-seqs", 1, "--max-queue", 2, runner=r) as srv:
        def too_many_conns():
            held = []
            for _ in range(conns):
                held.append(connect(srv))
                time.sleep(0.05)  # distinct ages: held[0] has waited longest
            try:
                time.sleep(0.3)
                status, _, raw = su.get(srv.url, "/health", timeout=10)
                assert status == 200, f"connection {conns + 1} of {conns}: {status} {raw[:200]!r}"
                assert closed_within(held[0], 5), "the longest-idle connection was not closed"
            finally:
                for h in held:
                    h.close()
            deadline = time.monotonic() + 5
            while True:  # the slots come back
                try:
                    status, _, _ = su.get(srv.url, "/health", timeout=5)
                except OSError:
                    status = None
                if status == 200:
                    break
                assert time.monotonic() < deadline, f"/health {status} after the connections closed"
                time.sleep(0.2)

        def queue_full():
            n = conns - 1
            results = [None] * n
            barrier = threading.Barrier(n)

            def worker(i):
                try:
                    barrier.wait(10)
                    results[i] = su.post_json(srv.url, "/v1/completions", C(
                        prompt=f"Request {i}: once upon a time", max_tokens=64, temperature=0),
                        timeout=120)
                except Exception as exc:  # noqa: BLE001
                    results[i] = exc

            threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(150)
            errors = [f"#{i}: {x!r}" for i, x in enumerate(results) if isinstance(x, Exception)]
            assert not errors, f"requests failed: {errors}"
            statuses = [x[0] for x in results]
            assert set(statuses) <= {200, 429}, f"statuses {statuses}"
            assert statuses.count(429) >= 1, \
                f"{n} simultaneous requests, --max-seqs 1 --max-queue 2: no 429 ({statuses})"
            assert statuses.count(200) >= 1, f"no request succeeded: {statuses}"
            for status, parsed, raw in results:
                if status == 429:
                    err = su.check_error(status, parsed, raw, 429, None, "queue full")
                    assert err["type"] == "rate_limit_error", f"429 type {err['type']!r}"
                else:
                    assert parsed["choices"][0]["text"], raw[:200]
            su.log(f"     statuses {statuses}")

        r.case("--max-conns: one more connection closes the longest-idle one, is served",
               too_many_conns)
        r.case("--max-queue: a full queue -> 429 rate_limit_error, others 200", queue_full)
        r.case("limits: idle afterwards", su.wait_idle, srv.url)


NO_EOS = {"0": -100, "2": -100}  # <|endoftext|> and <|im_end|> of the test model: never stop early


def run_timeout(r):
    """--request-timeout 1: a generation still running after 1 s ends with finish_reason
    "timeout" (200, plain and streamed) and counts as reason="timeout"."""
    with su.server("--request-timeout", 1, runner=r) as srv:
        def timeout_plain():
            before = su.metric(su.metrics(srv.url), "shoal_requests_finished_total",
                               reason="timeout") or 0
            t0 = time.monotonic()
            status, parsed, raw = su.post_json(srv.url, "/v1/completions", C(
                prompt="Once upon a time", max_tokens=2000, temperature=0, logit_bias=NO_EOS),
                timeout=60)
            dt = time.monotonic() - t0
            assert status == 200, f"status {status}: {raw[:300]!r}"
            ch = parsed["choices"][0]
            assert ch["finish_reason"] == "timeout", \
                f"finish_reason {ch['finish_reason']!r} after {dt:.1f} s, " \
                f"{parsed['usage']['completion_tokens']} tokens"
            assert dt < 5, f"a 1 s deadline answered after {dt:.1f} s"
            assert 0 < parsed["usage"]["completion_tokens"] < 2000
            after = su.metric(su.wait_idle(srv.url), "shoal_requests_finished_total",
                              reason="timeout") or 0
            assert after - before == 1, f'reason="timeout" rose by {after - before}'

        def timeout_stream():
            status, ctype, events = su.stream(srv.url, "/v1/chat/completions", CH(
                messages=[{"role": "user", "content": "Write a very long story."}],
                max_tokens=2000, temperature=0, logit_bias=NO_EOS, stream=True), timeout=60)
            assert status == 200, f"status {status}: {events}"
            assert events and events[-1] == "[DONE]", f"no [DONE]: {events[-2:]}"
            fins = [ch.get("finish_reason") for e in events[:-1] for ch in e.get("choices", [])]
            assert fins and fins[-1] == "timeout" and all(f is None for f in fins[:-1]), \
                f"finish_reasons {[f for f in fins if f]}"

        r.case("--request-timeout: finish_reason timeout", timeout_plain)
        r.case("--request-timeout: streamed finish_reason timeout + [DONE]", timeout_stream)


def run_shutdown(r):
    """SIGTERM with streams in flight: the server stops accepting (refused or 503), every open
    stream ends (finished or closed) and the process exits 0 within 30 s."""
    srv = su.start()
    r.srv = srv
    streams = []
    try:
        def start_streams():
            for i in range(3):
                path, body = "/v1/completions", enc(C(prompt=f"Story {i}: once upon a time",
                                                      max_tokens=MAX_TOKENS, stream=True))
                s = connect(srv, timeout=60)
                streams.append(s)
                s.sendall(b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n" % (path.encode(), len(body)) + body)
                buf = b""
                while b"data: " not in buf:
                    d = s.recv(4096)
                    assert d, f"stream {i} closed before its first chunk: {buf[:200]!r}"
                    buf += d

        ok = r.case("shutdown: 3 streams running", start_streams)
        srv.proc.send_signal(signal.SIGTERM)
        r.srv = None
        if ok:
            def no_new_requests():
                time.sleep(0.3)
                try:
                    status, _, raw = su.get(srv.url, "/health", timeout=5)
                except (ConnectionError, OSError, http_client.HTTPException):
                    return  # refused, reset or closed: fine
                assert status == 503, \
                    f"a new request 0.3 s after SIGTERM got {status} {raw[:100]!r}"

            def streams_end():
                for i, s in enumerate(streams):
                    assert closed_within(s, 30), f"stream {i} still open 30 s after SIGTERM"

            r.case("shutdown: new requests refused or 503", no_new_requests)
            r.case("shutdown: open streams end", streams_end)
    finally:
        for s in streams:
            s.close()
        problems = su.stop(srv, signal.SIGTERM, already_sent=True)
        if problems:
            r.fail("shutdown with streams in flight: exit 0 within 30 s", "\n".join(problems))
        else:
            r.passed += 1
            su.log("ok   serve_bad: shutdown with streams in flight: exit 0 within 30 s")


def run(r):
    with su.server("--max-body", MAX_BODY, "--ctx", CTX, "--header-timeout-ms", HEADER_TIMEOUT_MS,
                   "--max-tokens", MAX_TOKENS, runner=r) as srv:
        bg = Background(srv.url)
        bg.start()
        time.sleep(0.5)
        cancels0 = su.metric(su.metrics(srv.url), "shoal_requests_finished_total",
                             reason="cancel") or 0

        for name, path, body, want, code, param in JSON_CASES:
            r.case(name, run_json_case, srv, path, body, want, code, param, name)

        def unknown_paths():
            for method, path in (("GET", "/v1/nope"), ("POST", "/v1/images/generations"),
                                 ("GET", "/"), ("GET", "/v1/models/../../etc/passwd")):
                body = enc(C()) if method == "POST" else None
                status, hdrs, raw = su.request(srv.url, method, path, body, timeout=30)
                json_error(status, hdrs, raw, 404, None, f"{method} {path}")

        def wrong_methods():
            for method, path in (("GET", "/v1/completions"), ("DELETE", "/health"),
                                 ("PUT", "/v1/chat/completions"), ("POST", "/v1/models")):
                status, hdrs, raw = su.request(srv.url, method, path, b"{}", timeout=30)
                assert status in (404, 405, 501), f"{method} {path}: status {status}"
                json_error(status, hdrs, raw, status, None, f"{method} {path}")

        def oversized(chunked):
            s = connect(srv)
            try:
                body = enc(C(prompt="x" * 100_000))
                assert len(body) > 100_000
                if chunked:
                    head = (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"
                            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
                else:
                    head = (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"
                            b"Content-Type: application/json\r\n"
                            b"Content-Length: %d\r\n\r\n" % len(body))
                s.sendall(head)
                if not chunked:
                    r_, _, _ = select.select([s], [], [], 2.0)
                    if r_:  # answered from the headers alone
                        resp = read_response(s)
                        assert resp, "closed without a response"
                        json_error(*resp[:3], 413, None, "Content-Length 100 kB")
                        return
                for i in range(0, len(body), 8192):
                    piece = body[i:i + 8192]
                    data = (b"%x\r\n" % len(piece) + piece + b"\r\n") if chunked else piece
                    try:
                        s.sendall(data)
                    except (BrokenPipeError, ConnectionResetError):
                        break
                    r_, _, _ = select.select([s], [], [], 0)
                    if r_:
                        break
                else:
                    if chunked:
                        try:
                            s.sendall(b"0\r\n\r\n")
                        except (BrokenPipeError, ConnectionResetError):
                            pass
                resp = read_response(s)
                assert resp, "closed (or reset) without a 413 response"
                json_error(*resp[:3], 413, None, "chunked 100 kB" if chunked else "100 kB")
                assert closed_within(s, 5), "connection not closed after 413"
            finally:
                s.close()

        def expect_100_continue_oversized():
            s = connect(srv)
            try:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\n"
                          b"Content-Type: application/json\r\nContent-Length: 200000\r\n\r\n")
                resp = read_response(s)
                assert resp, "closed without a response"
                json_error(*resp[:3], 413, None, "Expect: 100-continue, 200 kB")
            finally:
                s.close()

        def slow_loris():
            s = connect(srv)
            try:
                req = b"POST /v1/completions HTTP/1.1\r\nHost: slow\r\nX-Slow: " + b"a" * 30
                t0 = time.monotonic()
                limit = HEADER_TIMEOUT_MS / 1000 + 3.0
                got = b""
                for i, byte in enumerate(req):
                    try:
                        s.send(bytes([byte]))
                    except (BrokenPipeError, ConnectionResetError):
                        break
                    r_, _, _ = select.select([s], [], [], 1.0)
                    if r_:
                        try:
                            d = s.recv(65536)
                        except ConnectionResetError:
                            d = b""
                        got += d
                        if not d or got:
                            break
                    if time.monotonic() - t0 > limit + 5:
                        break
                if got:
                    assert got.startswith(b"HTTP/1.1 408"), f"slow-loris got {got[:100]!r}"
                    closed = closed_within(s, 3)
                    assert closed, "not closed after the 408"
                dt = time.monotonic() - t0
                assert dt <= limit, f"slow connection still open {dt:.1f} s after its first byte " \
                    f"(header timeout {HEADER_TIMEOUT_MS} ms)"
                su.log(f"     slow-loris closed after {dt:.1f} s "
                       f"({'408' if got else 'no response'})")
            finally:
                s.close()

        def stream_body(chat):
            if chat:
                return "/v1/chat/completions", enc(CH(max_tokens=300, stream=True,
                                                      messages=[{"role": "user", "content":
                                                                 "Write a long story."}]))
            return "/v1/completions", enc(C(prompt="Once upon a time there was", max_tokens=300,
                                            stream=True))

        def disconnect_mid_stream():
            for i in range(20):
                path, body = stream_body(chat=i % 2 == 1)
                s = connect(srv, timeout=60)
                try:
                    s.sendall(b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                              b"Content-Length: %d\r\n\r\n" % (path.encode(), len(body)) + body)
                    buf = b""
                    while b"data: " not in buf.partition(b"\r\n\r\n")[2]:
                        d = s.recv(4096)
                        assert d, f"#{i}: closed before the first chunk: {buf[:300]!r}"
                        buf += d
                    assert buf.startswith(b"HTTP/1.1 200"), f"#{i}: {buf[:200]!r}"
                finally:
                    if i % 4 == 0:
                        rst_close(s)
                    else:
                        s.close()

        def disconnect_early():
            # close right after sending the request, before any response
            for i in range(5):
                path, body = stream_body(chat=i % 2 == 0)
                if i == 4:
                    body = enc(C(prompt="Once upon a time there was", max_tokens=300))
                s = connect(srv)
                s.sendall(b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n" % (path.encode(), len(body)) + body)
                if i % 2:
                    rst_close(s)
                else:
                    s.close()
            # close in the middle of the body, and in the middle of the headers
            s = connect(srv)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n\r\n"
                      b'{"model":')
            s.close()
            s = connect(srv)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Le")
            rst_close(s)

        def garbage(data, allow_silent_close=False):
            s = connect(srv)
            try:
                s.sendall(data)
                try:
                    resp = read_response(s, timeout=10)
                except AssertionError:
                    raise
                if resp is None:
                    assert allow_silent_close, f"{data[:20]!r}: closed without a 400"
                    return
                status, hdrs, body, _ = resp
                json_error(status, hdrs, body, 400, None, f"garbage {data[:20]!r}")
                assert closed_within(s, 5), "connection not closed after the 400"
            finally:
                s.close()

        def headers_too_large():
            for what, data in (
                    ("one 20 kB header", b"GET /health HTTP/1.1\r\nHost: t\r\nX-Big: " +
                     b"a" * 20000 + b"\r\n\r\n"),
                    ("3000 small headers", b"GET /health HTTP/1.1\r\nHost: t\r\n" +
                     b"".join(b"X-H%d: v\r\n" % i for i in range(3000)) + b"\r\n"),
                    ("20 kB URL",
                     b"GET /health?" + b"q" * 20000 + b" HTTP/1.1\r\nHost: t\r\n\r\n")):
                s = connect(srv)
                try:
                    try:
                        s.sendall(data)
                    except (BrokenPipeError, ConnectionResetError):
                        pass
                    resp = read_response(s)
                    assert resp, f"{what}: closed without a 431"
                    status, hdrs, body, _ = resp
                    assert status in (431, 414) or what != "20 kB URL", f"{what}: {status}"
                    json_error(status, hdrs, body, 431 if what != "20 kB URL" else status, None,
                               what)
                    assert closed_within(s, 5), f"{what}: not closed after {status}"
                finally:
                    s.close()

        def bad_content_length():
            for what, head in (
                    ("Content-Length abc", b"Content-Length: abc\r\n"),
                    ("negative Content-Length", b"Content-Length: -5\r\n"),
                    ("Content-Length + chunked",
                     b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n")):
                s = connect(srv)
                try:
                    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n" + head +
                              b"\r\n" + (b"0\r\n\r\n" if b"chunked" in head else b"{}"))
                    resp = read_response(s)
                    assert resp, f"{what}: closed without a 400"
                    json_error(*resp[:3], 400, None, what)
                finally:
                    s.close()

        def pipelining():
            s = connect(srv)
            try:
                body = enc(C(prompt="Hi", max_tokens=2, temperature=0))
                s.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"
                          b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"
                          b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" %
                          len(body) + body + b"GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n")
                pre = b""
                for want in ("health", "completion", "models"):
                    resp = read_response_rest(s, pre, 30)
                    assert resp, f"closed before the {want} response"
                    status, _, rbody, pre = resp
                    assert status == 200, f"pipelined {want}: {status} {rbody[:200]!r}"
                    j = json.loads(rbody)
                    if want == "health":
                        assert j.get("status") == "ok", j
                    elif want == "completion":
                        assert "choices" in j, j
                    else:
                        assert j.get("object") == "list", j
            finally:
                s.close()

        def http10():
            s = connect(srv)
            try:
                s.sendall(b"GET /health HTTP/1.0\r\n\r\n")
                resp = read_response(s)
                assert resp and resp[0] == 200, resp
                assert closed_within(s, 5), "HTTP/1.0 connection not closed"
            finally:
                s.close()

        r.case("unknown paths -> 404", unknown_paths)
        r.case("wrong methods -> 404/405/501", wrong_methods)
        r.case("100 kB body (Content-Length) -> 413", oversized, False)
        r.case("100 kB body (chunked) -> 413", oversized, True)
        r.case("Expect: 100-continue over the limit -> 413", expect_100_continue_oversized)
        r.case("slow-loris headers closed within the header timeout", slow_loris)
        r.case("20 disconnects mid-stream", disconnect_mid_stream)
        r.case("disconnects before the response / mid-request", disconnect_early)
        r.case("garbage request line -> 400 + close", garbage, b"HELLO WORLD\r\n\r\n")
        r.case("binary junk -> 400 or close", garbage,
               b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(256)), True)
        r.case("headers too large -> 431", headers_too_large)
        r.case("bad Content-Length -> 400", bad_content_length)
        r.case("pipelined requests answered in order", pipelining)
        r.case("HTTP/1.0 request", http10)

        # the background traffic stops; every request must have succeeded
        bg.stop.set()
        bg.join(90)

        def background_ok():
            assert not bg.is_alive(), "background thread stuck"
            assert bg.ok > 0, f"no background request succeeded; errors: {bg.errors[:5]}"
            assert not bg.errors, f"{len(bg.errors)} of {bg.ok + len(bg.errors)} background " \
                f"requests failed, first: {bg.errors[:3]}"
            assert len(bg.texts) == 1, f"greedy background texts differ: {sorted(bg.texts)}"
            su.log(f"     {bg.ok} background completions, all 200, text {next(iter(bg.texts))!r}")

        def health_and_idle():
            status, _, data = su.get(srv.url, "/health")
            assert status == 200 and json.loads(data).get("status") == "ok", (status, data)
            text = su.wait_idle(srv.url, 10)
            cancels = (su.metric(text, "shoal_requests_finished_total", reason="cancel") or 0) \
                - cancels0
            assert cancels >= 20, f"shoal_requests_finished_total{{reason=\"cancel\"}} rose by " \
                f"{cancels:.0f} after 20 mid-stream disconnects"

        r.case("background completions all succeeded", background_ok)
        r.case("/health ok, requests_running back to 0, cancels counted", health_and_idle)


if __name__ == "__main__":
    main()
