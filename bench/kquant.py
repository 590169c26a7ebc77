#!/usr/bin/env python3
"""Issue 13's engine comparison with llama.cpp, in one run on one machine: prefill (pp512) and
decode (tg128) of Shoal's bench_model and llama.cpp's llama-bench on the same GGUF files with the
same thread count, alternating the two engines round by round (each figure is the best over the
rounds, so a burst of load on a shared machine costs both sides alike).

Files:
  - the synthetic shapes (`--shapes`, default smollm2-135m tinyllama-1.1b, plus mixtral-tiny when
    `shoal mkmodel` knows it) in each type of `--types` (default Q4_K Q6_K Q4_0 Q4_1). A file is
    made once into .cache/bench-models/ by `shoal mkmodel --type T --seed 1`; for a type mkmodel
    does not make (yet), it is made from mkmodel's F16 file by `llama-quantize --pure SRC OUT T`
    (every matrix in T where its rows allow it: llama.cpp falls back to another type for rows that
    are not a multiple of 256, as in 576-wide smollm2-135m), named <shape>-<T>-llamaq.gguf;
  - the real Gemma 3 270M Q4_K_M file (`--gemma`, default models/gemma3-270m-q4_k_m.gguf) when
    present.
Shoal's side reports `unsupported` with its error line while it cannot load a file (a type or an
architecture still being added), and llama.cpp's figures are printed regardless.

Prints one JSON object per line: bench_info, one line per engine and test, then per model and
test a `ratio` line (shoal / llama.cpp, with Shoal's best decode as a fraction of the highest
read bandwidth bench_model's probe measured over that file's rounds; each round's figures go to
stderr); `--table` adds a Markdown table at the end.

Usage: LLAMA_BIN=/path/to/llama.cpp/build/bin bench/kquant.py [--build build] [--threads "1 2"]
       [--rounds 2] [--reps 2] [--shapes "..."] [--types "..."] [--gemma PATH|none] [--table]
llama.cpp is built by hand and never committed (tests/data/gemma3/README.md has the commands;
targets llama-bench and llama-quantize).
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def emit(obj):
    print(json.dumps(obj), flush=True)


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def load():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def cpu_name():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "?"


def mkmodel_shapes(shoal):
    r = subprocess.run([shoal, "mkmodel", "--help"], capture_output=True, text=True)
    for line in r.stdout.splitlines():
        if "--shape NAME" in line and "one of:" in line:
            return line.split("one of:", 1)[1].split()
    return []


def make_model(a, shape, typ):
    """Returns (path, how it was made) for shape/type, making it once; None when neither shoal
    mkmodel nor llama-quantize can."""
    cache = os.path.join(ROOT, ".cache", "bench-models")
    os.makedirs(cache, exist_ok=True)
    path = os.path.join(cache, f"{shape}-{typ}.gguf")
    if os.path.isfile(path):
        return path, "shoal mkmodel"
    r = subprocess.run([a.shoal, "mkmodel", "--shape", shape, "--type", typ, "--seed", "1",
                        "-o", path], capture_output=True, text=True)  # mkmodel renames at the end
    if r.returncode == 0:
        return path, "shoal mkmodel"
    why = r.stderr.strip().splitlines()[-1:] or ["?"]
    qpath = os.path.join(cache, f"{shape}-{typ}-llamaq.gguf")
    how = f"llama-quantize --pure from shoal mkmodel F16 (mkmodel: {why[0]})"
    if os.path.isfile(qpath):
        return qpath, how
    quantize = os.path.join(a.llama_bin, "llama-quantize")
    if not os.access(quantize, os.X_OK):
        log(f"kquant: cannot make {shape} {typ}: {why[0]}; no llama-quantize in {a.llama_bin}")
        return None, why[0]
    src, _ = make_model(a, shape, "F16")
    if src is None:
        return None, why[0]
    log(f"kquant: making {qpath} with llama-quantize --pure {typ}")
    part = qpath + ".part"  # renamed when complete, so an interrupted run leaves no bad file
    r = subprocess.run([quantize, "--pure", src, part, typ, "2"], capture_output=True, text=True)
    if r.returncode != 0:
        log(f"kquant: llama-quantize failed: {r.stderr.strip()[-400:]}")
        return None, "llama-quantize failed"
    os.replace(part, qpath)
    return qpath, how


def run_llama(a, path):
    """Best tokens/s over llama-bench's samples, {test: value}, or the error line."""
    cmd = [os.path.join(a.llama_bin, "llama-bench"), "-m", path, "-t", str(a.t),
           "-p", str(a.pp), "-n", str(a.tg), "-r", str(a.reps), "-o", "jsonl"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        return None, (r.stderr.strip().splitlines() or ["?"])[-1]
    out = {}
    for line in r.stdout.splitlines():
        if not line.startswith("{"):
            continue
        j = json.loads(line)
        test = f"pp{j['n_prompt']}" if j["n_prompt"] else f"tg{j['n_gen']}"
        out[test] = max(j.get("samples_ts") or [j["avg_ts"]])
    return out, " ".join(cmd)


def run_shoal(a, path):
    """Best tokens/s (bench_model takes the best of --reps), {test: value}, plus the read
    bandwidth and decode's fraction of it; or the error line."""
    cmd = [os.path.join(a.build, "bench", "bench_model"), "-m", path, "-t", str(a.t),
           "--pp", str(a.pp), "--tg", str(a.tg), "--reps", str(a.reps)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        return None, (r.stderr.strip().splitlines() or ["?"])[-1]
    out = {}
    for line in r.stdout.splitlines():
        j = json.loads(line)
        if j["name"] == "read_bandwidth":
            out["read_gbs"] = j["value"]
        elif j["name"].startswith(("pp", "tg")):
            out[j["name"]] = j["value"]
            if "read_fraction" in j:
                out["read_fraction"] = j["read_fraction"]
                out["decode_gbs"] = j["decode_gbs"]
    return out, " ".join(cmd)


def bench_file(a, label, typ, path, how, rows):
    tests = [f"pp{a.pp}", f"tg{a.tg}"]
    best = {"llama.cpp": {}, "shoal": {}}
    errors = {}
    for rnd in range(a.rounds):
        engines = ["llama.cpp", "shoal"] if rnd % 2 == 0 else ["shoal", "llama.cpp"]
        for eng in engines:
            if eng in errors:
                continue
            res, info = (run_llama if eng == "llama.cpp" else run_shoal)(a, path)
            if res is None:
                errors[eng] = info
                continue
            if eng == "shoal":
                log(f"kquant:   round {rnd + 1}: tg{a.tg} {res.get(f'tg{a.tg}')} tok/s, "
                    f"{res.get('decode_gbs')} GB/s against a read probe of {res.get('read_gbs')} GB/s")
            for k, v in res.items():
                if k in tests:
                    best[eng][k] = max(best[eng].get(k, 0), v)
                elif k in ("read_gbs", "decode_gbs"):
                    best[eng][k] = max(best[eng].get(k, 0), v)
    # The read fraction is the best decode's bytes per second over the highest probe of any round
    # of this file: a probe that a burst of load pulled down in one round does not flatter it.
    if best["shoal"].get("read_gbs") and best["shoal"].get("decode_gbs"):
        best["shoal"]["read_fraction"] = round(
            best["shoal"]["decode_gbs"] / best["shoal"]["read_gbs"], 3)
    base = {"model": label, "type": typ, "file": os.path.relpath(path, ROOT), "made_by": how,
            "threads": a.t}
    for eng in ("llama.cpp", "shoal"):
        if eng in errors:
            emit({**base, "engine": eng, "status": "unsupported", "error": errors[eng]})
            continue
        for t in tests:
            emit({**base, "engine": eng, "name": t, "value": round(best[eng][t], 1),
                  "unit": "tok/s"})
    row = {"model": label, "type": typ, "made_by": how, "threads": a.t}
    for t in tests:
        sh, ll = best["shoal"].get(t), best["llama.cpp"].get(t)
        line = {**base, "name": "ratio", "test": t, "shoal": sh, "llama.cpp": ll,
                "ratio": round(sh / ll, 2) if sh and ll else None}
        if t.startswith("tg") and sh:
            line["shoal_read_fraction"] = best["shoal"].get("read_fraction")
            line["read_gbs"] = best["shoal"].get("read_gbs")
        if "shoal" in errors:
            line["shoal_error"] = errors["shoal"]
        emit(line)
        row[t] = line
    rows.append(row)


def table(a, rows):
    pp, tg = f"pp{a.pp}", f"tg{a.tg}"
    print(f"\n| model | type | threads | {pp} shoal | {pp} llama.cpp | ratio | {tg} shoal | {tg} llama.cpp "
          f"| ratio | shoal decode / read bw |")
    print("|---|---|---|---|---|---|---|---|---|---|")

    def f(v, d=1):
        return "—" if v is None else f"{v:.{d}f}"

    for r in rows:
        p, t = r[pp], r[tg]
        frac = t.get("shoal_read_fraction")
        print(f"| {r['model']} | {r['type']} | {r['threads']} | {f(p['shoal'])} | {f(p['llama.cpp'])} | "
              f"{f(p['ratio'], 2)} | {f(t['shoal'])} | {f(t['llama.cpp'])} | {f(t['ratio'], 2)} | "
              f"{f(frac, 2) if frac else '—'} |")
    errs = {r["model"] + " " + r["type"]: r[tg].get("shoal_error") for r in rows
            if r[tg].get("shoal_error")}
    for k, v in errs.items():
        print(f"\n{k}: shoal: {v}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--llama-bin", default=os.environ.get("LLAMA_BIN"))
    p.add_argument("--threads", default="2", help="thread counts, e.g. \"1 2\" (each file at each)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--pp", type=int, default=512)
    p.add_argument("--tg", type=int, default=128)
    p.add_argument("--shapes", default=None)
    p.add_argument("--types", default="Q4_K Q6_K Q4_0 Q4_1")
    p.add_argument("--gemma", default=os.path.join(ROOT, "models", "gemma3-270m-q4_k_m.gguf"))
    p.add_argument("--table", action="store_true")
    a = p.parse_args()
    if not a.llama_bin:
        p.error("set LLAMA_BIN or --llama-bin to the folder holding llama-bench (and llama-quantize)")
    a.build = os.path.abspath(a.build)
    a.shoal = os.path.join(a.build, "shoal")
    for exe in (a.shoal, os.path.join(a.build, "bench", "bench_model"),
                os.path.join(a.llama_bin, "llama-bench")):
        if not os.access(exe, os.X_OK):
            p.error(f"{exe} is missing (build it first)")
    threads = [int(t) for t in a.threads.split()]
    known = mkmodel_shapes(a.shoal)
    shapes = a.shapes.split() if a.shapes else \
        ["smollm2-135m", "tinyllama-1.1b"] + [s for s in ("mixtral-tiny",) if s in known]
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    emit({"name": "bench_info", "commit": commit, "cpu": cpu_name(), "nproc": os.cpu_count(),
          "threads": threads, "rounds": a.rounds, "reps": a.reps, "load": load(),
          "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    rows = []
    for shape in shapes:
        for typ in a.types.split():
            path, how = make_model(a, shape, typ)
            if path is None:
                emit({"model": shape, "type": typ, "status": "unavailable", "error": how})
                continue
            for a.t in threads:
                log(f"kquant: {shape} {typ} ({os.path.basename(path)}) -t {a.t}, load {load()}")
                bench_file(a, shape, typ, path, how, rows)
    if a.gemma != "none" and os.path.isfile(a.gemma):
        for a.t in threads:
            log(f"kquant: gemma3-270m Q4_K_M -t {a.t}, load {load()}")
            bench_file(a, "gemma3-270m", "Q4_K_M", os.path.abspath(a.gemma), "real file", rows)
    emit({"name": "bench_end", "load": load(),
          "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    if a.table:
        table(a, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
