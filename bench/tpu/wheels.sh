#!/usr/bin/env bash
# The wheels the TPU machine needs that its own package index lacks (or holds too old), fetched HERE
# into .whl-tpu/ at the repository root (ignored by git), for `carry` to take along; installed there
# by bench/tpu/install.sh. Idempotent: a wheel already present is not fetched again, a stale one
# (another version) is removed. Needs the package registry; runs with any python3 that has pip.
#
# The device: Python 3.11.7, glibc 2.36, x86_64, no network; JAX 0.10.2 + jaxlib + libtpu + numpy +
# scipy preinstalled; the rest from its index (bench/tpu/requirements-index.txt). What the code that
# runs there imports (loraflow.steps.convert_checkpoint and lora_sft: MaxText's to_maxtext, pyconfig
# and SFT trainer, Tunix, qwix, grain, Orbax) and the index does not hold is listed here, at the
# versions of envs/trainer.lock, except:
#   tokamax 0.0.12 (lock: 0.0.17): 0.0.13 and later declare Python >= 3.12 and all but 0.0.15 need
#     jax >= 0.11; 0.0.13-0.0.17 also pull in xprof (+ fire). MaxText imports tokamax at module level
#     (MoE, GPU/tokamax-splash attention) but the dense Llama path never calls it.
#   typeguard 2.13.3: tokamax 0.0.12 pins it (the index has 4.x).
#   omegaconf 2.4.0 (the lock's) replaces the index's 2.3.1, which needs antlr4-python3-runtime
#     4.9.x, an sdist only; 2.4.0 vendors its own antlr4 runtime.
# Not carried (MaxText stubs them when missing, or nothing on this path imports them): chex,
# google-cloud-* (storage, logging, monitoring, aiplatform), ml-goodput-measurement,
# cloud-accelerator-diagnostics, google-cloud-mldiagnostics, xprof, tensorflow-datasets.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DEST="$REPO/.whl-tpu"
LOCK="$REPO/envs/trainer.lock"
PY="${PYTHON:-python3}"
MAX_MB="${WHEELS_MAX_MB:-30}"

# name, or name=version where the lock's version is not the one to take (see above)
PACKAGES=(
    maxtext
    google-tunix
    qwix
    grain
    array-record
    portpicker
    orbax-checkpoint
    omegaconf
    tokamax=0.0.12
    typeguard=2.13.3
    einshape
    google-metrax
    clu
    pathwaysutils
    perfetto
    drjax
    aqtp
)

# manylinux tags the device's glibc (2.36) accepts; pip matches each tag exactly
PLATFORMS=(manylinux1_x86_64 manylinux2010_x86_64 manylinux2014_x86_64)
for n in 17 24 26 27 28 31 34 35 36; do PLATFORMS+=("manylinux_2_${n}_x86_64"); done
PLATFORM_ARGS=()
for p in "${PLATFORMS[@]}"; do PLATFORM_ARGS+=(--platform "$p"); done

lock_version() {  # the version pinned in envs/trainer.lock, or nothing
    local want
    want="$(echo "$1" | tr 'A-Z_.' 'a-z--')"
    sed -nE 's/^([A-Za-z0-9._-]+)==([^ ;]+).*/\1 \2/p' "$LOCK" | while read -r name version; do
        if [ "$(echo "$name" | tr 'A-Z_.' 'a-z--')" = "$want" ]; then echo "$version"; break; fi
    done
}

mkdir -p "$DEST"
wanted=()
for entry in "${PACKAGES[@]}"; do
    name="${entry%%=*}"
    if [ "$entry" != "$name" ]; then version="${entry#*=}"; else version="$(lock_version "$name")"; fi
    if [ -z "$version" ]; then echo "wheels.sh: $name is not in $LOCK and has no version here" >&2; exit 1; fi
    stem="$(echo "$name" | tr 'A-Z.-' 'a-z__')-${version}-"
    wanted+=("$stem")
    # a wheel of another version of the same project: stale, removed (two versions stop the install)
    for old in "$DEST"/*.whl; do
        [ -e "$old" ] || continue
        base="$(basename "$old")"
        if [ "${base%%-*}" = "$(echo "$name" | tr 'A-Z.-' 'a-z__')" ] && [[ "$base" != "$stem"* ]]; then
            echo "wheels.sh: removing stale $base"; rm -f "$old"
        fi
    done
    if compgen -G "$DEST/${stem}*.whl" >/dev/null; then
        echo "wheels.sh: have $(basename "$(compgen -G "$DEST/${stem}*.whl" | head -1)")"
        continue
    fi
    echo "wheels.sh: fetching $name==$version"
    # --ignore-requires-python: maxtext 0.2.5 declares Python >= 3.12 (install.sh makes it run on 3.11)
    "$PY" -m pip download -q --no-deps --only-binary=:all: --ignore-requires-python \
        --python-version 3.11 --implementation cp --abi cp311 --abi abi3 --abi none "${PLATFORM_ARGS[@]}" \
        -d "$DEST" "$name==$version"
    if ! compgen -G "$DEST/${stem}*.whl" >/dev/null; then
        echo "wheels.sh: pip fetched no wheel named ${stem}*.whl for $name==$version" >&2; exit 1
    fi
done

# nothing else in .whl-tpu: a leftover wheel would be installed too
for whl in "$DEST"/*; do
    base="$(basename "$whl")"
    keep=0
    for stem in "${wanted[@]}"; do [[ "$base" == "$stem"* ]] && keep=1; done
    if [ "$keep" = 0 ]; then echo "wheels.sh: removing $base (not in the list)"; rm -rf "$whl"; fi
done

# each wheel must be for CPython 3.11 or pure, and for a glibc the device has
for whl in "$DEST"/*.whl; do
    tags="$(basename "$whl" .whl | cut -d- -f3-)"
    case "$tags" in
        py3-none-any | py2.py3-none-any | cp311-cp311-manylinux* | cp311-abi3-manylinux*) ;;
        *) echo "wheels.sh: $(basename "$whl") is not a wheel the device's Python 3.11 can take" >&2; exit 1 ;;
    esac
done

total_kb="$(du -sk "$DEST" | cut -f1)"
echo "wheels.sh: ${#wanted[@]} wheels in $DEST, $((total_kb / 1024)) MiB"
if [ "$total_kb" -gt $((MAX_MB * 1024)) ]; then
    echo "wheels.sh: more than ${MAX_MB} MiB: the working tree that travels is limited to 64 MiB" >&2
    exit 1
fi
