"""Length-aware routing (issue 26, docs/cluster.md "Length-aware routing") against real processes:
a `shoal serve -c` front and `shoal node` workers over ipc://, one model (stories260K) with two
replicas, one of 1 rank (w0) and one whose stage is a tensor-parallel group of 2 ranks (w1+w2),
and a threshold of 16 prompt tokens.

Cases: short prompts land on the 1-rank replica and long ones on the tensor-parallel one
(shoal_router_routed_class_total, the status document and `shoal cluster status`), all at once,
every text equal to one process's; with a rank of the group killed, long prompts go to the 1-rank
replica and succeed (health is a veto), and the group serves again once the rank is back; the
script's route() overrides the rule (class script, every text equal to one process's); a route()
that raises, returns a string, an index of no replica or runs past its time limit falls back to
the rule, the request succeeds, the failures are counted and logged once; bad input (a negative
or non-integer long_prompt, a route that is not a function, an unknown routing field) ends
`shoal serve -c`, `shoal node` and `shoal cluster up` with exit 2 and one `error:` line.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402
from test_cluster_pipeline import Node  # noqa: E402
from test_cluster_tp import STORIES, Cluster, at_once, everywhere, reference, same  # noqa: E402

THRESHOLD = 16
N = 24  # tokens per completion
SHORT = ["Once upon a time", "The little dog", "A big red ball", "The sun was", "Mom said",
         "The cat"]
LONG = ["Once upon a time there was a little girl named Lily who loved to play outside in the "
        "big green park near her house",
        "The little dog ran across the garden and jumped over the fence because he wanted to "
        "find his friend the cat",
        "Tom and Sara went to the beach with their mom and dad and they built a big sand castle "
        "with a flag on top",
        "One day a bird flew into the kitchen and sat on the table, and the children laughed "
        "and gave it some bread"]
WORKERS = ["w0", "w1", "w2"]

ROUTE_INVERTED = """
    route = function(req, replicas)
      if req.max_tokens == 7 then error('boom') end
      if req.max_tokens == 9 then return 'garbage' end
      if req.max_tokens == 11 then return 42 end
      if req.max_tokens == 13 then while true do end end
      assert(req.model == 'm' and req.priority >= 0 and #replicas == 2)
      -- the rule inverted: long prompts to the replica of 1 rank, short ones to the group
      local want = req.prompt_tokens > 16 and 1 or 2
      for _, r in ipairs(replicas) do
        if r.tp == want and r.stages == 1 and r.healthy and r.load >= 0 then return r.index end
      end
    end,"""


def write(d, name, routing):
    """'front' plus w0..w2 over ipc:// in d: replica 0 on w0, replica 1 a group w1+w2; line 7
    holds the routing table (`routing`, Lua)."""
    path = os.path.join(d, name)
    ns = ", ".join(f"node {{ name = '{n}', listen = 'ipc://{d}/{n}.sock' }}"
                   for n in ["front"] + WORKERS)
    with open(path, "w") as f:
        f.write(f"local m = model {{ path = '{STORIES}', name = 'm' }}\n"
                "return cluster {\n"
                f"  nodes = {{ {ns} }},\n"
                "  gateway = { node = 'front', http = '127.0.0.1:8080' },\n"
                "  replicas = { replica { model = m, stages = pipeline(m, { 'w0' }) },\n"
                "               replica { model = m, stages = pipeline(m, { { 'w1', 'w2' } }) } },\n"
                f"  routing = {routing},\n"
                "  batcher = { max_seqs = 16, max_step_tokens = 512 },\n"
                "  kv = { memory = '32MiB' },\n"
                "}\n")
    return path


def prompt_tokens(url, prompt):
    status, parsed, raw = su.post_json(url, "/v1/completions", {
        "prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert status == 200, f"status {status}: {raw[:300]!r}"
    return parsed["usage"]["prompt_tokens"]


def classes(url):
    """{(replica, class): routed} from the front's /metrics."""
    out = {}
    for n, lb, v in su.parse_metrics(su.metrics(url)):
        if n == "shoal_router_routed_class_total":
            out[(lb["replica"], lb["class"])] = v
    return out


def delta(before, after):
    return {k: after.get(k, 0) - before.get(k, 0) for k in after
            if after.get(k, 0) != before.get(k, 0)}


def by_length(d, want):
    c = Cluster(write(d, "len.lua", f"{{ long_prompt = {THRESHOLD} }}"), WORKERS)
    try:
        c.start()
        url = c.srv.url
        n_short = [prompt_tokens(url, p) for p in SHORT]
        n_long = [prompt_tokens(url, p) for p in LONG]
        assert max(n_short) <= THRESHOLD < min(n_long), (n_short, n_long)
        before = classes(url)
        assert set(before) == {("0", "long"), ("0", "short"), ("1", "long"), ("1", "short")}, \
            before
        got = at_once(url, SHORT + LONG, N)
        moved = delta(before, classes(url))
        assert moved == {("0", "short"): len(SHORT), ("1", "long"): len(LONG)}, moved
        same(want, got, "length rule")
        # The status document and `shoal cluster status` show each replica's shape and the rule.
        status, _, raw = su.get(url, "/admin/cluster")
        assert status == 200, raw[:300]
        doc = json.loads(raw)
        assert [r["tp"] for r in doc["replicas"]] == [1, 2], doc["replicas"]
        assert doc["routing"] == {"long_prompt": THRESHOLD, "route": False}, doc["routing"]
        now = classes(url)
        for k, rep in enumerate(doc["replicas"]):
            bc = rep["router"]["routed_by_class"]
            assert bc == {"long": now[(str(k), "long")], "short": now[(str(k), "short")],
                          "script": 0}, (k, bc, now)
        p = subprocess.run([su.shoal_binary(), "cluster", "status", url], capture_output=True,
                           text=True, timeout=su.scaled(30))
        assert p.returncode == 0, p.stdout + p.stderr
        for s in ("tp 2 x 1", "tp 1 x 1", f"prompts over {THRESHOLD} tokens go to the "
                  "tensor-parallel replicas", "LONG/SHORT/SCRIPT"):
            assert s in p.stdout, f"{s!r} not in:\n{p.stdout}"
        # Health is a veto: with a rank of the group gone, long prompts go to replica 0.
        w2 = c.nodes["w2"]
        w2.proc.send_signal(signal.SIGKILL)
        w2.proc.wait()
        deadline = time.monotonic() + su.scaled(15)
        while su.metric(su.metrics(url), "shoal_router_healthy", replica="1") != 0:
            assert time.monotonic() < deadline, c.srv.log_tail()
            time.sleep(0.05)
        before = classes(url)
        got = at_once(url, LONG, N)
        moved = delta(before, classes(url))
        assert moved == {("0", "long"): len(LONG)}, moved
        same(want[len(SHORT):], got, "long prompts on the 1-rank replica")
        c.nodes["w2"] = Node(c.path, "w2").wait_ready()
        deadline = time.monotonic() + su.scaled(30)
        while su.metric(su.metrics(url), "shoal_router_healthy", replica="1") != 1:
            assert time.monotonic() < deadline, c.srv.log_tail()
            time.sleep(0.1)
        before = classes(url)
        got = at_once(url, LONG[:2], N)
        assert delta(before, classes(url)) == {("1", "long"): 2}
        same(want[len(SHORT):len(SHORT) + 2], got, "long prompts on the group again")
    finally:
        c.stop()


def by_script(d, want):
    c = Cluster(write(d, "script.lua", f"{{ long_prompt = {THRESHOLD},{ROUTE_INVERTED} }}"),
                WORKERS)
    try:
        c.start()
        url = c.srv.url
        text = su.metrics(url)
        assert su.metric(text, "shoal_router_route_errors_total") == 0, text
        before = classes(url)
        got = at_once(url, SHORT + LONG, N)
        moved = delta(before, classes(url))
        assert moved == {("1", "script"): len(SHORT), ("0", "script"): len(LONG)}, moved
        same(want, got, "route()")
        status, _, raw = su.get(url, "/admin/cluster")
        assert json.loads(raw)["routing"] == {"long_prompt": THRESHOLD, "route": True}, raw
        # Failures fall back to the rule: each request succeeds and is routed by length.
        before = classes(url)
        # (4 short prompts and 2 long ones, so that a rule inverted would show.)
        for mt in (7, 9, 11, 13):
            for prompt in (SHORT[0], LONG[0]) if mt < 11 else (SHORT[0],):
                status, parsed, raw = su.post_json(url, "/v1/completions", {
                    "prompt": prompt, "max_tokens": mt, "temperature": 0, "ignore_eos": True})
                assert status == 200, f"max_tokens {mt}: {status} {raw[:300]!r}"
                assert parsed["usage"]["completion_tokens"] == mt, parsed
        moved = delta(before, classes(url))
        assert moved == {("0", "short"): 4, ("1", "long"): 2}, moved
        assert su.metric(su.metrics(url), "shoal_router_route_errors_total") == 6
        log = c.srv.log_text()
        lines = [ln for ln in log.splitlines() if "event=route_failed" in ln]
        assert len(lines) == 1 and "boom" in lines[0], "\n".join(lines) or log[-2000:]
        # The state is still usable after the time limit: route() works again.
        before = classes(url)
        got = at_once(url, LONG[:1] + SHORT[:1], N)
        assert delta(before, classes(url)) == {("0", "script"): 1, ("1", "script"): 1}
        same([want[len(SHORT)], want[0]], got, "route() after its failures")
    finally:
        c.stop()


def bad_routing(d):
    s = write(d, "neg.lua", "{ long_prompt = -1 }")
    everywhere(s, ["neg.lua:2", "cluster.routing: field 'long_prompt' must be within "
                   "0..1073741824, got -1"])
    s = write(d, "flt.lua", "{ long_prompt = 1.5 }")
    everywhere(s, ["flt.lua:2", "cluster.routing: field 'long_prompt' must be an integer"])
    s = write(d, "fn.lua", "{ route = 'first' }")
    everywhere(s, ["fn.lua:2", "cluster.routing: field 'route' must be a function(req, "
                   "replicas), got string"])
    s = write(d, "unk.lua", "{ long_prompts = 10 }")
    everywhere(s, ["unk.lua:2", "long_prompts"])


def main():
    if not os.path.exists(STORIES):
        su.skip(f"{STORIES} missing")
    r = su.Runner("test_cluster_route")
    d = tempfile.mkdtemp(prefix="shrt-", dir="/tmp")  # ipc:// paths stay short
    try:
        want = reference(STORIES, SHORT + LONG, N)
        r.case("short prompts to the 1-rank replica, long ones to the tensor-parallel one; "
               "health a veto; texts equal one process", by_length, d, want)
        r.case("route() overrides the rule; its failures fall back and are counted", by_script,
               d, want)
        r.case("bad routing settings refused with one line", bad_routing, d)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    r.finish()


if __name__ == "__main__":
    main()
