#!/usr/bin/env python3
"""Checks the NumPy reference against llama.cpp (built by hand, not part of Shoal): greedy
continuations of text prompts, on a real model or a synthetic one from `shoal mkmodel`.

  vs_llamacpp.py --bin LLAMA_BIN_DIR MODEL.gguf [-n 16] [--tie 0.5] "prompt" ...
  vs_llamacpp.py --json tests/data/gemma3/llamacpp_ref.json MODEL.gguf [-n 16]

llama-tokenize gives the prompt ids, llama-simple (greedy) the continuation as text; the
reference's greedy ids, detokenized with the file's vocabulary (SentencePiece or byte-level BPE),
must give the same text, or the first difference must sit where the reference's top two logits
are within --tie. Exit 0 when every prompt agrees (up to a near tie), 1 otherwise. Manual: needs
llama.cpp, which Shoal does not ship.
"""
import argparse
import os
import re
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ref_forward import run  # noqa: E402
from ref_model import Model  # noqa: E402


def llama(bindir, tool, args):
    env = dict(os.environ, LD_LIBRARY_PATH=bindir)
    p = subprocess.run([os.path.join(bindir, tool)] + args, env=env, capture_output=True,
                       text=False, timeout=600)
    if p.returncode != 0:
        sys.stderr.write(p.stderr.decode("utf-8", "replace")[-2000:])
        raise SystemExit(f"{tool} failed with {p.returncode}")
    return p.stdout


def piece_bytes(tokens, model_kind, i):
    s = tokens[i]
    if model_kind == "llama":  # SentencePiece: U+2581 is a space, <0xNN> a raw byte
        m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", s)
        if m:
            return bytes([int(m.group(1), 16)])
        return s.replace("\u2581", " ").encode()
    # byte-level BPE: each character stands for one byte (GPT-2's byte-to-unicode map)
    bs = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    k = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + k)
            k += 1
    inv = {chr(c): b for b, c in zip(bs, cs)}
    try:
        return bytes(inv[ch] for ch in s)
    except KeyError:
        return s.encode()


def check_json(a, m):
    """Greedy ids against llama.cpp's recorded ones, up to its end of generation."""
    import json

    ref = json.load(open(a.json))
    eog = set(ref.get("eog_ids", []))
    bad = 0
    for p in ref["prompts"]:
        want = [st["id"] for st in p["steps"]][: a.n]
        gen, logits, _ = run(m, p["prompt_ids"], len(want))
        k = 0
        while k < len(want) and gen[k] == want[k] and want[k] not in eog:
            k += 1
        if k == len(want) or want[k] in eog and gen[k] == want[k]:
            print(f"AGREE  {k}/{len(want)}  {p['prompt']!r}")
            continue
        top = p["steps"][k]["top"]
        gap = top[0][1] - top[1][1]
        lg = logits[len(p["prompt_ids"]) - 1 + k]
        t = np.argsort(-lg, kind="stable")[:2]
        tie = gap < a.tie
        bad += not tie
        print(f"{'TIE   ' if tie else 'DIFFER'} at {k}/{len(want)} {p['prompt']!r}: llama.cpp "
              f"{want[k]} (top-2 log-prob gap {gap:.3f}), reference {gen[k]} (top-2 logit gap "
              f"{float(lg[t[0]] - lg[t[1]]):.3f})")
    return 1 if bad else 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", help="llama.cpp build/bin")
    ap.add_argument("--json", help="ids recorded from llama.cpp (tests/data/gemma3/*.json)")
    ap.add_argument("model")
    ap.add_argument("prompts", nargs="*")
    ap.add_argument("-n", type=int, default=16)
    ap.add_argument("--long-rope", action="store_true",
                    help="use rope_factors_long (llama.cpp does when its context, padded to 256, "
                    "exceeds rope.scaling.original_context_length)")
    ap.add_argument("--tie", type=float, default=0.5, help="near-tie logit margin")
    a = ap.parse_intermixed_args()
    m = Model(a.model, long_rope=a.long_rope)
    if a.json:
        return check_json(a, m)
    if not a.bin or not a.prompts:
        ap.error("give --bin and prompts, or --json")
    tokens = [bytes(f.parts[i]).decode("utf-8", "replace")
              for f in [m.fields["tokenizer.ggml.tokens"]] for i in f.data]
    kind = m.fields["tokenizer.ggml.model"].contents()
    # llama-simple stops at an end-of-generation token without printing it.
    eog = {int(m.fields[k].contents()) for k in ("tokenizer.ggml.eos_token_id",
                                                  "tokenizer.ggml.eot_token_id") if k in m.fields}
    eog |= {i for i, t in enumerate(tokens) if t in ("<end_of_turn>", "<|im_end|>", "<|end|>")}
    bad = 0
    for prompt in a.prompts:
        out = llama(a.bin, "llama-tokenize", ["-m", a.model, "-p", prompt, "--ids", "--log-disable"])
        ids = [int(x) for x in re.findall(rb"-?\d+", out.strip().splitlines()[-1])]
        # llama-simple prints the prompt's pieces (BOS included), then the continuation's, with
        # printf("%s"): a NUL byte shows as nothing. Compared as bytes.
        theirs = llama(a.bin, "llama-simple", ["-m", a.model, "-n", str(a.n), prompt])
        theirs = theirs[:-1] if theirs.endswith(b"\n") else theirs

        def raw(toks):
            return b"".join(piece_bytes(tokens, kind, i) for i in toks).replace(b"\0", b"")

        gen, logits, _ = run(m, ids, a.n)
        stop = next((k for k, t in enumerate(gen) if t in eog), None)
        if stop is not None:
            gen = gen[:stop]
        shown = raw(gen).decode("utf-8", "replace")
        if raw(ids + gen) == theirs:
            end = "" if stop is None else f" (end of generation at {stop})"
            print(f"AGREE  {len(gen)}/{a.n}  {prompt!r} -> {shown!r}{end}")
            continue
        # the first generated token after which llama.cpp's output no longer continues ours
        pos = 0
        while pos < len(gen) and theirs.startswith(raw(ids + gen[: pos + 1])):
            pos += 1
        lg = logits[len(ids) - 1 + pos]
        top = np.argsort(-lg, kind="stable")[:2]
        margin = float(lg[top[0]] - lg[top[1]])
        tie = margin < a.tie
        bad += not tie
        print(f"{'TIE   ' if tie else 'DIFFER'} at {pos}/{a.n} (reference margin {margin:.3f}) "
              f"{prompt!r}\n   llama.cpp: {theirs.decode('utf-8', 'replace')!r}\n   reference: "
              f"{raw(ids + gen).decode('utf-8', 'replace')!r}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
