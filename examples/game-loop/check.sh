#!/bin/sh
# Runs the game-loop example briefly (scripts/check-examples.sh calls it with SHOAL_PREFIX,
# SHOAL_MODEL and SHOAL_BUILD set): the C99 program generating, the C++17 one without.
set -eu
: "${SHOAL_MODEL:?}" "${SHOAL_BUILD:?}"
out=$(mktemp)
trap 'rm -f "$out"' EXIT
"$SHOAL_BUILD/game_loop" -m "$SHOAL_MODEL" --seconds 3 --threads 1 --max-tokens 16 --min-lines 1 >"$out"
cat "$out"
grep -q '^overrun_p99_ms ' "$out"
grep -q '^npc line ' "$out" # at least one NPC line came back
"$SHOAL_BUILD/game_loop_cxx" -m "$SHOAL_MODEL" --seconds 1 --no-generate >"$out"
cat "$out"
grep -q '^overrun_p99_ms ' "$out"
