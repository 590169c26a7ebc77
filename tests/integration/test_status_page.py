"""The status page GET /admin/ in headless Chromium against a real cluster (issue 12,
docs/cluster.md "The status page").

`shoal cluster up` runs a 2-stage stories260K pipeline (front, w0 -> w1) with an API key; a
--bin wrapper makes w1's restarts wait 3 s so the front sees it dead for that long. Chromium
(Debian's `chromium`, driven over the DevTools protocol with the small websocket client below;
stdlib only) loads:
- /admin/ without the key: the 401 form asking for it;
- /admin/?key=KEY: the page goes live, draws front, w0 and w1 alive with the links front -> w0
  and w0 -> w1, the replica serving; it fetched nothing but its own origin;
- kill -9 of w1: the page shows w1 dead (its box, its table row, the link w0 -> w1) and the
  replica not serving; then healed: w1 alive, the replica serving, the page still updating,
  w1's death and the replica's resume listed among the faults and recoveries.
Screenshots (healthy, dead, healed) are kept under $SH_BINARY_DIR/Testing/status_page/ (the
paths are printed). Exit 77 (skip) when chromium is missing; scripts/bootstrap.sh installs it.
"""

import base64
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402
from test_admin_status import KEY, delayed_restart_wrapper  # noqa: E402
from test_cluster_pipeline import STORIES, script  # noqa: E402
from test_cluster_up import Cluster, no_process_left  # noqa: E402


def chromium_binary():
    for name in (os.environ.get("SH_CHROMIUM"), "chromium", "chromium-browser"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


class WebSocket:
    """A minimal RFC 6455 client: text frames out (masked), text frames in (any length,
    continuations joined), pings answered."""

    def __init__(self, url, timeout=30):
        u = urllib.parse.urlparse(url)
        self.sock = socket.create_connection((u.hostname, u.port), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET {u.path} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\n"
                           "Upgrade: websocket\r\nConnection: Upgrade\r\n"
                           f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n")
                          .encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(1)
            if not chunk:
                raise AssertionError(f"websocket handshake: connection closed: {head!r}")
            head += chunk
        if not head.startswith(b"HTTP/1.1 101"):
            raise AssertionError(f"websocket handshake refused: {head!r}")

    def _read(self, n):
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise AssertionError("websocket closed by the browser")
            buf += chunk
        return buf

    def _frame(self, opcode, payload):
        mask = os.urandom(4)
        n = len(payload)
        head = bytes([0x80 | opcode])
        if n < 126:
            head += bytes([0x80 | n])
        elif n < 65536:
            head += bytes([0x80 | 126]) + struct.pack(">H", n)
        else:
            head += bytes([0x80 | 127]) + struct.pack(">Q", n)
        self.sock.sendall(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))

    def send(self, text):
        self._frame(0x1, text.encode())

    def recv(self):
        parts = []
        while True:
            b0, b1 = self._read(2)
            n = b1 & 0x7F
            if n == 126:
                n = struct.unpack(">H", self._read(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self._read(8))[0]
            mask = self._read(4) if b1 & 0x80 else None
            data = self._read(n)
            if mask:
                data = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
            op = b0 & 0x0F
            if op == 0x9:  # ping
                self._frame(0xA, data)
                continue
            if op == 0x8:
                raise AssertionError("websocket closed by the browser")
            if op in (0x1, 0x2, 0x0):
                parts.append(data)
                if b0 & 0x80:
                    return b"".join(parts).decode()

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass


class Browser:
    """Headless Chromium with one page, driven over the DevTools protocol."""

    def __init__(self, binary, workdir):
        self.profile = tempfile.mkdtemp(prefix="chromium-", dir=workdir)
        fd, self.logpath = tempfile.mkstemp(prefix="shoal-chromium-", suffix=".log")
        logf = os.fdopen(fd, "wb")
        self.proc = subprocess.Popen(
            [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--no-default-browser-check", "--disable-extensions",
             "--disable-background-networking", "--disable-component-update", "--mute-audio",
             f"--user-data-dir={self.profile}", "--remote-debugging-port=0",
             "--window-size=1280,860", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True)
        logf.close()
        self.ws = None
        self.next_id = 0
        port_file = os.path.join(self.profile, "DevToolsActivePort")
        deadline = time.monotonic() + 60
        while True:
            if os.path.exists(port_file):
                with open(port_file) as f:
                    lines = f.read().split("\n")
                if lines and lines[0].strip().isdigit():
                    self.port = int(lines[0])
                    break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"chromium did not start (exit {self.proc.poll()}):\n"
                                     + self.log()[-2000:])
            time.sleep(0.1)
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/json/list", timeout=10) as r:
            targets = json.load(r)
        page = [t for t in targets if t.get("type") == "page"]
        assert page, f"no page target: {targets}"
        self.ws = WebSocket(page[0]["webSocketDebuggerUrl"])

    def log(self):
        with open(self.logpath, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def call(self, method, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise AssertionError(f"{method}: {msg['error']}")
                return msg["result"]

    def goto(self, url):
        self.call("Page.enable")
        self.call("Page.navigate", url=url)
        deadline = time.monotonic() + 30
        while self.eval("document.readyState") != "complete":
            assert time.monotonic() < deadline, f"{url} did not load"
            time.sleep(0.05)

    def eval(self, expr):
        r = self.call("Runtime.evaluate", expression=expr, returnByValue=True)
        if "exceptionDetails" in r:
            raise AssertionError(f"{expr}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def screenshot(self, path):
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        with open(path, "wb") as f:
            f.write(base64.b64decode(data["data"]))
        return path

    def close(self):
        if self.ws:
            try:
                self.call("Browser.close")
            except (AssertionError, OSError):
                pass
            self.ws.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        shutil.rmtree(self.profile, ignore_errors=True)


# What the page shows, read from its DOM: each node's box and table row, the links, the
# replicas' rows, the events listed, whether it is live and how many updates it drew.
SHOWN = """(() => {
  const q = (s) => [...document.querySelectorAll(s)];
  return {
    live: document.body.dataset.live, updates: +document.body.dataset.updates,
    conn: document.getElementById('conn').textContent,
    boxes: Object.fromEntries(q('#topo g.node').map((g) => [g.dataset.node, g.dataset.health])),
    rows: Object.fromEntries(q('#nodes tbody tr').map((r) => [r.cells[0].textContent,
                                                             r.cells[2].textContent])),
    links: Object.fromEntries(q('#topo line.link').map((l) => [l.dataset.from + '>' +
                                                               l.dataset.to, l.dataset.health])),
    replicas: q('#replicas tbody tr').map((r) => r.cells[2].textContent),
    events: q('#events tbody tr').map((r) => [r.cells[1].textContent, r.cells[2].textContent]),
    resources: performance.getEntriesByType('resource').map((e) => e.name),
  };
})()"""


def wait_shown(b, what, cond, timeout):
    deadline = time.monotonic() + timeout
    while True:
        s = b.eval(SHOWN)
        if cond(s):
            return s
        assert time.monotonic() < deadline, f"the page never showed {what}: {json.dumps(s)}"
        time.sleep(0.1)


def all_alive(s):
    want = {"front": "alive", "w0": "alive", "w1": "alive"}
    return (s["live"] == "1" and s["boxes"] == want and s["rows"] == want and
            s["links"] == {"front>w0": "alive", "w0>w1": "alive"} and s["replicas"] == ["serving"])


def page_case(d, chromium, art):
    path = script(os.path.join(d, "page.lua"), STORIES, ["w0", "w1"])
    c = Cluster(path, "--bin", delayed_restart_wrapper(d, "w1", 3),
                serve=("--port", "0", "--api-key", KEY))
    b = None
    try:
        url = c.wait_for("'cluster: up' line", c.ups, 90)[0]
        b = Browser(chromium, d)
        # Every document records what its Content-Security-Policy blocked (this script is the
        # browser's, not the page's, so the policy does not apply to it).
        b.call("Page.enable")
        b.call("Page.addScriptToEvaluateOnNewDocument", source=(
            "window.__csp = []; document.addEventListener('securitypolicyviolation', "
            "(e) => window.__csp.push(e.violatedDirective + ' ' + e.blockedURI));"))
        b.goto(url + "/admin/")
        assert b.eval("window.__csp") == [], f"the login form broke its CSP: {b.eval('window.__csp')}"
        assert b.eval("!!document.querySelector('form#login input[name=key]')"), \
            b.eval("document.documentElement.outerHTML.slice(0, 500)")
        b.goto(url + "/admin/?key=" + urllib.parse.quote(KEY, safe=""))
        s = wait_shown(b, "every node alive", all_alive, 30)
        assert b.eval("window.__csp") == [], f"the page broke its CSP: {b.eval('window.__csp')}"
        # The replica's KV bar is drawn (its width is set through the CSSOM, which the CSP allows).
        assert b.eval("document.querySelector('#replicas span.bar i').style.width").endswith("%")
        origin = url.rstrip("/")
        foreign = [r for r in s["resources"] if not r.startswith(origin + "/")]
        assert not foreign, f"the page fetched from elsewhere: {foreign}"
        shots = [b.screenshot(os.path.join(art, "healthy.png"))]

        os.kill(c.pids()["w1"][-1], signal.SIGKILL)
        t0 = time.monotonic()
        s = wait_shown(b, "w1 dead", lambda s: s["boxes"].get("w1") == "dead" and
                       s["rows"].get("w1") == "dead" and s["links"].get("w0>w1") == "dead", 5)
        t_dead = time.monotonic() - t0
        assert s["boxes"]["w0"] == "alive" and s["links"]["front>w0"] == "alive", s
        s = wait_shown(b, "the replica out of service", lambda s: s["replicas"] != ["serving"], 5)
        shots.append(b.screenshot(os.path.join(art, "dead.png")))

        s = wait_shown(b, "w1 healed", all_alive, 30)
        t_back = time.monotonic() - t0
        n = s["updates"]
        s = wait_shown(b, "updates going on", lambda s: s["updates"] >= n + 2, 5)
        # The front's faults and recoveries, newest first: w1's death before the replica resumed.
        ev = s["events"]
        assert ["dead", "w1"] in ev and ["resumed", "w1"] in ev, ev
        assert ev.index(["resumed", "w1"]) < ev.index(["dead", "w1"]), ev
        shots.append(b.screenshot(os.path.join(art, "healed.png")))
        for p in shots:
            with open(p, "rb") as f:
                assert f.read(8) == b"\x89PNG\r\n\x1a\n", f"{p} is not a PNG"
        su.log(f"note: the page showed w1 dead {t_dead:.2f} s after kill -9 and healed "
               f"{t_back:.2f} s after; {len(s['events'])} events listed")
        su.log("screenshots: " + " ".join(shots))
        b.close()
        b = None
        c.proc.send_signal(signal.SIGTERM)
        rc = c.wait_exit(60)
        assert rc == 0, f"cluster up exited {rc}:\n{c.text()[-3000:]}"
        no_process_left(c.sid, 5)
        os.unlink(c.logpath)
    finally:
        if b:
            su.log("chromium log tail:\n" + b.log()[-1500:])
            b.close()
        c.kill()


def main():
    if not os.path.exists(STORIES):
        su.skip(f"{STORIES} missing")
    chromium = chromium_binary()
    if not chromium:
        su.skip("chromium missing (scripts/bootstrap.sh installs Debian's chromium)")
    art = os.path.join(os.environ.get("SH_BINARY_DIR") or tempfile.gettempdir(), "Testing",
                       "status_page")
    os.makedirs(art, exist_ok=True)
    r = su.Runner("test_status_page")
    d = tempfile.mkdtemp(prefix="shsp-", dir="/tmp")  # ipc:// paths stay short
    try:
        r.case("chromium: the page against cluster up; kill -9 of a worker shown dead, then healed",
               page_case, d, chromium, art)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    r.finish()


if __name__ == "__main__":
    main()
