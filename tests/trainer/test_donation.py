"""The train step donates the model as well as the optimizer (loraflow.trainer.donation), in Tunix's own
training loop: the frozen weights a step was given are written over, not copied, and training is otherwise
the same. That lora_sft's trainer runs this way is checked on its training in test_trainer_steps.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from tunix.sft import peft_trainer

from loraflow.errors import LoraflowError
from loraflow.trainer import donation


class Tiny(nnx.Module):
    """One frozen weight and a trainable LoRA delta."""

    def __init__(self) -> None:
        self.frozen = nnx.Param(jnp.full((4, 4), 0.5))
        self.lora = nnx.LoRAParam(jnp.zeros((4, 4)))

    def __call__(self, x: Any) -> Any:
        return x @ (self.frozen[...] + self.lora[...])


BATCH = {"x": jnp.asarray(np.arange(8, dtype=np.float32).reshape(2, 4) / 8), "y": jnp.ones((2, 4))}


def _trainer(model: Tiny, steps: int) -> Any:
    config = peft_trainer.TrainingConfig(eval_every_n_steps=1000, max_steps=steps)
    trainer = peft_trainer.PeftTrainer(model, optax.sgd(0.1), config)
    return trainer.with_loss_fn(lambda m, x, y: jnp.mean((m(x) - y) ** 2)).with_gen_model_input_fn(lambda b: b)


def _trained(donate: bool, steps: int = 3) -> tuple[Tiny, Any, list[str]]:
    """A Tiny trained ``steps`` steps by Tunix's PeftTrainer, the model donated or not; (model, its frozen
    array before training, progress lines)."""
    model = Tiny()
    before = model.frozen[...]
    trainer = _trainer(model, steps)
    said: list[str] = []
    if donate:
        donation.donate_the_model(trainer, said.append)
    trainer.train([BATCH] * steps)
    return model, before, said


def test_the_step_plan_fit_compiles_writes_the_whole_state_over_itself() -> None:
    """jit_train_step, what plan --fit and the task log's step figures compile: its outputs are written over
    the model and the optimizer it was given (XLA's memory analysis), as in the trainer's own step."""
    model = Tiny()
    trainer = _trainer(model, 1)
    stats = donation.jit_train_step(trainer).lower(model, trainer.optimizer, BATCH).compile().memory_analysis()
    state = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(nnx.state(model)))  # frozen + LoRA
    optimizer = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(nnx.state(trainer.optimizer)))
    assert stats.alias_size_in_bytes >= state + optimizer  # Tunix's own jit: the optimizer's alone


def test_the_frozen_weights_given_to_a_step_are_written_over_and_training_is_unchanged() -> None:
    donated, given, said = _trained(donate=True)
    kept, kept_given, _ = _trained(donate=False)
    assert given.is_deleted()  # written over by the step's output: no second copy
    assert not kept_given.is_deleted()  # Tunix's own jit donates the optimizer only
    assert said == ["train step jitted with model and optimizer donated: no copy of the frozen weights"]
    np.testing.assert_array_equal(np.asarray(donated.frozen[...]), np.full((4, 4), 0.5, np.float32))
    assert float(jnp.abs(donated.lora[...]).sum()) > 0  # the adapter trained ...
    np.testing.assert_array_equal(np.asarray(donated.lora[...]), np.asarray(kept.lora[...]))  # ... as before


class _NotTunix:
    """A trainer whose jit no longer donates the optimizer alone (a changed Tunix release)."""

    def __init__(self, donate_argnames: Any) -> None:
        self.donate_argnames = donate_argnames

    def jit_train_and_eval_step(self, skip_jit: bool = False, cache_nnx_graph: bool = False) -> Any:
        if skip_jit:
            return None, None
        return nnx.jit(lambda model, optimizer: 0, donate_argnames=self.donate_argnames), None


@pytest.mark.parametrize("argnames", [None, ("optimizer", "model"), "optimizer"])
def test_a_trainer_that_no_longer_donates_the_optimizer_alone_is_refused(argnames: Any) -> None:
    trainer = _NotTunix(argnames)
    donation.donate_the_model(trainer, print)
    with pytest.raises(LoraflowError, match=r"no longer jits its train step.*update it for this Tunix release"):
        trainer.jit_train_and_eval_step()
    assert trainer.jit_train_and_eval_step(skip_jit=True) == (None, None)  # nothing jitted: nothing to widen


def test_the_widened_jit_is_restored_afterwards() -> None:
    jit = nnx.jit
    _trained(donate=True, steps=1)
    assert nnx.jit is jit
