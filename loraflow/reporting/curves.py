"""Curves where ML teams read them: TensorBoard event files in a stage's artifact (``tensorboard/``).

lora_sft writes one scalar per tag per training step (:mod:`loraflow.trainer.curves`); each evaluation
writes its scores at the evaluated model's training step (0 for the base model, :func:`evaluation_scalars`).
``tensorboard --logdir`` over a run's prefix shows them side by side, one TensorBoard run per stage;
over the pipeline's prefix, every run's. Written with tensorboardX's ``SummaryWriter`` (imported when a
writer opens: the trainer and serving environments have it, DAG parsing never pays for it); read back
with TensorBoard's reader (:func:`read_scalars`, the control environment) when the report logs the run
to Vertex AI Experiments.
"""

from __future__ import annotations

import contextlib
import shlex
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

TENSORBOARD = "tensorboard"  # the artifact's folder of event files


class ScalarWriter:
    """Scalars by tag at a step, into one event file."""

    def __init__(self, writer: Any) -> None:
        self._writer = writer

    def add(self, scalars: Mapping[str, float], step: int) -> None:
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, step)


@contextlib.contextmanager
def scalar_writer(out: Path) -> Iterator[ScalarWriter]:
    """A writer into ``out/tensorboard``, closed (its events flushed) when the block ends: before the
    step's manifest is written, so the manifest commits the event file with its checksum."""
    from tensorboardX import SummaryWriter

    writer = SummaryWriter(logdir=str(out / TENSORBOARD), flush_secs=30)
    try:
        yield ScalarWriter(writer)
    finally:
        writer.close()


def read_scalars(logdir: Path) -> dict[str, dict[int, float]]:
    """Every scalar of the event files in ``logdir``, by tag and step, read with TensorBoard's own reader
    (every point: no sampling; the report reads them for Vertex AI Experiments)."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={SCALARS: 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()[SCALARS]}


def trained_steps(model_manifest: Any) -> int:
    """The training steps of an evaluated model: merge_adapter records its adapter's (``adapter_steps``);
    a model without a manifest (the base checkpoint, a source URI) has none: 0."""
    if model_manifest is None:
        return 0
    return int(model_manifest.summary.get("adapter_steps") or 0)


def evaluation_scalars(
    rates: Mapping[str, float], guard: Mapping[str, Any] | None, suites: Mapping[str, Any] | None = None
) -> dict[str, float]:
    """An evaluation's scalars: ``eval/<metric>`` for each scored metric, with a guard set (metrics.json's
    ``guard``, which names the set) ``guard/accuracy``, and ``suite/<name>`` for each standard benchmark
    (metrics.json's ``suites``: its figure)."""
    scalars = {f"eval/{name}": float(value) for name, value in rates.items()}
    if guard is not None:
        scalars["guard/accuracy"] = float(guard["accuracy"])
    for name, entry in (suites or {}).items():
        scalars[f"suite/{name}"] = float(entry["value"])
    return scalars


def tensorboard_argv(
    tensorboard: str, logdir: str, emulator_host: str | None = None
) -> tuple[dict[str, str], list[str]]:
    """(environment, argv) of TensorBoard serving the curves under ``logdir`` (a run's or a pipeline's prefix)
    on 127.0.0.1. With a GCS emulator: its address, and TensorBoard's Python loader (``--load_fast false``),
    which reads gs:// through gcsfs and so honours the emulator (its Rust loader asks Google for a token)."""
    argv = [tensorboard, "--host", "127.0.0.1", "--logdir", logdir]
    if emulator_host is None:
        return {}, argv
    env = {"STORAGE_EMULATOR_HOST": emulator_host, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    return env, [*argv, "--load_fast", "false"]


def tensorboard_command(tensorboard: str, logdir: str, emulator_host: str | None = None) -> str:
    """:func:`tensorboard_argv` as one shell command line."""
    env, argv = tensorboard_argv(tensorboard, logdir, emulator_host)
    return shlex.join([*(f"{k}={v}" for k, v in env.items()), *argv])
