"""GET /admin/status and the status page GET /admin/ against real processes (issue 12,
docs/cluster.md, "The status page"). The page in a browser is test_status_page.py.

Cases:
- a single-process `shoal serve -m` (no keys): /admin/status is a superset of /admin/cluster
  (every field of every node and replica), with the server's time, one node alive, no links, the
  replica serving with no router figures, the degradation level (null while no gauge exists)
  and an event list; /admin/ is one self-contained HTML page (no external script, style or
  image); POST is 405 on both; /admin is the page too.
- keys (--api-key): /admin/status needs the bearer key; /admin/ without one answers 401 with a
  form that asks for it, with ?key= (percent-encoded) or the header it is the page, a wrong key
  is 401; while draining (SIGTERM with a long stream in flight) both still answer 200.
- a real cluster under `shoal cluster up` (replica 1: w0 -> w1, replica 2: w2, a router):
  nodes alive, the links front -> w0, w0 -> w1, front -> w2 alive, the router's load and weight
  per replica; kill -9 of w1 (restarted 3 s later by a --bin wrapper): w1 dead, the link w0 -> w1
  dead, replica 1 paused or down while replica 2 serves; then everything alive and serving
  again, w1 with a reconnect and one death; the events list w1's death and replica 1's resume;
  the watchdog's heartbeat figures (round trip, RSS) for every worker.
"""

import base64
import hashlib
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import http.client
import threading
import time
import urllib.parse

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402
from test_cluster_pipeline import STORIES, script  # noqa: E402
from test_cluster_up import Cluster, no_process_left  # noqa: E402

KEY = "st@tus/k+y=1"  # percent-encoding matters in ?key=
HEALTH = ("alive", "joining", "dead")
EVENT_KINDS = {"dead", "alive", "paused", "resumed", "promoted", "restarted", "removed", "drain",
               "level", "policy", "fault"}


def auth(key=KEY):
    return {"Authorization": f"Bearer {key}"}


def get_doc(url, path="/admin/status", key=None):
    st, hdrs, body = su.get(url, path, headers=auth(key) if key else None, timeout=10)
    assert st == 200, f"GET {path}: {st} {body[:300]!r}"
    assert hdrs.get("content-type", "").startswith("application/json"), hdrs
    return json.loads(body)


def check_superset(cluster, status):
    """Every field /admin/cluster has, /admin/status has too, at the top, per node and per
    replica (values may move between the two requests: compare keys and the fixed fields)."""
    assert cluster["object"] == "shoal.cluster" and status["object"] == "shoal.status"
    missing = set(cluster) - set(status)
    assert not missing, f"/admin/status lacks {missing}"
    for what in ("nodes", "replicas"):
        assert len(cluster[what]) == len(status[what]), (cluster[what], status[what])
        for a, b in zip(cluster[what], status[what]):
            lack = set(a) - set(b)
            assert not lack, f"/admin/status {what} lack {lack}: {b}"
    for k in ("mode", "node", "model", "version"):
        assert cluster[k] == status[k], (k, cluster[k], status[k])
    for a, b in zip(cluster["nodes"], status["nodes"]):
        for k in ("name", "url", "role", "stages"):
            assert a[k] == b[k], (k, a, b)


def check_shape(doc):
    """The fields /admin/status adds, with their types (tools/cluster_status.h)."""
    now = time.time() * 1000
    assert isinstance(doc["time_unix_ms"], int) and abs(doc["time_unix_ms"] - now) < 10000, \
        (doc["time_unix_ms"], now)
    assert doc["health_source"] in ("links", "watchdog"), doc["health_source"]
    lv = doc["degradation"]["level"]
    assert lv is None or (isinstance(lv, int) and 0 <= lv <= 4), doc["degradation"]
    names = [n["name"] for n in doc["nodes"]]
    for n in doc["nodes"]:
        assert n["health"] in HEALTH, n
        assert n["heartbeat_rtt_ms"] is None or n["heartbeat_rtt_ms"] >= 0, n
        assert n["heartbeat_age_ms"] is None or n["heartbeat_age_ms"] >= 0, n
        assert (n["heartbeat_rtt_ms"] is None) == (n["heartbeat_age_ms"] is None), n
        assert n["rss_bytes"] is None or n["rss_bytes"] > 0, n
        assert isinstance(n["deaths"], int) and n["deaths"] >= 0, n
        if doc["health_source"] == "links":
            assert n["heartbeat_rtt_ms"] is None and n["rss_bytes"] is None, n
    for ln in doc["links"]:
        assert set(ln) == {"from", "to", "replica", "health"}, ln
        assert ln["from"] in names and ln["to"] in names and ln["health"] in HEALTH, ln
        assert 0 <= ln["replica"] < len(doc["replicas"]), ln
    for r in doc["replicas"]:
        assert r["state"] in ("serving", "paused", "down"), r
        if len(doc["replicas"]) == 1:
            assert r["load"] is None and r["weight"] is None, r
        else:
            assert isinstance(r["load"], int) and r["load"] >= 0, r
            assert isinstance(r["weight"], (int, float)) and r["weight"] > 0, r
            assert r["load"] == r["router"]["load"] and r["weight"] == r["router"]["weight"], r
    ev = doc["events"]
    assert isinstance(ev, list) and len(ev) <= 32 and doc["events_total"] >= len(ev), doc
    seqs = [e["seq"] for e in ev]
    assert seqs == sorted(seqs) and (not seqs or seqs[-1] == doc["events_total"]), seqs
    for e in ev:
        assert set(e) == {"seq", "unix_ms", "kind", "node", "replica", "msg"}, e
        assert e["kind"] in EVENT_KINDS and abs(e["unix_ms"] - now) < 3600e3, e
        assert e["node"] is None or e["node"] in names, e


def check_csp(hdrs, text):
    """The document's Content-Security-Policy allows exactly its own inline blocks, by SHA-256
    of their text, no other script or style source, fetches to its own origin only, and no
    framing; no inline style attribute or handler is left for the policy to block."""
    csp = hdrs.get("content-security-policy", "")
    assert hdrs.get("x-frame-options") == "DENY", hdrs
    assert hdrs.get("x-content-type-options") == "nosniff", hdrs
    rules = {r.split()[0]: r.split()[1:] for r in csp.split(";") if r.strip()}
    assert rules.get("default-src") == ["'none'"], csp
    assert rules.get("frame-ancestors") == ["'none'"], csp
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp, csp
    for tag, directive in (("script", "script-src"), ("style", "style-src")):
        blocks = re.findall(f"<{tag}>(.*?)</{tag}>", text, re.S)
        want = ["'sha256-" + base64.b64encode(hashlib.sha256(b.encode()).digest()).decode() + "'"
                for b in blocks]
        assert rules.get(directive, []) == want, (directive, rules.get(directive), want)
    assert not re.search(r"\sstyle=|\son[a-z]+=", text), "an inline attribute the CSP blocks"


def check_page(url, path="/admin/", key=None):
    """The page: 200, HTML, self-contained (no URL it would fetch but /admin/status), with a
    CSP that allows only its own inline blocks."""
    q = "?key=" + urllib.parse.quote(key, safe="") if key else ""
    st, hdrs, body = su.get(url, path + q, timeout=10)
    assert st == 200, f"GET {path}{q}: {st} {body[:300]!r}"
    assert hdrs.get("content-type", "").startswith("text/html"), hdrs
    assert hdrs.get("cache-control") == "no-store", hdrs
    text = body.decode()
    check_csp(hdrs, text)
    assert "connect-src 'self'" in hdrs["content-security-policy"], hdrs
    assert text.startswith("<!doctype html>") and "<svg id='topo'" in text, text[:200]
    low = text.lower()
    for bad in ("http://", "https://", "<link", "src=", "@import", "url(http"):
        # The SVG namespace is a name, not something fetched.
        assert low.replace("http://www.w3.org/2000/svg", "").count(bad) == 0, \
            f"the page refers to something outside itself: {bad}"
    return text


class KeyedStream(threading.Thread):
    """A long greedy stream of the default model with the key, read to its end."""

    def __init__(self, url):
        super().__init__(daemon=True)
        self.url, self.status, self.error = url, None, None
        self.first = threading.Event()

    def run(self):
        host, port = su._hostport(self.url)
        conn = http.client.HTTPConnection(host, port, timeout=120)
        try:
            conn.request("POST", "/v1/completions", body=json.dumps({
                "model": su.MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 4000,
                "temperature": 0, "logit_bias": {"0": -100, "2": -100}, "stream": True}),
                headers=dict(auth(), **{"Content-Type": "application/json"}))
            resp = conn.getresponse()
            self.status = resp.status
            resp.readline()  # the first event: the request is running
            self.first.set()
            resp.read()  # the rest, until the server ends it
        except Exception as exc:  # noqa: BLE001 - reported by the checks
            self.error = exc
        finally:
            self.first.set()
            conn.close()


def single_case():
    with su.server("-m", STORIES, "-t", "1", "--kv-mem", "32M", model=None) as srv:
        cluster, doc = get_doc(srv.url, "/admin/cluster"), get_doc(srv.url)
        check_superset(cluster, doc)
        check_shape(doc)
        assert doc["mode"] == "single" and [n["health"] for n in doc["nodes"]] == ["alive"], doc
        assert doc["links"] == [] and doc["replicas"][0]["state"] == "serving", doc
        assert doc["degradation"] == {"level": None} or doc["degradation"]["level"] == 0, doc
        check_page(srv.url)
        check_page(srv.url, "/admin")
        for path in ("/admin/status", "/admin/"):
            st, _, _ = su.request(srv.url, "POST", path, b"{}")
            assert st == 405, (path, st)
        st, _, _ = su.get(srv.url, "/admin/nothing")
        assert st == 404, st


def keys_and_drain():
    srv = su.start("--api-key", KEY, "--drain-timeout", 30)
    try:
        st, _, body = su.get(srv.url, "/admin/status")
        assert st == 401, (st, body[:200])
        st, _, _ = su.get(srv.url, "/admin/status", headers=auth("wrong"))
        assert st == 401, st
        check_shape(get_doc(srv.url, key=KEY))
        st, hdrs, body = su.get(srv.url, "/admin/")
        assert st == 401 and hdrs.get("content-type", "").startswith("text/html"), (st, hdrs)
        assert b"<form" in body and b"name='key'" in body, body[:300]
        check_csp(hdrs, body.decode())
        st, _, _ = su.get(srv.url, "/admin/?key=wrong")
        assert st == 401, st
        st, _, _ = su.get(srv.url, "/admin/?key=" + KEY)  # '+' unescaped is a space: wrong
        assert st == 401, st
        check_page(srv.url, key=KEY)
        st, _, body = su.get(srv.url, "/admin/", headers=auth())
        assert st == 200 and b"<svg id='topo'" in body, st

        # Draining: both still answer while a long stream keeps the server up.
        long_ = KeyedStream(srv.url)
        long_.start()
        assert long_.first.wait(30) and long_.status == 200, (long_.status, long_.error)
        srv.proc.send_signal(signal.SIGTERM)
        # The drain closes the connections idle at its start (one whose request is not read yet
        # among them), so ask only once the gateway logged it.
        deadline = time.monotonic() + 10
        while "event=draining" not in srv.log_text():
            assert time.monotonic() < deadline and srv.alive(), "no drain:\n" + srv.log_tail()
            time.sleep(0.02)
        assert su.get(srv.url, "/health", timeout=5)[0] == 503, "/health does not say draining"
        doc = get_doc(srv.url, key=KEY)
        check_shape(doc)
        check_page(srv.url, key=KEY)
        assert su.get(srv.url, "/health", timeout=5)[0] == 503, "drain ended during the checks"
        su.log(f"while draining: /admin/status and /admin/ answered; running "
               f"{doc['replicas'][0]['running']}")
        srv.proc.send_signal(signal.SIGINT)  # the second signal stops at once
        problems = su.stop(srv, already_sent=True)
        long_.join(30)
        assert not problems, "\n".join(problems)
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()


def delayed_restart_wrapper(d, node, delay_s):
    """A --bin wrapper for `cluster up`: node's second and later starts wait delay_s first, so
    the front sees it dead for that long."""
    w = os.path.join(d, "shoal-delayed.sh")
    mark = os.path.join(d, f"{node}.started")
    with open(w, "w") as f:
        f.write("#!/bin/sh\n"
                f'case " $* " in *" --name {node} "*)\n'
                f'  if [ -e "{mark}" ]; then sleep {delay_s}; fi; touch "{mark}";;\n'
                "esac\n"
                f'exec "{os.path.abspath(su.shoal_binary())}" "$@"\n')
    os.chmod(w, 0o755)
    return w


def wait_doc(url, what, cond, timeout):
    deadline = time.monotonic() + timeout
    while True:
        doc = get_doc(url, key=KEY)
        if cond(doc):
            return doc
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s: {json.dumps(doc)}"
        time.sleep(0.1)


def by_name(doc):
    return {n["name"]: n for n in doc["nodes"]}


def links_of(doc):
    return {(ln["from"], ln["to"]): ln["health"] for ln in doc["links"]}


def cluster_case(d):
    path = script(os.path.join(d, "st.lua"), STORIES, ["w0", "w1", "w2"],
                  replicas=[["w0", "w1"], ["w2"]])
    c = Cluster(path, "--bin", delayed_restart_wrapper(d, "w1", 3),
                serve=("--port", "0", "--api-key", KEY))
    try:
        url = c.wait_for("'cluster: up' line", c.ups, 90)[0]
        doc = wait_doc(url, "every node alive", lambda x: all(
            n["health"] == "alive" for n in x["nodes"]), 30)
        check_superset(get_doc(url, "/admin/cluster", key=KEY), doc)
        check_shape(doc)
        assert doc["mode"] == "cluster" and [n["name"] for n in doc["nodes"]] == [
            "front", "w0", "w1", "w2"], doc["nodes"]
        assert links_of(doc) == {("front", "w0"): "alive", ("w0", "w1"): "alive",
                                 ("front", "w2"): "alive"}, doc["links"]
        assert [r["state"] for r in doc["replicas"]] == ["serving", "serving"], doc["replicas"]
        # The watchdog's heartbeats: every worker answers with its round trip and RSS.
        assert doc["health_source"] == "watchdog", doc["health_source"]
        doc = wait_doc(url, "heartbeats from every worker", lambda x: all(
            n["rss_bytes"] for n in x["nodes"] if n["role"] == "worker"), 10)
        for n in doc["nodes"]:
            if n["role"] == "worker":
                assert 0 <= n["heartbeat_rtt_ms"] < 1000 and n["heartbeat_age_ms"] < 2000, n
                assert 1 << 20 < n["rss_bytes"] < 1 << 34 and n["deaths"] == 0, n
            else:
                assert n["heartbeat_rtt_ms"] is None and n["rss_bytes"] is None, n
        for i in range(4):
            st, _, raw = su.post_json(url, "/v1/completions", {
                "prompt": f"Once upon a time {i}", "max_tokens": 8, "temperature": 0},
                headers=auth(), timeout=60)
            assert st == 200, raw[:300]
        doc = get_doc(url, key=KEY)
        assert sum(r["router"]["routed"] for r in doc["replicas"]) >= 4, doc["replicas"]

        os.kill(c.pids()["w1"][-1], signal.SIGKILL)
        t0 = time.monotonic()
        doc = wait_doc(url, "w1 dead", lambda x: by_name(x)["w1"]["health"] == "dead", 5)
        t_dead = time.monotonic() - t0
        check_shape(doc)
        n = by_name(doc)
        assert n["w0"]["health"] == "alive" and n["w2"]["health"] == "alive", doc["nodes"]
        assert links_of(doc) == {("front", "w0"): "alive", ("w0", "w1"): "dead",
                                 ("front", "w2"): "alive"}, doc["links"]
        doc = wait_doc(url, "replica 1 out of service",
                       lambda x: x["replicas"][0]["state"] != "serving", 5)
        assert doc["replicas"][1]["state"] == "serving", doc["replicas"]
        # Replica 2 serves meanwhile.
        st, _, raw = su.post_json(url, "/v1/completions", {
            "prompt": "The cat", "max_tokens": 8, "temperature": 0}, headers=auth(), timeout=60)
        assert st == 200, raw[:300]

        doc = wait_doc(url, "w1 back and replica 1 serving", lambda x: by_name(x)["w1"][
            "health"] == "alive" and x["replicas"][0]["state"] == "serving", 30)
        t_back = time.monotonic() - t0
        check_shape(doc)
        w1 = by_name(doc)["w1"]
        assert w1["reconnects"] >= 1 and w1["deaths"] == 1, doc["nodes"]
        assert set(links_of(doc).values()) == {"alive"}, doc["links"]
        # The front's log of faults and recoveries: w1 died, replica 1 paused, then resumed.
        kinds = [(e["kind"], e["node"], e["replica"]) for e in doc["events"]]
        assert ("dead", "w1", None) in kinds and ("resumed", "w1", 0) in kinds, kinds
        assert kinds.index(("dead", "w1", None)) < kinds.index(("resumed", "w1", 0)), kinds
        assert not any(e[1] in ("w0", "w2") for e in kinds if e[0] == "dead"), kinds
        su.log(f"note: w1 dead on /admin/status {t_dead:.2f} s after kill -9, alive and replica "
               f"1 serving {t_back:.2f} s after; {doc['events_total']} events logged")
        c.proc.send_signal(signal.SIGTERM)
        rc = c.wait_exit(60)
        assert rc == 0, f"cluster up exited {rc}:\n{c.text()[-3000:]}"
        no_process_left(c.sid, 5)
        os.unlink(c.logpath)
    finally:
        c.kill()


def main():
    if not os.path.exists(STORIES):
        su.skip(f"{STORIES} missing")
    r = su.Runner("test_admin_status")
    d = tempfile.mkdtemp(prefix="shas-", dir="/tmp")  # ipc:// paths stay short
    try:
        r.case("single process: /admin/status shape, superset of /admin/cluster; the page",
               single_case)
        if os.path.exists(su.MODEL):
            r.case("keys: bearer for the JSON, ?key= or a form for the page; both while draining",
                   keys_and_drain)
        else:
            su.log(f"note: {su.MODEL} missing: keys and drain case not run")
        r.case("cluster up, 2 replicas: health, links, load; kill -9 of a worker: dead, healed",
               cluster_case, d)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    r.finish()


if __name__ == "__main__":
    main()
