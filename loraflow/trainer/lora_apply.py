"""qwix's LoRA application traced under ``jax.jit`` instead of run eagerly: no copy of the frozen weights.

MaxText applies LoRA (and QLoRA) through ``qwix.apply_lora_to_model``, which runs the model once on
a dummy batch so that each targeted layer creates its LoRA factors (and, for QLoRA, its quantized
kernel). Run eagerly, that call goes through MaxText's layer scan, whose stacked output is a second
copy of every frozen weight of the layer stack while the first is still alive: a Llama-3.2-3B-shaped
model (7.2 GB in bf16) then runs out of a 16 GiB TPU chip before its first step, although training
it needs far less.

:func:`applied_under_jit` runs the same qwix call inside a traced function instead. Only what the
call creates or changes leaves that function (the LoRA factors, quantized kernels, RNG counters);
the frozen weights it passes through unchanged are taken back from the model as they are, so XLA
never materialises the scan's copy of them. The result is the same model state, value for value
(``tests/trainer/test_lora_apply.py``); what the traced program needs is reported in the task log.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

Progress = Callable[[str], None]

# XLA's while-loop invariant code motion (as in jaxlib 0.10.2's CPU compiler) hoists a per-layer
# conversion out of the layer scan as a conversion of the whole stack: QLoRA's quantization reads each
# layer's kernel in float32, and the hoisted program held every targeted kernel of every layer in
# float32 at once (27.2 GiB of scratch for an 8B model, 1.2 without the pass). The program runs once;
# the pass buys it nothing.
COMPILER_OPTIONS = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}


def _passes_through(old: Any, new: Any) -> bool:
    """Whether the traced call left a frozen weight as it found it (same kind, shape and dtype)."""
    from flax import nnx

    if old is None or type(old) is not type(new) or not isinstance(new, nnx.Param):
        return False
    before, after = old.get_value(), new.get_value()
    return getattr(before, "shape", None) == getattr(after, "shape", None) and getattr(
        before, "dtype", None
    ) == getattr(after, "dtype", None)


def _abstract(model: Any) -> bool:
    """Whether the model's arrays are tracers or shapes (``nnx.eval_shape``), not arrays."""
    import jax
    from flax import nnx

    return any(
        isinstance(leaf, (jax.core.Tracer, jax.ShapeDtypeStruct))
        for leaf in jax.tree_util.tree_leaves(nnx.state(model))
    )


def compiled(eager: Callable[..., Any], model: Any, provider: Any, **inputs: Any) -> tuple[Any, Any, Any, int]:
    """The compiled program of ``eager(model, provider, **inputs)`` (qwix's apply_lora_to_model
    signature) that returns only what the call creates or changes; with the state to run it on,
    ``finish(output)``, which makes the LoRA model from that program's output, and how many frozen
    weights pass through untouched. ``model`` may be abstract (``nnx.eval_shape``): nothing runs."""
    import jax
    from flax import nnx

    rngs = inputs.pop("rngs", None)  # split with the model: the LoRA initialisers draw from it
    graphdef, state = nnx.split((model, rngs))
    before = dict(nnx.to_flat_state(state))
    built: dict[str, Any] = {}

    def changed(state: Any) -> Any:
        traced_model, traced_rngs = nnx.merge(graphdef, state)
        lora_model = eager(traced_model, provider, rngs=traced_rngs, **inputs)
        built["graphdef"], after = nnx.split((lora_model, traced_rngs))
        flat = list(nnx.to_flat_state(after))
        built["paths"] = [path for path, _ in flat]
        built["kept"] = {path for path, var in flat if _passes_through(before.get(path), var)}
        return nnx.from_flat_state([(path, var) for path, var in flat if path not in built["kept"]])

    def finish(output: Any) -> Any:
        fresh = dict(nnx.to_flat_state(output))
        whole = nnx.from_flat_state([(p, before[p] if p in built["kept"] else fresh[p]) for p in built["paths"]])
        return nnx.merge(built["graphdef"], whole)[0]

    program = jax.jit(changed).lower(state).compile(compiler_options=COMPILER_OPTIONS)
    return program, state, finish, len(built["kept"])


def traced_apply(eager: Callable[..., Any], progress: Progress, model: Any, provider: Any, **inputs: Any) -> Any:
    """``eager(model, provider, **inputs)``, traced: see the module doc."""
    program, state, finish, kept = compiled(eager, model, provider, **inputs)
    lora_model = finish(program(state))
    memory = program.memory_analysis()
    if memory is not None:
        mib = 1 << 20
        progress(
            f"LoRA applied under jit: {memory.output_size_in_bytes / mib:.1f} MiB of new parameters, "
            f"{memory.temp_size_in_bytes / mib:.1f} MiB scratch; {kept} frozen weights kept, not copied"
        )
    return lora_model


@contextlib.contextmanager
def applied_under_jit(progress: Progress) -> Iterator[None]:
    """While open, ``qwix.apply_lora_to_model`` (what MaxText's LoRA set-up calls) is :func:`traced_apply`."""
    import qwix

    eager = qwix.apply_lora_to_model

    def apply(model: Any, provider: Any, **inputs: Any) -> Any:
        if _abstract(model):  # already traced (an abstract build): nothing to copy
            return eager(model, provider, **inputs)
        return traced_apply(eager, progress, model, provider, **inputs)

    qwix.apply_lora_to_model = apply
    try:
        yield
    finally:
        qwix.apply_lora_to_model = eager
