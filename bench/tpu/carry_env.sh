#!/usr/bin/env bash
# Runs the chip on the trainer environment's own versions (Python 3.12, JAX 0.12.0.1, libtpu 0.0.52:
# what `loraflow plan --fit` and the trainer image use) instead of the TPU machine's preinstalled
# Python 3.11 / JAX 0.10.2 / libtpu 0.0.42.1. JAX >= 0.11 needs Python >= 3.12, which the machine lacks,
# so the interpreter travels too.
#
#   here:        bash bench/tpu/carry_env.sh pack      # -> .tpu-env/meta + .tpu-env/part-NN (58 MiB each)
#   the machine: bash bench/tpu/carry_env.sh unpack    # one call per part, back to back on one warm machine
#
# pack: the interpreter of .venvs/trainer (its stdlib without tests, idle, tk and the static library) and
#   the packages of .venvs/trainer's site-packages that the trainer steps can import (everything except a
#   list of large packages nothing on the training path imports: EXCLUDE below, checked by tracing the
#   imports of `check.py tiny`), compiled to bytecode, as one zstd-compressed tar split into parts that fit
#   one device call's carry (64 MiB), with their checksums and a zstd binary in .tpu-env/meta.
# unpack: moves each carried part out of the way (to $PARTS), says which parts are still missing (exit 3),
#   and once all are there and their checksums match, unpacks the environment into $ENV_DIR (exit 0).
# run ARGS...: runs the unpacked interpreter with ARGS, e.g. `bash bench/tpu/carry_env.sh run
#   bench/tpu/check.py memory --cases 0,1,2,3 --out $OUT`, without the machine's PYTHONPATH (which holds
#   its own JAX, for its own Python) and TPU_LIBRARY_PATH (its own libtpu), so nothing shadows the carried.
#
# Environment: TRAINER_VENV (.venvs/trainer), ENV_DIR (/tmp/tpu-env), PARTS (/tmp/tpu-env-parts).
set -uo pipefail

fail() { echo "carry_env.sh: FAILED: $*" >&2; exit 1; }
say() { echo "carry_env.sh: $*"; }

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)" || fail "cannot find the repository root"
cd "$REPO" || fail "cannot cd to $REPO"
OUTDIR=.tpu-env
PART_BYTES=$((58 * 1024 * 1024))  # the working tree (about 5 MB) travels with each call and counts against its 64 MiB
ENV_DIR="${ENV_DIR:-/tmp/tpu-env}"
PARTS="${PARTS:-/tmp/tpu-env-parts}"

# Large packages of the trainer environment that neither convert_checkpoint nor lora_sft (nor MaxText,
# Tunix or JAX beneath them) imports: linters, notebook and plotting tools, other compilers.
EXCLUDE=(llvmlite numba googleapiclient _duckdb.abi3.so duckdb clang pytype nvidia tensorboard_plugin_profile
    tensorflow_datasets tensorboard_data_server keras h5py h5py.libs libcst hf_transfer hf_xet Cryptodome nltk
    virtualenv scipy-stubs pylint hypothesis textual _pytest pytest kagglesdk agentplatform vertexai fontTools
    matplotlib kiwisolver mypy mypyc ruff)

pack() {
    local venv="${TRAINER_VENV:-.venvs/trainer}"
    [ -x "$venv/bin/python" ] || fail "no $venv: run 'make envs' first"
    local py home site
    py="$(readlink -f "$venv/bin/python")"
    home="$(cd "$(dirname "$py")/.." && pwd)"
    site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    local ver
    ver="$("$venv/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
    say "interpreter $py ($home), site-packages $site"
    rm -rf "$OUTDIR" && mkdir -p "$OUTDIR/meta" || fail "cannot create $OUTDIR"
    local stage
    stage="$(mktemp -d)"
    trap 'rm -rf "$stage"' RETURN
    # the interpreter: bin/python3.X, lib/libpython3.X.so*, the stdlib without what no step imports
    mkdir -p "$stage/bin" "$stage/lib" || fail "cannot stage"
    cp -a "$home/bin/python$ver" "$stage/bin/" && cp -a "$home"/lib/libpython3*.so* "$stage/lib/" || fail "cannot copy the interpreter"
    tar -C "$home/lib" --exclude="python$ver/test" --exclude="python$ver/idlelib" --exclude="python$ver/tkinter" \
        --exclude="python$ver/turtledemo" --exclude="python$ver/ensurepip" --exclude="python$ver/site-packages" \
        --exclude="python$ver/config-$ver-*" --exclude='__pycache__' -cf - "python$ver" | tar -C "$stage/lib" -xf - \
        || fail "cannot copy the standard library"
    # the packages
    local dest="$stage/lib/python$ver/site-packages" skip=() name
    mkdir -p "$dest" || fail "cannot stage site-packages"
    for name in "${EXCLUDE[@]}"; do skip+=(--exclude="./$name"); done
    tar -C "$site" "${skip[@]}" --exclude='__pycache__' -cf - . | tar -C "$dest" -xf - || fail "cannot copy site-packages"
    # Bytecode for every module, whatever this venv happens to hold: uv installs none, and the device's
    # processes appear to keep none they write, so each case compiled MaxText and JAX from source
    # (lora_sft's first log line to its second: 11 s with bytecode carried, 23-24 s without, 2026-12-07).
    # Tracebacks name the unpacked paths.
    "$venv/bin/python" -m compileall -q -j 0 -s "$stage" -p "$ENV_DIR" "$stage/lib/python$ver" >/dev/null \
        || say "some files did not compile (their modules compile where they are imported)"
    # a fallback for the system libraries the stdlib's extension modules link, should the machine lack one
    mkdir -p "$stage/syslib"
    for name in libffi.so.8 libssl.so.3 libcrypto.so.3 libsqlite3.so.0 libbz2.so.1.0 liblzma.so.5 libuuid.so.1; do
        cp -L "/lib/x86_64-linux-gnu/$name" "$stage/syslib/" 2>/dev/null || say "no $name here to carry (the machine's own is used)"
    done
    say "staged $(du -sh "$stage" | cut -f1) in $(find "$stage" -type f | wc -l) files; compressing"
    tar -C "$stage" -cf - . | zstd -q -T0 -9 | split -b "$PART_BYTES" -d -a 2 - "$OUTDIR/part-" || fail "cannot compress"
    (cd "$OUTDIR" && sha256sum part-* >meta/SHA256SUMS) || fail "cannot checksum the parts"
    cp -L "$(command -v zstd)" "$OUTDIR/meta/zstd" || fail "no zstd here"
    "$venv/bin/python" - >"$OUTDIR/meta/VERSIONS" <<'EOF' || fail "the trainer environment lacks jax, jaxlib or libtpu"
import sys
from importlib.metadata import version
print(f"python {sys.version.split()[0]}, " + ", ".join(f"{n} {version(n)}" for n in ("jax", "jaxlib", "libtpu")))
EOF
    say "$(cat "$OUTDIR/meta/VERSIONS")"
    say "$(ls "$OUTDIR"/part-* | wc -l) parts of at most 58 MiB in $OUTDIR ($(du -sh "$OUTDIR" | cut -f1)); carry .tpu-env/meta with the first"
}

unpack() {
    [ -f "$OUTDIR/meta/SHA256SUMS" ] || [ -f "$PARTS/SHA256SUMS" ] || fail "carry .tpu-env/meta (made by 'pack') with the first part"
    mkdir -p "$PARTS" || fail "cannot create $PARTS"
    if [ -d "$OUTDIR/meta" ]; then cp -f "$OUTDIR"/meta/* "$PARTS/" || fail "cannot keep the manifest"; fi
    local f
    for f in "$OUTDIR"/part-*; do
        [ -f "$f" ] || continue
        mv -f "$f" "$PARTS/" || fail "cannot move $f"
        say "received $(basename "$f") ($(stat -c %s "$PARTS/$(basename "$f")") bytes)"
    done
    if [ -f "$ENV_DIR/.complete" ] && cmp -s "$ENV_DIR/.complete" "$PARTS/SHA256SUMS"; then
        say "$ENV_DIR already holds this environment: $(cat "$PARTS/VERSIONS")"
        return 0
    fi
    local missing
    missing="$(cd "$PARTS" && awk '{print $2}' SHA256SUMS | while read -r p; do [ -f "$p" ] || echo "$p"; done | tr '\n' ' ')"
    if [ -n "$missing" ]; then
        say "still missing: $missing(carry the next in the following call)"
        exit 3
    fi
    (cd "$PARTS" && sha256sum --quiet -c SHA256SUMS) || fail "a part's checksum differs: carry it again"
    chmod +x "$PARTS/zstd"
    rm -rf "$ENV_DIR" && mkdir -p "$ENV_DIR" || fail "cannot create $ENV_DIR"
    local t0=$SECONDS
    cat "$PARTS"/part-* | "$PARTS/zstd" -q -d | tar -C "$ENV_DIR" -xf - || fail "cannot unpack"
    cp "$PARTS/SHA256SUMS" "$ENV_DIR/.complete"
    run -c 'import ssl, ctypes, sqlite3, lzma, bz2, jax, libtpu; print("imports", jax.__version__)' \
        || fail "the unpacked environment does not import (output above)"
    say "unpacked in $((SECONDS - t0)) s into $ENV_DIR ($(du -sh "$ENV_DIR" | cut -f1)): $(cat "$PARTS/VERSIONS")"
}

run() {
    local py
    py="$(ls "$ENV_DIR"/bin/python3.* 2>/dev/null | head -1)"
    [ -n "$py" ] && [ -f "$ENV_DIR/.complete" ] || fail "no environment unpacked in $ENV_DIR: run 'unpack' first"
    env -u PYTHONPATH -u TPU_LIBRARY_PATH LD_LIBRARY_PATH="$ENV_DIR/lib:${LD_LIBRARY_PATH:-}:$ENV_DIR/syslib" "$py" "$@"
}

case "${1:-}" in
    pack) pack ;;
    unpack) unpack ;;
    run) shift && run "$@" ;;
    *) fail "usage: bash bench/tpu/carry_env.sh pack | unpack | run ARGS..." ;;
esac
