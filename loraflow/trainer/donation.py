"""The train step donates the model as well as the optimizer: no second copy of the frozen weights.

Tunix jits its train step (``PeftTrainer.jit_train_and_eval_step``) with the optimizer donated, not the
model. The step returns the model (the adapter updated, the frozen weights unchanged), and XLA may write
an output only over an argument it was given to write over: every step the chip holds the model twice,
the one passed in and the one returned (on a v5e chip 2.8 GiB more at 1.5 B LoRA, 5.5 GiB at 8B nf4), and
while Tunix keeps a second step queued, a third time. With the model donated too, XLA writes the returned
model over the one passed in: the step's peak is the training state, the batch and its temporaries.

nnx updates the model in place, so what the trainer, its hooks and the export read after a step is the
step's output, never a donated buffer; Tunix's checkpoints save the donated optimizer the same way.

:func:`jit_train_step` is the one jit of the step: the trainer runs it (:func:`donate_the_model`), and
``plan --fit`` (:mod:`loraflow.trainer.fit`) compiles it; the task log's compiled-step figures
(:mod:`loraflow.trainer.memory`) are read from the one the trainer ran.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from loraflow.errors import LoraflowError

#: the train step's arguments XLA may write its outputs over (Tunix's own: the optimizer only)
DONATED = ("model", "optimizer")
#: how Tunix's PeftTrainer jits its train step (``donate_argnames``), which :func:`donate_the_model` widens
TUNIX_DONATED = ("optimizer",)


def jit_train_step(trainer: Any) -> Any:
    """The trainer's train step (``nnx.jit``) with :data:`DONATED` donated."""
    from flax import nnx

    return nnx.jit(trainer.create_train_step_fn(), donate_argnames=DONATED)


def donate_the_model(trainer: Any, progress: Callable[[str], None]) -> None:
    """Make ``trainer`` (Tunix's ``PeftTrainer``) jit its train step as :func:`jit_train_step` does: its own
    ``jit_train_and_eval_step`` runs with ``nnx.jit`` widening the step's donation to :data:`DONATED`
    (said once in ``progress``).
    Refuses to train, naming the fix, when that method no longer jits a step donating the optimizer alone
    (a Tunix release that changed it): the chip would otherwise hold a copy of the model more than
    ``plan --fit`` predicts."""
    from flax import nnx

    tunix_jit = trainer.jit_train_and_eval_step
    widened: list[Any] = []

    def jit_train_and_eval_step(skip_jit: bool = False, cache_nnx_graph: bool = False) -> Any:
        jit = nnx.jit

        def donating(*args: Any, donate_argnames: Any = None, **kwargs: Any) -> Any:
            if donate_argnames == TUNIX_DONATED:
                if not widened:
                    progress(f"train step jitted with {' and '.join(DONATED)} donated: no copy of the frozen weights")
                widened.append(args)
                donate_argnames = DONATED
            return jit(*args, donate_argnames=donate_argnames, **kwargs)

        nnx.jit = donating  # type: ignore[assignment]
        try:
            steps = tunix_jit(skip_jit, cache_nnx_graph)
        finally:
            nnx.jit = jit  # type: ignore[assignment]
        if not skip_jit and not widened:
            raise LoraflowError(
                "Tunix's PeftTrainer no longer jits its train step with donate_argnames=('optimizer',): "
                "loraflow.trainer.donation cannot donate the model; update it for this Tunix release"
            )
        return steps

    trainer.jit_train_and_eval_step = jit_train_and_eval_step
