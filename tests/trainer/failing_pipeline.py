"""``python failing_pipeline.py MODULE ARGS...``: ``every_host_caches.py``'s host (the step program ``MODULE``,
its compilations kept whatever its process id), whose training data pipeline raises at its N-th batch when
``LORAFLOW_TEST_PIPELINE_FAILS_AT=N``, as a tokenizer error or a bad row would: the failing iterator goes
under the loader's watch (``loraflow.trainer.data_failure``), as in ``test_trainer_steps.py``'s run of the
tiny model whose pipeline fails. Without the variable the host runs unchanged."""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Iterator
from typing import Any

import every_host_caches

from loraflow.trainer import data_failure

FAILS_AT = "LORAFLOW_TEST_PIPELINE_FAILS_AT"
MESSAGE = "row 13: the chat template has no 'tool' role"


class FailsAt:
    """``source``'s batches; the ``n``-th read raises ValueError(MESSAGE)."""

    def __init__(self, source: Iterator[Any], n: int) -> None:
        self.source, self.n, self.read = source, n, 0

    def __iter__(self) -> FailsAt:
        return self

    def __next__(self) -> Any:
        self.read += 1
        if self.read == self.n:
            raise ValueError(MESSAGE)
        return next(self.source)


def install(n: int) -> None:
    """training.train's watch reads the loader's iterator through :class:`FailsAt`."""
    watch = data_failure.watch_batches

    def failing_then_watched(trainer: Any) -> data_failure.WatchedBatches:
        loader = trainer.data_hooks.train_data_loader
        loader.data_iterator = FailsAt(loader.data_iterator, n)
        return watch(trainer)

    data_failure.watch_batches = failing_then_watched


if __name__ == "__main__":
    if os.environ.get(FAILS_AT):
        install(int(os.environ[FAILS_AT]))
    sys.path[0] = os.getcwd()  # not this folder: the step program's path as under ``python -m``
    every_host_caches.write_from_every_process()
    module, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
