#!/usr/bin/env bash
# Issue 27's speed figures for speculative decoding, in one run, one JSON line per result:
#   kcost:  bench_model --kcost: the time of one forward pass of n = 1..K+1 rows of one sequence
#           after a 256-token context, against one row (what a verify step of n-1 drafts costs),
#           plus 32 and 64 rows and 8 sequences x (1+k) rows;
#   run:    `shoal run` greedy (temperature 0) with --spec off and --spec ngram, alternating within
#           each round, on two edit-style workloads (a paragraph / a C function to repeat with one
#           small change: the answer restates the prompt) and a free-form one (a short story);
#   draft:  the F16 copy of the model (made once with `shoal quantize`, cached in .cache/spec/)
#           with --spec off and with --spec draft:MODEL (the Q4_1 file drafting for its F16 copy);
#   self:   --spec self:SELF_LAYERS (the model's first layers and its head draft) vs off on the
#           edit-prose and story workloads;
#   gemma:  Gemma 3 270M (models/gemma3-270m*.gguf, .cache/, tests/data/gemma3/, or $GEMMA) off
#           vs ngram on the edit-prose and story workloads; a note when no file is found;
#   serve:  `shoal serve --spec ngram` vs `--spec off` under `shoal bench` at 1 and 32 clients
#           (random-word prompts, 64 tokens each, EOS ignored), a fresh server per run, ROUNDS
#           rounds with the order swapped every round.
# Every `spec_run` line has the timings line's fields (gen_tps; with --spec drafts, drafted,
# accepted, accept_rate, calib_ms) and the process's wall time; every `spec_ratio` line a round's
# on/off ratio of gen_tps and whether the greedy text equalled the --spec off run's (it must);
# `spec_ratio_median` the median over the rounds.
# Usage: bench/spec.sh [BUILD] [MODEL]
#   env: THREADS (2), ROUNDS (3), NGEN (tokens per answer, 160), SPEC_K (--spec-k, default:
#        shoal's), KCOST (16), PARTS ("kcost run draft self gemma serve"), SELF_LAYERS (15, half
#        the default model's 30), GEMMA (a file), PORT (18090), CLIENTS (32), COMMIT (the
#        commit to name; default git's HEAD)
# Exits 2 with a clear error when the build's `shoal run` has no --spec flag (before running
# anything); when `shoal serve` has none, the serve part is skipped with an error and the script
# exits 2 after the other parts.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${1:-$root/build}
MODEL=${2:-$root/models/smollm2-135m-instruct-q4_1.gguf}
THREADS=${THREADS:-2}
ROUNDS=${ROUNDS:-3}
NGEN=${NGEN:-160}
SPEC_K=${SPEC_K:-}
KCOST=${KCOST:-16}
PARTS=${PARTS:-"kcost run draft self gemma serve"}
SELF_LAYERS=${SELF_LAYERS:-15}
PORT=${PORT:-18090}
CLIENTS=${CLIENTS:-32}
COMMIT=${COMMIT:-$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)}
SHOAL=$BUILD/shoal
OUT=$(mktemp -d)
SERVER=
trap '[ -n "$SERVER" ] && kill "$SERVER" 2>/dev/null; wait 2>/dev/null; rm -rf "$OUT"' EXIT

die() {
  echo "error: $*" >&2
  exit 2
}
want() { [[ " $PARTS " == *" $1 "* ]]; }
load() { cut -d' ' -f1 /proc/loadavg; }

[ -x "$SHOAL" ] || die "$SHOAL not built (cmake --build $BUILD --target shoal)"
[ -f "$MODEL" ] || die "$MODEL missing (scripts/get-model.sh fetches the default model)"
name=$(basename "$MODEL" .gguf)
if want run || want draft || want self || want gemma; then
  grep -q -- '--spec' <<<"$("$SHOAL" run --help 2>&1)" ||
    die "this build's \`shoal run\` has no --spec flag (speculative decoding in shoal run is not in this build); PARTS=kcost runs the cost table alone"
fi
STATUS=0
if want serve && ! grep -q -- '--spec' <<<"$("$SHOAL" serve --help 2>&1)"; then
  # the other parts still run; the script exits 2 at the end
  echo "error: this build's \`shoal serve\` has no --spec flag: the serve part is skipped (leave serve out of PARTS)" >&2
  echo '{"name":"spec_note","part":"serve","error":"shoal serve has no --spec flag in this build: skipped"}'
  PARTS=${PARTS//serve/}
  STATUS=2
fi

echo "{\"name\":\"spec_info\",\"commit\":\"$COMMIT\",\"host\":\"$(hostname)\",\"cpu\":\"$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')\",\"cpus\":$(nproc),\"threads\":$THREADS,\"rounds\":$ROUNDS,\"ngen\":$NGEN,\"spec_k\":\"${SPEC_K:-default}\",\"load\":\"$(cut -d' ' -f1-3 /proc/loadavg)\"}"

# ---- the k-row forward cost table ----------------------------------------------------------------
if want kcost; then
  [ -x "$BUILD/bench/bench_model" ] || die "$BUILD/bench/bench_model not built"
  "$BUILD/bench/bench_model" -m "$MODEL" -t "$THREADS" --no-bw --kcost "$KCOST" |
    grep '"name":"kcost"' | sed "s/}\$/,\"load\":$(load)}/"
fi

# ---- workloads ---------------------------------------------------------------------------------
# One line each (shoal run --chat reads a message per line); the answer restates most of the
# edit prompts.
EDIT_PROSE='Repeat the following paragraph word for word, changing only the day "Tuesday" to "Friday" everywhere: The library on Elm Street opens at nine in the morning on Tuesday. Visitors can borrow up to five books at a time, and each loan lasts three weeks. The reading room on the second floor is quiet and has large windows that face the park. Story hour for children takes place every Tuesday afternoon, and volunteers help older visitors use the computers. Late returns cost ten cents per day, but the fee is waived for students. On Tuesday evenings the library hosts a book club that meets in the small room next to the main desk, and new members are always welcome. The café in the lobby serves coffee, tea and fresh bread, and it closes one hour before the library does.'
EDIT_CODE='Rewrite this C function exactly as it is, but rename the variable "total" to "sum": int add_all(const int *values, int count) { int total = 0; for (int i = 0; i < count; i++) { if (values[i] > 0) { total += values[i]; } } return total; }'
CHAT_STORY='Write a short story about a lighthouse keeper who finds a mysterious map.'

# run_one OUTNAME MODEL SPEC PROMPT: one greedy answer; prints one JSON line.
run_one() {
  local tag=$1 model=$2 spec=$3 prompt=$4
  local args=(run -m "$model" -t "$THREADS" -n "$NGEN" --temp 0 --chat --spec "$spec")
  [ -n "$SPEC_K" ] && [ "$spec" != off ] && args+=(--spec-k "$SPEC_K")
  local l0 t0 t1 rc=0
  l0=$(load)
  t0=$(date +%s.%N)
  printf '%s\n' "$prompt" | "$SHOAL" "${args[@]}" >"$OUT/$tag.txt" 2>"$OUT/$tag.err" || rc=$?
  t1=$(date +%s.%N)
  if [ "$rc" != 0 ]; then
    echo "{\"name\":\"spec_run\",\"tag\":\"$tag\",\"spec\":\"$spec\",\"error\":\"exit $rc: $(tail -1 "$OUT/$tag.err" | tr -d '\042\134')\"}"
    return 0
  fi
  python3 - "$OUT" "$tag" "$spec" "$(basename "$model" .gguf)" "$l0" "$t0" "$t1" <<'EOF'
import json, os, sys
out, tag, spec, model, load, t0, t1 = sys.argv[1:8]
line = [l for l in open(os.path.join(out, tag + ".err")) if l.startswith("timings:")][-1]
kv = dict(p.split("=", 1) for p in line.split()[1:] if "=" in p)
def num(v):
    for f in (int, float):
        try:
            return f(v)
        except ValueError:
            pass
    return v
r = {"name": "spec_run", "tag": tag, "model": model, "spec": spec, "load": float(load),
     "wall_s": round(float(t1) - float(t0), 2)}
# the timings line's fields (with --spec: spec, spec_k, calib_ms, drafts, drafted, accepted,
# accept_rate); its spec (the kind) becomes spec_kind
r.update({("spec_kind" if k == "spec" else k): num(v) for k, v in kv.items()})
print(json.dumps(r))
EOF
}

# pair WORKLOAD MODEL SPEC PROMPT: ROUNDS rounds of off then on (the order alternates by round).
pair() {
  local wl=$1 model=$2 spec=$3 prompt=$4 i
  for i in $(seq 1 "$ROUNDS"); do
    if [ $((i % 2)) = 1 ]; then
      run_one "$wl-off-$i" "$model" off "$prompt"
      run_one "$wl-on-$i" "$model" "$spec" "$prompt"
    else
      run_one "$wl-on-$i" "$model" "$spec" "$prompt"
      run_one "$wl-off-$i" "$model" off "$prompt"
    fi
  done
}

if want run; then
  pair "$name:edit-prose" "$MODEL" ngram "$EDIT_PROSE"
  pair "$name:edit-code" "$MODEL" ngram "$EDIT_CODE"
  pair "$name:chat-story" "$MODEL" ngram "$CHAT_STORY"
fi

if want draft; then
  f16="$root/.cache/spec/$name-f16.gguf"
  if [ ! -f "$f16" ]; then
    mkdir -p "$root/.cache/spec"
    "$SHOAL" quantize "$MODEL" "$f16.tmp" --type F16 -q -t "$THREADS" && mv "$f16.tmp" "$f16"
  fi
  pair "$name-f16:draft-edit-prose" "$f16" "draft:$MODEL" "$EDIT_PROSE"
  pair "$name-f16:draft-chat-story" "$f16" "draft:$MODEL" "$CHAT_STORY"
fi

if want self; then
  pair "$name:self$SELF_LAYERS-edit-prose" "$MODEL" "self:$SELF_LAYERS" "$EDIT_PROSE"
  pair "$name:self$SELF_LAYERS-chat-story" "$MODEL" "self:$SELF_LAYERS" "$CHAT_STORY"
fi

if want gemma; then
  g=${GEMMA:-}
  for c in "$root"/models/gemma3-270m*.gguf "$root"/.cache/*/gemma3*270m*.gguf \
    "$root"/tests/data/gemma3/*.gguf; do
    [ -z "$g" ] && [ -f "$c" ] && g=$c
  done
  if [ -z "$g" ] || [ ! -f "$g" ]; then
    echo "{\"name\":\"spec_note\",\"part\":\"gemma\",\"note\":\"skipped: no Gemma 3 270M file (models/gemma3-270m*.gguf, .cache/, tests/data/gemma3/ or GEMMA=)\"}"
  else
    gname=$(basename "$g" .gguf)
    pair "$gname:edit-prose" "$g" ngram "$EDIT_PROSE"
    pair "$gname:chat-story" "$g" ngram "$CHAT_STORY"
  fi
fi

# ---- serving -----------------------------------------------------------------------------------
if want serve; then
  start() { # start SPEC
    "$SHOAL" serve -m "$MODEL" -t "$THREADS" --port "$PORT" --log-level warn --spec "$1" \
      2>"$OUT/server.log" &
    SERVER=$!
    for _ in $(seq 1 600); do
      grep -q "listening on" "$OUT/server.log" 2>/dev/null && return 0
      kill -0 "$SERVER" 2>/dev/null || { cat "$OUT/server.log" >&2; exit 1; }
      sleep 0.1
    done
    die "server did not start"
  }
  stop() { kill "$SERVER"; wait "$SERVER" || true; SERVER=; }
  spec_counts() { # the server's drafts, drafted and accepted tokens so far (/metrics counters)
    curl -s "http://127.0.0.1:$PORT/metrics" | awk '
      $1 ~ /^shoal_spec_drafts_total([{]|$)/ { d += $2 }
      $1 ~ /^shoal_spec_draft_tokens_total([{]|$)/ { t += $2 }
      $1 ~ /^shoal_spec_accepted_tokens_total([{]|$)/ { a += $2 }
      END { printf "%d %d %d\n", d, t, a }'
  }
  # ROUNDS rounds, off then ngram, the order swapped every round; a fresh server each time
  for i in $(seq 1 "$ROUNDS"); do
    order="off ngram"
    [ $((i % 2)) = 0 ] && order="ngram off"
    for spec in $order; do
      start "$spec"
      for c in 1 "$CLIENTS"; do
        n=$((c == 1 ? 8 : 2 * c))
        l0=$(load)
        m0=$(spec_counts)
        "$SHOAL" bench --url "http://127.0.0.1:$PORT" --quiet --json "$OUT/serve-$spec-$c-$i.json" \
          -c "$c" -n "$n" --prompt-tokens 36 --output-tokens 64 --ignore-eos --warmup 1 >/dev/null
        python3 - "$OUT/serve-$spec-$c-$i.json" "$spec" "$c" "$i" "$l0" "$m0" "$(spec_counts)" <<'EOF2'
import json, sys
j = json.load(open(sys.argv[1]))
d = [b - a for a, b in zip(map(int, sys.argv[6].split()), map(int, sys.argv[7].split()))]
print(json.dumps({"name": "spec_serve", "spec": sys.argv[2], "clients": int(sys.argv[3]),
                  "round": int(sys.argv[4]), "load": float(sys.argv[5]),
                  "output_tok_s": round(j["throughput"]["output_tokens_per_s"], 1),
                  "failed": j["requests"]["failed"], "drafts": d[0], "drafted": d[1],
                  "accepted": d[2]}))
EOF2
      done
      stop
    done
  done
fi

# ---- ratios ------------------------------------------------------------------------------------
python3 - "$OUT" <<'EOF'
import json, os, statistics, sys
out = sys.argv[1]
runs, acc = {}, {}
for f in os.listdir(out):
    parts = f[:-4].rsplit("-", 2)
    if f.endswith(".err") and len(parts) == 3 and parts[1] in ("off", "on"):
        wl, spec, rnd = parts
        lines = [l for l in open(os.path.join(out, f)) if l.startswith("timings:")]
        if lines:
            kv = dict(p.split("=", 1) for p in lines[-1].split()[1:] if "=" in p)
            runs.setdefault(wl, {}).setdefault(rnd, {})[spec] = float(kv.get("gen_tps", 0))
            if spec == "on" and "accept_rate" in kv:
                acc.setdefault(wl, {})[rnd] = float(kv["accept_rate"])
for wl in sorted(runs):
    ratios = []
    for rnd in sorted(runs[wl]):
        r = runs[wl][rnd]
        if r.get("off") and r.get("on"):
            ratios.append(r["on"] / r["off"])
            txt = [open(os.path.join(out, "%s-%s-%s.txt" % (wl, s, rnd))).read() for s in ("off", "on")]
            print(json.dumps({"name": "spec_ratio", "workload": wl, "round": int(rnd),
                              "off_tps": r["off"], "on_tps": r["on"],
                              "ratio": round(r["on"] / r["off"], 3),
                              "accept_rate": acc.get(wl, {}).get(rnd),
                              "same_output": txt[0] == txt[1]}))
    if ratios:
        print(json.dumps({"name": "spec_ratio_median", "workload": wl, "rounds": len(ratios),
                          "ratio": round(statistics.median(ratios), 3)}))
serve = {}
for f in os.listdir(out):
    if f.startswith("serve-") and f.endswith(".json"):
        _, spec, c, rnd = f[:-5].split("-")
        tps = json.load(open(os.path.join(out, f)))["throughput"]["output_tokens_per_s"]
        serve.setdefault(int(c), {}).setdefault(int(rnd), {})[spec] = tps
for c in sorted(serve):
    ratios = []
    for rnd in sorted(serve[c]):
        s = serve[c][rnd]
        if s.get("off") and s.get("ngram"):
            ratios.append(s["ngram"] / s["off"])
            print(json.dumps({"name": "spec_serve_ratio", "clients": c, "round": rnd,
                              "ratio": round(ratios[-1], 3)}))
    if ratios:
        print(json.dumps({"name": "spec_serve_ratio_median", "clients": c, "rounds": len(ratios),
                          "ratio": round(statistics.median(ratios), 3)}))
EOF
exit $STATUS
