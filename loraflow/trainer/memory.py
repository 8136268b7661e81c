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
    """XLA's memory analysis of the train step compiled for this run's shapes and shardings (per device).
    One more compilation of the step (not run); None when no step ran (no ``batch``)."""
    if batch is None:
        return None
    import jax
    from flax.core.spmd import logical_axis_rules as axis_rules
    from tunix.sft import sharding_utils

    with jax.set_mesh(mesh), axis_rules(logical_axis_rules):
        sharded = sharding_utils.shard_input(batch, trainer.config.data_sharding_axis)
        stats = (
            donation.jit_train_step(trainer)
            .lower(trainer.model, trainer.optimizer, sharded)
            .compile()
            .memory_analysis()
        )
    if stats is None:  # a backend without the analysis
        return None
    return StepBytes(int(stats.argument_size_in_bytes), int(stats.output_size_in_bytes), int(stats.temp_size_in_bytes))


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
