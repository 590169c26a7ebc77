"""Loads a GGUF for the NumPy reference: hyperparameters per architecture and every tensor
dequantized to float32 by the `gguf` package's own dequantizer.

Architectures: llama (and mistral, with or without Mixtral-style experts), qwen2, qwen2moe,
qwen3, qwen3moe, gemma3, phi3, olmoe. Keys and tensor names are llama.cpp's (gguf-py constants.py);
what each key means follows llama.cpp's loader (src/llama-model.cpp, src/models/*.cpp).
"""
import math

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

from ref_rope import RopeParams

ARCHS = ("llama", "mistral", "qwen2", "qwen2moe", "qwen3", "qwen3moe", "gemma3", "phi3", "olmoe")
# llama.cpp's llama_model_rope_type: these rotate pairs (i, i + n/2), the others (2i, 2i+1).
NEOX = ("qwen2", "qwen2moe", "qwen3", "qwen3moe", "gemma3", "phi3", "olmoe")


class ModelError(Exception):
    pass


class Model:
    def __init__(self, path, long_rope=False):
        r = GGUFReader(path)
        self.fields = r.fields

        def get(key, default=None):
            f = r.fields.get(key)
            return default if f is None else f.contents()

        self.arch = a = get("general.architecture")
        if a not in ARCHS:
            raise ModelError(f"architecture '{a}' is not one of {', '.join(ARCHS)}")
        self.dim = int(get(f"{a}.embedding_length"))
        self.n_layers = int(get(f"{a}.block_count"))
        self.n_heads = int(get(f"{a}.attention.head_count"))
        self.n_kv_heads = int(get(f"{a}.attention.head_count_kv", self.n_heads))
        self.eps = float(get(f"{a}.attention.layer_norm_rms_epsilon", 1e-5))
        # Gemma 3 and Qwen 3 heads are wider than dim / heads: attention.key_length says so.
        self.head_dim = int(get(f"{a}.attention.key_length", self.dim // self.n_heads))
        self.v_head_dim = int(get(f"{a}.attention.value_length", self.head_dim))
        self.rope_dim = int(get(f"{a}.rope.dimension_count", self.head_dim))
        self.neox = a in NEOX
        ctx_train = int(get(f"{a}.context_length", 2048))
        self.rope = RopeParams(get, a, self.rope_dim, ctx_train)
        self.kq_scale = 1.0 / math.sqrt(self.head_dim)
        self.embd_scale = None
        self.softcap = float(get(f"{a}.final_logit_softcapping", 0.0))
        self.n_swa = 0
        self.is_swa = [False] * self.n_layers
        if a == "gemma3":
            # Embeddings times sqrt(dim) in float32, as llama.cpp does (HF rounds the factor to
            # the activation dtype first).
            self.embd_scale = np.float32(math.sqrt(self.dim))
            if self.n_layers == 62:  # Gemma 3 27B scales queries by (dim / heads)^-1/2
                self.kq_scale = 1.0 / math.sqrt(self.dim // self.n_heads)
            self.n_swa = int(get(f"{a}.attention.sliding_window", 0))
            if self.n_swa > 0:
                pat = get(f"{a}.attention.sliding_window_pattern", 6)
                if isinstance(pat, list):  # one bool per layer: true = sliding window
                    self.is_swa = [bool(x) for x in pat][: self.n_layers]
                else:  # every pat-th layer (the last of each group) is global
                    pat = int(pat)
                    self.is_swa = [pat == 0 or (il % pat < pat - 1) for il in range(self.n_layers)]
        # Mixture of experts.
        self.n_expert = int(get(f"{a}.expert_count", 0))
        self.n_expert_used = int(get(f"{a}.expert_used_count", 0))
        # Renormalise the chosen experts' weights to sum 1: llama.cpp does it for llama (Mixtral)
        # and qwen3moe whatever the file says, never for qwen2moe.
        self.expert_norm = a in ("llama", "mistral", "qwen3moe")
        self.expert_scale = float(get(f"{a}.expert_weights_scale", 0.0))
        self.expert_gating = int(get(f"{a}.expert_gating_func", 1))  # 1 softmax, 2 sigmoid
        if self.n_expert and not (0 < self.n_expert_used <= self.n_expert):
            raise ModelError(f"{a}.expert_used_count {self.n_expert_used} is not in "
                             f"1..{a}.expert_count {self.n_expert}")

        self.t = {}
        self.quantized = set()  # names of block-quantized tensors
        self.act_q8 = False  # emulate int8 activations for quantized weights (see mm)
        for t in r.tensors:
            if t.tensor_type.name not in ("F32", "F16", "BF16"):
                self.quantized.add(t.name)
            # gguf's dequantize returns the numpy shape (..., ne[1], ne[0]).
            w = dequantize(t.data, t.tensor_type).astype(np.float32)
            self.t[t.name] = w.reshape([int(x) for x in reversed(t.shape)])
        if "output.weight" not in self.t:
            self.t["output.weight"] = self.t["token_embd.weight"]  # tied embeddings
            if "token_embd.weight" in self.quantized:
                self.quantized.add("output.weight")
        # Per-frequency rope divisors: Llama 3 (rope_freqs), Phi-3 long context (short factors
        # unless the context exceeds the original one; long_rope picks the long ones).
        for name in ("rope_freqs.weight",
                     "rope_factors_long.weight" if long_rope else "rope_factors_short.weight"):
            if name in self.t:
                self.rope.factors = self.t[name].astype(np.float64).reshape(-1)[: self.rope_dim // 2]
                break
        self.check()

    def check(self):
        """Every tensor the forward pass will read exists with the shape it needs."""
        need = {"token_embd.weight", "output_norm.weight"}
        for l in range(self.n_layers):
            p = f"blk.{l}."
            need |= {p + "attn_norm.weight", p + "attn_output.weight", p + "ffn_norm.weight"}
            if p + "attn_qkv.weight" not in self.t:
                need |= {p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"}
            if self.n_expert:
                need |= {p + "ffn_gate_inp.weight", p + "ffn_up_exps.weight",
                         p + "ffn_down_exps.weight"}
            else:
                need |= {p + "ffn_up.weight", p + "ffn_down.weight"}
            if self.arch in ("qwen3", "qwen3moe", "gemma3", "olmoe"):
                need |= {p + "attn_q_norm.weight", p + "attn_k_norm.weight"}
            if self.arch == "gemma3":
                need |= {p + "post_attention_norm.weight", p + "post_ffw_norm.weight"}
        missing = sorted(need - set(self.t))
        if missing:
            raise ModelError(f"tensor {missing[0]} is missing ({len(missing)} missing)")
        for l in range(self.n_layers):
            e = f"blk.{l}.ffn_gate_inp.weight"
            if self.n_expert and self.t[e].shape[0] != self.n_expert:
                raise ModelError(f"{e} has {self.t[e].shape[0]} experts, "
                                 f"{self.arch}.expert_count says {self.n_expert}")

    def has(self, name):
        return name in self.t

    def w(self, name):
        return self.t[name]

    def mm(self, name, x, w=None):
        """W x. With act_q8, x is first rounded as an engine that multiplies quantized weights
        with int8 activations sees it: per 32 elements d = max|x| / 127, x ~ d * round(x / d)."""
        if self.act_q8 and name in self.quantized and x.size % 32 == 0:
            b = x.astype(np.float32).reshape(-1, 32)
            d = np.abs(b).max(axis=1, keepdims=True) / np.float32(127.0)
            inv = np.where(d != 0, 1.0 / np.where(d != 0, d, 1), 0).astype(np.float32)
            x = (np.rint(b * inv) * d).reshape(-1).astype(np.float32)
        return (self.t[name] if w is None else w) @ x
