#!/usr/bin/env bash
# libshoal.so exports the public API and nothing else: every defined dynamic symbol
# (nm -D --defined-only) must be a function that include/shoal.h or include/shoal/*.h declares
# (the list scripts/api-symbols.sh reads from the headers), so an internal sh__ function, a
# misnamed helper or a dependency's symbol leaking out fails. And the other way: every declared
# function must be exported (missing from the .so while libshoal.a has it: a version-script
# fault; missing from both: declared but never implemented). Also checks the SONAME and that the
# library needs no sh_ symbol from elsewhere.
# Env: SH_LIBSHOAL (the .so), SH_LIBSHOAL_A (the .a), SH_SONAME, SH_CC, SH_SOURCE_DIR.
set -uo pipefail
root="${SH_SOURCE_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}"
lib="${SH_LIBSHOAL:?set SH_LIBSHOAL to libshoal.so}"
archive="${SH_LIBSHOAL_A:?set SH_LIBSHOAL_A to libshoal.a}"
[ -f "$lib" ] || { echo "FAIL: no $lib"; exit 1; }
[ -f "$archive" ] || { echo "FAIL: no $archive"; exit 1; }
failed=0
fail() {
    failed=$((failed + 1))
    echo "FAIL lib_symbols: $*"
}

declared=$("$root/scripts/api-symbols.sh" "${SH_CC:-cc}" "$root/include") || {
    echo "FAIL: scripts/api-symbols.sh could not read include/"
    exit 1
}
# Defined dynamic symbols, without their version suffix; the linker's own (_init, _fini, ...)
# are not in a version-scripted library's dynamic table, so everything counts.
exported=$(nm -D --defined-only "$lib" | awk '{print $3}' | sed 's/@.*//' | sort -u)
[ -n "$exported" ] || { echo "FAIL: nm -D lists no symbol in $lib"; exit 1; }
echo "lib_symbols: $(echo "$declared" | wc -l) functions declared in include/, $(echo "$exported" | wc -l) symbols exported"

extra=$(comm -13 <(echo "$declared") <(echo "$exported"))
if [ -n "$extra" ]; then
    fail "exported but not declared in include/ (internal or dependency symbols):" $extra
else
    echo "ok   lib_symbols: every exported symbol is a declared sh_ function"
fi
internal=$(echo "$exported" | grep -E '^sh__' || true)
[ -z "$internal" ] || fail "internal sh__ symbols exported:" $internal

undef=$(nm -D --undefined-only "$lib" | awk '{print $2}' | sed 's/@.*//' | grep -E '^sh_' || true)
[ -z "$undef" ] || fail "libshoal.so needs sh_ symbols it does not define:" $undef

soname=$(readelf -d "$lib" | sed -n 's/.*Library soname: \[\(.*\)\].*/\1/p')
if [ "$soname" = "${SH_SONAME:-libshoal.so.0}" ]; then
    echo "ok   lib_symbols: SONAME $soname"
else
    fail "SONAME is '$soname', expected '${SH_SONAME:-libshoal.so.0}'"
fi

# Declared functions the .so lacks: a fault of the version script when libshoal.a defines them.
in_archive=$(nm --defined-only "$archive" 2>/dev/null | awk 'NF == 3 && $2 ~ /[TW]/ {print $3}' | sort -u)
missing=$(comm -23 <(echo "$declared") <(echo "$exported"))
hidden=$(comm -12 <(echo "$missing") <(echo "$in_archive"))
[ -z "$hidden" ] || fail "defined in libshoal.a but not exported by libshoal.so:" $hidden
unimpl=$(comm -23 <(echo "$missing") <(echo "$in_archive"))
[ -z "$unimpl" ] || fail "declared in include/ but defined nowhere (a program using them does not link):" $unimpl
[ -n "$missing" ] || echo "ok   lib_symbols: every declared function is exported"

if [ $failed -ne 0 ]; then
    echo "lib_symbols: $failed check(s) failed"
    exit 1
fi
echo "lib_symbols: all checks passed"
