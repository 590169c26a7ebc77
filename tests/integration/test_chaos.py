"""The chaos suite (issue 12, label `chaos`): `shoal chaos` runs one scenario of examples/chaos/
against a real local cluster (`shoal cluster up`: a 2-stage stories260K pipeline over ipc:// in a
temp dir) under at least 200 greedy requests, half of them streaming, and each must end: 0 lost,
0 different from the undisturbed run, and the command's exit status and JSON report agree.

Usage: test_chaos.py SCENARIO (a file name in examples/chaos/ without .lua), or
test_chaos.py SCENARIO --engine: the same run with `shoal chaos --engine`, whose front is the C
API's cluster front (sh_engine_open on the script, in the chaos process; only the workers are
children, under `cluster up --no-front`), to the same bar; or test_chaos.py attach: `shoal chaos --attach` against a cluster started by hand with
`cluster up --pid-dir --fault-scenario --fault-epoch @FILE`, a kill and a 1 s delay.

Scenarios whose recovery is not built yet are listed in KNOWN with the reason: such a scenario
still runs, and when it fails the test exits 77 (skipped) printing the counts and the reason;
SH_CHAOS_STRICT=1 makes that a failure (for whoever builds the mechanism). One that passes
prints a note to take it off the list. With SH_SOAK_SECONDS (`make soak`) the load goes on for
that long (at most 120 s, to stay within the ctest timeout) after the same faults.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402

EXAMPLES = os.path.join(su.ROOT, "examples", "chaos")
MODEL = os.path.join(su.ROOT, "tests", "data", "stories260K", "stories260K.gguf")
RUN_TIMEOUT = 150

# scenario: (cluster script, extra shoal chaos flags, what the run must show besides 0 lost/wrong)
SCENARIOS = {
    "kill-prefill": ("cluster-prefill.lua", ["--prompt-words", "60", "--max-tokens", "2"],
                     "kill"),
    "kill-decode": ("cluster.lua", ["--max-tokens", "32"], "kill"),
    "kill-twice": ("cluster.lua", ["--max-tokens", "32"], "kill"),
    "kill-standby": ("cluster-standby.lua", ["--max-tokens", "32"], "kill"),
    "kill-replica": ("cluster-replicas.lua", ["--max-tokens", "32"], "kill"),
    "stop-2s": ("cluster.lua", ["--max-tokens", "32"], "detect"),
    "partition-2s": ("cluster.lua", ["--max-tokens", "32", "--timeout", "15", "--duration", "9"],
                     ""),
    "drop-delay": ("cluster.lua", ["--concurrency", "16", "--timeout", "15"], ""),
    "corrupt": ("cluster.lua", ["--timeout", "15"], ""),
    "duplicate": ("cluster.lua", ["--timeout", "15"], "detect"),
    "leak": ("cluster-leak.lua", ["--max-tokens", "16"], "leak"),
    "kill-rank": ("cluster-tp.lua", ["--max-tokens", "32"], "kill"),
    "kill-leader-standby": ("cluster-tp-standby.lua", ["--max-tokens", "32"], "kill"),
    "stop-rank-2s": ("cluster-tp.lua", ["--max-tokens", "32"], "detect"),
    "drop-coll-1pct": ("cluster-tp-net.lua", ["--max-tokens", "32"], "coll"),
    "kill-decode-spec": ("cluster-spec.lua", ["--max-tokens", "48"], "kill-spec"),
}

# Scenarios that fail today for a reason outside `shoal chaos`, and who is on it.
KNOWN = {
    # Empty since d7cecbf (steps retried after a lost or refused frame): partition-2s, drop-delay
    # and corrupt lost 8, 16 and 8 requests before it, and pass 5 runs in 5 at 76c12ab.
}


def sec(v):
    return "-" if v is None else f"{v:.3f}"


def cluster_copy(d, name):
    """examples/chaos/NAME with its sockets in d and the model's absolute path."""
    with open(os.path.join(EXAMPLES, name)) as f:
        text = f.read()
    text = text.replace("ipc:///tmp/shoal-chaos-", f"ipc://{d}/")
    text = text.replace("../../tests/data/stories260K/stories260K.gguf", MODEL)
    path = os.path.join(d, name)
    with open(path, "w") as f:
        f.write(text)
    return path


def attach():
    """A cluster started by hand (cluster up with --pid-dir, --fault-scenario and --fault-epoch
    @FILE), then `shoal chaos --attach URL --pid-dir DIR --epoch-file FILE`: the kill finds the
    worker through the pid file, the nodes start the delay when the epoch file appears, and the
    times come from GET /admin/status."""
    d = tempfile.mkdtemp(prefix="shchaosat-", dir="/tmp")
    cl = cluster_copy(d, "cluster.lua")
    sc = os.path.join(d, "sc.lua")
    with open(sc, "w") as f:
        f.write("at(1.0, kill 'w1')\nat(3.0, delay { link = 'w0->w1', ms = 20, lasting = 1 })\n")
    pids = os.path.join(d, "pids")
    os.mkdir(pids)
    epoch = os.path.join(d, "epoch")
    log = os.path.join(d, "up.log")
    logf = open(log, "wb")
    up = subprocess.Popen([su.shoal_binary(), "cluster", "up", cl, "-t", "1", "--pid-dir", pids,
                           "--fault-scenario", sc, "--fault-epoch", "@" + epoch, "--", "--port",
                           "0"], cwd=su.ROOT, stdout=logf, stderr=logf, start_new_session=True)
    logf.close()
    try:
        deadline = time.monotonic() + 90
        url = None
        while not url:
            with open(log) as f:
                m = re.search(r"^cluster: up: .* listening on (http://\S+)", f.read(), re.M)
            url = m and m.group(1)
            assert up.poll() is None and time.monotonic() < deadline, open(log).read()[-2000:]
            time.sleep(0.05)
        assert sorted(os.listdir(pids)) == ["front.pid", "w0.pid", "w1.pid"], os.listdir(pids)
        w1 = int(open(os.path.join(pids, "w1.pid")).read())
        p = subprocess.run([su.shoal_binary(), "chaos", sc, "-c", cl, "--attach", url,
                            "--pid-dir", pids, "--epoch-file", epoch, "--json", "--requests",
                            "200", "--max-tokens", "32"], cwd=su.ROOT, capture_output=True,
                           text=True, timeout=RUN_TIMEOUT)
        assert p.returncode == 0, f"exit {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
        r = json.loads(p.stdout.strip().splitlines()[-1])
        q = r["requests"]
        assert q["accepted"] >= 200 and q["lost"] == 0 and q["wrong"] == 0, q
        assert r["marks_source"] == "admin/status", r["marks_source"]
        kill = r["events"][0]
        assert kill["detect_s"] is not None and kill["recover_s"] is not None, r["events"]
        text = open(log).read()
        # The restarted w1 has a new pid file; every node read the epoch the run wrote.
        assert int(open(os.path.join(pids, "w1.pid")).read()) != w1
        assert len(re.findall(r"shoal: fault scenario: epoch \d+ from", text)) >= 3, text[-3000:]
        su.log(f"attach: {q['accepted']} accepted, 0 lost, 0 wrong; kill detected after "
               f"{sec(kill['detect_s'])} s, recovered after {sec(kill['recover_s'])} s")
        up.send_signal(15)
        assert up.wait(60) == 0, open(log).read()[-3000:]
        assert os.listdir(pids) == [], os.listdir(pids)
        crash = su._crash_lines(open(log).read())
        assert not crash, "\n".join(crash[:10])
    finally:
        if up.poll() is None:
            os.killpg(up.pid, 9)
            up.wait()
    shutil.rmtree(d)  # kept when the run failed, for its log


def main():
    if sys.argv[1:] == ["attach"]:
        return attach()
    engine = sys.argv[2:] == ["--engine"]
    if len(sys.argv) != 2 + engine or sys.argv[1] not in SCENARIOS:
        sys.exit(f"usage: test_chaos.py {{{','.join(SCENARIOS)}}} [--engine]")
    name = sys.argv[1]
    cluster, extra, must = SCENARIOS[name]
    d = tempfile.mkdtemp(prefix="shchaos-", dir="/tmp")
    cl = cluster_copy(d, cluster)
    log = os.path.join(d, "cluster.log")
    argv = [su.shoal_binary(), "chaos", os.path.join(EXAMPLES, name + ".lua"), "-c", cl, "--json",
            "--requests", "200", "--log", log, *extra, *(["--engine"] if engine else [])]
    soak = os.environ.get("SH_SOAK_SECONDS")
    if soak:
        argv += ["--duration", str(min(max(float(soak), 10.0), 120.0))]
    t0 = time.monotonic()
    p = subprocess.run(argv, cwd=su.ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    dt = time.monotonic() - t0
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert p.returncode in (0, 1) and lines, \
        f"shoal chaos exited {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
    r = json.loads(lines[-1])
    q = r["requests"]
    ev = r["events"]
    summary = (f"{name}{' (engine)' if engine else ''}: {q['accepted']} accepted, {q['completed']} completed, {q['errors']} "
               f"errors, {q['lost']} lost, {q['wrong']} wrong in {dt:.1f} s; events: "
               + "; ".join(f"{e['what']} at {e['t']} s: detected after {sec(e['detect_s'])}, "
                           f"recovered after {sec(e['recover_s'])}" for e in ev)
               + f" ({r['marks_source']}); latency p50/p99/max s: "
               + ", ".join(f"{k} n={v['n']} {sec(v['p50'])}/{sec(v['p99'])}/{sec(v['max'])}"
                           for k, v in r["latency_s"].items()))
    su.log(summary)
    for fl in r["failures"][:5]:
        su.log(f"  {fl['outcome']}: {fl['count']} x {fl['msg']}")
    # The report is consistent: every request accepted ended one way, the exit status says so.
    assert q["accepted"] >= 200, q
    assert q["completed"] == q["equal"] + q["wrong"], q
    assert q["accepted"] == q["completed"] + q["errors"] + q["lost"], q
    assert (p.returncode == 0) == (q["lost"] == 0 and q["wrong"] == 0) == r["pass"], \
        (p.returncode, q)
    with open(log, "rb") as f:
        text = f.read().decode("utf-8", "replace")
    crash = su._crash_lines(text)
    assert not crash, "\n".join(crash[:10])
    assert r["cluster_exit"] == 0, f"cluster up exited {r['cluster_exit']}:\n{text[-3000:]}"
    assert r["front"] == ("engine" if engine else "shoal serve"), r["front"]
    if engine:
        # The engine closed cleanly, and the history came from its own lines.
        assert r["engine_close"] == 0, r["engine_close"]
        assert r["marks_source"] == "log", r["marks_source"]
        assert "[engine] node w0 joined" in text, text[-3000:]
        assert "started node front" not in text, text[-3000:]  # no `shoal serve` child
        # The front's share of the link events went to the engine's fault layer, every one.
        m = re.search(r"the engine applied (\d+) of (\d+) link events on its links \((\d+) failed",
                      p.stderr)
        links = any(e["kind"] in ("delay", "drop", "duplicate", "corrupt", "partition", "heal")
                    for e in ev)
        assert bool(m) == links, p.stderr[-2000:]
        assert not m or (m.group(1) == m.group(2) and m.group(3) == "0"), m.group(0)
    ok = q["lost"] == 0 and q["wrong"] == 0
    if not ok and name in KNOWN and os.environ.get("SH_CHAOS_STRICT") != "1":
        lines = [ln for ln in text.splitlines() if re.search(
            r"was lost|came back|fail|error|timed out|refus", ln, re.I)]
        su.log("\n".join(lines[-10:]))
        su.skip(f"{name} fails today ({q['lost']} lost, {q['wrong']} wrong of {q['accepted']}): "
                f"{KNOWN[name]}; SH_CHAOS_STRICT=1 makes this a failure")
    assert q["lost"] == 0, summary
    assert q["wrong"] == 0, summary
    # The cluster serves again once the faults are over (requests started after the window).
    assert r["latency_s"]["after"]["n"] > 0, summary
    if must == "kill-spec" and not engine:
        # The replica drafted (n-gram) and the stage accepted drafts during the run: the kill
        # fell among speculative steps (the reference run was speculative too; test_serve_spec
        # checks that speculation never changes a greedy answer).
        spec = r.get("spec")
        assert spec and spec["drafts"] > 0 and spec["accepted"] > 0, (spec, summary)
        su.log(f"note: {spec['drafts']:.0f} drafting steps, {spec['accepted']:.0f} drafted tokens "
               "accepted")
    if must in ("kill", "kill-spec"):
        # A kill is seen by the front (its connection breaks) and the replica resumes: no request
        # ends with an error, each kill has its detection and recovery.
        assert q["errors"] == 0, summary
        for e in ev:
            if e["kind"] == "kill" and e["from"] != "spare":
                assert e["detect_s"] is not None and e["recover_s"] is not None, summary
    if must == "detect":
        assert q["errors"] == 0, summary
    if must == "coll":
        # The group's network collective lost frames on both ranks and asked for them again: no
        # request failed, no collective call failed (a step the group could not run would log
        # tp_step_unanswered on the leader, stage_step_failed on w1). The group may still form
        # anew after a pause of the replica (a heartbeat missed on a loaded machine).
        assert q["errors"] == 0, summary
        dropped = []
        for w in ("w0", "w1"):
            m = re.search(r"\[" + w + r"\] shoal: fault layer: \d+ messages seen, (\d+) dropped",
                          text)
            assert m and int(m.group(1)) > 0, f"{w} dropped nothing:\n" + text[-3000:]
            dropped.append(f"{w} dropped {m.group(1)}")
        su.log("note: " + ", ".join(dropped))
        bad = [ln for ln in text.splitlines() if re.search(
            r"tp_step_unanswered|stage_step_failed|tensor-parallel group of \d+ ranks failed", ln)]
        assert not bad, "\n".join(bad[:10])
    if must == "leak":
        # w1 passes its 150 MiB budget: drained, it exits 75, cluster up starts it again at once
        # and the front resumes the replica on the new process.
        front = r"\[engine\] " if engine else r"\[front\] shoal: "
        for want in (front + r"node w1 \([^)]*\) was lost: over its memory budget",
                     r"\[w1\] shoal: node w1: the front asked for a restart: .*; exiting 75",
                     r"cluster: node w1 exited \(status 75: the front asked it to restart\); "
                     r"restarting it now",
                     front + r"node w1 came back [0-9.]+ s after it was lost \(a new "
                     r"process\); replica 1 resumed"):
            assert re.search(want, text), f"no {want!r} in the cluster log:\n" + text[-3000:]
    if name in KNOWN:
        su.log(f"note: {name} passed this run; take it off KNOWN once it passes every time")
    for f in os.listdir(d):
        os.unlink(os.path.join(d, f))
    os.rmdir(d)


if __name__ == "__main__":
    main()
