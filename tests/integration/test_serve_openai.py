"""`shoal serve` driven by the official `openai` Python client (1.x).

Needs the venv from scripts/test-venv.sh (run through tests/integration/run_py.sh). Without the
openai package the test skips (77), unless SH_REQUIRE_OPENAI is set, when it fails.

Checks: models.list(); chat (2+2 -> "4") and completion; streaming of both reassembles to the
non-streamed greedy text, the last choice event carries finish_reason, include_usage adds a usage
chunk; logprobs (completions logprobs=2, chat logprobs=True top_logprobs=3); stop strings taken
from the greedy output (plain and streamed); n=2; seed reproducibility; token-id prompts;
logit_bias; extension fields; an unknown model raises NotFoundError.
"""

import math
import os
import sys

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402

try:
    import openai  # noqa: E402
except ImportError:
    if os.environ.get("SH_REQUIRE_OPENAI"):
        print("FAIL: the openai package is missing and SH_REQUIRE_OPENAI is set "
              "(run scripts/test-venv.sh)", flush=True)
        sys.exit(1)
    su.skip("the openai package is missing (run scripts/test-venv.sh)")

# The client must talk to 127.0.0.1 directly, never through a proxy from the environment.
for var in ("NO_PROXY", "no_proxy"):
    parts = (os.environ.get(var), "127.0.0.1", "localhost", "::1")
    os.environ[var] = ",".join(x for x in parts if x)

MODEL = su.MODEL_NAME
CHAT_Q = [{"role": "user", "content": "What is 2+2? Answer with a number."}]
PROMPT = "The three primary colors are"


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def cmpl(c, **kw):
    kw.setdefault("model", MODEL)
    return c.completions.create(**kw)


def chat(c, **kw):
    kw.setdefault("model", MODEL)
    return c.chat.completions.create(**kw)


def stream_completion(c, **kw):
    """Returns (text by choice index, finish by index, list of chunks)."""
    chunks = list(cmpl(c, stream=True, **kw))
    texts, finish = {}, {}
    for ch in chunks:
        for choice in ch.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.text or "")
            if choice.finish_reason is not None:
                assert choice.index not in finish, f"two finish_reasons for choice {choice.index}"
                finish[choice.index] = choice.finish_reason
    return texts, finish, chunks


def stream_chat(c, **kw):
    chunks = list(chat(c, stream=True, **kw))
    texts, finish = {}, {}
    for ch in chunks:
        for choice in ch.choices:
            d = choice.delta
            texts[choice.index] = texts.get(choice.index, "") + ((d.content or "") if d else "")
            if choice.finish_reason is not None:
                assert choice.index not in finish, f"two finish_reasons for choice {choice.index}"
                finish[choice.index] = choice.finish_reason
    return texts, finish, chunks


def main():
    r = su.Runner("serve_openai")
    try:
        run(r)
    except AssertionError as e:  # the server did not start
        r.fail("server start", str(e))
    r.finish()


def run(r):
    with su.server(runner=r) as srv:
        c = client(srv.url)
        st = {}

        def models():
            ids = [m.id for m in c.models.list().data]
            assert MODEL in ids, f"models.list() = {ids}, want {MODEL}"

        # Each greedy reference is taken after a warm-up call of the same prompt, so that it and
        # the calls compared with it all take the same (prefix-cached) path; whether a cache hit
        # changes results is test_serve_batch's "prefix cache" case.
        def chat_basic():
            chat(c, messages=CHAT_Q, temperature=0, max_tokens=16)
            resp = chat(c, messages=CHAT_Q, temperature=0, max_tokens=16)
            assert resp.object == "chat.completion", resp.object
            assert resp.model == MODEL, resp.model
            assert len(resp.choices) == 1
            ch = resp.choices[0]
            assert ch.index == 0 and ch.message.role == "assistant", ch
            text = ch.message.content
            assert "4" in text, f"answer to 2+2 is {text!r}"
            assert ch.finish_reason in ("stop", "length"), ch.finish_reason
            u = resp.usage
            assert u.prompt_tokens > 0 and 0 < u.completion_tokens <= 16, u
            assert u.total_tokens == u.prompt_tokens + u.completion_tokens, u
            st["chat"] = (text, ch.finish_reason, u.completion_tokens)

        def completion_basic():
            cmpl(c, prompt=PROMPT, temperature=0, max_tokens=24)
            resp = cmpl(c, prompt=PROMPT, temperature=0, max_tokens=24)
            assert resp.object == "text_completion", resp.object
            assert resp.model == MODEL
            ch = resp.choices[0]
            assert ch.index == 0 and ch.text, ch
            assert ch.finish_reason in ("stop", "length"), ch.finish_reason
            u = resp.usage
            assert u.prompt_tokens > 0 and 0 < u.completion_tokens <= 24, u
            if ch.finish_reason == "length":
                assert u.completion_tokens == 24, u
            again = cmpl(c, prompt=PROMPT, temperature=0, max_tokens=24).choices[0].text
            assert again == ch.text, f"greedy not deterministic: {ch.text!r} vs {again!r}"
            st["cmpl"] = (ch.text, ch.finish_reason, u.completion_tokens)

        def completion_stream():
            want, want_finish, _ = st["cmpl"]
            texts, finish, chunks = stream_completion(c, prompt=PROMPT, temperature=0,
                                                      max_tokens=24)
            assert texts.get(0) == want, f"stream {texts.get(0)!r} != non-stream {want!r}"
            assert finish == {0: want_finish}, f"finish {finish}, want {want_finish}"
            assert chunks, "no chunks"
            last = chunks[-1]
            assert last.choices and last.choices[0].finish_reason == want_finish, \
                f"last event before [DONE] has no finish_reason: {last}"
            for ch in chunks[:-1]:
                assert all(x.finish_reason is None for x in ch.choices), \
                    f"finish_reason before the last event: {ch}"
            assert all(ch.object == "text_completion" for ch in chunks)
            assert len({ch.id for ch in chunks}) == 1, "chunk ids differ"

        def completion_stream_usage():
            want, want_finish, want_n = st["cmpl"]
            texts, finish, chunks = stream_completion(
                c, prompt=PROMPT, temperature=0, max_tokens=24,
                stream_options={"include_usage": True})
            assert texts.get(0) == want, f"stream {texts.get(0)!r} != {want!r}"
            assert finish == {0: want_finish}
            last = chunks[-1]
            assert last.choices == [] and last.usage is not None, \
                f"last event is not the usage chunk: {last}"
            assert last.usage.completion_tokens == want_n, last.usage
            assert last.usage.total_tokens == last.usage.prompt_tokens + want_n
            for ch in chunks[:-1]:
                assert ch.usage is None, f"usage before the last chunk: {ch}"
            assert chunks[-2].choices and chunks[-2].choices[0].finish_reason == want_finish

        def chat_stream():
            want, want_finish, want_n = st["chat"]
            texts, finish, chunks = stream_chat(c, messages=CHAT_Q, temperature=0, max_tokens=16)
            assert texts.get(0) == want, f"stream {texts.get(0)!r} != non-stream {want!r}"
            assert finish == {0: want_finish}, finish
            assert chunks[0].choices[0].delta.role == "assistant", chunks[0]
            assert chunks[-1].choices[0].finish_reason == want_finish
            assert all(ch.object == "chat.completion.chunk" for ch in chunks)
            texts, finish, chunks = stream_chat(c, messages=CHAT_Q, temperature=0, max_tokens=16,
                                                stream_options={"include_usage": True})
            assert texts.get(0) == want
            last = chunks[-1]
            assert last.choices == [] and last.usage is not None, f"no usage chunk: {last}"
            assert last.usage.completion_tokens == want_n, last.usage
            assert chunks[-2].choices[0].finish_reason == want_finish

        def logprobs_completion():
            resp = cmpl(c, prompt=PROMPT, temperature=0, max_tokens=8, logprobs=2)
            ch = resp.choices[0]
            lp = ch.logprobs
            assert lp is not None, "no logprobs"
            n = resp.usage.completion_tokens
            assert len(lp.tokens) == n and len(lp.token_logprobs) == n, \
                f"{len(lp.tokens)} tokens, {len(lp.token_logprobs)} logprobs, {n} generated"
            assert len(lp.top_logprobs) == n and len(lp.text_offset) == n
            assert "".join(lp.tokens) == ch.text, f"tokens {lp.tokens} != text {ch.text!r}"
            for i, (tok, l, top) in enumerate(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)):
                assert isinstance(l, float) and l <= 1e-4 and math.isfinite(l), (i, l)
                assert isinstance(top, dict) and 1 <= len(top) <= 2, f"top_logprobs[{i}]={top}"
                assert all(v <= 1e-4 for v in top.values()), top
                # greedy: the chosen token is the most likely one
                assert abs(max(top.values()) - l) < 1e-3, \
                    f"token {i} {tok!r} logprob {l} but top {top}"
            offs = lp.text_offset
            assert offs == sorted(offs), offs
            want = [sum(len(t.encode()) for t in lp.tokens[:i]) for i in range(n)]
            if offs != want:
                want_chars = [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
                assert offs == want_chars, f"text_offset {offs}, want {want} (bytes)"

        def logprobs_chat():
            resp = chat(c, messages=CHAT_Q, temperature=0, max_tokens=8, logprobs=True,
                        top_logprobs=3)
            ch = resp.choices[0]
            assert ch.logprobs is not None and ch.logprobs.content is not None, "no logprobs"
            items = ch.logprobs.content
            n = resp.usage.completion_tokens
            assert len(items) == n, f"{len(items)} logprob items for {n} tokens"
            assert "".join(x.token for x in items) == ch.message.content
            for i, x in enumerate(items):
                assert x.logprob <= 1e-4, (i, x.logprob)
                assert len(x.top_logprobs) == 3, f"item {i}: {len(x.top_logprobs)} top logprobs"
                tops = [t.logprob for t in x.top_logprobs]
                assert tops == sorted(tops, reverse=True), f"item {i} top not sorted: {tops}"
                assert abs(tops[0] - x.logprob) < 1e-3, f"item {i}: greedy {x.logprob} vs {tops}"
                if x.bytes is not None:
                    assert bytes(x.bytes) == x.token.encode(), (x.bytes, x.token)
            # without logprobs the field is null
            resp = chat(c, messages=CHAT_Q, temperature=0, max_tokens=4)
            assert resp.choices[0].logprobs is None, resp.choices[0].logprobs

        def pick_stop(text):
            """A stop string from the middle of text whose first occurrence is at its position."""
            for k in range(max(1, len(text) // 3), len(text) - 3):
                s = text[k:k + 4]
                if s.strip() and text.find(s) == k:
                    return k, s
            raise AssertionError(f"greedy text too short for a stop string: {text!r}")

        def stop_strings():
            text, _, _ = st["cmpl"]
            k, s = pick_stop(text)
            resp = cmpl(c, prompt=PROMPT, temperature=0, max_tokens=24, stop=[s])
            ch = resp.choices[0]
            assert ch.text == text[:k], f"stop {s!r}: got {ch.text!r}, want {text[:k]!r}"
            assert ch.finish_reason == "stop", ch.finish_reason
            assert s not in ch.text
            # several stop strings: the earliest match wins; unmatched ones change nothing
            resp = cmpl(c, prompt=PROMPT, temperature=0, max_tokens=24,
                        stop=["#never#", s, "@@@"])
            assert resp.choices[0].text == text[:k] and resp.choices[0].finish_reason == "stop"
            # a single string (not a list)
            resp = cmpl(c, prompt=PROMPT, temperature=0, max_tokens=24, stop=s)
            assert resp.choices[0].text == text[:k]

        def stop_strings_stream():
            text, _, _ = st["cmpl"]
            k, s = pick_stop(text)
            texts, finish, chunks = stream_completion(c, prompt=PROMPT, temperature=0,
                                                      max_tokens=24, stop=[s])
            assert texts.get(0) == text[:k], f"stream stop {s!r}: {texts.get(0)!r} != {text[:k]!r}"
            assert finish == {0: "stop"}, finish
            for ch in chunks:
                for x in ch.choices:
                    assert s not in (x.text or ""), f"chunk contains the stop string: {x.text!r}"
            # chat, streamed, with a stop string from the greedy answer
            ctext, _, _ = st["chat"]
            if len(ctext) >= 6:
                k, s = pick_stop(ctext)
                texts, finish, _ = stream_chat(c, messages=CHAT_Q, temperature=0, max_tokens=16,
                                               stop=[s])
                assert texts.get(0) == ctext[:k], f"chat stop {s!r}: {texts.get(0)!r}"
                assert finish == {0: "stop"}, finish

        def n_choices():
            resp = cmpl(c, prompt=PROMPT, temperature=0, max_tokens=12, n=2)
            assert sorted(x.index for x in resp.choices) == [0, 1], resp.choices
            a, b = (x.text for x in sorted(resp.choices, key=lambda x: x.index))
            assert a == b, f"greedy n=2 choices differ: {a!r} vs {b!r}"
            assert a == st["cmpl"][0][:len(a)], f"n=2 greedy {a!r} vs n=1 {st['cmpl'][0]!r}"
            resp = cmpl(c, prompt=PROMPT, temperature=1, seed=7, max_tokens=12, n=2)
            assert sorted(x.index for x in resp.choices) == [0, 1], resp.choices
            assert all(x.text for x in resp.choices)
            assert resp.usage.completion_tokens >= 2, f"usage counts both choices: {resp.usage}"
            resp = chat(c, messages=CHAT_Q, temperature=1, seed=7, max_tokens=8, n=2)
            assert sorted(x.index for x in resp.choices) == [0, 1], resp.choices
            texts, finish, _ = stream_completion(c, prompt=PROMPT, temperature=0, max_tokens=12,
                                                 n=2)
            assert sorted(texts) == [0, 1] and sorted(finish) == [0, 1], (texts, finish)
            assert texts[0] == texts[1] == a, f"streamed n=2 {texts} vs {a!r}"

        def seed_repro():
            kw = dict(prompt="Once upon a time", temperature=1, seed=1234, max_tokens=24)
            a = cmpl(c, **kw).choices[0].text
            b = cmpl(c, **kw).choices[0].text
            assert a == b, f"same seed, different text: {a!r} vs {b!r}"
            kw = dict(messages=CHAT_Q, temperature=1, seed=99, max_tokens=16)
            a = chat(c, **kw).choices[0].message.content
            b = chat(c, **kw).choices[0].message.content
            assert a == b, f"chat: same seed, different text: {a!r} vs {b!r}"

        def token_prompt():
            ids = [504, 3458, 314, 2148, 314]
            resp = cmpl(c, prompt=ids, temperature=0, max_tokens=4)
            assert resp.usage.prompt_tokens == len(ids), resp.usage
            assert resp.choices[0].text is not None

        def logit_bias():
            resp = cmpl(c, prompt=PROMPT, temperature=0, max_tokens=5, logprobs=0,
                        logit_bias={"1000": 100})
            toks = resp.choices[0].logprobs.tokens
            assert len(toks) == 5 and len(set(toks)) == 1, f"bias +100 on one id, got {toks}"

        def extensions():
            resp = cmpl(c, prompt=PROMPT, temperature=0.7, max_tokens=8, top_p=0.9,
                        presence_penalty=0.5, frequency_penalty=0.5, user="tester",
                        extra_body={"top_k": 40, "min_p": 0.05, "priority": 3})
            assert resp.choices[0].text is not None

        def unknown_model():
            try:
                cmpl(c, model="no-such-model", prompt="hi", max_tokens=2)
            except openai.NotFoundError as e:
                code = getattr(e, "code", None)
                body = e.body if isinstance(e.body, dict) else {}
                code = code or body.get("code") or (body.get("error") or {}).get("code")
                assert code == "model_not_found", f"code {code!r}, body {e.body!r}"
            else:
                raise AssertionError("no NotFoundError for an unknown model")
            try:
                chat(c, model="no-such-model", messages=CHAT_Q, max_tokens=2)
            except openai.NotFoundError:
                pass
            else:
                raise AssertionError("chat: no NotFoundError for an unknown model")

        def metrics_count_a_request():
            su.wait_idle(srv.url)
            before = su.parse_metrics(su.metrics(srv.url))
            resp = cmpl(c, prompt="Metrics check: one two three", temperature=0, max_tokens=7)
            u = resp.usage
            fin = resp.choices[0].finish_reason
            after = su.parse_metrics(su.wait_idle(srv.url))

            def delta(name, **lb):
                return (su.metric(after, name, **lb) or 0) - (su.metric(before, name, **lb) or 0)
            bad = []
            for name, lb, want in (
                    ("shoal_prompt_tokens_total", {}, u.prompt_tokens),
                    ("shoal_generation_tokens_total", {}, u.completion_tokens),
                    ("shoal_requests_finished_total", {"reason": fin}, 1),
                    ("shoal_time_to_first_token_seconds_count", {}, 1),
                    ("shoal_e2e_request_latency_seconds_count", {}, 1)):
                if delta(name, **lb) != want:
                    bad.append(f"{name}{lb or ''} rose by {delta(name, **lb)}, want {want}")
            tpot = delta("shoal_time_per_output_token_seconds_count")
            if tpot not in (u.completion_tokens - 1, u.completion_tokens, 1):
                bad.append(f"shoal_time_per_output_token_seconds_count rose by {tpot} for "
                           f"{u.completion_tokens} tokens")
            for g in ("shoal_kv_usage_ratio", "shoal_prefix_cache_hit_ratio"):
                v = su.metric(after, g)
                if v is None or not 0 <= v <= 1:
                    bad.append(f"{g} = {v}, want 0..1")
            if (su.metric(after, "shoal_e2e_request_latency_seconds_sum") or 0) <= 0:
                bad.append("shoal_e2e_request_latency_seconds_sum is 0")
            assert not bad, "; ".join(bad)

        def prefix_cache():
            long = "Prefix cache probe. " + " ".join(f"item{i}" for i in range(120))
            cmpl(c, prompt=long, temperature=0, max_tokens=2)
            cmpl(c, prompt=long + " and more", temperature=0, max_tokens=2)
            text = su.metrics(srv.url)
            ratio = su.metric(text, "shoal_prefix_cache_hit_ratio")
            assert ratio is not None and ratio > 0, \
                f"shoal_prefix_cache_hit_ratio {ratio} after a repeated 200-token prefix"

        def unicode_stream():
            for prompt in ("Traduis en japonais : « bonjour le monde » →",
                           "Emoji story: 🎉🐍🚀",
                           "用中文回答：天空是什么颜色？"):
                cmpl(c, prompt=prompt, temperature=0, max_tokens=24)  # warm the prefix cache
                want = cmpl(c, prompt=prompt, temperature=0, max_tokens=24).choices[0].text
                texts, _, chunks = stream_completion(c, prompt=prompt, temperature=0,
                                                     max_tokens=24)
                assert texts.get(0) == want, f"{prompt!r}: stream {texts.get(0)!r} != {want!r}"
                if "\ufffd" not in want:
                    for ch in chunks:
                        for x in ch.choices:
                            assert "\ufffd" not in (x.text or ""), \
                                f"{prompt!r}: a chunk splits a UTF-8 character: {x.text!r}"
                chat(c, messages=[{"role": "user", "content": prompt}], temperature=0,
                     max_tokens=24)
                want = chat(c, messages=[{"role": "user", "content": prompt}], temperature=0,
                            max_tokens=24).choices[0].message.content
                texts, _, _ = stream_chat(c, messages=[{"role": "user", "content": prompt}],
                                          temperature=0, max_tokens=24)
                assert texts.get(0) == want, f"chat {prompt!r}: stream {texts.get(0)!r} != {want!r}"

        def multi_turn():
            msgs = [{"role": "system", "content": "You are terse."},
                    {"role": "user", "content": "Name a fruit."},
                    {"role": "assistant", "content": "Apple."},
                    {"role": "user", "content": "Another one?"}]
            a = chat(c, messages=msgs, temperature=0, max_tokens=8)
            assert a.choices[0].message.content, a
            b = chat(c, messages=msgs[1:], temperature=0, max_tokens=8)
            assert a.usage.prompt_tokens != b.usage.prompt_tokens, \
                "the system message did not change the prompt"
            d = chat(c, messages=[{"role": "developer", "content": "You are terse."}] + msgs[1:],
                     temperature=0, max_tokens=8)
            assert d.usage.prompt_tokens == a.usage.prompt_tokens and \
                d.choices[0].message.content == a.choices[0].message.content, \
                "role developer is not treated as system"
            parts = chat(c, messages=[{"role": "user", "content": [
                {"type": "text", "text": "Name a "}, {"type": "text", "text": "fruit."}]}],
                temperature=0, max_tokens=8)
            plain = chat(c, messages=[{"role": "user", "content": "Name a fruit."}],
                         temperature=0, max_tokens=8)
            assert parts.choices[0].message.content == plain.choices[0].message.content, \
                "content parts differ from the same plain text"

        r.case("models.list", models)
        r.case("chat 2+2", chat_basic)
        r.case("completion", completion_basic)
        if "cmpl" in st:
            r.case("completion stream == non-stream", completion_stream)
            r.case("completion stream include_usage", completion_stream_usage)
            r.case("stop strings", stop_strings)
            r.case("stop strings streamed", stop_strings_stream)
            r.case("n=2", n_choices)
        else:
            r.fail("completion-dependent cases", "not run: the plain completion failed")
        if "chat" in st:
            r.case("chat stream == non-stream", chat_stream)
        r.case("logprobs completions", logprobs_completion)
        r.case("logprobs chat", logprobs_chat)
        r.case("seed reproducibility", seed_repro)
        r.case("token-id prompt", token_prompt)
        r.case("logit_bias", logit_bias)
        r.case("sampling params + extensions", extensions)
        r.case("unknown model -> NotFoundError", unknown_model)
        r.case("multi-turn chat, system/developer roles, content parts", multi_turn)
        r.case("UTF-8 streaming (multi-byte characters)", unicode_stream)
        r.case("prefix cache hit ratio", prefix_cache)
        r.case("metrics count one request exactly", metrics_count_a_request)
        r.case("idle afterwards", su.wait_idle, srv.url)


if __name__ == "__main__":
    main()
