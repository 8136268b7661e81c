"""``training.tuning: auto`` in lora_sft: the remat policy chosen before the set-up, on the devices here.

Each candidate (:data:`loraflow.spec.tuning.CANDIDATES`, most kept first) is predicted as ``plan --fit``
predicts a slice (:func:`loraflow.trainer.fit.predict_here`: the stage's train step compiled from shapes,
no weight allocated, for the devices JAX has, with ``remat_policy=<candidate>`` appended to the stage's
training settings), until one fits the device's memory (``bytes_limit``), and none after it: one compile
per candidate tried. The choice (:func:`loraflow.spec.tuning.tune`) reaches MaxText's command line
through :func:`loraflow.trainer.argv.training_args`. Devices that report no memory limit (JAX on CPU)
get the first candidate without any compile. Every process of a job compiles the same programs for
the same devices and so chooses the same policy.
"""

from __future__ import annotations

import time

from loraflow.spec import tuning
from loraflow.trainer.curves import device_memory
from loraflow.trainer.sft_run import SftRun


def device_memory_limit() -> int | None:
    """The bytes a program may use on this process's first device (``bytes_limit``); None when the
    device reports none (JAX's CPU devices)."""
    limit = (device_memory() or {}).get("bytes_limit")
    return int(limit) if limit else None


def choose_remat(sft: SftRun) -> tuning.Choice | None:
    """With ``training.tuning: auto``: the remat policy to train with (said in the task log); None when off."""
    if sft.cfg.tuning != "auto":
        return None
    from loraflow.trainer import fit

    model = sft.model

    def peak_of(policy: str) -> int:
        return fit.predict_here(sft.cfg, model.name, dict(model.overrides), model.scan_layers, policy).peak_bytes

    started = time.monotonic()
    choice = tuning.tune(peak_of, device_memory_limit())
    n = len(choice.peaks)
    compiled = f"; {n} compile{'s' if n > 1 else ''} in {time.monotonic() - started:.0f}s" if n else ""
    sft.progress(choice.note() + compiled)
    return choice
