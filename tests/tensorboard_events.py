"""Reading a stage's curves back (``tensorboard/`` event files) with TensorBoard's own reader."""

from __future__ import annotations

from pathlib import Path


def scalars(logdir: Path) -> dict[str, dict[int, float]]:
    """Every scalar of the event files in ``logdir``, by tag and step (float32, as stored)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
