"""`shoal serve` against idle connections (stdlib only: raw sockets and http.client).

1. Out of descriptors: a server whose RLIMIT_NOFILE is 64 gets 200 idle connections (opened,
   nothing sent). /health and a completion must still succeed promptly: the server closes the
   longest-idle connections to make room instead of running out of descriptors, and says so in
   its log exactly once (event=fd_limit), not once per connection.
2. Timeouts (--header-timeout-ms 1000 --idle-timeout-ms 1500): a connection that sends nothing
   is closed after the header timeout counted from accept; headers that start late still end
   at that deadline (408); a keep-alive connection is closed after the idle timeout.
3. --max-conns-per-ip 2: a third connection from the same address closes that address's
   longest-idle one and is served.
"""

import os
import re
import resource
import socket
import sys
import time

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402

NOFILE = 64
N_IDLE = 200


def connect(srv, timeout=10):
    s = socket.create_connection((srv.host, srv.port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def closed_by_server(sock, timeout):
    """Seconds until the server closed sock (EOF or reset) without sending anything, or None
    when it stayed open for timeout seconds. Raises if the server sent bytes."""
    t0 = time.monotonic()
    sock.settimeout(timeout)
    try:
        d = sock.recv(4096)
    except socket.timeout:
        return None
    except ConnectionResetError:
        d = b""
    assert d == b"", f"unexpected bytes from the server: {d[:200]!r}"
    return time.monotonic() - t0


def recv_all(sock, timeout):
    """Everything until EOF (or reset) within timeout; returns (bytes, seconds)."""
    t0 = time.monotonic()
    sock.settimeout(timeout)
    buf = b""
    try:
        while True:
            d = sock.recv(65536)
            if not d:
                break
            buf += d
    except (socket.timeout, ConnectionResetError):
        pass
    return buf, time.monotonic() - t0


def is_open(sock):
    """Whether the server still holds sock open (no EOF within 50 ms)."""
    sock.settimeout(0.05)
    try:
        return sock.recv(1, socket.MSG_PEEK) != b""
    except socket.timeout:
        return True
    except OSError:
        return False


def health(srv, timeout=5):
    t0 = time.monotonic()
    status, _, raw = su.get(srv.url, "/health", timeout=timeout)
    return status, time.monotonic() - t0, raw


def limit_fds():
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


def run_fd_limit(r):
    with su.server("-t", "1", runner=r, preexec_fn=limit_fds) as srv:
        held = []

        def idle_flood():
            for i in range(N_IDLE):
                held.append(connect(srv))  # the kernel's backlog takes them all
            time.sleep(0.5)  # let the server accept (and shed) them
            worst = 0.0
            for i in range(5):
                status, dt, raw = health(srv)
                assert status == 200, f"/health #{i} with {N_IDLE} idle connections: {status}"
                worst = max(worst, dt)
            assert worst < 1.0, f"/health took {worst:.2f} s with {N_IDLE} idle connections"
            t0 = time.monotonic()
            status, parsed, raw = su.post_json(srv.url, "/v1/completions", {
                "model": su.MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 8,
                "temperature": 0}, timeout=30)
            dt = time.monotonic() - t0
            assert status == 200, f"completion with {N_IDLE} idle connections: {status} {raw[:200]!r}"
            assert dt < 10, f"completion took {dt:.1f} s"
            su.log(f"     /health worst {worst * 1000:.1f} ms, completion {dt * 1000:.0f} ms "
                   f"with {N_IDLE} idle connections under RLIMIT_NOFILE {NOFILE}")

        def still_serving_after_more():
            # A second wave: the log line must not repeat per connection.
            for i in range(N_IDLE):
                held.append(connect(srv))
            time.sleep(0.5)
            status, dt, _ = health(srv)
            assert status == 200 and dt < 1.0, f"/health after a second wave: {status} {dt:.2f} s"
            text = su.metrics(srv.url)
            shed = su.metric(text, "shoal_http_connections_shed_total") or 0
            assert shed >= N_IDLE, f"shoal_http_connections_shed_total {shed}, want >= {N_IDLE}"

        def logged_once():
            lines = [ln for ln in srv.log_text().splitlines() if "event=fd_limit" in ln]
            assert len(lines) == 1, f"{len(lines)} fd_limit log lines, want 1: {lines[:3]}"
            assert "RLIMIT_NOFILE 64" in lines[0], lines[0]

        try:
            r.case(f"RLIMIT_NOFILE {NOFILE}: {N_IDLE} idle connections, /health and a "
                   "completion still succeed", idle_flood)
            r.case("RLIMIT_NOFILE: a second wave of idle connections, still served",
                   still_serving_after_more)
            r.case("RLIMIT_NOFILE: out of descriptors is logged once", logged_once)
        finally:
            for s in held:
                s.close()


def run_timeouts(r):
    with su.server("--header-timeout-ms", 1000, "--idle-timeout-ms", 1500, runner=r) as srv:
        def silent_connection_closed():
            s = connect(srv)
            try:
                dt = closed_by_server(s, 5)
                assert dt is not None, "a connection that sent nothing is still open after 5 s"
                assert 0.7 < dt < 2.5, f"closed after {dt:.2f} s, want about 1 s"
            finally:
                s.close()

        def late_headers_same_deadline():
            s = connect(srv)
            t0 = time.monotonic()
            try:
                time.sleep(0.8)
                s.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n")  # never finished
                buf, _ = recv_all(s, 5)
                dt = time.monotonic() - t0
                assert buf.startswith(b"HTTP/1.1 408 "), f"got {buf[:100]!r} after {dt:.2f} s"
                assert dt < 1.6, \
                    f"408 {dt:.2f} s after accept: the header timeout did not start at accept"
            finally:
                s.close()

        def idle_keepalive_closed():
            s = connect(srv)
            try:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
                s.settimeout(5)
                buf = b""
                while b'"ok"' not in buf:
                    d = s.recv(4096)
                    assert d, f"closed before the response: {buf!r}"
                    buf += d
                assert buf.startswith(b"HTTP/1.1 200 "), buf[:100]
                dt = closed_by_server(s, 6)
                assert dt is not None, "the keep-alive connection is open 6 s after its response"
                assert 1.0 < dt < 3.5, f"closed {dt:.2f} s after the response, want about 1.5 s"
            finally:
                s.close()

        r.case("--header-timeout-ms counts from accept: a silent connection is closed", 
               silent_connection_closed)
        r.case("--header-timeout-ms: late headers get 408 at the accept deadline",
               late_headers_same_deadline)
        r.case("--idle-timeout-ms: an idle keep-alive connection is closed", idle_keepalive_closed)


def run_per_ip(r):
    with su.server("--max-conns-per-ip", 2, runner=r) as srv:
        def third_sheds_oldest():
            a = connect(srv)
            time.sleep(0.1)
            b = connect(srv)
            time.sleep(0.2)
            try:
                status, dt, raw = health(srv)
                assert status == 200, f"a third connection from one address: {status} {raw[:200]!r}"
                time.sleep(0.2)
                assert not is_open(a), "the longest-idle connection of the address is still open"
                assert is_open(b), "the newer idle connection was closed instead of the oldest"
            finally:
                a.close()
                b.close()

        r.case("--max-conns-per-ip 2: a third connection closes the address's longest-idle one",
               third_sheds_oldest)


def main():
    r = su.Runner("serve_conns")
    for part in (run_fd_limit, run_timeouts, run_per_ip):
        try:
            part(r)
        except AssertionError as e:  # a server did not start
            r.fail(f"{part.__name__}: server start", str(e))
    r.finish()


if __name__ == "__main__":
    main()
