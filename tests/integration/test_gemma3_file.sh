#!/usr/bin/env bash
# `shoal` on the real Gemma 3 270M Q4_K_M file: `inspect` exits 0 and shows the gemma3 architecture,
# its 236 tensors and their types (Q5_0, Q8_0, Q4_K, Q6_K); `tokenize` encodes a prompt; `run -n 8`
# continues a prompt (test_gemma3_ref compares the ids with llama.cpp's, test_serve_gemma3 serves
# it); a copy cut short is refused with exactly one `error:` line and exit code 2, never a signal
# or another code. Env: SH_SHOAL (the binary), SH_SOURCE_DIR (repo root).
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

timeout 100 "$shoal" run -m "$model" -p "The capital of France is" -n 8 -t 1 >"$tmp/run.out" \
    2>"$tmp/run.err"
rc=$?
if [ "$rc" -eq 0 ] && grep -q '^The capital of France is .' "$tmp/run.out"; then
    ok "run generates: $(head -c 200 "$tmp/run.out" | tr '\n' ' ')"
else
    fail "run" "exit code $rc, want 0 and the prompt continued: $(head -c 400 "$tmp/run.out" "$tmp/run.err")"
fi
# A file the loader must refuse still ends with one clean line: the same file cut short.
head -c 1000000 "$model" >"$tmp/cut.gguf"
timeout 30 "$shoal" run -m "$tmp/cut.gguf" -p hi -n 1 >"$tmp/cut.out" 2>"$tmp/cut.err"
rc=$?
lines=$(wc -l <"$tmp/cut.err")
if [ "$rc" -eq 2 ] && [ "$lines" -eq 1 ] && grep -q '^error: ' "$tmp/cut.err"; then
    ok "a truncated copy is refused cleanly: $(cat "$tmp/cut.err")"
else
    fail "truncated copy" "exit code $rc, $lines lines: $(head -c 400 "$tmp/cut.err")"
fi

if [ "$failed" -ne 0 ]; then
    echo "gemma3_file: $failed failed"
    exit 1
fi
echo "gemma3_file: all passed"
