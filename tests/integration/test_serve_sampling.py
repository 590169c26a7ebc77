"""`shoal serve` sampling defaults and sampling fields, against the default model.

Checks: the built-in defaults (llama-server's: temperature 0.8, top_k 40, top_p 0.95, min_p 0.05)
are what /v1/models and the start-up line report; --temp 0 as the serve default makes a request
without "temperature" greedy (equal to one with temperature 0), and a request's own temperature
still wins; a copy of the model with general.sampling.temp = 0 and general.sampling.top_k = 7
(written here) gives those defaults without flags, and a flag beats the file; typical_p,
repeat_penalty/repeat_last_n and repetition_penalty are served (a penalty changes the greedy
text, repeat_last_n 0 turns it off); the sampling fields not implemented (mirostat, xtc, ...) are
400s naming the field while their neutral values are accepted, and the server keeps serving;
`shoal run` takes the model file's keys where no flag is given; min_tokens masks the
end-of-sequence token (greedy continues with the next best) where ignore_eos generates it.
"""

import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _skip_value(b, o, t):
    if t == 8:  # string
        n = struct.unpack_from("<Q", b, o)[0]
        return o + 8 + n
    if t == 9:  # array
        et, n = struct.unpack_from("<IQ", b, o)
        o += 12
        if et in GGUF_SIZES:
            return o + n * GGUF_SIZES[et]
        for _ in range(n):
            o = _skip_value(b, o, et)
        return o
    return o + GGUF_SIZES[t]


def gguf_with_keys(src, dst, extra):
    """Copies the GGUF file src to dst with extra metadata: a list of (key, type, value) with
    type 4 (uint32) or 6 (float32). The tensor data is copied as is, re-aligned."""
    with open(src, "rb") as f:
        b = f.read()
    magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", b, 0)
    assert magic == b"GGUF" and version >= 2, "not a GGUF v2+ file"
    o = 24
    alignment = 32
    for _ in range(n_kv):
        klen = struct.unpack_from("<Q", b, o)[0]
        key = b[o + 8:o + 8 + klen].decode()
        o += 8 + klen
        t = struct.unpack_from("<I", b, o)[0]
        o += 4
        if key == "general.alignment":
            alignment = struct.unpack_from("<I", b, o)[0]
        o = _skip_value(b, o, t)
    kv_end = o
    for _ in range(n_tensors):
        nlen = struct.unpack_from("<Q", b, o)[0]
        o += 8 + nlen
        nd = struct.unpack_from("<I", b, o)[0]
        o += 4 + 8 * nd + 4 + 8
    ti_end = o
    data_off = (ti_end + alignment - 1) // alignment * alignment
    add = b""
    for key, t, val in extra:
        k = key.encode()
        add += struct.pack("<Q", len(k)) + k + struct.pack("<I", t)
        add += struct.pack("<I" if t == 4 else "<f", val)
    head = struct.pack("<4sIQQ", magic, version, n_tensors, n_kv + len(extra))
    out = head + b[24:kv_end] + add + b[kv_end:ti_end]
    out += b"\0" * ((-len(out)) % alignment)
    with open(dst, "wb") as f:
        f.write(out)
        f.write(memoryview(b)[data_off:])


def cmpl(srv, want=200, **kw):
    body = dict(prompt=PROMPT, max_tokens=16)
    body.update(kw)
    st, parsed, raw = su.post_json(srv.url, "/v1/completions", body)
    assert st == want, f"status {st}, want {want}: {raw[:300]!r}"
    return parsed


def text(srv, **kw):
    return cmpl(srv, **kw)["choices"][0]["text"]


def sampling_defaults(srv):
    st, _, raw = su.get(srv.url, "/v1/models")
    parsed = json.loads(raw) if st == 200 else None
    assert st == 200, f"/v1/models: {st} {raw[:200]!r}"
    d = parsed["data"][0].get("sampling_defaults")
    assert isinstance(d, dict), f"/v1/models has no sampling_defaults: {raw[:300]!r}"
    return d


def near(a, b):
    return abs(a - b) < 1e-4


def run_builtin(r):
    with su.server(runner=r) as srv:
        def builtin_reported():
            d = sampling_defaults(srv)
            want = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, typical_p=1,
                        repeat_penalty=1, repeat_last_n=64, presence_penalty=0,
                        frequency_penalty=0)
            for k, v in want.items():
                assert k in d and near(d[k], v), f"sampling_defaults[{k}] = {d.get(k)}, want {v}"
            log = srv.log_text()
            assert "sampling defaults" in log and "temperature 0.8 (built-in)" in log, \
                f"start-up line missing: {log[-600:]}"

        def refused_fields():
            for field, value in [("mirostat", 2), ("xtc_probability", 0.5),
                                 ("dry_multiplier", 0.8), ("top_n_sigma", 1.5),
                                 ("dynatemp_range", 0.3), ("tfs_z", 0.95), ("n_probs", 3),
                                 ("best_of", 2), ("use_beam_search", True),
                                 ("stop_token_ids", [2]), ("samplers", "kt")]:
                st, parsed, raw = su.post_json(srv.url, "/v1/completions",
                                                  dict(prompt=PROMPT, max_tokens=2,
                                                       **{field: value}))
                su.check_error(st, parsed, raw, 400, "unsupported_parameter", field)
                assert parsed["error"]["param"] == field, f"{field}: {raw[:200]!r}"
                assert field in parsed["error"]["message"], f"{field}: {raw[:200]!r}"
            for field, value in [("typical_p", 0), ("repetition_penalty", 0),
                                 ("repeat_last_n", -2), ("typical_p", "x")]:
                st, parsed, raw = su.post_json(srv.url, "/v1/completions",
                                                  dict(prompt=PROMPT, max_tokens=2,
                                                       **{field: value}))
                su.check_error(st, parsed, raw, 400, None, field)
                assert parsed["error"]["param"] == field, f"{field}: {raw[:200]!r}"
            # Neutral values pass (clients that send every field), and the server serves on.
            cmpl(srv, max_tokens=2, mirostat=0, xtc_probability=0, dry_multiplier=0,
                 top_n_sigma=-1, dynatemp_range=0, tfs_z=1, n_probs=0, best_of=1,
                 use_beam_search=False, stop_token_ids=[], samplers=[])

        def fields_served():
            greedy = text(srv, temperature=0, max_tokens=24)
            # repeat_last_n 0: no window, no penalty: the plain greedy text.
            assert text(srv, temperature=0, max_tokens=24, repeat_penalty=5,
                        repeat_last_n=0) == greedy
            # The prompt repeats itself, so greedy continues it; a strong penalty over the
            # prompt and output (vLLM's repetition_penalty) must change that.
            assert text(srv, temperature=0, max_tokens=24, repetition_penalty=5) != greedy
            assert text(srv, temperature=0, max_tokens=24, repeat_penalty=5,
                        repeat_last_n=-1) != greedy
            got = cmpl(srv, temperature=1, seed=3, typical_p=0.5, max_tokens=8)
            assert got["choices"][0]["text"], "typical_p: empty text"
            # typical_p 1 is off: the seeded draw equals one without it.
            assert text(srv, temperature=0.9, seed=5, typical_p=1, max_tokens=12) == \
                text(srv, temperature=0.9, seed=5, max_tokens=12)

        def min_tokens_masks_eos():
            msgs = [{"role": "user", "content": "Say hello."}]

            def chat(**kw):
                st, parsed, raw = su.post_json(srv.url, "/v1/chat/completions",
                                               dict(messages=msgs, temperature=0, logprobs=True,
                                                    **kw))
                assert st == 200, f"{st}: {raw[:300]!r}"
                ch = parsed["choices"][0]
                return [t["token"] for t in ch["logprobs"]["content"]], ch["finish_reason"]

            greedy, fin = chat(max_tokens=64)
            assert fin == "stop", f"greedy did not end by itself within 64 tokens: {greedy}"
            k = len(greedy)
            # ignore_eos generates the end-of-sequence token as an ordinary one...
            ign, _ = chat(max_tokens=k + 5, ignore_eos=True)
            assert ign[:k] == greedy and len(ign) == k + 5, ign
            # ...min_tokens masks it: another token comes in its place, and the text goes on.
            got, fin = chat(max_tokens=64, min_tokens=k + 5)
            assert got[:k] == greedy, f"{got} vs {greedy}"
            assert len(got) >= k + 5, f"{len(got)} tokens < min_tokens {k + 5}: {got}"
            assert got[k] != ign[k], f"end-of-sequence {ign[k]!r} was sampled before min_tokens"
            assert ign[k] not in got[:k + 5], got
            # Nor do stop strings end the text before min_tokens: a stop string that comes early
            # in the greedy text stops it there, but not with min_tokens past it. The stop string
            # is an early token of the greedy text whose first occurrence starts at that token
            # (the greedy answer differs by ISA: "," on AVX-512, none on the AVX2-only EPYC VM).
            full = "".join(greedy)

            def first_at(i):
                t = greedy[i].strip()
                return t and full.find(t) == len("".join(greedy[:i])) + greedy[i].find(t)

            comma = next(i for i in range(1, len(greedy)) if first_at(i))
            stop = greedy[comma].strip()
            upto = "".join(greedy[:comma]) + greedy[comma][:greedy[comma].find(stop)]
            st, parsed, raw = su.post_json(srv.url, "/v1/chat/completions",
                                           dict(messages=msgs, temperature=0, max_tokens=64,
                                                stop=[stop]))
            assert parsed["choices"][0]["message"]["content"] == upto, (stop, raw)
            st, parsed, raw = su.post_json(srv.url, "/v1/chat/completions",
                                           dict(messages=msgs, temperature=0, max_tokens=64,
                                                stop=[stop], min_tokens=comma + 4))
            text_ = parsed["choices"][0]["message"]["content"]
            assert text_.startswith("".join(greedy[:comma + 4])), f"{text_!r} vs {greedy}"
            assert parsed["usage"]["completion_tokens"] >= comma + 4, raw

        r.case("built-in defaults in /v1/models and the start-up line", builtin_reported)
        r.case("min_tokens masks end-of-sequence (ignore_eos generates it) and holds off stops",
               min_tokens_masks_eos)
        r.case("sampling fields not implemented: 400 naming them; neutral values pass",
               refused_fields)
        r.case("repetition_penalty, repeat_penalty/repeat_last_n, typical_p served",
               fields_served)


def run_flag(r):
    with su.server("--temp", "0", "--top-k", "5", runner=r) as srv:
        def flag_greedy():
            d = sampling_defaults(srv)
            assert near(d["temperature"], 0) and d["top_k"] == 5, f"sampling_defaults = {d}"
            assert "temperature 0 (flag)" in srv.log_text()
            want = text(srv, temperature=0, max_tokens=20)
            for seed in (1, 2, 3):
                got = text(srv, seed=seed, max_tokens=20)
                assert got == want, f"seed {seed}: {got!r} != greedy {want!r}"
            # The request's own temperature wins over the flag: seeded draws at temperature 2
            # with top_k off differ from greedy for some seed.
            drawn = {text(srv, temperature=2, top_k=-1, seed=s, max_tokens=20) for s in range(4)}
            assert drawn != {want}, "a request's temperature did not override --temp"

        r.case("--temp 0: a request without temperature is greedy", flag_greedy)


def run_model_file(r, tmp):
    path = os.path.join(tmp, "sampled.gguf")
    gguf_with_keys(su.MODEL, path, [("general.sampling.temp", 6, 0.0),
                                    ("general.sampling.top_k", 4, 7)])
    with su.server(model=path, runner=r) as srv:
        def file_defaults():
            d = sampling_defaults(srv)
            assert near(d["temperature"], 0) and d["top_k"] == 7, f"sampling_defaults = {d}"
            assert near(d["top_p"], 0.95), f"top_p should stay built-in: {d}"
            log = srv.log_text()
            assert "temperature 0 (model file)" in log and "top_k 7 (model file)" in log, \
                log[-600:]
            want = text(srv, temperature=0, max_tokens=20)
            assert text(srv, seed=9, max_tokens=20) == want
            assert text(srv, seed=10, max_tokens=20) == want

        r.case("model file general.sampling.*: the defaults", file_defaults)
    with su.server("--temp", "0.7", model=path, runner=r) as srv:
        def flag_beats_file():
            d = sampling_defaults(srv)
            assert near(d["temperature"], 0.7) and d["top_k"] == 7, f"sampling_defaults = {d}"

        r.case("a flag beats the model file", flag_beats_file)

    # shoal run: the same keys apply where no flag is given (its own default is greedy).
    hot = os.path.join(tmp, "hot.gguf")
    gguf_with_keys(su.MODEL, hot, [("general.sampling.temp", 6, 1.5)])

    def run_cli(model, *args):
        p = subprocess.run([su.shoal_binary(), "run", "-m", model, "-p", PROMPT, "-n", "16",
                            "-t", "2", *args], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, f"shoal run {args}: exit {p.returncode}: {p.stderr[-400:]}"
        return p.stdout, p.stderr

    def run_file_defaults():
        greedy, err = run_cli(su.MODEL)
        assert "model file" not in err, err[-400:]
        out, _ = run_cli(hot, "--temp", "0")
        assert out == greedy, f"--temp 0 did not beat the model file: {out!r} != {greedy!r}"
        outs = set()
        for seed in ("1", "2", "3"):
            out, err = run_cli(hot, "--seed", seed)
            assert "sampling from the model file" in err and "temperature 1.5" in err, \
                err[-400:]
            outs.add(out)
        assert outs != {greedy}, "the model file's temperature 1.5 did not apply to shoal run"

    r.case("shoal run takes the model file's general.sampling.* unless a flag is given",
           run_file_defaults)


def main():
    r = su.Runner("serve_sampling")
    su.require_model()
    tmp = tempfile.mkdtemp(prefix="shoal-sampling-")
    try:
        for fn, args in ((run_builtin, ()), (run_flag, ()), (run_model_file, (tmp,))):
            try:
                fn(r, *args)
            except AssertionError as e:  # a server did not start
                r.fail(f"{fn.__name__}: server start", str(e))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    r.finish()


if __name__ == "__main__":
    main()
