#!/usr/bin/env python3
"""Writes a tiny seeded random qwen2-architecture GGUF (F16 matrices, F32 norms and Q/K/V biases,
tied embeddings, NeoX RoPE) for testing Shoal's qwen2 path against ref_forward.py.

Usage: make_tiny_qwen2.py OUT.gguf
"""
import sys

import numpy as np
from gguf import GGUFWriter

DIM, LAYERS, HEADS, KV_HEADS, FF, VOCAB = 64, 2, 4, 2, 96, 128


def main():
    rng = np.random.default_rng(20240611)
    hd = DIM // HEADS
    w = GGUFWriter(sys.argv[1], "qwen2")
    w.add_context_length(256)
    w.add_embedding_length(DIM)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)

    def mat(rows, cols, std=0.35):
        return (rng.standard_normal((rows, cols)) * std).astype(np.float16)

    def vec(n, mean=0.0, std=0.1):
        return (mean + rng.standard_normal(n) * std).astype(np.float32)

    w.add_tensor("token_embd.weight", mat(VOCAB, DIM, 0.5))
    w.add_tensor("output_norm.weight", vec(DIM, 1.0))
    for l in range(LAYERS):
        p = f"blk.{l}."
        w.add_tensor(p + "attn_norm.weight", vec(DIM, 1.0))
        w.add_tensor(p + "attn_q.weight", mat(HEADS * hd, DIM))
        w.add_tensor(p + "attn_k.weight", mat(KV_HEADS * hd, DIM))
        w.add_tensor(p + "attn_v.weight", mat(KV_HEADS * hd, DIM))
        w.add_tensor(p + "attn_q.bias", vec(HEADS * hd, 0.0, 0.5))
        w.add_tensor(p + "attn_k.bias", vec(KV_HEADS * hd, 0.0, 0.5))
        w.add_tensor(p + "attn_v.bias", vec(KV_HEADS * hd, 0.0, 0.5))
        w.add_tensor(p + "attn_output.weight", mat(DIM, HEADS * hd))
        w.add_tensor(p + "ffn_norm.weight", vec(DIM, 1.0))
        w.add_tensor(p + "ffn_gate.weight", mat(FF, DIM))
        w.add_tensor(p + "ffn_up.weight", mat(FF, DIM))
        w.add_tensor(p + "ffn_down.weight", mat(DIM, FF))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
