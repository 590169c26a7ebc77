"""Connections that have not proved a node in HELLO (issue 25), against a keyed cluster of real
processes over tcp:// (the cluster of test_cluster_forged.py: a front and two workers).

1. Half frames: three connections to a worker and three to the front each complete the SP
   handshake, announce a 127 MiB frame and send 1 MiB of it. Before, their buffers took the
   node's receive budget (pause_bytes) and it stopped reading every link: heartbeats stopped and
   the replica stalled. Now no buffer is taken for a connection that has not proved a node: the
   cluster keeps serving, every greedy output equal to the undisturbed run's, and after the
   handshake deadline (5 s) the nodes close them (shoal_frames_refused_total{reason=
   "preauth_frame"} on the front).
2. Idle connections: 5000 connections to the front that never send a byte (the probe's count;
   before, all 5000 were held with no timer). The listener holds at most 64 that have not proved
   a node (a new one closes the oldest), and none past 5 s; the cluster keeps serving
   throughout.
"""

import os
import resource
import socket
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402
from test_cluster_forged import STORIES, Cluster, N_TOKENS  # noqa: E402

HS_PUSH = bytes([0, ord("S"), ord("P"), 0, 0, 0x50, 0, 0])  # SP, pipeline0 push


def hostport(url):
    host, port = url[len("tcp://"):].rsplit(":", 1)
    return host, int(port)


def half_frame(url, announce=127 << 20, send=1 << 20):
    """Dials a node's tcp:// listener as a push0 peer, announces a frame of `announce` bytes (an
    8-byte big-endian length, NNG's tcp framing) and sends `send` bytes of it."""
    s = socket.create_connection(hostport(url), timeout=10)
    s.sendall(HS_PUSH)
    hs = b""
    while len(hs) < 8:
        got = s.recv(8 - len(hs))
        assert got, "the node closed the connection during the handshake"
        hs += got
    s.sendall(announce.to_bytes(8, "big"))
    s.settimeout(0.5)
    chunk = bytes(64 << 10)
    sent = 0
    try:
        while sent < send:
            sent += s.send(chunk)
    except socket.timeout:
        pass  # the node does not read it: what is left stays in our buffer
    return s


def closed(s, wait=0.0):
    """True when the node closed s (EOF or reset)."""
    s.settimeout(wait if wait > 0 else 0.001)
    try:
        while True:  # the node's SP handshake may come first
            if s.recv(4096) == b"":
                return True
    except socket.timeout:
        return False
    except OSError:
        return True


def half_frames(c, want):
    socks = [half_frame(c.urls[n]) for n in ("w0", "front") for _ in range(3)]
    try:
        t0 = time.monotonic()
        for _ in range(3):
            got = c.completion()
            assert got == want, f"under half frames {got!r} != {want!r}"
        assert all(p.alive() for p in c.procs.values()), \
            {n: p.proc.returncode for n, p in c.procs.items()}
        time.sleep(max(0.0, 6.0 - (time.monotonic() - t0)))
        assert all(closed(s, 1.0) for s in socks), "a half-frame connection is still open at 6 s"
        n = su.metric(su.metrics(c.url), "shoal_frames_refused_total", node="1",
                      reason="preauth_frame")
        assert n and n >= 3, f"shoal_frames_refused_total{{reason=preauth_frame}} = {n}"
        got = c.completion()
        assert got == want, f"after half frames {got!r} != {want!r}"
    finally:
        for s in socks:
            s.close()


N_IDLE = 5000


def idle_conns(c, want):
    host, port = hostport(c.urls["front"])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = N_IDLE + 256
    if soft < need and (hard == resource.RLIM_INFINITY or hard >= need):
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    n_idle = min(N_IDLE, resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 256)
    assert n_idle >= 300, f"only {n_idle} descriptors for the idle connections"
    if n_idle < N_IDLE:
        su.log(f"note: the descriptor limit allows {n_idle} idle connections, not {N_IDLE}")
    socks = []
    try:
        for _ in range(n_idle):
            socks.append(socket.create_connection((host, port), timeout=10))
        time.sleep(1.0)
        open_now = sum(not closed(s) for s in socks)
        assert open_now <= 64, f"{open_now} idle connections held (the cap is 64)"
        got = c.completion()
        assert got == want, f"under idle connections {got!r} != {want!r}"
        time.sleep(5.5)
        open_now = sum(not closed(s) for s in socks)
        assert open_now == 0, f"{open_now} idle connections still held after the 5 s deadline"
        n = su.metric(su.metrics(c.url), "shoal_frames_refused_total", node="1",
                      reason="preauth_cap")
        assert n and n >= n_idle - 64, f"shoal_frames_refused_total{{reason=preauth_cap}} = {n}"
    finally:
        for s in socks:
            s.close()


def main():
    if not os.path.exists(STORIES):
        su.skip(f"no {STORIES}")
    d = tempfile.mkdtemp(prefix="shpreauth-", dir="/tmp")
    c = Cluster(d)
    r = su.Runner("test_cluster_preauth")
    try:
        c.start()
        want = c.completion()
        assert want[1] == N_TOKENS, want
        r.case("half frames against a worker and the front: serving goes on, outputs equal",
               half_frames, c, want)
        r.case(f"{N_IDLE} idle connections: at most 64 held, none past 5 s, serving goes on",
               idle_conns, c, want)
    finally:
        c.stop()
    for f in os.listdir(d):
        os.unlink(os.path.join(d, f))
    os.rmdir(d)
    return r.finish()


if __name__ == "__main__":
    sys.exit(main())
