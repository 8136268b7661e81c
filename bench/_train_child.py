"""Child of train_bench.py (trainer env). argv: MODE ROOT [STEPS]; the HF model (tiny family) is ROOT/model

prepare   convert the HF model (loraflow's convert) into ROOT/ckpt and write ROOT/data/train.jsonl
          (the parity set as chat messages, as validate_data writes it)
loraflow  the lora_sft stage function (``loraflow.steps.lora_sft.run``: hooks, checkpoint sync,
          PEFT export, loss.csv) with the tiny spec's training config, outputs in ROOT/out-loraflow
direct    MaxText's own SFT entry points as ``train_sft.train`` calls them (``setup_trainer_state``
          then ``train_model``), with the same MaxText arguments the stage builds: no loraflow hooks,
          no checkpoint sync, no export

Both report the seconds of MaxText's ``train_model`` (training steps, first-step compile included)
and of the set-up before it; tokens per second = steps x batch_size x max_length / train seconds.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

T0 = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _sft_inputs import maxtext_sft_direct, prepare_sft_inputs  # noqa: E402
from common import emit  # noqa: E402

from loraflow.dev import tinymodel  # noqa: E402
from loraflow.models import llama  # noqa: E402

MODEL = tinymodel.MAXTEXT_MODEL
# training: of pipelines/tiny-llama-lora.yaml (steps from argv), lora: rank 16, alpha 32
CONFIG = {
    "rank": 16,
    "alpha": 32.0,
    "batch_size": 8,
    "learning_rate": 0.003,
    "max_length": 64,
    "seed": 0,
    "checkpoint_period": 50,
    "dtype": "float32",
}


def prepare(root: Path, hf_dir: Path) -> None:
    overrides = llama.maxtext_overrides(json.loads((hf_dir / "config.json").read_text()))
    prepare_sft_inputs(root, hf_dir, MODEL, overrides)


def context(root: Path, hf_dir: Path, mode: str, steps: int):
    from loraflow.steps._harness import StepContext

    out = root / f"out-{mode}"
    (out / "out").mkdir(parents=True)
    (out / "work").mkdir(parents=True)
    return StepContext(
        stage="lora_sft",
        output_uri=str(out / "remote"),
        inputs={"checkpoint": root / "ckpt", "dataset": root / "data", "tokenizer": hf_dir},
        input_manifests={},
        out=out / "out",
        work=out / "work",
        config={**CONFIG, "steps": steps},
    )


def run_loraflow(root: Path, hf_dir: Path, steps: int) -> dict:
    from loraflow.steps import lora_sft

    ctx = context(root, hf_dir, "loraflow", steps)
    t = time.perf_counter()
    summary = lora_sft.run(ctx)
    stage_s = time.perf_counter() - t
    import csv
    import statistics

    with (ctx.out / "loss.csv").open() as f:
        per_step = [float(r["tokens_per_s"]) for r in csv.DictReader(f) if int(r["step"]) >= 3]
    return {
        "hook_median_tokens_per_s_from_step_3": statistics.median(per_step) if per_step else None,
        "stage_s": stage_s,
        "train_s": summary["train_seconds"],
        "setup_s": summary["setup_seconds"],
        "final_loss": summary.get("final_loss"),
        "summary": {k: v for k, v in summary.items() if isinstance(v, (int, float, str))},
    }


def run_direct(root: Path, hf_dir: Path, steps: int) -> dict:
    ctx = context(root, hf_dir, "direct", steps)
    t = time.perf_counter()
    res = maxtext_sft_direct(ctx)
    return {
        "stage_s": time.perf_counter() - t,
        "train_s": res["train_seconds"],
        "setup_s": res["setup_seconds"],
        "final_step": res["steps"],
    }


if __name__ == "__main__":
    mode, root = sys.argv[1], Path(sys.argv[2])
    hf_dir = root / "model"
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 200
    res: dict = {"mode": mode, "steps": steps}
    if mode == "prepare":
        prepare(root, hf_dir)
    else:
        res.update(run_loraflow(root, hf_dir, steps) if mode == "loraflow" else run_direct(root, hf_dir, steps))
        res["tokens"] = steps * CONFIG["batch_size"] * CONFIG["max_length"]
        res["tokens_per_s"] = res["tokens"] / res["train_s"]
    res["process_s"] = time.perf_counter() - T0
    emit(res)
