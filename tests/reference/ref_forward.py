#!/usr/bin/env python3
"""Independent NumPy reference forward pass for the GGUF architectures Shoal runs (golden data).

Reads a GGUF with the `gguf` package, dequantizes every tensor to float32 with gguf's own
dequantizer (ref_model.py), runs the model token by token with a plain KV cache (float32 weights
and matmuls, float64 for norms, rope, softmax, the attention sums and the expert mix) and
greedy-decodes. Architectures: llama/mistral (dense or Mixtral-style experts), qwen2, qwen2moe,
qwen3, qwen3moe, gemma3, phi3, olmoe. Nothing here shares code with the C implementation.

Usage:
  ref_forward.py MODEL.gguf --ids "1 2 3" [-n N] [--experts]   print greedy ids (and routing)
  ref_forward.py MODEL.gguf --golden OUT_PREFIX [-n N] [--topk K] --prompt NAME "ids" ...
      writes OUT_PREFIX.txt (prompts, greedy ids, top-K logits at every position, for MoE models
      the experts chosen at every position and layer) and OUT_PREFIX.NAME.last.f32 (the full
      logits at each prompt's last position, little-endian).
"""
import argparse
import math
import sys

import numpy as np

import ref_rope
from ref_model import Model, ModelError


def rmsnorm(x, w, eps):
    # y = x / sqrt(mean(x^2) + eps) * w
    return (x / np.sqrt(np.mean(x.astype(np.float64) ** 2) + eps)).astype(np.float32) * w


def rmsnorm_rows(x, w, eps):
    """RMSNorm of each row of x (heads, head_dim) with one weight vector: Qwen 3 / Gemma 3 QK-norm."""
    x64 = x.astype(np.float64)
    r = np.sqrt(np.mean(x64**2, axis=1, keepdims=True) + eps)
    return (x64 / r).astype(np.float32) * w


def silu(g):
    g = g.astype(np.float64)
    return g / (1.0 + np.exp(-g))


def gelu_tanh(g):
    # GELU, tanh approximation: 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))
    g = g.astype(np.float64)
    return 0.5 * g * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g**3)))


class Runner:
    def __init__(self, m):
        self.m = m
        self.k = [[] for _ in range(m.n_layers)]
        self.v = [[] for _ in range(m.n_layers)]
        self.routes = []  # per step: per MoE layer (layer, experts, weights)

    def ffn(self, p, h):
        """The dense feed-forward: gated (SwiGLU, or GELU-tanh for gemma3), or phi3's fused
        ffn_up whose first half is the gate."""
        m = self.m
        if m.has(p + "ffn_gate.weight"):
            gt = m.mm(p + "ffn_gate.weight", h)
            up = m.mm(p + "ffn_up.weight", h)
        else:
            gu = m.mm(p + "ffn_up.weight", h)
            gt, up = gu[: gu.size // 2], gu[gu.size // 2 :]
        act = (gelu_tanh(gt) if m.arch == "gemma3" else silu(gt)) * up
        return m.mm(p + "ffn_down.weight", act.astype(np.float32))

    def moe(self, l, p, h):
        """Routed experts: router logits, softmax (or sigmoid), top-k, optional renormalisation
        to sum 1 and scale, then the sum of the chosen experts' SwiGLU outputs weighted; plus
        the shared expert (qwen2moe style, gated by sigmoid(ffn_gate_inp_shexp . h)) if any."""
        m = self.m
        logits = m.mm(p + "ffn_gate_inp.weight", h).astype(np.float64)
        if m.expert_gating == 2:
            probs = 1.0 / (1.0 + np.exp(-logits))
        else:
            probs = np.exp(logits - logits.max())
            probs /= probs.sum()
        sel = np.argsort(-probs, kind="stable")[: m.n_expert_used]
        wts = probs[sel]
        if m.expert_norm:
            wts = wts / max(wts.sum(), 6.103515625e-5)
        if m.expert_scale not in (0.0, 1.0):
            wts = wts * m.expert_scale
        out = np.zeros(m.dim, dtype=np.float64)
        gate_e = m.w(p + "ffn_gate_exps.weight") if m.has(p + "ffn_gate_exps.weight") else None
        up_e, down_e = m.w(p + "ffn_up_exps.weight"), m.w(p + "ffn_down_exps.weight")
        for e, wgt in zip(sel, wts):
            up = m.mm(p + "ffn_up_exps.weight", h, up_e[e])
            gt = m.mm(p + "ffn_gate_exps.weight", h, gate_e[e]) if gate_e is not None else up
            act = (silu(gt) * up).astype(np.float32)
            out += wgt * m.mm(p + "ffn_down_exps.weight", act, down_e[e]).astype(np.float64)
        self.routes[-1].append((l, [int(e) for e in sel], [float(x) for x in wts]))
        if m.has(p + "ffn_up_shexp.weight"):
            up = m.mm(p + "ffn_up_shexp.weight", h)
            gt = m.mm(p + "ffn_gate_shexp.weight", h)
            s = m.mm(p + "ffn_down_shexp.weight", (silu(gt) * up).astype(np.float32))
            s = s.astype(np.float64)
            if m.has(p + "ffn_gate_inp_shexp.weight"):
                g = float(m.w(p + "ffn_gate_inp_shexp.weight").reshape(-1).astype(np.float64) @ h)
                s *= 1.0 / (1.0 + math.exp(-g))
            out += s
        return out.astype(np.float32)

    def step(self, token, pos):
        m = self.m
        hd, vhd, nh, nkv = m.head_dim, m.v_head_dim, m.n_heads, m.n_kv_heads
        self.routes.append([])
        x = m.w("token_embd.weight")[token].astype(np.float32)
        if m.embd_scale is not None:
            x = x * m.embd_scale
        for l in range(m.n_layers):
            p = f"blk.{l}."
            h = rmsnorm(x, m.w(p + "attn_norm.weight"), m.eps)
            if m.has(p + "attn_qkv.weight"):  # fused rows: Q, then K, then V
                qkv = m.mm(p + "attn_qkv.weight", h)
                q, k, v = np.split(qkv, [nh * hd, nh * hd + nkv * hd])
            else:
                q = m.mm(p + "attn_q.weight", h)
                k = m.mm(p + "attn_k.weight", h)
                v = m.mm(p + "attn_v.weight", h)
            if m.has(p + "attn_q.bias"):
                q += m.w(p + "attn_q.bias")
                k += m.w(p + "attn_k.bias")
                v += m.w(p + "attn_v.bias")
            if m.has(p + "attn_q_norm.weight") and m.w(p + "attn_q_norm.weight").size == q.size:
                # OLMoE: one RMSNorm over all of Q and one over all of K
                q = rmsnorm(q, m.w(p + "attn_q_norm.weight"), m.eps)
                k = rmsnorm(k, m.w(p + "attn_k_norm.weight"), m.eps)
            q, k = q.reshape(nh, hd), k.reshape(nkv, hd)
            if m.has(p + "attn_q_norm.weight") and m.w(p + "attn_q_norm.weight").size == hd:
                # Qwen 3, Gemma 3: per-head RMSNorm before rope
                q = rmsnorm_rows(q, m.w(p + "attn_q_norm.weight"), m.eps)
                k = rmsnorm_rows(k, m.w(p + "attn_k_norm.weight"), m.eps)
            swa = m.is_swa[l]
            # Sliding-window layers use the local base and no frequency scaling.
            cs = (m.rope.angles(pos, m.rope.base_swa, 1.0) if swa
                  else m.rope.angles(pos, m.rope.base))
            q = ref_rope.apply(q, cs, m.neox, m.rope_dim)
            k = ref_rope.apply(k, cs, m.neox, m.rope_dim)
            self.k[l].append(k)
            self.v[l].append(v.reshape(nkv, vhd))
            K = np.stack(self.k[l])  # (T, nkv, hd)
            V = np.stack(self.v[l])
            lo = 0
            if swa:  # the query at pos sees keys at pos - n_swa + 1 .. pos
                lo = max(0, pos - m.n_swa + 1)
            att = np.zeros((nh, vhd), dtype=np.float64)
            for hh in range(nh):
                g = hh // (nh // nkv)  # grouped-query: heads share KV head g
                sc = K[lo:, g, :].astype(np.float64) @ q[hh].astype(np.float64) * m.kq_scale
                sc = np.exp(sc - sc.max())
                sc /= sc.sum()
                att[hh] = sc @ V[lo:, g, :]
            o = m.mm(p + "attn_output.weight", att.reshape(-1).astype(np.float32))
            if m.has(p + "post_attention_norm.weight"):
                o = rmsnorm(o, m.w(p + "post_attention_norm.weight"), m.eps)
            x = x + o
            h = rmsnorm(x, m.w(p + "ffn_norm.weight"), m.eps)
            f = self.moe(l, p, h) if m.has(p + "ffn_gate_inp.weight") else self.ffn(p, h)
            if m.has(p + "post_ffw_norm.weight"):
                f = rmsnorm(f, m.w(p + "post_ffw_norm.weight"), m.eps)
            x = x + f
        x = rmsnorm(x, m.w("output_norm.weight"), m.eps)
        logits = m.mm("output.weight", x).astype(np.float32)
        if m.softcap:  # cap * tanh(logits / cap)
            c = m.softcap
            logits = (c * np.tanh(logits.astype(np.float64) / c)).astype(np.float32)
        return logits


def run(m, ids, n):
    """Feeds the prompt, then greedy-decodes n tokens. Returns (generated ids, logits per input
    position of prompt + generated[:-1], routes per input position)."""
    r = Runner(m)
    logits = []
    gen = []
    pos = 0
    for t in ids:
        logits.append(r.step(t, pos))
        pos += 1
    for i in range(n):
        nxt = int(np.argmax(logits[-1]))
        gen.append(nxt)
        if i + 1 < n:
            logits.append(r.step(nxt, pos))
            pos += 1
    return gen, logits, r.routes


def route_lines(routes):
    """`experts POS LAYER e... w...` per position and MoE layer: the chosen experts in order of
    weight and their weights after normalisation."""
    out = []
    for pos, layers in enumerate(routes):
        for l, es, ws in layers:
            out.append(f"experts {pos} {l} " + " ".join(map(str, es)) + " "
                       + " ".join(f"{w:.6g}" for w in ws))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--ids", help="prompt token ids, space-separated")
    ap.add_argument("-n", type=int, default=16)
    ap.add_argument("--golden", help="output prefix for golden files")
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--prompt", nargs=2, action="append", metavar=("NAME", "IDS"))
    ap.add_argument("--experts", action="store_true",
                    help="with --ids: print the experts chosen at every position and layer")
    ap.add_argument("--logits", action="store_true",
                    help="with --ids: print the top-2 logits at every position")
    ap.add_argument("--long-rope", action="store_true",
                    help="use rope_factors_long (Phi-3 beyond its original context)")
    ap.add_argument("--act-q8", action="store_true",
                    help="round matmul inputs of quantized weights to int8 per 32 (as engines do)")
    ap.add_argument("--no-last", action="store_true", help="do not write the .last.f32 files")
    a = ap.parse_args()
    try:
        m = Model(a.model, long_rope=a.long_rope)
    except ModelError as e:
        print(f"error: {a.model}: {e}", file=sys.stderr)
        return 2
    m.act_q8 = a.act_q8
    if a.ids is not None:
        gen, logits, routes = run(m, [int(x) for x in a.ids.split()], a.n)
        print(" ".join(map(str, gen)))
        if a.logits:
            for pos, lg in enumerate(logits):
                t = np.argsort(-lg, kind="stable")[:2]
                print(f"top {pos} {t[0]} {lg[t[0]]:.6g} {t[1]} {lg[t[1]]:.6g}")
        if a.experts:
            print("\n".join(route_lines(routes)))
        return 0
    if not a.golden or not a.prompt:
        ap.error("give --ids, or --golden with --prompt")
    with open(a.golden + ".txt", "w") as f:
        mode = " --act-q8" if a.act_q8 else ""
        f.write(f"# {a.model} greedy reference from tests/reference/ref_forward.py{mode}\n")
        f.write("# prompt NAME N ids... | greedy N ids... | top POS K (id logit)*K")
        f.write(" | experts POS LAYER ids... weights...\n" if m.n_expert else "\n")
        for name, idstr in a.prompt:
            ids = [int(x) for x in idstr.split()]
            gen, logits, routes = run(m, ids, a.n)
            f.write(f"prompt {name} {len(ids)} {' '.join(map(str, ids))}\n")
            f.write(f"greedy {len(gen)} {' '.join(map(str, gen))}\n")
            for pos, lg in enumerate(logits):
                top = np.argsort(-lg, kind="stable")[: a.topk]
                f.write(f"top {pos} {a.topk} " + " ".join(f"{i} {lg[i]:.6g}" for i in top) + "\n")
            for line in route_lines(routes):
                f.write(line + "\n")
            if not a.no_last:
                logits[len(ids) - 1].astype("<f4").tofile(f"{a.golden}.{name}.last.f32")
            print(name, "->", " ".join(map(str, gen)), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
