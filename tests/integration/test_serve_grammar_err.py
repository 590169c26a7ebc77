"""`shoal serve`: a grammar whose matcher passes its bounds in the middle of generation fails its
own request only (issue 28), against real processes.

The grammar `root ::= w a`, `a ::= " " w a "b" | " " w a "c" | "\\x01"`, `w ::= [a-zA-Z]+`
parses, and its matcher starts with three parse stacks; but every space doubles them (each word
may close with "b" or "c" later), so after about 13 words it holds more than the matcher's bound
(SH_GRAMMAR_MAX_STACKS, model/grammar.h) and fails. Cases:
- together, in one batch: the limit request, three requests without a grammar and one with a small
  grammar: the limit request gets a 500 whose message says the grammar limit was hit (not "every
  token is banned"); every other one is a 200 with its full answer (the plain ones give the same
  greedy text as when sent alone; the grammar one follows its grammar);
- the same request streamed: some deltas, then an error event, then [DONE];
- the server serves afterwards;
- a 2-stage pipeline (`shoal node` workers, as test_cluster_pipeline): the last stage, on another
  process, samples, and the per-sequence error crosses the link: the limit request fails with the
  same message while a plain one sent with it finishes; there /v1/models lists the "embeddings"
  capability, and /v1/embeddings answers (test_cluster_embed checks its numbers).
"""

import json
import os
import shutil
import sys
import tempfile

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402

BLOWUP = r'''root ::= w a
a ::= " " w a "b" | " " w a "c" | "\x01"
w ::= [a-zA-Z]+
'''
STORY = "Write a long story about a dragon who lives in a cave."
PLAIN = ["The capital of France is", "Here is a list of colours: red, green,",
         "Once upon a time, in a small village by the sea,"]


def check(cond, msg):
    if not cond:
        raise AssertionError(msg)


def chat(url, content, **kw):
    body = {"messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": 80}
    body.update(kw)
    return su.post_json(url, "/v1/chat/completions", body, timeout=300)


def complete(url, prompt, **kw):
    body = {"prompt": prompt, "temperature": 0, "max_tokens": 48}
    body.update(kw)
    return su.post_json(url, "/v1/completions", body, timeout=300)


def check_limit_error(st, p, raw, what):
    err = su.check_error(st, p, raw, 500, what=what)
    msg = err["message"]
    check("grammar limit hit" in msg, f"{what}: the message does not name the limit: {msg!r}")
    check("banned" not in msg, f"{what}: the message blames banned tokens: {msg!r}")
    su.log(f"note: {what}: {msg}")


def mixed(url):
    """The limit request with four others at once: only it fails."""
    alone = []
    for pr in PLAIN:
        st, p, raw = complete(url, pr)
        check(st == 200, f"alone {pr!r}: {st} {raw[:300]!r}")
        alone.append(p["choices"][0]["text"])
    jobs = [("limit", None)] + [("plain", i) for i in range(len(PLAIN))] + [("yesno", None)]

    def one(url, job, _n):
        kind, i = job
        if kind == "limit":
            return kind, i, chat(url, STORY, grammar=BLOWUP)
        if kind == "plain":
            return kind, i, complete(url, PLAIN[i])
        return kind, i, complete(url, "Is the sky blue? Answer:", grammar='root ::= " yes" | " no"',
                                 max_tokens=8)

    for kind, i, (st, p, raw) in su.at_once(url, jobs, 0, one):
        if kind == "limit":
            check_limit_error(st, p, raw, "limit request in a batch")
        elif kind == "plain":
            check(st == 200, f"plain {i}: {st} {raw[:300]!r}")
            ch = p["choices"][0]
            check(ch["text"] == alone[i], f"plain {i}: {ch['text']!r} in the batch, "
                  f"{alone[i]!r} alone")
            check(ch["finish_reason"] in ("stop", "length"), repr(ch))
        else:
            check(st == 200, f"yes/no grammar: {st} {raw[:300]!r}")
            ch = p["choices"][0]
            check(ch["text"] in (" yes", " no") and ch["finish_reason"] == "stop", repr(ch))


def streamed(url):
    body = {"messages": [{"role": "user", "content": STORY}], "temperature": 0,
            "max_tokens": 80, "stream": True, "grammar": BLOWUP}
    st, _, events = su.stream(url, "/v1/chat/completions", body, timeout=300)
    check(st == 200, f"{st} {events[:1]!r}")
    check(events and events[-1] == "[DONE]", f"no [DONE] at the end: {events[-3:]!r}")
    errs = [e for e in events if isinstance(e, dict) and "error" in e]
    check(len(errs) == 1, f"want one error event, got {errs!r}")
    msg = errs[0]["error"]["message"]
    check("grammar limit hit" in msg, f"error event: {msg!r}")
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                   if isinstance(e, dict) and e.get("choices"))
    check(len(text.split(" ")) >= 8, f"it failed before generating much: {text!r}")


def still_serves(url):
    st, p, raw = complete(url, "The capital of France is", max_tokens=8)
    check(st == 200 and p["choices"][0]["text"], f"{st} {raw[:300]!r}")
    st, p, raw = complete(url, "Is the sky blue? Answer:", grammar='root ::= " yes" | " no"',
                          max_tokens=8)
    check(st == 200 and p["choices"][0]["text"] in (" yes", " no"), f"{st} {raw[:300]!r}")


def pipeline(d):
    import test_cluster_pipeline as cp
    path = cp.script(os.path.join(d, "p2.lua"), su.MODEL, ["w0", "w1"])
    nodes = [cp.Node(path, w) for w in ("w0", "w1")]
    problems = []
    try:
        for nd in nodes:
            nd.wait_ready()
        srv = su.start("-c", path, "--join-timeout", f"{su.scaled(60):g}", model=None)
        try:
            jobs = ["limit", "plain"]

            def one(url, kind, _n):
                if kind == "limit":
                    return kind, chat(url, STORY, grammar=BLOWUP)
                return kind, complete(url, PLAIN[0])

            for kind, (st, p, raw) in su.at_once(srv.url, jobs, 0, one):
                if kind == "limit":
                    check_limit_error(st, p, raw, "limit request on a pipeline")
                else:
                    check(st == 200 and p["choices"][0]["text"], f"plain: {st} {raw[:300]!r}")
            still_serves(srv.url)
            # A front with worker nodes computes embeddings (the last stage pools), and
            # /v1/models says so.
            st, _, data = su.get(srv.url, "/v1/models")
            caps = json.loads(data)["data"][0]["capabilities"]
            check(caps == ["completion", "chat", "embeddings"], f"cluster capabilities {caps}")
            st, p, raw = su.post_json(srv.url, "/v1/embeddings", {"input": "hello"})
            check(st == 200 and len(p["data"][0]["embedding"]) == 576,
                  f"cluster /v1/embeddings: {st} {raw[:200]!r}")
        finally:
            problems += su.stop(srv)
    finally:
        for nd in nodes:
            problems += nd.stop()
    check(not problems, "\n".join(problems))


def main():
    su.require_model()
    r = su.Runner("test_serve_grammar_err")
    with su.server("--max-seqs", "8", runner=r) as srv:
        r.case("mixed", mixed, srv.url)
        r.case("streamed", streamed, srv.url)
        r.case("still_serves", still_serves, srv.url)
    d = tempfile.mkdtemp(prefix="shge-", dir="/tmp")  # ipc:// paths stay short
    try:
        r.case("pipeline", pipeline, d)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    r.finish()


if __name__ == "__main__":
    main()
