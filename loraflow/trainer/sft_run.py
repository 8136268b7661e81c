"""One attempt of the lora_sft step, as the trainer modules see it: its config, model, inputs and places."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from loraflow.spec.step_configs import LoraSftConfig
from loraflow.trainer.converted import ConvertedModel

Progress = Callable[[str], None]  # a line for the task log


@dataclass(frozen=True)
class SftRun:
    cfg: LoraSftConfig
    model: ConvertedModel
    dataset: Path  # train.jsonl (+ chat_template.json, eval.jsonl): validate_data's output
    tokenizer: Path  # the HF checkpoint directory
    output_uri: str  # the stage's prefix: staged checkpoints go under {output_uri}/_checkpoints
    work: Path  # this host's own scratch disk
    progress: Progress
