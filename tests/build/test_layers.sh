#!/usr/bin/env bash
# The layering rule of docs/ARCHITECTURE.md, checked on every #include "..." of the tree:
#   base/     errors, file mapping, dtypes; includes nothing of ours but the public shoal/ headers
#   kernels/  knows base/ only (no model, no runtime)
#   model/    knows base/ and kernels/ (no runtime, no actors, no Lua)
#   runtime/  knows base/ (no model, no kernels, no Lua: the runtime knows no LLM)
#   lua/      knows base/ and the public shoal/ headers
#   net/      the HTTP server, the OpenAI codec, the status page: knows base/ only
#   actors/   the actor kinds: every layer above (base, runtime, model, kernels, lua, net), never
#             api/ or tools/
#   api/      knows every layer above but tools/ (the shoal program uses api/, not the reverse)
#   tools/    sits on top and may include any layer; nothing below includes it.
# Prints each offending include with its file and line; "N passed, N failed" at the end.
set -u
src=${SH_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
cd "$src" || exit 1
allowed() { # DIR -> the top folders its files may include (besides their own and shoal/)
  case $1 in
  base) echo "" ;;
  kernels) echo "base" ;;
  model) echo "base kernels" ;;
  runtime) echo "base" ;;
  lua) echo "base" ;;
  net) echo "base" ;;
  actors) echo "base kernels model runtime lua net" ;;
  api) echo "base kernels model runtime lua net actors api" ;;
  *) echo "*" ;;
  esac
}
pass=0 fail=0
for dir in base kernels model runtime lua net actors api; do
  ok=$(allowed $dir)
  bad=0
  while IFS=: read -r file line inc; do
    top=${inc%%/*}
    [ "$top" = "$inc" ] && continue # a same-folder include without a path
    case " $dir shoal $ok " in *" $top "*) continue ;; esac
    echo "FAIL $file:$line includes \"$inc\": $dir/ may include only $dir/ shoal/ $(printf '%s/ ' $ok)"
    bad=1
  done < <(grep -rn --include='*.c' --include='*.h' --include='*.cu' -E '^[[:space:]]*#[[:space:]]*include[[:space:]]+"' "$dir" 2>/dev/null |
    sed -E 's/^([^:]*):([0-9]*):.*#[[:space:]]*include[[:space:]]+"([^"]*)".*/\1:\2:\3/')
  if [ $bad = 0 ]; then
    echo "ok   $dir/ includes only what its layer may"
    pass=$((pass + 1))
  else
    fail=$((fail + 1))
  fi
done
echo "$pass passed, $fail failed"
[ $fail = 0 ]
