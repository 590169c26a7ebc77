"""Bad input to a cluster (issue 11's acceptance), against real processes and real sockets: each
case must end in exit code 2 with one `error:` line naming the culprit, within a bound, never a
hang.

Cases: a layer split that overlaps; a stage on a node the script does not define; bad weights
(wrong count, not a positive number, more stages than the model has layers); a tcp:// URL nobody
listens on (the join timeout names the node and its link's last error); a worker of another build
version and one of another protocol version (made with the testing aids SHOAL_TEST_BUILD_VERSION
and SHOAL_TEST_PROTO_VERSION, docs/cluster.md); a wrong cluster key; a key on one side only, each
way; a key file that is not one (node, serve and cluster up); as the control that shows these
refusals are about the key, the same key on every node joins and serves (with a split by weight
resolved at load); and a STEP sent straight
to a worker's socket by a process whose connection proved no node in HELLO is dropped and
logged (event=frame_refused, with a key and without: issue 25). A node
named twice, a split with a gap, a different model file and a worker that never starts are
tested in test_cluster_pipeline.py.
"""

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402
from test_cluster_pipeline import Node  # noqa: E402

STORIES = os.path.join(su.ROOT, "tests", "data", "stories260K", "stories260K.gguf")  # 5 layers
EXIT_BOUND = 30.0  # every refusal must come well within this


def _proto_version():
    """This build's SH_PROTO_VERSION, read from its header (frames forged here must speak it)."""
    with open(os.path.join(su.ROOT, "include", "shoal", "version.h")) as f:
        return int(re.search(r"#define SH_PROTO_VERSION (\d+)u", f.read()).group(1))


PROTO = _proto_version()


def write_script(path, workers, stages=None, extra="", urls=None):
    """A cluster script for stories260K: 'front' plus `workers` over ipc:// in the script's
    directory (or urls[name]); stages defaults to pipeline(m, workers)."""
    d = os.path.dirname(path)
    urls = urls or {}
    names = ["front"] + list(workers)
    nodes = ", ".join(f"node {{ name = '{n}', listen = '{urls.get(n, f'ipc://{d}/{n}.sock')}' }}"
                      for n in names)
    st = stages or "pipeline(m, { " + ", ".join(f"'{w}'" for w in workers) + " })"
    with open(path, "w") as f:
        f.write(f"local m = model {{ path = '{STORIES}', name = 'm' }}\n"
                "return cluster {\n"
                f"  nodes = {{ {nodes} }},\n"
                "  gateway = { node = 'front', http = '127.0.0.1:8080' },\n"
                f"  replicas = {{ replica {{ model = m, stages = {st} }} }},\n"
                "  batcher = { max_seqs = 8, max_step_tokens = 256 },\n"
                f"  kv = {{ memory = '16MiB' }},\n{extra}"
                "}\n")
    return path


def write_key(d, name, text):
    p = os.path.join(d, name)
    with open(p, "w") as f:
        f.write(text + "\n")
    os.chmod(p, 0o600)
    return p


def env_with(**kw):
    env = dict(os.environ)
    for k in ("SHOAL_CLUSTER_KEY_FILE", "SHOAL_TEST_BUILD_VERSION", "SHOAL_TEST_PROTO_VERSION"):
        env.pop(k, None)
    env.update({k: v for k, v in kw.items() if v is not None})
    return env


class Worker(Node):
    """`shoal node -c SCRIPT --name NAME` with the test's environment; stop() raises on a
    problem (not exit 0, crash lines, no stop on SIGTERM)."""

    def __init__(self, script, name, *args, env=None):
        super().__init__(script, name, *args, env=env or env_with())

    def stop(self):
        problems = super().stop()
        assert not problems, "\n".join(problems)


def exits_2(argv, want, env=None, bound=EXIT_BOUND):
    """Runs argv (a shoal command); it must exit 2 within bound with exactly one `error:` line
    that contains every string of `want`. Returns (the error line, seconds)."""
    t0 = time.monotonic()
    p = subprocess.run([su.shoal_binary(), *argv], cwd=su.ROOT, stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=bound, env=env or env_with())
    dt = time.monotonic() - t0
    assert p.returncode == 2, f"{argv[:2]}: exit {p.returncode}, want 2:\n{p.stderr[-2000:]}"
    errs = [ln for ln in p.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errs) == 1, f"want one error line:\n{p.stderr[-2000:]}"
    for w in want:
        assert w in errs[0], f"{errs[0]!r} lacks {w!r}"
    su.log(f"  {argv[0]}: {errs[0]} ({dt:.1f} s)")
    return errs[0], dt


def front(script, want, *args, env=None, bound=EXIT_BOUND):
    return exits_2(["serve", "-c", script, "--port", "0", *args], want, env=env, bound=bound)


def node(script, name, want, *args, env=None):
    return exits_2(["node", "-c", script, "--name", name, "-t", "1", *args], want, env=env)


def overlap(d):
    s = write_script(os.path.join(d, "overlap.lua"), ["w0", "w1"],
                     stages="{ { node = 'w0', first_layer = 0, last_layer = 3 },\n"
                     "    { node = 'w1', first_layer = 2, last_layer = 5 } }")
    want = ["overlap.lua:5", "replica 1 stage 2: layers [2, 5) do not continue from layer 3"]
    front(s, want)
    node(s, "w1", want)


def undefined_node(d):
    s = write_script(os.path.join(d, "undef.lua"), ["w0"], stages="pipeline(m, { 'w0', 'w9' })")
    want = ["undef.lua:5", "unknown node 'w9'"]
    front(s, want)
    node(s, "w0", want)
    g = write_script(os.path.join(d, "undef-gw.lua"), ["w0"])
    with open(g) as f:
        text = f.read().replace("node = 'front', http", "node = 'gw', http")
    with open(g, "w") as f:
        f.write(text)
    front(g, ["cluster.gateway: unknown node 'gw'"])


def bad_weights(d):
    s = write_script(os.path.join(d, "w-count.lua"), ["w0", "w1"],
                     stages="pipeline(m, { 'w0', 'w1' }, { weights = { 2, 1, 1 } })")
    want = ["w-count.lua:5", "weights has 3 entries for 2 nodes"]
    front(s, want)
    node(s, "w0", want)
    s = write_script(os.path.join(d, "w-neg.lua"), ["w0", "w1"],
                     stages="pipeline(m, { 'w0', 'w1' }, { weights = { 2, -1 } })")
    front(s, ["w-neg.lua:5", "weights[2] must be a positive number", "got -1"])
    s = write_script(os.path.join(d, "w-str.lua"), ["w0", "w1"],
                     stages="pipeline(m, { 'w0', 'w1' }, { weights = { 'two', 1 } })")
    front(s, ["w-str.lua:5", "weights[1] must be a positive number", "got a string"])
    # The model's 5 layers are known only when it is loaded: 6 weighted stages cannot be split.
    ws = [f"w{i}" for i in range(6)]
    s = write_script(os.path.join(d, "w-many.lua"), ws,
                     stages="pipeline(m, { " + ", ".join(f"'{w}'" for w in ws) + " }, "
                     "{ weights = { 1, 1, 1, 1, 1, 1 } })")
    want = ["w-many.lua", "6 stages", "5 layers"]
    front(s, want)
    node(s, "w3", want)


def free_tcp_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nobody_listens(d):
    url = f"tcp://127.0.0.1:{free_tcp_port()}"
    s = write_script(os.path.join(d, "nobody.lua"), ["w0"], urls={"w0": url})
    line, dt = front(s, ["1 of 1 worker nodes did not join within 2.0 s", f"'w0' ({url}",
                         "Connection refused"], "--join-timeout", "2")
    assert dt < 10, f"took {dt:.1f} s"


def other_build(d):
    s = write_script(os.path.join(d, "build.lua"), ["w0"])
    w = Worker(s, "w0", env=env_with(SHOAL_TEST_BUILD_VERSION="9.9.9-other")).wait_ready()
    try:
        front(s, ["node 'w0'", "refused", "build version: here ", "there 9.9.9-other"])
    finally:
        w.stop()


def other_protocol(d):
    s = write_script(os.path.join(d, "proto.lua"), ["w0"])
    w = Worker(s, "w0", env=env_with(SHOAL_TEST_PROTO_VERSION="7")).wait_ready()
    try:
        line, dt = front(s, ["did not join", "'w0'", "peer speaks protocol 7, this build speaks"],
                         "--join-timeout", "3")
        assert dt < 15, f"took {dt:.1f} s"
        # The worker saw the front's frames as another protocol's too, and said so in its log.
        w.wait_log(f"protocol version {PROTO} not supported (this node speaks 7)")
    finally:
        w.stop()


def wrong_key(d):
    ka = write_key(d, "a.key", "the-cluster-key-of-machine-a")
    kb = write_key(d, "b.key", "another-cluster-key-entirely")
    s = write_script(os.path.join(d, "wrongkey.lua"), ["w0"])
    w = Worker(s, "w0", "--cluster-key-file", ka).wait_ready()
    try:
        front(s, ["node 'w0'", "refused: wrong cluster key"], "--cluster-key-file", kb)
        # The worker refused the front too, in one line that names it.
        w.wait_log("event=hello_refused")
        refusals = [ln for ln in w.text().splitlines() if "event=hello_refused" in ln]
        assert "front" in refusals[0] and "wrong cluster key" in refusals[0], refusals
        assert ka not in w.text() and "the-cluster-key-of" not in w.text()
    finally:
        w.stop()


def key_one_side(d):
    k = write_key(d, "one.key", "only-one-side-holds-this-key")
    s = write_script(os.path.join(d, "oneside.lua"), ["w0"])
    # The front has a key (from the environment), the worker none.
    w = Worker(s, "w0").wait_ready()
    try:
        front(s, ["node 'w0'", "refused", "this node has a cluster key and 'w0' has none"],
              env=env_with(SHOAL_CLUSTER_KEY_FILE=k))
        w.wait_log("it has a cluster key and this node has none")
    finally:
        w.stop()
    # The worker has a key (from its script's key_file), the front none (its script has no
    # key_file; the URLs are the same).
    ks = write_script(os.path.join(d, "oneside-w.lua"), ["w0"], extra="  key_file = 'one.key',\n")
    w = Worker(ks, "w0").wait_ready()
    try:
        front(s, ["node 'w0'", "refused", "'w0' has a cluster key and this node has none"])
        w.wait_log("it has no cluster key and this node has one")
    finally:
        w.stop()


def bad_key_file(d):
    s = write_script(os.path.join(d, "badkey.lua"), ["w0"])
    short = write_key(d, "short.key", "too-short")
    node(s, "w0", ["cluster key (from --cluster-key-file)", "/dev/null: not a regular file"],
         "--cluster-key-file", "/dev/null")
    front(s, ["cluster key (from SHOAL_CLUSTER_KEY_FILE)", "short.key",
              "at least 16 bytes (this one has 9)"], env=env_with(SHOAL_CLUSTER_KEY_FILE=short))
    exits_2(["cluster", "up", s, "--cluster-key-file", os.path.join(d, "missing.key")],
            ["cluster key (from --cluster-key-file)", "missing.key: cannot open"])


def standby_with_key(d):
    """Standby nodes do not work with a cluster key yet: the front and the standby refuse it."""
    s = write_script(os.path.join(d, "sbkey.lua"), ["w0"], extra="  key_file = 'sb.key',\n")
    with open(s) as f:
        text = f.read()
    spare = f"node {{ name = 'spare', listen = 'ipc://{d}/spare.sock', standby = true }}"
    text = text.replace("  nodes = { ", "  nodes = { " + spare + ", ", 1)
    with open(s, "w") as f:
        f.write(text)
    write_key(d, "sb.key", "the-cluster-key-of-the-standby-case")
    want = ["sbkey.lua", "node 'spare' is a standby", "do not work with a cluster key yet"]
    front(s, want)
    node(s, "spare", want)


def same_key_joins(d):
    k = write_key(d, "same.key", "both-sides-hold-this-very-key")
    # The split is by weight, resolved when the model is loaded (the script does not know the
    # layer count): 4 : 1 over stories260K's 5 layers.
    s = write_script(os.path.join(d, "same.lua"), ["w0", "w1"], extra="  key_file = 'same.key',\n",
                     stages="pipeline(m, { 'w0', 'w1' }, { weights = { 4, 1 } })")
    ws = [Worker(s, "w0").wait_ready(), Worker(s, "w1", "--cluster-key-file", k).wait_ready()]
    try:
        assert "serving stage 1 layers [0, 4)" in ws[0].text(), ws[0].text()
        assert "serving stage 2 layers [4, 5)" in ws[1].text(), ws[1].text()
        srv = su.start("-c", s, "--join-timeout", "30", model=None,
                       env=env_with(SHOAL_CLUSTER_KEY_FILE=k))
        try:
            log = srv.log_text()
            assert "node w0 joined" in log and "node w1 joined" in log, log[-2000:]
            status, parsed, raw = su.post_json(srv.url, "/v1/completions", {
                "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}, timeout=60)
            assert status == 200, raw[:300]
            assert parsed["usage"]["completion_tokens"] == 8, parsed
        finally:
            problems = su.stop(srv)
        assert not problems, "\n".join(problems)
        # w1 takes ACT from w0: the two workers proved the key to each other, and nothing was
        # refused anywhere.
        for w in ws:
            assert "hello_refused" not in w.text() and "auth_refused" not in w.text(), w.text()
    finally:
        for w in ws:
            w.stop()


def mp_uint(v):
    """msgpack's shortest unsigned integer."""
    if v < 0x80:
        return bytes([v])
    for tag, n in ((0xcc, 1), (0xcd, 2), (0xce, 4), (0xcf, 8)):
        if v < 1 << (8 * n):
            return bytes([tag]) + v.to_bytes(n, "big")
    raise ValueError(v)


def crc32c(data):
    """CRC-32C (Castagnoli), bit by bit: the seal after every frame between nodes."""
    c = 0xffffffff
    for x in data:
        c ^= x
        for _ in range(8):
            c = (c >> 1) ^ 0x82f63b78 if c & 1 else c >> 1
    return c ^ 0xffffffff


def rogue_step(sock_path, src, dst):
    """Dials a node's ipc:// listener as NNG's push0 would and sends one STEP frame (an empty
    body) claiming to come from `src`: what anyone who can reach the socket can do."""
    with socket.socket(socket.AF_UNIX) as c:
        c.settimeout(10)
        c.connect(sock_path)
        c.sendall(bytes([0, ord("S"), ord("P"), 0, 0, 0x50, 0, 0]))  # SP, pipeline0 push
        hs = b""
        while len(hs) < 8:
            got = c.recv(8 - len(hs))
            assert got, "the node closed the connection during the handshake"
            hs += got
        frame = bytes([0x98]) + b"".join(mp_uint(v) for v in (
            0x5348, PROTO, 6, 0, src, dst, 0)) + bytes([0x80])  # [magic, version, STEP, ...], {}
        # Sealed with its CRC-32C as a node does (runtime/msg.h): the seal catches changed
        # bytes, it proves nothing about the sender (the key does).
        frame += crc32c(frame).to_bytes(4, "little")
        c.sendall(bytes([1]) + len(frame).to_bytes(8, "big") + frame)
        time.sleep(0.3)


def unauthenticated_step(d):
    k = write_key(d, "gate.key", "the-key-a-rogue-does-not-hold")
    s = write_script(os.path.join(d, "gate.lua"), ["w0"])
    sock = os.path.join(d, "w0.sock")
    stage = (2 << 32) | 2  # w0 is node 2; its first stage is actor 2
    claimed_front = (1 << 32) | 3
    w = Worker(s, "w0", "--cluster-key-file", k).wait_ready()
    try:
        rogue_step(sock, claimed_front, stage)
        w.wait_log("event=frame_refused")
        line = next(ln for ln in w.text().splitlines() if "event=frame_refused" in ln)
        assert "reason=unproved" in line and "claimed_node=1" in line and "what=STEP" in line, \
            line
        assert "stage_step_failed" not in w.text(), w.text()[-1500:]
    finally:
        w.stop()
    # Without a key the frame is refused too (issue 25): its connection greeted as no node, and
    # a frame acts only as the node its own connection named in HELLO; it never reaches the stage.
    w = Worker(s, "w0").wait_ready()
    try:
        rogue_step(sock, claimed_front, stage)
        w.wait_log("event=frame_refused")
        assert "stage_step_failed" not in w.text(), w.text()[-1500:]
    finally:
        w.stop()


def main():
    if not os.path.exists(STORIES):
        su.skip(f"{STORIES} missing")
    r = su.Runner("test_cluster_bad")
    d = tempfile.mkdtemp(prefix="shbad-", dir="/tmp")  # ipc:// paths stay short
    try:
        r.case("a layer split that overlaps", overlap, d)
        r.case("a script referring to a node it does not define", undefined_node, d)
        r.case("bad weights", bad_weights, d)
        r.case("a tcp:// URL nobody listens on: the join timeout names it and why",
               nobody_listens, d)
        r.case("a worker of another build version", other_build, d)
        r.case("a worker of another protocol version", other_protocol, d)
        r.case("a wrong cluster key: refused on both sides", wrong_key, d)
        r.case("a cluster key on one side only, each way", key_one_side, d)
        r.case("a key file that is not one (a device, too short, missing)", bad_key_file, d)
        r.case("a standby node with a cluster key: refused by the front and the node",
               standby_with_key, d)
        r.case("control: the same key on every node joins and serves, split by weight",
               same_key_joins, d)
        r.case("a worker drops a STEP from a connection that proved no node (keyed or open)",
               unauthenticated_step, d)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    r.finish()


if __name__ == "__main__":
    main()
