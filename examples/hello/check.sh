#!/usr/bin/env bash
# Runs hello as scripts/check-examples.sh builds it (examples/README.md): the version it prints
# must be the installed shoal program's, and on the default model it must name the model's
# architecture and layer count as `shoal inspect` reads them. Then links hello statically against
# libshoal.a with `pkg-config --static` (Libs.private and Requires.private must be complete) and
# runs that too.
set -euo pipefail
want=$("$SHOAL_PREFIX/bin/shoal" --version)   # "shoal X.Y.Z"
out=$("$SHOAL_BUILD/hello" "$SHOAL_MODEL")
echo "$out"
case "$(echo "$out" | head -n 1)" in
"$want "*) ;;
*) echo "hello printed '$out', the installed shoal says '$want'" >&2; exit 1 ;;
esac
# The model line against the file's own metadata, as shoal inspect shows it.
meta=$("$SHOAL_PREFIX/bin/shoal" inspect "$SHOAL_MODEL" --no-tensors)
arch=$(echo "$meta" | sed -n 's/.*general\.architecture[^"]*"\([^"]*\)".*/\1/p' | head -n 1)
layers=$(echo "$meta" | sed -n "s/.*$arch\.block_count.* \([0-9]\+\) *$/\1/p" | head -n 1)
[ -n "$arch" ] && [ -n "$layers" ] || { echo "shoal inspect shows no architecture or block_count" >&2; exit 1; }
echo "$out" | grep -q "^model .*: $arch, .*, $layers layers," ||
    { echo "hello's model line does not say $arch with $layers layers" >&2; exit 1; }

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
static_out=$("$tmp/hello-static" "$SHOAL_MODEL")
[ "$static_out" = "$out" ] || { echo "static hello printed '$static_out'" >&2; exit 1; }
echo "hello: shared and static builds print the same version and model ($arch, $layers layers)"
