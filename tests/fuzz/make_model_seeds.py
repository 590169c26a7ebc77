#!/usr/bin/env python3
"""Writes the model seeds of fuzz_gguf's corpus: tiny valid files of every architecture the
engine loads (gemma3, qwen3, phi3, Llama 3 rope scaling, the MoE forms mixtral, qwen2moe,
qwen3moe, olmoe), made with `shoal mkmodel` (F16, dim 16, the 4-token vocabulary of
small_model.gguf), and broken copies of them patched in place: an expert count the tensors
disagree with, a missing expert count, k above the count, a K-quant tensor whose rows are not
whole blocks, an unknown architecture, a block count of 2^30 in a file of a few tensors. tests/golden/test_llama_seeds.c checks that each broken
one is refused naming the key or tensor (by the loader and by `shoal run`: exit 2, one `error:`
line) and that the valid ones load. Stdlib only. Run from the repository root:
    python3 tests/fuzz/make_model_seeds.py build/shoal tests/fuzz/corpus/gguf"""
import os
import struct
import subprocess
import sys

COMMON = ["--layers", "1", "--dim", "16", "--ffn", "16", "--heads", "2", "--kv-heads", "1",
          "--head-dim", "8", "--ctx", "64", "--type", "F16", "--untied", "--seed", "3"]
MODELS = {
    "qwen3": ["--shape", "qwen3-0.6b"],
    "gemma3": ["--shape", "gemma3-270m", "--layers", "2", "--swa-pattern", "2",
               "--sliding-window", "4", "--softcap", "30"],
    "phi3": ["--shape", "phi3-mini", "--kv-heads", "2"],
    "llama3rope": ["--shape", "llama3.2-1b", "--rope-scaling", "llama3", "--rope-factor", "8",
                   "--rope-orig-ctx", "32"],
    "mixtral": ["--shape", "mixtral-tiny", "--experts", "4", "--experts-used", "2"],
    "qwen2moe": ["--shape", "qwen2moe-tiny", "--kv-heads", "2", "--experts", "4",
                 "--experts-used", "2", "--expert-ffn", "16", "--shared-ffn", "16"],
    "qwen3moe": ["--shape", "qwen3moe-tiny", "--experts", "4", "--experts-used", "2",
                 "--expert-ffn", "16"],
    "olmoe": ["--shape", "olmoe-tiny", "--kv-heads", "2", "--experts", "4", "--experts-used", "2"],
}
SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
Q4_K = 12


class Gguf:
    """The byte offsets of every key, value and tensor type field of a GGUF, for patching in
    place (sizes unchanged, so the layout stays valid)."""

    def __init__(self, blob):
        self.b = bytearray(blob)
        self.pos = 24
        _, _, n_t, n_kv = struct.unpack_from("<IIQQ", self.b, 0)
        self.keys = {}  # key -> (key bytes offset, value type, value offset)
        for _ in range(n_kv):
            k_off, key = self.string()
            (typ,) = struct.unpack_from("<I", self.b, self.pos)
            self.pos += 4
            self.keys[key] = (k_off, typ, self.pos)
            self.value(typ)
        self.types = {}  # tensor name -> offset of its type field
        for _ in range(n_t):
            _, name = self.string()
            (nd,) = struct.unpack_from("<I", self.b, self.pos)
            self.pos += 4 + 8 * nd
            self.types[name] = self.pos
            self.pos += 12

    def string(self):
        (n,) = struct.unpack_from("<Q", self.b, self.pos)
        off = self.pos + 8
        self.pos = off + n
        return off, bytes(self.b[off:off + n]).decode()

    def value(self, typ):
        if typ == 8:
            self.string()
        elif typ == 9:
            et, n = struct.unpack_from("<IQ", self.b, self.pos)
            self.pos += 12
            for _ in range(n):
                self.value(et)
        else:
            self.pos += SCALAR[typ]

    def set_u32(self, key, v):
        _, typ, off = self.keys[key]
        assert typ == 4, (key, typ)
        struct.pack_into("<I", self.b, off, v)

    def rename(self, key, new):
        assert len(new) == len(key)
        off = self.keys[key][0]
        self.b[off:off + len(key)] = new.encode()

    def set_str(self, key, new):
        _, typ, off = self.keys[key]
        (n,) = struct.unpack_from("<Q", self.b, off)
        assert typ == 8 and n == len(new)
        self.b[off + 8:off + 8 + n] = new.encode()

    def set_type(self, tensor, typ):
        struct.pack_into("<I", self.b, self.types[tensor], typ)


# name -> (source model, patch)
BROKEN = {
    "bad_mixtral_expert_count.gguf": ("mixtral", lambda g: g.set_u32("llama.expert_count", 3)),
    "bad_qwen3moe_expert_count.gguf": ("qwen3moe",
                                       lambda g: g.set_u32("qwen3moe.expert_count", 8)),
    "bad_olmoe_no_expert_count.gguf": ("olmoe", lambda g: g.rename("olmoe.expert_count",
                                                                   "olmoe.expert_cxxxx")),
    "bad_qwen2moe_expert_used.gguf": ("qwen2moe",
                                      lambda g: g.set_u32("qwen2moe.expert_used_count", 5)),
    "bad_qwen3_q4_k_rows.gguf": ("qwen3", lambda g: g.set_type("blk.0.attn_q.weight", Q4_K)),
    "bad_olmoe_q4_k_experts.gguf": ("olmoe",
                                    lambda g: g.set_type("blk.0.ffn_up_exps.weight", Q4_K)),
    "bad_unknown_arch.gguf": ("qwen3", lambda g: g.set_str("general.architecture", "olmo2")),
    "bad_block_count.gguf": ("mixtral", lambda g: g.set_u32("llama.block_count", 1 << 30)),
}


def main(shoal, dst):
    here = os.path.dirname(os.path.abspath(__file__))
    vocab = os.path.join(here, "corpus", "gguf", "small_model.gguf")
    blobs = {}
    for name, args in MODELS.items():
        out = os.path.join(dst, f"arch_{name}.gguf")
        subprocess.run([shoal, "mkmodel", *COMMON, "--vocab-from", vocab, *args, "-o", out],
                       check=True, stdout=subprocess.DEVNULL)
        with open(out, "rb") as f:
            blobs[name] = f.read()
        assert len(blobs[name]) < 16384, (name, len(blobs[name]))
    for name, (src, patch) in BROKEN.items():
        g = Gguf(blobs[src])
        patch(g)
        with open(os.path.join(dst, name), "wb") as f:
            f.write(g.b)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
