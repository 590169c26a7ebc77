"""`shoal serve` on a sliding-window model (stdlib only).

A synthetic model written by `shoal mkmodel --sliding-window 32` (2 layers, random weights and
vocabulary) is served with a small KV pool. Long generations must complete although the pool could
not hold them without the window: the KV manager releases every block wholly before a sequence's
window, so shoal_kv_blocks_used stays bounded while the tokens grow. n=2 over a long prompt forks
the prompt's blocks (or falls back to computing them when the window already released them), and
greedy choices agree with each other and with a second identical request.
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

WINDOW = 32
GEN = 400


def make_model(path):
    import subprocess
    argv = [su.shoal_binary(), "mkmodel", "--shape", "custom", "--layers", "2", "--dim", "64",
            "--ffn", "128", "--heads", "4", "--kv-heads", "2", "--vocab", "300", "--ctx", "2048",
            "--sliding-window", str(WINDOW), "--type", "F32", "--seed", "3", "-o", path]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"mkmodel failed: {r.stderr}"


def main():
    r = su.Runner("serve_window")
    tmp = tempfile.mkdtemp(prefix="shoal-window-")
    model = os.path.join(tmp, "window.gguf")
    make_model(model)
    # 24 blocks = 384 positions in the whole pool: one 400-token generation alone would not fit
    # without the window.
    with su.server("-m", model, "--kv-blocks", "24", "--max-seqs", "4", runner=r) as srv:
        name = "window"

        def long_generation():
            peak = [0]
            done = threading.Event()

            def watch():
                while not done.is_set():
                    try:
                        v = su.metric(su.metrics(srv.url), "shoal_kv_blocks_used")
                        peak[0] = max(peak[0], int(v or 0))
                    except Exception:  # noqa: BLE001 - a sample may miss; the next one counts
                        pass
                    time.sleep(0.02)
            t = threading.Thread(target=watch)
            t.start()
            try:
                status, parsed, raw = su.post_json(srv.url, "/v1/completions", {
                    "model": name, "prompt": list(range(3, 103)), "max_tokens": GEN,
                    "temperature": 0, "ignore_eos": True}, timeout=300)
            finally:
                done.set()
                t.join()
            assert status == 200, f"status {status}: {raw[:300]!r}"
            u = parsed["usage"]
            assert u["completion_tokens"] == GEN and u["prompt_tokens"] == 100, u
            assert parsed["choices"][0]["finish_reason"] == "length"
            # 500 positions would need 32 blocks (more than the 24 of the pool). The 100-token
            # prompt is prefilled in one step and holds its 7 blocks until the window releases
            # them, plus the block the first generated token opens: at most 8 at any moment; once
            # past the prompt the window keeps 3-4. (The bound was 6, which the metrics poller
            # broke whenever it sampled during the prefill step on a loaded machine.)
            assert peak[0] <= 8, f"shoal_kv_blocks_used peaked at {peak[0]}"

        r.case(f"a {GEN}-token generation past a {WINDOW}-token window in a 384-position pool",
               long_generation)

        def n2_and_repeat():
            body = {"model": name, "prompt": list(range(5, 95)), "max_tokens": 60,
                    "temperature": 0, "n": 2, "ignore_eos": True}
            s1, p1, raw1 = su.post_json(srv.url, "/v1/completions", body, timeout=300)
            s2, p2, raw2 = su.post_json(srv.url, "/v1/completions", body, timeout=300)
            assert s1 == 200 and s2 == 200, f"{s1} {raw1[:200]!r} / {s2} {raw2[:200]!r}"
            t = [c["text"] for c in p1["choices"]] + [c["text"] for c in p2["choices"]]
            assert len(set(t)) == 1, f"greedy choices differ: {t!r}"
            assert p1["usage"]["completion_tokens"] == 120

        r.case("n=2 over a prompt longer than the window; greedy choices and repeats agree",
               n2_and_repeat)

        def concurrent():
            errs = []

            def one(i):
                st, p, raw = su.post_json(srv.url, "/v1/completions", {
                    "model": name, "prompt": [7 + i] * 40, "max_tokens": 150, "temperature": 0,
                    "ignore_eos": True}, timeout=300)
                if st != 200 or p["usage"]["completion_tokens"] != 150:
                    errs.append(f"{i}: {st} {raw[:200]!r}")
            th = [threading.Thread(target=one, args=(i,)) for i in range(4)]
            [x.start() for x in th]
            [x.join() for x in th]
            assert not errs, "; ".join(errs)

        r.case("4 concurrent 190-position sequences share a 384-position pool", concurrent)
    shutil.rmtree(tmp, ignore_errors=True)
    r.finish()


if __name__ == "__main__":
    main()
