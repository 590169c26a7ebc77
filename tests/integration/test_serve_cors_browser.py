"""A web page on another origin calls `shoal serve` from headless Chromium (docs/serving.md, CORS).

The page is served by a Python http.server on its own port (so its origin differs from the
server's); its script POSTs to /v1/chat/completions with an API key (Authorization and
Content-Type: the browser sends a preflight first) and writes the reply, or the error, into the
page, which Chromium dumps. With `--cors-origin <the page's origin>` the call succeeds; without
it, and with another origin listed, the browser refuses it. Exit 77 where chromium is absent.
"""

import http.server
import os
import shutil
import subprocess
import sys
import tempfile
import threading

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402

KEY = "sk-browser-test"
PAGE = """<!doctype html><html><body><div id="out">pending</div><script>
fetch("%(api)s/v1/chat/completions", {method: "POST",
  headers: {"Authorization": "Bearer %(key)s", "Content-Type": "application/json"},
  body: JSON.stringify({messages: [{role: "user", content: "Say hi."}], max_tokens: 4,
                        temperature: 0})})
  .then(r => r.json())
  .then(j => { document.getElementById("out").textContent =
                 "RESULT-OK " + j.object + " " + j.choices.length; })
  .catch(e => { document.getElementById("out").textContent = "RESULT-ERR " + e; });
</script></body></html>"""


def browser():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        p = shutil.which(name)
        if p:
            return p
    return None


class Page:
    """Serves PAGE for api_url on 127.0.0.1 at an ephemeral port, in a thread."""

    def __init__(self):
        self.api = ""
        page = self

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the stdlib's name
                body = (PAGE % {"api": page.api, "key": KEY}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.origin = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def load(chrome, url):
    """The page's result line after its script ran (Chromium's dumped DOM)."""
    with tempfile.TemporaryDirectory(prefix="shoal-chromium-") as ud:
        p = subprocess.run([chrome, "--headless", "--no-sandbox", "--disable-gpu",
                            "--no-first-run", f"--user-data-dir={ud}",
                            "--virtual-time-budget=60000", "--dump-dom", url],
                           capture_output=True, text=True, timeout=su.scaled(120))
    for line in p.stdout.splitlines():
        if "RESULT-" in line:
            return line[line.index("RESULT-"):]
    return f"no result (exit {p.returncode}): {p.stdout[-300:]!r} {p.stderr[-300:]!r}"


def run(r, chrome, page):
    def called(url, want_ok):
        page.api = url
        res = load(chrome, page.origin + "/")
        ok = res.startswith("RESULT-OK chat.completion 1")
        if ok != want_ok:
            raise AssertionError(f"the page got {res!r}; want {'success' if want_ok else 'a refusal'}")

    with su.server("--ctx", "512", "--api-key", KEY, "--cors-origin", page.origin,
                   runner=r) as srv:
        r.case("--cors-origin <page>: the page's call succeeds", called, srv.url, True)
    with su.server("--ctx", "512", "--api-key", KEY, runner=r) as srv:
        r.case("no --cors-origin: the browser refuses the call", called, srv.url, False)
    with su.server("--ctx", "512", "--api-key", KEY, "--cors-origin", "http://other.example",
                   runner=r) as srv:
        r.case("another origin listed: the browser refuses the call", called, srv.url, False)


def main():
    chrome = browser()
    if not chrome:
        su.skip("chromium is not installed")
    su.require_model()
    r = su.Runner("serve_cors_browser")
    page = Page()
    try:
        run(r, chrome, page)
    except AssertionError as e:
        r.fail("server", str(e))
    finally:
        page.close()
    r.finish()


if __name__ == "__main__":
    main()
