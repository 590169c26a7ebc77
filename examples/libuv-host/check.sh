#!/bin/sh
# Runs the libuv-host example on two prompts (scripts/check-examples.sh sets SHOAL_MODEL and
# SHOAL_BUILD): both completions must come back and the program exit 0.
set -eu
: "${SHOAL_MODEL:?}" "${SHOAL_BUILD:?}"
out=$(mktemp)
trap 'rm -f "$out"' EXIT
"$SHOAL_BUILD/libuv_host" -m "$SHOAL_MODEL" --max-tokens 12 \
    "The capital of France is" "Once upon a time" >"$out"
cat "$out"
test "$(grep -c '^\[[0-9]*\] (' "$out")" -eq 2
