"""loraflow's training hooks: MaxText's SFT hooks, plus the step log and checkpoint persistence.

MaxText's ``setup_trainer_state`` builds ``hooks.SFTTrainingHooks(config, mesh, schedule, recorder)``;
:mod:`loraflow.trainer.setup` has it build :class:`LoraflowHooks` instead. Imports MaxText: imported
only once the step program has loaded it.
"""

from __future__ import annotations

from typing import Any

from maxtext.trainers.post_train.sft.hooks import SFTTrainingHooks

from loraflow.storage import checkpoint_sync
from loraflow.trainer.curves import TrainingCurves, device_memory, learning_rates, rate_at
from loraflow.trainer.sft_run import Progress
from loraflow.trainer.step_log import StepLog


class LoraflowHooks(SFTTrainingHooks):
    """Each step: the previous step's checkpoint persisted once Orbax finalised it, the step logged and,
    on the process that commits the artifact, its curves written."""

    def __init__(
        self,
        *args: Any,
        log: StepLog,
        syncer: checkpoint_sync.Syncer | checkpoint_sync.HostSyncer | None,
        curves: TrainingCurves | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.log = log
        self.syncer = syncer
        self.curves = curves
        # before the first step: at a step's end the schedule's computation would wait for the queued step
        self.rates = learning_rates(self.metric_logger.learning_rate_schedule, int(self.config.steps)) if curves else ()

    def on_train_step_start(self, train_ctx: Any) -> None:
        if self.syncer is not None:
            self.syncer.poll()  # the previous step's checkpoint, once Orbax has finalised it
        super().on_train_step_start(train_ctx)
        batch = train_ctx.data_hooks.train_batch
        self.log.step_started(tokens_in(batch["inputs_segmentation"]) if batch is not None else 0)

    def on_train_step_end(self, train_ctx: Any, train_step: int, train_loss: Any, step_time: float = 0.0) -> None:
        super().on_train_step_end(train_ctx, train_step, train_loss, step_time)
        self.log.step_ended(int(train_step), float(train_loss))  # float() waits for the step's result
        if self.curves is not None:
            rate = rate_at(self.rates, int(train_step))
            self.curves.step(self.log.rows[-1], rate, device_memory)  # read every MEMORY_EVERY steps


def tokens_in(segmentation: Any) -> int:
    """Non-padding tokens of a batch: counted on the host when this process holds the whole batch (no
    device computation to dispatch and wait for), else on the devices (a multi-host global array)."""
    import numpy as np

    if getattr(segmentation, "is_fully_addressable", True):
        return int(np.count_nonzero(np.asarray(segmentation)))
    import jax.numpy as jnp

    return int(jnp.sum(segmentation != 0))


def skip_trained_batches(trainer: Any, n: int, progress: Progress) -> None:
    """Tunix restores the step but MaxText's data hooks restart the iterator: skip what was trained."""
    if n <= 0:
        return
    hooks = trainer.data_hooks
    original = hooks.load_next_train_batch
    left = [n]

    def load(train_ctx: Any) -> Any:
        while left[0] > 0:
            hooks.train_data_loader.load_next_batch()
            left[0] -= 1
        return original(train_ctx)

    hooks.load_next_train_batch = load
    progress(f"resuming at step {n}: skipping the {n} batches already trained on")
