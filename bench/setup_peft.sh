#!/usr/bin/env bash
# PEFT (+ accelerate) for the merge comparison, outside the project's environments: installed with
# --no-deps into /tmp/bench-peftlib and put on the serving env's PYTHONPATH only for that child.
set -euo pipefail
[ -d /tmp/bench-peftlib/peft ] && exit 0
# uv from PATH, else the one `make envs` bootstraps into .venvs/.uv
uv=$(command -v uv || echo "$(cd "$(dirname "$0")/.." && pwd)/.venvs/.uv/bin/uv")
"$uv" pip install -q --target /tmp/bench-peftlib --no-deps peft accelerate || echo "[bench] PEFT not installable: that comparison is skipped"
