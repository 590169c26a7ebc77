"""A cluster that loses a stage fails clean: every request ends with an error, nothing hangs
(docs/cluster.md, "When a worker node dies"), against real processes: two `shoal node` workers
holding the two pipeline stages of stories260K and a `shoal serve -c` front, over ipc://.

Cases:
- a worker killed (SIGKILL) while streams run: every stream ends within a few seconds with an
  error event and `data: [DONE]`, a non-streaming request gets a 503, the front logs one error
  line naming the node and exits with status 3; the other worker still stops cleanly. Run once
  for the last stage (stopped first, so its step is surely in flight when it dies) and once for
  the first stage killed outright mid-stream.
- a worker that hangs while connected (SIGSTOP): the batcher's step timeout (--step-timeout 1)
  fails the step's requests with 503 naming the step; after SIGCONT the late answers are ignored
  and the replica serves again, with the same greedy text as before.

Every wait is bounded, so a hang (the behaviour before fail-stop) fails instead of blocking.
"""

import http.client
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402
from test_cluster_pipeline import STORIES, Node, script  # noqa: E402

EXIT_LOST = 3
END_WITHIN = 10.0  # seconds from the failure to every request's end (generous; ~0.1 s expected)
N_STREAMS = 6
PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park",
           "A big red ball", "The sun was", "One day, a bird"]


class Stream(threading.Thread):
    """One streaming completion read event by event, with the time of each and of the end."""

    def __init__(self, url, prompt, max_tokens=2000):
        super().__init__(daemon=True)
        self.url, self.prompt, self.max_tokens = url, prompt, max_tokens
        self.events = []  # payloads: dicts, or "[DONE]"
        self.status = None
        self.body = b""
        self.closed_at = None  # time.monotonic() when the connection ended
        self.error = None  # an exception from the reader (a timeout means it hung)

    def tokens(self):
        return sum(1 for e in self.events if isinstance(e, dict) and "choices" in e)

    def run(self):
        host, port = su._hostport(self.url)
        conn = http.client.HTTPConnection(host, port, timeout=END_WITHIN + 20)
        try:
            conn.request("POST", "/v1/completions", body=json.dumps({
                "prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}).encode(),
                headers={"Content-Type": "application/json", "Connection": "close"})
            resp = conn.getresponse()
            self.status = resp.status
            if resp.status != 200:
                self.body = resp.read()
                return
            while True:
                line = resp.readline()
                if not line:
                    break
                line = line.decode("utf-8").rstrip("\r\n")
                if line.startswith("data:"):
                    p = line[5:].strip()
                    self.events.append(p if p == "[DONE]" else json.loads(p))
        except Exception as exc:  # noqa: BLE001
            self.error = exc
        finally:
            self.closed_at = time.monotonic()
            conn.close()


class Plain(threading.Thread):
    """One non-streaming completion."""

    def __init__(self, url, prompt, max_tokens=2000):
        super().__init__(daemon=True)
        self.url, self.prompt, self.max_tokens = url, prompt, max_tokens
        self.result = None
        self.closed_at = None

    def run(self):
        try:
            self.result = su.post_json(self.url, "/v1/completions", {
                "prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True}, timeout=END_WITHIN + 20)
        except Exception as exc:  # noqa: BLE001
            self.result = exc
        finally:
            self.closed_at = time.monotonic()


def wait_for(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.005)


def errors_of(st):
    return [e["error"] for e in st.events if isinstance(e, dict) and "error" in e]


def check_stream_failed(st, t_fail, want_msg, i):
    """st must have ended within END_WITHIN of t_fail with an error event and then [DONE]."""
    st.join(max(0.0, t_fail + END_WITHIN - time.monotonic()))
    assert not st.is_alive(), (f"stream {i} still open {END_WITHIN:.0f} s after the failure "
                               f"({st.tokens()} tokens so far): the request hangs")
    assert st.error is None, f"stream {i}: {st.error!r} after {st.tokens()} tokens"
    assert st.status == 200, f"stream {i}: status {st.status} {st.body[:300]!r}"
    errs = errors_of(st)
    assert errs, f"stream {i} ended without an error event: last events {st.events[-3:]!r}"
    assert st.events[-1] == "[DONE]", f"stream {i}: last event {st.events[-1]!r}, want [DONE]"
    assert isinstance(st.events[-2], dict) and "error" in st.events[-2], \
        f"stream {i}: the error event is not right before [DONE]: {st.events[-3:]!r}"
    assert want_msg in errs[0].get("message", ""), f"stream {i}: error {errs[0]!r} lacks " \
        f"{want_msg!r}"
    return st.closed_at - t_fail


def check_plain_failed(p, t_fail, want_status, want_msg):
    p.join(max(0.0, t_fail + END_WITHIN - time.monotonic()))
    assert not p.is_alive(), f"the non-streaming request still open {END_WITHIN:.0f} s after " \
        "the failure: it hangs"
    assert not isinstance(p.result, Exception), f"non-streaming request: {p.result!r}"
    status, parsed, raw = p.result
    assert status == want_status, f"non-streaming request: status {status}, want " \
        f"{want_status}: {raw[:300]!r}"
    msg = ((parsed or {}).get("error") or {}).get("message", "")
    assert want_msg in msg, f"non-streaming request: error {raw[:300]!r} lacks {want_msg!r}"
    return p.closed_at - t_fail


# The watchdog judges a silent (stopped) worker dead after 3 missed 100 ms heartbeats; the cases
# that stop a worker to hold a step in flight, or to test --step-timeout, give it 10 s instead.
PATIENT = "  watchdog = { dead_after = 100 },\n"


def start_cluster(d, name, *front_args, extra=""):
    path = script(os.path.join(d, f"{name}.lua"), STORIES, ["w0", "w1"], extra=extra)
    nodes = {w: Node(path, w) for w in ("w0", "w1")}
    try:
        for nd in nodes.values():
            nd.wait_ready()
        # Fail stop is what these cases test: no waiting for a lost worker (the default waits 30 s).
        srv = su.start("-c", path, "--join-timeout", "60", "--recover-timeout", "0", *front_args,
                       model=None)
    except BaseException:
        for nd in nodes.values():
            nd.stop()
        raise
    return srv, nodes


def start_streams(url):
    streams = [Stream(url, PROMPTS[i % len(PROMPTS)]) for i in range(N_STREAMS)]
    for st in streams:
        st.start()
    wait_for(lambda: all(st.tokens() > 0 or not st.is_alive() for st in streams), 60,
             "the first token of every stream")
    return streams


def worker_killed(d, victim, stop_first):
    """SIGKILL `victim` while streams run (stop_first: SIGSTOP it first, so that a step is surely
    in flight when it dies, and add a non-streaming request that waits behind it)."""
    srv, nodes = start_cluster(d, f"kill-{victim}", extra=PATIENT if stop_first else "")
    problems = []
    try:
        streams = start_streams(srv.url)
        vp = nodes[victim].proc
        plain = None
        if stop_first:
            vp.send_signal(signal.SIGSTOP)
            done = [i for i, st in enumerate(streams) if not st.is_alive()]
            assert not done, f"streams {done} ended before the worker was stopped: " \
                f"{[streams[i].events[-2:] for i in done]}"
            plain = Plain(srv.url, "The cat")
            plain.start()
            time.sleep(0.3)
        t_kill = time.monotonic()
        vp.kill()
        open_at_kill = sum(st.is_alive() for st in streams)
        assert open_at_kill > 0, "every stream finished before the kill: nothing was tested"
        want = "a stage node of this replica was lost"
        ends = [check_stream_failed(st, t_kill, want, i) for i, st in enumerate(streams)
                if st.is_alive() or errors_of(st)]
        if plain:
            ends.append(check_plain_failed(plain, t_kill, 503, want))
        try:
            srv.proc.wait(timeout=max(0.5, t_kill + END_WITHIN - time.monotonic()))
        except Exception:  # noqa: BLE001
            raise AssertionError(f"the front did not exit within {END_WITHIN:.0f} s of the kill "
                                 "(it hangs):\n" + srv.log_tail(30))
        t_exit = time.monotonic() - t_kill
        log = srv.log_text()
        assert srv.proc.returncode == EXIT_LOST, \
            f"the front exited {srv.proc.returncode}, want {EXIT_LOST}:\n{srv.log_tail(30)}"
        errs = [ln for ln in log.splitlines() if ln.startswith("error: ")]
        assert len(errs) == 1, "want one error line:\n" + "\n".join(errs or [srv.log_tail(30)])
        for w in (f"node {victim} ", "was lost", "cannot continue"):
            assert w in errs[0], f"{errs[0]!r} lacks {w!r}"
        crash = su._crash_lines(log)
        assert not crash, "crash output in the front's log:\n" + "\n".join(crash)
        su.log(f"note: {victim} killed with {open_at_kill} streams open: every request ended "
               f"within {max(ends):.2f} s (first {min(ends):.2f} s), the front exited "
               f"{EXIT_LOST} after {t_exit:.2f} s: {errs[0]}")
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()
        for w, nd in nodes.items():
            if w == victim:
                if nd.proc.poll() is None:
                    nd.proc.kill()
                nd.proc.wait()
            else:
                problems += nd.stop()
    assert not problems, "\n".join(problems)


def step_timeout(d):
    """SIGSTOP w0 (connected but silent): with --step-timeout 1 the step in flight fails."""
    srv, nodes = start_cluster(d, "hang", "--step-timeout", "1", extra=PATIENT)
    problems = []
    stopped = None
    try:
        status, before, raw = su.post_json(srv.url, "/v1/completions", {
            "prompt": "The cat", "max_tokens": 40, "temperature": 0}, timeout=60)
        assert status == 200, f"status {status}: {raw[:300]!r}"
        streams = start_streams(srv.url)
        stopped = nodes["w0"].proc
        t_stop = time.monotonic()
        stopped.send_signal(signal.SIGSTOP)
        plain = Plain(srv.url, "The dog")
        plain.start()
        want = "did not answer step"
        ends = [check_stream_failed(st, t_stop, want, i) for i, st in enumerate(streams)
                if st.is_alive() or errors_of(st)]
        assert ends, "every stream finished before w0 was stopped: nothing was tested"
        ends.append(check_plain_failed(plain, t_stop, 503, want))
        msg = errors_of([st for st in streams if errors_of(st)][0])[0]["message"]
        # --step-timeout 1: the step (sent again meanwhile: "Lossy and corrupting links") fails
        # after about a second.
        assert re.search(r"did not answer step \d+ in 1[0-9]{3} ms \(\d+ tries?\)", msg) and \
            "a stage node may be down" in msg, msg
        stopped.send_signal(signal.SIGCONT)
        stopped = None
        # The replica goes on: the late STEP_DONEs are ignored and a request computes as before.
        status, after, raw = su.post_json(srv.url, "/v1/completions", {
            "prompt": "The cat", "max_tokens": 40, "temperature": 0}, timeout=60)
        assert status == 200, f"after SIGCONT: status {status}: {raw[:300]!r}"
        assert after["choices"][0]["text"] == before["choices"][0]["text"], \
            (before["choices"][0]["text"], after["choices"][0]["text"])
        st, _, body = su.get(srv.url, "/health")
        assert st == 200, (st, body)
        assert srv.alive(), "the front exited:\n" + srv.log_tail(30)
        su.log(f"note: w0 stopped: the step timeout ended every request within {max(ends):.2f} s "
               f"({msg!r}); after SIGCONT the replica served the same text again")
    finally:
        if stopped is not None:
            stopped.send_signal(signal.SIGCONT)
        problems += su.stop(srv)
        for nd in nodes.values():
            problems += nd.stop()
    assert not problems, "\n".join(problems)


def front_restarted(d):
    """The front restarted in front of running workers serves what the first one did: sampled
    output with a seed and penalties (the last stage keeps a sampler per sequence id, so a new
    front reusing its predecessor's ids would continue their random state and history)."""
    srv, nodes = start_cluster(d, "restart")
    problems = []
    body = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0.8, "seed": 7,
            "repeat_penalty": 1.3, "ignore_eos": True}
    try:
        texts = []
        for round in range(2):
            if round:
                srv = su.start("-c", nodes["w0"].script, "--join-timeout", "60", model=None)
            for _ in range(3):
                status, parsed, raw = su.post_json(srv.url, "/v1/completions", body)
                assert status == 200, f"status {status}: {raw[:300]!r}"
                texts.append(parsed["choices"][0]["text"])
            problems += su.stop(srv)
            srv = None
        assert len(set(texts)) == 1, f"outputs differ across the restart: {texts}"
    finally:
        if srv:
            problems += su.stop(srv)
        for nd in nodes.values():
            problems += nd.stop()
    assert not problems, "\n".join(problems)


def not_back(d):
    """--recover-timeout 1 and nobody restarts the lost worker: the replica pauses, open requests
    wait, and after 1 s the front gives up: they end with 503 and it exits 3 naming the node."""
    srv, nodes = start_cluster(d, "notback", "--recover-timeout", "1")
    problems = []
    try:
        nodes["w1"].proc.kill()
        nodes["w1"].proc.wait()
        t0 = time.monotonic()
        status, _, raw = su.post_json(srv.url, "/v1/completions", {
            "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}, timeout=30)
        assert status == 503, f"status {status}: {raw[:300]!r}"
        rc = srv.proc.wait(timeout=30)
        dt = time.monotonic() - t0
        log = srv.log_text()
        assert rc == EXIT_LOST, f"exit {rc}:\n{log[-2000:]}"
        assert "replica 1 paused" in log, log[-2000:]
        assert "node w1" in log and "did not come back within 1.0 s" in log, log[-2000:]
        assert dt < 10, f"took {dt:.1f} s"
    finally:
        if srv.proc.poll() is None:
            problems += su.stop(srv)
        problems += nodes["w0"].stop()  # w1 was killed on purpose
        os.unlink(nodes["w1"].logpath)
    assert not problems, "\n".join(problems)


def main():
    if not os.path.exists(STORIES):
        su.skip(f"{STORIES} missing")
    r = su.Runner("test_cluster_failure")
    d = tempfile.mkdtemp(prefix="shcf-", dir="/tmp")  # ipc:// paths stay short
    try:
        r.case("the last stage's worker stopped then killed: every request fails within "
               f"{END_WITHIN:.0f} s, the front exits {EXIT_LOST} naming w1",
               worker_killed, d, "w1", True)
        r.case("the first stage's worker killed mid-stream: every request fails, the front "
               f"exits {EXIT_LOST} naming w0", worker_killed, d, "w0", False)
        r.case("a hung worker: --step-timeout fails the step with 503 naming it; the replica "
               "serves again after SIGCONT", step_timeout, d)
        r.case("a front restarted in front of running workers gives the same sampled output",
               front_restarted, d)
        r.case("--recover-timeout with no restart: the front gives up after it, exit 3 naming "
               "the node", not_back, d)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    r.finish()


if __name__ == "__main__":
    main()
