"""Lossy and corrupting links (issue 12, docs/cluster.md "Lossy and corrupting links"), against
real processes: two `shoal node` workers (a 2-stage stories260K pipeline) and a `shoal serve -c`
front over ipc://, every one of the three running the same `--fault-scenario` against its own
links, so that STEP (front -> w0), ACT (w0 -> w1) and STEP_DONE (w1 -> front) all suffer it. The
scenario's times count from when the requests start (`--fault-epoch @FILE`, the file written
then), so that the join is clean and the faults meet the traffic.

A clean run of the same cluster answers REQUESTS greedy requests (every other one streamed,
max_tokens 3 to 20, 12 at a time); then each scenario runs the same requests and every one must
end with status 200 and the clean run's text, finish reason and token count (a stream: its text
put together, one finish reason, then [DONE]): none lost, none failed, none different.

- 1% of frames dropped on every link, every frame delayed 50 ms: lost steps are sent again
  (shoal_step_retries_total > 0 on the front);
- 0.1% of frames corrupted on every link (and 5% for the first half second, so that some surely
  are; 200 requests make only a few hundred frames): the
  receivers' checksums drop them (shoal_frames_corrupt_total > 0, summed over the nodes the
  front's /metrics shows) and the steps they carried are sent again;
- 5% of frames duplicated on every link: the stages run duplicated steps twice and the batcher
  ignores the second answers (shoal_step_answers_ignored_total > 0).
"""

import os
import queue
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402
from test_cluster_pipeline import Node  # noqa: E402

STORIES = os.path.join(su.ROOT, "tests", "data", "stories260K", "stories260K.gguf")
REQUESTS = int(os.environ.get("SH_LOSSY_REQUESTS", "200"))
CLIENTS = 12
WORDS = ["Lily", "Tom", "a dog", "the sun", "a big tree", "Mom", "the park", "a red ball",
         "the cat", "Ben", "a little bird", "the sea", "a toy car"]

SCENARIOS = {
    "1% drop with 50 ms delay": (
        'at(0, drop { link = "*", p = 0.01 })\n'
        'at(0, delay { link = "*", ms = 50 })\n'),
    "0.1% corrupted frames": (
        'at(0, corrupt { link = "*", p = 0.001, bytes = 2 })\n'
        'at(0, corrupt { link = "*", p = 0.05, bytes = 2, lasting = 0.5 })\n'),
    "5% duplicated frames": 'at(0, duplicate { link = "*", p = 0.05 })\n',
}


def script(d):
    path = os.path.join(d, "lossy.lua")
    with open(path, "w") as f:
        f.write(f"""local m = model {{ path = '{STORIES}', name = 'm' }}
return cluster {{
  nodes = {{ node {{ name = 'front', listen = 'ipc://{d}/front.sock' }},
            node {{ name = 'w0', listen = 'ipc://{d}/w0.sock' }},
            node {{ name = 'w1', listen = 'ipc://{d}/w1.sock' }} }},
  gateway = {{ node = 'front', http = '127.0.0.1:8080' }},
  replicas = {{ replica {{ model = m, stages = pipeline(m, {{ 'w0', 'w1' }}) }} }},
  batcher = {{ max_seqs = 16, max_step_tokens = 512 }},
  kv = {{ memory = '32MiB' }},
}}
""")
    return path


def requests():
    out = []
    for i in range(REQUESTS):
        prompt = f"Once upon a time, {WORDS[i % len(WORDS)]} and {WORDS[(i * 7 + 3) % len(WORDS)]}"
        out.append({"prompt": prompt, "max_tokens": 3 + (i * 5) % 18, "stream": i % 2 == 1})
    return out


def one(url, spec):
    """(text, finish_reason, tokens or None) of one greedy request; raises on any failure."""
    body = {"prompt": spec["prompt"], "max_tokens": spec["max_tokens"], "temperature": 0,
            "ignore_eos": True}
    if not spec["stream"]:
        status, parsed, raw = su.post_json(url, "/v1/completions", body, timeout=300)
        assert status == 200, f"status {status}: {raw[:300]!r}"
        ch = parsed["choices"][0]
        return ch["text"], ch["finish_reason"], parsed["usage"]["completion_tokens"]
    body["stream"] = True
    status, ctype, events = su.stream(url, "/v1/completions", body, timeout=300)
    assert status == 200, f"status {status}: {events[:1]!r}"
    assert events and events[-1] == "[DONE]", f"the stream did not end with [DONE]: {events[-3:]}"
    text, reasons = "", []
    for ev in events[:-1]:
        assert "error" not in ev, f"error event: {ev}"
        ch = ev["choices"][0]
        text += ch.get("text") or ""
        if ch.get("finish_reason"):
            reasons.append(ch["finish_reason"])
    assert len(reasons) == 1, f"finish reasons {reasons}"
    return text, reasons[0], None


def run_all(url, specs):
    """Every spec through CLIENTS threads; returns the results (an exception for a failure)."""
    out = [None] * len(specs)
    todo = queue.Queue()
    for i in range(len(specs)):
        todo.put(i)

    def client():
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            try:
                out[i] = one(url, specs[i])
            except Exception as exc:  # noqa: BLE001 - every failure is counted
                out[i] = exc

    ts = [threading.Thread(target=client, daemon=True) for _ in range(CLIENTS)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(900)
    return out


def metric_sum(url, name):
    return sum(v for n, _, v in su.parse_metrics(su.metrics(url)) if n == name)


class Cluster:
    def __init__(self, path, scenario=None, epoch_file=None):
        extra = ("--fault-scenario", scenario, "--fault-epoch", "@" + epoch_file) \
            if scenario else ()
        self.nodes, self.srv = [], None
        try:
            self.nodes = [Node(path, w, *extra) for w in ("w0", "w1")]
            for nd in self.nodes:
                nd.wait_ready()
            self.srv = su.start("-c", path, "--join-timeout", "60", *extra, model=None)
        except BaseException:
            self.close()
            raise

    def close(self):
        problems = []
        if self.srv:
            problems += su.stop(self.srv)
            self.srv = None
        for nd in self.nodes:
            problems += nd.stop()
        self.nodes = []
        return problems


def compare(want, got):
    lost = [i for i, g in enumerate(got) if g is None]
    failed = [(i, g) for i, g in enumerate(got) if isinstance(g, Exception)]
    differ = [i for i, (w, g) in enumerate(zip(want, got))
              if g is not None and not isinstance(g, Exception) and
              (w[0] != g[0] or w[1] != g[1] or (g[2] is not None and w[2] != g[2]))]
    return lost, failed, differ


def faulty(d, path, want, name, text):
    sc = os.path.join(d, f"sc{abs(hash(name)) % 1000}.lua")
    with open(sc, "w") as f:
        f.write(text)
    epoch = sc + ".epoch"
    c = Cluster(path, sc, epoch)
    problems = []
    try:
        tmp = epoch + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(int(time.time() * 1000)))
        os.rename(tmp, epoch)  # the scenario starts now, in every process
        time.sleep(0.1)  # the processes poll for the file every 20 ms
        for nd in c.nodes:
            nd.wait_log("fault scenario")
        t0 = time.monotonic()
        got = run_all(c.srv.url, requests())
        dt = time.monotonic() - t0
        time.sleep(1.5)  # the workers' next metrics reports
        url = c.srv.url
        retries = metric_sum(url, "shoal_step_retries_total")
        ignored = metric_sum(url, "shoal_step_answers_ignored_total")
        corrupt = metric_sum(url, "shoal_frames_corrupt_total")
        lost, failed, differ = compare(want, got)
        su.log(f"note: {name}: {len(got)} requests in {dt:.1f} s: {len(lost)} lost, "
               f"{len(failed)} failed, {len(differ)} different; {retries:.0f} steps sent again, "
               f"{ignored:.0f} answers ignored, {corrupt:.0f} corrupted frames dropped")
        assert not lost, f"lost: {lost[:10]}"
        assert not failed, f"failed: {[(i, str(e)[:200]) for i, e in failed[:5]]}"
        assert not differ, "different: " + "; ".join(
            f"{i}: {want[i]!r} vs {got[i]!r}" for i in differ[:5])
        if "drop" in name:
            assert retries > 0, "no step was sent again"
        if "corrupt" in name:
            assert corrupt > 0, "no corrupted frame was dropped"
        if "duplicate" in name:
            assert ignored > 0, "no duplicated answer was ignored"
    finally:
        problems += c.close()
    assert not problems, "\n".join(problems)


def main():
    if not os.path.exists(STORIES):
        su.skip(f"{STORIES} missing")
    r = su.Runner("test_cluster_lossy")
    with tempfile.TemporaryDirectory(prefix="shlossy-") as d:
        path = script(d)
        c = Cluster(path)
        try:
            t0 = time.monotonic()
            want = run_all(c.srv.url, requests())
            su.log(f"note: the clean run: {len(want)} requests in {time.monotonic() - t0:.1f} s")
        finally:
            problems = c.close()
        bad = [w for w in want if w is None or isinstance(w, Exception)]
        if bad or problems:
            r.fail("the clean run", f"{bad[:3]} {problems[:3]}")
            r.finish()
        for name, text in SCENARIOS.items():
            r.case(name, faulty, d, path, want, name, text)
    r.finish()


if __name__ == "__main__":
    main()
