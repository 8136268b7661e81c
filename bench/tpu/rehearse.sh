#!/usr/bin/env bash
# A rehearsal of the TPU machine's set-up on this machine's CPU, at no device time: Python 3.11,
# JAX 0.10.2 + jaxlib + numpy + scipy in a folder of their own on PYTHONPATH (as the TPU machine has
# them), bench/tpu/install.sh against the package index, then the tiny model converted and trained
# through bench/tpu/_case.py (loraflow LoRA bf16, QLoRA nf4 bf16, int8, MaxText's own entry point),
# JAX_PLATFORMS=cpu, 3 steps each. Scratch in $REHEARSE_DIR (default /tmp/tpu-rehearse).
#
# Needs a Python 3.11 (PYTHON311, default: python3.11 on PATH, else pyenv's 3.11.7) and the index
# (TPU_INDEX_URL; this workplace's machines hold a copy of the TPU machine's at /opt/pypi/simple).
# Run bench/tpu/wheels.sh first. About 2 minutes on 2 cores once the venv exists.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
DIR="${REHEARSE_DIR:-/tmp/tpu-rehearse}"
export TPU_INDEX_URL="${TPU_INDEX_URL:-file:///opt/pypi/simple}"
PY311="${PYTHON311:-$(command -v python3.11 || echo /root/.pyenv/versions/3.11.7/bin/python3.11)}"
[ -x "$PY311" ] || { echo "rehearse.sh: no Python 3.11 ($PY311); set PYTHON311" >&2; exit 1; }

mkdir -p "$DIR"
if [ ! -x "$DIR/venv/bin/python3" ]; then
    "$PY311" -m venv "$DIR/venv"
fi
if [ ! -d "$DIR/preinstalled/jax" ]; then  # the TPU machine's preinstalled folder, less libtpu
    PIP_CONFIG_FILE=/dev/null "$DIR/venv/bin/python3" -m pip install --isolated -q --no-cache-dir \
        --only-binary=:all: --index-url "$TPU_INDEX_URL" --target "$DIR/preinstalled" \
        jax==0.10.2 jaxlib==0.10.2 numpy scipy
fi

export PATH="$DIR/venv/bin:$PATH" PYTHONPATH="$DIR/preinstalled" TPU_SITE="$DIR/site"
t0=$SECONDS
bash bench/tpu/install.sh
echo "rehearse.sh: install.sh took $((SECONDS - t0))s"

# the device command's environment
export PYTHONPATH="$REPO/bench/tpu/shim:$PYTHONPATH:$TPU_SITE" JAX_PLATFORMS=cpu
rm -rf "$DIR/case"
status=0
for c in \
    '{"kind": "prepare", "size": "tiny"}' \
    '{"kind": "train", "size": "tiny", "mode": "loraflow", "dtype": "bfloat16", "quantization": "none", "steps": 3}' \
    '{"kind": "train", "size": "tiny", "mode": "loraflow", "dtype": "bfloat16", "quantization": "nf4", "steps": 3}' \
    '{"kind": "train", "size": "tiny", "mode": "loraflow", "dtype": "float32", "quantization": "int8", "steps": 3}' \
    '{"kind": "train", "size": "tiny", "mode": "maxtext", "dtype": "float32", "quantization": "none", "steps": 3}'; do
    case_json="${c%\}}, \"root\": \"$DIR/case\"}"
    t=$SECONDS
    if python3 bench/tpu/_case.py "$case_json" >"$DIR/case.log" 2>&1; then
        echo "rehearse.sh: ok   $((SECONDS - t))s $c $(grep -o '"final_loss": [0-9.]*' "$DIR/case.log" | tail -1)"
    else
        echo "rehearse.sh: FAIL $((SECONDS - t))s $c"; tail -30 "$DIR/case.log"; status=1
        [[ "$c" == *prepare* ]] && break
    fi
done
exit $status
