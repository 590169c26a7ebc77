#!/usr/bin/env bash
# Creates (idempotently) the Python virtual environment the `shoal serve` integration tests use,
# at .cache/venv under the repository root, with the official `openai` client in it
# (tests/integration/test_serve_openai.py; the other serve tests are stdlib-only) and the pinned
# packages of tests/reference/requirements.txt (gguf, numpy), which the K-quant test
# tests/unit/test_quant_k_gguf.py and the NumPy reference forward pass use, and jsonschema, with
# which tests/integration/test_serve_grammar.py validates structured output, and kubernetes, whose
# API model classes tests/integration/test_deploy_k8s.py checks generated manifests against.
# Needs python3 with the venv module (Debian: python3-venv, installed by scripts/bootstrap.sh) and
# PyPI reachable by pip. Usage: scripts/test-venv.sh [--quiet]
set -euo pipefail

OPENAI_VERSION=1.109.1 # the last 1.x release; the tests use only its stable 1.x surface

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.cache/venv"
py="$venv/bin/python3"
quiet=0
[ "${1:-}" = "--quiet" ] && quiet=1

say() { [ "$quiet" -eq 1 ] || echo "test-venv: $*"; }
die() {
    echo "test-venv: error: $*" >&2
    exit 1
}

command -v python3 >/dev/null 2>&1 || die "python3 not found (run scripts/bootstrap.sh)"

reqs="$root/tests/reference/requirements.txt"

# Already done? (the venv works and has the pinned client and the pinned reference packages)
if [ -x "$py" ] && "$py" -c "import openai, sys; sys.exit(openai.__version__ != '$OPENAI_VERSION')" \
    2>/dev/null && "$py" - "$reqs" 2>/dev/null <<'PY'; then
import sys
from importlib.metadata import version
pins = [line.split("#")[0].strip() for line in open(sys.argv[1])]
sys.exit(any(version(n) != v for n, v in (p.split("==") for p in pins if p)))
PY
    say "$venv already has openai $OPENAI_VERSION and the packages of $reqs"
    exit 0
fi

# A venv that exists but does not run (python upgraded or removed under it) is rebuilt.
if [ -e "$venv" ] && ! "$py" -c "import sys" 2>/dev/null; then
    say "removing broken venv $venv"
    rm -rf "$venv"
fi

if [ ! -x "$py" ]; then
    python3 -c "import venv, ensurepip" 2>/dev/null ||
        die "python3 lacks the venv/ensurepip modules (Debian: apt-get install python3-venv)"
    say "creating venv $venv with $(python3 --version 2>&1)"
    mkdir -p "$root/.cache"
    python3 -m venv "$venv" || die "python3 -m venv $venv failed"
fi

say "installing openai==$OPENAI_VERSION into $venv"
pipq=()
[ "$quiet" -eq 1 ] && pipq=(-q)
if ! "$py" -m pip install "${pipq[@]}" --disable-pip-version-check --timeout 60 --retries 2 \
    "openai==$OPENAI_VERSION"; then
    die "pip could not install openai==$OPENAI_VERSION: is PyPI reachable (proxy settings)?"
fi

"$py" -c "import openai; print('test-venv: openai', openai.__version__, 'ready')" ||
    die "openai installed but does not import"

say "installing $reqs into $venv"
if ! "$py" -m pip install "${pipq[@]}" --disable-pip-version-check --timeout 60 --retries 2 \
    -r "$reqs"; then
    die "pip could not install $reqs: is PyPI reachable (proxy settings)?"
fi
"$py" -c "import gguf, numpy; print('test-venv: gguf and numpy', numpy.__version__, 'ready')" ||
    die "gguf and numpy installed but do not import"
"$py" -c "import kubernetes, yaml; print('test-venv: kubernetes', kubernetes.__version__, 'ready')" ||
    die "kubernetes installed but does not import"
