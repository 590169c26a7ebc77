"""Host names in a cluster script's addresses (issue 29, docs/deploy.md "Host names"), against real
processes in a network namespace of their own: this test re-runs itself under `unshare -n -m`
(root; skipped with 77 where that is not permitted), bind-mounts a temporary hosts file over
/etc/hosts there and brings `lo` up, so the names resolve through that file alone.

Cases, for a 2-stage pipeline of the default model whose nodes listen on tcp://shoal-front.shoal,
tcp://shoal-0.shoal and tcp://shoal-1.shoal (each on its own 127.x address), the workers named
by HOSTNAME=shoal-0 and shoal-1 (--name-from HOSTNAME):
- DNS not ready: shoal-1.shoal is missing from the hosts file when the nodes and the front start;
  w1 waits for its own name, the front keeps dialling it; once the name is added both go on, and
  greedy completions through the front equal one process's;
- a restart at another address (a pod rescheduled): w1 is killed and started again with its
  name moved to another address; the front resolves it again, rejoins it and resumes, and the
  completions still equal one process's;
- three workers named by their ordinals alone (HOSTNAME=shoal-0, shoal-1, shoal-2, as a
  StatefulSet's pods), a 3-stage pipeline over shoal-0.shoal ... shoal-2.shoal: greedy
  completions through the front equal one process's;
- a name that never resolves: the front's join timeout (2 s) names the host, exit 2, one line;
  `shoal node` for that node gives up after its --join-timeout (1 s) naming it, exit 2, one line.
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deploy_util as du  # noqa: E402
import serve_util as su  # noqa: E402

ADDR = {"shoal-front.shoal": "127.0.1.1", "shoal-0.shoal": "127.0.2.1",
        "shoal-1.shoal": "127.0.2.2"}
MOVED = "127.0.2.3"
URLS = {"front": "tcp://shoal-front.shoal:7000", "w0": "tcp://shoal-0.shoal:7001",
        "w1": "tcp://shoal-1.shoal:7001"}


def write_hosts(path, names):
    """Rewrites the hosts file in place (the bind mount follows the inode, not the name)."""
    text = "127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a in names.items())
    with open(path, "r+") as f:
        f.seek(0)
        f.write(text)
        f.truncate()


def resolves(name):
    import socket
    try:
        socket.getaddrinfo(name, 7000)
        return True
    except socket.gaierror:
        return False


def not_ready_then_moved(d, hosts, want):
    names = {n: a for n, a in ADDR.items() if n != "shoal-1.shoal"}
    write_hosts(hosts, names)
    assert not resolves("shoal-1.shoal") and resolves("shoal-0.shoal"), open(hosts).read()
    s = du.script(os.path.join(d, "dns.lua"), URLS)
    node = ["node", "-c", s, "--name-from", "HOSTNAME", "-t", "1"]
    w0 = du.Proc(node, "w0", {"HOSTNAME": "shoal-0"})
    w1 = du.Proc(node + ["--join-timeout", "120"], "w1", {"HOSTNAME": "shoal-1"})
    front = None
    try:
        w0.wait_for("serving")
        front = du.Proc(["serve", "-c", s, "--port", "0", "--host", "127.0.0.1",
                         "--join-timeout", f"{su.scaled(90):g}", "--recover-timeout", "60"],
                        "front")
        front.wait_for("node w0 joined")
        time.sleep(2.0)  # both wait on the missing name meanwhile
        assert "serving" not in w1.text() and w1.proc.poll() is None, w1.text()[-800:]
        assert "listening on" not in front.text(), front.text()[-800:]
        names["shoal-1.shoal"] = ADDR["shoal-1.shoal"]
        write_hosts(hosts, names)
        t0 = time.monotonic()
        w1.wait_for("serving")
        front.wait_for("listening on")
        su.log(f"  name added: w1 serving and the front listening {time.monotonic() - t0:.1f} s "
               "later")
        got = du.completions(front.url())
        assert got == want, f"cluster {got} != one process {want}"
        # w1 rescheduled: another address under the same name.
        w1.proc.send_signal(signal.SIGKILL)
        w1.proc.wait()
        names["shoal-1.shoal"] = MOVED
        write_hosts(hosts, names)
        w1b = du.Proc(node, "w1-moved", {"HOSTNAME": "shoal-1"})
        try:
            w1b.wait_for("serving")
            assert MOVED in open(hosts).read()
            front.wait_for("(a new process)", su.scaled(60))
            got = du.completions(front.url())
            assert got == want, f"after the move {got} != one process {want}"
            su.log("  w1 restarted at " + MOVED + ": rejoined, completions equal")
        finally:
            front.stop()
            front = None
            w1b.stop()
    finally:
        if front:
            front.stop()
        if w1.proc.poll() is None:
            w1.stop()
        w0.stop()


def three_ordinals(d, hosts, want):
    names = dict(ADDR, **{"shoal-2.shoal": "127.0.2.4"})
    write_hosts(hosts, names)
    urls = dict(URLS, w2="tcp://shoal-2.shoal:7001")
    s = du.script(os.path.join(d, "three.lua"), urls, workers=("w0", "w1", "w2"))
    node = ["node", "-c", s, "--name-from", "HOSTNAME", "-t", "1"]
    ws = [du.Proc(node, f"w{k}", {"HOSTNAME": f"shoal-{k}"}) for k in range(3)]
    front = None
    try:
        for k, w in enumerate(ws):
            w.wait_for("serving")
            assert f"node w{k} (from HOSTNAME=shoal-{k}, a rank)" in w.text(), w.text()[-800:]
        front = du.Proc(["serve", "-c", s, "--port", "0", "--host", "127.0.0.1",
                         "--join-timeout", f"{su.scaled(90):g}"], "front")
        front.wait_for("listening on")
        got = du.completions(front.url())
        assert got == want, f"3 stages {got} != one process {want}"
    finally:
        if front:
            front.stop()
        for w in ws:
            w.stop()


def never_resolves(d, hosts):
    write_hosts(hosts, ADDR)
    urls = dict(URLS, w1="tcp://shoal-9.shoal:7001")
    s = du.script(os.path.join(d, "never.lua"), urls)
    t0 = time.monotonic()
    line = du.fails_with(["serve", "-c", s, "--port", "0", "--host", "127.0.0.1",
                          "--join-timeout", "2"],
                         ["did not join within 2.0 s", "host shoal-9.shoal did not resolve",
                          "'w1'", "'w0'"])
    su.log(f"  front ({time.monotonic() - t0:.1f} s): {line}")
    t0 = time.monotonic()
    line = du.fails_with(["node", "-c", s, "--name", "w1", "-t", "1", "--join-timeout", "1"],
                         ["cannot listen on tcp://shoal-9.shoal:7001",
                          "host shoal-9.shoal did not resolve within 1.0 s"])
    dt = time.monotonic() - t0
    su.log(f"  node ({dt:.1f} s): {line}")
    assert dt < su.scaled(30), f"took {dt:.1f} s"


def inner(hosts):
    su.require_model()
    d = tempfile.mkdtemp(prefix="shdns-", dir="/tmp")
    r = su.Runner("test_deploy_dns")
    try:
        r.case("a name that never resolves: named by the join timeouts, exit 2",
               never_resolves, d, hosts)
        write_hosts(hosts, ADDR)
        want = du.reference()
        r.case("three workers named by ordinal (shoal-0 ... shoal-2), names from the hosts "
               "file: completions equal one process", three_ordinals, d, hosts, want)
        write_hosts(hosts, ADDR)
        r.case("DNS not ready at start, then a restart at another address: completions equal "
               "one process", not_ready_then_moved, d, hosts, want)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    r.finish()


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--inner":
        inner(sys.argv[2])
        return
    su.require_model()
    su.shoal_binary()
    if os.geteuid() != 0:
        su.skip("not root: unshare -n -m is not permitted")
    if not shutil.which("unshare") or not shutil.which("ip"):
        su.skip("no unshare or ip command")
    p = subprocess.run(["unshare", "-n", "-m", "true"], capture_output=True, text=True)
    if p.returncode != 0:
        su.skip(f"unshare -n -m is not permitted: {p.stderr.strip()}")
    fd, hosts = tempfile.mkstemp(prefix="shoal-hosts-")
    os.close(fd)
    try:
        write_hosts(hosts, ADDR)
        cmd = (f"mount --bind {hosts} /etc/hosts && ip link set lo up && "
               f"exec {sys.executable} {os.path.abspath(__file__)} --inner {hosts}")
        p = subprocess.run(["unshare", "-n", "-m", "sh", "-c", cmd])
        sys.exit(p.returncode)
    finally:
        os.unlink(hosts)


if __name__ == "__main__":
    main()
