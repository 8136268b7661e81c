#!/usr/bin/env bash
# Installs vLLM's TPU backend and what loraflow's evaluate step needs on the TPU machine (Python 3.11,
# JAX 0.10.2 + libtpu preinstalled on PYTHONPATH, no network), from the repository root, with
# .whl-tpu-serve carried (bench/tpu/serve_wheels.sh makes it):
#
#   bash bench/tpu/install_serve.sh && export PYTHONPATH=$PYTHONPATH:/tmp/site-serve && python3 bench/tpu/check.py vllm-tiny
#
# 1. pip installs, with --no-deps, bench/tpu/serve-requirements-index.txt from the machine's own index
#    (torch 2.13.0+cpu from its /opt/wheels) and the carried wheels into /tmp/site-serve. Skipped when
#    that folder already holds this very set (a marker from an earlier call on the same warm machine).
# 2. torchax 0.0.11 made importable on torch 2.13 (_serve_device.fix_torchax).
# Exits non-zero, saying why, when either fails.
#
# Environment: PYTHON (python3), TPU_SERVE_SITE (/tmp/site-serve), TPU_INDEX_URL (file:///opt/pypi/simple),
# TPU_FIND_LINKS (/opt/wheels: where the machine keeps torch).
set -uo pipefail

fail() { echo "install_serve.sh: FAILED: $*" >&2; exit 1; }
say() { echo "install_serve.sh: $*"; }

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)" || fail "cannot find the repository root"
cd "$REPO" || fail "cannot cd to $REPO"
PY="${PYTHON:-python3}"
SITE="${TPU_SERVE_SITE:-/tmp/site-serve}"
INDEX_URL="${TPU_INDEX_URL:-file:///opt/pypi/simple}"
FIND_LINKS="${TPU_FIND_LINKS:-/opt/wheels}"
REQS="bench/tpu/serve-requirements-index.txt"
MARKER="$SITE/.loraflow-serve-install"
T0=$SECONDS

[ -f "$REQS" ] || fail "$REQS is missing (run from a loraflow checkout)"
shopt -s nullglob
WHEELS=(.whl-tpu-serve/*.whl)
shopt -u nullglob
[ "${#WHEELS[@]}" -gt 0 ] || fail "no wheels in .whl-tpu-serve/: run 'bash bench/tpu/serve_wheels.sh' here and name .whl-tpu-serve in the device call's carry"
"$PY" -c 'import jax' 2>/dev/null || fail "$PY cannot import jax: PYTHONPATH must keep the machine's JAX folder (add to it, never replace it)"
say "$("$PY" -c 'import sys, jax, jaxlib; print("Python", sys.version.split()[0], "jax", jax.__version__, "jaxlib", jaxlib.__version__)')"

STAMP="$( { cat "$REQS" "${BASH_SOURCE[0]}" bench/tpu/_serve_device.py; for w in "${WHEELS[@]}"; do basename "$w"; done; } | sha256sum | cut -c1-16)"
if [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$STAMP" ]; then
    say "$SITE already holds this set (marker $STAMP): install skipped"
    exit 0
fi
rm -rf "$SITE" && mkdir -p "$SITE" || fail "cannot create $SITE"
say "pip: $(grep -c '^[a-zA-Z]' "$REQS") projects from $INDEX_URL + ${#WHEELS[@]} carried wheels -> $SITE"
env PIP_CONFIG_FILE=/dev/null "$PY" -m pip install --isolated -q --disable-pip-version-check --no-deps \
    --no-compile --no-cache-dir --ignore-requires-python --only-binary=:all: --index-url "$INDEX_URL" \
    --find-links "$FIND_LINKS" --target "$SITE" -r "$REQS" "${WHEELS[@]}" 2>&1 | grep -v "WARNING: Target directory"
[ "${PIPESTATUS[0]}" = 0 ] || fail "pip could not install from $INDEX_URL, $FIND_LINKS and .whl-tpu-serve (output above)"
say "installed $(ls -d "$SITE"/*.dist-info | wc -l) distributions in $((SECONDS - T0))s"

PYTHONPATH="$PYTHONPATH:$SITE" "$PY" bench/tpu/_serve_device.py fix-torchax "$SITE" || fail "torchax could not be fixed"
PYTHONPATH="$PYTHONPATH:$SITE" "$PY" -c 'import torchax' || fail "torchax does not import on this torch"
echo "$STAMP" >"$MARKER"
say "done in $((SECONDS - T0))s"
