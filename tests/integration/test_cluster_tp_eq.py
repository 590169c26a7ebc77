"""Tensor-parallel groups against one process, on shapes test_cluster_tp.py does not cover (issue
26, "Equality"; docs/cluster.md "Tensor parallelism"), with real processes: `shoal node` ranks and
a `shoal serve -c` front, each case's greedy completions (all sent at once, 5 top logprobs per
token) against a single-process `shoal serve -m` of the same file.

Cases:
- stories260K, one stage of 3 ranks (shared memory): an uneven split. Its 8 query heads go 3/3/2
  and its 4 KV heads cannot be divided by 3, so a rank's heads run in KV-aligned parts with the
  KV heads two ranks share replicated; the FFN's 172 columns split 58/57/57 and the output head's
  512 rows 171/171/170. Tokens and text must equal one process's (a split is allowed only at a
  near-tie, top-2 gap < 1e-3), logprobs within 5e-3 (test_cluster_tp.py's bound).
- stories260K, one stage of 2 ranks, and 2 stages x 2 ranks, over the network collective on
  tcp://127.0.0.1 (`tp_link = "net"`): every node on a port P whose P + 1000 x I is free too for
  each stage index I (a rank's collective link listens on its node's port + 1000 x its stage's
  index), drawn at random from 20000-26999, below the ephemeral range that other tests' port-0
  listeners and connections use; each rank must log a net group. Same bounds; the leader's bytes
  sent on the links are at least those it passed to its collectives (nothing compressed).
- the same one stage of 2 ranks with `tp_compress = "f16"` and `"int8"`: each rank logs its
  group's compression; the completions follow one process within bounds from the measured figures
  (F16_* and INT8_* below: prompts equal throughout, logprobs before a split, the gap at a
  split), and the leader sends fewer bytes on its links than it passes in (f16 0.55-0.75 of
  them, int8 0.35-0.55: the gathers are not compressed).
- an MoE file written by `shoal mkmodel --shape qwen2moe-tiny` at a small size (2 layers, dim 64,
  8 routed experts of width 32, 4 per token, a shared expert of width 96, F16), one stage of 2
  ranks: 4 experts placed whole on each rank, the shared expert on rank 0, the router replicated.
  Same bounds.
- a Q4_K mkmodel file (dim 512 = 4 heads of 128, FFN 512: 2 blocks of 256 each): a group of 3
  ranks is refused by every rank's loader, each ending with exit 2 and one `error:` line naming
  the node, its rank, the file and the reason (2 FFN blocks of 256, blk.0.ffn_down.weight, fewer
  than the 3 ranks), and `shoal cluster up` stops on it; a group of 2 (whole blocks) follows one
  process up to near-ties (quantized bounds, below).
- Gemma 3 270M Q4_K_M (models/gemma3-270m-q4_k_m.gguf, `make model-gemma3`; skipped only when
  absent), one stage of 2 ranks and one of 3 (its 4 heads of 256 as 2/1/1: every slice of the
  attention output's 1024 Q4_K columns and of the FFN's 8 blocks is whole, so the loader takes
  every tp the heads allow), 4 prompts x 16 tokens: quantized, so each must follow one process up
  to near-ties as test_cluster_tp.py's smollm2 case does (a split only where the group's token is
  among the single process's 5 best, within 0.5 of its best; logprobs within 0.5 before it).
- speculative decoding in a group (issue 27): stories260K, one stage of 2 ranks whose script
  says batcher = { spec = "ngram", spec_k = 4 }, 16 prompts (8 that repeat themselves, so that
  n-gram drafts are accepted; 4 of them, and 2 others, with a logit_bias entry of 0, which turns
  the greedy head off, so their drafts are verified on the gathered logits instead of the rows'
  top-1) x 48 greedy tokens, each alone and then all at once, against `shoal serve -m --spec off`:
  equal tokens and text, logprobs within test_cluster_tp.py's bound; the front's
  shoal_spec_accepted_tokens_total > 0 after each of the two paths, and no answer that does not
  fit its drafts (step_answer_bad).
Each case logs how many prompts were equal throughout and, for the others, the token of the
split and the gap there.
"""

import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402
from test_cluster_pipeline import PROMPTS, Node  # noqa: E402
from test_cluster_tp import (SAME_LP_TOL, STORIES, Cluster, at_once, complete_top,  # noqa: E402
                             group_script, same)

GEMMA3 = os.path.join(su.ROOT, "models", "gemma3-270m-q4_k_m.gguf")
MOE_PROMPTS = [list(range(1, 21)), [100], [7, 8, 9, 250, 3], list(range(40, 80)), [299, 1, 299],
               [5] * 12, [17, 33, 250, 9, 140, 66, 5, 99], list(range(200, 230))]
NEAR_TIE = 1e-3  # issue 26: a split is allowed only where the top-2 gap is under this
EXACT_LP = 5e-3  # F32/F16 models: logprobs before a split (test_cluster_tp.py's `same`)
QUANT_TOL = 0.5  # quantized models: test_cluster_tp.py's LP_TOL and GAP_TOL
# tp_compress on stories260K (docs/cluster.md, "Compressed links"; measured with
# bench/tp_compress_agreement.py and this test, 8 runs: f16 16 of 16 equal, logprobs within
# 5.4e-3, 0.64 of the bytes on the wire; int8 9-14 of 16 equal, within 0.163 before a split,
# splits at gaps up to 0.134, 0.46 of the bytes). A broken encoding or a missing sum moves the
# first token's logprobs by far more (decoding either at 0.7 of its value fails both cases), and
# the uncompressed link sends every byte passed in (plus its frames' headers).
F16_GAP, F16_LP, F16_EQUAL, F16_WIRE = 0.02, 0.02, 14, (0.55, 0.75)
INT8_GAP, INT8_LP, INT8_EQUAL, INT8_WIRE = 0.3, 0.3, 5, (0.35, 0.55)


def reference(model, prompts, n):
    with su.server("-m", model, "-t", "1", "--kv-mem", "32M", "--max-seqs", "16",
                   "--step-tokens", "512", model=None) as srv:
        return at_once(srv.url, prompts, n, complete_top)


def agree(want, got, what, gap_tol, lp_tol):
    """Each prompt's tokens equal the single process's, or split once where the group's token is
    among its 5 best within gap_tol of the best; logprobs within lp_tol before a split."""
    equal, splits, worst_lp = 0, [], 0.0
    for i, (a, b) in enumerate(zip(want, got)):
        assert b[2] == a[2], f"{what}: prompt {i}: {b[2]} tokens, want {a[2]}"
        k = next((j for j, (x, y) in enumerate(zip(a[3], b[3])) if x != y), None)
        for j in range(k if k is not None else len(a[3])):
            d = abs(a[4][j] - b[4][j])
            worst_lp = max(worst_lp, d)
            assert d < lp_tol, \
                f"{what}: prompt {i} token {j} {a[3][j]!r}: logprobs {a[4][j]} vs {b[4][j]}"
        if k is None:
            assert b[0] == a[0], f"{what}: prompt {i}: text {b[0]!r}, want {a[0]!r}"
            equal += 1
            continue
        top = a[5][k]
        assert b[3][k] in top, \
            f"{what}: prompt {i}: at token {k} the group chose {b[3][k]!r}, not among {top}"
        gap = max(top.values()) - top[b[3][k]]
        assert gap < gap_tol, \
            f"{what}: prompt {i}: at token {k} {b[3][k]!r} is {gap:.2e} below the best"
        splits.append((i, k, gap))
    su.log(f"note: {what}: {equal} of {len(want)} prompts equal throughout; splits "
           f"(prompt, token, gap) {[(i, k, round(g, 6)) for i, k, g in splits]}; largest "
           f"logprob difference before a split {worst_lp:.2e}")
    return equal, splits


def group_agrees(d, model, ranks, prompts, n, want, name, gap_tol, lp_tol, kind="shm",
                 stages=None, script=None, wire=None, min_equal=None):
    """wire: (lo, hi) bounds on the leader's bytes sent on the links over the bytes it passed to
    its collectives; min_equal: the fewest prompts that must be equal throughout."""
    stages = stages or "pipeline(m, { { " + ", ".join(f"'{w}'" for w in ranks) + " } })"
    path = script or group_script(os.path.join(d, name + ".lua"), model, stages, ranks)
    c = Cluster(path, ranks)
    try:
        c.start()
        got = at_once(c.srv.url, prompts, n, complete_top)
        for w, nd in c.nodes.items():
            assert "event=tp_group" in nd.text() and f"kind={kind}" in nd.text(), \
                f"{w} formed no {kind} group:\n{nd.text()[-1500:]}"
        if wire:
            passed, sent = leader_bytes(c.srv.url, ranks)
            su.log(f"note: {name}: the leader passed {passed:.0f} bytes to its collectives and "
                   f"sent {sent:.0f} on its links ({sent / passed:.3f})")
            assert wire[0] <= sent / passed < wire[1], \
                f"{name}: wire bytes {sent} over {passed} passed, want [{wire[0]}, {wire[1]})"
    finally:
        c.stop()
    assert all(r[2] == n for r in got), [r[2] for r in got]
    equal, splits = agree(want, got, name, gap_tol, lp_tol)
    assert min_equal is None or equal >= min_equal, \
        f"{name}: {equal} of {len(want)} prompts equal throughout, want at least {min_equal}"
    return equal, splits


def leader_bytes(url, ranks):
    """The leader's (w0, layer 0) shoal_tp_collective_bytes_total and _wire_bytes_total once
    every rank's reports count the same collectives (nodes report each second)."""
    deadline = time.monotonic() + su.scaled(15)
    while True:
        text = su.metrics(url)
        calls = [su.metric(text, "shoal_tp_collectives_total", node=w, layer="0", rank=str(r))
                 for r, w in enumerate(ranks)]
        passed = su.metric(text, "shoal_tp_collective_bytes_total", node=ranks[0], layer="0",
                           rank="0")
        sent = su.metric(text, "shoal_tp_collective_wire_bytes_total", node=ranks[0], layer="0",
                         rank="0")
        if calls[0] and len(set(calls)) == 1 and passed and sent is not None:
            return passed, sent
        assert time.monotonic() < deadline, f"collectives per rank {calls}, bytes {passed} {sent}"
        time.sleep(0.5)


def ports_free(p, stages):
    for q in [p] + [p + 1000 * i for i in range(1, stages + 1)]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", q))
            except OSError:
                return False
    return True


def free_ports(n, stages):
    """n ports P, each with P + 1000 x I free too for every stage index I, from 20000-26999
    (below the ephemeral range, so that no test's connection takes one meanwhile; random, so
    that parallel tests do not pick the same)."""
    out = []
    rng = random.Random(os.getpid() ^ int.from_bytes(os.urandom(4), "little"))
    taken = set()
    while len(out) < n:
        p = rng.randrange(20000, 27000)
        mine = {p + 1000 * i for i in range(stages + 1)}
        if not mine & taken and ports_free(p, stages):
            out.append(p)
            taken |= mine
    return out


def tcp_script(path, model, ranks, stages=1, compress="none"):
    """'front' and `ranks` over tcp://127.0.0.1, the layers split over `stages` groups of
    len(ranks) / stages ranks that link over the network, with tp_compress = `compress`."""
    ports = free_ports(1 + len(ranks), stages)
    ns = ", ".join(f"node {{ name = '{n}', listen = 'tcp://127.0.0.1:{p}' }}"
                   for n, p in zip(["front"] + list(ranks), ports))
    k = len(ranks) // stages
    groups = ", ".join("{ " + ", ".join(f"'{w}'" for w in ranks[i:i + k]) + " }"
                       for i in range(0, len(ranks), k))
    with open(path, "w") as f:
        f.write(f"local m = model {{ path = '{model}', name = 'm' }}\n"
                "return cluster {\n"
                f"  nodes = {{ {ns} }},\n"
                "  gateway = { node = 'front', http = '127.0.0.1:8080' },\n"
                f"  replicas = {{ replica {{ model = m, stages = pipeline(m, {{ {groups} }}), "
                f"tp_link = 'net', tp_compress = '{compress}' }} }},\n"
                "  batcher = { max_seqs = 16, max_step_tokens = 512 },\n"
                "  kv = { memory = '32MiB' },\n"
                "}\n")
    links = [p + 1000 * (1 + i // k) for i, p in enumerate(ports[1:])]
    su.log(f"note: tcp ports {ports} (collective links on {links})")
    return path


def make_moe(path):
    argv = [su.shoal_binary(), "mkmodel", "--shape", "qwen2moe-tiny", "--layers", "2", "--dim",
            "64", "--ffn", "96", "--heads", "4", "--kv-heads", "2", "--vocab", "300", "--ctx",
            "512", "--experts", "8", "--experts-used", "4", "--expert-ffn", "32", "--shared-ffn",
            "96", "--type", "F16", "--seed", "5", "-o", path]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=su.scaled(60))
    assert r.returncode == 0, f"mkmodel failed: {r.stderr}"


def make_q4k(path):
    """Q4_K everywhere, dim 512 (4 heads of 128) and ffn 512: the attention output's 512 columns
    and the FFN are 2 blocks of 256 each."""
    argv = [su.shoal_binary(), "mkmodel", "--shape", "custom", "--layers", "2", "--dim", "512",
            "--ffn", "512", "--heads", "4", "--kv-heads", "2", "--vocab", "300", "--ctx", "512",
            "--type", "Q4_K", "--seed", "7", "-o", path]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=su.scaled(60))
    assert r.returncode == 0, f"mkmodel failed: {r.stderr}"


def kquant_split(d, model):
    """A K-quant file whose blocks allow 2 ranks and not 3: a group of 3 ends each rank with one
    `error:` line naming the node, its rank and the loader's reason (its 2 FFN blocks of 256 are
    fewer than the ranks), exit 2, nothing hanging; `shoal cluster up` stops on it."""
    ranks = ["w0", "w1", "w2"]
    path = group_script(os.path.join(d, "k1x3.lua"), model, "pipeline(m, { { 'w0', 'w1', "
                        "'w2' } })", ranks)
    nodes = [Node(path, w) for w in ranks]
    problems = []
    try:
        for r, nd in enumerate(nodes):
            nd.proc.wait(timeout=su.scaled(60))
            errs = [ln for ln in nd.text().splitlines() if ln.startswith("error:")]
            assert nd.proc.returncode == 2 and len(errs) == 1, \
                f"{nd.name} exit {nd.proc.returncode}:\n{nd.text()[-1500:]}"
            assert errs[0].startswith(f"error: node '{nd.name}': rank {r} of stage 1's group of "
                                      f"3: {model}: tensor parallelism: feed_forward_length 512 "
                                      "is 2 blocks of 256 (blk.0.ffn_down.weight is Q4_K): "
                                      "fewer than the 3 ranks"), errs[0]
        su.log(f"note: k-quant tp 3: {errs[0]}")
    finally:
        for nd in nodes:
            if nd.proc.poll() is None:
                problems += nd.stop()
    assert not problems, "\n".join(problems)
    p = subprocess.run([su.shoal_binary(), "cluster", "up", path], cwd=su.ROOT,
                       stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       timeout=su.scaled(120))
    out = p.stdout + p.stderr
    assert p.returncode != 0 and "fewer than the 3 ranks" in out, \
        f"cluster up exit {p.returncode}:\n{out[-2000:]}"


# Speculative decoding in a group: prompts that repeat themselves (drafts accepted) and others;
# True: with a logit_bias entry of 0 (no change to the logits, but the greedy head is off).
SPEC_PROMPTS = [(p, False) for p in [
    "Once upon a time, there was a little girl named Lily. Once upon a time, there was a little "
    "girl named Lily. Once upon a time, there was",
    "Tim and Sue went to the park. Tim and Sue went to the park. Tim and Sue went to the",
    "The cat sat on the mat. The cat sat on the mat. The cat sat on the mat. The cat",
    "One, two, three, four. One, two, three, four. One, two, three,"] + PROMPTS[:4]] + \
    [(p, True) for p in [
        "The dog ran to the tree. The dog ran to the tree. The dog ran to the",
        "Mom said yes. Mom said yes. Mom said yes. Mom said",
        "Lily had a red ball. Lily had a red ball. Lily had a",
        "The sun was hot and the sky was blue. The sun was hot and the sky was blue. The sun",
        "Ben wanted to fly", "The fish swam"]] + [(p, False) for p in PROMPTS[8:10]]
SPEC_TOKENS = 48


def complete_spec(url, item, n):
    """A greedy completion with each token's logprob and no top list (so it may draft)."""
    prompt, biased = item
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}
    if biased:
        body["logit_bias"] = {"0": 0}
    status, parsed, raw = su.post_json(url, "/v1/completions", body, timeout=300)
    assert status == 200, f"status {status}: {raw[:300]!r}"
    ch = parsed["choices"][0]
    lp = ch["logprobs"]
    return (ch["text"], ch["finish_reason"], parsed["usage"]["completion_tokens"], lp["tokens"],
            lp["token_logprobs"])


def spec_group(d, want):
    """One stage of 2 ranks with n-gram speculation: each prompt alone (the greedy-head ones
    first, then the biased ones, with the accepted drafts counted after each part), then all at
    once, equal the single process without speculation."""
    ranks = ["w0", "w1"]
    path = group_script(os.path.join(d, "spec.lua"), STORIES, "pipeline(m, { { 'w0', 'w1' } })",
                        ranks, batcher="max_seqs = 16, max_step_tokens = 512, spec = 'ngram', "
                        "spec_k = 4")
    c = Cluster(path, ranks)
    accepted = []
    try:
        c.start()
        assert "speculative decoding ngram, up to 4 drafted tokens" in c.srv.log_text(), \
            c.srv.log_text()[-1500:]
        alone = [None] * len(SPEC_PROMPTS)
        for part in (False, True):
            for i, item in enumerate(SPEC_PROMPTS):
                if item[1] == part:
                    alone[i] = complete_spec(c.srv.url, item, SPEC_TOKENS)
            accepted.append(su.metric(su.metrics(c.srv.url), "shoal_spec_accepted_tokens_total")
                            or 0)
        together = at_once(c.srv.url, SPEC_PROMPTS, SPEC_TOKENS, complete_spec)
        text = su.metrics(c.srv.url)
        counts = {k: su.metric(text, f"shoal_spec_{k}_total") or 0
                  for k in ("drafts", "draft_tokens", "accepted_tokens")}
        bad = [ln for ln in c.srv.log_text().splitlines() if "step_answer_bad" in ln]
        for w, nd in c.nodes.items():
            assert "event=tp_group" in nd.text() and "kind=shm" in nd.text(), \
                f"{w} formed no shm group:\n{nd.text()[-1500:]}"
    finally:
        c.stop()
    su.log(f"note: spec in a group: accepted {accepted[0]:.0f} through the greedy head, "
           f"{accepted[1] - accepted[0]:.0f} through the gathered logits; in all {counts}")
    assert not bad, f"{len(bad)} answers did not fit their drafts:\n  " + "\n  ".join(bad[:5])
    assert accepted[0] > 0, f"no draft accepted through the greedy head: {accepted}"
    assert accepted[1] > accepted[0], f"no draft accepted on the gathered logits: {accepted}"
    same(want, alone, "s1x2 spec ngram, alone", SAME_LP_TOL)
    same(want, together, "s1x2 spec ngram, at once", SAME_LP_TOL)


def main():
    if not os.path.exists(STORIES):
        su.skip(f"{STORIES} missing")
    r = su.Runner("test_cluster_tp_eq")
    d = tempfile.mkdtemp(prefix="shtpe-", dir="/tmp")  # ipc:// paths stay short
    try:
        with su.server("-m", STORIES, "-t", "1", "--kv-mem", "32M", "--max-seqs", "16",
                       "--step-tokens", "512", "--spec", "off", model=None) as srv:
            want_spec = at_once(srv.url, SPEC_PROMPTS, SPEC_TOKENS, complete_spec)
        r.case("stories260K: one stage of 2 ranks with batcher.spec = 'ngram' (drafts verified "
               "through the greedy head and the gathered logits) equals one process without it",
               spec_group, d, want_spec)
        want = reference(STORIES, PROMPTS, 64)
        r.case("stories260K: one stage of 3 ranks (8 heads over 4 KV heads: an uneven split) "
               "equals one process", group_agrees, d, STORIES, ["w0", "w1", "w2"], PROMPTS, 64,
               want, "s1x3", NEAR_TIE, EXACT_LP)
        r.case("stories260K: one stage of 2 ranks over the network collective on tcp://127.0.0.1 "
               "equals one process", group_agrees, d, STORIES, ["w0", "w1"], PROMPTS, 64, want,
               "s1x2tcp", NEAR_TIE, EXACT_LP, "net",
               script=tcp_script(os.path.join(d, "tcp.lua"), STORIES, ["w0", "w1"]),
               wire=(1.0, 1.1))
        r.case("stories260K: one stage of 2 ranks over the network collective with tp_compress = "
               "'f16' follows one process, sending less", group_agrees, d, STORIES, ["w0", "w1"],
               PROMPTS, 64, want, "s1x2f16", F16_GAP, F16_LP, "net compress=f16",
               script=tcp_script(os.path.join(d, "f16.lua"), STORIES, ["w0", "w1"],
                                 compress="f16"),
               wire=F16_WIRE, min_equal=F16_EQUAL)
        r.case("stories260K: one stage of 2 ranks over the network collective with tp_compress = "
               "'int8' follows one process up to near-ties, sending less", group_agrees, d,
               STORIES, ["w0", "w1"], PROMPTS, 64, want, "s1x2int8", INT8_GAP, INT8_LP,
               "net compress=int8",
               script=tcp_script(os.path.join(d, "int8.lua"), STORIES, ["w0", "w1"],
                                 compress="int8"),
               wire=INT8_WIRE, min_equal=INT8_EQUAL)
        r.case("stories260K: 2 stages x 2 ranks over the network collective on tcp://127.0.0.1 "
               "equal one process", group_agrees, d, STORIES, ["w0", "w1", "w2", "w3"], PROMPTS,
               64, want, "s2x2tcp", NEAR_TIE, EXACT_LP, "net",
               script=tcp_script(os.path.join(d, "tcp2.lua"), STORIES, ["w0", "w1", "w2", "w3"],
                                 2))
        moe = os.path.join(d, "qwen2moe.gguf")
        make_moe(moe)
        want_moe = reference(moe, MOE_PROMPTS, 24)
        r.case("qwen2moe (mkmodel, 8 experts, a shared one): one stage of 2 ranks, experts placed "
               "across them, equals one process", group_agrees, d, moe, ["w0", "w1"],
               MOE_PROMPTS, 24, want_moe, "moe1x2", NEAR_TIE, EXACT_LP)
        q4k = os.path.join(d, "q4k.gguf")
        make_q4k(q4k)
        r.case("a K-quant split the blocks do not allow (3 ranks) is refused by each rank by name",
               kquant_split, d, q4k)
        want_k = reference(q4k, MOE_PROMPTS, 24)
        r.case("the same K-quant file over 2 ranks (whole blocks) follows one process up to "
               "near-ties", group_agrees, d, q4k, ["w0", "w1"], MOE_PROMPTS, 24, want_k, "q4k1x2",
               QUANT_TOL, QUANT_TOL)
        if os.path.exists(GEMMA3):
            want_g = reference(GEMMA3, PROMPTS[:4], 16)
            r.case("gemma3 270M Q4_K_M: one stage of 2 ranks follows one process up to near-ties",
                   group_agrees, d, GEMMA3, ["w0", "w1"], PROMPTS[:4], 16, want_g, "gemma3 1x2",
                   QUANT_TOL, QUANT_TOL)
            r.case("gemma3 270M Q4_K_M: one stage of 3 ranks (4 heads as 2/1/1) follows one "
                   "process up to near-ties", group_agrees, d, GEMMA3, ["w0", "w1", "w2"],
                   PROMPTS[:4], 16, want_g, "gemma3 1x3", QUANT_TOL, QUANT_TOL)
        else:
            su.log(f"note: {GEMMA3} missing (make model-gemma3): the gemma3 cases are skipped")
    finally:
        shutil.rmtree(d, ignore_errors=True)
    r.finish()


if __name__ == "__main__":
    main()
