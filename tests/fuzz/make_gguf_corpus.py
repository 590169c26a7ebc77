#!/usr/bin/env python3
"""Writes the seed corpus for fuzz_gguf: small valid GGUF files covering every metadata type,
nested arrays, several tensor types and alignments, one file per K-quant type (whole 256-element
blocks), two broken K-quant files (rows that are not whole blocks; data that runs past the end
of the file) and F32 data that general.alignment 2 leaves misaligned. make_model_seeds.py adds the model seeds. Run from the repository root:
    python3 tests/fuzz/make_gguf_corpus.py tests/fuzz/corpus/gguf"""
import struct
import sys


def s(x):
    b = x.encode() if isinstance(x, str) else x
    return struct.pack('<Q', len(b)) + b


def kv(key, typ, payload):
    return s(key) + struct.pack('<I', typ) + payload


def arr(etype, items):
    return struct.pack('<IQ', etype, len(items)) + b''.join(items)


def gguf(kvs, tensors, align=32, version=3):
    """tensors: (name, dims, type, nbytes); laid out in order at aligned offsets."""
    out = struct.pack('<IIQQ', 0x46554747, version, len(tensors), len(kvs)) + b''.join(kvs)
    off, infos, data = 0, b'', b''
    for name, dims, typ, nbytes in tensors:
        infos += s(name) + struct.pack('<I', len(dims)) + b''.join(struct.pack('<Q', d) for d in dims)
        infos += struct.pack('<IQ', typ, off)
        blob = bytes((i * 31 + 7) & 0xff for i in range(nbytes))
        data += blob + b'\0' * (-nbytes % align)
        off += nbytes + (-nbytes % align)
    out += infos
    out += b'\0' * (-len(out) % align)
    return out + data


def main(dst):
    u32 = lambda v: struct.pack('<I', v)
    files = {}
    files['small_model.gguf'] = gguf([
        kv('general.architecture', 8, s('llama')),
        kv('general.name', 8, s('tiny')),
        kv('llama.block_count', 4, u32(1)),
        kv('llama.embedding_length', 4, u32(8)),
        kv('llama.attention.layer_norm_rms_epsilon', 6, struct.pack('<f', 1e-5)),
        kv('tokenizer.ggml.model', 8, s('llama')),
        kv('tokenizer.ggml.tokens', 9, arr(8, [s('<unk>'), s('<s>'), s('</s>'), s('a')])),
        kv('tokenizer.ggml.scores', 9, arr(6, [struct.pack('<f', -i) for i in range(4)])),
        kv('tokenizer.ggml.bos_token_id', 4, u32(1)),
    ], [('token_embd.weight', [8, 4], 0, 128), ('blk.0.attn_q.weight', [32, 2], 8, 68),
        ('output_norm.weight', [8], 1, 16), ('q4.weight', [32], 2, 18)])
    files['all_types.gguf'] = gguf([
        kv('u8', 0, b'\xfa'), kv('i8', 1, b'\xf9'), kv('u16', 2, struct.pack('<H', 65000)),
        kv('i16', 3, struct.pack('<h', -3)), kv('u32', 4, u32(7)),
        kv('i32', 5, struct.pack('<i', -7)), kv('f32', 6, struct.pack('<f', 0.5)),
        kv('bool', 7, b'\x01'), kv('str', 8, s('hello')),
        kv('u64', 10, struct.pack('<Q', 2**63)), kv('i64', 11, struct.pack('<q', -2**40)),
        kv('f64', 12, struct.pack('<d', 1 / 3)),
        kv('arr.bool', 9, arr(7, [b'\x01', b'\x00'])),
        kv('arr.nested', 9, arr(9, [arr(9, [arr(0, [b'\x01', b'\x02'])]), arr(8, [s('x')]),
                                    arr(4, [])])),
        kv('general.alignment', 4, u32(64)),
    ], [('t', [4, 2, 1, 2], 0, 64)], align=64, version=2)
    files['vocab_only.gguf'] = gguf([
        kv('general.architecture', 8, s('gpt2')),
        kv('tokenizer.ggml.model', 8, s('gpt2')),
        kv('tokenizer.ggml.tokens', 9, arr(8, [s(c) for c in 'abcdefgh'])),
        kv('tokenizer.ggml.merges', 9, arr(8, [s('a b'), s('ab c')])),
        kv('tokenizer.ggml.token_type', 9, arr(5, [struct.pack('<i', 1)] * 8)),
    ], [])
    files['empty.gguf'] = gguf([], [])
    # K-quants: GGML type id and bytes per 256-element block (Q2_K .. Q6_K, and Q8_K).
    kq = {'q2_k': (10, 84), 'q3_k': (11, 110), 'q4_k': (12, 144), 'q5_k': (13, 176),
          'q6_k': (14, 210), 'q8_k': (15, 292)}
    for name, (typ, bb) in kq.items():
        files[f'kquant_{name}.gguf'] = gguf([
            kv('general.architecture', 8, s('llama')),
        ], [('blk.0.ffn_down.weight', [512, 2], typ, 4 * bb), ('output.weight', [256, 1], typ, bb),
            ('output_norm.weight', [256], 0, 1024)])
    # A Q5_K tensor of 300-element rows (not whole blocks); a Q6_K tensor of two rows whose file
    # holds one row's bytes (its data runs past the end).
    files['bad_q5_k_rows.gguf'] = gguf([kv('general.architecture', 8, s('llama'))],
                                       [('blk.0.attn_q.weight', [300, 1], 13, 176)])
    trunc = gguf([kv('general.architecture', 8, s('llama'))],
                 [('blk.0.attn_k.weight', [256, 2], 14, 2 * 210)])
    files['bad_q6_k_truncated.gguf'] = trunc[:-210]
    # general.alignment 2 with the data section 2 bytes past a multiple of 4: F32 weights that
    # are not 4-byte aligned (the name's length pads the header to that).
    for pad in range(4):
        blob = gguf([kv('general.architecture', 8, s('llama')), kv('general.alignment', 4, u32(2))],
                    [('token_embd' + '_' * pad + '.weight', [8, 4], 0, 128)], align=2)
        if (len(blob) - 128) % 4 == 2:
            files['bad_alignment.gguf'] = blob
            break
    for name, blob in files.items():
        assert len(blob) < 8192
        with open(f'{dst}/{name}', 'wb') as f:
            f.write(blob)


if __name__ == '__main__':
    main(sys.argv[1])
