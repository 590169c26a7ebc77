"""`shoal chaos` refuses bad input before anything starts (issue 12): a scenario naming an unknown
node or with a bad argument (file:line), a stall of one actor, a cluster script `cluster up`
would refuse, arguments past the fault layer's limits (corrupt bytes = 1000, a delay over 10
minutes: issue 25), bad flags, and with --engine (whose front is this process) an event that
kills, stops or leaks the front; each exits 2 with one error line and starts no process. Also
`shoal node --fault-epoch` and `shoal cluster up --fault-epoch` refuse a bad epoch, and --help
exits 0."""

import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402
from test_chaos import cluster_copy  # noqa: E402


def run(*args, want=2):
    t0 = time.monotonic()
    p = subprocess.run([su.shoal_binary(), *args], cwd=su.ROOT, capture_output=True, text=True,
                       timeout=60)
    dt = time.monotonic() - t0
    assert p.returncode == want, f"{args}: exit {p.returncode}, want {want}:\n{p.stderr}"
    return p.stderr, dt


def main():
    d = tempfile.mkdtemp(prefix="shchaosbad-", dir="/tmp")
    cl = cluster_copy(d, "cluster.lua")
    cases = [
        ("at(1, kill 'w0')\nat(2, stop 'w9')\n", "sc.lua:2: stop: unknown node 'w9'"),
        ("\n\nat(1, leak { node = 'w1', mb_per_s = -5, lasting = 2 })\n",
         "sc.lua:3: leak: field 'mb_per_s' must be > 0"),
        ("at(1, partition { a = 'w0', b = 'nope' })\n", "sc.lua:1: partition: unknown node "
                                                         "'nope'"),
        ("at(1, cont { node = 'w0', lasting = 2 })\n", "sc.lua:1: cont: unknown key 'lasting'"),
        ("at(1, stall { actor = 'w0/stage', ms = 100 })\n",
         "sc.lua:1: stall: shoal chaos stalls whole nodes"),
        ("at(1, kill 'w0'\n", "sc.lua"),
        # Arguments past the fault layer's own limits (SH_FAULT_FLIPS_MAX, SH_FAULT_DELAY_MAX_MS):
        # every node would drop the rule at its time and the run would pass with no fault.
        ("at(1, corrupt { link = 'w0->w1', bytes = 1000 })\n",
         "sc.lua:1: corrupt: field 'bytes' must be within 1..16, got 1000"),
        ("at(1, corrupt { bytes = 17 })\n", "sc.lua:1: corrupt: field 'bytes' must be within 1..16"),
        ("at(1, delay { link = 'w0->w1', ms = 700000 })\n",
         "sc.lua:1: delay: field 'ms' must be >= 0 and <= 600000, got 700000"),
    ]
    engine_cases = [
        ("at(1, kill 'front')\n", "sc.lua:1: kill \"front\": with --engine the front 'front' is "
                                  "this process (an embedding engine), which shoal chaos does not "
                                  "signal"),
        ("at(1, stop { node = 'front', lasting = 1 })\n", "sc.lua:1: stop \"front\": with --engine"),
        ("\nat(1, leak { node = 'front', mb_per_s = 5, lasting = 2 })\n",
         "sc.lua:2: leak \"front\": with --engine the front 'front' is this process (an embedding "
         "engine), which shoal chaos does not make leak"),
    ]
    for src, want in cases + [(s, w) for s, w in engine_cases]:
        sc = os.path.join(d, "sc.lua")
        with open(sc, "w") as f:
            f.write(src)
        engine = (src, want) in engine_cases
        err, dt = run("chaos", sc, "-c", cl, *(["--engine"] if engine else []))
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and want in lines[0], \
            f"want one error line with {want!r}, got:\n{err}"
        assert dt < 10, f"{want}: took {dt:.1f} s (was anything started?)"
        assert not any(n.endswith(".sock") for n in os.listdir(d)), os.listdir(d)
    ok = os.path.join(su.ROOT, "examples", "chaos", "kill-decode.lua")
    err, _ = run("chaos", ok, "-c", os.path.join(d, "missing.lua"))
    assert "missing.lua" in err, err
    for args, want in [((ok,), "needs SCENARIO.lua and -c CLUSTER.lua"),
                       ((ok, "-c", cl, "--requests", "0"), "bad value '0' for --requests"),
                       ((ok, "-c", cl, "--duration", "x"), "bad value 'x' for --duration"),
                       ((ok, "-c", cl, "--bogus", "1"), "unknown option '--bogus'"),
                       ((ok, "-c", cl, "--pid-dir", d), "--pid-dir and --epoch-file go with "
                                                        "--attach"),
                       ((ok, "-c", cl, "--attach", "http://127.0.0.1:1"),
                        "kill, stop, cont and stall need --pid-dir with --attach"),
                       ((ok, "-c", cl, "--engine", "--attach", "http://127.0.0.1:1"),
                        "--engine starts its own front: it does not go with --attach"),
                       ((ok, "-c", cl, "--engine", "--api-key", "k"),
                        "--engine sends no HTTP request")]:
        err, _ = run("chaos", *args)
        assert want in err, f"{args}: want {want!r} in:\n{err}"
    err, _ = run("node", "-c", cl, "--name", "w0", "--fault-scenario", ok, "--fault-epoch",
                 "soon")
    assert "bad value 'soon' for --fault-epoch" in err, err
    err, _ = run("cluster", "up", cl, "--fault-epoch", "123")
    assert "--fault-epoch needs --fault-scenario" in err, err
    err, _ = run("cluster", "up", cl, "--no-front", "--", "--port", "0")
    assert "--no-front starts no `shoal serve`" in err, err
    out = subprocess.run([su.shoal_binary(), "chaos", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "usage: shoal chaos" in out.stdout, out
    for f in os.listdir(d):
        os.unlink(os.path.join(d, f))
    os.rmdir(d)
    su.log("ok: bad scenarios and flags refused before anything started")


if __name__ == "__main__":
    main()
