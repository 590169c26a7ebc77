#!/usr/bin/env bash
# Serving benchmarks of issue 5 against `shoal serve` on one machine, with `shoal bench`:
#   1. streams:  1 client vs 32 concurrent clients (the ANCHORS.md llama-server shape: 64
#                streaming requests, ~36-token prompts, exactly 64 generated tokens, EOS ignored);
#   2. prefix:   a 1000-word (about 1k-token) shared system prompt with short questions, with the
#                prefix cache on and then off, and the server's prefix-cache hit ratio.
# Usage: bench/serve.sh [BUILD] [MODEL]   (env: THREADS, PORT, CLIENTS, REQS)
# Prints each run's text report and one JSON summary line per run at the end.
set -euo pipefail
BUILD=${1:-build}
MODEL=${2:-models/smollm2-135m-instruct-q4_1.gguf}
THREADS=${THREADS:-2}
PORT=${PORT:-18080}
CLIENTS=${CLIENTS:-32}
REQS=${REQS:-64}
SHOAL=$BUILD/shoal
OUT=$(mktemp -d)
trap 'kill "${SERVER:-}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$OUT"' EXIT

[ -x "$SHOAL" ] || { echo "error: $SHOAL not built" >&2; exit 2; }
[ -f "$MODEL" ] || { echo "error: $MODEL missing (scripts/get-model.sh fetches it)" >&2; exit 2; }

start() { # start EXTRA_ARGS...
  "$SHOAL" serve -m "$MODEL" -t "$THREADS" --port "$PORT" --log-level warn "$@" \
    2>"$OUT/server.log" &
  SERVER=$!
  for _ in $(seq 1 600); do
    grep -q "listening on" "$OUT/server.log" 2>/dev/null && return 0
    kill -0 "$SERVER" 2>/dev/null || { cat "$OUT/server.log" >&2; exit 1; }
    sleep 0.1
  done
  echo "error: server did not start" >&2
  exit 1
}
stop() { kill "$SERVER"; wait "$SERVER" || true; SERVER=; }
metric() { # metric NAME: its value on /metrics
  curl -s "http://127.0.0.1:$PORT/metrics" | awk -v n="$1" '$1 == n { print $2 }'
}
run() { # run NAME BENCH_ARGS...
  local name=$1
  shift
  echo "== $name ($(uptime | sed 's/.*load/load/'))"
  "$SHOAL" bench --url "http://127.0.0.1:$PORT" --quiet --json "$OUT/$name.json" "$@"
}

start
run single -c 1 -n 16 --prompt-tokens 36 --output-tokens 64 --ignore-eos
run streams$CLIENTS -c "$CLIENTS" -n "$REQS" --prompt-tokens 36 --output-tokens 64 --ignore-eos
stop

start
run prefix-on -c 8 -n 64 --endpoint chat --shared-prefix 1000 --prompt-tokens 16 \
  --output-tokens 32 --ignore-eos --warmup 1
HIT=$(metric shoal_prefix_cache_hit_ratio)
stop
echo "prefix cache hit ratio (cache on): $HIT"
start --no-prefix-cache
run prefix-off -c 8 -n 64 --endpoint chat --shared-prefix 1000 --prompt-tokens 16 \
  --output-tokens 32 --ignore-eos --warmup 1
stop

echo "== summary (output tokens/s, TTFT p99 ms)"
python3 - "$OUT" "$HIT" <<'EOF'
import json, sys, os
out, hit = sys.argv[1], sys.argv[2]
r = {}
for n in sorted(os.listdir(out)):
    if n.endswith(".json"):
        j = json.load(open(os.path.join(out, n)))
        r[n[:-5]] = j
        print(json.dumps({"name": n[:-5], "output_tok_s": j["throughput"]["output_tokens_per_s"],
                          "requests_per_s": j["throughput"]["requests_per_s"],
                          "ttft_p99_ms": j["ttft_ms"]["p99"], "latency_p99_ms": j["latency_ms"]["p99"],
                          "failed": j["requests"]["failed"]}))
s = [k for k in r if k.startswith("streams")]
if "single" in r and s:
    print("streams/single throughput ratio: %.2f" % (r[s[0]]["throughput"]["output_tokens_per_s"] /
                                                      r["single"]["throughput"]["output_tokens_per_s"]))
if "prefix-on" in r and "prefix-off" in r:
    print("prefix cache on/off throughput ratio: %.2f (hit ratio %s)" % (
        r["prefix-on"]["throughput"]["requests_per_s"] / r["prefix-off"]["throughput"]["requests_per_s"], hit))
EOF
