"""Broken gemma3, qwen3 and phi3 files through the real binary: `shoal run` and `shoal serve` must exit
with code 2 and exactly one `error:` line naming the missing or bad tensor or key (never a crash,
ASan clean in the Debug suite).

The variants are written with the PyPI gguf package from the tiny golden models
(tests/data/golden/{gemma3,qwen3,phi3}-tiny-f16.gguf): a tensor left out, a key left out, a
QK-norm or fused FFN of the wrong size, Gemma 2's attention soft-capping, a sliding-window layout
without a period, an unknown rope scaling type, LongRoPE factors of the wrong length.
Exit 77 when the gguf package is missing (scripts/test-venv.sh installs it).
Env: SH_SHOAL (the binary), SH_SOURCE_DIR (repository root).
"""
import os
import subprocess
import sys
import tempfile

try:
    import numpy as np
    import gguf
except ImportError:
    print("SKIP: numpy/gguf missing (scripts/test-venv.sh)")
    sys.exit(77)

ROOT = os.environ.get("SH_SOURCE_DIR") or os.path.abspath(
    os.path.join(os.path.dirname(__file__), "..", ".."))
SHOAL = os.environ.get("SH_SHOAL") or os.path.join(ROOT, "build", "shoal")
GOLDEN = os.path.join(ROOT, "tests", "data", "golden")


def write_variant(src, dst, drop_key=None, drop_tensor=None, set_kv=None, cut_tensor=None,
                  add_tensor=None):
    """Copies src to dst without drop_key / drop_tensor, with set_kv = (key, value, type[, sub])
    and add_tensor = (name, numpy array) added, and with cut_tensor's first dimension halved."""
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch)
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture" or k == drop_key:
            continue
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(k, f.contents(), f.types[0], f.types[1])
        else:
            w.add_key_value(k, f.contents(), f.types[0])
    if set_kv:
        w.add_key_value(*set_kv)
    for t in r.tensors:
        if t.name == drop_tensor:
            continue
        data = np.array(t.data)
        if t.name == cut_tensor:
            data = data[..., : data.shape[-1] // 2]
        w.add_tensor(t.name, data)
    if add_tensor:
        w.add_tensor(*add_tensor)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


CASES = [
    # (name, base, variant options, text the error must hold)
    ("gemma3 without a q-norm", "gemma3", {"drop_tensor": "blk.1.attn_q_norm.weight"},
     "blk.1.attn_q_norm.weight"),
    ("gemma3 without a post-FFN norm", "gemma3", {"drop_tensor": "blk.2.post_ffw_norm.weight"},
     "blk.2.post_ffw_norm.weight"),
    ("gemma3 without a post-attention norm", "gemma3",
     {"drop_tensor": "blk.0.post_attention_norm.weight"}, "blk.0.post_attention_norm.weight"),
    ("gemma3 without its head count", "gemma3", {"drop_key": "gemma3.attention.head_count"},
     "gemma3.attention.head_count"),
    ("gemma3 with a k-norm of half the head size", "gemma3",
     {"cut_tensor": "blk.0.attn_k_norm.weight"}, "blk.0.attn_k_norm.weight"),
    ("gemma3 with attention soft-capping", "gemma3",
     {"set_kv": ("gemma3.attn_logit_softcapping", 50.0, gguf.GGUFValueType.FLOAT32)},
     "gemma3.attn_logit_softcapping"),
    ("gemma3 with sliding layers in no period", "gemma3",
     {"drop_key": "gemma3.attention.sliding_window_pattern",
      "set_kv": ("gemma3.attention.sliding_window_pattern", [False, True, True],
                 gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.BOOL)},
     "gemma3.attention.sliding_window_pattern"),
    ("qwen3 without a k-norm", "qwen3", {"drop_tensor": "blk.0.attn_k_norm.weight"},
     "blk.0.attn_k_norm.weight"),
    ("qwen3 without its layer count", "qwen3", {"drop_key": "qwen3.block_count"},
     "qwen3.block_count"),
    ("qwen3 with an unknown rope scaling type", "qwen3",
     {"set_kv": ("qwen3.rope.scaling.type", "ntk-by-parts", gguf.GGUFValueType.STRING)},
     "qwen3.rope.scaling.type"),
    ("phi3 without a fused QKV", "phi3", {"drop_tensor": "blk.1.attn_qkv.weight"},
     "blk.1.attn_qkv.weight"),
    ("phi3 with a fused FFN of the wrong shape", "phi3", {"cut_tensor": "blk.0.ffn_up.weight"},
     "blk.0.ffn_up.weight"),
    ("phi3 with LongRoPE factors of the wrong length", "phi3",
     {"add_tensor": ("rope_factors_long.weight", np.ones(5, dtype=np.float32))},
     "rope_factors_long.weight"),
]


def check(name, argv, needle, failures):
    try:
        p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        failures.append(f"{name}: still running after 60 s")
        print(f"FAIL arch_bad: {name}: hung")
        return
    lines = p.stderr.splitlines()
    if p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and \
            needle in lines[0]:
        print(f"ok   arch_bad: {name}: {lines[0]}")
    else:
        failures.append(name)
        print(f"FAIL arch_bad: {name}: exit {p.returncode}, want 2 and one 'error:' line naming "
              f"{needle!r}; stderr: {p.stderr[-600:]!r}")


def main():
    if not os.access(SHOAL, os.X_OK):
        print(f"FAIL: no shoal binary at {SHOAL} (set SH_SHOAL)")
        return 1
    failures = []
    with tempfile.TemporaryDirectory(prefix="shoal-arch-bad.") as tmp:
        for i, (name, base, opts, needle) in enumerate(CASES):
            path = os.path.join(tmp, f"v{i}.gguf")
            write_variant(os.path.join(GOLDEN, f"{base}-tiny-f16.gguf"), path, **opts)
            check(f"run: {name}", [SHOAL, "run", "-m", path, "-p", "hi", "-n", "1", "-t", "1"],
                  needle, failures)
            if i in (0, len(CASES) - 2):  # serve loads the model before it listens
                check(f"serve: {name}", [SHOAL, "serve", "-m", path, "--port", "0", "-t", "1"],
                      needle, failures)
        # The unchanged files run (so the refusals above are the variants' doing).
        for base in ("gemma3", "qwen3", "phi3"):
            p = subprocess.run([SHOAL, "run", "-m", os.path.join(GOLDEN, f"{base}-tiny-f16.gguf"),
                                "--prompt-ids", "1 2 3", "-n", "4", "--ids", "-t", "1"], cwd=ROOT,
                               capture_output=True, text=True, timeout=60)
            if p.returncode == 0 and len(p.stdout.split()) == 4:
                print(f"ok   arch_bad: the unchanged {base} file runs: {p.stdout.strip()}")
            else:
                failures.append(f"{base} unchanged")
                print(f"FAIL arch_bad: unchanged {base}: exit {p.returncode}: {p.stderr[-400:]!r}")
    if failures:
        print(f"arch_bad: {len(failures)} failed")
        return 1
    print("arch_bad: all passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
