"""What a training benchmark's child needs before lora_sft can run (trainer env): the HF checkpoint
converted by loraflow's convert into ROOT/ckpt (with its loraflow_checkpoint.json), and the parity
training set as chat messages in ROOT/data/train.jsonl, as validate_data writes it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PARITY = Path(__file__).resolve().parents[1] / "pipelines" / "data" / "parity" / "train.jsonl"


def prepare_sft_inputs(
    root: Path, hf_dir: Path, model: str, overrides: dict[str, Any], save_dtype: str = "float32", convert: bool = True
) -> None:
    """``convert=False`` writes the checkpoint's record only (a benchmark whose MaxText initialises at random)."""
    from loraflow.steps import convert_checkpoint as cc
    from loraflow.steps._maxtext import CHECKPOINT_JSON

    ckpt = root / "ckpt"
    if convert:
        cc.convert(hf_dir, ckpt, model, overrides, True, {}, save_dtype)
    ckpt.mkdir(parents=True, exist_ok=True)
    meta = {
        "format": "loraflow.maxtext_checkpoint/1",
        "load_parameters_path": cc.PARAMS_RELPATH,
        "model_name": model,
        "model_overrides": overrides,
        "scan_layers": True,
        "save_dtype": save_dtype,
    }
    (ckpt / CHECKPOINT_JSON).write_text(json.dumps(meta))
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    with (data / "train.jsonl").open("w") as out:
        for i, line in enumerate(PARITY.read_text().splitlines()):
            row = json.loads(line)
            messages = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["completion"]}]
            out.write(json.dumps({"id": str(i), "messages": messages}) + "\n")
