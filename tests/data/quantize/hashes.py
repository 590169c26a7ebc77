#!/usr/bin/env python3
"""Prints the sha256 of every tensor's data in GGUF files, read with the PyPI gguf package (not
Shoal's reader), for tests/unit/test_quantize.c's llama-quantize reference (make_hashes.sh).

  hashes.py tensors MODEL TYPE FILE   one line per tensor: tensor MODEL TYPE NAME GGMLTYPE SHA256
  hashes.py digest TAG FILE           one line: digest TAG DIGEST, where DIGEST is the sha256 of
                                      "NAME\\nGGMLTYPE\\nSHA256\\n" for every tensor sorted by name
"""
import hashlib
import sys

from gguf import GGUFReader


def tensors(path):
    r = GGUFReader(path)
    out = []
    for t in r.tensors:
        out.append((t.name, t.tensor_type.name, hashlib.sha256(t.data.tobytes()).hexdigest()))
    return sorted(out)


def main():
    kind = sys.argv[1]
    if kind == "tensors":
        model, typ, path = sys.argv[2:5]
        for name, ttype, h in tensors(path):
            print(f"tensor {model} {typ} {name} {ttype} {h}")
    elif kind == "digest":
        tag, path = sys.argv[2:4]
        d = hashlib.sha256()
        for name, ttype, h in tensors(path):
            d.update(f"{name}\n{ttype}\n{h}\n".encode())
        print(f"digest {tag} {d.hexdigest()}")
    else:
        sys.exit("usage: hashes.py tensors MODEL TYPE FILE | digest TAG FILE")


main()
