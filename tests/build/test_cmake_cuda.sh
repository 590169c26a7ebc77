#!/usr/bin/env bash
# Configure must never fail because of an optional GPU toolkit: with CMake's own FindCUDAToolkit
# as Debian ships it (unpatched; with CUDA 13 it stops on "set_property could not find TARGET
# CUDA::nvToolsExt"), a configure that did not ask for SH_CUDA succeeds with CUDA off and one
# warning, and -DSH_CUDA=ON still fails. Runs two real configures of this tree in fresh build
# folders. Skips (77) without nvcc.
set -u
src=${SH_SOURCE_DIR:?}
nvcc=$(command -v nvcc || true)
[ -z "$nvcc" ] && [ -x /usr/local/cuda/bin/nvcc ] && nvcc=/usr/local/cuda/bin/nvcc
if [ -z "$nvcc" ]; then
  echo "SKIP: no nvcc"
  exit 77
fi
ver=$(cmake --version | sed -n 's/^cmake version \([0-9]*\.[0-9]*\).*/\1/p')
mods=$(cmake --system-information 2>/dev/null | sed -n 's/^CMAKE_ROOT "\(.*\)"$/\1/p')/Modules
[ -f "$mods/FindCUDAToolkit.cmake" ] || mods=/usr/share/cmake-$ver/Modules
if [ ! -f "$mods/FindCUDAToolkit.cmake" ]; then
  echo "SKIP: CMake's FindCUDAToolkit.cmake not found"
  exit 77
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# Debian's module: the machines here carry one patched to guard the nvToolsExt property with
# `if(TARGET CUDA::nvToolsExt AND ...)`; removing that guard gives back the packaged text.
cp -r "$mods" "$tmp/modules"
sed -i 's/if(TARGET CUDA::nvToolsExt AND CMAKE_MINIMUM/if(CMAKE_MINIMUM/' \
  "$tmp/modules/FindCUDAToolkit.cmake"
fail=0 pass=0
check() { # NAME CONDITION-RESULT DETAIL
  if [ "$2" = 0 ]; then
    echo "ok   $1"
    pass=$((pass + 1))
  else
    echo "FAIL $1: $3"
    fail=$((fail + 1))
  fi
}

cmake -S "$src" -B "$tmp/auto" -DCMAKE_MODULE_PATH="$tmp/modules" >"$tmp/auto.log" 2>&1
rc=$?
check "auto configure succeeds with the unpatched module" $([ $rc = 0 ]; echo $?) \
  "exit $rc: $(grep -m1 -A2 'CMake Error' "$tmp/auto.log")"
if grep -q 'nvToolsExt' "$tmp/modules/FindCUDAToolkit.cmake" &&
  ! ls /usr/local/cuda/lib64/libnvToolsExt* >/dev/null 2>&1; then
  # This toolkit has no nvToolsExt library, so the probe must have failed: CUDA off, one warning.
  val=$(sed -n 's/^SH_CUDA:BOOL=//p' "$tmp/auto/CMakeCache.txt" 2>/dev/null)
  check "SH_CUDA turned off" $([ "$val" = OFF ]; echo $?) "SH_CUDA=$val"
  n=$(grep -c 'SH_CUDA: the CUDA toolkit' "$tmp/auto.log")
  check "one warning names the cause" \
    $([ "$n" = 1 ] && grep -A3 'SH_CUDA: the CUDA' "$tmp/auto.log" | grep -q nvToolsExt; echo $?) \
    "$n warnings: $(grep -A4 'CMake Warning' "$tmp/auto.log")"
fi

cmake -S "$src" -B "$tmp/on" -DSH_CUDA=ON -DCMAKE_MODULE_PATH="$tmp/modules" >"$tmp/on.log" 2>&1
rc=$?
if [ -f "$tmp/auto/CMakeCache.txt" ] && grep -q '^SH_CUDA:BOOL=ON' "$tmp/auto/CMakeCache.txt"; then
  check "-DSH_CUDA=ON configures where the probe passed" $([ $rc = 0 ]; echo $?) "exit $rc"
else
  check "-DSH_CUDA=ON stays an error" $([ $rc != 0 ]; echo $?) "exit $rc"
fi
echo "$pass passed, $fail failed"
[ $fail = 0 ]
