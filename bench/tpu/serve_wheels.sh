#!/usr/bin/env bash
# Fetches the wheels bench/tpu/serve-wheels.txt lists into .whl-tpu-serve/ (git-ignored), for the
# TPU machine's Python 3.11 (CPython 3.11 or pure wheels, manylinux x86_64 for its glibc 2.36):
# what vLLM's TPU backend needs there beyond the machine's own package index. Run here, once:
#
#   bash bench/tpu/serve_wheels.sh
#
# and name .whl-tpu-serve in the device call's carry (bench/tpu/README.md, "Serving").
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DEST="$REPO/.whl-tpu-serve"
LIST="$REPO/bench/tpu/serve-wheels.txt"
PY="${PYTHON:-python3}"

PLATFORM_ARGS=()
for p in manylinux1_x86_64 manylinux2010_x86_64 manylinux2014_x86_64; do PLATFORM_ARGS+=(--platform "$p"); done
for n in 5 17 24 26 27 28 31 34 35 36; do PLATFORM_ARGS+=(--platform "manylinux_2_${n}_x86_64"); done

mapfile -t PINS < <(grep -E '^[A-Za-z0-9]' "$LIST")
mkdir -p "$DEST"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
    --abi cp311 --abi abi3 --abi none "${PLATFORM_ARGS[@]}" -d "$DEST" "${PINS[@]}"

# exactly one wheel per pin, for a Python the device has; nothing else (a leftover would be installed too)
stems=()
for pin in "${PINS[@]}"; do
    stem="$(echo "${pin%%==*}" | tr 'A-Z.-' 'a-z__')-${pin#*==}-"
    stems+=("$stem")
    found=("$DEST"/"$stem"*.whl)
    [ -e "${found[0]}" ] || { echo "serve_wheels.sh: no wheel ${stem}*.whl for $pin" >&2; exit 1; }
done
for whl in "$DEST"/*; do
    base="$(basename "$whl")"
    keep=0
    for stem in "${stems[@]}"; do [[ "${base,,}" == "$stem"* ]] && keep=1; done
    [ "$keep" = 1 ] || { echo "serve_wheels.sh: removing $base (not listed)"; rm -rf "$whl"; continue; }
    case "$(basename "$whl" .whl | cut -d- -f3-)" in
        py3-none-any | py2.py3-none-any | py37-none-any | cp311-cp311-manylinux* | cp3*-abi3-manylinux*) ;;
        *) echo "serve_wheels.sh: $base is not for the device's Python 3.11" >&2; exit 1 ;;
    esac
done
echo "serve_wheels.sh: ${#PINS[@]} wheels in $DEST, $(du -sm "$DEST" | cut -f1) MiB"
