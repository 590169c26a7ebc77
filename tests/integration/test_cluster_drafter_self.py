"""A replica's self-drafter on a node of its own (issue 27; docs/cluster.md, "Speculative
decoding"): replica{ drafter = { node = "d0", self = LAYERS } } drafts with the default model's
own first LAYERS layers and its output head, on a worker node that maps the model's file and
reads only those; `shoal serve -c` with a 2-stage pipeline on w0 and w1, against real processes
over ipc://.

(a) Greedy completions (8 prompts x 32 tokens, one by one and then all at once) through
    front -> d0 -> w0 -> w1 equal the same cluster's without a drafter (text, finish reason and
    token count; a request asking for logprobs is never drafted for, so the ids are compared in
    tests/api/test_engine_drafter.c); the drafter node's shoal_drafter_tokens_total and the
    front's shoal_spec_accepted_tokens_total move, and no answer failed to fit its drafts.
(b) Bad values, each an error line naming the script's line of the replica and exit 2 of the
    front: model and self both given, neither, self = 0, 2.5 or "x", and self = 30 (the model
    file has 30 layers: checked against the file by the cluster plan); `shoal node` on the
    drafter's node exits 2 with the same line for self = 30 and for both given.
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
import test_cluster_drafter as tcd  # noqa: E402  (PROMPTS, TOKENS, complete, compare)
import test_cluster_pipeline as tcp  # noqa: E402  (Node, front_exits)

LAYERS = 20     # of the default model's 30: drafts the target mostly accepts
REPLICA_LINE = 3  # the script's line of replica { ... } (errors name it)


def script(path, drafter=None):
    """front, w0 and w1 (the pipeline's stages) and, with drafter (the fields of replica{
    drafter = {...} } besides node), the drafter's node d0."""
    d = os.path.dirname(path)
    d0 = f",\n            node {{ name = 'd0', listen = 'ipc://{d}/d0.sock' }}" if drafter else ""
    dr = f",\n    drafter = {{ node = 'd0', {drafter} }}" if drafter else ""
    with open(path, "w") as f:
        f.write(f"local m = model {{ path = '{su.MODEL}', name = 'm' }}\n"
                "return cluster {\n"
                "  replicas = { replica { model = m, stages = pipeline(m, { 'w0', 'w1' })"
                f"{dr} }} }},\n"
                f"  nodes = {{ node {{ name = 'front', listen = 'ipc://{d}/front.sock' }},\n"
                f"            node {{ name = 'w0', listen = 'ipc://{d}/w0.sock' }},\n"
                f"            node {{ name = 'w1', listen = 'ipc://{d}/w1.sock' }}{d0} }},\n"
                "  gateway = { node = 'front', http = '127.0.0.1:8080' },\n"
                "  batcher = { max_seqs = 16, max_step_tokens = 512, spec_k = 4 },\n"
                "  kv = { memory = '32MiB' },\n"
                "}\n")
    with open(path) as f:
        assert "replica {" in f.read().splitlines()[REPLICA_LINE - 1]
    return path


def run(path, nodes, check):
    """Starts the worker nodes and the front on path, runs check(srv) and stops everything."""
    procs = [tcp.Node(path, n) for n in nodes]
    problems = []
    try:
        for nd in procs:
            nd.wait_ready()
        srv = su.start("-c", path, "--join-timeout", f"{su.scaled(60):g}", model=None)
        try:
            out = check(srv, procs)
        finally:
            problems += su.stop(srv)
    finally:
        for nd in procs:
            problems += nd.stop()
    assert not problems, "\n".join(problems)
    return out


def both_ways(srv):
    one = [tuple(tcd.complete(srv.url, p, tcd.TOKENS)) for p in tcd.PROMPTS]
    many = [tuple(r) for r in su.at_once(srv.url, tcd.PROMPTS, tcd.TOKENS, tcd.complete)]
    return one, many


def reference(d):
    def check(srv, procs):
        one, many = both_ways(srv)
        tcd.compare(one, many, "all at once (no drafter)")
        return one
    return run(script(os.path.join(d, "ref.lua")), ["w0", "w1"], check)


def equal_through_self_drafter(d, want):
    def check(srv, procs):
        log = procs[2].text()
        assert f"drafter of m (draft its layers [0, {LAYERS}) and head" in log, log[-1000:]
        one, many = both_ways(srv)
        tcd.compare(want, one, "one by one through the self-drafter")
        tcd.compare(want, many, "all at once through the self-drafter")
        n, acc = tcd.wait_drafted(srv.url, 0)
        assert n > 0, f"shoal_drafter_tokens_total{{node=\"d0\"}} = {n}"
        assert acc > 0, f"shoal_spec_accepted_tokens_total = {acc}"
        su.log(f"note: {n:.0f} tokens drafted on d0 by layers [0, {LAYERS}), {acc:.0f} accepted")
        bad = [ln for ln in srv.log_text().splitlines() if "step_answer_bad" in ln]
        assert not bad, "\n".join(bad[:5])
    path = script(os.path.join(d, "self.lua"), f"self = {LAYERS}")
    run(path, ["w0", "w1", "d0"], check)


def node_exits(path, want):
    p = subprocess.run([su.shoal_binary(), "node", "-c", path, "--name", "d0", "-t", "1"],
                       cwd=su.ROOT, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       timeout=su.scaled(60))
    assert p.returncode == 2, f"exit {p.returncode}, want 2:\n{p.stderr}"
    errs = [ln for ln in p.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errs) == 1, f"want one error line:\n{p.stderr}"
    for w in want:
        assert w in errs[0], f"{errs[0]!r} lacks {w!r}"


def bad_values(d):
    line = f"bad.lua:{REPLICA_LINE}:"
    exactly = "give exactly one of model"
    whole = "must be a whole number of layers"
    cases = [(f"model = '{su.MODEL}', self = 4", [line, exactly, "not both"]),
             ("", [line, exactly]),
             ("self = 0", [line, "self = 0", whole]),
             ("self = 2.5", [line, "self = 2.5", whole]),
             ("self = 'x'", [line, 'self = "x"', whole]),
             ("self = 30", [line, "drafter self = 30", "from 1 to 29", "has 30"])]
    for fields, want in cases:
        path = script(os.path.join(d, "bad.lua"), fields or "model = nil")
        tcp.front_exits(path, want)
        if fields in ("self = 30", cases[0][0]):
            node_exits(path, want)


def main():
    su.require_model()
    r = su.Runner("test_cluster_drafter_self")
    d = tempfile.mkdtemp(prefix="shds-", dir="/tmp")  # ipc:// paths stay short
    try:
        r.case("(b) bad drafter values exit 2 naming the line", bad_values, d)
        want = reference(d)
        r.case("(a) 2 stages + a self-drafter node == the same cluster without a drafter",
               equal_through_self_drafter, d, want)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    r.finish()


if __name__ == "__main__":
    main()
