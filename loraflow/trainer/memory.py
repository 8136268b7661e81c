"""What training takes on a device: the training state, and the compiled train step (XLA's analysis).

Measured with ``on_device_size_in_bytes`` (:func:`loraflow.trainer.host_build.device_bytes`): ``nbytes``
misreports packed 4-bit arrays.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from loraflow.trainer import donation
from loraflow.trainer.host_build import device_bytes

MIB = 2**20


@dataclass(frozen=True)
class StateBytes:
    """Device bytes of the training state."""

    train_state_bytes: int  # the model and the optimizer's state
    model_bytes: int  # base weights (quantized or not) and the adapter
    adapter_bytes: int
    optimizer_bytes: int


@dataclass(frozen=True)
class StepBytes:
    """XLA's memory analysis of the compiled train step, per device."""

    step_argument_bytes: int  # model, optimizer state, batch
    step_output_bytes: int
    step_temp_bytes: int  # activations, gradients


@dataclass(frozen=True)
class Memory:
    state: StateBytes
    step: StepBytes | None  # None: no step ran (a resumed, finished run), or the backend has no analysis

    def summary(self) -> dict[str, int]:
        """The summary's ``*_bytes`` figures."""
        step = dataclasses.asdict(self.step) if self.step is not None else {}
        return {**dataclasses.asdict(self.state), **step}


def state_bytes(trainer: Any) -> StateBytes:
    """Device bytes of the training state: the model (base weights, quantized or not, and the adapter),
    the adapter alone, and the optimizer's state."""
    from flax import nnx

    model = device_bytes(nnx.state(trainer.model))
    optimizer = device_bytes(nnx.state(trainer.optimizer))
    adapter = device_bytes(nnx.state(trainer.model, nnx.LoRAParam))
    return StateBytes(model + optimizer, model, adapter, optimizer)


def remember_last_batch(trainer: Any) -> dict[str, Any]:
    """Make the trainer keep the last batch it prepared (under ``"batch"``): the compiled step's memory is
    read with it."""
    seen: dict[str, Any] = {}
    prepare = trainer._prepare_inputs  # pylint: disable=protected-access

    def remembering(example: Any) -> Any:
        seen["batch"] = prepared = prepare(example)
        return prepared

    trainer._prepare_inputs = remembering  # pylint: disable=protected-access
    return seen


def compiled_step_bytes(trainer: Any, mesh: Any, logical_axis_rules: Any, batch: Any) -> StepBytes | None:
    """XLA's memory analysis of the train step as this run compiled it (its shapes and shardings, per device);
    None when no step ran (no ``batch``). Read through the jit the trainer ran (:func:`trained_step`): JAX
    keeps that jit's lowering and executable in memory, so nothing compiles again. A fresh jit of the step
    (:func:`loraflow.trainer.donation.jit_train_step`) compiled it once more: 20 to 40 s for the tiny model on
    2 CPU cores on every host of a multi-host job but process 0, the only one that reads the persistent
    compilation cache (docs/architecture.md); that jit only where the trainer kept none."""
    if batch is None:
        return None
    import jax
    from flax.core.spmd import logical_axis_rules as axis_rules
    from tunix.sft import sharding_utils

    step = trained_step(trainer)
    if step is None:
        step = donation.jit_train_step(trainer)
    with jax.set_mesh(mesh), axis_rules(logical_axis_rules):
        sharded = sharding_utils.shard_input(batch, trainer.config.data_sharding_axis)
        stats = step.lower(trainer.model, trainer.optimizer, sharded).compile().memory_analysis()
    if stats is None:  # a backend without the analysis
        return None
    return StepBytes(int(stats.argument_size_in_bytes), int(stats.output_size_in_bytes), int(stats.temp_size_in_bytes))


def trained_step(trainer: Any) -> Any | None:
    """The ``nnx.jit`` of the train step Tunix's trainer ran (its ``_jitted_train_step_fn``: the jit bound to
    the model and optimizer by ``functools.partial``, through ``nnx.cached_partial`` where the graph is
    cached, as MaxText's ``train_model`` asks); None before a step was jitted."""
    bound = getattr(trainer, "_jitted_train_step_fn", None)  # pylint: disable=protected-access
    jitted = getattr(getattr(bound, "func", None), "__wrapped__", getattr(bound, "func", None))
    return jitted if hasattr(jitted, "lower") else None


def state_note(state: StateBytes) -> str:
    return (
        f"training state {state.train_state_bytes / MIB:.2f} MiB (model {state.model_bytes / MIB:.2f} MiB of which "
        f"adapter {state.adapter_bytes / MIB:.2f} MiB, optimizer {state.optimizer_bytes / MIB:.2f} MiB)"
    )


def step_note(step: StepBytes) -> str:
    return (
        f"compiled train step, per device: arguments {step.step_argument_bytes / MIB:.2f} MiB, "
        f"temporaries {step.step_temp_bytes / MIB:.2f} MiB, outputs {step.step_output_bytes / MIB:.2f} "
        "MiB (XLA's memory analysis)"
    )
