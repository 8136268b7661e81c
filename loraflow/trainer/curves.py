"""lora_sft's training curves as TensorBoard event files in its artifact (``tensorboard/``,
:mod:`loraflow.reporting.curves`).

Written as each step ends, from the same row ``loss.csv`` gets, so the curves and the CSV agree step by
step. MaxText's own writer is left off: it writes under ``{base_output_directory}/{run_name}/tensorboard``
(the staged checkpoints, not the artifact), with ``DECOUPLE_GCLOUD`` set into a folder of its installed
package, and times a step from hook to hook without waiting for its result (see
:class:`loraflow.trainer.step_log.StepLog`).

Tags: ``train/loss``, ``train/learning_rate`` (the rate the step's update used), ``perf/step_seconds``,
``perf/tokens_per_s`` and, where the backend reports device memory (TPU, GPU; not CPU),
``memory/hbm_in_use_gib`` and ``memory/hbm_peak_gib`` of the first local device, after step 1 and every
:data:`MEMORY_EVERY` th step only: on a TPU, reading the device's memory waits for the steps queued on it,
so a read every step kept the host from running ahead (issue 39: 1.5 B steps alternated 0.78 / 1.21 s on a
v5e chip instead of 0.57 / 0.64). The learning rates are computed once, before training
(:func:`learning_rates`), for the same reason.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from loraflow.reporting.curves import ScalarWriter, scalar_writer
from loraflow.trainer.step_log import StepRow

GIB = 2**30
#: the curves read the device's memory after step 1 and every this many steps (a read waits for the chip)
MEMORY_EVERY = 100


def reads_memory(step: int) -> bool:
    """Whether the curves read the device's memory after ``step`` (:data:`MEMORY_EVERY`)."""
    return step == 1 or step % MEMORY_EVERY == 0


def learning_rates(schedule: Callable[[Any], Any], steps: int) -> tuple[float, ...]:
    """The rate each update ``0 .. steps - 1`` uses, computed by one program before training starts.

    Evaluated at a step's end instead, the schedule's small computation lands on the device's queue behind
    the step the trainer has already dispatched, and reading it waits for that step: the host stops running
    ahead of the chip (issue 39: 1.5 B steps alternated 0.85 / 1.31 s on a v5e chip against 0.63 / 0.69 for
    MaxText's own entry point)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rates = np.asarray(jax.jit(jax.vmap(schedule))(jnp.arange(max(steps, 1))))
    return tuple(float(rate) for rate in rates)


def rate_at(rates: Sequence[float], step: int) -> float:
    """The rate step ``step`` (from 1) updated with: optax counts updates from 0, so step N used update N - 1's
    (the last rate past the schedule's end)."""
    return rates[min(max(step, 1), len(rates)) - 1]


class TrainingCurves:
    """Each step's scalars at the step's number."""

    def __init__(self, writer: ScalarWriter) -> None:
        self._writer = writer

    def step(self, row: StepRow, learning_rate: float, memory: Callable[[], Mapping[str, int] | None]) -> None:
        """The step's row, the learning rate its update used and, on the steps :func:`reads_memory` names,
        the device's memory stats ``memory()`` returns (None: none reported); never called on the others."""
        self._writer.add(step_scalars(row, learning_rate, memory() if reads_memory(row.step) else None), row.step)


def step_scalars(row: StepRow, learning_rate: float, memory: Mapping[str, int] | None) -> dict[str, float]:
    """The scalars of one step, by tag."""
    scalars = {
        "train/loss": row.loss,
        "train/learning_rate": learning_rate,
        "perf/step_seconds": row.seconds,
        "perf/tokens_per_s": row.tokens_per_s,
    }
    if memory and "bytes_in_use" in memory:
        scalars["memory/hbm_in_use_gib"] = memory["bytes_in_use"] / GIB
        scalars["memory/hbm_peak_gib"] = memory.get("peak_bytes_in_use", memory["bytes_in_use"]) / GIB
    return scalars


def device_memory() -> Mapping[str, int] | None:
    """The first local device's memory stats (``bytes_in_use``, ``peak_bytes_in_use``); None where the
    backend reports none (CPU)."""
    import jax

    return jax.local_devices()[0].memory_stats()


@contextlib.contextmanager
def training_curves(out: Path, writes: bool) -> Iterator[TrainingCurves | None]:
    """Curves into ``out/tensorboard`` while training runs; None on a process that does not commit the artifact."""
    if not writes:
        yield None
        return
    with scalar_writer(out) as writer:
        yield TrainingCurves(writer)
