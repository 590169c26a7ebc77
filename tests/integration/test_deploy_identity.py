"""Node identity from the environment (issue 29, docs/deploy.md "Node identity"), against real
processes: `shoal node --name-from VAR`, SHOAL_NODE and `shoal serve -c --name-from VAR`.

Cases: a 2-stage pipeline of the default model whose worker w0 takes its name from
HOSTNAME=shoal-0 (a StatefulSet pod's ordinal), w1 from SHOAL_NODE=1 (a bare rank, as Slurm's
SLURM_PROCID gives) and the front from a variable naming it; its greedy completions equal one
process's. Bad input exits 2 with one error line each: a rank with no node (the line gives the
worker count; also a fully qualified host name's, read by its first label), a variable that is
not set, an empty one, a value that is neither a node nor a rank (1.5, banana), --name with
--name-from, no name at all, a front whose variable names a worker.
"""

import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deploy_util as du  # noqa: E402
import serve_util as su  # noqa: E402


def ipc_script(d):
    return du.script(os.path.join(d, "ids.lua"),
                     {n: f"ipc://{d}/{n}.sock" for n in ("front", "w0", "w1")})


def ranks_serve(d, want):
    s = ipc_script(d)
    w0 = du.Proc(["node", "-c", s, "--name-from", "HOSTNAME", "-t", "1"], "w0",
                 {"HOSTNAME": "shoal-0"})
    w1 = du.Proc(["node", "-c", s, "-t", "1"], "w1", {"SHOAL_NODE": "1"})
    front = None
    try:
        w0.wait_for("serving")
        w1.wait_for("serving")
        assert "node w0 (from HOSTNAME=shoal-0, a rank)" in w0.text(), w0.text()[-800:]
        assert "node w1 (from SHOAL_NODE=1, a rank)" in w1.text(), w1.text()[-800:]
        front = du.Proc(["serve", "-c", s, "--port", "0", "--name-from", "ROLE",
                         "--join-timeout", f"{su.scaled(60):g}"], "front", {"ROLE": "front"})
        front.wait_for("listening on")
        assert "node w0 joined" in front.text() and "node w1 joined" in front.text()
        got = du.completions(front.url())
        assert got == want, f"cluster {got} != one process {want}"
    finally:
        if front:
            front.stop()
        w1.stop()
        w0.stop()


def bad_input(d):
    s = ipc_script(d)
    node = ["node", "-c", s, "-t", "1"]
    line = du.fails_with(node + ["--name-from", "HOSTNAME"], ["rank 2", "2 worker nodes"],
                         {"HOSTNAME": "shoal-2"})
    su.log(f"  {line}")
    du.fails_with(node + ["--name-from", "SLURM_PROCID"], ["rank 7", "2 worker nodes"],
                  {"SLURM_PROCID": "7"})
    du.fails_with(node + ["--name-from", "SLURM_PROCID"], ["'1.5'", "neither a node"],
                  {"SLURM_PROCID": "1.5"})
    # A fully qualified host name counts by its first label.
    du.fails_with(node + ["--name-from", "HOSTNAME"], ["rank 5", "shoal-5.shoal.default.svc"],
                  {"HOSTNAME": "shoal-5.shoal.default.svc"})
    line = du.fails_with(node + ["--name-from", "SH_NO_SUCH_VAR"], ["SH_NO_SUCH_VAR", "not set"])
    su.log(f"  {line}")
    du.fails_with(node + ["--name-from", "EMPTY"], ["EMPTY", "empty"], {"EMPTY": ""})
    du.fails_with(node + ["--name-from", "HOSTNAME"], ["'banana'", "neither a node"],
                  {"HOSTNAME": "banana"})
    du.fails_with(node + ["--name", "w0", "--name-from", "HOSTNAME"], ["not both"],
                  {"HOSTNAME": "shoal-0"})
    du.fails_with(node, ["--name NAME", "--name-from VAR", "SHOAL_NODE"])
    du.fails_with(node, ["rank 5"], {"SHOAL_NODE": "5"})
    line = du.fails_with(["serve", "-c", s, "--port", "0", "--name-from", "HOSTNAME"],
                         ["node 'w1'", "gateway", "'front'"], {"HOSTNAME": "shoal-1"})
    su.log(f"  {line}")
    du.fails_with(["serve", "--name-from", "HOSTNAME"], ["needs -c"], {"HOSTNAME": "front"})


def main():
    su.require_model()
    d = tempfile.mkdtemp(prefix="shids-", dir="/tmp")
    r = su.Runner("test_deploy_identity")
    try:
        r.case("bad input: one error line and exit 2 each", bad_input, d)
        want = du.reference()
        r.case("names from HOSTNAME=shoal-0, SHOAL_NODE=1 and a variable naming the front: "
               "completions equal one process", ranks_serve, d, want)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    r.finish()


if __name__ == "__main__":
    main()
