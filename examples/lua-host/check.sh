#!/bin/sh
# Runs host.lua with the system lua5.4 and the module installed under SHOAL_PREFIX
# (lib/lua/5.4/shoal.so; scripts/check-examples.sh sets SHOAL_PREFIX and SHOAL_MODEL).
set -eu
: "${SHOAL_PREFIX:?}" "${SHOAL_MODEL:?}"
here=$(cd "$(dirname "$0")" && pwd)
if ! command -v lua5.4 >/dev/null 2>&1; then
    echo "lua-host: lua5.4 is not installed (scripts/bootstrap.sh installs it)" >&2
    exit 1
fi
mod=$(find "$SHOAL_PREFIX" -path '*/lua/5.4/shoal.so' | head -n 1)
if [ -z "$mod" ]; then
    echo "lua-host: no lua/5.4/shoal.so under $SHOAL_PREFIX" >&2
    exit 1
fi
LUA_CPATH="$(dirname "$mod")/?.so;;" lua5.4 "$here/host.lua" "$SHOAL_MODEL"
