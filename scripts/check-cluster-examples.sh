#!/usr/bin/env bash
# Checks that every script in examples/cluster/ loads and serves, on this machine: each one is
# copied to a temp dir with its model path made absolute, its ipc:// sockets moved into the temp
# dir, its tcp:// addresses moved to loopback (the first distinct host to 127.0.0.1, the second to
# 127.0.0.2, ...) and its ports to free ones; then every worker runs as `shoal node`, the front
# as `shoal serve -c`, and one greedy completion must come back. A script that the build refuses
# because it has several replicas (the router is not built yet) is reported as "needs the
# router", not as a failure. Usage: scripts/check-cluster-examples.sh [BUILD] [SCRIPT...]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
shift || true
shoal=$build/shoal
[ -x "$shoal" ] || { echo "error: $shoal not built" >&2; exit 2; }
scripts=("$@")
[ ${#scripts[@]} -gt 0 ] || scripts=("$root"/examples/cluster/*.lua)
tmp=$(mktemp -d /tmp/shoal-check-ex.XXXXXX)
pids=()
stop_all() {
    local p
    for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
    pids=()
}
trap 'stop_all; rm -rf "$tmp"' EXIT
trap 'exit 130' INT TERM

failed=0
port=18700
for src in "${scripts[@]}"; do
    name=$(basename "$src" .lua)
    dir=$(cd "$(dirname "$src")" && pwd)
    work=$tmp/$name
    mkdir -p "$work"
    port=$((port + 10))
    # Rewrite: model path absolute, sockets into $work, tcp hosts to loopback, ports to free ones.
    python3 - "$src" "$work/$name.lua" "$dir" "$work" "$port" <<'EOF'
import os, re, sys
src, dst, d, work, port = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
s = open(src).read()
s = re.sub(r'path = "(\.[^"]*)"', lambda m: 'path = "%s"' % os.path.normpath(os.path.join(d, m.group(1))), s)
s = re.sub(r'ipc:///tmp/([^"]+)', lambda m: "ipc://%s/%s" % (work, m.group(1).replace("/", "_")), s)
hosts = {}
def host(h):
    hosts.setdefault(h, "127.0.0.%d" % (len(hosts) + 1))
    return '"%s"' % hosts[h]
# local X = "10.0.0.1" address variables, and literal tcp://host:port URLs
s = re.sub(r'(local \w+ = )"(\d+\.\d+\.\d+\.\d+)"', lambda m: m.group(1) + host(m.group(2)), s)
s = re.sub(r'tcp://(\d+\.\d+\.\d+\.\d+):', lambda m: "tcp://%s:" % host(m.group(1)).strip('"'), s)
n = [0]
def newport(m):
    n[0] += 1
    return ":%d%s" % (port + n[0], m.group(1))
s = re.sub(r':7\d\d\d(["\s])', newport, s)
s = re.sub(r'http = "127\.0\.0\.1:\d+"', 'http = "127.0.0.1:%d"' % port, s)
open(dst, "w").write(s)
EOF
    script=$work/$name.lua
    # Node names in script order; the gateway's node is the front.
    nodes=$(grep -o 'node { name = "[^"]*"' "$script" | sed 's/.*"\(.*\)"/\1/')
    front=$(sed -n 's/.*gateway = { node = "\([^"]*\)".*/\1/p' "$script")
    rc=0
    for n in $nodes; do
        [ "$n" = "$front" ] && continue
        "$shoal" node -c "$script" --name "$n" -t 1 --log-level warn >"$work/$n.log" 2>&1 &
        pids+=("$!")
    done
    "$shoal" serve -c "$script" --log-level warn --join-timeout 60 >"$work/front.log" 2>&1 &
    fpid=$!
    pids+=("$fpid")
    up=0
    for _ in $(seq 1 900); do
        grep -q "listening on" "$work/front.log" && { up=1; break; }
        kill -0 "$fpid" 2>/dev/null || break
        sleep 0.1
    done
    if [ "$up" = 1 ]; then
        out=$(curl -s --max-time 120 "http://127.0.0.1:$port/v1/completions" \
            -d '{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}')
        if grep -q '"finish_reason"' <<<"$out"; then
            echo "ok: $name serves ($(grep -o '"text":"[^"]*"' <<<"$out"))"
        else
            echo "FAIL: $name: the completion failed: $out"
            rc=1
        fi
    elif grep -qh "several replicas (the router) is not implemented" "$work"/*.log; then
        echo "needs the router: $name loads, and this build refuses several replicas"
    else
        echo "FAIL: $name did not start:"
        tail -n 5 "$work"/*.log
        rc=1
    fi
    stop_all
    [ "$rc" = 0 ] || failed=1
done
exit "$failed"
