#!/bin/sh
# Runs the edge gateway on six prompts with a threshold of 2, against a one-worker cluster it
# starts itself (`shoal node` from SHOAL_PREFIX/bin, on an ipc:// socket in a temporary folder).
# Every line must be answered, at least one by the cluster, and the program exit 0.
set -eu
: "${SHOAL_PREFIX:?}" "${SHOAL_MODEL:?}" "${SHOAL_BUILD:?}"
tmp=$(mktemp -d /tmp/shoal-edge.XXXXXX)
worker=""
cleanup() {
    if [ -n "$worker" ]; then kill "$worker" 2>/dev/null || true; wait "$worker" 2>/dev/null || true; fi
    rm -rf "$tmp"
}
trap cleanup EXIT
port=$((20000 + $$ % 20000)) # the script needs a gateway address; the embedded front may not listen
model=$(cd "$(dirname "$SHOAL_MODEL")" && pwd)/$(basename "$SHOAL_MODEL")
cat >"$tmp/cluster.lua" <<LUA
local m = model { path = "$model", name = "edge-remote" }
return cluster {
  nodes = {
    node { name = "front", listen = "ipc://$tmp/front.sock" },
    node { name = "w0", listen = "ipc://$tmp/w0.sock" },
  },
  gateway = { node = "front", http = "127.0.0.1:$port" },
  replicas = { replica { model = m, stages = pipeline(m, { "w0" }) } },
  kv = { block_tokens = 16, memory = "64MiB" },
}
LUA
"$SHOAL_PREFIX/bin/shoal" node -c "$tmp/cluster.lua" --name w0 -t 1 >"$tmp/w0.log" 2>&1 &
worker=$!
printf '%s\n' "What is the capital of France?" "Name a colour." "Say hello." \
    "Count to three." "Name a fruit." "What is two plus two?" >"$tmp/in.txt"
"$SHOAL_BUILD/edge_gateway" -m "$SHOAL_MODEL" --cluster "$tmp/cluster.lua" --threshold 2 \
    --max-tokens 12 <"$tmp/in.txt" >"$tmp/out.txt" 2>"$tmp/err.txt" || {
    cat "$tmp/out.txt" "$tmp/err.txt" "$tmp/w0.log"; exit 1; }
cat "$tmp/out.txt" "$tmp/err.txt"
test "$(grep -c "$(printf '\t')" "$tmp/out.txt")" -eq 6
# The fallback must have been open and used: at least one answer came from the cluster.
if grep -q 'remote fallback unavailable' "$tmp/err.txt"; then
    echo "edge-gateway: the cluster fallback was unavailable"; exit 1
fi
grep -q "$(printf '\tremote\t')" "$tmp/out.txt"
tail -n 1 "$tmp/err.txt"
