#!/bin/sh
# Runs the fault harness against the installed `shoal` (scripts/check-examples.sh sets
# SHOAL_PREFIX, SHOAL_MODEL and SHOAL_BUILD): 6 requests, 5% drops, 20 ms delays; exit 0 when
# every check held. The harness exits 77 when the library cannot open an engine on a cluster
# script (not implemented at this commit): then the workers were started and the usage checks
# ran, the fault run could not, and the last line says so plainly.
set -u
: "${SHOAL_PREFIX:?}" "${SHOAL_MODEL:?}" "${SHOAL_BUILD:?}"
h=$SHOAL_BUILD/fault_harness
# Bad usage is refused with exit 2.
"$h" -m "$SHOAL_MODEL" >/dev/null 2>&1; rc=$?
[ $rc -eq 2 ] || { echo "fault-harness: no --shoal: exit $rc, not 2"; exit 1; }
"$h" --shoal "$SHOAL_PREFIX/bin/shoal" -m relative.gguf >/dev/null 2>&1; rc=$?
[ $rc -eq 2 ] || { echo "fault-harness: a relative model path: exit $rc, not 2"; exit 1; }
model=$(cd "$(dirname "$SHOAL_MODEL")" && pwd)/$(basename "$SHOAL_MODEL")
"$h" --shoal "$SHOAL_PREFIX/bin/shoal" -m "$model" --requests 6 --max-tokens 8 --drop 0.05 \
    --delay-ms 20
rc=$?
if [ $rc -eq 77 ]; then
    echo "fault-harness: NOT RUN: this libshoal cannot front worker nodes from an engine yet" \
         "(built, usage checked; no fault run)"
    exit 0
fi
exit $rc
