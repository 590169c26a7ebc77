"""Tensor-parallel groups in cluster scripts (issue 26, docs/cluster.md "Tensor parallelism"),
against real processes: bad input to a group (tp of 0, negative or over 64, a node named twice in
a group, a standby as a rank, ranks on different URL schemes, a node count that tp does not
divide) ends `shoal serve -c`, `shoal node` and `shoal cluster up` with exit 2 and one `error:`
line naming the script's line and the culprit, never a hang.
"""

import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402
from test_cluster_bad import exits_2  # noqa: E402

STORIES = os.path.join(su.ROOT, "tests", "data", "stories260K", "stories260K.gguf")  # 5 layers


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
        r.case("tp of 0, negative, over 64, not a whole number, not dividing the nodes", bad_tp, d)
        r.case("a node named twice in a group", named_twice, d)
        r.case("a standby as a rank", standby_rank, d)
        r.case("ranks on URL schemes that differ", mixed_schemes, d)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    r.finish()


if __name__ == "__main__":
    main()
