#!/usr/bin/env bash
# Issue 14's game-loop figures: bench_game_loop (examples/game-loop/game_loop.c built in the tree)
# at 60 Hz for SECONDS, generating NPC lines continuously with THREADS compute threads, then the
# same loop without generating; ROUNDS times, alternating. Prints each run's percentile table and
# one JSON line per run with the load average before it.
# Usage: bench/game-loop.sh [BUILD] [MODEL]   Env: SECONDS_PER_RUN (30), THREADS (1), ROUNDS (1),
#        WORK_MS (4), EXTRA (more bench_game_loop flags for both runs, e.g. "--rt")
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
model=${2:-$root/models/smollm2-135m-instruct-q4_1.gguf}
secs=${SECONDS_PER_RUN:-30}
threads=${THREADS:-1}
rounds=${ROUNDS:-1}
work=${WORK_MS:-4}
read -r -a extra <<<"${EXTRA:-}"
bin=$build/bench/bench_game_loop
[ -x "$bin" ] || { echo "error: no $bin (cmake --build $build --target bench_game_loop)" >&2; exit 2; }
commit=$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)
for r in $(seq 1 "$rounds"); do
    for mode in generate no-generate; do
        load=$(cut -d' ' -f1-3 /proc/loadavg)
        flag=()
        [ "$mode" = no-generate ] && flag=(--no-generate)
        out=$("$bin" -m "$model" --seconds "$secs" --threads "$threads" --work-ms "$work" --quiet \
            ${flag[@]+"${flag[@]}"} ${extra[@]+"${extra[@]}"} || true)
        echo "$out"
        p99=$(awk '/^overrun_p99_ms/ {print $2}' <<<"$out")
        tick99=$(awk '$1 == "tick" {print $7}' <<<"$out")
        tps=$(sed -n 's/.*(\([0-9.]*\) tokens\/s).*/\1/p' <<<"$out")
        missed=$(sed -n 's/.*missed (ended past their 16.7 ms slot) \([0-9]*\).*/\1/p' <<<"$out")
        printf '{"bench":"game_loop","commit":"%s","round":%d,"mode":"%s","seconds":%s,"threads":%s,"work_ms":%s,"extra":"%s","overrun_p99_ms":%s,"tick_p99_ms":%s,"missed":%s,"tokens_per_s":%s,"load_before":"%s"}\n' \
            "$commit" "$r" "$mode" "$secs" "$threads" "$work" "${EXTRA:-}" "$p99" "$tick99" "$missed" "${tps:-0}" "$load"
    done
done
