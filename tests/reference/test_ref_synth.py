#!/usr/bin/env python3
"""ctest test_mkmodel_ref: the NumPy reference runs on a small `shoal mkmodel` model of every
architecture, the committed synthetic golden data still follows from the committed models, and
(with SH_LLAMA_CPP_BIN=llama.cpp/build/bin) llama.cpp's greedy text equals the reference's.

Usage: test_ref_synth.py SHOAL_BINARY. Exit 77 when numpy / gguf cannot be imported.
"""
import os
import subprocess
import sys
import tempfile

try:
    import numpy as np

    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    import ref_forward
    from ref_model import Model
except ImportError as e:
    print(f"skipped: {e} (run scripts/test-venv.sh)")
    sys.exit(77)

root = os.path.dirname(os.path.dirname(here))
SMALL = ("--layers 2 --dim 64 --ffn 128 --heads 4 --kv-heads 2 --vocab 300 --seed 5 "
         "--std 0.3 --untied --type F32").split()
MODELS = {
    "gemma3": "--shape gemma3-270m --layers 3 --head-dim 32 --sliding-window 4 --swa-pattern 2",
    "gemma3-softcap": "--shape gemma3-270m --head-dim 32 --softcap 5 --rope-base-swa 20000",
    "qwen3": "--shape qwen3-0.6b --head-dim 32",
    "qwen3-yarn": "--shape qwen3-0.6b --rope-scaling yarn --rope-factor 4 --rope-orig-ctx 8",
    "qwen3moe": "--shape qwen3moe-tiny --experts 8 --experts-used 3 --expert-ffn 32",
    "mixtral": "--shape mixtral-tiny --experts 4 --experts-used 2",
    "qwen2moe": "--shape qwen2moe-tiny --experts 8 --experts-used 3 --expert-ffn 32 "
                "--shared-ffn 96",
    "olmoe": "--shape olmoe-tiny --kv-heads 4 --experts 8 --experts-used 3",
    "phi3": "--shape phi3-mini",
    # original context 1024 >= the 256 llama.cpp pads its context to: it uses the short factors
    "phi3-longrope": "--shape phi3-mini --ctx 4096 --rope-orig-ctx 1024 --rope-scaling longrope "
                     "--rope-factor 4",
    "llama3": "--shape llama3.2-1b --rope-base 10000 --rope-factor 8 --rope-orig-ctx 16",
    "llama-linear": "--shape custom --rope-scaling linear --rope-factor 2",
}
PROMPT = [5, 17, 260, 3, 99, 140, 7, 7, 31, 200, 11, 42]
failures = []


def fail(msg):
    print("FAIL", msg)
    failures.append(msg)


def mkmodel(shoal, args, path):
    cmd = [shoal, "mkmodel"] + SMALL + args.split() + ["-o", path]  # later options win
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}: {p.stderr}")


def check_model(name, path):
    m = Model(path)
    gen, logits, routes = ref_forward.run(m, PROMPT, 8)
    if not all(np.isfinite(lg).all() for lg in logits):
        fail(f"{name}: non-finite logits")
    if not all(0 <= t < 300 for t in gen):
        fail(f"{name}: ids out of range {gen}")
    if m.softcap and max(float(np.abs(lg).max()) for lg in logits) > m.softcap:
        fail(f"{name}: logits beyond the soft cap {m.softcap}")
    if m.n_expert:
        for pos, layers in enumerate(routes):
            if len(layers) != m.n_layers:
                fail(f"{name}: position {pos} routed in {len(layers)} layers")
            for l, es, ws in layers:
                if len(set(es)) != m.n_expert_used or not all(0 <= e < m.n_expert for e in es):
                    fail(f"{name}: position {pos} layer {l} experts {es}")
                if m.expert_norm and abs(sum(ws) - 1.0) > 1e-9:
                    fail(f"{name}: weights {ws} do not sum to 1")
                if ws != sorted(ws, reverse=True):
                    fail(f"{name}: weights {ws} not in descending order")
    print(f"ok   {name}: {m.arch}, greedy {' '.join(map(str, gen))}")
    return m, logits


def check_swa_plumbing(shoal, tmp):
    """A gemma3 model whose window covers the whole sequence and whose local rope base equals the
    global one computes what the same weights without local layers compute; with a short window
    the result differs (the window is applied)."""
    base = "--shape gemma3-270m --head-dim 32 --rope-base 10000"
    paths = {}
    for tag, extra in (("none", ""), ("wide", " --sliding-window 64 --rope-base-swa 10000"),
                       ("short", " --sliding-window 3 --rope-base-swa 10000")):
        paths[tag] = os.path.join(tmp, f"swa-{tag}.gguf")
        mkmodel(shoal, base + extra, paths[tag])
    out = {t: ref_forward.run(Model(p), PROMPT, 4)[1] for t, p in paths.items()}
    d_wide = max(float(np.abs(a - b).max()) for a, b in zip(out["none"], out["wide"]))
    d_short = max(float(np.abs(a - b).max()) for a, b in zip(out["none"], out["short"]))
    if d_wide != 0.0 or d_short < 1e-3:
        fail(f"gemma3 window: wide window differs by {d_wide}, short by {d_short}")
    else:
        print(f"ok   gemma3 window plumbing (short window moves logits by {d_short:.3g})")


def check_golden():
    """The committed synthetic golden files follow from their committed models (qwen2-tiny has
    its own test, tests/golden/test_llama_qwen2.c)."""
    gdir = os.path.join(root, "tests", "data", "golden")
    for f in sorted(os.listdir(gdir)):
        if not f.endswith("-tiny-f16.gguf") or f == "qwen2-tiny-f16.gguf":
            continue
        stem = f[: -len(".gguf")]
        # made with --long-rope (make_golden_synth.sh's ref_args): the engine takes the long
        # factors there, its 256-token context being past the original 128
        m = Model(os.path.join(gdir, f), long_rope=stem == "phi3-longrope128-tiny-f16")
        lines = open(os.path.join(gdir, stem + ".txt")).read().splitlines()
        prompts = [l.split() for l in lines if l.startswith("prompt ")]
        greedy = [l.split() for l in lines if l.startswith("greedy ")]
        tops = [l.split() for l in lines if l.startswith("top ")]
        if [p[1] for p in prompts] != ["a", "b"] or len(greedy) != 2:
            fail(f"{stem}: prompts {[p[1] for p in prompts]}, want a and b (a cut-short run?)")
        worst = 0.0
        k = 0
        for p, g in zip(prompts, greedy):
            ids = [int(x) for x in p[3:]]
            gen, logits, _ = ref_forward.run(m, ids, int(g[1]))
            if gen != [int(x) for x in g[2:]]:
                fail(f"{stem} prompt {p[1]}: greedy {gen} != committed {g[2:]}")
            for lg in logits:
                t = tops[k]
                k += 1
                for j in range(int(t[2])):
                    i, v = int(t[3 + 2 * j]), float(t[4 + 2 * j])
                    worst = max(worst, abs(lg[i] - v) / max(1.0, abs(v)))
            last = np.fromfile(os.path.join(gdir, f"{stem}.{p[1]}.last.f32"), dtype="<f4")
            worst = max(worst, float(np.abs(last - logits[len(ids) - 1]).max()))
        if worst > 1e-4:
            fail(f"{stem}: committed logits differ by {worst:.3g}")
        print(f"ok   golden {stem}: ids equal, logits within {worst:.2g}")


def main():
    shoal = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for name, args in MODELS.items():
            paths[name] = os.path.join(tmp, name + ".gguf")
            mkmodel(shoal, args, paths[name])
            check_model(name, paths[name])
        check_swa_plumbing(shoal, tmp)
        check_golden()
        llama = os.environ.get("SH_LLAMA_CPP_BIN")
        if llama:
            for name, path in paths.items():
                p = subprocess.run([sys.executable, os.path.join(here, "vs_llamacpp.py"), "--bin",
                                    llama, path, "-n", "16", "hello world", "abc def ghi"],
                                   capture_output=True, text=True)
                print(p.stdout, end="")
                if p.returncode != 0:
                    fail(f"{name}: llama.cpp disagrees: {p.stderr[-500:]}")
        else:
            print("llama.cpp comparison not run (set SH_LLAMA_CPP_BIN=llama.cpp/build/bin)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
