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
    from loraflow.trainer.converted import CHECKPOINT_JSON

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


def maxtext_sft_direct(ctx: Any, random_init: bool = False) -> dict[str, Any]:
    """MaxText's SFT entry points as ``train_sft.train`` calls them (``setup_trainer_state``, then
    ``train_model``) with the MaxText arguments the lora_sft stage builds for ``ctx``: nothing of
    loraflow's around them. ``random_init``: without ``load_parameters_path`` (MaxText's own init)."""
    import time

    from absl import flags
    from maxtext.configs import pyconfig
    from maxtext.trainers.post_train.sft import train_sft

    from loraflow.steps import lora_sft
    from loraflow.trainer.data import training_set
    from loraflow.trainer.training import maxtext_argv

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    sft = lora_sft.sft_run(ctx)
    argv = maxtext_argv(sft, training_set(sft.dataset), str(ctx.work / "maxtext"))
    if random_init:
        argv = [a for a in argv if not a.startswith("load_parameters_path=")]
    t = time.perf_counter()
    mt_config = pyconfig.initialize_pydantic(argv)
    train_sft.validate_config(mt_config)
    trainer, mesh = train_sft.setup_trainer_state(mt_config)
    t_train = time.perf_counter()
    train_sft.train_model(mt_config, trainer, mesh)
    end = time.perf_counter()
    return {"setup_seconds": t_train - t, "train_seconds": end - t_train, "steps": int(trainer.train_steps)}
