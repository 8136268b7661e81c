"""The training data pipeline's failure, kept for the stage's error.

MaxText's SFT data hooks (``SFTDataHooks.load_next_train_batch``) catch any exception of the data pipeline (a
tokenizer error, a row the chat template cannot render, a grain or HF datasets error), log one line and hand
Tunix's loop no batch; the loop then ends as it does at the end of the data, and lora_sft saw only a run that
stopped early. :func:`watch_batches` puts a :class:`WatchedBatches` under the trainer's data loader, over
whatever it reads: MaxText's iterator on a CPU, :class:`~loraflow.trainer.batches_ahead.BatchesAhead` (which
raises the pipeline's exception at the ``next()`` where it came) on an accelerator. It keeps the first
exception and raises it on unchanged, so MaxText does what it did. It also watches the loader's
``load_next_batch``, which MaxText's hook calls inside that same ``except``: what fails there after the batch
was read (``jax.device_put`` of the batch onto the mesh's shardings, MaxText's checkify check of the batch) is
kept the same way. :func:`stopped_early` is the stage's error when training ends before its last step: the
exception, when there was one, else the data that ran out.

In a job of several processes a host whose batches end early must not leave the loop as MaxText would: Tunix
then saves its last checkpoint and closes, collectives the other hosts never join, while they wait in the
next step's collective for it. :func:`stop_where_the_batches_end` makes that host fail at that batch instead,
with the same error (docs/reliability.md).
"""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from typing import Any

from loraflow.errors import LoraflowError
from loraflow.trainer.batches_ahead import data_loader, read_batches_through
from loraflow.trainer.sft_run import Progress

MESSAGE_CHARS = 500  # of the exception's message in the stage's error (a row echoed whole could be megabytes)


class WatchedBatches:
    """``source``'s items as they are; the first exception a ``next()`` raised (not the end of the data) is
    kept in :attr:`failure` and raised on."""

    def __init__(self, source: Iterator[Any]) -> None:
        self._source = source
        self.failure: Exception | None = None
        self.ended = False  # the data ran out: a StopIteration came through

    def __iter__(self) -> WatchedBatches:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._source)
        except StopIteration:
            self.ended = True
            raise
        except Exception as exc:
            if self.failure is None:
                self.failure = exc
            raise


def watch_batches(trainer: Any) -> WatchedBatches:
    """The trainer's data loader (MaxText's ``data_hooks.train_data_loader``) reads its batches through a
    :class:`WatchedBatches`, and what its ``load_next_batch`` raises after a batch was read is that watch's
    failure too; call it after :func:`~loraflow.trainer.batches_ahead.prepare_batches_ahead`, whose reader it
    then watches."""
    watched = read_batches_through(trainer, WatchedBatches)
    loader = data_loader(trainer)
    load = loader.load_next_batch

    def load_next_batch(*args: Any, **kwargs: Any) -> Any:
        try:
            return load(*args, **kwargs)
        except Exception as exc:
            # the pipeline's own exception is kept where it was read (MaxText re-raises it as StopTraining),
            # and so is the end of the data: this is what failed after the read
            if watched.failure is None and not watched.ended:
                watched.failure = exc
            raise

    loader.load_next_batch = load_next_batch
    return watched


def stop_where_the_batches_end(trainer: Any, watched: WatchedBatches, steps: int, progress: Progress) -> None:
    """The trainer's data hooks raise the stage's error (:func:`stopped`) where the loop would get no batch
    before step ``steps``, instead of ending the loop: for a process of a multi-host job, whose loop's end
    (Tunix saves the last checkpoint and closes) the other processes, in the next step's collective, never
    join. The last batch's read (the loop reads one more after its last step) ends it as before."""
    hooks = trainer.data_hooks
    load = hooks.load_next_train_batch

    def load_next_train_batch(train_ctx: Any) -> Any:
        batch = load(train_ctx)
        step = int(train_ctx.train_steps)
        if batch is None and step < steps:
            raise stopped(step, steps, watched.failure, progress)
        return batch

    hooks.load_next_train_batch = load_next_train_batch


def stopped(final_step: int, steps: int, failure: BaseException | None, progress: Progress) -> LoraflowError:
    """The stage's error for training that ended at ``final_step`` of ``steps`` (:func:`stopped_early`); the
    failure's traceback, when there is one, goes to ``progress`` first, line by line."""
    if failure is not None:
        for line in traceback_lines(failure):
            progress(line)
    return LoraflowError(stopped_early(final_step, steps, failure))


def describe(exc: BaseException) -> str:
    """``Type: message``, the message cut to :data:`MESSAGE_CHARS` (and its length said); the type alone when
    the message is empty."""
    message = str(exc)
    if len(message) > MESSAGE_CHARS:
        message = f"{message[:MESSAGE_CHARS]}... ({len(message)} characters)"
    name = type(exc).__name__
    return f"{name}: {message}" if message else name


def stopped_early(final_step: int, steps: int, failure: BaseException | None) -> str:
    """The error of a run whose training ended at ``final_step`` of ``steps``: with a recorded ``failure`` of
    the data pipeline, that failure; without one, the data ran out."""
    stopped = f"training stopped at step {final_step} of {steps}"
    if failure is None:
        return f"{stopped} (data ran out?)"
    return f"{stopped}: the data pipeline failed: {describe(failure)} (its traceback is in the task log above)"


def traceback_lines(failure: BaseException) -> list[str]:
    """The failure's traceback as the task log's lines."""
    return "".join(traceback.format_exception(failure)).splitlines()
