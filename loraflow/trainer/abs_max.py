"""qwix's abs-max calibration with the ``abs`` kept apart from the ``max``: the same scales, a third of the faults.

QLoRA's scales are qwix's ``max(abs(w))`` over each tile of a kernel. XLA's CPU backend hands the two to
YNNPACK as one fusion, which writes the bf16 ``abs`` of the whole kernel into a buffer it allocates on
every call (above glibc's 32 MiB mmap bound: mapped and unmapped each time) and then reduces it. In the
host build's quantize program (:mod:`loraflow.trainer.host_build`) faulting those fresh pages in was most
of the run's kernel time: at 3.6 B on this project's 2-core CPU 1.6 million faults a run, 4.4-5.9 s of
kernel time in 18-23 s of CPU. With an optimization barrier between the two, XLA computes the ``abs`` into
its own buffer, reused layer after layer: 0.54 million faults, 1.0-2.1 s of kernel time, the run 12.3,
14.2, 13.1 -> 9.7, 13.0, 12.5 s interleaved under load 1.5-3.4 (bench/notes.md section 13d).

While :func:`abs_apart` is open, qwix's ``calibrate`` takes an ``absmax`` calibration as qwix's own
``minmax`` calibration of the magnitudes ``abs(w)``, kept apart by the barrier: its ``max`` is the
abs-max, bit for bit (the largest magnitude, clipped at 0, which a magnitude is already; NaN stays NaN).
``tests/trainer/test_abs_max.py`` checks the values; any other calibration goes to qwix as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any


def apart(qwix_calibrate: Callable[[Any, Any], dict[str, Any]]) -> Callable[[Any, Any], dict[str, Any]]:
    """qwix's ``calibrate`` with an ``absmax`` calibration's ``abs`` kept apart from its ``max``."""
    import jax
    import jax.numpy as jnp

    def calibrate(array: Any, how: Any) -> dict[str, Any]:
        if how.calibration_method.lower() != "absmax":
            return qwix_calibrate(array, how)
        magnitudes = jax.lax.optimization_barrier(jnp.abs(array))
        return {"absmax": qwix_calibrate(magnitudes, dataclasses.replace(how, calibration_method="minmax"))["max"]}

    return calibrate


@contextlib.contextmanager
def abs_apart() -> Iterator[None]:
    """While open, qwix calibrates abs-max scales by :func:`apart` (see the module doc)."""
    from qwix._src.core import qarray

    qwix_calibrate = qarray.calibrate
    qarray.calibrate = apart(qwix_calibrate)
    try:
        yield
    finally:
        qarray.calibrate = qwix_calibrate
