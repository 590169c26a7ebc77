"""The degradation ladder in one `shoal serve -m` process (docs/serving.md, "Degradation"), with
a policy script the test rewrites and reloads, so each level is reached on purpose:

- the flags: a missing policy file and settings without a policy are refused at start;
- each level's effect in the response (X-Shoal-Degraded, logprobs dropped, max_tokens capped,
  503 with Retry-After for a key of low priority), in /metrics (shoal_degradation_level and
  shoal_degraded_requests_total by effect) and in the log (one line per change, with metrics);
- hysteresis: after the policy drops to 0 the level stays until --policy-hold has passed;
- bad policies (an error, an endless loop, a string, an out-of-range level, each only after a
  few good answers) keep the level in force and are logged once each, not at every tick;
- reloads: POST /admin/policy/reload (needs an admin key, KEY:P:admin: 401 without a key, 403
  with another valid one; a broken script answers 422 with file:line and the old one stays in
  force), SIGHUP, and `shoal cluster policy reload URL` (the admin key from SHOAL_API_KEY; exit
  2 with another key);
- without --policy the route answers 409 and /metrics has no level; --policy default serves.

The load-driven ladder over a cluster (fallback model included) is test_cluster_degrade.py.
"""

import os
import re
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402

HOLD = 1.5
KEY_HI, KEY_LO = "k-gold", "k-free"  # priority 0 and 5
KEY_ADMIN = "k-ops"  # priority 0, an admin key
AUTH_ADMIN = {"Authorization": f"Bearer {KEY_ADMIN}"}
AUTH_HI = {"Authorization": f"Bearer {KEY_HI}"}
AUTH_LO = {"Authorization": f"Bearer {KEY_LO}"}


def write(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def level_of(url):
    return su.metric(su.metrics_with(url, AUTH_HI), "shoal_degradation_level")


def wait_level(url, want, timeout=5.0):
    deadline = time.monotonic() + timeout
    while True:
        got = level_of(url)
        if got == want:
            return time.monotonic()
        if time.monotonic() > deadline:
            raise AssertionError(f"shoal_degradation_level {got}, want {want} within {timeout} s")
        time.sleep(0.05)


def reload(url, headers=AUTH_ADMIN):
    return su.post_json(url, "/admin/policy/reload", b"", headers=headers)


def policy_reload_cli(url, env_key):
    return subprocess.run([su.shoal_binary(), "cluster", "policy", "reload", url], cwd=su.ROOT,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30,
                          env=dict(os.environ, SHOAL_API_KEY=env_key))


def set_policy(srv, path, body):
    write(path, body)
    st, parsed, raw = reload(srv.url)
    assert st == 200 and parsed["status"] == "reloaded", f"reload: {st} {raw[:300]!r}"


def complete(url, headers=AUTH_HI, **kw):
    body = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}
    body.update(kw)
    return su.request(url, "POST", "/v1/completions", body, headers)


def counter(url, effect):
    return su.metric(su.metrics_with(url, AUTH_HI), "shoal_degraded_requests_total",
                     effect=effect) or 0


def refused_at_start(*args, want):
    p = subprocess.run([su.shoal_binary(), "serve", "-m", su.MODEL, "--port", "0", *args],
                       cwd=su.ROOT, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2, f"{args}: exit {p.returncode}, not 2 (bad input)"
    assert want in p.stderr, f"{args}: no {want!r} in: {p.stderr[-600:]}"


def main():
    su.require_model()
    if not hasattr(su, "metrics_with"):
        def metrics_with(url, headers):
            st, _, data = su.get(url, "/metrics", headers=headers)
            assert st == 200, f"GET /metrics: {st}"
            return data.decode("utf-8", "replace")
        su.metrics_with = metrics_with
    r = su.Runner("serve_degrade")
    d = tempfile.mkdtemp(prefix="shoal-degrade-")
    pol = os.path.join(d, "policy.lua")

    r.case("missing policy file refused", refused_at_start, "--policy", "/nonexistent/p.lua",
           want="/nonexistent/p.lua")
    r.case("settings without a policy refused", refused_at_start, "--policy-hold", "2",
           want="need a policy")
    write(os.path.join(d, "broken.lua"), "function level(m)\n  return (\nend\n")
    r.case("broken policy refused", refused_at_start, "--policy", os.path.join(d, "broken.lua"),
           want="broken.lua:3")
    write(os.path.join(d, "throws.lua"), "-- fails when it runs\nlocal x = nil + 1\n")
    r.case("policy that fails at start refused", refused_at_start, "--policy",
           os.path.join(d, "throws.lua"), want="throws.lua:2")

    write(pol, "function level(m) return 0 end\n")
    srv = su.start("--policy", pol, "--policy-hold", str(HOLD), "--degrade-max-tokens", "4",
                   "--shed-priority", "3", "--api-key", f"{KEY_HI}:0", "--api-key",
                   f"{KEY_LO}:5", "--api-key", f"{KEY_ADMIN}:0:admin", "--max-seqs", "8")
    r.srv = srv
    problems = []
    try:
        url = srv.url

        def level0():
            assert "degradation policy " + pol in srv.log_text()
            assert level_of(url) == 0
            st, hdrs, body = complete(url, logprobs=2)
            assert st == 200, body
            assert "x-shoal-degraded" not in hdrs, hdrs
            import json
            ch = json.loads(body)["choices"][0]
            assert ch["logprobs"] and len(ch["logprobs"]["tokens"]) == 6, ch
        r.case("level 0: nothing changes", level0)

        def level1():
            set_policy(srv, pol, "function level(m) return 1 end\n")
            wait_level(url, 1)
            import json
            st, hdrs, body = complete(url, logprobs=2)
            assert st == 200, body
            assert hdrs.get("x-shoal-degraded") == "logprobs", hdrs
            ch = json.loads(body)["choices"][0]
            assert ch["logprobs"] is None, ch
            assert len(ch["text"]) > 0
            st, hdrs, _ = complete(url)  # nothing to drop: not degraded
            assert st == 200 and "x-shoal-degraded" not in hdrs, hdrs
            assert counter(url, "logprobs") == 1
            assert re.search(r"event=degradation_level from=0 to=1 why=\"up\" policy=\"[^\"]+\" "
                             r"queue_wait_p50_ms=\S+ queue_wait_p99_ms=", srv.log_text()), \
                srv.log_tail(10)
        r.case("level 1: logprobs dropped", level1)

        def level2():
            set_policy(srv, pol, "function level(m) return 2 end\n")
            wait_level(url, 2)
            import json
            st, hdrs, body = complete(url, max_tokens=40, ignore_eos=True, logprobs=1)
            assert st == 200, body
            assert hdrs.get("x-shoal-degraded") == "logprobs, max_tokens=4", hdrs
            doc = json.loads(body)
            assert doc["usage"]["completion_tokens"] == 4, doc
            assert doc["choices"][0]["finish_reason"] == "length", doc
            # A stream is capped too.
            st, _, events = su.stream(url, "/v1/completions", {
                "prompt": "Hi", "max_tokens": 40, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}, headers=AUTH_HI)
            assert st == 200, events
            usage = [e for e in events if isinstance(e, dict) and e.get("usage")]
            assert usage and usage[-1]["usage"]["completion_tokens"] == 4, events[-3:]
            assert counter(url, "max_tokens") == 2
        r.case("level 2: max_tokens capped", level2)

        def level4():
            set_policy(srv, pol, "function level(m) return 4 end\n")
            wait_level(url, 4)
            import json
            st, hdrs, body = complete(url, headers=AUTH_LO)
            err = su.check_error(st, json.loads(body), body, 503, "overloaded", "low priority")
            assert hdrs.get("retry-after") == "2", hdrs  # the hold, 1.5 s, rounded up
            assert hdrs.get("x-shoal-degraded") == "shed", hdrs
            assert "priority 3 and above" in err["message"], err
            st, hdrs, body = complete(url, priority=3)  # the request's own priority counts
            assert st == 503, body
            st, hdrs, body = complete(url, max_tokens=40, ignore_eos=True)  # priority 0: served
            assert st == 200, body
            assert hdrs.get("x-shoal-degraded") == "max_tokens=4", hdrs
            assert counter(url, "shed") == 2
        r.case("level 4: low priority shed with Retry-After", level4)

        def hysteresis():
            t0 = time.monotonic()
            set_policy(srv, pol, "function level(m) return 0 end\n")
            time.sleep(HOLD - 0.5)
            assert level_of(url) == 4, "dropped before the hold time"
            t1 = wait_level(url, 0, timeout=3.0)
            assert t1 - t0 >= HOLD - 0.05, f"dropped after {t1 - t0:.2f} s < {HOLD} s"
            held = re.findall(r"from=4 to=0 why=\"below for ([0-9.]+) s\"", srv.log_text())
            assert held and float(held[-1]) >= HOLD, srv.log_tail(5)
            st, hdrs, _ = complete(url, headers=AUTH_LO, logprobs=1)
            assert st == 200 and "x-shoal-degraded" not in hdrs, hdrs
        r.case("hysteresis: a drop waits for the hold time", hysteresis)

        bad = [("error('policy broke')", "policy broke"),
               ("while true do end", "time"),
               ("return 'three'", "returned string"),
               ("return 9", "returned 9, expected 0..4")]

        def bad_policies():
            for code, text in bad:
                before = srv.log_text().count("event=policy_error")
                errors0 = su.metric(su.metrics_with(url, AUTH_HI), "shoal_policy_errors_total")
                set_policy(srv, pol, "calls = 0\nfunction level(m)\n  calls = calls + 1\n"
                           f"  if calls <= 5 then return 3 end\n  {code}\nend\n")
                wait_level(url, 3)
                time.sleep(HOLD + 0.7)  # a good policy answering lower would have dropped
                assert level_of(url) == 3, f"{code}: level not kept"
                log = srv.log_text()
                lines = [ln for ln in log.splitlines() if "event=policy_error" in ln]
                assert len(lines) == before + 1, \
                    f"{code}: {len(lines) - before} policy_error lines, want 1:\n" + \
                    "\n".join(lines[before:][:5])
                assert text in lines[-1] and "kept=true" in lines[-1], lines[-1]
                errors = su.metric(su.metrics_with(url, AUTH_HI), "shoal_policy_errors_total")
                assert errors - errors0 >= 3, (errors0, errors)
                set_policy(srv, pol, "function level(m) return 3 end\n")
        r.case("bad policies keep the level, logged once", bad_policies)

        def reloads():
            st, parsed, raw = reload(url, headers={})
            su.check_error(st, parsed, raw, 401, "invalid_api_key", "reload without a key")
            for who in (AUTH_HI, AUTH_LO):  # valid keys, but not admin keys
                st, parsed, raw = reload(url, headers=who)
                su.check_error(st, parsed, raw, 403, "admin_key_required", "reload, no admin key")
            st, _, _ = su.request(url, "GET", "/admin/policy/reload", None, AUTH_HI)
            assert st == 405, st
            write(pol, "function level(m)\n  return 1 +\nend\n")
            st, parsed, raw = reload(url)
            err = su.check_error(st, parsed, raw, 422, "policy_error", "broken reload")
            assert "not reloaded" in err["message"] and "policy.lua:3" in err["message"], err
            assert re.search(r"event=policy_reload .*ok=false", srv.log_text())
            time.sleep(HOLD + 0.5)
            assert level_of(url) == 3, "the old policy (3) must stay in force"
            # SIGHUP: the broken file is refused again, then a good one taken.
            srv.proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 5
            while "SIGHUP: policy not reloaded" not in srv.log_text():
                assert time.monotonic() < deadline, srv.log_tail(5)
                time.sleep(0.05)
            write(pol, "function level(m) return 1 end\n")
            srv.proc.send_signal(signal.SIGHUP)
            while "SIGHUP: policy reloaded" not in srv.log_text():
                assert time.monotonic() < deadline, srv.log_tail(5)
                time.sleep(0.05)
            wait_level(url, 1, timeout=HOLD + 3)
            # The command line client: another key is refused (403, exit 2); the admin key is
            # taken from SHOAL_API_KEY without its priority and role.
            write(pol, "function level(m) return 2 end\n")
            p = policy_reload_cli(url, f"{KEY_HI}:0")
            assert p.returncode == 2 and "403" in p.stderr, (p.returncode, p.stderr)
            p = policy_reload_cli(url, f"{KEY_ADMIN}:0:admin")
            assert p.returncode == 0, f"exit {p.returncode}: {p.stdout} {p.stderr}"
            assert "reloaded" in p.stdout, p.stdout
            wait_level(url, 2)
            write(pol, "function level(m) return nil + 1 end\n")
            p = policy_reload_cli(url, f"{KEY_ADMIN}:0:admin")
            assert p.returncode != 0 and "policy.lua:1" in p.stderr, (p.returncode, p.stderr)
            text = su.metrics_with(url, AUTH_HI)
            assert su.metric(text, "shoal_policy_reloads_total", result="error") >= 3, text
        r.case("reload: admin route, SIGHUP, shoal cluster policy reload", reloads)
    finally:
        problems += su.stop(srv)
        r.srv = None
    if problems:
        r.fail("server stopped cleanly", "\n".join(problems))

    def no_policy():
        with su.server("--policy", "default") as s2:
            assert "degradation policy default" in s2.log_text(), s2.log_tail(5)
            assert su.metric(su.metrics(s2.url), "shoal_degradation_level") == 0
            st, _, body = complete(s2.url, headers={})
            assert st == 200, body
        with su.server() as s3:
            st, parsed, raw = reload(s3.url, headers={})
            su.check_error(st, parsed, raw, 409, "no_policy", "no policy")
            assert su.metric(su.metrics(s3.url), "shoal_degradation_level") is None
    r.case("--policy default; no policy: 409", no_policy)
    r.finish()


if __name__ == "__main__":
    main()
