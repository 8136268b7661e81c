"""lora_sft's summary: what its manifest records and the task log's last line reports."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from loraflow.launchers import multihost
from loraflow.spec.tuning import Choice
from loraflow.trainer.answers import Answers
from loraflow.trainer.export import PeftExport
from loraflow.trainer.memory import Memory
from loraflow.trainer.step_log import step_times
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
    tokens_per_s: float | None  # the steps after the attempt's first (which compiles): tokens over seconds
    median_tokens_per_s: float | None  # the median of those steps' rates
    first_step_seconds: float | None  # the first step of an attempt compiles it
    compile_seconds: float | None  # the first step beyond a median one
    mean_step_seconds: float | None  # the steady step time: the mean of the others
    median_step_seconds: float | None  # ... and their median
    lora_b_norm: float
    peft_tensors: int
    total_seconds: float
    processes: int
    quantization: str
    chat_template: dict[str, Any]
    memory: Memory
    answers: Answers | None
    tuning: Choice | None = None  # training.tuning: auto's choice

    def to_json(self) -> dict[str, Any]:
        """The manifest's summary: every figure above, the memory's and the answers' flattened in."""
        figures = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _NESTED}
        answers = self.answers.summary() if self.answers is not None else {}
        tuned = self.tuning.summary() if self.tuning is not None else {}
        return {**figures, **self.memory.summary(), **answers, **tuned}


_NESTED = ("memory", "answers", "tuning")


def summarize(
    trained: Trained,
    quantization: str,
    exported: PeftExport,
    norm: float,
    started: float,
    dist: multihost.DistributedConfig | None,
) -> SftSummary:
    rows = trained.rows
    times = step_times(rows)
    return SftSummary(
        first_loss=rows[0].loss if rows else None,
        final_loss=rows[-1].loss if rows else None,
        steps=trained.final_step,
        resumed_from_step=trained.start_step or None,
        train_seconds=round(trained.train_seconds, 1),
        setup_seconds=round(trained.setup_seconds, 1),
        step_seconds=round(trained.train_seconds / max(1, len(rows)), 3),
        tokens_per_s=_rounded(times.tokens_per_s, 1),
        median_tokens_per_s=_rounded(times.median_tokens_per_s, 1),
        first_step_seconds=_rounded(times.first_step_seconds, 3),
        compile_seconds=_rounded(times.compile_seconds, 3),
        mean_step_seconds=_rounded(times.mean_step_seconds, 4),
        median_step_seconds=_rounded(times.median_step_seconds, 4),
        lora_b_norm=round(norm, 4),
        peft_tensors=exported.tensors,
        total_seconds=round(time.monotonic() - started, 1),
        processes=dist.num_processes if dist is not None else 1,
        quantization=quantization,
        chat_template=trained.chat_template,
        memory=trained.memory,
        answers=trained.answers,
        tuning=trained.tuning,
    )


def _rounded(value: float | None, digits: int) -> float | None:
    return round(value, digits) if value is not None else None
