#!/bin/sh
# Runs a Python test with the venv's interpreter from scripts/test-venv.sh when it exists
# (.cache/venv under the repository root), else with python3. Usage: run_py.sh SCRIPT [ARGS...]
root="${SH_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}"
py="$root/.cache/venv/bin/python3"
export PYTHONDONTWRITEBYTECODE=1
if [ -x "$py" ] && "$py" -c "import sys" 2>/dev/null; then
    exec "$py" "$@"
fi
exec python3 "$@"
