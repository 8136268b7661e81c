"""lora_sft's summary: what its manifest records and the task log's last line reports."""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Any

from loraflow.launchers import multihost
from loraflow.trainer.answers import Answers
from loraflow.trainer.export import PeftExport
from loraflow.trainer.memory import Memory
from loraflow.trainer.training import Trained


@dataclass(frozen=True)
class SftSummary:
    first_loss: float | None
    final_loss: float | None
    steps: int
    resumed_from_step: int | None
    train_seconds: float
    setup_seconds: float
    step_seconds: float
    tokens_per_s: float | None  # the mean of the steps after the first (which compiles)
    first_step_seconds: float | None  # the first step of an attempt compiles it
    median_step_seconds: float | None  # the steady step time: the median of the others
    lora_b_norm: float
    peft_tensors: int
    total_seconds: float
    processes: int
    quantization: str
    chat_template: dict[str, Any]
    memory: Memory
    answers: Answers | None

    def to_json(self) -> dict[str, Any]:
        """The manifest's summary: every figure above, the memory's and the answers' flattened in."""
        figures = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _NESTED}
        answers = self.answers.summary() if self.answers is not None else {}
        return {**figures, **self.memory.summary(), **answers}


_NESTED = ("memory", "answers")


def summarize(
    trained: Trained,
    quantization: str,
    exported: PeftExport,
    norm: float,
    started: float,
    dist: multihost.DistributedConfig | None,
) -> SftSummary:
    rows = trained.rows
    later = [r for r in rows if r.step > 1]  # step 1 includes compilation
    return SftSummary(
        first_loss=rows[0].loss if rows else None,
        final_loss=rows[-1].loss if rows else None,
        steps=trained.final_step,
        resumed_from_step=trained.start_step or None,
        train_seconds=round(trained.train_seconds, 1),
        setup_seconds=round(trained.setup_seconds, 1),
        step_seconds=round(trained.train_seconds / max(1, len(rows)), 3),
        tokens_per_s=round(sum(r.tokens_per_s for r in later) / len(later), 1) if later else None,
        first_step_seconds=round(rows[0].seconds, 3) if rows else None,
        median_step_seconds=round(statistics.median(r.seconds for r in rows[1:]), 4) if len(rows) > 1 else None,
        lora_b_norm=round(norm, 4),
        peft_tensors=exported.tensors,
        total_seconds=round(time.monotonic() - started, 1),
        processes=dist.num_processes if dist is not None else 1,
        quantization=quantization,
        chat_template=trained.chat_template,
        memory=trained.memory,
        answers=trained.answers,
    )
