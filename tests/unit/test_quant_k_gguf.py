#!/usr/bin/env python3
"""Our K-quant, Q5_0/Q5_1 and IQ4_NL/IQ4_XS scalar reference against an independent one: the PyPI `gguf`
package's NumPy dequantizer (pinned in tests/reference/requirements.txt). Random blocks of bytes
for Q2_K..Q6_K, Q5_0, Q5_1, IQ4_NL and IQ4_XS, with their fp16 scales made finite, are dequantized by
kernels/cpu/quant_k.c / quant.c (through quant_k_tool) and by gguf.quants.dequantize; the floats
must be bit-identical. Where gguf can quantize a type, our quantizer's bytes are compared with its
on random floats (gguf 0.19.0 quantizes Q5_0 and Q5_1 but has no K-quant quantizer, so for the
K and IQ4 types that part reports itself as not run). With SH_GGML_LIB set to a built
libggml-base.so (llama.cpp's, e.g. from the llama-cpp-python sdist; not needed by CI), our
quantizer's bytes are also compared with ggml's quantize_row_*_ref on random floats, Q8_K
included, and for IQ4_NL / IQ4_XS with ggml's quantize_iq4_nl / quantize_iq4_xs without an
importance matrix (what llama-quantize runs; ggml's quantize_row_iq4_nl_ref skips the scale
search). The seed is
printed; SH_TEST_SEED repeats a run. Exit 77 (skip) only when numpy or gguf cannot be imported.
Usage: test_quant_k_gguf.py QUANT_K_TOOL"""
import os
import subprocess
import sys
import tempfile

try:
    import numpy as np
    import gguf
    from gguf import GGMLQuantizationType as QT
    from gguf import quants
except ImportError as e:  # the only reason to skip
    print(f"skip: python cannot import the reference ({e}); run scripts/test-venv.sh")
    sys.exit(77)

# Byte offsets of each type's fp16 fields within its block (ggml's block_q*_K layouts).
HALF_FIELDS = {
    "Q2_K": (80, 82),  # scales[16] qs[64] d dmin
    "Q3_K": (108,),  # hmask[32] qs[64] scales[12] d
    "Q4_K": (0, 2),  # d dmin scales[12] qs[128]
    "Q5_K": (0, 2),  # d dmin scales[12] qh[32] qs[128]
    "Q6_K": (208,),  # ql[128] qh[64] scales[16] d
    "Q5_0": (0,),  # d qh[4] qs[16] (blocks of 32)
    "Q5_1": (0, 2),  # d m qh[4] qs[16]
    "IQ4_NL": (0,),  # d qs[16] (blocks of 32)
    "IQ4_XS": (0,),  # d scales_h scales_l[4] qs[128]
}
N_ELEMS = 2048 * 256  # per type: 2048 K-quant blocks, 16384 blocks of 32
failures = 0


def fail(msg):
    global failures
    failures += 1
    print("FAIL:", msg)


def run_tool(tool, mode, name, data, tmp):
    src, dst = os.path.join(tmp, "in.bin"), os.path.join(tmp, "out.bin")
    with open(src, "wb") as f:
        f.write(data)
    subprocess.run([tool, mode, name, src, dst], check=True)
    with open(dst, "rb") as f:
        return f.read()


def random_blocks(rng, name):
    qtype = getattr(QT, name)
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    nb = N_ELEMS // block_elems
    raw = rng.integers(0, 256, size=(nb, block_bytes), dtype=np.uint8)
    for off in HALF_FIELDS[name]:
        h = raw[:, off : off + 2].copy().view("<u2").reshape(-1)
        # Exponent 31 is infinity or NaN: flip its top bit (exponent 15, values around 1) so every
        # scale is finite; zeros, subnormals and both signs stay in the mix.
        bad = ((h >> 10) & 0x1F) == 0x1F
        h[bad] ^= 0x4000
        raw[:, off : off + 2] = h.view(np.uint8).reshape(nb, 2)
    # A few blocks with a zero scale, as real files have.
    raw[:8, HALF_FIELDS[name][0] : HALF_FIELDS[name][0] + 2] = 0
    return qtype, raw


def check_dequant(tool, rng, name, tmp):
    qtype, raw = random_blocks(rng, name)
    block_elems = gguf.GGML_QUANT_SIZES[qtype][0]
    ref = quants.dequantize(raw.reshape(-1), qtype).astype(np.float32).reshape(-1)
    ours = np.frombuffer(run_tool(tool, "deq", name, raw.tobytes(), tmp), dtype="<f4")
    if ours.shape != ref.shape:
        fail(f"{name}: {ours.size} floats from us, {ref.size} from gguf")
        return
    same = ours.view(np.uint32) == ref.view(np.uint32)
    if not same.all():
        i = int(np.flatnonzero(~same)[0])
        fail(f"{name}: {int((~same).sum())} of {ref.size} floats differ; first at element {i} "
             f"(block {i // block_elems}): ours {ours[i]!r} gguf {ref[i]!r}")
    else:
        print(f"ok: {name} dequantization of {raw.shape[0]} random blocks bit-identical to gguf "
              f"{gguf_version()}")


def check_quant(tool, rng, name, tmp):
    qtype = getattr(QT, name)
    x = random_floats(rng, 256).reshape(-1)
    try:
        ref = quants.quantize(x.reshape(256, 256), qtype)
    except NotImplementedError:
        print(f"not run: gguf {gguf_version()} cannot quantize {name}, so our quantizer's bytes "
              "are not compared here")
        return
    ours = run_tool(tool, "q", name, x.tobytes(), tmp)
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    a = np.frombuffer(ours, np.uint8)
    b = ref.reshape(-1).view(np.uint8)
    if a.shape != b.shape:
        fail(f"{name}: {a.size} quantized bytes from us, {b.size} from gguf")
        return
    differ = (a.reshape(-1, block_bytes) != b.reshape(-1, block_bytes)).any(axis=1)
    if differ.any():
        fail(f"{name}: {int(differ.sum())} of {differ.size} quantized blocks differ from gguf's; "
             f"first block {int(np.flatnonzero(differ)[0])}")
    else:
        print(f"ok: {name} quantization of {differ.size} random blocks byte-identical to gguf "
              f"{gguf_version()}")


def random_floats(rng, rows):
    """Rows of 256 floats: per-row scale over seven decades, a quarter of the rows shifted to one
    sign, a few exact ties and zeros."""
    scale = 10.0 ** rng.uniform(-4, 3, size=(rows, 1))
    shift = rng.uniform(-2, 2, size=(rows, 1)) * (rng.random((rows, 1)) < 0.25)
    x = ((rng.standard_normal((rows, 256)) + shift) * scale).astype(np.float32)
    x[0, :] = 0  # an all-zero row
    x[1, :] = -0.7  # a constant row
    x[2, ::2] = -x[2, 1::2]  # equal magnitudes of both signs
    return x


def check_ggml(tool, rng, tmp, lib_path):
    """Our quantizer against ggml's own reference, through ctypes (optional)."""
    import ctypes

    lib = ctypes.CDLL(lib_path)
    for name in list(HALF_FIELDS) + ["Q8_K"]:
        block_elems, block_bytes = gguf.GGML_QUANT_SIZES[getattr(QT, name)]
        x = random_floats(rng, 1024).reshape(-1)
        nb = x.size // block_elems
        ref = np.zeros(nb * block_bytes, np.uint8)
        if name.startswith("IQ4"):  # llama-quantize's entry point: rows of 256, no imatrix
            fn = getattr(lib, f"quantize_{name.lower()}")
            fn(ctypes.c_void_p(x.ctypes.data), ctypes.c_void_p(ref.ctypes.data),
               ctypes.c_int64(x.size // 256), ctypes.c_int64(256), ctypes.c_void_p(None))
        else:
            fn = getattr(lib, f"quantize_row_{name[:2].lower()}{name[2:]}_ref")
            fn(ctypes.c_void_p(x.ctypes.data), ctypes.c_void_p(ref.ctypes.data),
               ctypes.c_int64(x.size))
        ours = np.frombuffer(run_tool(tool, "q", name, x.tobytes(), tmp), np.uint8)
        differ = (ours.reshape(nb, -1) != ref.reshape(nb, -1)).any(axis=1)
        if differ.any():
            fail(f"{name}: {int(differ.sum())} of {nb} blocks differ from ggml's quantize_row_ref")
        else:
            print(f"ok: {name} quantization of {nb} random blocks byte-identical to ggml's reference")


def gguf_version():
    try:
        from importlib.metadata import version

        return version("gguf")
    except Exception:
        return "?"


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    tool = sys.argv[1]
    env_seed = os.environ.get("SH_TEST_SEED")
    seed = int(env_seed, 0) if env_seed else int.from_bytes(os.urandom(8), "little")
    print(f"seed {seed} (SH_TEST_SEED to repeat)")
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory(prefix="shoal-qk-") as tmp:
        for name in HALF_FIELDS:
            check_dequant(tool, rng, name, tmp)
            check_quant(tool, rng, name, tmp)
        if os.environ.get("SH_GGML_LIB"):
            check_ggml(tool, rng, tmp, os.environ["SH_GGML_LIB"])
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
