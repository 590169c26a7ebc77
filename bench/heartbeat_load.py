#!/usr/bin/env python3
"""Heartbeats while every node computes (issue 25): a 2-stage pipeline (w0, w1 as `shoal node -t
T`, the front as `shoal serve -c`, as bench/chaos_recovery.py's hot case starts them, in this
process's session beside --hog busy loops), kept busy by --streams greedy streams started again
as they end, for --seconds. GET /admin/status is read every 20 ms; each read gives, per worker,
the age of its last PONG (heartbeat_age_ms: the watchdog judges a node dead when it passes 3
beats of 100 ms with 3 PINGs unanswered) and the last round trip (heartbeat_rtt_ms).

Prints the figures (p50, p99, max of the age and the round trip over every read of both workers),
the tokens generated per second (the compute's throughput), the deaths the watchdog logged (any
is false: nothing is stopped or killed; each with its time from the start of the reads, negative
for one during the 2 s start of the load) and the load average. Run it against two binaries in
turn to compare (the machine is shared: alternate them, and quote the load).

Usage (from the repository root):
  bench/heartbeat_load.py [--bin build/shoal] [--model PATH] [--threads 2] [--hog 2]
                          [--streams 8] [--seconds 20] [--label L] [-- NODE FLAGS]
NODE FLAGS go to every `shoal node` and to the front (e.g. -- --control-nice 0).
"""

import argparse
import http.client
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import chaos_recovery as cr  # noqa: E402


class Busy:
    """--streams streams, each started again when it ends, until stop()."""

    def __init__(self, port, n, tokens):
        self.stopping = threading.Event()
        self.tokens = 0
        self.errors = 0
        self.lock = threading.Lock()

        def one(i):
            k = 0
            while not self.stopping.is_set():
                times = []
                try:
                    cr.stream(port, f"Story {i}.{k}: once upon a time", tokens, times)
                except Exception:  # noqa: BLE001 - counted, the load goes on
                    with self.lock:
                        self.errors += 1
                with self.lock:
                    self.tokens += len(times)
                k += 1

        self.threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def stop(self):
        self.stopping.set()
        for t in self.threads:
            t.join(120)


def status(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/admin/status")
        return json.loads(conn.getresponse().read().decode())
    finally:
        conn.close()


def pct(xs, p):
    return cr.pct(xs, p) if xs else float("nan")


def main():
    argv = sys.argv[1:]
    extra = []
    if "--" in argv:
        extra = argv[argv.index("--") + 1:]
        argv = argv[:argv.index("--")]
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default=os.path.join(cr.ROOT, "build", "shoal"))
    ap.add_argument("--model", default=os.path.join(cr.ROOT, "models",
                                                    "smollm2-135m-instruct-q4_1.gguf"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hog", type=int, default=2)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--label", default="")
    a = ap.parse_args(argv)
    a.bin, a.model = os.path.abspath(a.bin), os.path.abspath(a.model)
    d = tempfile.mkdtemp(prefix="hb-", dir="/tmp")
    script = cr.write_script(d, a.model, None)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.hog)]
    cl = None
    try:
        cl = cr.Manual.__new__(cr.Manual)
        cl.d, cl.procs, cl.logs = d, {}, {}
        for name in ("w0", "w1"):
            cl._spawn(name, [a.bin, "node", "-c", script, "--name", name, "-t", str(a.threads),
                             *extra])
        for name in ("w0", "w1"):
            cr.wait_for(f"node {name} serving", lambda n=name: "serving" in cr.read(cl.logs[n]),
                        180, lambda n=name: cr.read(cl.logs[n]))
        cl._spawn("front", [a.bin, "serve", "-c", script, "--port", "0", "--recover-timeout",
                            "30", *extra])
        mm = cr.wait_for("listening line", lambda: re.search(
            r"listening on http://127\.0\.0\.1:(\d+)", cr.read(cl.logs["front"])), 180,
            lambda: cr.read(cl.logs["front"]))
        port = int(mm.group(1))
        busy = Busy(port, a.streams, a.tokens)
        time.sleep(2)  # every stream under way
        ages, rtts = [], []
        t0, tok0, unix0 = time.monotonic(), busy.tokens, time.time()
        load0 = os.getloadavg()[0]
        while time.monotonic() - t0 < a.seconds:
            for n in status(port).get("nodes", []):
                if n.get("name") in ("w0", "w1"):
                    if n.get("heartbeat_age_ms") is not None:
                        ages.append(n["heartbeat_age_ms"] / 1000)
                    if n.get("heartbeat_rtt_ms") is not None:
                        rtts.append(n["heartbeat_rtt_ms"] / 1000)
            time.sleep(0.02)
        dt = time.monotonic() - t0
        tok_s = (busy.tokens - tok0) / dt
        deaths = [e for e in status(port).get("events", []) if e.get("kind") == "dead"]
        busy.stop()
        load1 = os.getloadavg()[0]
        print(f"{a.label or os.path.basename(a.bin)}: {dt:.0f} s, -t {a.threads}, {a.hog} hog(s), "
              f"{a.streams} streams, flags {' '.join(extra) or '-'}; load {load0:.1f}-{load1:.1f}")
        print(f"  heartbeat age  s: p50 {pct(ages, 50):.3f} p99 {pct(ages, 99):.3f} "
              f"max {max(ages, default=float('nan')):.3f} ({len(ages)} reads)")
        print(f"  heartbeat rtt  s: p50 {pct(rtts, 50):.3f} p99 {pct(rtts, 99):.3f} "
              f"max {max(rtts, default=float('nan')):.3f}")
        print(f"  tokens/s {tok_s:.1f}, stream errors {busy.errors}, deaths {len(deaths)}"
              + (" (" + "; ".join(f"{e.get('unix_ms', 0) / 1000 - unix0:+.3f} s: "
                                  f"{e.get('msg', '')[:70]}" for e in deaths) + ")"
                 if deaths else ""))
        return 0
    finally:
        if cl is not None:
            cl.stop()
        for h in hogs:
            h.kill()
            h.wait()
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
