"""The front's /metrics carries every node's series with a node label (issue 11, docs/cluster.md,
"Metrics of every node"), against real processes: a 2-stage stories260K cluster over ipc://
(two `shoal node` workers, a `shoal serve -c` front). Workers report over the transport every
second; the front is never told to scrape anything.

Checks: the whole exposition is valid Prometheus text (a strict parser: HELP and TYPE once per
family, every sample under its family, label syntax, no label or series twice, histograms
cumulative with _count equal to the +Inf bucket); both workers' series arrive with node="w0" /
node="w1" (their runtime's own `node` label kept as exported_node); the first stage's
shoal_act_bytes_total{layer="2",dtype="f32",node="w0"} grows with the completions served;
shoal_node_metrics_age_seconds stays below a few seconds for a live worker and grows for a
stopped one (SIGSTOP) while the other's stays fresh, then recovers after SIGCONT; nothing is
refused (shoal_node_metrics_rejected_total 0); the front's own series keep their labels.
"""

import os
import re
import shutil
import signal
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402
from test_cluster_pipeline import STORIES, Node, script  # noqa: E402

NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
SAMPLE_RE = re.compile(rf"^({NAME})(\{{.*\}})? (\S+)$")
LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"')


def parse_labels(text, line):
    """'{a="1",b="2"}' -> [(a, 1), (b, 2)], refusing anything malformed."""
    if not text:
        return []
    body, out, pos = text[1:-1], [], 0
    while pos < len(body):
        m = LABEL_RE.match(body, pos)
        assert m, f"bad label set at {body[pos:pos + 40]!r}: {line!r}"
        out.append((m.group(1), m.group(2)))
        pos = m.end()
        if pos < len(body):
            assert body[pos] == "," and pos + 1 < len(body), f"bad separator: {line!r}"
            pos += 1
    names = [k for k, _ in out]
    assert len(names) == len(set(names)), f"a label twice: {line!r}"
    return out


def parse_strict(text):
    """Parses Prometheus text format 0.0.4 strictly; returns {family: (type, [(name, labels dict,
    value)])}. Raises AssertionError naming the first problem."""
    fams, cur, seen = {}, None, set()
    helped = set()
    hist = {}  # (family, labels without le) -> [last cumulative, +Inf count or None]
    assert text.endswith("\n"), "the text must end with a newline"
    for line in text.split("\n")[:-1]:
        if line.startswith("# HELP "):
            name = line.split(" ")[2]
            assert re.fullmatch(NAME, name), f"bad family name: {line!r}"
            assert name not in helped and name not in fams, f"HELP twice for {name}"
            helped.add(name)
            cur = None
            continue
        if line.startswith("# TYPE "):
            parts = line.split(" ")
            assert len(parts) == 4, f"bad TYPE line: {line!r}"
            name, typ = parts[2], parts[3]
            assert name not in fams, f"TYPE twice for {name}"
            assert typ in ("counter", "gauge", "histogram"), f"unknown type: {line!r}"
            fams[name] = (typ, [])
            cur = name
            continue
        assert line and not line.startswith("#"), f"unexpected line: {line!r}"
        m = SAMPLE_RE.match(line)
        assert m, f"bad sample line: {line!r}"
        name, labels = m.group(1), parse_labels(m.group(2), line)
        value = float(m.group(3))  # accepts +Inf, -Inf, NaN as Prometheus writes them
        assert cur, f"a sample before any TYPE: {line!r}"
        typ = fams[cur][0]
        lab = dict(labels)
        if typ == "histogram":
            suffix = name[len(cur):] if name.startswith(cur) else None
            assert suffix in ("_bucket", "_sum", "_count"), f"not of {cur}: {line!r}"
            base = tuple(sorted((k, v) for k, v in labels if k != "le"))
            if suffix == "_bucket":
                assert "le" in lab, f"a bucket without le: {line!r}"
                st = hist.setdefault((cur, base), [0.0, None])
                assert value >= st[0], f"buckets not cumulative: {line!r}"
                st[0] = value
                if lab["le"] == "+Inf":
                    st[1] = value
            elif suffix == "_count":
                st = hist.get((cur, base))
                assert st and st[1] == value, f"_count is not the +Inf bucket: {line!r}"
        else:
            assert name == cur, f"a sample outside its family {cur}: {line!r}"
        key = (name, tuple(sorted(labels)))
        assert key not in seen, f"a series twice: {line!r}"
        seen.add(key)
        fams[cur][1].append((name, lab, value))
    assert set(fams) == helped, f"HELP without TYPE: {helped - set(fams)}"
    return fams


def value(fams, name, **labels):
    """The value of the one sample named name whose labels include labels, or None."""
    fam = name
    for suf in ("_bucket", "_sum", "_count"):
        if name.endswith(suf) and name[:-len(suf)] in fams:
            fam = name[:-len(suf)]
    vals = [v for n, lb, v in fams.get(fam, (None, []))[1]
            if n == name and all(lb.get(k) == x for k, x in labels.items())]
    assert len(vals) <= 1, f"{name} {labels}: {len(vals)} samples"
    return vals[0] if vals else None


def scrape(url):
    st, hdrs, body = su.request(url, "GET", "/metrics")
    assert st == 200, f"GET /metrics: {st}"
    assert hdrs.get("content-type", "").startswith("text/plain"), hdrs
    return parse_strict(body.decode("utf-8"))


def wait_for(url, what, cond, timeout=10.0):
    """Scrapes until cond(fams) is true; returns those fams."""
    deadline = time.monotonic() + timeout
    while True:
        fams = scrape(url)
        if cond(fams):
            return fams
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.2)


def complete(url, prompt, n):
    st, parsed, raw = su.post_json(url, "/v1/completions", {
        "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}, timeout=120)
    assert st == 200, f"status {st}: {raw[:300]!r}"
    return parsed


def reported(fams, node):
    return (value(fams, "shoal_node_metrics_reports_total", node=node) or 0) >= 1


def check(srv, nodes):
    url = srv.url
    fams = wait_for(url, "a report from both workers",
                    lambda f: reported(f, "w0") and reported(f, "w1"))
    # Each worker's runtime series, with its own node="<id>" kept as exported_node.
    for name, nid in (("w0", "2"), ("w1", "3")):
        v = value(fams, "shoal_msgs_sent_total", node=name, exported_node=nid)
        assert v is not None, f"no shoal_msgs_sent_total of {name}"
        assert value(fams, "shoal_actors", node=name) is not None, name
        assert value(fams, "shoal_node_metrics_rejected_total", node=name) == 0
        assert value(fams, "shoal_node_metrics_skipped_total", node=name) == 0
    # The front's own series keep their labels (node="1" is the front's runtime).
    assert value(fams, "shoal_msgs_sent_total", node="1") is not None
    assert "shoal_requests_running" in fams
    assert fams["shoal_act_bytes_total"][0] == "counter"
    # Stage 1 (w0, layers [0, 2)) sends ACT to stage 2, whose first layer is 2; the last stage
    # sends none.
    act0 = value(fams, "shoal_act_bytes_total", node="w0", layer="2", dtype="f32")
    assert act0 is not None, [s for s in fams["shoal_act_bytes_total"][1]]
    assert value(fams, "shoal_act_bytes_total", node="w1") is None
    hid0 = value(fams, "shoal_act_hidden_bytes_total", node="w0", layer="2", dtype="f32")

    for p in ("Once upon a time", "The little dog", "Lily went"):
        complete(url, p, 8)
    # Three prompts x 8 tokens through the pipeline: every step sends at least one row of 64
    # F32 values (256 bytes) from w0 to w1; the next report shows it.
    fams = wait_for(url, "shoal_act_bytes_total of w0 growing",
                    lambda f: (value(f, "shoal_act_hidden_bytes_total", node="w0", layer="2",
                                     dtype="f32") or 0) >= hid0 + 3 * 8 * 256)
    act1 = value(fams, "shoal_act_bytes_total", node="w0", layer="2", dtype="f32")
    hid1 = value(fams, "shoal_act_hidden_bytes_total", node="w0", layer="2", dtype="f32")
    assert act1 > act0 and act1 - act0 >= hid1 - hid0, (act0, act1, hid0, hid1)
    su.log(f"note: w0 sent {act1 - act0:.0f} ACT bytes ({hid1 - hid0:.0f} hidden) for 3 x 8 "
           "tokens")
    for name in ("w0", "w1"):
        age = value(fams, "shoal_node_metrics_age_seconds", node=name)
        assert age is not None and 0 <= age < 3, f"age of {name}: {age}"

    # A stopped worker stops reporting: its age grows while the other's stays fresh.
    w1 = [nd for nd in nodes if nd.name == "w1"][0]
    os.kill(w1.proc.pid, signal.SIGSTOP)
    try:
        fams = wait_for(url, "w1's age past 3 s while stopped",
                        lambda f: value(f, "shoal_node_metrics_age_seconds", node="w1") > 3)
        assert value(fams, "shoal_node_metrics_age_seconds", node="w0") < 2.5, fams[
            "shoal_node_metrics_age_seconds"]
    finally:
        os.kill(w1.proc.pid, signal.SIGCONT)
    wait_for(url, "w1's age back under 2 s after SIGCONT",
             lambda f: value(f, "shoal_node_metrics_age_seconds", node="w1") < 2)
    fams = scrape(url)
    for name in ("w0", "w1"):
        assert value(fams, "shoal_node_metrics_rejected_total", node=name) == 0


def checker_refuses():
    """The parser must refuse what it is there to catch."""
    bad = ["# HELP a x\n# TYPE a counter\na 1\n# HELP a x\n# TYPE a counter\na 2\n",
           "# HELP a x\n# TYPE a counter\na{b=\"1\",b=\"2\"} 1\n",
           "# HELP a x\n# TYPE a counter\na{b=\"1\"} 1\na{b=\"1\"} 2\n",
           "# HELP a x\n# TYPE a counter\nb 1\n",
           "# HELP a x\n# TYPE a counter\na{b=1} 1\n",
           "# HELP h x\n# TYPE h histogram\nh_bucket{le=\"+Inf\"} 2\nh_sum 1\nh_count 1\n"]
    for text in bad:
        try:
            parse_strict(text)
        except AssertionError:
            continue
        raise AssertionError(f"the parser accepted {text!r}")
    parse_strict("# HELP a x\n# TYPE a gauge\na{b=\"1\"} +Inf\n")


def cluster_case(d):
    # w1 is stopped for over 3 s below: a watchdog that waits 10 s (100 missed beats) before it
    # judges w1 dead keeps the front (no --recover-timeout) from stopping meanwhile.
    path = script(os.path.join(d, "m.lua"), STORIES, ["w0", "w1"],
                  extra="  watchdog = { dead_after = 100 },\n")
    nodes = [Node(path, w) for w in ("w0", "w1")]
    problems = []
    try:
        for nd in nodes:
            nd.wait_ready()
        srv = su.start("-c", path, model=None)
        try:
            check(srv, nodes)
        finally:
            problems += su.stop(srv)
    finally:
        for nd in nodes:
            if nd.proc.poll() is None:
                os.kill(nd.proc.pid, signal.SIGCONT)
            problems += nd.stop()
    assert not problems, "\n".join(problems)


def main():
    if not os.path.exists(STORIES):
        su.skip(f"{STORIES} missing")
    r = su.Runner("test_cluster_metrics")
    d = tempfile.mkdtemp(prefix="shcm-", dir="/tmp")  # ipc:// paths stay short
    try:
        r.case("the strict exposition parser refuses bad text", checker_refuses)
        r.case("2-stage cluster: every node's series on the front's /metrics", cluster_case, d)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    r.finish()


if __name__ == "__main__":
    main()
