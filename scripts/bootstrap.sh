#!/usr/bin/env bash
# Installs the Debian packages Shoal builds and tests with. Idempotent: it installs only what is
# missing and says what it does. Usage: scripts/bootstrap.sh [--quiet]
set -euo pipefail

# Build and runtime libraries, the toolchain, Python for the model fetch, clang for the fuzzers,
# headless Chromium for the status page's browser test (tests/integration/test_status_page.py),
# the lua5.4 interpreter for the Lua module's test (api/lua/) and examples/lua-host/, Slurm's
# daemons and clients for examples/deploy/slurm/'s test (tests/integration/test_deploy_slurm.py,
# which configures its own one-machine cluster; nothing is started at install).
packages=(
    build-essential cmake pkg-config git ca-certificates openssl
    libuv1-dev libnng-dev libmbedtls-dev libmsgpack-dev liblua5.4-dev lua5.4 libpcre2-dev
    libjansson-dev libhttp-parser-dev curl iproute2
    python3 python3-pip python3-venv
    clang libclang-rt-14-dev clang-format
    chromium
    slurm-wlm
)

missing=()
for p in "${packages[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$p")
    fi
done

if [ ${#missing[@]} -eq 0 ]; then
    echo "bootstrap: all ${#packages[@]} packages present"
    exit 0
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        sudo="sudo"
    else
        echo "bootstrap: error: need root (or sudo) to install: ${missing[*]}" >&2
        exit 1
    fi
fi

echo "bootstrap: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q
$sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
echo "bootstrap: done"
