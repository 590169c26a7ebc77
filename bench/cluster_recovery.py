#!/usr/bin/env python3
"""Recovery figures of `shoal cluster up` (issue 12, first step): a 2-stage pipeline of a model,
N greedy streams, kill -9 of the last stage's worker while they run; the supervisor restarts it
and the front resumes every stream by recompute. Prints one JSON line per rep:

  kill_to_resume_s: from the kill to the front's "replica 1 resumed" line;
  stall_s: the longest gap between two tokens of any stream around the kill (what a client saw);
  equal: every stream's text equals the undisturbed run's.

Usage: bench/cluster_recovery.py [--model PATH] [--streams N] [--tokens N] [--reps N] [--bin B]
(from the repository root; default model: the default model, 8 streams, 96 tokens, 3 reps).
"""

import argparse
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def stream(port, prompt, tokens, times):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    text = []
    while True:
        line = resp.readline()
        if not line:
            break
        line = line.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        ev = json.loads(line[5:])
        if "error" in ev:
            raise RuntimeError(ev["error"])
        times.append(time.monotonic())
        text.append(ev["choices"][0]["text"])
    conn.close()
    return "".join(text)


def run_streams(port, n, tokens):
    out, times = [None] * n, [[] for _ in range(n)]

    def one(i):
        try:
            out[i] = stream(port, f"Story {i}: once upon a time", tokens, times[i])
        except Exception as exc:  # noqa: BLE001
            out[i] = exc

    ts = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in ts:
        t.start()
    return ts, out, times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(ROOT, "models",
                                                    "smollm2-135m-instruct-q4_1.gguf"))
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "shoal"))
    a = ap.parse_args()
    d = tempfile.mkdtemp(prefix="shrec-", dir="/tmp")
    script = os.path.join(d, "rec.lua")
    with open(script, "w") as f:
        f.write(f"""local m = model {{ path = '{a.model}', name = 'm' }}
return cluster {{
  nodes = {{ node {{ name = 'front', listen = 'ipc://{d}/f.sock' }},
            node {{ name = 'w0', listen = 'ipc://{d}/w0.sock' }},
            node {{ name = 'w1', listen = 'ipc://{d}/w1.sock' }} }},
  gateway = {{ node = 'front', http = '127.0.0.1:8080' }},
  replicas = {{ replica {{ model = m, stages = pipeline(m, {{ 'w0', 'w1' }}) }} }},
  kv = {{ memory = '256MiB' }},
}}
""")
    log = os.path.join(d, "up.log")
    logf = open(log, "wb")
    up = subprocess.Popen([a.bin, "cluster", "up", script, "-t", "1", "--", "--port", "0"],
                          cwd=ROOT, stdout=logf, stderr=logf, start_new_session=True)

    def text():
        with open(log, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def wait(pattern, timeout, start=0):
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            m = re.search(pattern, text()[start:], re.M)
            if m:
                return m
            time.sleep(0.01)
        raise SystemExit(f"no {pattern!r} within {timeout} s:\n{text()[-2000:]}")

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    try:
        port = int(wait(r"listening on http://127\.0\.0\.1:(\d+)", 120).group(1))
        ts, want, _ = run_streams(port, a.streams, a.tokens)
        for t in ts:
            t.join()
        for rep in range(a.reps):
            ts, out, times = run_streams(port, a.streams, a.tokens)
            time.sleep(0.5)
            pids = re.findall(r"^cluster: started node w1 \(worker, pid (\d+)\)", text(), re.M)
            mark = len(text())
            t_kill = time.monotonic()
            os.kill(int(pids[-1]), signal.SIGKILL)
            wait(r"replica 1 resumed", 60, mark)
            t_resume = time.monotonic()
            for t in ts:
                t.join(300)
            stall = max((b - a_) for tl in times for a_, b in zip(tl, tl[1:]) if a_ <= t_kill + 5
                        and b >= t_kill) if any(times) else None
            print(json.dumps({"bench": "cluster_recovery", "commit": commit,
                              "model": os.path.basename(a.model), "streams": a.streams,
                              "tokens": a.tokens, "rep": rep + 1,
                              "kill_to_resume_s": round(t_resume - t_kill, 3),
                              "stall_s": round(stall, 3) if stall else None,
                              "equal": out == want,
                              "errors": sum(1 for o in out if not isinstance(o, str)),
                              "load": os.getloadavg()[0]}), flush=True)
            time.sleep(1.0)
    finally:
        os.killpg(up.pid, signal.SIGTERM)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
        logf.close()


if __name__ == "__main__":
    sys.exit(main())
