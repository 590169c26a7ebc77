#!/usr/bin/env bash
# Writes the small seeded synthetic models of each architecture (shoal mkmodel, F16 matrices)
# and their NumPy reference (ids, top-8 logits, last-position logits, MoE routing) into
# tests/data/golden/. Usage: make_golden_synth.sh SHOAL_BINARY [NAME...] (default: all).
# OUT=dir TYPE=F32 write elsewhere / another type (to check a copy against llama.cpp).
set -euo pipefail
shoal=$(realpath "${1:?usage: make_golden_synth.sh path/to/shoal [name...]}")
shift
cd "$(dirname "$0")/../.."
py=${PYTHON:-.cache/venv/bin/python3}
out=${OUT:-tests/data/golden}
type=${TYPE:-F16}
suffix=$(echo "$type" | tr 'A-Z' 'a-z')
# Common small dimensions: 2 layers (gemma3: 3), dim 64, 4 query heads on 2 KV heads, a
# 300-token generated vocabulary, untied head (a tied random head mostly repeats the input
# token), weights of deviation 0.3 so logits and routing are decisive.
small="--layers 2 --dim 64 --ffn 128 --heads 4 --kv-heads 2 --vocab 300 --ctx 256 --seed 7 \
--std 0.3 --untied --type $type"
declare -A args=(
  # 256-wide heads scaled down: head dim 32 (queries 128 wide on a 64-wide model); layers 0
  # and 2 local (8-token window, rope base 10000), layer 1 global (base 1e6); soft-capping 30.
  [gemma3-tiny]="--shape gemma3-270m $small --layers 3 --head-dim 32 --sliding-window 8 \
--swa-pattern 2 --rope-base-swa 10000 --softcap 30"
  [qwen3-tiny]="--shape qwen3-0.6b $small --head-dim 32"
  [qwen3moe-tiny]="--shape qwen3moe-tiny $small --head-dim 32 --experts 8 --experts-used 2 \
--expert-ffn 32"
  [mixtral-tiny]="--shape mixtral-tiny $small --experts 4 --experts-used 2 --ffn 64"
  # Q/K/V biases, 8 experts of width 32 (2 per token, not renormalised), a shared expert of
  # width 96 behind its sigmoid gate.
  [qwen2moe-tiny]="--shape qwen2moe-tiny $small --experts 8 --experts-used 2 --expert-ffn 32 \
--shared-ffn 96"
  [phi3-tiny]="--shape phi3-mini $small"
  # one RMSNorm over all of Q / all of K (so no grouped-query attention), 8 experts of width 64,
  # 2 per token, not renormalised
  [olmoe-tiny]="--shape olmoe-tiny $small --kv-heads 4 --ffn 64 --experts 8 --experts-used 2"
  # RoPE scaling (tests/golden/test_llama_rope.c): linear, YaRN over an original context of 64,
  # Llama 3's rope_freqs (base 500000, factor 8, original context 64: the 8 frequencies are kept,
  # blended and divided), Phi-3 long rope with an original context of 4096 (a 256-token context
  # uses the short factors) and of 128 (it uses the long ones: the reference's --long-rope).
  [llama-linear-tiny]="--shape smollm2-135m $small --rope-scaling linear --rope-factor 4"
  [llama-yarn-tiny]="--shape smollm2-135m $small --rope-scaling yarn --rope-factor 4 \
--rope-orig-ctx 64"
  [llama3rope-tiny]="--shape llama3.2-1b $small --rope-scaling llama3 --rope-factor 8 \
--rope-orig-ctx 64"
  [phi3-longrope-tiny]="--shape phi3-mini $small --rope-scaling longrope --rope-factor 4"
  [phi3-longrope128-tiny]="--shape phi3-mini $small --rope-scaling longrope --rope-factor 4 \
--rope-orig-ctx 128"
)
declare -A ref_args=([phi3-longrope128-tiny]="--long-rope")
names=("$@")
[ ${#names[@]} -gt 0 ] || names=(gemma3-tiny qwen3-tiny qwen3moe-tiny mixtral-tiny qwen2moe-tiny
  phi3-tiny olmoe-tiny llama-linear-tiny llama-yarn-tiny llama3rope-tiny phi3-longrope-tiny
  phi3-longrope128-tiny)
for n in "${names[@]}"; do
  [ -n "${args[$n]:-}" ] || { echo "error: unknown model $n" >&2; exit 2; }
  # shellcheck disable=SC2086
  "$shoal" mkmodel ${args[$n]} -o "$out/$n-$suffix.gguf"
  # shellcheck disable=SC2086
  "$py" tests/reference/ref_forward.py "$out/$n-$suffix.gguf" ${ref_args[$n]:-} \
    --golden "$out/$n-$suffix" -n 24 --topk 8 \
    --prompt a "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20" --prompt b "100"
done
