"""`shoal serve` with the real Gemma 3 270M model through the OpenAI API, the batcher, the KV
manager and the prefix cache.

Checks: /v1/models names it; a greedy completion equals `shoal run`'s greedy text for the same
prompt (both with an F32 KV cache); four different prompts sent at once (batched) give the texts
each gives alone; a prompt longer than the 512-token sliding window (so the interleaved global
layers must still see its start: no KV block may be released) equals `shoal run` too, and again
when sent a second time (from the prefix cache); a chat completion uses Gemma's turn format and
answers; the server shuts down cleanly.

Model: SH_GEMMA3_MODEL, else models/gemma3-270m-q4_k_m.gguf (scripts/get-model.sh gemma3-270m);
a missing file skips (77).
"""

import concurrent.futures
import os
import subprocess
import sys

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402

MODEL = os.environ.get("SH_GEMMA3_MODEL") or os.path.join(su.ROOT, "models",
                                                          "gemma3-270m-q4_k_m.gguf")
NAME = "gemma3"
N = 16
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):",
           "The three primary colors are"]


def long_prompt():
    """About 700 tokens of a fixed word list, then a question: past the 512-token window."""
    words = ("river stone light north garden window paper silver morning bridge candle winter "
             "harbor forest letter music").split()
    body = " ".join(words[(i * 7 + i // 5) % len(words)] for i in range(640))
    return "Here is a list of words: " + body + ". The first word of the list was"


def run_greedy(prompt, n=N):
    """`shoal run`'s greedy continuation (the text after the prompt)."""
    out = subprocess.run([su.shoal_binary(), "run", "-m", MODEL, "-p", prompt, "-n", str(n),
                          "--temp", "0", "-t", "2"], cwd=su.ROOT, capture_output=True, timeout=300)
    assert out.returncode == 0, f"shoal run exited {out.returncode}: {out.stderr[-400:]!r}"
    text = out.stdout.decode()
    assert text.startswith(prompt), f"shoal run output does not start with the prompt: {text!r}"
    return text[len(prompt):].rstrip("\n")


def complete(url, prompt, n=N):
    status, body, raw = su.post_json(url, "/v1/completions", {
        "model": NAME, "prompt": prompt, "max_tokens": n, "temperature": 0})
    assert status == 200, f"status {status}: {raw[:400]!r}"
    return body["choices"][0]["text"], body


def main():
    if not os.path.exists(MODEL):
        su.skip(f"{MODEL} missing (scripts/get-model.sh gemma3-270m)")
    r = su.Runner("serve_gemma3")
    solo = {p: run_greedy(p) for p in PROMPTS}
    lp = long_prompt()
    solo_long = run_greedy(lp, 8)
    with su.server("-t", "2", "--kv-f32", "--ctx", "2048", "--model-name", NAME, model=MODEL,
                   runner=r) as srv:
        def models():
            status, _, data = su.get(srv.url, "/v1/models")
            assert status == 200 and b'"gemma3"' in data, f"{status}: {data[:300]!r}"

        def greedy_equals_run():
            for p in PROMPTS:
                text, body = complete(srv.url, p)
                assert text == solo[p], f"{p!r}: serve {text!r}, run {solo[p]!r}"
                assert body["usage"]["completion_tokens"] == N, body["usage"]

        def batched_equals_alone():
            with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as ex:
                texts = list(ex.map(lambda p: complete(srv.url, p)[0], PROMPTS))
            for p, t in zip(PROMPTS, texts):
                assert t == solo[p], f"{p!r} batched: {t!r}, alone {solo[p]!r}"

        def past_the_window():
            for attempt in ("first", "prefix-cached"):
                text, body = complete(srv.url, lp, 8)
                assert body["usage"]["prompt_tokens"] > 600, body["usage"]
                assert text == solo_long, f"{attempt}: serve {text!r}, run {solo_long!r}"

        def chat():
            status, body, raw = su.post_json(srv.url, "/v1/chat/completions", {
                "model": NAME, "max_tokens": 12, "temperature": 0,
                "messages": [{"role": "user", "content": "Say hello."}]})
            assert status == 200, f"status {status}: {raw[:400]!r}"
            msg = body["choices"][0]["message"]
            assert msg["role"] == "assistant" and body["usage"]["prompt_tokens"] > 5, body

        r.case("models lists gemma3", models)
        r.case("greedy completions equal shoal run", greedy_equals_run)
        r.case("four prompts batched equal each alone", batched_equals_alone)
        r.case("a prompt past the sliding window equals shoal run, twice", past_the_window)
        r.case("chat completion", chat)
    r.finish()


if __name__ == "__main__":
    main()
