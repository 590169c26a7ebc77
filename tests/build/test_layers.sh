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
# Prints each offending include with its file and line; "N passed, N failed" at the end. Also
# checks that replicas are assembled in one place (below).
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
# One replica builder (actors/replica.c, CONVENTIONS.md "Modules"): a kvmgr, batcher or router
# spawned by kind name anywhere else in the library or the program is a second copy of the replica
# assembly. Tests assemble replicas by hand on purpose and are not scanned; the spawn may wrap
# over lines (grep -z reads each file whole).
spawn='sh_actor_spawn\(\s*[^,;()]*,\s*"(kvmgr|batcher|router)"'
copies=$(grep -rlPz --include='*.c' --include='*.h' "$spawn" base kernels model runtime lua net \
  actors api tools examples bench 2>/dev/null | grep -v '^actors/replica\.c$')
if [ -z "$copies" ] && grep -qPz "$spawn" actors/replica.c; then
  echo "ok   kvmgr, batcher and router are spawned only by actors/replica.c"
  pass=$((pass + 1))
else
  for f in $copies; do
    echo "FAIL $f spawns a kvmgr, batcher or router: build replicas with actors/replica.h"
  done
  [ -z "$copies" ] && echo "FAIL actors/replica.c spawns no kvmgr, batcher or router (the check is stale)"
  fail=$((fail + 1))
fi
# `shoal serve` is wiring (issue 25): its flags and keys live in tools/serve_opts.c, the recovery
# in actors/supervisor.c, the replicas in actors/replica.c. A command file that grows back past
# 600 lines is taking a module's work again.
n=$(wc -l < tools/cmd_serve.c)
if [ "$n" -lt 600 ]; then
  echo "ok   tools/cmd_serve.c is $n lines (under 600)"
  pass=$((pass + 1))
else
  echo "FAIL tools/cmd_serve.c is $n lines: move what is not wiring into a module (under 600)"
  fail=$((fail + 1))
fi
echo "$pass passed, $fail failed"
[ $fail = 0 ]
