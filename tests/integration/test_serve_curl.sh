#!/usr/bin/env bash
# `shoal serve` driven by curl: GET /health, /v1/models, /metrics (the metric names), a
# completion, a streamed chat (-N) that ends with `data: [DONE]`, keep-alive (curl reuses one
# connection for two requests), and a server with --api-key (no key or a wrong key -> 401, the
# right key -> 200). Each server is stopped with SIGTERM and must exit 0 with no crash in its log.
# Env: SH_SHOAL (the binary), SH_SOURCE_DIR (repo root). Exit 77 when the model or curl is missing.
set -uo pipefail

root="${SH_SOURCE_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}"
cd "$root" || exit 1
model="models/smollm2-135m-instruct-q4_1.gguf"
name="smollm2-135m-instruct-q4_1"
shoal="${SH_SHOAL:-build/shoal}"

[ -f "$model" ] || { echo "SKIP: $model missing (scripts/get-model.sh)"; exit 77; }
command -v curl >/dev/null 2>&1 || { echo "SKIP: curl missing (scripts/bootstrap.sh)"; exit 77; }
command -v python3 >/dev/null 2>&1 || { echo "SKIP: python3 missing"; exit 77; }
[ -x "$shoal" ] || { echo "FAIL: no shoal binary at $shoal (set SH_SHOAL)"; exit 1; }

tmp="$(mktemp -d /tmp/shoal-curl.XXXXXX)"
passed=0
failed=0
failures=()
srv_pid=""
srv_log=""
url=""

# Never go through a proxy from the environment.
export no_proxy="127.0.0.1,localhost" NO_PROXY="127.0.0.1,localhost"
CURL=(curl --noproxy '*' -sS --max-time 120)

ok() {
    passed=$((passed + 1))
    echo "ok   serve_curl: $1"
}
fail() {
    failed=$((failed + 1))
    failures+=("$1: $2")
    echo "FAIL serve_curl: $1: $2"
}

# start_server ARGS...: starts `shoal serve --port 0 -m MODEL ARGS` and sets srv_pid, srv_log, url.
start_server() { start_server_with --port 0 -m "$model" "$@"; }

# start_server_with ARGS...: starts `shoal serve ARGS` (which must listen on a free port).
start_server_with() {
    srv_log="$tmp/server.$RANDOM.log"
    "$shoal" serve "$@" >"$srv_log" 2>&1 &
    srv_pid=$!
    local i line
    for ((i = 0; i < 1200; i++)); do
        line="$(grep -o 'listening on http://[0-9.]*:[0-9]*' "$srv_log" | head -n 1)"
        if [ -n "$line" ]; then
            url="${line#listening on }"
            return 0
        fi
        if ! kill -0 "$srv_pid" 2>/dev/null; then
            wait "$srv_pid"
            echo "FAIL serve_curl: server exited with $? before listening; log:"
            tail -n 60 "$srv_log"
            return 1
        fi
        sleep 0.1
    done
    echo "FAIL serve_curl: server did not print 'listening on' within 120 s; log:"
    tail -n 60 "$srv_log"
    kill -KILL "$srv_pid" 2>/dev/null
    wait "$srv_pid" 2>/dev/null
    return 1
}

# stop_server: SIGTERM, wait (30 s), then check exit 0 and a log without crash lines.
stop_server() {
    [ -n "$srv_pid" ] || return 0
    kill -TERM "$srv_pid" 2>/dev/null
    local i rc
    for ((i = 0; i < 300; i++)); do
        kill -0 "$srv_pid" 2>/dev/null || break
        sleep 0.1
    done
    if kill -0 "$srv_pid" 2>/dev/null; then
        kill -KILL "$srv_pid" 2>/dev/null
        wait "$srv_pid" 2>/dev/null
        fail "shutdown" "server did not exit within 30 s of SIGTERM; log tail: $(tail -n 20 "$srv_log")"
        srv_pid=""
        return
    fi
    wait "$srv_pid"
    rc=$?
    srv_pid=""
    if [ "$rc" -ne 0 ]; then
        fail "shutdown" "server exited with $rc after SIGTERM (want 0); log tail:
$(tail -n 30 "$srv_log")"
    elif grep -E 'Sanitizer|runtime error:|panic at|Segmentation fault|Assertion `|double free' \
        "$srv_log" >/dev/null; then
        fail "shutdown" "crash/sanitizer output in the server log:
$(grep -E -A3 'Sanitizer|runtime error:|panic at|Segmentation fault|Assertion `|double free' "$srv_log" | head -n 40)"
    else
        ok "clean shutdown (exit 0)"
    fi
}

cleanup() {
    if [ -n "$srv_pid" ]; then
        kill -KILL "$srv_pid" 2>/dev/null
        wait "$srv_pid" 2>/dev/null
    fi
    rm -rf "$tmp"
}
trap cleanup EXIT

# req NAME ARGS...: runs curl with -w '%{http_code}' into $tmp/body, sets code.
code=""
req() {
    local what="$1"
    shift
    code="$("${CURL[@]}" -o "$tmp/body" -w '%{http_code}' "$@" 2>"$tmp/curl.err")" || {
        fail "$what" "curl failed: $(cat "$tmp/curl.err")"
        code="000"
        return 1
    }
    return 0
}

# json_check FILE PYTHON-EXPR: evaluates EXPR with j = the parsed JSON; true passes.
json_check() {
    python3 - "$1" "$2" <<'EOF'
import json, sys
try:
    j = json.load(open(sys.argv[1], "rb"))
except Exception as e:
    print(f"not JSON: {e}"); sys.exit(1)
try:
    ok = eval(sys.argv[2])
except Exception as e:
    print(f"{type(e).__name__}: {e}"); sys.exit(1)
sys.exit(0 if ok else 1)
EOF
}

body() { head -c 600 "$tmp/body"; }

if ! start_server; then
    echo "serve_curl: 0 passed, 1 failed"
    exit 1
fi
echo "serve_curl: server at $url"

# --- GET /health
if req health "$url/health"; then
    if [ "$code" = 200 ] && json_check "$tmp/body" 'j.get("status") == "ok"' >/dev/null; then
        ok "GET /health"
    else fail "GET /health" "status $code, body $(body)"; fi
fi

# --- GET /v1/models
if req models "$url/v1/models"; then
    if [ "$code" = 200 ] && json_check "$tmp/body" \
        "j.get('object') == 'list' and any(m.get('id') == '$name' and m.get('object') == 'model' for m in j['data'])" \
        >/dev/null; then
        ok "GET /v1/models"
    else fail "GET /v1/models" "status $code, body $(body)"; fi
fi

# --- a completion
cmpl='{"model":"'$name'","prompt":"The capital of France is","max_tokens":12,"temperature":0}'
if req completion -H 'Content-Type: application/json' -d "$cmpl" "$url/v1/completions"; then
    if [ "$code" = 200 ] && json_check "$tmp/body" \
        "j['object'] == 'text_completion' and j['choices'][0]['index'] == 0 and isinstance(j['choices'][0]['text'], str) and len(j['choices'][0]['text']) > 0 and j['choices'][0]['finish_reason'] in ('stop','length') and j['usage']['completion_tokens'] > 0" \
        >/dev/null; then
        ok "POST /v1/completions"
    else fail "POST /v1/completions" "status $code, body $(body)"; fi
fi

# --- a streamed chat
chatreq='{"model":"'$name'","messages":[{"role":"user","content":"Say hello."}],"max_tokens":16,"temperature":0,"stream":true}'
if "${CURL[@]}" -N -D "$tmp/hdrs" -o "$tmp/sse" -H 'Content-Type: application/json' \
    -d "$chatreq" "$url/v1/chat/completions" 2>"$tmp/curl.err"; then
    if python3 - "$tmp/sse" "$tmp/hdrs" <<'EOF'; then
import json, sys
raw = open(sys.argv[1], "rb").read().decode()
hdrs = open(sys.argv[2]).read().lower()
assert hdrs.startswith("http/1.1 200"), hdrs.splitlines()[0]
assert "content-type: text/event-stream" in hdrs, hdrs
lines = [ln for ln in raw.split("\n") if ln.strip()]
assert lines and lines[-1].strip() == "data: [DONE]", f"last line {lines[-1:]!r}"
events = [json.loads(ln[5:]) for ln in lines[:-1]]
assert all(ln.startswith("data: ") for ln in lines), "non-data line"
assert events, "no chunks"
assert all(e["object"] == "chat.completion.chunk" for e in events)
assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length"), events[-1]
text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
assert text, "empty streamed text"
EOF
        ok "streamed chat ends with data: [DONE]"
    else fail "streamed chat" "bad SSE stream: $(head -c 800 "$tmp/sse")"; fi
else fail "streamed chat" "curl failed: $(cat "$tmp/curl.err")"; fi

# --- keep-alive: GET then POST over one connection (--next keeps the connection pool)
if "${CURL[@]}" -v -o /dev/null "$url/health" --next --noproxy '*' -sS -o /dev/null \
    -H 'Content-Type: application/json' -d "$cmpl" "$url/v1/completions" 2>"$tmp/curl.err"; then
    if grep -q "Re-using existing connection" "$tmp/curl.err"; then
        ok "keep-alive: second request reuses the connection"
    else fail "keep-alive" "curl did not reuse the connection: $(grep -E '^[<>*]' "$tmp/curl.err" | head -n 30)"; fi
else fail "keep-alive" "curl failed: $(tail -n 5 "$tmp/curl.err")"; fi

# --- keep-alive after a chunked SSE stream: the stream ends cleanly and the connection is reused
if "${CURL[@]}" -v -N -o /dev/null -H 'Content-Type: application/json' -d "$chatreq" \
    "$url/v1/chat/completions" --next --noproxy '*' -sS -o /dev/null "$url/health" \
    2>"$tmp/curl.err"; then
    if grep -q "Re-using existing connection" "$tmp/curl.err"; then
        ok "keep-alive: a request after a stream reuses the connection"
    else fail "keep-alive after a stream" "not reused: $(grep -E '^[<>*]' "$tmp/curl.err" | head -n 30)"; fi
else fail "keep-alive after a stream" "curl failed: $(tail -n 5 "$tmp/curl.err")"; fi

# --- /metrics after traffic: every contract name is there
if req metrics "$url/metrics"; then
    missing=()
    for m in shoal_requests_running shoal_requests_waiting shoal_requests_finished_total \
        shoal_prompt_tokens_total shoal_generation_tokens_total \
        shoal_time_to_first_token_seconds shoal_time_per_output_token_seconds \
        shoal_e2e_request_latency_seconds shoal_kv_usage_ratio shoal_prefix_cache_hit_ratio \
        shoal_preemptions_total shoal_batch_size; do
        grep -q "^$m" "$tmp/body" || missing+=("$m")
    done
    for h in shoal_time_to_first_token_seconds shoal_e2e_request_latency_seconds shoal_batch_size; do
        grep -q "^${h}_bucket{.*le=\"+Inf\"}" "$tmp/body" || missing+=("${h}_bucket{le=\"+Inf\"}")
        grep -q "^${h}_count" "$tmp/body" || missing+=("${h}_count")
    done
    grep -q '^shoal_requests_finished_total{[^}]*reason="length"' "$tmp/body" ||
        grep -q '^shoal_requests_finished_total{[^}]*reason="stop"' "$tmp/body" ||
        missing+=('shoal_requests_finished_total{reason=...}')
    if [ "$code" = 200 ] && [ ${#missing[@]} -eq 0 ]; then
        ok "GET /metrics has every metric"
    else fail "GET /metrics" "status $code, missing: ${missing[*]}"; fi
fi

stop_server

# --- a server with API keys
if start_server --api-key sekrit-one --api-key sekrit-two:7; then
    if req "no key" -H 'Content-Type: application/json' -d "$cmpl" "$url/v1/completions"; then
        if [ "$code" = 401 ] && json_check "$tmp/body" \
            "isinstance(j['error']['message'], str) and 'type' in j['error'] and 'code' in j['error'] and 'param' in j['error']" \
            >/dev/null; then
            ok "--api-key: no key -> 401"
        else fail "--api-key: no key" "status $code, body $(body)"; fi
    fi
    if req "wrong key" -H 'Authorization: Bearer nope' -H 'Content-Type: application/json' \
        -d "$cmpl" "$url/v1/completions"; then
        if [ "$code" = 401 ]; then ok "--api-key: wrong key -> 401"
        else fail "--api-key: wrong key" "status $code, body $(body)"; fi
    fi
    if req "right key" -H 'Authorization: Bearer sekrit-one' -H 'Content-Type: application/json' \
        -d "$cmpl" "$url/v1/completions"; then
        if [ "$code" = 200 ] && json_check "$tmp/body" "len(j['choices'][0]['text']) > 0" >/dev/null; then
            ok "--api-key: right key -> 200"
        else fail "--api-key: right key" "status $code, body $(body)"; fi
    fi
    if req "second key" -H 'Authorization: Bearer sekrit-two' "$url/v1/models"; then
        if [ "$code" = 200 ]; then ok "--api-key: second key (with priority) -> 200"
        else fail "--api-key: second key" "status $code, body $(body)"; fi
    fi
    stop_server
else
    fail "--api-key server" "did not start"
fi

# --- a server configured by a cluster script (shoal serve -c); --port 0 overrides its port.
# A relative model path would be relative to the script's directory: name the model absolutely.
cfg="$tmp/cluster.lua"
cat >"$cfg" <<EOF
local m = model { path = "$(pwd)/$model", name = "tiny-chat" }
return cluster {
  nodes = { node { name = "local", listen = "inproc://local" } },
  gateway = { node = "local", http = "127.0.0.1:1" },
  replicas = { replica { model = m, stages = pipeline(m, { "local" }) } },
  batcher = { max_step_tokens = 512, max_seqs = 8, max_wait_ms = 5 },
  kv = { block_tokens = 16, prefix_cache = false, memory = "64MiB" },
}
EOF
if start_server_with -c "$cfg" --port 0; then
    # 64 MiB of F16 KV (the default since 3791eac) for this 30-layer model: 182 blocks.
    if grep -q "KV 182 blocks" "$srv_log" && grep -q "prefix cache off" "$srv_log" &&
        grep -q "8 sequences x 512 tokens per step" "$srv_log"; then
        ok "-c cluster.lua: KV budget, prefix cache and batcher settings taken from the script"
    else fail "-c cluster.lua settings" "startup line: $(grep 'shoal: model' "$srv_log")"; fi
    if req "models (-c)" "$url/v1/models" && [ "$code" = 200 ] &&
        json_check "$tmp/body" "j['data'][0]['id'] == 'tiny-chat'" >/dev/null; then
        ok "-c cluster.lua: the model is served under the script's name"
    else fail "-c cluster.lua: /v1/models" "status $code, body $(body)"; fi
    if req "completion (-c)" -H 'Content-Type: application/json' \
        -d '{"model":"tiny-chat","prompt":"Once upon a time","max_tokens":8,"temperature":0,"ignore_eos":true}' \
        "$url/v1/completions" && [ "$code" = 200 ] &&
        json_check "$tmp/body" "j['usage']['completion_tokens'] == 8" >/dev/null; then
        ok "-c cluster.lua: a completion runs"
    else fail "-c cluster.lua: completion" "status $code, body $(body)"; fi
    stop_server
else
    fail "-c cluster.lua server" "did not start"
fi
printf 'return cluster {\n  nodes = 42,\n}\n' >"$tmp/bad.lua"
if "$shoal" serve -c "$tmp/bad.lua" >"$tmp/bad.out" 2>&1; then
    fail "-c with a broken script" "exited 0"
elif grep -q "^error: .*bad.lua" "$tmp/bad.out"; then
    ok "-c with a broken script: one error line naming the script, non-zero exit"
else fail "-c with a broken script" "output: $(head -c 300 "$tmp/bad.out")"; fi

# --- bad command lines: one error line, exit 2, nothing started
for args in "--bogus" "--port" "--port 99999" "--max 3" "-m /nonexistent.gguf" "stray"; do
    # shellcheck disable=SC2086 # the words are the arguments
    "$shoal" serve $args >"$tmp/args.out" 2>&1
    rc=$?
    if [ "$rc" = 2 ] && [ "$(grep -c '^error: ' "$tmp/args.out")" = 1 ]; then
        ok "shoal serve $args: exit 2 with one error line"
    else fail "shoal serve $args" "exit $rc, output: $(head -c 300 "$tmp/args.out")"; fi
done

if [ "$failed" -gt 0 ]; then
    echo
    echo "serve_curl: failures:"
    for f in "${failures[@]}"; do echo "  - ${f%%$'\n'*}"; done
fi
echo "serve_curl: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
