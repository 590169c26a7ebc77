#!/usr/bin/env bash
# Same-machine comparison with llama.cpp, in one run: the engine (llama-bench vs bench_model on
# the synthetic shapes of ANCHORS.md) and serving (llama-server -np 8 vs shoal serve, both loaded
# by `shoal bench` on the ANCHORS.md shape). llama.cpp is not part of this project and nothing of
# it is committed: build it yourself (a git checkout, or the copy vendored in the PyPI sdist of
# llama-cpp-python) with `cmake -DGGML_NATIVE=ON` and targets llama-bench and llama-server.
#
# Usage: LLAMA_BIN=/path/to/llama.cpp/build/bin bench/compare-llamacpp.sh [BUILD]
# Env: PARTS ("engine serve"), SHAPES, TYPES, THREADS (2), REPS (2), CLIENTS ("1 8 32"),
#      MODEL (the served model), PORT, ROUNDS (1: each round runs both engines, alternated, for
#      every shape and type, then both servers), PP (512), TG (128; 0 for prefill only), NP (8:
#      llama-server's -np), CTX (8192: its -c).
# Prints one JSON line per measurement: {"engine": "shoal"|"llama.cpp", ...}; a server's line
# "serve_rss" gives its peak RSS (VmHWM) after its client counts.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
: "${LLAMA_BIN:?set LLAMA_BIN to the folder holding llama-bench and llama-server}"
parts=${PARTS:-"engine serve"}
shapes=${SHAPES:-"smollm2-135m tinyllama-1.1b"}
types=${TYPES:-"Q4_0 Q4_1 Q8_0 F16"}
threads=${THREADS:-2}
reps=${REPS:-2}
clients=${CLIENTS:-"1 8 32"}
rounds=${ROUNDS:-1}
pp=${PP:-512}
tg=${TG:-128}
np=${NP:-8}
ctx=${CTX:-8192}
model=${MODEL:-$root/models/smollm2-135m-instruct-q4_1.gguf}
port=${PORT:-18181}
cache="$root/.cache/bench-models"
tmp=$(mktemp -d)
server=
trap 'kill $server 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$tmp"' EXIT

echo "{\"name\":\"compare_info\",\"commit\":\"$(git -C "$root" rev-parse --short HEAD)\",\"cpu\":\"$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')\",\"load\":\"$(cut -d' ' -f1-3 /proc/loadavg)\"}"

engine_round() { # engine_round ROUND
    for shape in $shapes; do
        for type in $types; do
            m="$cache/$shape-$type.gguf"
            [ -f "$m" ] || "$build/shoal" mkmodel --shape "$shape" --type "$type" --seed 1 -o "$m" >&2
            "$LLAMA_BIN/llama-bench" -m "$m" -t "$threads" -p "$pp" -n "$tg" -r "$reps" -o jsonl 2>/dev/null |
                python3 -c '
import json, sys
for line in sys.stdin:
    j = json.loads(line)
    test = "pp%d" % j["n_prompt"] if j["n_prompt"] else "tg%d" % j["n_gen"]
    print(json.dumps({"engine": "llama.cpp", "shape": sys.argv[1], "type": sys.argv[2],
                      "name": test, "value": round(j["avg_ts"], 1), "unit": "tok/s",
                      "threads": j["n_threads"], "round": int(sys.argv[3])}))' "$shape" "$type" "$1"
            "$build/bench/bench_model" -m "$m" -t "$threads" --pp "$pp" --tg "$((tg > 0 ? tg : 1))" \
                --reps "$reps" --no-bw |
                python3 -c '
import json, sys
for line in sys.stdin:
    j = json.loads(line)
    name = j.get("name", "")
    if name.startswith("pp") or (name.startswith("tg") and sys.argv[4] != "0"):
        print(json.dumps({"engine": "shoal", "shape": sys.argv[1], "type": sys.argv[2],
                          "name": name, "value": j["value"], "unit": "tok/s",
                          "threads": j["threads"], "round": int(sys.argv[3])}))' "$shape" "$type" "$1" "$tg"
        done
    done
}

wait_listen() { # wait_listen LOG PATTERN
    for _ in $(seq 1 1200); do
        grep -q "$2" "$1" 2>/dev/null && return 0
        kill -0 "$server" 2>/dev/null || { cat "$1" >&2; exit 1; }
        sleep 0.1
    done
    echo "error: server did not start" >&2
    exit 1
}
load() { # load ENGINE: one shoal bench run per client count
    for c in $clients; do
        "$build/shoal" bench --url "http://127.0.0.1:$port" --quiet -c "$c" -n 64 \
            --prompt-tokens 36 --output-tokens 64 --ignore-eos --json "$tmp/run.json" >/dev/null
        python3 -c '
import json, sys
j = json.load(open(sys.argv[1]))
print(json.dumps({"engine": sys.argv[2], "name": "serve", "clients": int(sys.argv[3]),
                  "output_tok_s": round(j["throughput"]["output_tokens_per_s"], 1),
                  "ttft_p50_ms": round(j["ttft_ms"]["p50"], 1),
                  "ttft_p99_ms": round(j["ttft_ms"]["p99"], 1),
                  "latency_p99_ms": round(j["latency_ms"]["p99"], 1),
                  "failed": j["requests"]["failed"]}))' "$tmp/run.json" "$1" "$c"
    done
}

peak_rss() { # peak_rss ENGINE: the server's VmHWM
    python3 -c '
import json, sys
kb = 0
for line in open("/proc/%s/status" % sys.argv[1]):
    if line.startswith("VmHWM:"):
        kb = int(line.split()[1])
print(json.dumps({"engine": sys.argv[2], "name": "serve_rss", "peak_rss_mb": round(kb / 1024, 1)}))' "$server" "$1"
}

serve_round() {
    "$LLAMA_BIN/llama-server" -m "$model" -np "$np" -c "$ctx" -t "$threads" --port "$port" \
        >"$tmp/llama.log" 2>&1 &
    server=$!
    wait_listen "$tmp/llama.log" "listening on"
    load llama.cpp
    peak_rss llama.cpp
    kill "$server"
    wait "$server" 2>/dev/null || true
    "$build/shoal" serve -m "$model" -t "$threads" --port "$port" --log-level warn \
        2>"$tmp/shoal.log" &
    server=$!
    wait_listen "$tmp/shoal.log" "listening on"
    load shoal
    peak_rss shoal
    kill "$server"
    wait "$server" 2>/dev/null || true
    server=
}

for round in $(seq 1 "$rounds"); do
    [[ " $parts " == *" engine "* ]] && engine_round "$round"
    [[ " $parts " == *" serve "* ]] && serve_round
done
exit 0
