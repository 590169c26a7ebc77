"""`shoal serve` on mixture-of-experts models, against real processes (stdlib only).

The tiny seeded mkmodel files of tests/data/golden (mixtral-tiny: llama with 4 experts, 2 per
token; qwen3moe-tiny and olmoe-tiny: 8 experts, 2 per token) are served

- by one process: 8 greedy completions sent all at once (batched steps, prefills beside decodes)
  equal each one sent alone (text, finish reason, token count, tokens); the stage's
  shoal_moe_expert_tokens_total has one series per (layer, expert), and each layer's experts
  were sent exactly k tokens per row computed (k x shoal_step_tokens_sum);
- by a 2-stage pipeline over ipc:// (two `shoal node` workers holding layer 0 and layer 1, a
  `shoal serve -c` front): the same completions equal the single process's, and the front's
  /metrics carries each worker's own layer's expert counters (node="w0" layer 0, node="w1"
  layer 1), k per row computed.
"""

import os
import shutil
import sys
import tempfile
import threading
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402
from test_cluster_pipeline import Node, script  # noqa: E402

GOLDEN = os.path.join(su.ROOT, "tests", "data", "golden")
MODELS = [("mixtral-tiny", os.path.join(GOLDEN, "mixtral-tiny-f16.gguf"), 2, 4),
          ("qwen3moe-tiny", os.path.join(GOLDEN, "qwen3moe-tiny-f16.gguf"), 2, 8),
          ("olmoe-tiny", os.path.join(GOLDEN, "olmoe-tiny-f16.gguf"), 2, 8)]
PROMPTS = [list(range(1, 21)), [100], [7, 8, 9, 250, 3], list(range(40, 80)), [299, 1, 299],
           [5] * 12, [17, 33, 250, 9, 140, 66, 5, 99], list(range(200, 230))]
TOKENS = 24
LAYERS = 2


def complete(url, prompt):
    status, parsed, raw = su.post_json(url, "/v1/completions", {
        "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
        "logprobs": 1}, timeout=300)
    assert status == 200, f"status {status}: {raw[:300]!r}"
    ch = parsed["choices"][0]
    return (ch["text"], ch["finish_reason"], parsed["usage"]["completion_tokens"],
            (ch.get("logprobs") or {}).get("tokens"))


def all_at_once(url):
    out = [None] * len(PROMPTS)

    def one(i):
        try:
            out[i] = complete(url, PROMPTS[i])
        except Exception as exc:  # noqa: BLE001 - reported below
            out[i] = exc
    ts = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(PROMPTS))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(300)
    bad = [f"prompt {i}: {r!r}" for i, r in enumerate(out) if r is None or isinstance(r, Exception)]
    assert not bad, "\n".join(bad)
    return out


def expert_sums(text, n_expert, **labels):
    """Per layer: the sum of shoal_moe_expert_tokens_total over the experts, checking that
    every (layer, expert) series is there."""
    sums = []
    for layer in range(LAYERS):
        vals = [su.metric(text, "shoal_moe_expert_tokens_total", layer=str(layer), expert=str(x),
                          **labels) for x in range(n_expert)]
        sums.append(None if any(v is None for v in vals) else sum(vals))
    return sums


def single(name, model, k, n_expert, want):
    with su.server("-m", model, "-t", "1", "--kv-mem", "32M", "--max-seqs", "16",
                   "--step-tokens", "512", model=None) as srv:
        alone = [complete(srv.url, p) for p in PROMPTS]
        together = all_at_once(srv.url)
        bad = [f"prompt {i}: alone {a} vs batched {b}"
               for i, (a, b) in enumerate(zip(alone, together)) if a != b]
        assert not bad, "\n".join(bad)
        assert all(r[2] == TOKENS for r in alone), [r[2] for r in alone]
        text = su.wait_idle(srv.url)
        rows = su.metric(text, "shoal_step_tokens_sum")
        sums = expert_sums(text, n_expert)
        assert rows and rows > 0, f"shoal_step_tokens_sum {rows}"
        assert sums == [k * rows] * LAYERS, f"{name}: experts' tokens per layer {sums}, " \
            f"want {k} x {rows} rows"
        su.log(f"note: {name}: {int(rows)} rows computed, each layer's experts got "
               f"{[int(s) for s in sums]} tokens")
        want[name] = alone


def pipeline(d, name, model, k, n_expert, want):
    path = script(os.path.join(d, f"{name}.lua"), model, ["w0", "w1"])
    nodes = [Node(path, w) for w in ("w0", "w1")]
    problems = []
    try:
        for nd in nodes:
            nd.wait_ready()
        srv = su.start("-c", path, "--join-timeout", "60", model=None)
        try:
            got = all_at_once(srv.url)
            bad = [f"prompt {i}: single {a} vs pipeline {b}"
                   for i, (a, b) in enumerate(zip(want[name], got)) if a != b]
            assert not bad, "\n".join(bad)
            # Workers report every second: wait until both layers' counters cover every row
            # the front's batcher computed (a retried step may count twice, never less).
            deadline = time.monotonic() + 15
            while True:
                text = su.wait_idle(srv.url)
                rows = su.metric(text, "shoal_step_tokens_sum", node="1") or \
                    su.metric(text, "shoal_step_tokens_sum")
                w0 = expert_sums(text, n_expert, node="w0")
                w1 = expert_sums(text, n_expert, node="w1")
                ok = rows and w0[0] is not None and w1[1] is not None and \
                    w0[0] >= k * rows and w1[1] >= k * rows
                if ok or time.monotonic() > deadline:
                    break
                time.sleep(0.3)
            assert ok, f"{name}: rows {rows}, w0 layers {w0}, w1 layers {w1}"
            assert w0[1] is None and w1[0] is None, f"a worker counts another's layer: {w0} {w1}"
            assert w0[0] % k == 0 and w1[1] % k == 0, (w0, w1)
            su.log(f"note: {name} pipeline: {int(rows)} rows, layer 0 on w0 {int(w0[0])}, "
                   f"layer 1 on w1 {int(w1[1])} expert tokens")
        finally:
            problems += su.stop(srv)
    finally:
        for nd in nodes:
            problems += nd.stop()
    assert not problems, "\n".join(problems)


def main():
    for _, path, _, _ in MODELS:
        if not os.path.exists(path):
            su.skip(f"{path} missing")
    r = su.Runner("test_serve_moe")
    d = tempfile.mkdtemp(prefix="shmoe-", dir="/tmp")  # ipc:// paths stay short
    want = {}
    try:
        for name, path, k, ne in MODELS:
            r.case(f"{name}: batched completions equal each alone; experts' tokens k per row",
                   single, name, path, k, ne, want)
        for name, path, k, ne in MODELS:
            if name in want:
                r.case(f"{name}: 2 stages over ipc:// equal one process; each counts its layer",
                       pipeline, d, name, path, k, ne, want)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    r.finish()


if __name__ == "__main__":
    main()
