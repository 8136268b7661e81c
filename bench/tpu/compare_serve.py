"""The chip's evaluate answers against the CPU's (bench/tpu/README.md, "Serving"), here, stdlib only:

    python3 bench/tpu/compare_serve.py TPU_JSON CPU_JSON

TPU_JSON is the ``vllm-tiny`` phase's results from the TPU machine (``tpu-vllm-tiny.json``), CPU_JSON the
same phase run here in the serving env (vLLM's CPU build). For each case the chip ran, against the CPU
case of the same model and dtype (the CPU computes float32 products in full whatever
``matmul_precision`` says): accuracy and format rate on both, how many answers are the same token ids,
which differ, and the guard on each. Writes ``bench/results/tpu-vllm-compare.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def _cases(path: Path) -> dict[str, dict[str, Any]]:
    """The phase's cases that ran, by name (a later run of a name replaces an earlier one)."""
    return {r["case"]["name"]: r for r in json.loads(path.read_text())["results"] if "answers" in r}


def _guard(result: dict[str, Any]) -> dict[str, Any]:
    guard = result["guard"]
    return {"failed": guard["failed"]} if "failed" in guard else {"accuracy": guard["accuracy"]}


def compare(tpu: dict[str, Any], cpu: dict[str, Any]) -> dict[str, Any]:
    n = tpu["metrics"]["n"]  # the answers come first; the guard's one-token generations after them
    ours, theirs = tpu["answers"]["token_ids"][:n], cpu["answers"]["token_ids"][:n]
    differ = [i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b]
    return {
        "n": n,
        "accuracy": {"tpu": tpu["metrics"]["accuracy"], "cpu": cpu["metrics"]["accuracy"]},
        "format_rate": {"tpu": tpu["metrics"]["format_rate"], "cpu": cpu["metrics"]["format_rate"]},
        "same_tokens": n - len(differ),
        "differing": [{"example": i, "tpu": ours[i], "cpu": theirs[i]} for i in differ],
        "guard": {"tpu": _guard(tpu), "cpu": _guard(cpu)},
        "tpu_versions": tpu["versions"],
        "cpu_versions": cpu["versions"],
    }


def main() -> int:
    tpu, cpu = _cases(Path(sys.argv[1])), _cases(Path(sys.argv[2]))
    rows = {}
    for name, result in tpu.items():
        reference = cpu.get(name.removesuffix("-highest"))
        if reference is not None:
            rows[name] = compare(result, reference)
            print(name, {k: v for k, v in rows[name].items() if k in ("accuracy", "same_tokens", "guard")})
    dest = REPO / "bench" / "results" / "tpu-vllm-compare.json"
    dest.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {dest.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
