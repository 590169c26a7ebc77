#!/usr/bin/env python3
"""Decode tokens/s of `shoal serve` with a JSON schema (response_format) against unconstrained, at
1 stream and at 32 (issue 28's speed figure), one fresh server per run, the two alternating in
rounds with the order swapped every round.

Each request is a streaming chat completion of NGEN tokens with usage: unconstrained ones ignore
EOS; the schema's (by default an array of at least 40 short strings) is long enough that every
answer is cut at NGEN tokens. A stream's decode rate is (completion_tokens - 1) over the time from
its first content chunk to its last; a run's figure at C streams is the sum of its completion
tokens after the first of each over the time from the first stream's first chunk to the last
one's end. One JSON line per run (`grammar_serve`), a `grammar_serve_ratio` per round and client
count (schema over plain) and their median.

Usage: bench/grammar_serve.py [--bin build/shoal] [--model M] [--json-schema FILE] [--rounds N]
       [--ngen N] [--clients 1,32] [--threads T]
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
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 40}


def start(args):
    log = tempfile.NamedTemporaryFile(prefix="shoal-gbench-", suffix=".log", delete=False)
    p = subprocess.Popen([args.bin, "serve", "--port", "0", "-m", args.model, "-t",
                          str(args.threads), "--max-seqs", "64"], cwd=ROOT,
                         stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        m = re.search(r"listening on http://([0-9.]+):(\d+)", open(log.name).read())
        if m:
            return p, m.group(1), int(m.group(2)), log.name
        if p.poll() is not None:
            break
        time.sleep(0.05)
    p.kill()
    sys.exit("server did not start:\n" + open(log.name).read()[-2000:])


def one(host, port, body, out, i):
    c = http.client.HTTPConnection(host, port, timeout=600)
    c.request("POST", "/v1/chat/completions", json.dumps(body).encode(),
              {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        out[i] = RuntimeError(f"{r.status} {r.read()[:300]!r}")
        return
    first = last = None
    usage = None
    for line in r:
        line = line.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        ev = json.loads(line[5:])
        if ev.get("usage"):
            usage = ev["usage"]
        if ev.get("choices") and ev["choices"][0]["delta"].get("content"):
            now = time.monotonic()
            first = first or now
            last = now
    c.close()
    out[i] = (first, last, usage["completion_tokens"] if usage else 0)


def run(args, schema, clients):
    p, host, port, logpath = start(args)
    try:
        body = {"messages": [{"role": "user", "content": "List forty fruit names as JSON."}],
                "max_tokens": args.ngen, "temperature": 1.0, "stream": True,
                "stream_options": {"include_usage": True}}
        if schema is None:
            body["ignore_eos"] = True
        else:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "b", "schema": schema}}
        one(host, port, dict(body, max_tokens=4), [None], 0)  # warm up
        out = [None] * clients
        ts = [threading.Thread(target=one, args=(host, port, body, out, i))
              for i in range(clients)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        bad = [o for o in out if isinstance(o, Exception) or o is None or o[0] is None]
        if bad:
            sys.exit(f"a request failed: {bad[0]!r}")
        toks = sum(o[2] - 1 for o in out)
        span = max(o[1] for o in out) - min(o[0] for o in out)
        per = [(o[2] - 1) / (o[1] - o[0]) for o in out if o[1] > o[0]]
        return {"tps": toks / span, "stream_tps_median": statistics.median(per),
                "tokens": sum(o[2] for o in out)}
    finally:
        p.terminate()
        p.wait()
        os.unlink(logpath)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "shoal"))
    ap.add_argument("--model", default=os.path.join(ROOT, "models",
                                                    "smollm2-135m-instruct-q4_1.gguf"))
    ap.add_argument("--json-schema", help="a file holding the schema (default: a long array)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ngen", type=int, default=64)
    ap.add_argument("--clients", default="1,32")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    schema = SCHEMA
    if args.json_schema:
        with open(args.json_schema) as f:
            schema = json.load(f)
    ratios = {}
    for c in [int(x) for x in args.clients.split(",")]:
        for rnd in range(args.rounds):
            order = [None, schema] if rnd % 2 == 0 else [schema, None]
            res = {}
            for sc in order:
                mode = "plain" if sc is None else "schema"
                load = os.getloadavg()[0]
                r = run(args, sc, c)
                res[mode] = r
                print(json.dumps({"name": "grammar_serve", "mode": mode, "clients": c,
                                  "round": rnd, "tps": round(r["tps"], 2),
                                  "stream_tps_median": round(r["stream_tps_median"], 2),
                                  "tokens": r["tokens"], "load": round(load, 2)}), flush=True)
            ratio = res["schema"]["tps"] / res["plain"]["tps"]
            ratios.setdefault(c, []).append(ratio)
            print(json.dumps({"name": "grammar_serve_ratio", "clients": c, "round": rnd,
                              "ratio": round(ratio, 3)}), flush=True)
        print(json.dumps({"name": "grammar_serve_ratio_median", "clients": c,
                          "ratio": round(statistics.median(ratios[c]), 3)}), flush=True)


if __name__ == "__main__":
    main()
