#!/usr/bin/env bash
# Installs what loraflow's trainer steps need on the TPU machine (Python 3.11, JAX 0.10.2 + libtpu
# preinstalled on PYTHONPATH, no network), from the repository root, with .whl-tpu carried:
#
#   bash bench/tpu/install.sh && export PYTHONPATH=$PWD/bench/tpu/shim:$PYTHONPATH:/tmp/site && python3 ...
#
# 1. pip installs, with --no-deps, bench/tpu/requirements-index.txt from the machine's own index and
#    the carried wheels .whl-tpu/*.whl (bench/tpu/wheels.sh makes them) into /tmp/site. Skipped when
#    /tmp/site already holds this very set (a marker from an earlier call on the same warm machine).
# 2. Makes MaxText 0.2.5 (which declares Python >= 3.12) and the other carried packages compile on
#    this Python: `type X = ...` statements (PEP 695) become `X = ...`; every file of the carried
#    packages is compiled (leaving the .pyc files for the runs), and what still does not is reported
#    (one MaxText example script with a 3.12 f-string, never imported).
# 3. Checks that the modules loraflow's convert_checkpoint and lora_sft import do import, on the CPU
#    (the chip stays free), with bench/tpu/shim first on PYTHONPATH (typing.override and the JAX >= 0.11
#    names MaxText uses; see shim/sitecustomize.py).
# Exits non-zero, saying why, when any of this fails.
#
# Environment: PYTHON (python3), TPU_SITE (/tmp/site), TPU_INDEX_URL (file:///opt/pypi/simple; a
# rehearsal elsewhere points it at a stand-in), TPU_SKIP_CHECK=1 skips step 3.
set -uo pipefail

fail() { echo "install.sh: FAILED: $*" >&2; exit 1; }
say() { echo "install.sh: $*"; }

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)" || fail "cannot find the repository root"
cd "$REPO" || fail "cannot cd to $REPO"
PY="${PYTHON:-python3}"
SITE="${TPU_SITE:-/tmp/site}"
INDEX_URL="${TPU_INDEX_URL:-file:///opt/pypi/simple}"
REQS="bench/tpu/requirements-index.txt"
SHIM="$REPO/bench/tpu/shim"
MARKER="$SITE/.loraflow-tpu-install"
T0=$SECONDS

command -v "$PY" >/dev/null || fail "no $PY on PATH"
[ -f "$REQS" ] || fail "$REQS is missing (run from a loraflow checkout)"
shopt -s nullglob
WHEELS=(.whl-tpu/*.whl)
shopt -u nullglob
[ "${#WHEELS[@]}" -gt 0 ] || fail "no wheels in .whl-tpu/: run 'bash bench/tpu/wheels.sh' on the development machine and name .whl-tpu in the device call's carry"

say "$("$PY" -c 'import sys, platform; print("Python", sys.version.split()[0], "glibc", "-".join(platform.libc_ver()))')"
say "preinstalled: $("$PY" - <<'EOF'
from importlib import metadata
found = []
for name in ("jax", "jaxlib", "libtpu", "numpy", "scipy", "ml_dtypes"):
    try:
        found.append(f"{name} {metadata.version(name)}")
    except metadata.PackageNotFoundError:
        found.append(f"{name} -")
print(", ".join(found))
EOF
)"
"$PY" -c 'import jax' 2>/dev/null || fail "$PY cannot import jax: PYTHONPATH must keep the machine's JAX folder (add to it, never replace it)"

# ------------------------------------------------------------------ 1. install (once per machine)
STAMP="$( { cat "$REQS" "${BASH_SOURCE[0]}"; for w in "${WHEELS[@]}"; do basename "$w"; done; } | sha256sum | cut -c1-16)"
if [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$STAMP" ]; then
    say "$SITE already holds this set (marker $STAMP): install skipped"
else
    rm -rf "$SITE" || fail "cannot remove the old $SITE"
    mkdir -p "$SITE" || fail "cannot create $SITE"
    PIP=(env PIP_CONFIG_FILE=/dev/null "$PY" -m pip install --isolated -q --disable-pip-version-check
        --no-deps --no-compile --no-cache-dir --ignore-requires-python --only-binary=:all:
        --index-url "$INDEX_URL" --target "$SITE")
    say "pip: $(grep -c '^[a-z]' "$REQS") projects from $INDEX_URL + ${#WHEELS[@]} carried wheels -> $SITE"
    if ! "${PIP[@]}" -r "$REQS" "${WHEELS[@]}"; then
        # a pin the index does not hold: the same names, each at the index's newest version
        say "pinned install failed; trying again with the index's newest version of each name"
        rm -rf "$SITE" && mkdir -p "$SITE"
        UNPINNED="$(mktemp)"
        sed -nE 's/^([A-Za-z0-9._-]+)==.*/\1/p' "$REQS" >"$UNPINNED"
        "${PIP[@]}" -r "$UNPINNED" "${WHEELS[@]}" || fail "pip could not install from $INDEX_URL and .whl-tpu (output above)"
        say "WARNING: installed unpinned: versions may differ from the rehearsed set"
    fi
    say "installed $(ls -d "$SITE"/*.dist-info | wc -l) distributions in $((SECONDS - T0))s"

    # -------------------------------------------------------------- 2. Python 3.11 source fixes
    T1=$SECONDS
    "$PY" - "$SITE" "${WHEELS[@]}" <<'EOF' || fail "the Python 3.11 source fixes failed (output above)"
"""In the carried packages: PEP 695 `type X = ...` -> `X = ...` where a file does not compile on
this Python; every file byte-compiled (the .pyc files serve the runs); what still fails, reported."""
import os
import py_compile
import re
import sys
import zipfile
from concurrent.futures import ProcessPoolExecutor

site, wheels = sys.argv[1], sys.argv[2:]
TYPE_ALIAS = re.compile(r"^(?P<indent>[ \t]*)type[ \t]+(?P<name>[A-Za-z_]\w*)[ \t]*=(?P<rest>.*)$", re.M)


def compiles(path):
    try:
        py_compile.compile(path, doraise=True)
        return None
    except py_compile.PyCompileError as exc:
        return exc.msg.strip().splitlines()[-1]


def check_and_fix(path):
    error = compiles(path)
    if error is None:
        return None
    with open(path, encoding="utf-8") as f:
        text = f.read()
    fixed, n = TYPE_ALIAS.subn(lambda m: f"{m['indent']}{m['name']} ={m['rest']}", text)
    if n:
        with open(path, "w", encoding="utf-8") as f:
            f.write(fixed)
        after = compiles(path)
        if after is None:
            return ("fixed", path, f"{n} `type` statement(s) rewritten")
        return ("broken", path, after)
    return ("broken", path, error)


tops = set()
for wheel in wheels:
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            top = name.split("/")[0]
            if name.endswith(".py") and not top.endswith((".dist-info", ".data")):
                tops.add(top)
files = []
for top in sorted(tops):
    root = os.path.join(site, top)
    if os.path.isfile(root):
        files.append(root)
    for d, _, names in os.walk(root):
        files.extend(os.path.join(d, n) for n in names if n.endswith(".py"))
with ProcessPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
    results = [r for r in pool.map(check_and_fix, files, chunksize=32) if r is not None]
for kind, path, what in sorted(results):
    print(f"install.sh:   {kind}: {os.path.relpath(path, site)}: {what}")
broken = [p for k, p, _ in results if k == "broken"]
# an example script or a test may stay broken: what must import is checked in step 3
print(f"install.sh: {len(files)} files of the carried packages compiled, "
      f"{sum(k == 'fixed' for k, _, _ in results)} fixed, {len(broken)} still not compiling on Python {sys.version.split()[0]}")
EOF
    say "carried sources checked and byte-compiled in $((SECONDS - T1))s"
    # what an earlier PYTHONPATH folder (the machine's own) would hide of what was installed here
    SHADOWED="$(IFS=:; for dir in ${PYTHONPATH:-}; do
        [ -d "$dir" ] || continue
        for entry in "$dir"/*; do
            name="$(basename "$entry")"
            case "$name" in *.dist-info | *.libs | __pycache__ | bin | *.pth) continue ;; esac
            [ -e "$SITE/$name" ] && echo "$name"
        done
    done | sort -u | tr '\n' ' ')"
    [ -z "$SHADOWED" ] || say "note: the machine's PYTHONPATH comes first and keeps its own: $SHADOWED"
    echo "$STAMP" >"$MARKER.pending"
fi

# ------------------------------------------------------------------ 3. does it import?
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}:$SITE"
if [ -f "$MARKER.pending" ] && [ "${TPU_SKIP_CHECK:-0}" != 1 ]; then  # after a fresh install only
    T2=$SECONDS
    JAX_PLATFORMS=cpu "$PY" - <<'EOF' || fail "an import the trainer steps need failed (traceback above)"
import importlib
import typing

assert hasattr(typing, "override"), "bench/tpu/shim/sitecustomize.py did not run (is it first on PYTHONPATH?)"
from jax.experimental import xla_metadata
assert hasattr(xla_metadata, "must_fuse_call"), "the JAX shim did not apply"
for name in [
    "loraflow.steps.convert_checkpoint",
    "loraflow.steps.lora_sft",
    "maxtext.checkpoint_conversion.to_maxtext",
    "maxtext.configs.pyconfig",
    "maxtext.trainers.post_train.sft.train_sft",
    "maxtext.trainers.post_train.sft.hooks",
    "maxtext.utils.lora_utils",
    "tunix.sft.checkpoint_manager",
    "tunix.sft.sharding_utils",
    "qwix",
    "grain",
    "orbax.checkpoint",
    "transformers",
    "datasets",
]:
    importlib.import_module(name)
from transformers import AutoConfig, AutoTokenizer  # noqa: F401
import datasets.packaged_modules.json.json  # noqa: F401  (the json loader MaxText's HF pipeline uses)
from importlib import metadata
print("install.sh: imports ok: " + ", ".join(
    f"{n} {metadata.version(n)}" for n in ("jax", "maxtext", "google-tunix", "qwix", "flax", "orbax-checkpoint", "transformers")))
EOF
    say "import check took $((SECONDS - T2))s"
fi
if [ -f "$MARKER.pending" ]; then mv "$MARKER.pending" "$MARKER"; fi
say "done in $((SECONDS - T0))s; now: export PYTHONPATH=$SHIM:\$PYTHONPATH:$SITE"
