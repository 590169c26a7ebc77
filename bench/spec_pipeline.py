#!/usr/bin/env python3
"""Speculative decoding through a 2-stage pipeline at batch 1 (issue 27): `shoal cluster up` of a
2-stage pipeline of a model (front, w0, w1 over ipc://, one thread per node), once with the
batcher's n-gram speculation (`batcher = { spec = "ngram" }`) and once without, the two clusters
alternating over ROUNDS rounds (the order swapped every round). Each run sends the edit workload
(a paragraph to repeat with one change, so the answer restates the prompt) and a free-form one
(a short story), one request at a time, greedy, and times each answer. Prints JSON lines:

  spec_pipeline: one per cluster, round and workload: output tokens/s (completion tokens over the
      request's wall time, prompt included), the drafts, drafted and accepted tokens the run added
      to the front's /metrics, the load average before it, and whether the text equals the off
      run's of the same round;
  spec_pipeline_ratio: on/off per round and workload; spec_pipeline_ratio_median per workload.

Usage: bench/spec_pipeline.py [--model PATH] [--rounds N] [--tokens N] [--bin B]
(from the repository root; default: the default model, 3 rounds, 160 tokens).
"""

import argparse
import http.client
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

EDIT = ("Repeat the following paragraph word for word, changing only the day \"Tuesday\" to "
        "\"Friday\" everywhere: The library on Elm Street opens at nine in the morning on Tuesday. "
        "Visitors can borrow up to five books at a time, and each loan lasts three weeks. The "
        "reading room on the second floor is quiet and has large windows that face the park. "
        "Story hour for children takes place every Tuesday afternoon, and volunteers help older "
        "visitors use the computers. Late returns cost ten cents per day, but the fee is waived "
        "for students.")
STORY = "Write a short story about a lighthouse keeper who finds a message in a bottle."
WORKLOADS = {"edit": EDIT, "story": STORY}


def chat(port, prompt, tokens):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
            "temperature": 0}
    t0 = time.monotonic()
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = json.loads(resp.read())
    dt = time.monotonic() - t0
    if resp.status != 200:
        raise SystemExit(f"HTTP {resp.status}: {data}")
    return data["choices"][0]["message"]["content"], data["usage"]["completion_tokens"], dt


def metrics(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    out = {}
    for k in ("drafts", "draft_tokens", "accepted_tokens"):
        m = re.search(rf"^shoal_spec_{k}_total(?:{{[^}}]*}})? (\S+)$", text, re.M)
        out[k] = float(m.group(1)) if m else 0.0
    return out


def run_cluster(a, d, spec, rnd, commit, results):
    tag = f"{spec}-{rnd}"
    script = os.path.join(d, f"{tag}.lua")
    sd = os.path.join(d, tag)
    os.makedirs(sd, exist_ok=True)
    with open(script, "w") as f:
        f.write(f"""local m = model {{ path = '{a.model}', name = 'm' }}
return cluster {{
  nodes = {{ node {{ name = 'front', listen = 'ipc://{sd}/f.sock' }},
            node {{ name = 'w0', listen = 'ipc://{sd}/w0.sock' }},
            node {{ name = 'w1', listen = 'ipc://{sd}/w1.sock' }} }},
  gateway = {{ node = 'front', http = '127.0.0.1:8080' }},
  replicas = {{ replica {{ model = m, stages = pipeline(m, {{ 'w0', 'w1' }}) }} }},
  batcher = {{ spec = '{spec}' }},
  kv = {{ memory = '256MiB' }},
}}
""")
    log = os.path.join(d, f"{tag}.log")
    logf = open(log, "wb")
    up = subprocess.Popen([a.bin, "cluster", "up", script, "-t", "1", "--", "--port", "0"],
                          cwd=ROOT, stdout=logf, stderr=logf, start_new_session=True)
    logf.close()
    try:
        t_end = time.monotonic() + 120
        port = None
        while port is None:
            with open(log, "rb") as f:
                m = re.search(rb"listening on http://127\.0\.0\.1:(\d+)", f.read())
            if m:
                port = int(m.group(1))
            elif up.poll() is not None or time.monotonic() > t_end:
                with open(log, "rb") as f:
                    raise SystemExit(f"cluster up failed:\n{f.read()[-2000:].decode()}")
            else:
                time.sleep(0.05)
        chat(port, "Say hello.", 8)  # warm-up: pages, the step-cost table's first points
        for name, prompt in WORKLOADS.items():
            m0 = metrics(port)
            load = float(open("/proc/loadavg").read().split()[0])
            text, n, dt = chat(port, prompt, a.tokens)
            m1 = metrics(port)
            rec = {"name": "spec_pipeline", "commit": commit, "model": os.path.basename(a.model),
                   "spec": spec, "round": rnd, "workload": name, "tokens": n,
                   "tok_s": round(n / dt, 2), "wall_s": round(dt, 3),
                   "drafts": m1["drafts"] - m0["drafts"],
                   "drafted": m1["draft_tokens"] - m0["draft_tokens"],
                   "accepted": m1["accepted_tokens"] - m0["accepted_tokens"], "load": load}
            results.setdefault((rnd, name), {})[spec] = (rec, text)
            print(json.dumps(rec), flush=True)
    finally:
        up.send_signal(15)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, 9)
            up.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(ROOT, "models",
                                                    "smollm2-135m-instruct-q4_1.gguf"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "shoal"))
    a = ap.parse_args()
    if not os.path.exists(a.model):
        sys.exit(f"spec_pipeline: no model at {a.model} (scripts/ fetches the default one)")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    d = tempfile.mkdtemp(prefix="shspecp-", dir="/tmp")
    results = {}
    for rnd in range(1, a.rounds + 1):
        order = ("off", "ngram") if rnd % 2 else ("ngram", "off")
        for spec in order:
            run_cluster(a, d, spec, rnd, commit, results)
    ratios = {}
    for (rnd, name), r in sorted(results.items()):
        off, on = r["off"], r["ngram"]
        ratio = on[0]["tok_s"] / off[0]["tok_s"]
        ratios.setdefault(name, []).append(ratio)
        print(json.dumps({"name": "spec_pipeline_ratio", "round": rnd, "workload": name,
                          "ratio": round(ratio, 3), "same_output": on[1] == off[1],
                          "accept_rate": round(on[0]["accepted"] / on[0]["drafted"], 3)
                          if on[0]["drafted"] else None}))
    for name, rs in ratios.items():
        print(json.dumps({"name": "spec_pipeline_ratio_median", "workload": name,
                          "rounds": len(rs), "ratio": round(statistics.median(rs), 3)}))


if __name__ == "__main__":
    main()
