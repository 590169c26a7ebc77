#!/usr/bin/env python3
"""Issue 26's agreement figures for a tensor-parallel group's link compression (docs/cluster.md,
"Tensor parallelism"): greedy completions through one stage of 2 ranks linked over the network
collective (`tp_link = "net"`, ipc://) with each `tp_compress`, against one process (`shoal serve
-m`, the same F16 KV cache), with real `shoal node` processes and a `shoal serve -c` front.

Per model and compression, one JSON line: prompts equal throughout, the largest logprob
difference before a split, each split's token index and the single process's top-2 gap there
(its best logprob less the group's token's, from its 5 best), and the leader's collective bytes
passed in and sent on the links (shoal_tp_collective_bytes_total and _wire_bytes_total: the
all-reduces are compressed, the gathers are not).

Usage: bench/tp_compress_agreement.py [--models stories,smollm2] [--cmp none,f16,int8]
       [--prompts 16] [--tokens 64] (the binary: build/shoal, or SH_SHOAL)
"""
import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
import serve_util as su  # noqa: E402
from test_cluster_pipeline import PROMPTS  # noqa: E402
from test_cluster_tp import SMOLLM2, STORIES, Cluster, at_once, complete_top, group_script  # noqa

MODELS = {"stories": STORIES, "smollm2": SMOLLM2}


def reference(model, prompts, n):
    with su.server("-m", model, "-t", "1", "--kv-mem", "32M", "--max-seqs", "16",
                   "--step-tokens", "512", model=None) as srv:
        return at_once(srv.url, prompts, n, complete_top)


def compare(want, got):
    equal, splits, worst = 0, [], 0.0
    for a, b in zip(want, got):
        k = next((j for j, (x, y) in enumerate(zip(a[3], b[3])) if x != y), None)
        for j in range(k if k is not None else len(a[3])):
            worst = max(worst, abs(a[4][j] - b[4][j]))
        if k is None:
            equal += 1
            continue
        top = a[5][k]
        gap = max(top.values()) - top[b[3][k]] if b[3][k] in top else None
        splits.append((k, None if gap is None else round(gap, 4)))
    return equal, worst, splits


def leader_bytes(url, want_calls_equal=True):
    deadline = time.monotonic() + 15
    while True:
        text = su.metrics(url)
        calls = [su.metric(text, "shoal_tp_collectives_total", node=w, layer="0", rank=str(r))
                 for r, w in enumerate(["w0", "w1"])]
        if (calls[0] and calls[0] == calls[1]) or time.monotonic() > deadline:
            return (su.metric(text, "shoal_tp_collective_bytes_total", node="w0", layer="0",
                              rank="0"),
                    su.metric(text, "shoal_tp_collective_wire_bytes_total", node="w0", layer="0",
                              rank="0"))
        time.sleep(1.0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="stories,smollm2")
    ap.add_argument("--cmp", default="none,f16,int8")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    prompts = PROMPTS[:a.prompts]
    d = tempfile.mkdtemp(prefix="shtpc-", dir="/tmp")  # ipc:// paths stay short
    for name in a.models.split(","):
        model = MODELS[name]
        want = reference(model, prompts, a.tokens)
        for cmp in a.cmp.split(","):
            stages = ("pipeline(m, { { 'w0', 'w1' } }), tp_link = 'net', "
                      f"tp_compress = '{cmp}'")
            path = group_script(os.path.join(d, f"{name}-{cmp}.lua"), model, stages, ["w0", "w1"])
            c = Cluster(path, ["w0", "w1"])
            try:
                c.start()
                got = at_once(c.srv.url, prompts, a.tokens, complete_top)
                passed, wire = leader_bytes(c.srv.url)
            finally:
                c.stop()
            equal, worst, splits = compare(want, got)
            print(json.dumps({"model": name, "tp_compress": cmp, "prompts": len(prompts),
                              "tokens": a.tokens, "equal": equal, "max_lp_diff": worst,
                              "splits": splits, "leader_bytes": passed, "leader_wire": wire,
                              "wire_over_bytes": round(wire / passed, 3) if passed else None}),
                  flush=True)


if __name__ == "__main__":
    main()
