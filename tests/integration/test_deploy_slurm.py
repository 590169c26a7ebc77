"""examples/deploy/slurm/ against a real one-machine Slurm cluster (issue 29, docs/deploy.md
"Slurm"): slurmctld and slurmd from Debian's slurm-wlm, configured here in a temporary directory
(auth/none, proctrack/linuxproc, free ports), run shoal.sbatch for the 2-stage pipeline of the
default model (examples/cluster/pipeline-2stage.lua) as one job step of 3 tasks.

Cases:
- a job with 2 tasks for a script of 3 nodes ends with status 2 and one line asking for
  --ntasks=3;
- the job's output names the front's HTTP address, and the front listens there;
- greedy completions through the front equal a one-process `shoal serve -m` run;
- kill -9 of worker w1's process: shoal-task.sh starts it again, the front's watchdog takes it
  back (--recover-timeout) and greedy completions still equal the one-process run;
- streams in flight when the job is cancelled (`scancel JOBID`: SIGTERM to every task, the
  workers included) each end with a complete response (the text of the one-process run) or an
  error event, then `data: [DONE]`; the job ends by itself after the drain, with no crash in its
  output and no process of it left.
Every daemon and job process is ended at the end, also on failure. Skips (77) when the Slurm
binaries are missing, when not root (slurmd launches tasks) or without the model file.
"""

import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402

SCRIPT = "examples/cluster/pipeline-2stage.lua"
SBATCH = "examples/deploy/slurm/shoal.sbatch"
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
STREAM_PROMPTS = ["Once upon a time, in a small village by the sea,",
                  "The history of the Roman Empire began",
                  "Here is a list of the planets in our solar system:",
                  "In the early twentieth century, the city of London"]
MAX_TOKENS = 24
STREAM_TOKENS = 160
DRAIN_S = 25      # the front's --drain-timeout in the job (KillWait is 45 s below)
BINARIES = ["slurmctld", "slurmd", "sbatch", "srun", "scancel", "squeue", "sinfo", "scontrol"]
LISTEN_RE = re.compile(r"listening on (http://127\.0\.0\.1:(\d+))")
ANNOUNCE_RE = re.compile(r"the front will answer on (http://\S+) once")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_base(n):
    """A port p with p..p+n free on 127.0.0.1 (the job's HTTP port and one per node)."""
    for _ in range(200):
        base = free_port()
        if base + n > 65000:
            continue
        socks = []
        try:
            for k in range(n + 1):
                s = socket.socket()
                s.bind(("127.0.0.1", base + k))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError("no free range of ports")


CONF = """\
ClusterName=shoaltest
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
KillWait=45
SlurmdParameters=config_overrides
NodeName=localhost NodeAddr=127.0.0.1 CPUs=8 RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
"""


def _die_with_parent():
    """In a daemon's child before exec: SIGTERM it when this test dies (even by SIGKILL)."""
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Stop(BaseException):  # not caught by Runner.case: it ends the test
    pass


def _stop(signum, _frame):
    raise Stop(f"stopped by {signal.Signals(signum).name}: cleaning up")


class Slurm:
    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="shoal-slurm-")
        self.conf = os.path.join(self.dir, "slurm.conf")
        for sub in ("state", "spool"):
            os.mkdir(os.path.join(self.dir, sub))
        with open(self.conf, "w") as f:
            f.write(CONF.format(d=self.dir, ctld_port=free_port(), d_port=free_port()))
        self.env = dict(os.environ, SLURM_CONF=self.conf)
        self.daemons = []

    def start(self):
        for argv, name in ((["slurmctld", "-D", "-i"], "ctld"),
                           (["slurmd", "-D", "-N", "localhost"], "d")):
            out = open(os.path.join(self.dir, name + ".out"), "wb")
            self.daemons.append(subprocess.Popen(argv, env=self.env, stdin=subprocess.DEVNULL,
                                                 stdout=out, stderr=out,
                                                 start_new_session=True,
                                                 preexec_fn=_die_with_parent))
            out.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            r = self.run(["sinfo", "-h", "-o", "%T"], check=False)
            if r.returncode == 0 and r.stdout.strip() == "idle":
                return
            time.sleep(0.3)
        raise AssertionError("the Slurm node did not become idle in 30 s\n" + self.logs())

    def run(self, argv, check=True):
        r = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=30,
                           cwd=su.ROOT)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {r.returncode}: {r.stderr.strip()}")
        return r

    def logs(self):
        out = []
        for name in ("ctld.out", "d.out", "slurmctld.log", "slurmd.log"):
            p = os.path.join(self.dir, name)
            if os.path.exists(p):
                with open(p, errors="replace") as f:
                    out.append(f"--- {name} ---\n" + "".join(f.readlines()[-15:]))
        return "\n".join(out)

    def ours(self):
        """Pids of every process started under this Slurm (the daemons, slurmstepd, the job's
        processes): their environment names this configuration."""
        key = ("SLURM_CONF=" + self.conf).encode()
        pids = []
        for p in os.listdir("/proc"):
            if not p.isdigit() or int(p) == os.getpid():
                continue
            try:
                with open(f"/proc/{p}/environ", "rb") as f:
                    if key in f.read().split(b"\0"):
                        pids.append(int(p))
            except OSError:
                pass
        return pids

    def stop(self):
        self.run(["scancel", "--user=root"], check=False)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            r = self.run(["squeue", "-h"], check=False)
            if r.returncode != 0 or not r.stdout.strip():
                break
            time.sleep(0.5)
        for p in self.daemons:
            if p.poll() is None:
                p.terminate()
        for p in self.daemons:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        left = self.ours()
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        shutil.rmtree(self.dir, ignore_errors=True)
        return left


class Stream(threading.Thread):
    """One streaming completion, its events kept as they arrive."""

    def __init__(self, url, prompt):
        super().__init__(daemon=True)
        self.url, self.prompt = url, prompt
        self.events, self.error = [], None

    def run(self):
        host, port = su._hostport(self.url)
        conn = http.client.HTTPConnection(host, port, timeout=120)
        try:
            conn.request("POST", "/v1/completions", body=json.dumps(
                {"prompt": self.prompt, "max_tokens": STREAM_TOKENS, "temperature": 0,
                 "stream": True}), headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                self.error = f"status {resp.status}: {resp.read()[:200]!r}"
                return
            while True:
                line = resp.readline()
                if not line:
                    break
                line = line.decode().rstrip("\r\n")
                if line.startswith("data:"):
                    p = line[5:].strip()
                    self.events.append(p if p == "[DONE]" else json.loads(p))
        except Exception as exc:  # noqa: BLE001 - reported as this stream's failure
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            conn.close()

    def text(self):
        return "".join(e["choices"][0].get("text", "") for e in self.events
                       if isinstance(e, dict) and e.get("choices"))


def proc_is(pid, arg, env):
    """Process pid has `arg` on its command line and `env` in its environment."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().split(b"\0")
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read().split(b"\0")
    except OSError:
        return False
    return arg in cmd and env in environ and os.path.basename(cmd[0]) == b"shoal"


def completion(url, prompt, max_tokens):
    status, body, raw = su.post_json(url, "/v1/completions", {
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}, timeout=120)
    if status != 200:
        raise AssertionError(f"{prompt!r}: status {status}: {raw[:300]!r}")
    return body["choices"][0]["text"]


def main():
    missing = [b for b in BINARIES if not shutil.which(b)]
    if missing:
        su.skip("Slurm binaries missing: " + " ".join(missing) + " (Debian: slurm-wlm)")
    if os.geteuid() != 0:
        su.skip("slurmd must run as root to launch tasks")
    su.require_model()
    r = su.Runner("deploy_slurm")

    # The one-process reference, before the cluster (2 cores: one thing at a time).
    ref = {}
    with su.server("-t", "2") as srv:
        for p in PROMPTS:
            ref[p] = completion(srv.url, p, MAX_TOKENS)
        for p in STREAM_PROMPTS:
            ref[p] = completion(srv.url, p, STREAM_TOKENS)

    slurm = Slurm()
    out = os.path.join(slurm.dir, "job.out")
    job = None
    # Whatever stops this test (ctest's timeout sends SIGTERM first where it can, a person
    # Ctrl-C), the cleanup below runs: the daemons and the job's processes are ended. Our own
    # bound comes before ctest's (300 s).
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM):
        signal.signal(sig, _stop)
    signal.alarm(int(su.scaled(250)))
    try:
        slurm.start()
        base = free_base(3)
        env_add = {"SHOAL_BIN": su.shoal_binary(), "SHOAL_PORT_BASE": str(base),
                   "SHOAL_DRAIN_TIMEOUT": str(DRAIN_S)}
        slurm.env.update(env_add)
        def wrong_count():
            bad_out = os.path.join(slurm.dir, "bad.out")
            bad = slurm.run(["sbatch", "--parsable", "--ntasks=2", "--cpus-per-task=1", "-o",
                             bad_out, "--chdir", su.ROOT, SBATCH, SCRIPT]).stdout.strip()
            bad = bad.split(";")[0]
            deadline = time.monotonic() + 60
            while slurm.run(["squeue", "-h", "-j", bad], check=False).stdout.strip():
                if time.monotonic() > deadline:
                    raise AssertionError("the job with 2 tasks did not end")
                time.sleep(0.3)
            info = slurm.run(["scontrol", "show", "job", "-o", bad]).stdout
            with open(bad_out, errors="replace") as f:
                errs = [ln for ln in f.read().splitlines() if ln.startswith("error: ")]
            if "ExitCode=2:0" not in info or len(errs) != 1 or "--ntasks=3" not in errs[0]:
                raise AssertionError(f"want exit 2 and one line asking for --ntasks=3: {errs}, "
                                     + re.search(r"ExitCode=\S+", info).group(0))
            left = [p for p in os.listdir(os.path.join(su.ROOT, "examples/cluster"))
                    if p.startswith(f".shoal-slurm-{bad}")]
            if left:
                raise AssertionError(f"left behind: {left}")
        r.case("a job with the wrong number of tasks: one line naming the count, exit 2",
               wrong_count)

        job = slurm.run(["sbatch", "--parsable", "--ntasks=3", "--cpus-per-task=1", "-o", out,
                         "--chdir", su.ROOT, SBATCH, SCRIPT]).stdout.strip().split(";")[0]
        su.log(f"submitted job {job} (ports from {base})")

        def text():
            try:
                with open(out, errors="replace") as f:
                    return f.read()
            except OSError:
                return ""

        url = None
        deadline = time.monotonic() + su.scaled(120)
        while time.monotonic() < deadline and not url:
            m = LISTEN_RE.search(text())
            if m:
                url = m.group(1)
            elif not slurm.run(["squeue", "-h", "-j", job], check=False).stdout.strip():
                break
            else:
                time.sleep(0.3)
        if not url:
            raise AssertionError("the front did not listen within 120 s\n--- job output ---\n"
                                 + text()[-4000:] + "\n" + slurm.logs())

        def announced():
            m = ANNOUNCE_RE.search(text())
            want = f"http://127.0.0.1:{base}"
            if not m or m.group(1) != want or url != want:
                raise AssertionError(f"announced {m and m.group(1)}, listening on {url}, "
                                     f"want {want}")
        r.case("the job's output names the front's HTTP address", announced)

        def greedy():
            for p in PROMPTS:
                got = completion(url, p, MAX_TOKENS)
                if got != ref[p]:
                    raise AssertionError(f"{p!r}: cluster {got!r} != one process {ref[p]!r}")
        r.case("greedy completions through the front equal one process", greedy)

        def worker_killed():
            pids = [pid for pid in slurm.ours() if proc_is(pid, b"--name-from", b"SHOAL_RANK=1")]
            if len(pids) != 1:
                raise AssertionError(f"want one process of worker rank 1, found {pids}")
            before = text().count("came back")
            os.kill(pids[0], signal.SIGKILL)
            for p in PROMPTS[:2]:
                got = completion(url, p, MAX_TOKENS)
                if got != ref[p]:
                    raise AssertionError(f"{p!r} after the kill: {got!r} != {ref[p]!r}")
            t = text()
            if "shoal-task 2: the node exited (status 137)" not in t or t.count("came back") <= before:
                raise AssertionError("no restart by the wrapper and return to the front:\n"
                                     + t[-2000:])
        r.case("kill -9 of a worker: its task's wrapper starts it again, the front resumes and "
               "greedy completions still equal one process", worker_killed)

        streams = [Stream(url, p) for p in STREAM_PROMPTS]
        for s in streams:
            s.start()
        deadline = time.monotonic() + su.scaled(60)
        while time.monotonic() < deadline and not all(
                len(s.events) >= 2 or not s.is_alive() for s in streams):
            time.sleep(0.05)
        running = sum(s.is_alive() for s in streams)
        su.log("     at scancel: " + ", ".join(f"{len(s.events)} events" + ("" if s.is_alive()
                                                                          else " (ended)")
                                          for s in streams))
        for s in streams:
            if not s.is_alive():
                su.log(f"     {s.prompt!r} ended before scancel: {s.error or s.events!r}")
        t0 = time.monotonic()
        slurm.run(["scancel", job])
        for s in streams:
            s.join(timeout=DRAIN_S + 30)

        def cancelled():
            if running < len(streams):
                raise AssertionError(f"only {running} of {len(streams)} streams were running "
                                     "at scancel (too fast to test the drain)")
            bad = []
            done = errored = 0
            for s in streams:
                ev = s.events
                if s.is_alive():
                    bad.append(f"{s.prompt!r}: still open {DRAIN_S + 30} s after scancel")
                elif s.error:
                    bad.append(f"{s.prompt!r}: {s.error}")
                elif not ev or ev[-1] != "[DONE]":
                    bad.append(f"{s.prompt!r}: did not end with [DONE] ({ev[-2:]!r})")
                elif isinstance(ev[-2], dict) and "error" in ev[-2]:
                    errored += 1
                elif not any(isinstance(e, dict) and e.get("choices") and
                             e["choices"][0].get("finish_reason") for e in ev):
                    bad.append(f"{s.prompt!r}: no finish_reason and no error event")
                elif s.text() != ref[s.prompt]:
                    bad.append(f"{s.prompt!r}: {s.text()!r} != one process {ref[s.prompt]!r}")
                else:
                    done += 1
            su.log(f"     after scancel: {done} complete, {errored} ended by an error event "
                   f"({time.monotonic() - t0:.1f} s)")
            if bad:
                raise AssertionError("; ".join(bad) + "\n--- job output ---\n" + text()[-3000:])
        r.case("scancel: every stream ends complete or with an error event, then [DONE]",
               cancelled)

        def ended():
            deadline = time.monotonic() + DRAIN_S + 30
            while slurm.run(["squeue", "-h", "-j", job], check=False).stdout.strip():
                if time.monotonic() > deadline:
                    raise AssertionError("the job was still queued or running "
                                         f"{DRAIN_S + 30} s after scancel")
                time.sleep(0.3)
            t = text()
            for ln in t.splitlines():
                if re.search(r"shoal-task|drain|resum|lost|dead|joined again|rejoin", ln):
                    su.log("     job: " + ln[:160])
            crash = [ln for ln in t.splitlines() if any(p in ln for p in su.CRASH_PATTERNS)]
            if crash:
                raise AssertionError("crash output in the job:\n" + "\n".join(crash[:10]))
            if "drained, shutting down" not in t:
                raise AssertionError("the front did not drain:\n" + t[-3000:])
            leftovers = [p for p in os.listdir(os.path.join(su.ROOT, "examples/cluster"))
                         if p.startswith(f".shoal-slurm-{job}")]
            if leftovers:
                raise AssertionError(f"the job's script was left behind: {leftovers}")
        r.case("the job ends by itself after the drain, without crash output", ended)
    except (AssertionError, Stop) as exc:
        r.fail("slurm job", str(exc))
    finally:
        signal.alarm(0)
        left = slurm.stop()
        stale = [p for p in os.listdir(os.path.join(su.ROOT, "examples/cluster"))
                 if job and p.startswith(f".shoal-slurm-{job}")]
        for p in stale:
            os.unlink(os.path.join(su.ROOT, "examples/cluster", p))
        job_left = [p for p in left if p]
        if job_left:
            su.log(f"     killed {len(job_left)} leftover processes of the test's Slurm")
    r.finish()


if __name__ == "__main__":
    main()
