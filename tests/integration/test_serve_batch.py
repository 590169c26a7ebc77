"""`shoal serve` under concurrency (stdlib only, threads).

(a) Greedy equivalence: 32 different prompts (temperature 0, max_tokens 32), each run alone, one
    after the other, then all 32 at once: the text, finish_reason and token counts must be
    identical per prompt, so batching never changes a greedy result.
(b) Prefix cache: token-id prompts of 17..48 tokens, each sent twice; the second call reuses the
    first one's cached KV blocks and must give the same greedy text and log-probabilities.
(c) KV exhaustion: a server with --kv-blocks 40 --max-seqs 16 (640 positions) gets 16 concurrent
    requests of ~60 prompt tokens and max_tokens 80 (16 x 140 positions): every one must finish
    with 200, finish_reason "length" and 80 tokens, within a timeout, shoal_preemptions_total
    must be > 0, and every text must equal that prompt's text when run alone.
(d) Priority classes: with one running sequence at a time, a later priority-1 request runs
    before an earlier priority-5 one.
"""

import os
import signal
import sys
import threading
import time

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402

MODEL = su.MODEL_NAME
CONCURRENT_TIMEOUT = 120.0

SUBJECTS = [
    "The history of the Roman Empire", "How photosynthesis works", "A recipe for pancakes",
    "The rules of chess", "Why the sky is blue", "The life of a honeybee",
    "How to learn a new language", "The causes of the French Revolution",
    "A short poem about the ocean", "The benefits of regular exercise",
    "How computers store numbers", "The water cycle", "A letter to a friend about summer",
    "The planets of the solar system", "How to plant a tree", "The invention of the printing press",
    "Tips for a job interview", "The story of a lost cat", "How bread is made",
    "The structure of an atom", "A description of a busy market", "How airplanes fly",
    "The importance of sleep", "A dialogue between two robots", "The migration of birds",
    "How volcanoes form", "A review of a mystery novel", "The basics of saving money",
    "Why leaves change color in autumn", "The first day at a new school",
    "How the internet works", "A journey across the desert",
]
assert len(SUBJECTS) == 32


def complete(url, prompt, max_tokens, timeout=120):
    status, parsed, raw = su.post_json(url, "/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        timeout=timeout)
    assert status == 200, f"status {status}: {raw[:300]!r}"
    ch = parsed["choices"][0]
    return ch["text"], ch["finish_reason"], parsed["usage"]["completion_tokens"], \
        parsed["usage"]["prompt_tokens"]


def run_concurrently(url, prompts, max_tokens):
    """Sends every prompt at once (one thread each, released together). Returns the results
    (or exceptions) in order and the wall time."""
    results = [None] * len(prompts)
    barrier = threading.Barrier(len(prompts))

    def worker(i):
        try:
            barrier.wait(30)
            results[i] = complete(url, prompts[i], max_tokens, timeout=CONCURRENT_TIMEOUT)
        except Exception as exc:  # noqa: BLE001
            results[i] = exc

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(len(prompts))]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(CONCURRENT_TIMEOUT + 30)
    dt = time.monotonic() - t0
    stuck = [i for i, t in enumerate(threads) if t.is_alive()]
    assert not stuck, f"requests {stuck} still running after {dt:.0f} s"
    return results, dt


def first_diff(a, b):
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"differ at char {n}: alone {a[max(0, n-20):n+40]!r} vs batched {b[max(0, n-20):n+40]!r}"


def compare(alone, batched, prompts):
    bad = []
    for i, (a, b) in enumerate(zip(alone, batched)):
        if isinstance(b, Exception):
            bad.append(f"prompt {i}: {type(b).__name__}: {b}")
        elif a[:3] != b[:3]:
            what = first_diff(a[0], b[0]) if a[0] != b[0] else \
                f"finish/tokens alone {a[1:3]} vs batched {b[1:3]}"
            bad.append(f"prompt {i} ({prompts[i][:30]!r}): {what}")
    assert not bad, f"{len(bad)} of {len(prompts)} differ:\n  " + "\n  ".join(bad)


def greedy_equivalence(r):
    prompts = [f"{s}." for s in SUBJECTS]
    with su.server(runner=r) as srv:
        alone = []

        def sequential():
            t0 = time.monotonic()
            for p in prompts:
                alone.append(complete(srv.url, p, 32))
            su.log(f"     32 sequential requests in {time.monotonic() - t0:.1f} s")

        def concurrent():
            assert len(alone) == 32, "the sequential pass did not finish"
            batched, dt = run_concurrently(srv.url, prompts, 32)
            su.log(f"     32 concurrent requests in {dt:.1f} s")
            compare(alone, batched, prompts)
            text = su.metrics(srv.url)
            n = su.metric(text, "shoal_batch_size_count")
            total = su.metric(text, "shoal_batch_size_sum")
            if n and total:
                su.log(f"     mean batch size over all steps {total / n:.2f}")
                assert total / n > 1.0, "no step ever batched more than one sequence"

        r.case("32 prompts alone (sequential)", sequential)
        r.case("32 prompts concurrently == alone (greedy)", concurrent)
        r.case("idle afterwards", su.wait_idle, srv.url)


# Token ids of an English paragraph in the test model's vocabulary (shoal tokenize): token-id
# prompts give exact lengths.
PARAGRAPH_IDS = [
    504, 1463, 282, 260, 4469, 7057, 22389, 540, 670, 253, 7557, 929, 28, 3616, 351, 260, 14465,
    282, 260, 2240, 284, 10808, 351, 260, 2332, 282, 25951, 30, 3897, 451, 655, 28, 260, 11022,
    6679, 429, 253, 1165, 3102, 335, 260, 41558, 618, 253, 4749, 1215, 338, 5918, 260, 2415,
    10834, 14573, 28, 351, 253, 1784, 817, 282, 1693, 28, 1525, 28, 8364, 284, 3735, 30]


def prefix_cache_equivalence(r):
    """Each prompt (17..48 tokens, so 1-2 full 16-token blocks get cached; a distinct first token
    so no two share a block) is sent twice: the second call adopts the first one's cached blocks
    and must give the same greedy text and the same log-probabilities."""
    with su.server(runner=r) as srv:
        def one(prompt):
            status, parsed, raw = su.post_json(srv.url, "/v1/completions", {
                "model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                "logprobs": 1})
            assert status == 200, f"status {status}: {raw[:300]!r}"
            ch = parsed["choices"][0]
            return ch["text"], ch["logprobs"]["token_logprobs"]

        def check():
            bad = []
            for n in range(17, 49):
                prompt = [1000 + n] + PARAGRAPH_IDS[:n - 1]
                (t0, lp0), (t1, lp1) = one(prompt), one(prompt)
                d = max((abs(a - b) for a, b in zip(lp0, lp1)), default=0.0)
                if t0 != t1 or d > 1e-4:
                    bad.append(f"{n} tokens: max logprob diff {d:.4f}" +
                               (f", text {t0!r} -> {t1!r}" if t0 != t1 else ""))
            hits = su.metric(su.metrics(srv.url), "shoal_prefix_cache_hit_tokens_total")
            assert not bad, f"{len(bad)} of 32 prompts changed on a prefix-cache hit " \
                f"(shoal_prefix_cache_hit_tokens_total {hits}):\n  " + "\n  ".join(bad)

        r.case("prefix-cache hit == uncached (greedy text and logprobs)", check)


def kv_prompts():
    out = []
    for i in range(16):
        s = 10 + i * 5
        out.append(f"Sequence {chr(65 + i)}: " + ", ".join(str(s + j) for j in range(14)) + ",")
    return out


def kv_exhaustion(r):
    prompts = kv_prompts()
    max_tokens = 80
    with su.server("--kv-blocks", 40, "--max-seqs", 16, runner=r,
                   stop_signal=signal.SIGINT) as srv:
        alone = []

        def sequential():
            for p in prompts:
                alone.append(complete(srv.url, p, max_tokens))
            ptoks = sorted(a[3] for a in alone)
            su.log(f"     prompt tokens {ptoks[0]}..{ptoks[-1]}")
            bad = [(i, a[1], a[2]) for i, a in enumerate(alone)
                   if a[1] != "length" or a[2] != max_tokens]
            assert not bad, f"alone, not full length (index, finish, tokens): {bad}"

        def concurrent():
            assert len(alone) == 16, "the sequential pass did not finish"
            before = su.metric(su.metrics(srv.url), "shoal_preemptions_total") or 0
            batched, dt = run_concurrently(srv.url, prompts, max_tokens)
            su.log(f"     16 concurrent requests in {dt:.1f} s")
            errors = [f"#{i}: {b}" for i, b in enumerate(batched) if isinstance(b, Exception)]
            assert not errors, f"{len(errors)} requests failed: " + "; ".join(errors[:5])
            short = [(i, b[1], b[2]) for i, b in enumerate(batched)
                     if b[1] != "length" or b[2] != max_tokens]
            assert not short, f"not full length (index, finish, tokens): {short}"
            text = su.metrics(srv.url)
            pre = (su.metric(text, "shoal_preemptions_total") or 0) - before
            su.log(f"     preemptions {pre:.0f}, kv usage now "
                   f"{su.metric(text, 'shoal_kv_usage_ratio')}")
            compare(alone, batched, prompts)
            assert pre > 0, "shoal_preemptions_total did not rise with 16 x 140 positions in 640"

        r.case("KV: 16 prompts alone are full length", sequential)
        r.case("KV: 16 concurrent over 40 blocks complete, preempt, == alone", concurrent)
        r.case("KV: idle afterwards", su.wait_idle, srv.url)


def priority_classes(r):
    """With one sequence at a time (--max-seqs 1), a long request runs while a priority-5 and then
    a priority-1 request wait: the priority-1 request, although it arrived later, runs first
    (the queue is ordered by class, then arrival)."""
    with su.server("--max-seqs", "1", runner=r) as srv:
        def check():
            done = {}
            lock = threading.Lock()

            def one(name, prio, max_tokens):
                status, parsed, raw = su.post_json(srv.url, "/v1/completions", {
                    "model": MODEL, "prompt": f"Request {name}: once upon a time",
                    "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "priority": prio}, timeout=CONCURRENT_TIMEOUT)
                assert status == 200, f"{name}: status {status}: {raw[:200]!r}"
                with lock:
                    done[name] = time.monotonic()

            first = threading.Thread(target=one, args=("long", 9, 400))
            first.start()
            time.sleep(0.3)  # the long request is running
            low = threading.Thread(target=one, args=("low", 5, 20))
            low.start()
            time.sleep(0.2)  # queued behind it
            high = threading.Thread(target=one, args=("high", 1, 20))
            high.start()
            for t in (first, low, high):
                t.join()
            order = sorted(done, key=done.get)
            assert order == ["long", "high", "low"], f"completion order {order}"

        r.case("priority: a later, higher-priority request runs before an earlier one", check)


def main():
    r = su.Runner("serve_batch")
    for part in (greedy_equivalence, prefix_cache_equivalence, kv_exhaustion, priority_classes):
        try:
            part(r)
        except AssertionError as e:
            r.fail(part.__name__, str(e))
    r.finish()


if __name__ == "__main__":
    main()
