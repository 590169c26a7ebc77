#!/usr/bin/env bash
# Cluster benchmarks of issues 11 and 26 against real processes (`shoal node` workers and a `shoal serve
# -c` front over ipc:// or LINK=tcp, beside a single-process `shoal serve -m`), on one machine:
#   throughput  output tokens/s at 32 concurrent streams (the ANCHORS.md llama-server shape: 64
#               streaming requests, ~36-token prompts, exactly 64 tokens out, EOS ignored) of the
#               default model: one process with 2 threads, a 2-stage pipeline (2 workers with 1
#               thread each + the front), 2 replicas of 1 worker thread each, and one replica
#               whose stage is a tensor-parallel group of 2 ranks of 1 thread each (a JSON line
#               saying "unsupported" when `shoal serve -c` refuses a config). Every config is
#               started once and the runs alternate (reversed in even rounds), ROUNDS times, so
#               ratios are within a round.
#   hop         decode time per token of one stream of stories260K (tiny compute, so the links
#               dominate) through 1, 2 and 3 stages on worker nodes, one stage on a
#               tensor-parallel group of 2 ranks, and a single process; per hop = (t_k - t_1) /
#               (k - 1); the group's added time per token = t_tp2 - t_1. Runs alternate,
#               HOP_REPS times; medians.
#   memory      (--memory) peak RSS (VmHWM) of a `shoal mkmodel --shape llama3-8b --type Q4_0`
#               model split over 2 worker processes against 60% of the file plus the stage's KV
#               pool, and of each rank of one stage on a tensor-parallel group of 2 (`shoal node`
#               each, shared memory between them) against 60% of the file plus the rank's KV pool
#               (its half of the KV heads), and of `shoal serve` of the default model under the 32-stream load against
#               llama-server's 436-471 MB (ANCHORS.md), with its default KV budget and with the
#               8192-token KV of `llama-server -c 8192`.
# Usage: bench/cluster.sh [--memory | --all] [BUILD]   (default parts: throughput hop)
# Env: MODEL, STORIES, BIG (the 8B file; made once with shoal mkmodel, 4.5 GB), PORT (base),
#      LINK (ipc, or tcp: every node on loopback tcp://), ROUNDS (4), HOP_REPS (5), CLIENTS
#      (32), REQS (64), MEM_STEP_TOKENS (the 8B split's batcher max_step_tokens, 512), PARTS
#      (overrides the parts: throughput hop memory, or memory-split / memory-tp2 / memory-serve
#      for a third of memory), COMMIT (the label of the measured build; default: this checkout's HEAD,
#      "+dirty" if tracked files changed).
# Prints one JSON line per measurement on stdout ({"bench": "cluster", "commit", "config",
# "figure", "value", "unit", ...}); progress and the processes' logs on failure go to stderr.
# Builds nothing: build first (`cmake --build BUILD --target shoal`).
# shellcheck disable=SC2016 # the "$W" in single-quoted replica lists is replaced by script()
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
parts=${PARTS:-"throughput hop"}
case "${1:-}" in
--memory) parts=${PARTS:-memory}; shift ;;
--all) parts=${PARTS:-"throughput hop memory"}; shift ;;
esac
build=${1:-$root/build}
shoal=$build/shoal
model=${MODEL:-$root/models/smollm2-135m-instruct-q4_1.gguf}
stories=${STORIES:-$root/tests/data/stories260K/stories260K.gguf}
big=${BIG:-$root/.cache/bench-models/llama3-8b-Q4_0.gguf}
port=${PORT:-18300}
rounds=${ROUNDS:-4}
hop_reps=${HOP_REPS:-5}
link=${LINK:-ipc}
clients=${CLIENTS:-32}
reqs=${REQS:-64}
if [ -z "${COMMIT:-}" ]; then
    COMMIT=$(git -C "$root" rev-parse --short HEAD)
    [ -z "$(git -C "$root" status --porcelain --untracked-files=no)" ] || COMMIT="$COMMIT+dirty"
fi

[ -x "$shoal" ] || { echo "error: $shoal not built" >&2; exit 2; }
[ -f "$model" ] || { echo "error: $model missing (scripts/get-model.sh fetches it)" >&2; exit 2; }
[ -f "$stories" ] || { echo "error: $stories missing" >&2; exit 2; }

tmp=$(mktemp -d /tmp/shoal-cluster-bench.XXXXXX)
pids=()
cleanup() {
    local p
    for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    for _ in $(seq 1 50); do
        local alive=0
        for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
        [ "$alive" = 0 ] && break
        sleep 0.1
    done
    for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    pids=()
}
trap 'cleanup; rm -rf "$tmp"' EXIT
trap 'exit 130' INT TERM

say() { echo "cluster.sh: $*" >&2; }
load() { cut -d' ' -f1-3 /proc/loadavg; }

# emit KEY=STRING | KEY:=JSON ...: one JSON line with the bench, commit and load first.
emit() {
    python3 - "bench=cluster" "commit=$COMMIT" "$@" "load=$(load)" <<'EOF'
import json, sys
d = {}
for a in sys.argv[1:]:
    k, v = a.split("=", 1)
    if k.endswith(":"):
        d[k[:-1]] = json.loads(v)
    else:
        d[k] = v
print(json.dumps(d), flush=True)
EOF
}

# spawn NAME CMD...: starts CMD in the background, stdout+stderr to $tmp/NAME.log.
spawn() {
    local name=$1
    shift
    "$@" >"$tmp/$name.log" 2>&1 &
    pids+=("$!")
    eval "pid_${name//-/_}=$!"
}
pid_of() { local v="pid_${1//-/_}"; echo "${!v}"; }

# wait_log NAME PATTERN: until the process's log has PATTERN; 1 if the process exited first.
wait_log() {
    local name=$1 pat=$2 pid
    pid=$(pid_of "$name")
    for _ in $(seq 1 1200); do
        grep -q "$pat" "$tmp/$name.log" 2>/dev/null && return 0
        kill -0 "$pid" 2>/dev/null || return 1
        sleep 0.1
    done
    return 1
}

# node_url TAG NODE: the node's transport URL: ipc:// in $tmp, or with LINK=tcp loopback tcp://
# on a port of its own (from PORT + 100 up).
next_tcp=$((port + 100))
# (sets $url; no subshell, so that the port count goes on)
node_url() {
    if [ "$link" = tcp ]; then
        url="tcp://127.0.0.1:$next_tcp"
        next_tcp=$((next_tcp + 1))
    else
        url="ipc://$tmp/$1-$2.sock"
    fi
}

# script FILE MODEL HTTP_PORT REPLICAS KV BATCHER WORKER...: a cluster script over $link
# (node_url): node 'front' (the gateway) and the workers. REPLICAS is the Lua list of replicas ("m"
# names the model; "$W" stands for the quoted, comma-separated workers).
script() {
    local file=$1 m=$2 http=$3 reps=$4 kv=$5 batcher=$6
    shift 6
    local tag nodes w ws=""
    tag=$(basename "$file" .lua)
    local url
    node_url "$tag" front
    nodes="    node { name = \"front\", listen = \"$url\" },"
    for w in "$@"; do
        node_url "$tag" "$w"
        nodes+=$'\n'"    node { name = \"$w\", listen = \"$url\" },"
        ws+="${ws:+, }\"$w\""
    done
    cat >"$file" <<EOF
local m = model { path = "$m", name = "m" }
return cluster {
  nodes = {
$nodes
  },
  gateway = { node = "front", http = "127.0.0.1:$http" },
  replicas = { ${reps//\$W/$ws} },
  batcher = { $batcher },
  kv = { block_tokens = 16, prefix_cache = true, memory = "$kv" },
}
EOF
}

# exit_class PID: 2 when the (exited) process's status was 2 (it refused its input), else 1.
exit_class() {
    local st=0
    wait "$1" || st=$?
    [ "$st" = 2 ] && return 2
    return 1
}

# start_cluster TAG SCRIPT THREADS WORKER...: starts the workers (-t THREADS), then the front;
# 0 when it listens, 2 when a process refused the script (exit status 2), 1 otherwise.
start_cluster() {
    local tag=$1 file=$2 threads=$3 w
    shift 3
    for w in "$@"; do
        spawn "$tag-$w" "$shoal" node -c "$file" --name "$w" -t "$threads" --log-level warn
    done
    spawn "$tag-front" "$shoal" serve -c "$file" --log-level warn
    for w in "$@"; do
        if ! wait_log "$tag-$w" "serving"; then
            exit_class "$(pid_of "$tag-$w")"
            return $?
        fi
    done
    if ! wait_log "$tag-front" "listening on"; then
        exit_class "$(pid_of "$tag-front")"
        return $?
    fi
}

# bench URL OUT ARGS...: one `shoal bench` run, JSON report to OUT.
bench() {
    local url=$1 out=$2
    shift 2
    "$shoal" bench --url "$url" --quiet --json "$out" "$@" >/dev/null
}
jget() { python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); print(eval(sys.argv[2], {}, {"j": j}))' "$@"; }
# inflight PORT: "SUM COUNT" of the server's shoal_steps_in_flight histogram (empty without it).
inflight() {
    curl -s --max-time 5 "http://127.0.0.1:$1/metrics" | awk '
        $1 ~ /^shoal_steps_in_flight_sum/ { s = $2 } $1 ~ /^shoal_steps_in_flight_count/ { c = $2 }
        END { if (c != "") print s, c }' || true
}
hwm() { echo $(($(awk '/^VmHWM/ { print $2 }' "/proc/$1/status") * 1024)); } # bytes
fail_logs() { local f; for f in "$@"; do echo "--- $f" >&2; tail -20 "$tmp/$f.log" >&2; done; }

emit config=machine figure=info link="$link" cpu="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')" \
    cpus:="$(nproc)" mem_gib:="$(awk '/MemTotal/ { printf "%.1f", $2 / 1048576 }' /proc/meminfo)"

# ---------------------------------------------------------------------------------------------
if [[ " $parts " == *" throughput "* ]]; then
    say "throughput: default model, $clients streams, $reqs requests, rounds $rounds"
    batcher="max_step_tokens = 4096, max_seqs = 64, max_wait_ms = 50" # shoal serve's defaults
    load_args=(-c "$clients" -n "$reqs" --prompt-tokens 36 --output-tokens 64 --ignore-eos)
    # KV: the same block count everywhere (512 MiB for all 30 layers = 256 MiB per half).
    spawn tp-single "$shoal" serve -m "$model" -t 2 --kv-mem 512M --port $((port + 1)) \
        --log-level warn
    wait_log tp-single "listening on" || { fail_logs tp-single; exit 1; }
    configs=("single:$((port + 1))")

    script "$tmp/tp-pipe2.lua" "$model" $((port + 2)) 'replica { model = m, stages = pipeline(m, { $W }) }' \
        256MiB "$batcher" w0 w1
    if start_cluster tp-pipe2 "$tmp/tp-pipe2.lua" 1 w0 w1; then
        configs+=("pipeline2:$((port + 2))")
    else
        fail_logs tp-pipe2-w0 tp-pipe2-w1 tp-pipe2-front
        emit config=pipeline2 figure=output_tok_s status=failed
    fi

    script "$tmp/tp-rep2.lua" "$model" $((port + 3)) \
        'replica { model = m, stages = pipeline(m, { "w0" }) }, replica { model = m, stages = pipeline(m, { "w1" }) }' \
        512MiB "$batcher" w0 w1
    rc=0
    start_cluster tp-rep2 "$tmp/tp-rep2.lua" 1 w0 w1 || rc=$?
    if [ "$rc" = 0 ]; then
        configs+=("replicas2:$((port + 3))")
    elif [ "$rc" = 2 ]; then
        reason=$(grep -h -m1 "error:" "$tmp"/tp-rep2-*.log | head -1)
        emit config=replicas2 figure=output_tok_s status=unsupported reason="$reason"
    else
        fail_logs tp-rep2-w0 tp-rep2-w1 tp-rep2-front
        emit config=replicas2 figure=output_tok_s status=failed
    fi

    # One replica whose only stage is a tensor-parallel group of 2 ranks (shared memory between
    # them), every layer sliced over both; the KV budget is the stage's, as for replicas2.
    script "$tmp/tp-tp2.lua" "$model" $((port + 4)) 'replica { model = m, stages = pipeline(m, { { $W } }) }' \
        512MiB "$batcher" w0 w1
    rc=0
    start_cluster tp-tp2 "$tmp/tp-tp2.lua" 1 w0 w1 || rc=$?
    if [ "$rc" = 0 ]; then
        configs+=("tp2:$((port + 4))")
    elif [ "$rc" = 2 ]; then
        reason=$(grep -h -m1 "error:" "$tmp"/tp-tp2-*.log | head -1)
        emit config=tp2 figure=output_tok_s status=unsupported reason="$reason"
    else
        fail_logs tp-tp2-w0 tp-tp2-w1 tp-tp2-front
        emit config=tp2 figure=output_tok_s status=failed
    fi

    for c in "${configs[@]}"; do # warm-up: each config serves the load once, unmeasured
        bench "http://127.0.0.1:${c#*:}" "$tmp/warm.json" -c "$clients" -n "$clients" \
            --prompt-tokens 36 --output-tokens 16 --ignore-eos --seed 99
    done
    for r in $(seq 1 "$rounds"); do
        order=("${configs[@]}")
        if [ $((r % 2)) = 0 ]; then # even rounds run the configs in reverse order
            order=()
            for ((i = ${#configs[@]} - 1; i >= 0; i--)); do order+=("${configs[$i]}"); done
        fi
        for c in "${order[@]}"; do
            name=${c%%:*}
            before=$(inflight "${c#*:}")
            bench "http://127.0.0.1:${c#*:}" "$tmp/tp-$name-$r.json" "${load_args[@]}"
            after=$(inflight "${c#*:}")
            f=$tmp/tp-$name-$r.json
            case $name in
            single) desc="shoal serve -m -t 2 (one process)" ;;
            pipeline2) desc="2 shoal node -t 1 (2 stages) + shoal serve -c front, $link://" ;;
            replicas2) desc="2 replicas of 1 stage, shoal node -t 1 each + front, $link://" ;;
            tp2) desc="1 stage on a tensor-parallel group of 2 ranks, shoal node -t 1 each + front, $link://" ;;
            esac
            emit config="$name" desc="$desc" round:="$r" figure=output_tok_s \
                value:="$(jget "$f" 'j["throughput"]["output_tokens_per_s"]')" unit=tok/s \
                clients:="$clients" requests:="$reqs" prompt_tokens:=36 output_tokens:=64 \
                ok:="$(jget "$f" 'j["requests"]["ok"]')" failed:="$(jget "$f" 'j["requests"]["failed"]')" \
                ttft_p99_ms:="$(jget "$f" 'j["ttft_ms"]["p99"]')" tpot_p50_ms:="$(jget "$f" 'j["tpot_ms"]["p50"]')" \
                steps_in_flight_mean:="$(python3 -c 'import sys; a, b = sys.argv[1].split(), sys.argv[2].split()
print(round((float(b[0]) - float(a[0])) / (float(b[1]) - float(a[1])), 3) if len(a) == 2 and len(b) == 2 and b[1] != a[1] else "null")' "$before" "$after")"
        done
        for c in "${configs[@]}"; do
            name=${c%%:*}
            [ "$name" = single ] && continue
            ratio=$(python3 -c 'import json,sys; a,b=(json.load(open(f))["throughput"]["output_tokens_per_s"] for f in sys.argv[1:]); print(round(a/b, 3))' \
                "$tmp/tp-$name-$r.json" "$tmp/tp-single-$r.json")
            emit config="$name/single" round:="$r" figure=throughput_ratio value:="$ratio" \
                target:=0.85 met:="$(python3 -c "print('true' if $ratio >= 0.85 else 'false')")"
        done
    done
    for c in "${configs[@]}"; do # the median over rounds of each config's ratio to single
        name=${c%%:*}
        [ "$name" = single ] && continue
        python3 - "$tmp" "$name" "$rounds" "$COMMIT" "$(load)" <<'EOF'
import json, os, statistics, sys
tmp, name, rounds, commit, load = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
tok = lambda n, r: json.load(open(os.path.join(tmp, f"tp-{n}-{r}.json")))["throughput"]["output_tokens_per_s"]
ratios = [tok(name, r) / tok("single", r) for r in range(1, rounds + 1)]
v = statistics.median(ratios)
print(json.dumps({"bench": "cluster", "commit": commit, "config": f"{name}/single",
                  "figure": "throughput_ratio_median", "value": round(v, 3),
                  "rounds": [round(x, 3) for x in ratios], "target": 0.85, "met": v >= 0.85,
                  "load": load}), flush=True)
EOF
    done
    cleanup
fi

# ---------------------------------------------------------------------------------------------
if [[ " $parts " == *" hop "* ]]; then
    say "hop: stories260K, one stream, 1/2/3 stages on workers, reps $hop_reps"
    batcher="max_step_tokens = 512, max_seqs = 16, max_wait_ms = 50"
    spawn hop-single "$shoal" serve -m "$stories" -t 1 --port $((port + 10)) --log-level warn
    wait_log hop-single "listening on" || { fail_logs hop-single; exit 1; }
    hops=("single:$((port + 10))")
    for k in 1 2 3; do
        ws=()
        for i in $(seq 0 $((k - 1))); do ws+=("w$i"); done
        script "$tmp/hop$k.lua" "$stories" $((port + 10 + k)) \
            'replica { model = m, stages = pipeline(m, { $W }) }' 32MiB "$batcher" "${ws[@]}"
        start_cluster "hop$k" "$tmp/hop$k.lua" 1 "${ws[@]}" ||
            { fail_logs "hop$k-front"; exit 1; }
        hops+=("stages$k:$((port + 10 + k))")
    done
    # One stage on a tensor-parallel group of 2 ranks: the two all-reduces per layer (and the
    # step's agreement) in place of the hops.
    script "$tmp/hoptp2.lua" "$stories" $((port + 14)) \
        'replica { model = m, stages = pipeline(m, { { $W } }) }' 32MiB "$batcher" w0 w1
    start_cluster hoptp2 "$tmp/hoptp2.lua" 1 w0 w1 ||
        { fail_logs hoptp2-w0 hoptp2-w1 hoptp2-front; exit 1; }
    hops+=("tp2:$((port + 14))")
    hop_args=(-c 1 -n 16 --prompt-tokens 8 --output-tokens 256 --ignore-eos)
    for h in "${hops[@]}"; do
        bench "http://127.0.0.1:${h#*:}" "$tmp/warm.json" -c 1 -n 2 --prompt-tokens 8 \
            --output-tokens 64 --ignore-eos --seed 99
    done
    for r in $(seq 1 "$hop_reps"); do
        for h in "${hops[@]}"; do
            bench "http://127.0.0.1:${h#*:}" "$tmp/hop-${h%%:*}-$r.json" "${hop_args[@]}"
        done
    done
    python3 - "$tmp" "$hop_reps" "$COMMIT" "$(load)" "$link" <<'EOF'
import json, os, statistics, sys
tmp, reps, commit, load, link = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
def fig(name, r, key, stat):
    return json.load(open(os.path.join(tmp, f"hop-{name}-{r}.json")))[key][stat]
base = {"bench": "cluster", "commit": commit, "model": "stories260K", "link": link, "threads_per_process": 1,
        "requests": 16, "output_tokens": 256, "reps": reps}
med = {}
for name in ["single", "stages1", "stages2", "stages3", "tp2"]:
    tpot = [fig(name, r, "tpot_ms", "p50") for r in range(1, reps + 1)]
    itl = [fig(name, r, "itl_ms", "p50") for r in range(1, reps + 1)]
    med[name] = statistics.median(tpot)
    print(json.dumps(dict(base, config=name, figure="decode_ms_per_token",
                          value=round(med[name], 4), unit="ms", stat="median over reps of TPOT p50",
                          tpot_p50_ms=[round(x, 4) for x in tpot],
                          itl_p50_ms=[round(x, 4) for x in itl], load=load)))
for k in (2, 3):
    per_hop = [(fig(f"stages{k}", r, "tpot_ms", "p50") - fig("stages1", r, "tpot_ms", "p50")) / (k - 1) * 1000
               for r in range(1, reps + 1)]
    v = (med[f"stages{k}"] - med["stages1"]) / (k - 1) * 1000
    print(json.dumps(dict(base, config=f"stages{k}-vs-stages1", figure="added_us_per_hop",
                          value=round(v, 1), unit="us", per_rep=[round(x, 1) for x in per_hop],
                          target=200, met=v < 200, load=load)))
print(json.dumps(dict(base, config="tp2-vs-stages1", figure="added_us_per_token",
                      value=round((med["tp2"] - med["stages1"]) * 1000, 1), unit="us",
                      per_rep=[round((fig("tp2", r, "tpot_ms", "p50") - fig("stages1", r, "tpot_ms", "p50")) * 1000, 1)
                               for r in range(1, reps + 1)], load=load)))
print(json.dumps(dict(base, config="stages1-vs-single", figure="worker_round_trip_us",
                      value=round((med["stages1"] - med["single"]) * 1000, 1), unit="us", load=load)))
EOF
    cleanup
fi

# ---------------------------------------------------------------------------------------------
# kv_bytes GGUF LAYERS BLOCKS [TP]: bytes of an F16 KV pool of BLOCKS 16-token blocks over LAYERS
# (of one rank of a tensor-parallel group of TP: its share of the KV heads; the shapes measured
# here split them evenly, anything else is an error).
kv_bytes() {
    "$shoal" inspect "$1" | awk -v L="$2" -v B="$3" -v T="${4:-1}" '
        $1 == "embedding_length" { d = $2 } $1 == "attention.head_count" { h = $2 }
        $1 == "attention.head_count_kv" { kvh = $2 }
        END { if (kvh % T) { print "error: " kvh " KV heads over " T " ranks" > "/dev/stderr"; exit 1 }
              printf "%.0f\n", B * L * 2 * (kvh / T) * (d / h) * 2 * 16 }'
}

# rss_of PID FIELD: bytes of FIELD (RssAnon, RssFile) in /proc/PID/status now.
rss_of() { echo $(($(awk -v f="$2:" '$1 == f { print $2 }' "/proc/$1/status") * 1024)); }

# mem_big TAG CONFIG REPLICAS TP WORKER...: the 8B file under a short load on a cluster of REPLICAS
# (workers -t 1, 64 MiB of KV per stage), then one JSON line per process: peak RSS against 0.6 x
# the file + the process's KV pool (a rank's share when TP > 1).
mem_big() {
    local tag=$1 config=$2 reps=$3 tp=$4
    shift 4
    local kvmem=64MiB mem_step=${MEM_STEP_TOKENS:-512} http=$((port + 20))
    [ "$tp" -gt 1 ] && http=$((port + 22))
    script "$tmp/$tag.lua" "$big" "$http" "$reps" "$kvmem" \
        "max_step_tokens = $mem_step, max_seqs = 16, max_wait_ms = 50" "$@"
    start_cluster "$tag" "$tmp/$tag.lua" 1 "$@" ||
        { fail_logs "${@/#/$tag-}" "$tag-front"; exit 1; }
    bench "http://127.0.0.1:$http" "$tmp/$tag.json" -c 4 -n 4 --prompt-tokens 16 \
        --output-tokens 8 --ignore-eos --timeout 600
    local w pid peak kv layers line a b blocks limit
    for w in "$@" front; do
        pid=$(pid_of "$tag-$w")
        peak=$(hwm "$pid")
        if [ "$w" = front ]; then
            kv=0 layers=none
        else
            line=$(grep -m1 "serving stage" "$tmp/$tag-$w.log")
            a=$(sed -E 's/.*layers \[([0-9]+), ([0-9]+)\).*/\1/' <<<"$line")
            b=$(sed -E 's/.*layers \[([0-9]+), ([0-9]+)\).*/\2/' <<<"$line")
            blocks=$(sed -E 's/.*KV ([0-9]+) blocks.*/\1/' <<<"$line")
            kv=$(kv_bytes "$big" $((b - a)) "$blocks" "$tp")
            layers="[$a, $b)"
            [ "$tp" -gt 1 ] && layers="$layers $(sed -E 's/.*\((rank [0-9]+ of [0-9]+)[,)].*/\1/' <<<"$line")"
        fi
        limit=$(python3 -c "print(int(0.6 * $size + $kv))")
        emit config="$config" node="$w" layers="$layers" figure=peak_rss value:="$peak" unit=bytes \
            rss_anon_bytes:="$(rss_of "$pid" RssAnon)" rss_file_bytes:="$(rss_of "$pid" RssFile)" \
            file_bytes:="$size" kv_pool_bytes:="$kv" limit_bytes:="$limit" \
            ratio_to_file:="$(python3 -c "print(round($peak / $size, 3))")" \
            met:="$(python3 -c "print('true' if $peak <= $limit else 'false')")" \
            requests_ok:="$(jget "$tmp/$tag.json" 'j["requests"]["ok"]')" kv_memory="$kvmem" \
            batcher="max_step_tokens $mem_step, max_seqs 16" threads:=1
    done
    cleanup
}

if [[ " $parts " == *" memory "* || " $parts " == *" memory-split "* || " $parts " == *" memory-tp2 "* ]]; then
    if [ ! -f "$big" ]; then
        avail=$(df --output=avail -B1 "$(dirname "$big")" 2>/dev/null | tail -1 || echo 0)
        [ "$avail" -gt 6000000000 ] || { echo "error: less than 6 GB free for $big" >&2; exit 1; }
        mkdir -p "$(dirname "$big")"
        say "making $big (shoal mkmodel --shape llama3-8b --type Q4_0 --seed 1)"
        "$shoal" mkmodel --shape llama3-8b --type Q4_0 --seed 1 -o "$big.tmp.$$" >&2
        mv "$big.tmp.$$" "$big"
    fi
    size=$(stat -c %s "$big")
fi

if [[ " $parts " == *" memory "* || " $parts " == *" memory-split "* ]]; then
    say "memory: $big ($size bytes) over 2 worker processes"
    mem_big mem8b llama3-8b-q4_0-2stages 'replica { model = m, stages = pipeline(m, { $W }) }' 1 w0 w1
fi

# One stage on a tensor-parallel group of 2 ranks (shared memory between them): every layer
# sliced over both, each rank's KV pool its half of the KV heads of the stage's blocks.
if [[ " $parts " == *" memory "* || " $parts " == *" memory-tp2 "* ]]; then
    say "memory: $big ($size bytes) on a tensor-parallel group of 2 rank processes"
    mem_big mem8btp2 llama3-8b-q4_0-tp2 'replica { model = m, stages = pipeline(m, { { $W } }) }' 2 w0 w1
fi

if [[ " $parts " == *" memory "* || " $parts " == *" memory-serve "* ]]; then
    # One process, the default model, the ANCHORS.md load at 32 clients; llama-server's
    # -c 8192 holds 8192 tokens of KV, which is 512 blocks here.
    # Also the longer load of bench/README.md's "one copy of the weights" section (~128-token
    # prompts, 128 out), where the default 1 GiB KV budget fills further.
    for cfg in default kv8192 default-long kv8192-long; do
        extra=()
        [[ "$cfg" == kv8192* ]] && extra=(--kv-blocks 512)
        shape=(--prompt-tokens 36 --output-tokens 64)
        desc="32 clients, 64 requests, 36-token prompts, 64 out (ANCHORS.md)"
        if [[ "$cfg" == *-long ]]; then
            shape=(--prompt-tokens 128 --output-tokens 128)
            desc="32 clients, 64 requests, 128-token prompts, 128 out"
        fi
        spawn "mem-$cfg" "$shoal" serve -m "$model" -t 2 --port $((port + 21)) --log-level warn "${extra[@]}"
        wait_log "mem-$cfg" "listening on" || { fail_logs "mem-$cfg"; exit 1; }
        bench "http://127.0.0.1:$((port + 21))" "$tmp/mem-$cfg.json" -c 32 -n 64 "${shape[@]}" --ignore-eos
        peak=$(hwm "$(pid_of "mem-$cfg")")
        emit config="serve-default-model-$cfg" figure=peak_rss value:="$peak" unit=bytes \
            args="serve -m MODEL -t 2 ${extra[*]}" load_shape="$desc" \
            output_tok_s:="$(jget "$tmp/mem-$cfg.json" 'j["throughput"]["output_tokens_per_s"]')" \
            failed:="$(jget "$tmp/mem-$cfg.json" 'j["requests"]["failed"]')" \
            llama_server_anchor_bytes="436-471 MB (ANCHORS.md, 36/64 load; not run here)" \
            met:="$(python3 -c "print('true' if $peak <= 471e6 else 'false')")"
        cleanup
    done
fi
