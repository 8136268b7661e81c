"""What each training step leaves: a live ``step N loss L tokens/s T`` line (flushed: the Airflow log is
live) for the first steps, every ``log_every``-th and the last, and a ``loss.csv`` row; and the attempt's
step times summed up (:func:`step_times`)."""

from __future__ import annotations

import csv
import statistics
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from loraflow.storage import faults
from loraflow.trainer.sft_run import Progress


class StepRow(NamedTuple):
    step: int
    loss: float
    tokens_per_s: float
    seconds: float  # from the previous step's end (the attempt's first step: from its start, compiling included)
    tokens: int  # the step's non-padding tokens


class StepLog:
    """The steps of this attempt, as the training hooks report them.

    A step's seconds run from the previous step's end to its own. JAX dispatches a step and returns
    before the chip has run it, and the trainer does work between the hooks: measured from the step's
    start hook, a 1 B model's 0.58 s steps on a TPU v5e read as 0.02 s (25x the real tokens per second).
    Tunix reports a step's end (its loss) after it has started the next step, and the last one after the
    loop: each end takes the oldest started step's tokens, and the attempt's first step runs from its own
    start (its compile included), not from the second step's.
    """

    def __init__(self, progress: Progress, steps: int, log_every: int) -> None:
        self.rows: list[StepRow] = []
        self._progress, self._steps, self._log_every = progress, steps, max(1, log_every)
        self._created = time.monotonic()
        self._since: float | None = None  # the attempt's first step start, then the last step end
        self._started: deque[int] = deque()  # the tokens of the steps started and not yet ended, oldest first

    def step_started(self, tokens: int) -> None:
        """A step begins on a batch of ``tokens`` non-padding tokens."""
        self._started.append(tokens)
        if self._since is None:
            self._since = time.perf_counter()

    def step_ended(self, step: int, loss: float) -> None:
        """The step's loss is known (the caller waited for the step's result)."""
        end = time.perf_counter()
        seconds = max(end - (self._since if self._since is not None else end), 1e-9)
        self._since = end
        tokens = self._started.popleft() if self._started else 0
        tps = tokens / seconds
        self.rows.append(StepRow(step, loss, tps, seconds, tokens))
        faults.point("train_step")  # a host lost mid-training (the reliability tests)
        if step <= 3 or step % self._log_every == 0 or step == self._steps:
            first = " compiling included" if len(self.rows) == 1 else ""
            self._progress(
                f"step {step}/{self._steps} loss {loss:.4f} tokens/s {tps:.0f} "
                f"({seconds:.3f}s/step{first}, t+{time.monotonic() - self._created:.0f}s)"
            )


@dataclass(frozen=True)
class StepTimes:
    """An attempt's step times: its first step (which compiles) apart from the steady ones after it."""

    first_step_seconds: float | None
    compile_seconds: float | None  # the first step beyond a steady (median) step
    mean_step_seconds: float | None
    median_step_seconds: float | None
    tokens_per_s: float | None  # the steady steps' tokens over their seconds (the mean rate)
    median_tokens_per_s: float | None


def step_times(rows: list[StepRow]) -> StepTimes:
    """The figures of an attempt's rows: the steps after its first are the steady ones (None where none)."""
    first, steady = rows[:1], rows[1:]
    if not steady:
        return StepTimes(first[0].seconds if first else None, None, None, None, None, None)
    median = statistics.median(r.seconds for r in steady)
    seconds = sum(r.seconds for r in steady)
    return StepTimes(
        first_step_seconds=first[0].seconds,
        compile_seconds=max(first[0].seconds - median, 0.0),
        mean_step_seconds=seconds / len(steady),
        median_step_seconds=median,
        tokens_per_s=sum(r.tokens for r in steady) / seconds,
        median_tokens_per_s=statistics.median(r.tokens_per_s for r in steady),
    )


def write_loss_csv(path: Path, rows: list[StepRow]) -> None:
    """loss.csv: this attempt's steps: loss, tokens per second, wall seconds and tokens of each (the first
    step's seconds include compiling it)."""
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "loss", "tokens_per_s", "seconds", "tokens"])
        for step, loss, tps, seconds, tokens in rows:
            w.writerow([step, f"{loss:.6f}", f"{tps:.1f}", f"{seconds:.4f}", tokens])
