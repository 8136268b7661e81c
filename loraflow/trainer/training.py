"""One training run: MaxText's ``train_sft.train`` (setup_trainer_state, then train_model) run in-process
with loraflow's data, hooks, checkpoints and set-up (:mod:`loraflow.trainer.setup`) around it."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraflow.launchers import multihost
from loraflow.spec.tuning import Choice
from loraflow.trainer import answers
from loraflow.trainer.argv import sft_argv
from loraflow.trainer.checkpoints import checkpoint_storage
from loraflow.trainer.curves import TrainingCurves
from loraflow.trainer.data import TrainingSet, prepare, training_set, training_template
from loraflow.trainer.distributed import sharding_note
from loraflow.trainer.export import trained_adapter
from loraflow.trainer.maxtext_config import sft_config
from loraflow.trainer.memory import (
    Memory,
    StateBytes,
    compiled_step_bytes,
    remember_last_batch,
    state_bytes,
    state_note,
    step_note,
)
from loraflow.trainer.setup import quantization_note, setup_trainer
from loraflow.trainer.sft_run import SftRun
from loraflow.trainer.step_log import StepLog, StepRow
from loraflow.trainer.tuning import choose_remat


@dataclass(frozen=True)
class Trained:
    """What this attempt's training left for the step's outputs."""

    mt_config: Any  # MaxText's config
    lora_tree: dict[str, Any]  # the trained adapter, numpy arrays (the whole of it, on every process)
    rows: list[StepRow]  # this attempt's steps
    start_step: int  # the step it resumed from (0: a fresh run)
    final_step: int
    local_ckpt: Path  # where Orbax wrote the checkpoints (staged)
    setup_seconds: float
    train_seconds: float
    memory: Memory
    chat_template: dict[str, Any]  # the template's summary: origin and digest
    answers: answers.Answers | None  # QLoRA: the trained model's own answers to the first eval prompts
    tuning: Choice | None = None  # training.tuning: auto: the remat policy chosen and the predictions
    data_failure: Exception | None = None  # the data pipeline's exception, which MaxText logs and ends the loop on


def train(sft: SftRun, dist: multihost.DistributedConfig | None, curves: TrainingCurves | None = None) -> Trained:
    """Train the adapter (resuming from the newest committed checkpoint), each step's scalars into ``curves``;
    the step program has imported MaxText."""
    from absl import flags
    from maxtext.trainers.post_train.sft import train_sft

    from loraflow.trainer.batches_ahead import close_data_workers, prepare_batches_ahead
    from loraflow.trainer.data_failure import stop_where_the_batches_end, watch_batches
    from loraflow.trainer.hooks import skip_trained_batches

    if not flags.FLAGS.is_parsed():  # grain reads absl flags; the harness parses its own argv
        flags.FLAGS.mark_as_parsed()
    train_set = training_set(sft.dataset)
    template = training_template(sft.dataset, sft.tokenizer, sft.progress)
    sft.progress(f"chat template: {template.origin} (sha256 {template.digest[:12]})")
    if answers.wanted(sft.cfg):
        answers.eval_file(sft.dataset)  # before hours of training, not after
    store = checkpoint_storage(sft, dist)
    choice = choose_remat(sft)  # training.tuning: auto (None: off)
    remat_policy = choice.policy if choice is not None else None
    mt_config = sft_config(maxtext_argv(sft, train_set, store.base_output, remat_policy))
    train_sft.validate_config(mt_config)
    if mt_config.grain_worker_count:
        sft.progress("training data rendered, tokenized and packed by MaxText's pipeline in a process of its own")

    started = time.monotonic()
    log = StepLog(sft.progress, sft.cfg.steps, sft.cfg.log_every)
    trainer, mesh = setup_trainer(sft.cfg, mt_config, store, log, curves, train_set.rows, sft.progress)
    last_batch = remember_last_batch(trainer)
    start_step = int(trainer.train_steps)
    state = state_bytes(trainer)
    _report_setup(sft, trainer, mesh, dist, state)
    end_data_workers = close_data_workers(trainer)
    skip_trained_batches(trainer, start_step, sft.progress)
    batches = prepare_batches_ahead(trainer, sft.progress)  # the accelerator does not wait for the host's data
    watched = watch_batches(trainer)  # a pipeline error MaxText swallows, kept for the stage's error
    if dist is not None:  # a host whose batches end early fails there: the others wait in a collective for it
        stop_where_the_batches_end(trainer, watched, sft.cfg.steps, sft.progress)
    sft.progress(
        f"set up in {time.monotonic() - started:.0f}s; training from step {start_step} to {sft.cfg.steps} "
        "(compiling first)"
    )
    t_train = time.monotonic()
    try:
        train_sft.train_model(mt_config, trainer, mesh)
    finally:
        if batches is not None:
            batches.close()
        end_data_workers()
    train_seconds = time.monotonic() - t_train
    if store.syncer is not None:
        store.syncer.poll()
    step = compiled_step_bytes(trainer, mesh, mt_config.logical_axis_rules, last_batch.get("batch"))
    if step is not None:
        sft.progress(step_note(step))
    eval_answers = _answer_eval_prompts(sft, trainer.model, mesh, mt_config)
    return Trained(
        mt_config=mt_config,
        lora_tree=trained_adapter(trainer, dist),
        rows=log.rows,
        start_step=start_step,
        final_step=int(trainer.train_steps),
        local_ckpt=store.local_ckpt,
        setup_seconds=t_train - started,
        train_seconds=train_seconds,
        memory=Memory(state, step),
        chat_template=template.summary(),
        answers=eval_answers,
        tuning=choice,
        data_failure=watched.failure,
    )


def maxtext_argv(sft: SftRun, train_set: TrainingSet, base_output: str, remat_policy: str | None = None) -> list[str]:
    """MaxText's ``train_sft`` command line for this run (with the remat policy tuning chose, and the data
    pipeline in a worker process on an accelerator: :func:`~loraflow.trainer.batches_ahead.data_workers`);
    first renders the examples and writes them in training order beside the training set."""
    from loraflow.trainer.batches_ahead import data_workers  # looked up when called: tests stand in for it

    data = prepare(sft.cfg, train_set, sft.tokenizer)
    return sft_argv(sft.cfg, sft.model, data, sft.tokenizer, base_output, remat_policy, data_workers())


def _report_setup(
    sft: SftRun,
    trainer: Any,
    mesh: Any,
    dist: multihost.DistributedConfig | None,
    state: StateBytes,
) -> None:
    """The task log's lines on what was set up: across the processes, quantized, its memory."""
    if dist is not None:
        sft.progress(sharding_note(trainer.model, mesh))
    sft.progress(quantization_note(sft.cfg, trainer.model) + "; " + state_note(state))


def _answer_eval_prompts(sft: SftRun, model: Any, mesh: Any, mt_config: Any) -> answers.Answers | None:
    """QLoRA: the trained model's own answers to the first eval prompts (the report's merge-cost row)."""
    if not answers.wanted(sft.cfg):
        return None
    return answers.answer_eval_prompts(
        model,
        mesh,
        mt_config.logical_axis_rules,
        sft.dataset,
        sft.tokenizer,
        sft.cfg.quantized_eval_examples,
        sft.cfg.max_new_tokens,
        sft.cfg.batch_size,
        sft.progress,
    )
