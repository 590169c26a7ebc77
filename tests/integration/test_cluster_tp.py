"""Tensor-parallel groups in cluster scripts (issue 26, docs/cluster.md "Tensor parallelism"),
against real processes (`shoal node` workers and a `shoal serve -c` front over ipc://).

Cases: greedy completions through one stage of 2 ranks (stories260K: 16 prompts x 64 tokens, all
at once, over shared memory and over the network collective, keyed and not; the default model:
16 x 32) and through 2 stages x 2 ranks (stories260K) against a single-process `shoal serve -m`
(stories260K: equal text, tokens and logprobs, plain greedy, so through the last stage's greedy
head; smollm2 Q4_1: equal up to near-ties, with top lists, so through the gathered logits); the
greedy head passes fewer bytes per step into the collectives than the gathered logits, with the
same logprobs, and requests with top lists or sampling beside it still answer; one stage of 2
ranks with `kv = { type = "f32" }` (stories260K, 4 prompts x 32 tokens) against `shoal serve -m
--kv-f32`: equal tokens, logprobs within issue 26's 1e-3; a rank started with the ranks swapped
in its script, with another model file, another group link, another tp_compress or another
kv.type is refused at the join naming the node; a rank killed under load pauses the replica, and once it
is started again the group is formed anew and every request ends with the undisturbed text; so
do rank 1 and the leader stopped (SIGSTOP) for 2 s under load; the status document, `shoal
cluster status` and the front's `/metrics` show the group and each rank's collectives and step
time (which grows with requests and holds the time waiting in collectives); bad input
(tp of 0, negative or over 64 or over the model's heads, a node named twice in a group, a standby
as a rank, or beside a group on another URL scheme or off the host of a shared-memory group, ranks
on different URL schemes, a node count that tp does not divide, an unknown tp_compress or one
without tp_link = "net") ends `shoal serve -c`, `shoal node` and `shoal cluster up` with exit 2 and one `error:`
line naming the culprit, never a hang.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402
from test_cluster_bad import exits_2  # noqa: E402
from test_cluster_pipeline import PROMPTS, Node, complete  # noqa: E402

STORIES = os.path.join(su.ROOT, "tests", "data", "stories260K", "stories260K.gguf")  # 5 layers
SMOLLM2 = os.path.join(su.ROOT, "models", "smollm2-135m-instruct-q4_1.gguf")


def group_script(path, model, stages, workers, extra="", kv="memory = '32MiB'",
                 batcher="max_seqs = 16, max_step_tokens = 512"):
    """'front' plus `workers` over ipc:// in the script's directory; `stages`: the replica's
    stages (Lua); `kv`, `batcher`: those tables' fields."""
    d = os.path.dirname(path)
    ns = ", ".join(f"node {{ name = '{n}', listen = 'ipc://{d}/{n}.sock' }}"
                   for n in ["front"] + list(workers))
    with open(path, "w") as f:
        f.write(f"local m = model {{ path = '{model}', name = 'm' }}\n"
                "return cluster {\n"
                f"  nodes = {{ {ns} }},\n"
                "  gateway = { node = 'front', http = '127.0.0.1:8080' },\n"
                f"  replicas = {{ replica {{ model = m, stages = {stages} }} }},\n"
                f"  batcher = {{ {batcher} }},\n"
                f"  kv = {{ {kv} }},\n{extra}"
                "}\n")
    return path


def complete_top(url, prompt, n):
    """A greedy completion with each token's 5 most likely alternatives: (text, finish reason,
    token count, tokens, logprobs, top logprobs)."""
    status, parsed, raw = su.post_json(url, "/v1/completions", {
        "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
        "logprobs": 5}, timeout=300)
    assert status == 200, f"status {status}: {raw[:300]!r}"
    ch = parsed["choices"][0]
    lp = ch["logprobs"]
    return (ch["text"], ch["finish_reason"], parsed["usage"]["completion_tokens"], lp["tokens"],
            lp["token_logprobs"], lp["top_logprobs"])


def complete_lp0(url, prompt, n):
    """A greedy completion with each token's logprob and no top list ("logprobs": 0): a plain
    greedy sequence, which a group's last stage samples from the rows' top-1 and log-sum-exp
    (docs/cluster.md, "The greedy head"). The same tuple as `complete`."""
    status, parsed, raw = su.post_json(url, "/v1/completions", {
        "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
        "logprobs": 0}, timeout=300)
    assert status == 200, f"status {status}: {raw[:300]!r}"
    ch = parsed["choices"][0]
    lp = ch["logprobs"]
    assert all(not t for t in lp.get("top_logprobs") or []), lp
    return (ch["text"], ch["finish_reason"], parsed["usage"]["completion_tokens"], lp["tokens"],
            lp["token_logprobs"])


def at_once(url, prompts, n, fn=complete):
    return su.at_once(url, prompts, n, fn)


def reference(model, prompts, n, fn=complete, *flags):
    with su.server("-m", model, "-t", "1", "--kv-mem", "32M", "--max-seqs", "16",
                   "--step-tokens", "512", *flags, model=None) as srv:
        return at_once(srv.url, prompts, n, fn)


# A quantized model whose greedy text is chaotic under any change of rounding (docs/cluster.md,
# "Activation links": smollm2 Q4_1) does not give one process's tokens when its matrices are
# split: each prompt must follow the single process's tokens, within LP_TOL of its logprobs,
# until a split where the group's token is among the 5 the single process found most likely,
# within GAP_TOL of its best. Wrong slices or a broken exchange fail at once (other tokens, far
# larger differences).
LP_TOL = 0.5
GAP_TOL = 0.5


def close(want, got, what):
    equal, splits, worst_lp, worst_gap = 0, [], 0.0, 0.0
    for i, (a, b) in enumerate(zip(want, got)):
        assert b[2] == a[2], f"prompt {i}: {b[2]} tokens, want {a[2]}"
        k = next((j for j, (x, y) in enumerate(zip(a[3], b[3])) if x != y), None)
        for j in range(k if k is not None else len(a[3])):
            d = abs(a[4][j] - b[4][j])
            worst_lp = max(worst_lp, d)
            assert d < LP_TOL, f"prompt {i} token {j} {a[3][j]!r}: logprobs {a[4][j]} vs {b[4][j]}"
        if k is None:
            equal += 1
            continue
        top = a[5][k]
        assert b[3][k] in top, \
            f"prompt {i}: at token {k} the group chose {b[3][k]!r}, not among {top}"
        gap = max(top.values()) - top[b[3][k]]
        worst_gap = max(worst_gap, gap)
        assert gap < GAP_TOL, f"prompt {i}: at token {k} {b[3][k]!r} is {gap:.3f} below the best"
        splits.append(k)
    su.log(f"note: {what}: {equal} of {len(want)} prompts equal throughout; the others split at "
           f"tokens {splits} (the single process's best within {worst_gap:.3f} of the group's "
           f"token); largest logprob difference before a split {worst_lp:.3f}")


# stories260K's logprobs through a group: one process's sums in another order (the all-reduce's)
# move a K or V value across a rounding step of the F16 KV cache now and then (the nodes' and
# `shoal serve`'s cache type); measured 2.08e-3 here, 1.6e-3 in test_llama_tp's stories_f16_kv
# (1.5e-5 with an F32 cache there; nodes and reference built with an F32 cache gave 4.6e-6 here).
# A wrong slice or a broken exchange changes tokens.
SAME_LP_TOL = 3e-3
# With `kv = { type = "f32" }` on the nodes and `--kv-f32` on the single process only the
# all-reduce's order differs: issue 26's bound (measured 5e-6 and under).
F32_KV_LP_TOL = 1e-3


def same(want, got, what, tol=SAME_LP_TOL):
    """Equal tokens with logprobs within tol, except that a prompt may split at an exact near-tie:
    the first differing token of each side has a logprob within tol of the other's (each chose
    its best, so the two were within tol of each other on both sides; the logprob tolerance
    itself allows that much). On the AVX2-only EPYC VM stories260K's prompt 12 splits so at
    token 52 (' I' -1.21654 vs ' The' -1.21727 in one process); at most 1 prompt in 8 may."""
    bad, splits = [], []
    for i, (a, b) in enumerate(zip(want, got)):
        if a[:4] == b[:4]:
            continue
        k = next((j for j, (x, y) in enumerate(zip(a[3], b[3])) if x != y), None)
        if (a[1:3] == b[1:3] and k is not None and a[3][:k] == b[3][:k]
                and abs(a[4][k] - b[4][k]) < tol):
            splits.append((i, k, a[3][k], b[3][k], a[4][k], b[4][k]))
            continue
        bad.append(f"prompt {i}: single {a[:4]} vs {what} {b[:4]}")
    assert not bad, "\n".join(bad)
    assert len(splits) <= max(1, len(want) // 8), f"{what}: too many near-tie splits: {splits}"
    upto = {i: k + 1 for i, k, *_ in splits}  # the split token's logprobs are compared too
    worst = max(abs(x - y) for i, (a, b) in enumerate(zip(want, got))
                for x, y in zip(a[4][:upto.get(i, len(a[4]))], b[4]))
    su.log(f"note: {what}: largest logprob difference {worst:.2e}"
           + (f"; near-tie splits (prompt, token, single, group): {splits}" if splits else ""))
    assert worst < tol, f"logprobs differ by up to {worst} (at most {tol})"


class Cluster:
    """Worker nodes and a front on a script; stop() raises on a problem."""

    def __init__(self, path, workers):
        self.path = path
        self.nodes = {w: Node(path, w) for w in workers}
        self.srv = None

    def start(self):
        for nd in self.nodes.values():
            nd.wait_ready()
        self.srv = su.start("-c", self.path, "--join-timeout", f"{su.scaled(60):g}", model=None)
        return self

    def stop(self):
        problems = su.stop(self.srv) if self.srv else []
        for nd in self.nodes.values():
            problems += nd.stop()
        assert not problems, "\n".join(problems)


def settled_bytes(url):
    """The leader's (w0, rank 0, layer 0) shoal_tp_collective_bytes_total once the nodes' reports
    have stopped moving it (they report each second) and both ranks count the same calls."""
    deadline = time.monotonic() + su.scaled(15)
    last = None
    while True:
        text = su.metrics(url)
        b = su.metric(text, "shoal_tp_collective_bytes_total", node="w0", layer="0", rank="0")
        calls = [su.metric(text, "shoal_tp_collectives_total", node=w, layer="0", rank=str(r))
                 for r, w in enumerate(["w0", "w1"])]
        if b is not None and b == last and calls[0] == calls[1]:
            return b
        assert time.monotonic() < deadline, f"collective bytes still moving: {b}, calls {calls}"
        last = b
        time.sleep(1.5)


def greedy_head(url, want):
    """The group's last stage uses the greedy head (16 bytes a row exchanged instead of each
    rank's share of the logits) for a plain greedy request only: one request of N tokens alone,
    with "logprobs": 0 and then "logprobs": 1 (the full-logits path: it needs a top list), moves
    the leader's collective bytes by a rank's share of a row of logits less 16 bytes per sampled
    step (stories260K: 512 / 2 x 4 - 16 = 1008). A request with a top list and one at
    temperature 0.8 in the same cluster still answer (the full-logits path)."""
    n = 32
    deltas, runs = {}, {}
    for fn in (complete_lp0, complete):
        b0 = settled_bytes(url)
        r = fn(url, PROMPTS[0], n)
        assert r[2] == n and r[3] == want[0][3][:n], f"{fn.__name__}: {r[3]} vs {want[0][3][:n]}"
        deltas[fn.__name__] = settled_bytes(url) - b0
        runs[fn.__name__] = r
    top1, full = deltas["complete_lp0"], deltas["complete"]
    su.log(f"note: collective bytes per step (leader, {n} sampled steps of one sequence): greedy "
           f"head {top1 / n:.0f}, full logits {full / n:.0f}")
    assert (full - top1) / n >= 1000, f"bytes per step: greedy head {top1 / n}, full {full / n}"
    # The same steps' logprobs from the top-1 and log-sum-exp and from the gathered logits.
    worst = max(abs(x - y) for x, y in zip(runs["complete_lp0"][4], runs["complete"][4]))
    su.log(f"note: greedy head vs full logits, same steps: largest logprob difference "
           f"{worst:.1e}")
    assert worst < 1e-5, f"{runs['complete_lp0'][4]} vs {runs['complete'][4]}"

    # Plain greedy sequences and ones with a top list in the same steps (the full-logits path).
    def mixed(u, p, k):
        return (complete_top if PROMPTS.index(p) % 2 else complete_lp0)(u, p, k)

    got = at_once(url, PROMPTS[:4], 16, mixed)
    for i, g in enumerate(got):
        assert g[2] == 16 and g[3] == want[i][3][:16], f"prompt {i}: {g[3]} vs {want[i][3][:16]}"
        assert i % 2 == 0 or all(len(t) == 5 for t in g[5]), f"prompt {i}: {g[5]}"
    status, parsed, raw = su.post_json(url, "/v1/completions", {
        "prompt": PROMPTS[1], "max_tokens": 16, "temperature": 0.8, "seed": 7,
        "ignore_eos": True}, timeout=300)
    assert status == 200 and parsed["usage"]["completion_tokens"] == 16, raw[:300]


def group_equals(d, model, stages, workers, prompts, n, want, name, kind="shm", exact=True,
                 extra="", kv="memory = '32MiB'", tol=SAME_LP_TOL):
    c = Cluster(group_script(os.path.join(d, name + ".lua"), model, stages, workers, extra, kv),
                workers)
    try:
        c.start()
        got = at_once(c.srv.url, prompts, n, complete_lp0 if exact else complete_top)
        if name == "s1x2":  # the status document and `shoal cluster status` show the group
            greedy_head(c.srv.url, want)
            status, _, raw = su.get(c.srv.url, "/admin/cluster")
            assert status == 200, raw[:300]
            doc = json.loads(raw)
            st = doc["replicas"][0]["stages"][0]
            assert st["node"] == "w0" and st["ranks"] == ["w0", "w1"], st
            w1 = [x for x in doc["nodes"] if x["name"] == "w1"][0]
            assert w1["stages"] == [1], w1
            p = subprocess.run([su.shoal_binary(), "cluster", "status", c.srv.url],
                               capture_output=True, text=True, timeout=su.scaled(30))
            assert p.returncode == 0 and "w0+w1" in p.stdout, p.stdout + p.stderr
            # Each rank's collective series reach the front's /metrics (nodes report each second).
            deadline = time.monotonic() + su.scaled(10)
            while True:
                text = su.metrics(c.srv.url)
                calls = [su.metric(text, "shoal_tp_collectives_total", node=w, layer="0",
                                   rank=str(r)) for r, w in enumerate(["w0", "w1"])]
                if (calls[0] and calls[0] == calls[1]) or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert all(x and x > 0 for x in calls), f"collectives per rank: {calls}"
            waits = [su.metric(text, "shoal_tp_collective_wait_microseconds_total", node=w,
                               layer="0", rank=str(r)) for r, w in enumerate(["w0", "w1"])]
            formed = su.metric(text, "shoal_tp_groups_formed_total", node="w1", layer="0",
                               rank="1")
            assert calls[0] == calls[1] and all(x is not None for x in waits) and formed == 1, \
                (calls, waits, formed)
            steps = tp_steps(text)
            assert all(x and x > 0 for x in steps) and all(
                w <= s for w, s in zip(waits, steps)), f"waits {waits}, steps {steps}"
            su.log(f"note: collectives per rank {calls}, microseconds waiting {waits} of "
                   f"{steps} in steps ({', '.join(f'{w / s:.0%}' for w, s in zip(waits, steps))})")
            # More requests: each rank's step time grows, and still holds its waits.
            at_once(c.srv.url, prompts[:4], 16)
            deadline = time.monotonic() + su.scaled(10)
            while True:
                text = su.metrics(c.srv.url)
                more = tp_steps(text)
                calls = [su.metric(text, "shoal_tp_collectives_total", node=w, layer="0",
                                   rank=str(r)) for r, w in enumerate(["w0", "w1"])]
                if (all(m and m > s for m, s in zip(more, steps)) and calls[0] == calls[1]) or \
                        time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            waits = [su.metric(text, "shoal_tp_collective_wait_microseconds_total", node=w,
                               layer="0", rank=str(r)) for r, w in enumerate(["w0", "w1"])]
            assert all(m and m > s for m, s in zip(more, steps)) and all(
                w <= m for w, m in zip(waits, more)), \
                f"steps {steps} then {more}, waits {waits}"
        kt = "f32" if "'f32'" in kv else "f16"  # kv.type, shown by each node and the front
        for w, nd in c.nodes.items():
            assert "event=tp_group" in nd.text() and f"kind={kind}" in nd.text(), \
                f"{w} formed no {kind} group:\n{nd.text()[-1500:]}"
            assert "key_file" not in extra or "cluster key set" in nd.text(), nd.text()[-1500:]
            assert f"blocks of {kt} per stage" in nd.text(), nd.text()[-1500:]
        assert f"MiB {kt} per stage)" in c.srv.log_text(), c.srv.log_text()[-1500:]
    finally:
        c.stop()
    if exact:
        same(want, got, name, tol)
    else:
        close(want, got, name)
    assert all(r[2] == n for r in got), [r[2] for r in got]


def tp_steps(text):
    """Each rank's microseconds of steps (w0 rank 0, w1 rank 1) in a /metrics text."""
    return [su.metric(text, "shoal_tp_step_microseconds_total", node=w, layer="0", rank=str(r))
            for r, w in enumerate(["w0", "w1"])]


def swapped_rank(d):
    """w1 started with a script that makes it the leader: refused at the join by name."""
    front = group_script(os.path.join(d, "sw.lua"), STORIES, "pipeline(m, { { 'w0', 'w1' } })",
                         ["w0", "w1"])
    other = group_script(os.path.join(d, "sw-w1.lua"), STORIES, "pipeline(m, { { 'w1', 'w0' } })",
                         ["w0", "w1"])
    w0, w1 = Node(front, "w0"), Node(other, "w1")
    try:
        w0.wait_ready()
        w1.wait_ready()
        exits_2(["serve", "-c", front, "--port", "0", "--join-timeout", "30"],
                ["node 'w1' (ipc://", "refused: stage 1: it holds rank 0 of 2 with layers [0, 5), "
                 "the script gives it rank 1 of 2 with layers [0, 5)"])
    finally:
        problems = w0.stop() + w1.stop()
    assert not problems, "\n".join(problems)


def other_link(d):
    """w1 started with a script whose group links over the network: refused by name."""
    front = group_script(os.path.join(d, "ol.lua"), STORIES, "pipeline(m, { { 'w0', 'w1' } })",
                         ["w0", "w1"])
    other = group_script(os.path.join(d, "ol-w1.lua"), STORIES,
                         "pipeline(m, { { 'w0', 'w1' } }), tp_link = 'net'", ["w0", "w1"])
    w0, w1 = Node(front, "w0"), Node(other, "w1")
    try:
        w0.wait_ready()
        w1.wait_ready()
        exits_2(["serve", "-c", front, "--port", "0", "--join-timeout", "30"],
                ["node 'w1' (ipc://", "refused: stage 1: its group links over the network, the "
                 "script's over shared memory"])
    finally:
        problems = w0.stop() + w1.stop()
    assert not problems, "\n".join(problems)


def other_compress(d):
    """w1 started with a script whose network group compresses its links with f16 while the
    front's sends f32: refused by name."""
    front = group_script(os.path.join(d, "oc.lua"), STORIES,
                         "pipeline(m, { { 'w0', 'w1' } }), tp_link = 'net'", ["w0", "w1"])
    other = group_script(os.path.join(d, "oc-w1.lua"), STORIES,
                         "pipeline(m, { { 'w0', 'w1' } }), tp_link = 'net', tp_compress = 'f16'",
                         ["w0", "w1"])
    w0, w1 = Node(front, "w0"), Node(other, "w1")
    try:
        w0.wait_ready()
        w1.wait_ready()
        assert "(rank 1 of 2, network, f16 links)" in w1.text(), w1.text()[-1500:]
        exits_2(["serve", "-c", front, "--port", "0", "--join-timeout", "30"],
                ["node 'w1' (ipc://", "refused: stage 1: its group's links carry tp_compress = "
                 "\"f16\", the script's \"none\": was it started with another script?"])
    finally:
        problems = w0.stop() + w1.stop()
    assert not problems, "\n".join(problems)


def bad_compress(d):
    """An unknown tp_compress, and compression of a group that would link over shared memory."""
    s = write(d, "cmp.lua", "replica { model = m, stages = pipeline(m, { { 'w0', 'w1' } }), "
              "tp_link = 'net', tp_compress = 'bf16' }")
    everywhere(s, ["cmp.lua:5", "replica: tp_compress 'bf16' must be \"none\", \"f16\" or "
                   "\"int8\""])
    s = write(d, "cmpshm.lua", "replica { model = m, stages = pipeline(m, { { 'w0', 'w1' } }), "
              "tp_compress = 'int8' }")
    everywhere(s, ["cmpshm.lua:5", "replica: tp_compress = \"int8\" needs tp_link = \"net\" or "
                   "\"hier\" (only the network collective compresses; a group on shared memory "
                   "exchanges f32)"])


def other_kv_type(d):
    """w1 started with a script whose KV cache is F16 (at half the budget: the same block count)
    while the front's is F32: refused by name."""
    front = group_script(os.path.join(d, "kt.lua"), STORIES, "pipeline(m, { { 'w0', 'w1' } })",
                         ["w0", "w1"], kv="memory = '32MiB', type = 'f32'")
    other = group_script(os.path.join(d, "kt-w1.lua"), STORIES, "pipeline(m, { { 'w0', 'w1' } })",
                         ["w0", "w1"], kv="memory = '16MiB', type = 'f16'")
    w0, w1 = Node(front, "w0"), Node(other, "w1")
    try:
        w0.wait_ready()
        w1.wait_ready()
        exits_2(["serve", "-c", front, "--port", "0", "--join-timeout", "30"],
                ["node 'w1' (ipc://", "refused: kv.type: here f32, there f16"])
    finally:
        problems = w0.stop() + w1.stop()
    assert not problems, "\n".join(problems)


def other_model(d):
    """A rank holding another model file is refused by name."""
    copy = os.path.join(d, "other.gguf")
    shutil.copyfile(STORIES, copy)
    with open(copy, "ab") as f:
        f.write(b"\0" * 64)
    front = group_script(os.path.join(d, "om.lua"), STORIES, "pipeline(m, { { 'w0', 'w1' } })",
                         ["w0", "w1"])
    other = group_script(os.path.join(d, "om-w1.lua"), copy, "pipeline(m, { { 'w0', 'w1' } })",
                         ["w0", "w1"])
    w0, w1 = Node(front, "w0"), Node(other, "w1")
    try:
        w0.wait_ready()
        w1.wait_ready()
        exits_2(["serve", "-c", front, "--port", "0", "--join-timeout", "30"],
                ["node 'w1' (ipc://", "refused: a different model file"])
    finally:
        problems = w0.stop() + w1.stop()
    assert not problems, "\n".join(problems)


def rank_stopped(d, who):
    """SIGSTOP of one rank for 2 s under 8 requests of 256 tokens: the replica pauses, the node
    answers again, the replica resumes and every request ends with the undisturbed text."""
    want = reference(STORIES, PROMPTS[:8], 256)
    path = group_script(os.path.join(d, f"stop-{who}.lua"), STORIES,
                        "pipeline(m, { { 'w0', 'w1' } })", ["w0", "w1"])
    c = Cluster(path, ["w0", "w1"])
    try:
        c.start()
        out = [None] * 8

        def one(i):
            try:
                out[i] = complete(c.srv.url, PROMPTS[i], 256)
            except Exception as exc:  # noqa: BLE001
                out[i] = exc

        ts = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(8)]
        for t in ts:
            t.start()
        time.sleep(0.15)
        nd = c.nodes[who]
        nd.proc.send_signal(signal.SIGSTOP)
        try:
            time.sleep(2.0)
        finally:
            nd.proc.send_signal(signal.SIGCONT)
        for t in ts:
            t.join(su.scaled(120))
        for i, r in enumerate(out):
            assert not isinstance(r, Exception) and r is not None, f"prompt {i}: {r!r}"
        log = c.srv.log_text()
        assert f"node {who}" in log and "was lost" in log and "resumed" in log, log[-2000:]
    finally:
        c.stop()
    same(want, out, f"2 ranks, {who} stopped 2 s")


def rank_killed(d):
    """kill -9 of rank 1 under 8 requests of 256 tokens: the replica pauses, the node is started
    again, the group is formed anew (a new epoch) and every request ends with the undisturbed
    text."""
    want = reference(STORIES, PROMPTS[:8], 256)
    path = group_script(os.path.join(d, "kill.lua"), STORIES, "pipeline(m, { { 'w0', 'w1' } })",
                        ["w0", "w1"])
    c = Cluster(path, ["w0", "w1"])
    try:
        c.start()
        out = [None] * 8
        ts = []

        def one(i):
            try:
                out[i] = complete(c.srv.url, PROMPTS[i], 256)
            except Exception as exc:  # noqa: BLE001
                out[i] = exc

        for i in range(8):
            ts.append(threading.Thread(target=one, args=(i,), daemon=True))
            ts[-1].start()
        time.sleep(0.15)
        w1 = c.nodes["w1"]
        w1.proc.send_signal(signal.SIGKILL)
        w1.proc.wait()
        done = sum(1 for x in out if x is not None)
        su.log(f"note: {done} of 8 requests had ended at the kill")
        deadline = time.monotonic() + su.scaled(10)
        while "node w1" not in c.srv.log_text() or "was lost" not in c.srv.log_text():
            assert time.monotonic() < deadline, c.srv.log_tail()
            time.sleep(0.05)
        c.nodes["w1"] = Node(path, "w1").wait_ready()
        for t in ts:
            t.join(su.scaled(120))
        for i, r in enumerate(out):
            assert not isinstance(r, Exception) and r is not None, f"prompt {i}: {r!r}"
        log = c.srv.log_text()
        assert "replica 1 resumed" in log, log[-2000:]
        epochs = {ln.split("epoch=")[1].split()[0] for ln in c.nodes["w0"].text().splitlines()
                  if "event=tp_group" in ln}
        assert len(epochs) >= 2, f"the leader formed its group once only: {epochs}"
    finally:
        c.stop()
    same(want, out, "2 ranks, rank 1 killed and restarted")


def write(d, name, replica, nodes=("w0", "w1", "w2", "w3"), extra_nodes=""):
    """A script for stories260K: 'front' plus `nodes` over ipc:// in d, and `replica` (the text of
    one replica{ ... } whose model is m) on line 5."""
    path = os.path.join(d, name)
    ns = ", ".join(f"node {{ name = '{n}', listen = 'ipc://{d}/{n}.sock' }}"
                   for n in ("front",) + tuple(nodes))
    with open(path, "w") as f:
        f.write(f"local m = model {{ path = '{STORIES}', name = 'm' }}\n"
                "return cluster {\n"
                f"  nodes = {{ {ns}{extra_nodes} }},\n"
                "  gateway = { node = 'front', http = '127.0.0.1:8080' },\n"
                f"  replicas = {{ {replica} }},\n"
                "  batcher = { max_seqs = 8, max_step_tokens = 256 },\n"
                "  kv = { memory = '16MiB' },\n"
                "}\n")
    return path


def everywhere(script, want, node="w0"):
    """The front, a worker and `cluster up` each refuse the script with the same line."""
    exits_2(["serve", "-c", script, "--port", "0"], want)
    exits_2(["node", "-c", script, "--name", node, "-t", "1"], want)
    exits_2(["cluster", "up", script], want)


def bad_tp(d):
    for tp in ("0", "-2", "65"):
        s = write(d, f"tp{tp}.lua", "replica { model = m, stages = pipeline(m, { 'w0', 'w1' }), "
                  f"tp = {tp} }}")
        everywhere(s, [f"tp{tp}.lua:5", f"replica: tp = {tp}: the ranks of each stage's "
                       "tensor-parallel group must be a whole number from 1 to 64"])
    s = write(d, "tpf.lua", "replica { model = m, stages = pipeline(m, { 'w0', 'w1' }), tp = 1.5 }")
    everywhere(s, ["tpf.lua:5", "replica: field 'tp' must be an integer, got a float"])
    s = write(d, "tp3.lua", "replica { model = m, stages = pipeline(m, { 'w0', 'w1', 'w2', 'w3' }),"
              " tp = 3 }")
    everywhere(s, ["tp3.lua:5", "replica 1: tp = 3 groups the stages' 4 nodes by 3, which leaves "
                   "1 over"])


def named_twice(d):
    s = write(d, "twice.lua", "replica { model = m, stages = pipeline(m, { { 'w0', 'w0' } }) }",
              nodes=("w0",))
    everywhere(s, ["twice.lua:5", "replica 1 stage 1: node 'w0' is named twice in the group "
                   "(ranks 0 and 1)"])
    s = write(d, "twice2.lua", "replica { model = m, stages = pipeline(m, { 'w1', 'w1' }), tp = 2 }",
              nodes=("w1",))
    everywhere(s, ["twice2.lua:5", "replica 1 stage 1 (tp = 2): node 'w1' is named twice"],
               node="w1")


def standby_rank(d):
    s = write(d, "sb.lua", "replica { model = m, stages = { { nodes = { 'w0', 's' } } } }",
              nodes=("w0",),
              extra_nodes=f", node {{ name = 's', listen = 'ipc://{d}/s.sock', standby = true }}")
    everywhere(s, ["sb.lua:5", "replica 1 stage 1: node 's' is a standby and cannot serve"])
    # A standby beside a group may take any rank's place (test_cluster_tp_standby.py), but only
    # over the ranks' kind of link, and on their host when they exchange through shared memory.
    s = write(d, "sb2.lua", "replica { model = m, stages = { { nodes = { 'w0', 'w1' } } } }",
              nodes=("w0", "w1"),
              extra_nodes=", node { name = 's', listen = 'tcp://127.0.0.1:7399', standby = true }")
    everywhere(s, ["sb2.lua: standby 's' listens on tcp://127.0.0.1:7399 and replica 1 stage 1's "
                   "ranks on ipc://: a standby takes a rank's place over the ranks' kind of link"])
    s = os.path.join(d, "sb3.lua")
    with open(s, "w") as f:
        f.write(f"local m = model {{ path = '{STORIES}', name = 'm' }}\n"
                "return cluster {\n"
                "  nodes = { node { name = 'front', listen = 'tcp://127.0.0.1:7395' },\n"
                "    node { name = 'w0', listen = 'tcp://127.0.0.1:7396' },\n"
                "    node { name = 'w1', listen = 'tcp://127.0.0.1:7397' },\n"
                "    node { name = 's', listen = 'tcp://192.0.2.7:7398', standby = true } },\n"
                "  gateway = { node = 'front', http = '127.0.0.1:8080' },\n"
                "  replicas = { replica { model = m, stages = { { nodes = { 'w0', 'w1' } } } } },\n"
                "}\n")
    want = ["sb3.lua: standby 's' listens on tcp://192.0.2.7:7398, not on this host, and "
            "replica 1 stage 1's ranks exchange through shared memory here: it could not take a "
            "rank's place"]
    # (`cluster up` refuses it earlier: it starts local nodes only.)
    exits_2(["serve", "-c", s, "--port", "0"], want)
    exits_2(["node", "-c", s, "--name", "w0", "-t", "1"], want)
    # Nor beside a group on two levels (its host would move the rank's segment and leader).
    s = os.path.join(d, "sb4.lua")
    with open(s, "w") as f:
        f.write(f"local m = model {{ path = '{STORIES}', name = 'm' }}\n"
                "return cluster {\n"
                "  nodes = { node { name = 'front', listen = 'tcp://127.0.0.1:7395' },\n"
                "    node { name = 'w0', listen = 'tcp://127.0.0.1:7396' },\n"
                "    node { name = 'w1', listen = 'tcp://127.0.0.2:7397' },\n"
                "    node { name = 's', listen = 'tcp://127.0.0.1:7398', standby = true } },\n"
                "  gateway = { node = 'front', http = '127.0.0.1:8080' },\n"
                "  replicas = { replica { model = m, tp_link = 'hier',\n"
                "    stages = { { nodes = { 'w0', 'w1' } } } } },\n"
                "}\n")
    want = ["sb4.lua: standby 's' and replica 1 stage 1's group, which links over two levels: a "
            "standby cannot take a rank's place in a two-level group yet"]
    exits_2(["serve", "-c", s, "--port", "0"], want)
    exits_2(["node", "-c", s, "--name", "w0", "-t", "1"], want)


def too_many_ranks(d):
    """tp over the model's heads: the plan (front, nodes, `cluster up`) refuses it once the model's
    shape is known, naming the stage; each rank's loader would refuse its slice too, naming the
    node (model/llama.h)."""
    names = [f"w{i}" for i in range(9)]
    s = write(d, "tp9.lua", "replica { model = m, stages = pipeline(m, { "
              + ", ".join(f"'{n}'" for n in names) + " }), tp = 9 }", nodes=names)
    want = ["tp9.lua: stage 1: a group of 9 ranks is more than the model's 8 attention heads"]
    exits_2(["serve", "-c", s, "--port", "0"], want)
    exits_2(["node", "-c", s, "--name", "w1", "-t", "1"], want)
    p = subprocess.run([su.shoal_binary(), "cluster", "up", s], cwd=su.ROOT,
                       stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       timeout=su.scaled(60))
    assert p.returncode == 2, f"exit {p.returncode}:\n{p.stdout[-2000:]}{p.stderr[-2000:]}"
    assert want[0] in p.stdout + p.stderr, (p.stdout + p.stderr)[-2000:]


def mixed_schemes(d):
    s = write(d, "mixed.lua", "replica { model = m, stages = { { nodes = { 'w0', 't' } } } }",
              nodes=("w0",), extra_nodes=", node { name = 't', listen = 'tcp://127.0.0.1:7391' }")
    exits_2(["serve", "-c", s, "--port", "0"],
            ["mixed.lua:5", "replica 1 stage 1: rank 0 'w0' listens on ipc://", "and rank 1 't' "
             "on tcp://127.0.0.1:7391: the ranks of a group exchange over one kind of link"])
    exits_2(["node", "-c", s, "--name", "t", "-t", "1"], ["mixed.lua:5", "rank 1 't'"])


def main():
    if not os.path.exists(STORIES):
        su.skip(f"{STORIES} missing")
    r = su.Runner("test_cluster_tp")
    d = tempfile.mkdtemp(prefix="shtp-", dir="/tmp")  # ipc:// paths stay short
    try:
        want = reference(STORIES, PROMPTS, 64, complete_lp0)
        r.case("stories260K: one stage of 2 ranks equals one process", group_equals, d, STORIES,
               "pipeline(m, { { 'w0', 'w1' } })", ["w0", "w1"], PROMPTS, 64, want, "s1x2")
        r.case("stories260K: one stage of 2 ranks over the network collective (tp_link = 'net', "
               "ipc://) equals one process", group_equals, d, STORIES,
               "pipeline(m, { { 'w0', 'w1' } }), tp_link = 'net'", ["w0", "w1"], PROMPTS, 64,
               want, "s1x2net", "net")
        key = os.path.join(d, "cluster.key")
        with open(key, "w") as f:
            f.write("tp-cluster-test-key-0123456789abcdef\n")
        os.chmod(key, 0o600)
        r.case("stories260K: a keyed cluster, one stage of 2 ranks over the network collective "
               "(each link proves the key) equals one process", group_equals, d, STORIES,
               "pipeline(m, { { 'w0', 'w1' } }), tp_link = 'net'", ["w0", "w1"], PROMPTS, 64,
               want, "s1x2key", "net", True, "  key_file = 'cluster.key',\n")
        want32 = reference(STORIES, PROMPTS[:4], 32, complete, "--kv-f32")
        r.case("stories260K: one stage of 2 ranks with kv.type = 'f32' within 1e-3 of one process "
               "with --kv-f32", group_equals, d, STORIES, "pipeline(m, { { 'w0', 'w1' } })",
               ["w0", "w1"], PROMPTS[:4], 32, want32, "s1x2f32", "shm", True, "",
               "memory = '32MiB', type = 'f32'", F32_KV_LP_TOL)
        r.case("a rank with another KV type is refused by name", other_kv_type, d)
        r.case("stories260K: 2 stages x 2 ranks (replica tp = 2) equal one process", group_equals,
               d, STORIES, "pipeline(m, { 'w0', 'w1', 'w2', 'w3' }), tp = 2",
               ["w0", "w1", "w2", "w3"], PROMPTS, 64, want, "s2x2")
        if os.path.exists(SMOLLM2):
            want_m = reference(SMOLLM2, PROMPTS, 32, complete_top)
            r.case("smollm2 (Q4_1): one stage of 2 ranks follows one process up to near-ties",
                   group_equals, d, SMOLLM2, "pipeline(m, { { 'w0', 'w1' } })", ["w0", "w1"],
                   PROMPTS, 32, want_m, "m1x2", "shm", False)
        else:
            su.log(f"note: {SMOLLM2} missing: the default model's case is skipped")
        r.case("a rank started with the ranks swapped is refused by name", swapped_rank, d)
        r.case("a rank with another model file is refused by name", other_model, d)
        r.case("a rank whose group links otherwise is refused by name", other_link, d)
        r.case("a rank whose group compresses otherwise is refused by name", other_compress, d)
        r.case("a rank killed under load: paused, restarted, regrouped, every text unchanged",
               rank_killed, d)
        r.case("rank 1 stopped 2 s under load: paused, resumed, every text unchanged",
               rank_stopped, d, "w1")
        r.case("the leader stopped 2 s under load: paused, resumed, every text unchanged",
               rank_stopped, d, "w0")
        r.case("tp of 0, negative, over 64, not a whole number, not dividing the nodes", bad_tp, d)
        r.case("a node named twice in a group", named_twice, d)
        r.case("tp_compress unknown, or without tp_link = 'net'", bad_compress, d)
        r.case("a standby as a rank, or beside a group that it could not join", standby_rank, d)
        r.case("ranks on URL schemes that differ", mixed_schemes, d)
        r.case("more ranks than the model has heads: refused by the front and by each rank",
               too_many_ranks, d)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    r.finish()


if __name__ == "__main__":
    main()
