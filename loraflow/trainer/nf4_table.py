"""qwix's nf4 quantization of bf16 weights looked up in a table: the same 4-bit values, a quarter less time.

QLoRA's nf4 (qwix) maps each scaled weight to the nearest of nf4's 16 levels, ``argmin(|levels - x|)``:
sixteen distances and a sixteen-way reduction per weight. In the host build's quantize program
(:mod:`loraflow.trainer.host_build`) that reduction was the largest part of the run: at 3.6 B on this
project's 2-core CPU the program ran 12.0-12.5 s with it, 9.1-9.2 s with the table (bench/notes.md
section 13d). The dummy forward pass costs nothing there: nothing it computes leaves the program, and
XLA drops it.

A bf16 weight has 65,536 possible bit patterns. :func:`by_table` has qwix's own function quantize every
one of them once (on the device given, the host's CPU: a few milliseconds), and while open makes qwix
look each scaled bf16 weight up in that table instead. The values are qwix's, bit for bit: the table
is qwix's function on every input it can receive, NaN, infinities and subnormals included
(``tests/trainer/test_nf4_table.py``). Weights of any other dtype (float32 models) go to qwix's function
as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any


def table(qwix_nf4: Callable[[Any], Any], device: Any) -> Any:
    """``qwix_nf4`` (qwix's ``fp_to_nf4``) of every bf16 value, run on ``device``, as a numpy uint8 array
    indexed by the value's 16 bits."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    every = jax.device_put(np.arange(1 << 16, dtype=np.uint16).view(jnp.bfloat16), device)
    return np.asarray(jax.jit(qwix_nf4)(every)).astype(np.uint8)


def looked_up(levels: Any, qwix_nf4: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """qwix's ``fp_to_nf4`` by ``levels`` (:func:`table`) for bf16 arrays; any other goes to ``qwix_nf4``."""
    import jax
    import jax.numpy as jnp

    def fp_to_nf4(array: Any) -> Any:
        if array.dtype != jnp.bfloat16:
            return qwix_nf4(array)
        return jnp.asarray(levels)[jax.lax.bitcast_convert_type(array, jnp.uint16)].astype(jnp.uint4)

    return fp_to_nf4


@contextlib.contextmanager
def by_table(device: Any) -> Iterator[None]:
    """While open, qwix quantizes bf16 values to nf4 by a table made on ``device`` (see the module doc)."""
    from qwix._src.core import numerics

    qwix_nf4 = numerics.fp_to_nf4
    numerics.fp_to_nf4 = looked_up(table(qwix_nf4, device), qwix_nf4)
    try:
        yield
    finally:
        numerics.fp_to_nf4 = qwix_nf4
