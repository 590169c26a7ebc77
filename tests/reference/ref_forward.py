#!/usr/bin/env python3
"""Independent NumPy reference forward pass for Llama-family GGUF models (golden data for Shoal).

Reads a GGUF with the `gguf` package, dequantizes every tensor to float32 with gguf's own
dequantizer (F32/F16/BF16/Q8_0/Q4_0/Q4_1 ...), runs the model in float64-accumulated float32 with
a plain KV cache, and greedy-decodes. Nothing here shares code with the C implementation.

Usage:
  ref_forward.py MODEL.gguf --ids "1 2 3" [-n N]           print greedy ids
  ref_forward.py MODEL.gguf --golden OUT_PREFIX [-n N] [--topk K] --prompt NAME "ids" ...
      writes OUT_PREFIX.txt (prompts, greedy ids, top-K logits at every position) and
      OUT_PREFIX.NAME.last.f32 (the full logits at each prompt's last position, little-endian).
"""
import argparse
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def field(r, key, default=None):
    f = r.fields.get(key)
    if f is None:
        return default
    return f.contents()


class Model:
    def __init__(self, path):
        r = GGUFReader(path)
        self.arch = field(r, "general.architecture")
        a = self.arch
        self.dim = int(field(r, f"{a}.embedding_length"))
        self.n_layers = int(field(r, f"{a}.block_count"))
        self.n_heads = int(field(r, f"{a}.attention.head_count"))
        self.n_kv_heads = int(field(r, f"{a}.attention.head_count_kv", self.n_heads))
        self.eps = float(field(r, f"{a}.attention.layer_norm_rms_epsilon", 1e-5))
        self.theta = float(field(r, f"{a}.rope.freq_base", 10000.0))
        self.head_dim = self.dim // self.n_heads
        self.rope_dim = int(field(r, f"{a}.rope.dimension_count", self.head_dim))
        # llama GGUFs store Q/K permuted for the interleaved ("normal") rope; qwen2 uses NeoX.
        self.neox = a in ("qwen2", "qwen2moe", "phi3", "gptneox")
        self.t = {}
        self.quantized = set()  # names of block-quantized tensors
        self.act_q8 = False  # emulate int8 activations for quantized weights (see mm)
        for t in r.tensors:
            if t.tensor_type.name not in ("F32", "F16", "BF16"):
                self.quantized.add(t.name)
            # gguf's dequantize returns the numpy shape (rows, cols) = (ne[1], ne[0]).
            w = dequantize(t.data, t.tensor_type).astype(np.float32)
            self.t[t.name] = w.reshape([int(x) for x in reversed(t.shape)])
        if "output.weight" not in self.t:
            self.t["output.weight"] = self.t["token_embd.weight"]  # tied embeddings
            if "token_embd.weight" in self.quantized:
                self.quantized.add("output.weight")

    def w(self, name):
        return self.t[name]

    def mm(self, name, x):
        """W x. With act_q8, x is first rounded as an engine that multiplies quantized weights
        with int8 activations sees it: per 32 elements d = max|x| / 127, x ~ d * round(x / d)."""
        if self.act_q8 and name in self.quantized:
            b = x.astype(np.float32).reshape(-1, 32)
            d = np.abs(b).max(axis=1, keepdims=True) / np.float32(127.0)
            inv = np.where(d != 0, 1.0 / np.where(d != 0, d, 1), 0).astype(np.float32)
            x = (np.rint(b * inv) * d).reshape(-1).astype(np.float32)
        return self.t[name] @ x


def rmsnorm(x, w, eps):
    # y = x / sqrt(mean(x^2) + eps) * w
    return (x / np.sqrt(np.mean(x.astype(np.float64) ** 2) + eps)).astype(np.float32) * w


def rope(x, pos, m):
    """Rotates each head's first rope_dim dims by angle pos * theta^(-2i/rope_dim)."""
    n = m.rope_dim
    i = np.arange(n // 2, dtype=np.float64)
    ang = pos * m.theta ** (-2.0 * i / n)
    c, s = np.cos(ang), np.sin(ang)
    out = x.astype(np.float64).copy()
    if m.neox:  # pairs (i, i + n/2)
        a, b = out[:, : n // 2].copy(), out[:, n // 2 : n].copy()
        out[:, : n // 2] = a * c - b * s
        out[:, n // 2 : n] = a * s + b * c
    else:  # pairs (2i, 2i+1)
        a, b = out[:, 0:n:2].copy(), out[:, 1:n:2].copy()
        out[:, 0:n:2] = a * c - b * s
        out[:, 1:n:2] = a * s + b * c
    return out.astype(np.float32)


class Runner:
    def __init__(self, m):
        self.m = m
        self.k = [[] for _ in range(m.n_layers)]
        self.v = [[] for _ in range(m.n_layers)]

    def step(self, token, pos):
        m = self.m
        hd, nh, nkv = m.head_dim, m.n_heads, m.n_kv_heads
        x = m.w("token_embd.weight")[token].astype(np.float32)
        for l in range(m.n_layers):
            p = f"blk.{l}."
            h = rmsnorm(x, m.w(p + "attn_norm.weight"), m.eps)
            q = m.mm(p + "attn_q.weight", h)
            k = m.mm(p + "attn_k.weight", h)
            v = m.mm(p + "attn_v.weight", h)
            if p + "attn_q.bias" in m.t:
                q += m.w(p + "attn_q.bias")
                k += m.w(p + "attn_k.bias")
                v += m.w(p + "attn_v.bias")
            q = rope(q.reshape(nh, hd), pos, m)
            k = rope(k.reshape(nkv, hd), pos, m)
            self.k[l].append(k)
            self.v[l].append(v.reshape(nkv, hd))
            K = np.stack(self.k[l])  # (T, nkv, hd)
            V = np.stack(self.v[l])
            att = np.zeros((nh, hd), dtype=np.float64)
            for hh in range(nh):
                g = hh // (nh // nkv)  # grouped-query: heads share KV head g
                sc = K[:, g, :].astype(np.float64) @ q[hh] / np.sqrt(hd)
                sc = np.exp(sc - sc.max())
                sc /= sc.sum()
                att[hh] = sc @ V[:, g, :]
            x = x + m.mm(p + "attn_output.weight", att.reshape(-1).astype(np.float32))
            h = rmsnorm(x, m.w(p + "ffn_norm.weight"), m.eps)
            gt = m.mm(p + "ffn_gate.weight", h)
            up = m.mm(p + "ffn_up.weight", h)
            act = gt / (1.0 + np.exp(-gt.astype(np.float64))) * up  # SwiGLU: silu(gate) * up
            x = x + m.mm(p + "ffn_down.weight", act.astype(np.float32))
        x = rmsnorm(x, m.w("output_norm.weight"), m.eps)
        return m.mm("output.weight", x).astype(np.float32)


def run(m, ids, n):
    """Feeds the prompt, then greedy-decodes n tokens. Returns (generated ids, logits per input
    position of prompt + generated[:-1])."""
    r = Runner(m)
    logits = []
    seq = list(ids)
    gen = []
    pos = 0
    for t in seq:
        logits.append(r.step(t, pos))
        pos += 1
    for i in range(n):
        nxt = int(np.argmax(logits[-1]))
        gen.append(nxt)
        if i + 1 < n:
            logits.append(r.step(nxt, pos))
            pos += 1
    return gen, logits


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--ids", help="prompt token ids, space-separated")
    ap.add_argument("-n", type=int, default=16)
    ap.add_argument("--golden", help="output prefix for golden files")
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--prompt", nargs=2, action="append", metavar=("NAME", "IDS"))
    ap.add_argument("--act-q8", action="store_true",
                    help="round matmul inputs of quantized weights to int8 per 32 (as engines do)")
    ap.add_argument("--no-last", action="store_true", help="do not write the .last.f32 files")
    a = ap.parse_args()
    m = Model(a.model)
    m.act_q8 = a.act_q8
    if a.ids is not None:
        gen, _ = run(m, [int(x) for x in a.ids.split()], a.n)
        print(" ".join(map(str, gen)))
        return 0
    if not a.golden or not a.prompt:
        ap.error("give --ids, or --golden with --prompt")
    with open(a.golden + ".txt", "w") as f:
        mode = " --act-q8" if a.act_q8 else ""
        f.write(f"# {a.model} greedy reference from tests/reference/ref_forward.py{mode}\n")
        f.write("# prompt NAME N ids... | greedy N ids... | top POS K (id logit)*K\n")
        for name, idstr in a.prompt:
            ids = [int(x) for x in idstr.split()]
            gen, logits = run(m, ids, a.n)
            f.write(f"prompt {name} {len(ids)} {' '.join(map(str, ids))}\n")
            f.write(f"greedy {len(gen)} {' '.join(map(str, gen))}\n")
            for pos, lg in enumerate(logits):
                top = np.argsort(-lg, kind="stable")[: a.topk]
                f.write(f"top {pos} {a.topk} " + " ".join(f"{i} {lg[i]:.6g}" for i in top) + "\n")
            if not a.no_last:
                logits[len(ids) - 1].astype("<f4").tofile(f"{a.golden}.{name}.last.f32")
            print(name, "->", " ".join(map(str, gen)), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
