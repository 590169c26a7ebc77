#!/usr/bin/env bash
# `shoal` on the real Gemma 3 270M Q4_K_M file: `inspect` exits 0 and shows the gemma3 architecture,
# its 236 tensors and their types (Q5_0, Q8_0, Q4_K, Q6_K); `tokenize` encodes a prompt; `run -n 4`
# and `serve` either work or refuse the file with exactly one `error:` line naming the architecture
# or a tensor type and exit code 2 — never a signal or another code. Holds before and after gemma3
# support lands (issue 13). Env: SH_SHOAL (the binary), SH_SOURCE_DIR (repo root).
# Exit 77 when the model is missing (scripts/get-model.sh gemma3-270m).
set -uo pipefail

root="${SH_SOURCE_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}"
cd "$root" || exit 1
model="models/gemma3-270m-q4_k_m.gguf"
shoal="${SH_SHOAL:-build/shoal}"

[ -f "$model" ] || { echo "SKIP: $model missing (scripts/get-model.sh gemma3-270m)"; exit 77; }
[ -x "$shoal" ] || { echo "FAIL: no shoal binary at $shoal (set SH_SHOAL)"; exit 1; }

tmp="$(mktemp -d /tmp/shoal-gemma3.XXXXXX)"
trap 'rm -rf "$tmp"' EXIT
failed=0
ok() { echo "ok   gemma3_file: $1"; }
fail() {
    failed=$((failed + 1))
    echo "FAIL gemma3_file: $1: $2"
}

# has FILE TEXT NAME: checks that FILE contains the fixed string TEXT.
has() {
    if grep -qF -- "$2" "$1"; then ok "$3"; else fail "$3" "no '$2' in: $(head -c 400 "$1")"; fi
}

# clean_refusal NAME RC ERRFILE: a refusal is exit code 2 with exactly one line on stderr, which
# starts with `error:` and names gemma3 or one of the file's tensor types.
clean_refusal() {
    local name="$1" rc="$2" err="$3" lines
    lines=$(wc -l <"$err")
    if [ "$rc" -ne 2 ]; then
        fail "$name" "exit code $rc, want 0 or 2; stderr: $(head -c 400 "$err")"
    elif [ "$lines" -ne 1 ] || ! grep -qE '^error: .*(gemma3|Q5_0|Q8_0|Q4_K|Q6_K)' "$err"; then
        fail "$name" "want one 'error:' line naming gemma3 or a type, got $lines: $(head -c 400 "$err")"
    else
        ok "$name refuses the file cleanly: $(cat "$err")"
    fi
}

"$shoal" inspect "$model" >"$tmp/inspect.out" 2>"$tmp/inspect.err"
rc=$?
if [ "$rc" -eq 0 ]; then ok "inspect exits 0"; else fail "inspect" "exit code $rc: $(head -c 400 "$tmp/inspect.err")"; fi
has "$tmp/inspect.out" '"gemma3"' "inspect shows the architecture"
has "$tmp/inspect.out" 'tensor count  236' "inspect counts 236 tensors"
for t in Q5_0 Q8_0 Q4_K Q6_K; do has "$tmp/inspect.out" "  $t " "inspect lists $t tensors"; done

"$shoal" tokenize -m "$model" -p "hello" >"$tmp/tok.out" 2>"$tmp/tok.err"
rc=$?
if [ "$rc" -eq 0 ] && grep -qE '^2( [0-9]+)+$' "$tmp/tok.out"; then
    ok "tokenize: $(cat "$tmp/tok.out")"
else
    fail "tokenize" "exit code $rc, want BOS 2 then ids: $(head -c 400 "$tmp/tok.out" "$tmp/tok.err")"
fi

timeout 100 "$shoal" run -m "$model" -p "hi" -n 4 -t 1 >"$tmp/run.out" 2>"$tmp/run.err"
rc=$?
if [ "$rc" -eq 0 ]; then
    ok "run generates (gemma3 is supported)"
else
    clean_refusal "run" "$rc" "$tmp/run.err"
    # serve loads the model before it listens, so a refused file ends it at once.
    timeout 30 "$shoal" serve -m "$model" --port 0 >"$tmp/serve.out" 2>"$tmp/serve.err"
    clean_refusal "serve" "$?" "$tmp/serve.err"
fi

if [ "$failed" -ne 0 ]; then
    echo "gemma3_file: $failed failed"
    exit 1
fi
echo "gemma3_file: all passed"
