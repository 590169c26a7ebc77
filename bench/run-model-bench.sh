#!/usr/bin/env bash
# Prefill and decode figures for the synthetic model shapes of ANCHORS.md: makes each model once
# with `shoal mkmodel` into .cache/bench-models/ (git-ignored), then runs bench_model on it at
# each thread count. Prints bench_model's JSON lines, each tagged with shape and type.
# Usage: bench/run-model-bench.sh [BUILD_DIR] ; env SHAPES, TYPES, THREADS, REPS override.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
shapes=${SHAPES:-"smollm2-135m tinyllama-1.1b"}
types=${TYPES:-"Q4_0 Q4_1 Q8_0 F16"}
threads=${THREADS:-"1 2"}
reps=${REPS:-3}
cache="$root/.cache/bench-models"
mkdir -p "$cache"
echo "{\"name\":\"bench_info\",\"commit\":\"$(git -C "$root" rev-parse --short HEAD)\",\"host\":\"$(hostname)\",\"cpu\":\"$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')\",\"load\":\"$(cut -d' ' -f1-3 /proc/loadavg)\"}"
for shape in $shapes; do
    for type in $types; do
        model="$cache/$shape-$type.gguf"
        if [ ! -f "$model" ]; then
            "$build/shoal" mkmodel --shape "$shape" --type "$type" --seed 1 -o "$model" >&2
        fi
        for t in $threads; do
            "$build/bench/bench_model" -m "$model" -t "$t" --reps "$reps" \
                | sed "s/^{/{\"shape\":\"$shape\",\"type\":\"$type\",/"
        done
    done
done
