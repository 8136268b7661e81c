"""The trainer MaxText's ``setup_trainer_state`` builds, with loraflow's parts in place of some of its own.

* the hooks: :class:`loraflow.trainer.hooks.LoraflowHooks` (the step log, the curves, checkpoint persistence);
* staged checkpoints on several hosts: :class:`loraflow.trainer.per_host_checkpoints.PerHostCheckpointManager`;
* LoRA applied under ``jax.jit`` (:mod:`loraflow.trainer.lora_apply`): MaxText's eager application copies
  the frozen layer stack once more, which alone stops a 3B model fitting one 16 GiB chip;
* the train step donates the model as well as the optimizer (:mod:`loraflow.trainer.donation`): Tunix's
  step writes the unchanged frozen weights to new buffers, one more copy of the model on the chip;
* QLoRA on one chip: the model built in host memory (:mod:`loraflow.trainer.host_build`), so the chip
  never holds the full-precision model (MaxText's set-up does, which alone stops an 8B nf4 model fitting
  one 16 GiB chip). On several chips MaxText's set-up shards the full-precision model across them.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

from loraflow.errors import LoraflowError
from loraflow.spec.step_configs import LoraSftConfig
from loraflow.trainer import donation, host_build, lora_apply
from loraflow.trainer.checkpoints import Checkpoints
from loraflow.trainer.curves import TrainingCurves
from loraflow.trainer.sft_run import Progress
from loraflow.trainer.step_log import StepLog


def setup_trainer(
    cfg: LoraSftConfig,
    mt_config: Any,
    store: Checkpoints,
    log: StepLog,
    curves: TrainingCurves | None,
    rows: int,
    progress: Progress,
) -> tuple[Any, Any]:
    """MaxText's ``setup_trainer_state`` for ``mt_config`` (``rows`` examples): (trainer, mesh); its hooks
    log each step to ``log`` and ``curves``."""
    from maxtext.trainers.post_train.sft import hooks as sft_hooks
    from maxtext.trainers.post_train.sft import train_sft
    from tunix.sft import checkpoint_manager as tunix_checkpoints

    from loraflow.trainer.hooks import LoraflowHooks
    from loraflow.trainer.per_host_checkpoints import PerHostCheckpointManager

    original_hooks, original_manager = sft_hooks.SFTTrainingHooks, tunix_checkpoints.CheckpointManager
    # setup_trainer_state builds hooks.SFTTrainingHooks(...); Tunix's PeftTrainer checkpoint_manager.CheckpointManager(...)
    sft_hooks.SFTTrainingHooks = functools.partial(LoraflowHooks, log=log, syncer=store.syncer, curves=curves)
    if store.per_host:
        tunix_checkpoints.CheckpointManager = PerHostCheckpointManager
    try:
        progress(f"building the MaxText model and data pipeline ({rows} rows)")
        with (
            lora_apply.applied_under_jit(progress),  # no second copy of the frozen weights
            host_build.built_on_host(progress) if builds_on_host(cfg) else contextlib.nullcontext(),
        ):
            trainer, mesh = train_sft.setup_trainer_state(mt_config)
    finally:
        sft_hooks.SFTTrainingHooks, tunix_checkpoints.CheckpointManager = original_hooks, original_manager
    donation.donate_the_model(trainer, progress)
    return trainer, mesh


def builds_on_host(cfg: LoraSftConfig) -> bool:
    """QLoRA on one chip: the full-precision model is built and quantized in host memory."""
    import jax

    return cfg.quantization != "none" and jax.process_count() == 1 and jax.local_device_count() == 1


def quantized_kernels(model: Any) -> dict[str, str]:
    """``{kernel path: stored dtype}`` of the kernels qwix holds quantized (QLoRA); empty for LoRA."""
    import jax
    from flax import nnx

    found = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]:
        name = "/".join(str(getattr(p, "key", getattr(p, "name", p))) for p in path)
        if "/qvalue" in name:
            found[name.split("/kernel/")[0]] = str(leaf.dtype)
    return found


def quantization_note(cfg: LoraSftConfig, model: Any) -> str:
    """Which kernels hold their base weights quantized, to what (the task log's QLoRA line); refuses a
    QLoRA model with none."""
    kernels = quantized_kernels(model)
    if cfg.quantization == "none":
        return "LoRA: base weights in full precision"
    if not kernels:
        raise LoraflowError(
            f"lora.quantization {cfg.quantization} was asked for, but no kernel was quantized: check "
            "lora.target_modules matches the model's projections"
        )
    tile = f"tiles of {cfg.tile_size}" if cfg.tile_size is not None else "one scale per channel"
    stored = ", ".join(sorted(set(kernels.values())))
    return (
        f"QLoRA: {len(kernels)} kernel stacks hold their base weights as {cfg.quantization} ({stored}, {tile}): "
        f"{', '.join(sorted(kernels))}; embeddings, LM head and norms stay full precision"
    )
