"""lora_sft's training curves as TensorBoard event files in its artifact (``tensorboard/``,
:mod:`loraflow.reporting.curves`).

Written as each step ends, from the same row ``loss.csv`` gets, so the curves and the CSV agree step by
step. MaxText's own writer is left off: it writes under ``{base_output_directory}/{run_name}/tensorboard``
(the staged checkpoints, not the artifact), with ``DECOUPLE_GCLOUD`` set into a folder of its installed
package, and times a step from hook to hook without waiting for its result (see
:class:`loraflow.trainer.step_log.StepLog`).

Tags: ``train/loss``, ``train/learning_rate`` (the rate the step's update used), ``perf/step_seconds``,
``perf/tokens_per_s`` and, where the backend reports device memory (TPU, GPU; not CPU),
``memory/hbm_in_use_gib`` and ``memory/hbm_peak_gib`` of the first local device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path

from loraflow.reporting.curves import ScalarWriter, scalar_writer
from loraflow.trainer.step_log import StepRow

GIB = 2**30


class TrainingCurves:
    """Each step's scalars at the step's number."""

    def __init__(self, writer: ScalarWriter) -> None:
        self._writer = writer

    def step(self, row: StepRow, learning_rate: float, memory: Mapping[str, int] | None) -> None:
        """The step's row, the learning rate its update used and the device's memory stats (None: none reported)."""
        self._writer.add(step_scalars(row, learning_rate, memory), row.step)


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
