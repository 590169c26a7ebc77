#!/usr/bin/env bash
# Builds tests/abi/test_abi.c as C99 (-pedantic -Wall -Wextra -Werror) against the API
# version-1 headers in tests/abi/v1/ only, links it to the libshoal.so just built (not to
# include/, not to libshoal.a) and runs it on the tiny stories260K model.
# Env: SH_LIBSHOAL (the .so), SH_CC, SH_SOURCE_DIR, SH_SAN_FLAGS.
set -uo pipefail
root="${SH_SOURCE_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}"
lib="${SH_LIBSHOAL:?set SH_LIBSHOAL to libshoal.so}"
cc="${SH_CC:-cc}"
model="$root/tests/data/stories260K/stories260K.gguf"
[ -f "$lib" ] || { echo "FAIL: no $lib"; exit 1; }
tmp=$(mktemp -d /tmp/shoal-abi.XXXXXX)
trap 'rm -rf "$tmp"' EXIT

# SH_SAN_FLAGS: a sanitizer build's flags, which a program linking its library needs too.
san=(${SH_SAN_FLAGS:-})
flags=(-std=c99 -pedantic -Wall -Wextra -Werror "${san[@]}" -I "$root/tests/abi/v1")
"$cc" "${flags[@]}" -c "$root/tests/abi/test_abi.c" -o "$tmp/test_abi.o" || {
    echo "FAIL abi: test_abi.c does not compile against tests/abi/v1/"
    exit 1
}
echo "ok   abi: compiles as C99 against the v1 headers"

libdir=$(cd "$(dirname "$lib")" && pwd)
"$cc" "${san[@]}" "$tmp/test_abi.o" -o "$tmp/test_abi" "$lib" -Wl,-rpath,"$libdir" || {
    echo "FAIL abi: test_abi does not link against $lib"
    exit 1
}
resolved=$(ldd "$tmp/test_abi" | awk '/libshoal\.so/ {print $3}')
[ "$(readlink -f "$resolved")" = "$(readlink -f "$lib")" ] || {
    echo "FAIL abi: test_abi loads '$resolved', not $lib"
    exit 1
}
echo "ok   abi: links against $lib"
"$tmp/test_abi" "$model"
