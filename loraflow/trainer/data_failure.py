"""The training data pipeline's failure, kept for the stage's error.

MaxText's SFT data hooks (``SFTDataHooks.load_next_train_batch``) catch any exception of the data pipeline (a
tokenizer error, a row the chat template cannot render, a grain or HF datasets error), log one line and hand
Tunix's loop no batch; the loop then ends as it does at the end of the data, and lora_sft saw only a run that
stopped early. :func:`watch_batches` puts a :class:`WatchedBatches` under the trainer's data loader, over
whatever it reads: MaxText's iterator on a CPU, :class:`~loraflow.trainer.batches_ahead.BatchesAhead` (which
raises the pipeline's exception at the ``next()`` where it came) on an accelerator. It keeps the first
exception and raises it on unchanged, so MaxText does what it did. :func:`stopped_early` is the stage's error
when training ends before its last step: the exception, when there was one, else the data that ran out.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from typing import Any

from loraflow.trainer.batches_ahead import read_batches_through

MESSAGE_CHARS = 500  # of the exception's message in the stage's error (a row echoed whole could be megabytes)


class WatchedBatches:
    """``source``'s items as they are; the first exception a ``next()`` raised (not the end of the data) is
    kept in :attr:`failure` and raised on."""

    def __init__(self, source: Iterator[Any]) -> None:
        self._source = source
        self.failure: Exception | None = None

    def __iter__(self) -> WatchedBatches:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._source)
        except StopIteration:
            raise
        except Exception as exc:
            if self.failure is None:
                self.failure = exc
            raise


def watch_batches(trainer: Any) -> WatchedBatches:
    """The trainer's data loader (MaxText's ``data_hooks.train_data_loader``) reads its batches through a
    :class:`WatchedBatches`; call it after :func:`~loraflow.trainer.batches_ahead.prepare_batches_ahead`,
    whose reader it then watches."""
    return read_batches_through(trainer, WatchedBatches)


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
