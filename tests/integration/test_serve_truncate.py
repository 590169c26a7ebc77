"""A model file truncated while `shoal serve` maps it (issue 25): before, the next read of a page
past the new end raised SIGBUS and the server died with no log line. Now (base/file.h's guard)
the server stays up and answers: each request gets a server error (500, "the model step
failed"), /health answers 503 "model_file_damaged" (out of rotation), the log says what
happened and names the file, and SIGTERM still stops it cleanly (exit 0). Both models: stories260K (F32, every weight read in place from the
mapping) and the default model (Q4_1: the weights are packed copies; the embeddings and norms
are still read from the mapping).
"""

import json
import os
import shutil
import sys
import tempfile

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402

STORIES = os.path.join(su.ROOT, "tests", "data", "stories260K", "stories260K.gguf")


def completion(url, name):
    return su.post_json(url, "/v1/completions", {"model": name, "prompt": "Once upon a time",
                                                 "max_tokens": 8, "temperature": 0})


def truncated_while_served(src, d):
    path = os.path.join(d, os.path.basename(src))
    shutil.copyfile(src, path)
    srv = su.start("-m", path, "-t", "1", "--kv-mem", "32M", model=None)
    try:
        st, _, raw = su.get(srv.url, "/v1/models")
        assert st == 200, (st, raw[:200])
        name = json.loads(raw)["data"][0]["id"]
        st, parsed, raw = completion(srv.url, name)
        assert st == 200 and parsed["choices"][0]["text"], (st, raw[:300])
        os.truncate(path, 4096)  # the header stays; every tensor is gone
        for attempt in range(3):
            st, parsed, raw = completion(srv.url, name)
            assert srv.alive(), f"the server died (exit {srv.proc.returncode}):\n" + srv.log_tail()
            assert st >= 500, f"request {attempt} after the truncation: {st} {raw[:300]!r}"
            assert parsed["error"]["type"] == "server_error", parsed
        st, _, raw = su.get(srv.url, "/health")
        assert st == 503 and b"model_file_damaged" in raw, (st, raw)
        # The client is told only that the step failed; the log says why, naming the file.
        log = srv.log_text()
        assert log.count("was truncated while mapped") == 1, srv.log_tail(20)
        assert f"the model file {path} was truncated while it was served" in log, \
            srv.log_tail(20)
        problems = su.stop(srv)
        assert not problems, "\n".join(problems)
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()


def main():
    su.require_model()
    if not os.path.exists(STORIES):
        su.skip(f"no {STORIES}")
    d = tempfile.mkdtemp(prefix="shoal-trunc-")
    r = su.Runner("serve_truncate")
    try:
        r.case("stories260K (F32, read in place) truncated while served: errors, not SIGBUS",
               truncated_while_served, STORIES, d)
        r.case("the default model (Q4_1, packed) truncated while served: errors, not SIGBUS",
               truncated_while_served, su.MODEL, d)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return r.finish()


if __name__ == "__main__":
    sys.exit(main())
