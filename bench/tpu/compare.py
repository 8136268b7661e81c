"""The TPU-trained adapters against CPU-trained twins (trainer env, on this machine; bench/tpu/README.md).

    .venvs/trainer/bin/python bench/tpu/compare.py RESULTS_DIR

RESULTS_DIR holds what the tiny phase of ``bench/tpu/check.py`` brought back (``tpu-tiny.json``,
``tpu-tiny-adapters.tar.gz``). For each of its loraflow runs (float32, bfloat16, nf4) this trains the
same configuration here on CPU from the same base (``.tpu-inputs/tiny``, carried there), merges both
adapters into that base with loraflow's merge (what merge_adapter publishes), and answers the
held-out parity prompts with each merged model (an independent numpy Llama, greedy). It writes
``bench/results/tpu_compare.json``: the loss curves side by side, each model's accuracy, how many
answers agree, and how far the merged weights differ (relative to the adapter's own update).
"""

from __future__ import annotations

import csv
import json
import os
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench"), str(HERE), str(REPO / "tests" / "trainer")]

import _case  # noqa: E402

TINY = REPO / ".tpu-inputs" / "tiny"
EVAL = REPO / "pipelines" / "data" / "parity" / "eval.jsonl"
N_EVAL = 100


def _losses(path: Path) -> list[float]:
    with path.open() as f:
        return [float(r["loss"]) for r in csv.DictReader(f)]


def _train_on_cpu(work: Path, case: dict[str, Any]) -> Path:
    """The same case through the same code on this machine's CPU: the run's out/ directory."""
    root = work / "cpu"
    if not (root / "ckpt").exists():
        _case.prepare("tiny", root, str(TINY))
    _case.train(case, root)
    return root / "runs" / _case.run_name(case) / "out"


def _answers(merged: Path) -> list[str]:
    import llama_numpy
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TINY))
    cfg, w = llama_numpy.load_hf(merged)
    out = []
    for line in EVAL.read_text().splitlines()[:N_EVAL]:
        prompt = [{"role": "user", "content": json.loads(line)["prompt"]}]
        ids = tok.encode(
            tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False), add_special_tokens=False
        )
        out.append(tok.decode(llama_numpy.greedy(cfg, w, ids, tok.eos_token_id), skip_special_tokens=True).strip())
    return out


def _weight_gap(base: Path, a: Path, b: Path) -> dict[str, float]:
    """max |a - b| over the merged weights, and the same over |a - base| (the adapter's own update)."""
    import llama_numpy
    import numpy as np

    _, w0 = llama_numpy.load_hf(base)
    _, wa = llama_numpy.load_hf(a)
    _, wb = llama_numpy.load_hf(b)
    gap = max(float(np.abs(wa[k].astype(np.float64) - wb[k]).max()) for k in w0)
    update = max(float(np.abs(wa[k].astype(np.float64) - w0[k]).max()) for k in w0)
    return {"max_abs_diff": gap, "max_abs_update": update, "relative": gap / update if update else float("inf")}


def main() -> int:
    from loraflow.lora.merge import merge_checkpoint

    results_dir = Path(sys.argv[1])
    runs = json.loads((results_dir / "tpu-tiny.json").read_text())["results"]
    work = Path(tempfile.mkdtemp(prefix="tpu-compare-"))
    with tarfile.open(results_dir / "tpu-tiny-adapters.tar.gz") as tar:
        tar.extractall(work / "tpu", filter="data")
    references = [json.loads(line)["completion"] for line in EVAL.read_text().splitlines()[:N_EVAL]]
    rows = []
    for run in runs:
        case = run.get("case", {})
        if case.get("kind") != "train" or case.get("mode") != "loraflow" or "failed" in run:
            continue
        name = _case.run_name(case)
        tpu_out, cpu_out = work / "tpu" / name, _train_on_cpu(work, case)
        merged = {}
        for where, out in (("tpu", tpu_out), ("cpu", cpu_out)):
            merged[where] = work / "merged" / where / name
            merge_checkpoint(TINY, out / "peft", merged[where])
        answers = {where: _answers(path) for where, path in merged.items()}
        tpu_loss, cpu_loss = _losses(tpu_out / "loss.csv"), _losses(cpu_out / "loss.csv")
        rows.append(
            {
                "run": name,
                "accuracy": {
                    w: sum(a == r for a, r in zip(ans, references, strict=True)) / N_EVAL for w, ans in answers.items()
                },
                "answers_agree": sum(a == b for a, b in zip(answers["tpu"], answers["cpu"], strict=True)) / N_EVAL,
                "loss_tpu": tpu_loss,
                "loss_cpu": cpu_loss,
                "loss_max_abs_diff": max(abs(a - b) for a, b in zip(tpu_loss, cpu_loss, strict=False)),
                "merged_weights": _weight_gap(TINY, merged["tpu"], merged["cpu"]),
                "device": run.get("device"),
            }
        )
        print(json.dumps({k: v for k, v in rows[-1].items() if not k.startswith("loss_")}), flush=True)
    dest = REPO / "bench" / "results" / "tpu_compare.json"
    dest.write_text(json.dumps({"eval_examples": N_EVAL, "runs": rows}, indent=1) + "\n")
    print(f"wrote {dest.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
