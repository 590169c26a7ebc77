"""`shoal serve --spec ngram`: speculative decoding in the batcher (stdlib only, threads).

(a) Greedy exactness: 12 requests (edit-style prompts that restate text of the prompt, so that
    n-gram drafts are accepted, code, a count, free text; one with a stop string and one with a
    small max_tokens, which end inside runs of accepted drafts) give, alone and then all at once
    with 20 short ones more (16 tokens each: 32 concurrent requests, drafts accepted among
    them), the same text, finish_reason and token counts as the same server with --spec off; an
    edit prompt with "logprobs": 0 also gives the same per-token logprobs (those of accepted drafts included).
    Seeded sampling (temperature 0.8, top_p 0.95) gives --spec off's text too: the stage draws
    one number per token from the sequence's generator, drafted or not, so the same seed draws
    the same tokens (this relies on a row's logits not depending on the rows beside it, as (a)).
(b) /metrics: after the edit prompts shoal_spec_drafts_total, shoal_spec_draft_tokens_total,
    shoal_spec_accepted_tokens_total and shoal_spec_accepted_position_total{pos="1"} are > 0, and
    no more are accepted than drafted.
(c) Opt-out: a request with "speculative": false, and one asking for top logprobs, leave
    shoal_spec_draft_tokens_total unchanged and still equal --spec off; "speculative" that is
    not a boolean is a 400 naming the field. Per-request draft length: on a server whose steps
    so far carried several drafts (some accepted at position 2), an edit prompt sent alone with
    "speculative": {"n_max": 1} and with the flat "speculative.n_max": 1 gives the same output
    with exactly one draft per drafting step (drafted tokens == drafting steps, nothing accepted
    at position 2); {"n_max": 0} drafts nothing; an n_max out of range or of the wrong type, an
    unknown key in the object, n_max given twice or with "speculative": false are 400s naming
    the field.
(d) Preemption: with --kv-blocks 40 --max-seqs 16, 16 concurrent requests (6 of them edit-style)
    preempt one another and still equal --spec off's outputs.
(e) Bad flags (--spec draft:PATH of a missing file, self:30 (the model has 30 layers), an
    unknown kind, --spec-k 0, 17, abc, --spec-k without --spec ngram) exit 2 with a message.
(g) Prefix cache: a drafting request's computed blocks, output included, enter the prefix cache
    (shoal_kv_blocks_cached grows by its whole blocks; rejected drafts' positions are given back
    before they could be hashed), and the same prompt again gives the same output.
(h) A 2-stage pipeline (`shoal node` workers, ipc://) whose script says batcher.spec = "ngram":
    the 12 requests at once equal --spec off's and drafts are accepted (the drafts travel
    through both stages; the workers' contexts have rows of logits for them).
(f) A one-node cluster script's batcher = { spec = "ngram", spec_k = 4 } turns it on for
    `shoal serve -c` (the startup line says so, drafts are accepted, output equals --spec off);
    --spec off on the command line wins over it.

(i) stories260K (F32 weights, 512-token vocabulary): 32 prompts (short story openings, some
    made of random words as `shoal chaos` sends, one of them a near tie that a batch-dependent
    F32 tile once flipped) alone with --spec off, then with --spec ngram, self:2 and
    draft:stories260K.gguf, alone and all 32 at once: equal, and drafts accepted.

(a), (b) and (d) need a stage that verifies drafts (actors/stage.c): one that ignores them
samples the row after the drafts and (a) fails.
"""

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402
import test_cluster_pipeline as tcp  # noqa: E402  (its Node: a `shoal node` worker)

MODEL = su.MODEL_NAME
TIMEOUT = 120.0

FOX = "The quick brown fox jumps over the lazy dog."
EDIT = [
    f"Repeat the following text exactly: {FOX} {FOX}\n\nText:",
    "Copy this list: apples, oranges, bananas, grapes, pears, plums, cherries, lemons.\nCopy:",
    "Rewrite the sentence in the same words: Once upon a time there was a little girl who "
    "lived in a village near the forest.\nRewritten:",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "Count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "The cat sat on the mat. The cat sat on the mat. The cat sat on the mat. The cat",
]
FREE = ["The history of the Roman Empire.", "How photosynthesis works.",
        "A recipe for pancakes.", "Why the sky is blue."]
# (prompt, max_tokens, extra fields)
REQS = [(p, 48, {}) for p in EDIT] + [(p, 32, {}) for p in FREE] + [
    (EDIT[5], 48, {"stop": ["mat. The"]}),  # a stop string inside a run of accepted drafts
    (EDIT[0], 5, {}),                       # max_tokens inside one
]
assert len(REQS) == 12
# 20 short ones more (16 tokens each: edit-style prompts, numbered so that they differ, and free
# text), to run 32 at once with REQS.
MORE = [(f"Request {i}: {EDIT[i % len(EDIT)]}", 16, {}) for i in range(10)] + \
    [(f"Part {i}. {FREE[i % len(FREE)]}", 16, {}) for i in range(10)]
REQS32 = REQS + MORE
assert len(REQS32) == 32


def complete(url, prompt, max_tokens, extra=None, timeout=TIMEOUT):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    body.update(extra or {})
    status, parsed, raw = su.post_json(url, "/v1/completions", body, timeout=timeout)
    assert status == 200, f"status {status}: {raw[:300]!r}"
    ch = parsed["choices"][0]
    lp = (ch.get("logprobs") or {}).get("token_logprobs")
    return ch["text"], ch["finish_reason"], parsed["usage"]["completion_tokens"], lp


def run_all(url, reqs):
    return [complete(url, p, n, x)[:3] for p, n, x in reqs]


def run_concurrently(url, reqs):
    results = [None] * len(reqs)
    barrier = threading.Barrier(len(reqs))

    def worker(i):
        try:
            barrier.wait(30)
            p, n, x = reqs[i]
            results[i] = complete(url, p, n, x)[:3]
        except Exception as exc:  # noqa: BLE001
            results[i] = exc

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT + 30)
    stuck = [i for i, t in enumerate(threads) if t.is_alive()]
    assert not stuck, f"requests {stuck} still running"
    return results


def compare(ref, got, reqs, what):
    bad = []
    for i, (a, b) in enumerate(zip(ref, got)):
        if isinstance(b, Exception):
            bad.append(f"#{i}: {type(b).__name__}: {b}")
        elif a != b:
            bad.append(f"#{i} ({reqs[i][0][:30]!r}): --spec off {a!r}\n      {what} {b!r}")
    assert not bad, f"{len(bad)} of {len(reqs)} differ from --spec off:\n  " + "\n  ".join(bad)


def spec_counts(url):
    text = su.metrics(url)
    return {k: su.metric(text, f"shoal_spec_{k}_total") or 0
            for k in ("drafts", "draft_tokens", "accepted_tokens")}, \
        su.metric(text, "shoal_spec_accepted_position_total", pos="1") or 0


def clean_answers(srv):
    """The batcher logs step_answer_bad when an answer does not fit the drafts it sent."""
    bad = [ln for ln in srv.log_text().splitlines() if "step_answer_bad" in ln]
    assert not bad, f"{len(bad)} answers did not fit their drafts:\n  " + "\n  ".join(bad[:5])


def kv_reqs():
    out = []
    for i in range(10):
        s = 10 + i * 5
        out.append((f"Sequence {chr(65 + i)}: " + ", ".join(str(s + j) for j in range(14)) + ",",
                    80, {}))
    for i, p in enumerate(EDIT):
        out.append((f"Request {i}. {p}", 80, {"ignore_eos": True}))
    return out


LP_REQ = (EDIT[0], 40, {"logprobs": 0})
SAMP_REQS = [(p, 40, {"temperature": 0.8, "top_p": 0.95, "seed": seed})
             for p in (EDIT[0], EDIT[4], EDIT[5]) for seed in (1, 2)]


def reference(r, ref):
    with su.server("--spec", "off", runner=r) as srv:
        def run():
            ref["a"] = run_all(srv.url, REQS)
            ref["more"] = run_all(srv.url, MORE)
            ref["kv"] = run_all(srv.url, kv_reqs())
            ref["lp"] = complete(srv.url, *LP_REQ)
            ref["samp"] = run_all(srv.url, SAMP_REQS)
            spec, _ = spec_counts(srv.url)
            assert spec["drafts"] == 0, f"--spec off drafted: {spec}"

        r.case("--spec off: reference outputs", run)


def spec_server(r, ref):
    with su.server("--spec", "ngram", runner=r) as srv:
        def alone():
            compare(ref["a"], run_all(srv.url, REQS), REQS, "--spec ngram alone")

        def metrics():
            spec, pos1 = spec_counts(srv.url)
            su.log(f"     after the requests alone: {spec}, accepted at position 1: {pos1:.0f}")
            assert spec["drafts"] > 0 and spec["draft_tokens"] > 0, f"no drafts: {spec}"
            assert spec["accepted_tokens"] > 0 and pos1 > 0, f"no draft accepted: {spec}"
            assert spec["accepted_tokens"] <= spec["draft_tokens"], f"accepted > drafted: {spec}"
            clean_answers(srv)

        def at_once():
            before, _ = spec_counts(srv.url)
            compare(ref["a"] + ref["more"], run_concurrently(srv.url, REQS32), REQS32,
                    "--spec ngram, 32 at once")
            after, _ = spec_counts(srv.url)
            su.log(f"     32 at once: {before} -> {after}")
            assert after["accepted_tokens"] > before["accepted_tokens"], \
                f"no draft accepted with 32 at once: {before} -> {after}"
            clean_answers(srv)

        def logprobs():
            text, fin, n, lp = complete(srv.url, *LP_REQ)
            rt, rf, rn, rlp = ref["lp"]
            assert (text, fin, n) == (rt, rf, rn), f"{(text, fin, n)!r} vs {(rt, rf, rn)!r}"
            d = max(abs(a - b) for a, b in zip(lp, rlp))
            assert len(lp) == len(rlp) and d < 1e-3, f"logprobs differ by {d:.5f}"

        def sampled():
            compare(ref["samp"], run_all(srv.url, SAMP_REQS), SAMP_REQS, "--spec ngram seeded")

        def opt_out():
            before, _ = spec_counts(srv.url)
            got = complete(srv.url, REQS[0][0], REQS[0][1], {"speculative": False})[:3]
            assert got == ref["a"][0], f"speculative false: {got!r} vs {ref['a'][0]!r}"
            got = complete(srv.url, REQS[0][0], REQS[0][1], {"logprobs": 2})[:3]
            assert got == ref["a"][0], f"top logprobs: {got!r} vs {ref['a'][0]!r}"
            after, _ = spec_counts(srv.url)
            assert after["draft_tokens"] == before["draft_tokens"], \
                f"drafted for an opted-out request: {before} -> {after}"
            got = complete(srv.url, REQS[0][0], REQS[0][1], {"speculative": True})[:3]
            assert got == ref["a"][0], f"speculative true: {got!r}"
            again, _ = spec_counts(srv.url)
            assert again["draft_tokens"] > after["draft_tokens"], \
                f"no drafts with speculative true: {after} -> {again}"
            status, parsed, raw = su.post_json(srv.url, "/v1/completions", {
                "model": MODEL, "prompt": "Hi", "max_tokens": 2, "speculative": "no"})
            err = su.check_error(status, parsed, raw, 400, what="speculative \"no\"")
            assert err["param"] == "speculative", f"param {err['param']!r}"

        def n_max():
            # This server drafts several tokens a step on these prompts (its counters so far,
            # after (a) and (b): how many a step takes depends on the measured step cost, so one
            # request alone may not); with n_max 1, alone on the server, every drafting step
            # carries exactly one draft and nothing is accepted at position 2, and the output is
            # the same.
            text = su.metrics(srv.url)
            so_far, _ = spec_counts(srv.url)
            pos2 = su.metric(text, "shoal_spec_accepted_position_total", pos="2") or 0
            assert so_far["draft_tokens"] > so_far["drafts"] and pos2 > 0, \
                f"no step of several drafts so far: {so_far}, accepted at position 2: {pos2}"

            def delta(extra):
                t0 = su.metrics(srv.url)
                got = complete(srv.url, REQS[0][0], REQS[0][1], extra)[:3]
                t1 = su.metrics(srv.url)
                d = {k: (su.metric(t1, f"shoal_spec_{k}_total") or 0) -
                     (su.metric(t0, f"shoal_spec_{k}_total") or 0)
                     for k in ("drafts", "draft_tokens", "accepted_tokens")}
                d["pos2"] = (su.metric(t1, "shoal_spec_accepted_position_total", pos="2") or 0) - \
                    (su.metric(t0, "shoal_spec_accepted_position_total", pos="2") or 0)
                assert got == ref["a"][0], f"{extra}: {got!r} vs {ref['a'][0]!r}"
                return d
            free = delta({})
            for extra in ({"speculative": {"n_max": 1}}, {"speculative.n_max": 1}):
                d = delta(extra)
                su.log(f"     so far {so_far}; this prompt uncapped {free}, {extra}: {d}")
                assert d["drafts"] > 0 and d["draft_tokens"] == d["drafts"] and d["pos2"] == 0, \
                    f"{extra}: {d}"
            d = delta({"speculative": {"n_max": 0}})
            assert d["drafts"] == 0, f"n_max 0 drafted: {d}"
            bad = [({"speculative": {"n_max": 17}}, "speculative.n_max"),
                   ({"speculative": {"n_max": "1"}}, "speculative.n_max"),
                   ({"speculative": {"n_max": 1, "p_min": 0.5}}, "speculative"),
                   ({"speculative": [1]}, "speculative"),
                   ({"speculative.n_max": -1}, "speculative.n_max"),
                   ({"speculative.n_max": 2, "speculative": {"n_max": 2}}, "speculative.n_max"),
                   ({"speculative.n_max": 2, "speculative": False}, "speculative.n_max")]
            for extra, param in bad:
                body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
                body.update(extra)
                status, parsed, raw = su.post_json(srv.url, "/v1/completions", body)
                err = su.check_error(status, parsed, raw, 400, what=str(extra))
                assert err["param"] == param, f"{extra}: param {err['param']!r}, want {param!r}"

        r.case("(a) 12 requests alone == --spec off", alone)
        r.case("(b) /metrics: drafts and accepted tokens > 0", metrics)
        r.case("(a) 32 requests at once (the 12 and 20 short ones) == --spec off", at_once)
        r.case("(a) logprobs of an edit prompt == --spec off", logprobs)
        def cached_output():
            prompt = f"Request 77, a fresh one. {EDIT[0]}"
            before = su.metric(su.metrics(srv.url), "shoal_kv_blocks_cached") or 0
            d0, _ = spec_counts(srv.url)
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 64, "temperature": 0,
                    "ignore_eos": True}
            status, parsed, raw = su.post_json(srv.url, "/v1/completions", body)
            assert status == 200, f"status {status}: {raw[:200]!r}"
            u = parsed["usage"]
            d1, _ = spec_counts(srv.url)
            assert d1["accepted_tokens"] > d0["accepted_tokens"], f"no draft accepted: {d1}"
            after = su.metric(su.metrics(srv.url), "shoal_kv_blocks_cached") or 0
            # Computed at the end: every position but the last token's.
            blocks = (u["prompt_tokens"] + u["completion_tokens"] - 1) // 16
            su.log(f"     {u}: {after - before:.0f} blocks cached, {blocks} whole blocks computed")
            assert after - before >= blocks, \
                f"only {after - before:.0f} of {blocks} blocks cached after a drafting request"
            status, again, raw = su.post_json(srv.url, "/v1/completions", body)
            assert status == 200 and again["choices"][0]["text"] == parsed["choices"][0]["text"], \
                "a prefix-cache hit changed the output"

        r.case("(a) 6 seeded sampled requests == --spec off", sampled)
        r.case("(c) opt-out and top logprobs: no drafts, same output; bad value 400", opt_out)
        r.case("(c) n_max 1: one draft a drafting step, same output; bad n_max 400", n_max)
        r.case("(g) a drafting request's output blocks enter the prefix cache", cached_output)
        r.case("idle afterwards", su.wait_idle, srv.url)


def preemption(r, ref):
    reqs = kv_reqs()
    with su.server("--spec", "ngram", "--kv-blocks", 40, "--max-seqs", 16, runner=r,
                   stop_signal=signal.SIGINT) as srv:
        def check():
            before = su.metric(su.metrics(srv.url), "shoal_preemptions_total") or 0
            got = run_concurrently(srv.url, reqs)
            text = su.metrics(srv.url)
            pre = (su.metric(text, "shoal_preemptions_total") or 0) - before
            spec, _ = spec_counts(srv.url)
            su.log(f"     preemptions {pre:.0f}, {spec}")
            compare(ref["kv"], got, reqs, "--spec ngram, 40 blocks")
            assert pre > 0, "no preemption with 16 x ~140 positions in 640"
            assert spec["accepted_tokens"] > 0, f"no draft accepted: {spec}"
            clean_answers(srv)

        r.case("(d) 16 concurrent over 40 blocks: preempted, == --spec off", check)


def bad_flags(r):
    cases = [["--spec", "draft:models/x.gguf"], ["--spec", "self:30"], ["--spec", "bogus"],
             ["--spec", "ngram", "--spec-k", "0"], ["--spec", "ngram", "--spec-k", "17"],
             ["--spec", "ngram", "--spec-k", "abc"], ["--spec-k", "4"], ["--spec"]]

    def check():
        bad = []
        for args in cases:
            p = subprocess.run([su.shoal_binary(), "serve", "--port", "0", "-m", su.MODEL] + args,
                               cwd=su.ROOT, capture_output=True, text=True, timeout=60)
            if p.returncode != 2 or "error" not in p.stderr:
                bad.append(f"{args}: exit {p.returncode}, stderr {p.stderr[-200:]!r}")
        assert not bad, "\n  ".join(bad)

    r.case("(e) bad --spec / --spec-k values exit 2 with a message", check)


def script_server(r, ref):
    with tempfile.TemporaryDirectory(prefix="shoal-spec-") as d:
        path = os.path.join(d, "one.lua")
        with open(path, "w") as f:
            f.write(f"local m = model {{ path = '{su.MODEL}', name = '{MODEL}' }}\n"
                    "return cluster {\n"
                    "  nodes = { node { name = 'local', listen = 'inproc://local' } },\n"
                    "  gateway = { node = 'local', http = '127.0.0.1:8080' },\n"
                    "  replicas = { replica { model = m, stages = pipeline(m, { 'local' }) } },\n"
                    "  batcher = { spec = 'ngram', spec_k = 4 },\n"
                    "}\n")
        with su.server("-c", path, model=None, runner=r) as srv:
            def check():
                assert "speculative decoding ngram, up to 4 drafted tokens" in srv.log_text(), \
                    "no startup line for the script's spec"
                got = run_all(srv.url, REQS[:1])
                compare(ref["a"][:1], got, REQS[:1], "script spec ngram")
                spec, _ = spec_counts(srv.url)
                assert spec["accepted_tokens"] > 0, f"no draft accepted: {spec}"

            r.case("(f) script batcher.spec = 'ngram' serves drafts, == --spec off", check)
        with su.server("-c", path, "--spec", "off", model=None, runner=r) as srv:
            def off():
                complete(srv.url, *REQS[0])
                spec, _ = spec_counts(srv.url)
                assert spec["drafts"] == 0, f"--spec off drafted: {spec}"

            r.case("(f) --spec off wins over the script's spec", off)


def pipeline(r, ref):
    with tempfile.TemporaryDirectory(prefix="shoal-spec-") as d:
        path = os.path.join(d, "p2.lua")
        with open(path, "w") as f:
            f.write(f"local m = model {{ path = '{su.MODEL}', name = '{MODEL}' }}\n"
                    "return cluster {\n"
                    f"  nodes = {{ node {{ name = 'front', listen = 'ipc://{d}/front.sock' }},\n"
                    f"            node {{ name = 'w0', listen = 'ipc://{d}/w0.sock' }},\n"
                    f"            node {{ name = 'w1', listen = 'ipc://{d}/w1.sock' }} }},\n"
                    "  gateway = { node = 'front', http = '127.0.0.1:8080' },\n"
                    "  replicas = { replica { model = m, stages = pipeline(m, { 'w0', 'w1' }) } },\n"
                    "  batcher = { max_seqs = 16, spec = 'ngram' },\n"
                    "  kv = { memory = '64MiB' },\n"
                    "}\n")
        nodes = [tcp.Node(path, w) for w in ("w0", "w1")]
        problems = []
        try:
            for nd in nodes:
                nd.wait_ready()
            with su.server("-c", path, "--join-timeout", f"{su.scaled(60):g}", model=None,
                           runner=r) as srv:
                def check():
                    got = run_concurrently(srv.url, REQS)
                    compare(ref["a"], got, REQS, "2-stage pipeline, spec ngram")
                    spec, _ = spec_counts(srv.url)
                    su.log(f"     {spec}")
                    assert spec["accepted_tokens"] > 0, f"no draft accepted: {spec}"
                    clean_answers(srv)

                r.case("(h) 2-stage pipeline with spec ngram: 12 at once == --spec off", check)
        finally:
            for nd in nodes:
                problems += nd.stop()
        if problems:
            r.fail("(h) workers stop cleanly", "\n".join(problems))


STORIES = os.path.join(su.ROOT, "tests", "data", "stories260K", "stories260K.gguf")
WORDS = ("bird letter doctor some point father tree happy water river sun moon cat dog ball "
         "girl boy friend house garden flower apple toy car road sky").split()
STORY_REQS = [(p, 48, {"model": "stories260K"}) for p in (
    ["Once upon a time bird letter doctor some point father", "Once upon a time",
     "Lily and Tom went to the park.", "One day, a big dog", "The sun was"]
    + [f"Once upon a time {' '.join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(2 + i % 6))}"
       for i in range(27)])]
assert len(STORY_REQS) == 32


def stories(r, ref):
    with su.server("-m", STORIES, "-t", 1, "--spec", "off", runner=r) as srv:
        def run():
            ref["stories"] = run_all(srv.url, STORY_REQS)

        r.case("(i) stories260K --spec off: 32 reference outputs", run)
    if "stories" not in ref:
        return
    for spec in ("ngram", "self:2", "draft:" + STORIES):
        name = spec.split(":")[0]
        with su.server("-m", STORIES, "-t", 1, "--spec", spec, runner=r) as srv:
            def check():
                compare(ref["stories"], run_all(srv.url, STORY_REQS), STORY_REQS,
                        f"stories260K --spec {name} alone")
                compare(ref["stories"], run_concurrently(srv.url, STORY_REQS), STORY_REQS,
                        f"stories260K --spec {name} at once")
                spec_n, _ = spec_counts(srv.url)
                su.log(f"     stories260K --spec {name}: {spec_n}")
                assert spec_n["accepted_tokens"] > 0, f"no draft accepted: {spec_n}"
                clean_answers(srv)

            r.case(f"(i) stories260K --spec {name}: 32 alone and at once == --spec off", check)


def main():
    su.require_model()
    r = su.Runner("serve_spec")
    ref = {}
    t0 = time.monotonic()
    for part in (bad_flags, reference, spec_server, preemption, script_server, pipeline, stories):
        if part is not bad_flags and part is not reference and "a" not in ref:
            r.fail(part.__name__, "no reference outputs")
            continue
        try:
            part(r, ref) if part is not bad_flags else part(r)
        except AssertionError as e:
            r.fail(part.__name__, str(e))
    su.log(f"     {time.monotonic() - t0:.0f} s")
    r.finish()


if __name__ == "__main__":
    main()
