#!/usr/bin/env python3
"""Issue 28's grammar comparison with llama.cpp, in one run on one machine: the grammar work per
decoded token of Shoal's matcher (build/bench/bench_grammar) and of llama.cpp's grammar sampler
(bench/llama_grammar_ref.cpp, the calls llama-server's common_sampler_sample makes), on the same
grammar and the same token ids, the two engines alternating in rounds.

Two grammars:
  json    the generic JSON grammar of bench_grammar.c, the same GBNF text given to both engines;
  schema  bench/grammar_order.schema.json, converted by each engine's own converter (Shoal's
          net/json_schema.c, llama.cpp's json_schema_to_grammar as llama-server calls it for
          `json_schema` / `response_format`), the document without its trailing newline.

llama.cpp is not part of this project and nothing of it is committed: the script takes the copy
vendored in the PyPI sdist of llama-cpp-python (downloaded with pip into .cache/llamacpp/ when
missing), builds libllama there (CPU only, -DGGML_NATIVE=ON, nice, -j2) and compiles
llama_grammar_ref with the five files of llama.cpp's common library that json_schema_to_grammar
needs (json-schema-to-grammar, json, json-schema, trie, unicode) and three string helpers copied
verbatim out of its common.cpp (the rest of that file is not needed and not built).

Usage: bench/llama-grammar.py [--build DIR] [--rounds N] [--modes json,schema]
                              [--models A.gguf,B.gguf] [--llama-version V] [--table]
Prints JSON lines: one per engine run ({"engine": "shoal"|"llama.cpp", "round", "mode", ...}),
then one "llama_grammar_ratio" line per (mode, model): medians over the rounds and
llama.cpp / Shoal ratios of the full mask (p50, p99) and of the sampled-token check + accept.
--table adds a markdown table (for bench/README.md) on stderr.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = ["json-schema-to-grammar", "json", "json-schema", "trie", "unicode"]
# json_schema_to_grammar also calls three string helpers of common.cpp, a file that pulls in most
# of the library (logging, sampling, chat, ...): those three functions are copied out of it as
# they stand into common-strings.cpp.
STRING_HELPERS = ["string_join", "string_split", "string_repeat"]


def extract_helpers(src, out):
    """Writes `out` with STRING_HELPERS' definitions taken verbatim from common/common.cpp."""
    lines = open(os.path.join(src, "common", "common.cpp")).read().split("\n")
    body = ["#include <sstream>", "#include <string>", "#include <vector>", ""]
    for name in STRING_HELPERS:
        start = next((i for i, l in enumerate(lines)
                      if not l.startswith((" ", "\t", "/", "#")) and f" {name}(" in l
                      and l.rstrip().endswith("{")), None)
        if start is None:
            sys.exit(f"error: {name} not found in common/common.cpp")
        end = lines.index("}", start)
        body += lines[start:end + 1] + [""]
    text = "\n".join(body)
    if not os.path.exists(out) or open(out).read() != text:
        with open(out, "w") as f:
            f.write(text)


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def run(cmd, **kw):
    log("+", " ".join(cmd))
    subprocess.run(cmd, check=True, **kw)


def llama_source(version, cache):
    """The vendored llama.cpp of llama-cpp-python's sdist (downloaded with pip if missing)."""
    top = os.path.join(cache, f"llama_cpp_python-{version}")
    src = os.path.join(top, "vendor", "llama.cpp")
    if not os.path.isdir(src):
        tgz = os.path.join(cache, f"llama_cpp_python-{version}.tar.gz")
        if not os.path.exists(tgz):
            run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                 f"llama_cpp_python=={version}", "-d", cache])
        with tarfile.open(tgz) as t:
            t.extractall(cache)
    commit = "unknown"
    with open(os.path.join(top, "CHANGELOG.md")) as f:  # "update llama.cpp to ggml-org/llama.cpp@X"
        for line in f:
            if "llama.cpp@" in line:
                commit = line.split("llama.cpp@")[1].split()[0]
                break
    return src, commit


def build_ref(src, out, jobs):
    """libllama (cmake, CPU only) and llama_grammar_ref; each step skipped when up to date."""
    if not os.path.exists(os.path.join(out, "bin", "libllama.so")):
        run(["nice", "cmake", "-S", src, "-B", out, "-DCMAKE_BUILD_TYPE=Release",
             "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
             "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
             "-DLLAMA_BUILD_TOOLS=OFF", "-DBUILD_SHARED_LIBS=ON"], stdout=subprocess.DEVNULL)
        run(["nice", "cmake", "--build", out, "-j", str(jobs), "--target", "llama"],
            stdout=subprocess.DEVNULL)
    objdir = os.path.join(out, "grammar-ref")
    os.makedirs(objdir, exist_ok=True)
    inc = [f"-I{src}/common", f"-I{src}/include", f"-I{src}/ggml/include", f"-I{src}/vendor"]
    flags = ["-std=c++17", "-O2"]
    helpers = os.path.join(objdir, "common-strings.cpp")
    extract_helpers(src, helpers)
    objs = []
    for name in COMMON + ["common-strings", "ref"]:
        cpp = (os.path.join(ROOT, "bench", "llama_grammar_ref.cpp") if name == "ref"
               else helpers if name == "common-strings"
               else os.path.join(src, "common", name + ".cpp"))
        obj = os.path.join(objdir, name + ".o")
        if not os.path.exists(obj) or os.path.getmtime(obj) < os.path.getmtime(cpp):
            run(["nice", "g++", *flags, *inc, "-c", cpp, "-o", obj])
        objs.append(obj)
    exe = os.path.join(objdir, "llama_grammar_ref")
    if not os.path.exists(exe) or any(os.path.getmtime(exe) < os.path.getmtime(o) for o in objs):
        lib = os.path.join(out, "bin")
        run(["g++", *objs, "-o", exe, f"-L{lib}", "-lllama", "-lggml", "-lggml-base",
             f"-Wl,-rpath,{lib}"])
    return exe


def load():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="json,schema")
    ap.add_argument("--models", default=",".join(
        os.path.join(ROOT, "models", m)
        for m in ("smollm2-135m-instruct-q4_1.gguf", "gemma3-270m-q4_k_m.gguf")))
    ap.add_argument("--llama-version", default="0.3.36",
                    help="llama-cpp-python sdist whose vendored llama.cpp is used")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--table", action="store_true")
    a = ap.parse_args()

    models = [m for m in a.models.split(",") if m]
    for m in models:
        if not os.path.exists(m):
            log(f"skip: {m} missing")
            sys.exit(77)
    cache = os.path.join(ROOT, ".cache", "llamacpp")
    os.makedirs(cache, exist_ok=True)
    src, commit = llama_source(a.llama_version, cache)
    ref = build_ref(src, os.path.join(cache, f"build-{a.llama_version}"), a.jobs)
    bench = os.path.join(a.build, "bench", "bench_grammar")
    if not os.access(bench, os.X_OK):
        sys.exit(f"error: {bench} not built")
    schema = os.path.join(ROOT, "bench", "grammar_order.schema.json")
    tmp = os.path.join(cache, "run")
    os.makedirs(tmp, exist_ok=True)
    cpu = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    print(json.dumps({"name": "llama_grammar_info", "llama_cpp_python": a.llama_version,
                      "llama_cpp_commit": commit, "cpu": cpu, "cpus": os.cpu_count(),
                      "shoal_commit": subprocess.run(
                          ["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip(),
                      "load": load()}), flush=True)

    results = []  # every run's line
    for rnd in range(1, a.rounds + 1):
        for mode in a.modes.split(","):
            opt = ["--schema", schema] if mode == "schema" else []
            paths = {}
            for what in ("grammar", "doc"):
                p = os.path.join(tmp, f"{mode}.{what}")
                with open(p, "w") as f:
                    subprocess.run([bench, *opt, "--print", what], stdout=f, check=True)
                paths[what] = p
            # ours: both models in one process, with the token ids
            ld = load()
            out = subprocess.run([bench, *opt, "--print-ids", *models], capture_output=True,
                                 text=True)
            if out.returncode:
                sys.exit(f"error: bench_grammar: {out.stderr.strip()}")
            ids = {}
            for line in out.stdout.splitlines():
                j = json.loads(line)
                ids[j["model"]] = j.pop("ids")
                j.update({"engine": "shoal", "round": rnd, "mode": mode, "load": ld})
                results.append(j)
                print(json.dumps(j), flush=True)
            # theirs: one process per model, same ids
            for m in models:
                name = os.path.basename(m)
                idp = os.path.join(tmp, f"{mode}.{name}.ids")
                with open(idp, "w") as f:
                    json.dump(ids[name], f)
                gopt = (["--schema", schema] if mode == "schema"
                        else ["--gbnf", paths["grammar"]])
                ld = load()
                out = subprocess.run([ref, *gopt, "--ids", idp, "--doc", paths["doc"], m],
                                     capture_output=True, text=True)
                if out.returncode:
                    sys.exit(f"error: llama_grammar_ref: {out.stderr.strip()}")
                j = json.loads(out.stdout.strip().splitlines()[-1])
                j.update({"round": rnd, "mode": mode, "load": ld})
                results.append(j)
                print(json.dumps(j), flush=True)

    rows = []
    for mode in a.modes.split(","):
        for m in models:
            name = os.path.basename(m)
            ours = [r for r in results if r["engine"] == "shoal" and r["mode"] == mode
                    and r["model"] == name]
            theirs = [r for r in results if r["engine"] == "llama.cpp" and r["mode"] == mode
                      and r["model"] == name]

            def med(rs, key, p):
                return statistics.median(r[key][p] for r in rs)

            line = {"name": "llama_grammar_ratio", "mode": mode, "model": name,
                    "rounds": len(ours), "steps": ours[0]["steps"],
                    "tokenize_same": all(r["tokenize_same"] == 1 for r in theirs)}
            for p in ("p50", "p99"):
                line[f"shoal_mask_ms_{p}"] = med(ours, "mask_ms", p)
                line[f"shoal_walk_ms_{p}"] = med(ours, "walk_ms", p)
                line[f"llama_full_ms_{p}"] = med(theirs, "full_ms", p)
                line[f"shoal_check_accept_us_{p}"] = med(ours, "check_accept_us", p)
                line[f"llama_check_accept_us_{p}"] = med(theirs, "check_accept_us", p)
                line[f"llama_check_us_{p}"] = med(theirs, "check_us", p)
                line[f"llama_accept_us_{p}"] = med(theirs, "accept_us", p)
                for k, ou, th in (("full_vs_mask", "shoal_mask_ms", "llama_full_ms"),
                                  ("full_vs_walk", "shoal_walk_ms", "llama_full_ms"),
                                  ("check_accept", "shoal_check_accept_us",
                                   "llama_check_accept_us")):
                    o, t = line[f"{ou}_{p}"], line[f"{th}_{p}"]
                    line[f"ratio_{k}_{p}"] = round(t / o, 1) if o > 0 else None
            rows.append(line)
            print(json.dumps(line), flush=True)
    if a.table:
        log("| grammar | model | Shoal mask p50 / p99 (walk p50 / p99) | llama.cpp full p50 / p99 "
            "| ratio p50 / p99 (vs walk) | Shoal check+accept p50 / p99 | llama.cpp "
            "check+accept p50 / p99 | ratio p50 / p99 |")
        log("|---|---|---|---|---|---|---|---|")
        for r in rows:
            def f(x):
                return "n/a" if x is None else f"{x:g}x"
            log(f"| {r['mode']} | {r['model']} | {r['shoal_mask_ms_p50']:.4f} / "
                f"{r['shoal_mask_ms_p99']:.3f} ms ({r['shoal_walk_ms_p50']:.3f} / "
                f"{r['shoal_walk_ms_p99']:.3f}) | {r['llama_full_ms_p50']:.2f} / "
                f"{r['llama_full_ms_p99']:.2f} ms | {f(r['ratio_full_vs_mask_p50'])} / "
                f"{f(r['ratio_full_vs_mask_p99'])} ({f(r['ratio_full_vs_walk_p50'])} / "
                f"{f(r['ratio_full_vs_walk_p99'])}) | {r['shoal_check_accept_us_p50']:.2f} / "
                f"{r['shoal_check_accept_us_p99']:.2f} µs | "
                f"{r['llama_check_accept_us_p50']:.2f} / {r['llama_check_accept_us_p99']:.2f} µs "
                f"| {f(r['ratio_check_accept_p50'])} / {f(r['ratio_check_accept_p99'])} |")


if __name__ == "__main__":
    main()
