#!/usr/bin/env bash
# Builds every example under examples/ that has a build file against an installed Shoal only, then
# runs it: installs BUILD into a temporary prefix (cmake --install), copies each example out of the
# source tree, builds it (a Makefile with pkg-config, a CMakeLists.txt with find_package(Shoal)),
# as C99 with -Wall -Wextra -Werror (C++ sources as C++17), and runs its check.sh. The convention
# an example follows is in examples/README.md. Folders without a build file (the Lua scripts of
# chaos/ and cluster/) are left alone. Exit 0: all built and ran; 1: a failure; 77: built, but the
# default model is missing, so nothing ran.
# Usage: scripts/check-examples.sh [BUILD] [EXAMPLE...]   (EXAMPLE: a folder name under examples/)
# Env: SHOAL_MODEL (default models/smollm2-135m-instruct-q4_1.gguf), CC, CXX,
#      SH_EXAMPLE_TIMEOUT (seconds each check.sh may run; default 120), SH_SAN_FLAGS (set by
#      ctest in a sanitizer build: skip).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-$root/build}" && pwd) || { echo "error: no build folder ${1:-$root/build}" >&2; exit 2; }
shift || true
cc=${CC:-cc}
cxx=${CXX:-c++}
model=${SHOAL_MODEL:-$root/models/smollm2-135m-instruct-q4_1.gguf}
limit=${SH_EXAMPLE_TIMEOUT:-120}
cflags="-std=c99 -O2 -Wall -Wextra -Werror"
cxxflags="-std=c++17 -O2 -Wall -Wextra -Werror"

# A sanitizer build's library needs the sanitizer runtime in every program that loads it; the
# examples are built as users build them, without it.
if [ -n "${SH_SAN_FLAGS:-}" ]; then
    echo "SKIP: $build is a sanitizer build ($SH_SAN_FLAGS): examples are checked on a plain build"
    exit 77
fi

names=("$@")
if [ ${#names[@]} -eq 0 ]; then
    for d in "$root"/examples/*/; do
        d=${d%/}
        [ -f "$d/Makefile" ] || [ -f "$d/CMakeLists.txt" ] && names+=("$(basename "$d")")
    done
fi
[ ${#names[@]} -gt 0 ] || { echo "error: no example with a Makefile or CMakeLists.txt" >&2; exit 2; }

tmp=$(mktemp -d /tmp/shoal-examples.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
failed=0
fail() {
    failed=$((failed + 1))
    echo "FAIL examples: $*"
}
# show LOG: the last lines of a failed step's log.
show() { tail -n 30 "$1" | sed 's/^/    /'; }

# The installed tree, and nothing of the source tree, is what the examples see.
prefix=$tmp/prefix
if ! cmake --install "$build" --prefix "$prefix" >"$tmp/install.log" 2>&1; then
    echo "FAIL examples: cmake --install $build --prefix $prefix"
    show "$tmp/install.log"
    exit 1
fi
pc=$(find "$prefix" -name shoal.pc -path '*/pkgconfig/*' | head -n 1)
[ -n "$pc" ] || { echo "FAIL examples: the install has no pkgconfig/shoal.pc"; exit 1; }
libdir=$(dirname "$(dirname "$pc")")
for f in include/shoal.h include/shoal/err.h include/shoal/version.h bin/shoal; do
    [ -e "$prefix/$f" ] || fail "the install lacks $f"
done
for f in libshoal.so libshoal.a pkgconfig/shoal.pc cmake/Shoal/ShoalConfig.cmake \
    cmake/Shoal/ShoalConfigVersion.cmake; do
    [ -e "$libdir/$f" ] || fail "the install lacks ${libdir#"$prefix"/}/$f"
done
echo "examples: installed into $prefix ($(find "$prefix" -type f | wc -l) files)"
export PKG_CONFIG_PATH=$libdir/pkgconfig
# Found through the prefix alone: no path of the source tree may reach a compiler.
if pkg-config --cflags --libs shoal | grep -qF "$root"; then
    fail "pkg-config --cflags --libs shoal names the source tree: $(pkg-config --cflags --libs shoal)"
fi

ran=0
built=0
for name in "${names[@]}"; do
    src=$root/examples/$name
    [ -d "$src" ] || { fail "$name: no folder examples/$name"; continue; }
    systems=()
    [ -f "$src/Makefile" ] && systems+=(make)
    [ -f "$src/CMakeLists.txt" ] && systems+=(cmake)
    [ ${#systems[@]} -gt 0 ] || { fail "$name: no Makefile or CMakeLists.txt"; continue; }
    [ -f "$src/check.sh" ] || fail "$name: no check.sh"
    for sys in "${systems[@]}"; do
        copy=$tmp/src/$name-$sys
        mkdir -p "$tmp/src"
        cp -a "$src" "$copy"
        log=$tmp/$name-$sys.log
        if [ "$sys" = make ]; then
            bdir=$copy
            make -C "$copy" CC="$cc" CXX="$cxx" CFLAGS="$cflags" CXXFLAGS="$cxxflags" >"$log" 2>&1
        else
            bdir=$tmp/build/$name
            cmake -S "$copy" -B "$bdir" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release \
                -DCMAKE_C_COMPILER="$cc" -DCMAKE_CXX_COMPILER="$cxx" \
                -DCMAKE_C_STANDARD=99 -DCMAKE_C_STANDARD_REQUIRED=ON -DCMAKE_C_EXTENSIONS=OFF \
                -DCMAKE_CXX_STANDARD=17 -DCMAKE_CXX_STANDARD_REQUIRED=ON -DCMAKE_CXX_EXTENSIONS=OFF \
                -DCMAKE_C_FLAGS="-Wall -Wextra -Werror" -DCMAKE_CXX_FLAGS="-Wall -Wextra -Werror" \
                >"$log" 2>&1 && cmake --build "$bdir" --verbose >>"$log" 2>&1
        fi
        rc=$?
        if [ $rc -ne 0 ]; then
            fail "$name: the $sys build failed (exit $rc)"
            show "$log"
            continue
        fi
        if grep -qF -- "-I$root" "$log" || grep -qF -- "-I $root" "$log"; then
            fail "$name: the $sys build used an include path of the source tree"
            continue
        fi
        built=$((built + 1))
        echo "ok   examples: $name builds ($sys)"
        [ -f "$copy/check.sh" ] || continue
        if [ ! -f "$model" ]; then
            echo "skip examples: $name not run: no model at $model (scripts/get-model.sh)"
            continue
        fi
        (cd "$copy" && SHOAL_PREFIX="$prefix" SHOAL_MODEL="$model" SHOAL_BUILD="$bdir" \
            LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
            timeout -k 5 "$limit" bash ./check.sh) >"$tmp/$name-$sys.run" 2>&1
        rc=$?
        if [ $rc -eq 0 ]; then
            ran=$((ran + 1))
            echo "ok   examples: $name runs ($sys): $(tail -n 1 "$tmp/$name-$sys.run")"
        else
            [ $rc -eq 124 ] && rc="$rc, timed out after ${limit}s"
            fail "$name: check.sh failed ($sys build, exit $rc)"
            show "$tmp/$name-$sys.run"
        fi
    done
done

if [ $failed -ne 0 ]; then
    echo "examples: $failed failure(s)"
    exit 1
fi
echo "examples: $built build(s), $ran run(s) passed"
if [ ! -f "$model" ]; then
    echo "SKIP: nothing ran: no model at $model"
    exit 77
fi
