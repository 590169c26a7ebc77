"""The degradation ladder under real load (issue 12's acceptance; docs/serving.md, "Degradation"):
a cluster front over two workers, 'b' serving the default SmolLM2 as "smollm2" (the main model)
and 'a' serving stories260K as "stories" (the light one, `fallback = 'stories'`), with a policy
script whose levels follow the number of requests in the batchers (4, 8, 12, 16 for levels 1 to
4). The test opens and closes long greedy streams to move the load (sixteen at once under a
policy that answers 0, then the ladder reloaded: POST /admin/policy/reload on the front), and
checks at every level:

- level 1: a request for logprobs is served without them (X-Shoal-Degraded: logprobs);
- level 2: max_tokens is capped at degrade_max_tokens (4 tokens, finish_reason "length");
- level 3: a request for smollm2 is answered by stories (the response's model, the header);
- level 4: a request of priority 1 gets 503 with Retry-After; priority 0 is still served;
- back down one level per step, each drop only after hold_s (2 s) of lower answers: measured
  from when the load went down, and as the front's log line says ("below for 2.x s");
- shoal_degradation_level on /metrics at every step, the counters by effect, one log line per
  change naming the metrics (requests=..., the watchdog's nodes_dead and node_rss_max_mb), one
  "level" event per change in GET /admin/status, and the load streams never degraded.
"""

import json
import os
import re
import socket
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402
from test_cluster_pipeline import Node  # noqa: E402

STORIES = os.path.join(su.ROOT, "tests", "data", "stories260K", "stories260K.gguf")
HOLD = 2.0
LOG_TAIL = None  # the front's log tail, for failure messages
D = None  # the directory of the script and the policy
POLICY = """-- Levels by the requests the batchers hold (waiting + running), 4 per level.
function level(m)
  local n = m.requests
  if n >= 16 then return 4 end
  if n >= 12 then return 3 end
  if n >= 8 then return 2 end
  if n >= 4 then return 1 end
  return 0
end
"""


def write(path, text):
    with open(path, "w") as f:
        f.write(text)
    return path


def script(d):
    write(os.path.join(d, "ladder.lua"), POLICY)
    return write(os.path.join(d, "cluster.lua"), f"""
local s = model {{ path = '{STORIES}', name = 'stories' }}
local m = model {{ path = '{su.MODEL}', name = 'smollm2' }}
return cluster {{
  nodes = {{ node {{ name = 'front', listen = 'ipc://{d}/front.sock' }},
            node {{ name = 'a', listen = 'ipc://{d}/a.sock' }},
            node {{ name = 'b', listen = 'ipc://{d}/b.sock' }} }},
  gateway = {{ node = 'front', http = '127.0.0.1:8080' }},
  replicas = {{ replica {{ model = m, stages = pipeline(m, {{ 'b' }}) }},
               replica {{ model = s, stages = pipeline(s, {{ 'a' }}) }} }},
  batcher = {{ max_seqs = 32, max_step_tokens = 512 }},
  kv = {{ memory = '512MiB' }},
  watchdog = {{ policy = 'ladder.lua', hold_s = {HOLD}, degrade_max_tokens = 4,
               fallback = 'stories', shed_priority = 1,
               dead_after = 100 }}, -- 10 s: a busy CI machine must not lose a worker here
}}
""")


class Streams:
    """Long greedy streams to smollm2 on raw sockets: opened together (every request is written
    before any is read, so the ladder sees them arrive at once), read by one thread each, and
    closed from the client side (the gateway cancels them)."""

    def __init__(self, url):
        self.host, self.port = su._hostport(url)
        self.socks = []
        self.headers = []  # the response head of each stream, once read
        self.lock = threading.Lock()

    def open(self, n):
        body = json.dumps({"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 3000,
                           "ignore_eos": True, "stream": True, "temperature": 0}).encode()
        req = (f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
               ).encode() + body
        new = [socket.create_connection((self.host, self.port), timeout=su.scaled(30))
               for _ in range(n)]
        for s in new:
            s.sendall(req)
        for s in new:
            threading.Thread(target=self._read, args=(s,), daemon=True).start()
        self.socks += new

    def _read(self, s):
        head, done = b"", False
        try:
            while True:
                data = s.recv(65536)
                if not data:
                    break
                if not done:
                    head += data
                    if b"\r\n\r\n" in head:
                        with self.lock:
                            self.headers.append(head.split(b"\r\n\r\n")[0].decode("latin-1"))
                        done = True
        except OSError:
            pass

    def close(self, n):
        for s in self.socks[-n:]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self.socks = self.socks[:-n]

    def close_all(self):
        self.close(len(self.socks))


def level(url):
    return su.metric(su.metrics(url), "shoal_degradation_level")


def wait_level(url, want, timeout):
    """Polls until the level is `want`; timeout: seconds, through su.scaled()."""
    timeout = su.scaled(timeout)
    deadline = time.monotonic() + timeout
    while True:
        got = level(url)
        if got == want:
            return time.monotonic()
        if time.monotonic() > deadline:
            text = su.metrics(url)
            raise AssertionError(f"shoal_degradation_level {got}, want {want} within {timeout} s "
                                 f"(requests waiting {su.metric(text, 'shoal_requests_waiting')}, "
                                 f"running {su.metric(text, 'shoal_requests_running')})"
                                 + (f"\n--- front log ---\n{LOG_TAIL()}" if LOG_TAIL else ""))
        time.sleep(0.05)


def probe(url, **kw):
    body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 8,
            "ignore_eos": True, "temperature": 0}
    body.update(kw)
    st, hdrs, raw = su.request(url, "POST", "/v1/completions", body, timeout=120)
    return st, hdrs, raw


def drop(srv, url, streams, n, want, frm):
    """Closes n streams and checks the level goes from `frm` to `want` only after HOLD."""
    t0 = time.monotonic()
    streams.close(n)
    time.sleep(HOLD * 0.6)
    got = level(url)
    assert got == frm, f"level {got} {HOLD * 0.6:.1f} s after the load dropped, want {frm} held"
    t1 = wait_level(url, want, timeout=HOLD + 15)
    assert t1 - t0 >= HOLD - 0.05, f"{frm} -> {want} after {t1 - t0:.2f} s < hold {HOLD} s"
    m = re.findall(rf"from={frm} to={want} why=\"below for ([0-9.]+) s\"", srv.log_text())
    assert m and float(m[-1]) >= HOLD, f"no drop line {frm} -> {want} after >= {HOLD} s: {m}"


def run(srv, r):
    url = srv.url
    streams = Streams(url)

    def level0():
        assert level(url) == 0
        st, hdrs, raw = probe(url, logprobs=1)
        assert st == 200, raw
        assert "x-shoal-degraded" not in hdrs, hdrs
        doc = json.loads(raw)
        assert doc["model"] == "smollm2" and doc["choices"][0]["logprobs"], doc
    r.case("level 0: served as asked", level0)

    def up_1_2():
        streams.open(4)
        wait_level(url, 1, timeout=30)
        st, hdrs, raw = probe(url, logprobs=1)
        assert st == 200, raw
        assert hdrs.get("x-shoal-degraded") == "logprobs", hdrs
        doc = json.loads(raw)
        assert doc["model"] == "smollm2" and doc["choices"][0]["logprobs"] is None, doc
        assert doc["usage"]["completion_tokens"] == 8, doc
        streams.open(4)  # opened at level 1: not capped
        wait_level(url, 2, timeout=30)
        st, hdrs, raw = probe(url, max_tokens=40)
        assert st == 200, raw
        assert hdrs.get("x-shoal-degraded") == "max_tokens=4", hdrs
        doc = json.loads(raw)
        assert doc["usage"]["completion_tokens"] == 4, doc
        assert doc["choices"][0]["finish_reason"] == "length", doc
        drop(srv, url, streams, 8, 0, 2)
    r.case("up to 1 and 2 under load, then back to 0 after the hold", up_1_2)

    def up_4_and_down():
        # Sixteen streams at once: with the ladder live, the first ones counted could raise the
        # level before the last ones are parsed (and cap them). So the policy answers 0 while
        # they arrive, and the ladder is reloaded once all sixteen are in the batchers.
        write(os.path.join(D, "ladder.lua"), "function level(m) return 0 end\n")
        st, _, raw = su.post_json(url, "/admin/policy/reload", b"")
        assert st == 200, raw
        text0 = su.metrics(url)
        capped0 = su.metric(text0, "shoal_degraded_requests_total", effect="max_tokens")
        streams.open(16)
        deadline = time.monotonic() + su.scaled(30)
        while True:
            text = su.metrics(url)
            n = su.metric(text, "shoal_requests_waiting") + su.metric(text, "shoal_requests_running")
            if n >= 16:
                break
            assert time.monotonic() < deadline, f"only {n} of 16 streams reached the batchers"
            time.sleep(0.05)
        assert level(url) == 0
        write(os.path.join(D, "ladder.lua"), POLICY)
        st, parsed, raw = su.post_json(url, "/admin/policy/reload", b"")
        assert st == 200 and parsed["status"] == "reloaded", raw
        wait_level(url, 4, timeout=30)
        capped = su.metric(su.metrics(url), "shoal_degraded_requests_total", effect="max_tokens")
        assert capped == capped0, "a load stream was capped: it reached the gateway too late"
        st, hdrs, raw = probe(url, priority=1)
        su.check_error(st, json.loads(raw), raw, 503, "overloaded", "priority 1 at level 4")
        assert hdrs.get("retry-after") == "2" and hdrs.get("x-shoal-degraded") == "shed", hdrs
        st, hdrs, raw = probe(url, max_tokens=40)  # priority 0: served, by the light model
        assert st == 200, raw
        assert hdrs.get("x-shoal-degraded") == "max_tokens=4, model=stories", hdrs
        doc = json.loads(raw)
        assert doc["model"] == "stories" and doc["usage"]["completion_tokens"] == 4, doc
        drop(srv, url, streams, 4, 3, 4)  # 12 requests
        st, hdrs, raw = probe(url, priority=1, max_tokens=3)  # not shed at 3
        assert st == 200, raw
        assert hdrs.get("x-shoal-degraded") == "model=stories", hdrs
        assert json.loads(raw)["model"] == "stories"
        drop(srv, url, streams, 4, 2, 3)  # 8
        st, hdrs, raw = probe(url, max_tokens=40)
        assert st == 200 and json.loads(raw)["model"] == "smollm2", raw
        assert hdrs.get("x-shoal-degraded") == "max_tokens=4", hdrs
        drop(srv, url, streams, 4, 1, 2)  # 4
        st, hdrs, raw = probe(url, logprobs=1)
        assert st == 200, raw
        assert hdrs.get("x-shoal-degraded") == "logprobs", hdrs
        doc = json.loads(raw)
        assert doc["model"] == "smollm2" and doc["usage"]["completion_tokens"] == 8, doc
        drop(srv, url, streams, 4, 0, 1)
        st, hdrs, raw = probe(url, logprobs=1, priority=1)
        assert st == 200 and "x-shoal-degraded" not in hdrs, (hdrs, raw)
    r.case("burst to 4, then down one level at a time", up_4_and_down)

    def observed():
        text = su.metrics(url)
        for eff in ("logprobs", "max_tokens", "fallback", "shed"):
            v = su.metric(text, "shoal_degraded_requests_total", effect=eff)
            assert v and v >= 1, f"shoal_degraded_requests_total{{effect={eff}}} = {v}"
        log = srv.log_text()
        changes = re.findall(r"event=degradation_level from=(\d) to=(\d) .* requests=(\d+)", log)
        tos = [int(t) for _, t, _ in changes]
        assert tos == [1, 2, 0, 4, 3, 2, 1, 0], f"level changes {tos}"
        ups = [(int(f), int(t), int(n)) for f, t, n in changes if int(t) > int(f)]
        for f, t, n in ups:  # the log names the metrics that caused it
            assert n >= 4 * t, (f, t, n)
        # The watchdog's view reaches the policy: no worker dead, their RSS from the heartbeats.
        rss = re.findall(r"event=degradation_level .* nodes_dead=0 node_rss_max_mb=([0-9.]+)", log)
        assert len(rss) == len(changes) and all(float(x) > 10 for x in rss), rss
        # Each change is an event "level" in the front's ring, and /admin/status has the level.
        st, _, body = su.get(url, "/admin/status")
        assert st == 200, body
        doc = json.loads(body)
        assert doc["degradation"]["level"] == 0, doc["degradation"]
        levels = [e["msg"][:6] for e in doc["events"] if e["kind"] == "level"]
        assert levels == ["0 -> 1", "1 -> 2", "2 -> 0", "0 -> 4", "4 -> 3", "3 -> 2", "2 -> 1",
                          "1 -> 0"], levels
        with streams.lock:
            heads = list(streams.headers)
        assert len(heads) >= 8, len(heads)  # a stream closed before its first token has none
        assert not [h for h in heads if "X-Shoal-Degraded" in h], "a load stream was degraded"
    r.case("metrics, log lines and undegraded load", observed)
    streams.close_all()


def main():
    su.require_model()
    if not os.path.exists(STORIES):
        su.skip(f"{STORIES} missing")
    r = su.Runner("cluster_degrade")
    global D
    d = D = tempfile.mkdtemp(prefix="shoal-cdeg-")
    path = script(d)
    nodes, srv, problems = [], None, []
    try:
        nodes = [Node(path, "a"), Node(path, "b")]
        for nd in nodes:
            nd.wait_ready()
        srv = su.start("-c", path, "--join-timeout", "60", model=None)
        r.srv = srv
        global LOG_TAIL
        LOG_TAIL = lambda: "\n".join(ln for ln in srv.log_tail(400).splitlines()
                                     if "degradation_level" not in ln)[-3000:]
        assert "degradation policy " + os.path.join(d, "ladder.lua") in srv.log_text()
        run(srv, r)
    finally:
        if srv:
            problems += su.stop(srv)
            r.srv = None
        for nd in nodes:
            problems += nd.stop()
    if problems:
        r.fail("processes stopped cleanly", "\n".join(problems))
    r.finish()


if __name__ == "__main__":
    main()
