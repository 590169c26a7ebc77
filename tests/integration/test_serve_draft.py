"""shoal serve --spec draft:PATH and --spec self:LAYERS (issue 27): a draft model in serving.

(a) --spec off: the reference outputs of test_serve_spec's 12 greedy requests (edit-style, code,
    a count, free text, a stop string and a max_tokens inside runs of accepted drafts).
(b) --spec draft:<the default model itself> --spec-k 4: the 12 requests alone and then all at
    once (their prompts then hit the prefix cache, so the drafter learns their first tokens from
    step_seq.prior) give --spec off's outputs; /metrics: drafts in both phases, accepted in both,
    and a draft drafting for itself has nearly every draft accepted; the drafter's counters move,
    and shoal_spec_draft_tokens_total equals shoal_drafter_tokens_total (the batcher counts the
    drafts the drafter appended, as the last stage reports them, not those it asked for).
(c) --spec self:8: the same equality, drafts in both phases, and some accepted.
(e) Preemption: test_serve_spec's 16 requests at once over 40 KV blocks with a draft of the model
    itself: sequences are preempted and resumed (their first tokens again from step_seq.prior),
    outputs equal --spec off's and drafts are accepted; the drafter, whose pool is as small,
    appends fewer drafts than asked for at times, and shoal_spec_draft_tokens_total still equals
    shoal_drafter_tokens_total.
(d) Bad drafts exit 2 with one error line naming the problem: another vocabulary (stories260K's
    GGUF), a truncated copy of the model, a file that is no model, a missing file, self:0,
    self:30 (the model has 30 layers), and a draft with the worker nodes of a cluster script.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402
import test_serve_spec as tss  # noqa: E402  (the requests and their helpers)

REQS = tss.REQS
STORIES = os.path.join(su.ROOT, "tests", "data", "stories260K", "stories260K.gguf")


def drafter_counts(url):
    text = su.metrics(url)
    return {k: su.metric(text, f"shoal_drafter_{k}_total") or 0
            for k in ("steps", "tokens", "compute_us")}


def reference(r, ref):
    with su.server("--spec", "off", runner=r) as srv:
        def run():
            ref["a"] = tss.run_all(srv.url, REQS)
            ref["kv"] = tss.run_all(srv.url, tss.kv_reqs())
        r.case("(a) --spec off reference outputs", run)


def spec_server(r, ref, spec, label, min_rate):
    with su.server("--spec", spec, "--spec-k", "4", runner=r) as srv:
        seen = {}

        def alone():
            tss.compare(ref["a"], tss.run_all(srv.url, REQS), REQS, f"--spec {spec} alone")
            seen["alone"] = tss.spec_counts(srv.url)[0]
        r.case(f"({label}) --spec {spec}: 12 requests one by one == --spec off", alone)

        def at_once():
            tss.compare(ref["a"], tss.run_concurrently(srv.url, REQS), REQS,
                        f"--spec {spec} at once")
        r.case(f"({label}) --spec {spec}: 12 requests at once (prefix-cache hits) == --spec off",
               at_once)

        def metrics():
            spec_now, pos1 = tss.spec_counts(srv.url)
            d = drafter_counts(srv.url)
            a = seen.get("alone")
            assert a and a["accepted_tokens"] > 0, f"no draft accepted alone: {a}"
            assert spec_now["drafts"] > a["drafts"], f"no drafts at once: {a} -> {spec_now}"
            # A good draft is accepted after prefix-cache hits too (self:8 is not one).
            assert min_rate == 0 or spec_now["accepted_tokens"] > a["accepted_tokens"], \
                f"no draft accepted at once: {a} -> {spec_now}"
            assert pos1 > 0 and spec_now["accepted_tokens"] <= spec_now["draft_tokens"], spec_now
            assert d["steps"] > 0 and d["tokens"] > 0 and d["compute_us"] > 0, d
            # The batcher counts the drafts the drafter appended (STEP_DONE's drafted), not
            # those it asked for: exactly the drafter's own count (no step was retried here).
            assert d["tokens"] == spec_now["draft_tokens"], \
                f"drafter appended {d['tokens']:.0f}, batcher counted " \
                f"{spec_now['draft_tokens']:.0f}: {d} {spec_now}"
            rate = spec_now["accepted_tokens"] / d["tokens"]
            assert rate >= min_rate, \
                f"{rate:.3f} of the drafter's tokens accepted (want >= {min_rate}): {spec_now} {d}"
            su.log(f"     --spec {spec}: {spec_now}, drafter {d}, accepted {rate:.3f}")
        r.case(f"({label}) --spec {spec}: /metrics, drafts accepted", metrics)


def preemption(r, ref):
    reqs = tss.kv_reqs()
    with su.server("--spec", f"draft:{su.MODEL}", "--spec-k", "4", "--kv-blocks", 40,
                   "--max-seqs", 16, runner=r) as srv:
        def check():
            got = tss.run_concurrently(srv.url, reqs)
            text = su.metrics(srv.url)
            pre = su.metric(text, "shoal_preemptions_total") or 0
            spec, _ = tss.spec_counts(srv.url)
            d = drafter_counts(srv.url)
            su.log(f"     preemptions {pre:.0f}, {spec}, drafter {d}")
            tss.compare(ref["kv"], got, reqs, "--spec draft, 40 blocks")
            assert pre > 0, "no preemption with 16 x ~140 positions in 640"
            assert spec["accepted_tokens"] > 0, f"no draft accepted: {spec}"
            # Here the drafter appends fewer drafts than asked for at times (its own pool is as
            # small as the stage's and evicts sequences): the batcher counts what it appended.
            assert d["tokens"] == spec["draft_tokens"], \
                f"drafter appended {d['tokens']:.0f}, batcher counted " \
                f"{spec['draft_tokens']:.0f}: {d} {spec}"
        r.case("(e) 16 concurrent over 40 blocks with a draft: preempted, == --spec off", check)


def bad_drafts(r):
    tmp = tempfile.mkdtemp(prefix="shoal-draft-")
    truncated = os.path.join(tmp, "truncated.gguf")
    with open(su.MODEL, "rb") as f, open(truncated, "wb") as g:
        g.write(f.read(1 << 20))
    garbage = os.path.join(tmp, "garbage.gguf")
    with open(garbage, "wb") as g:
        g.write(b"this is not a model\n" * 100)
    m = ["-m", su.MODEL]
    cluster = ["-c", os.path.join(su.ROOT, "lua", "examples", "cluster-demo.lua")]
    cases = [(m, f"draft:{STORIES}", "vocabulary"), (m, f"draft:{truncated}", truncated),
             (m, f"draft:{garbage}", garbage), (m, "draft:/nonexistent/draft.gguf", "/nonexistent"),
             (m, "self:0", "self:0"), (m, "self:30", "from 1 to 29"),
             (cluster, "self:4", "one process only")]  # worker nodes: not yet

    def check():
        bad = []
        for where, spec, want in cases:
            p = subprocess.run([su.shoal_binary(), "serve", "--port", "0"] + where +
                               ["--spec", spec], cwd=su.ROOT, capture_output=True, text=True,
                               timeout=su.scaled(60))
            errs = [ln for ln in p.stderr.splitlines() if ln.startswith("error")]
            if p.returncode != 2 or len(errs) != 1 or want not in errs[0]:
                bad.append(f"--spec {spec}: exit {p.returncode}, stderr {p.stderr[-300:]!r}")
        assert not bad, "\n  ".join(bad)
    try:
        r.case("(d) bad drafts exit 2 with one error line", check)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main():
    su.require_model()
    r = su.Runner("serve_draft")
    ref = {}
    t0 = time.monotonic()
    bad_drafts(r)
    reference(r, ref)
    if "a" in ref:
        spec_server(r, ref, f"draft:{su.MODEL}", "b", 0.9)
        spec_server(r, ref, "self:8", "c", 0.0)
        preemption(r, ref)
    else:
        r.fail("spec", "no reference outputs")
    su.log(f"     {time.monotonic() - t0:.0f} s")
    r.finish()


if __name__ == "__main__":
    main()
