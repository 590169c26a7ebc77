#!/usr/bin/env bash
# Runs hello as scripts/check-examples.sh builds it (examples/README.md): the version it prints
# must be the installed shoal program's. Then links hello statically against libshoal.a with
# `pkg-config --static` (Libs.private and Requires.private must be complete) and runs that too.
set -euo pipefail
want=$("$SHOAL_PREFIX/bin/shoal" --version)   # "shoal X.Y.Z"
out=$("$SHOAL_BUILD/hello")
echo "$out"
case "$out" in
"$want "*) ;;
*) echo "hello printed '$out', the installed shoal says '$want'" >&2; exit 1 ;;
esac

# Static: libshoal.a in place of -lshoal, the dependencies from the .pc file.
libdir=$(pkg-config --variable=libdir shoal)
libs=$(pkg-config --static --libs shoal)
libs=${libs/-lshoal/$libdir/libshoal.a}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
${CC:-cc} -std=c99 -Wall -Wextra -Werror $(pkg-config --cflags shoal) hello.c -o "$tmp/hello-static" $libs
if readelf -d "$tmp/hello-static" | grep -q 'libshoal\.so'; then
    echo "hello-static needs libshoal.so" >&2
    exit 1
fi
static_out=$("$tmp/hello-static")
[ "$static_out" = "$out" ] || { echo "static hello printed '$static_out'" >&2; exit 1; }
echo "hello: shared and static builds print $want"
