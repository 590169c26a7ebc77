#!/bin/sh
# Runs the fault harness against the installed `shoal` (scripts/check-examples.sh sets
# SHOAL_PREFIX, SHOAL_MODEL and SHOAL_BUILD): bad usage is refused, then 8 requests with 10% of
# the front's messages and 2% of the workers' dropped and 20 ms delays must all end once, with
# the clean run's text. Any other exit of the harness (77 included: the library could not front
# the workers) fails the check.
set -u
: "${SHOAL_PREFIX:?}" "${SHOAL_MODEL:?}" "${SHOAL_BUILD:?}"
h=$SHOAL_BUILD/fault_harness
"$h" -m "$SHOAL_MODEL" >/dev/null 2>&1; rc=$?
[ $rc -eq 2 ] || { echo "fault-harness: no --shoal: exit $rc, not 2"; exit 1; }
"$h" --shoal "$SHOAL_PREFIX/bin/shoal" -m relative.gguf >/dev/null 2>&1; rc=$?
[ $rc -eq 2 ] || { echo "fault-harness: a relative model path: exit $rc, not 2"; exit 1; }
model=$(cd "$(dirname "$SHOAL_MODEL")" && pwd)/$(basename "$SHOAL_MODEL")
exec "$h" --shoal "$SHOAL_PREFIX/bin/shoal" -m "$model" --requests 8 --max-tokens 16 \
    --drop 0.1 --worker-drop 0.02 --delay-ms 20
