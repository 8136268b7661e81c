"""loraflow.trainer.data_failure: a data pipeline that raises, or a batch MaxText's loader fails on after reading
it, is the stage's error, named, and not "data ran out"; a pipeline that really ran out keeps that message; a
host of a multi-host job fails at the batch it lacks instead of ending its loop.

MaxText's own data hooks and loader run here around a stand-in iterator (no model, no compilation); the tiny
model's run that stops on a failing pipeline is ``test_trainer_steps.py``'s."""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest

from loraflow.errors import LoraflowError
from loraflow.trainer.batches_ahead import prepare_batches_ahead
from loraflow.trainer.data_failure import (
    MESSAGE_CHARS,
    WatchedBatches,
    describe,
    stop_where_the_batches_end,
    stopped_early,
    traceback_lines,
    watch_batches,
)


class Pipeline:
    """Numbered batches; read ``fail_at`` raises ``error`` (each later read raises a new one); ``n``: the end."""

    def __init__(self, n: int | None = None, fail_at: int | None = None, error: Exception | None = None) -> None:
        self.n, self.fail_at, self.read = n, fail_at, 0
        self.error = error if error is not None else KeyError("content")

    def __iter__(self) -> Iterator[dict[str, int]]:
        return self

    def __next__(self) -> dict[str, int]:
        self.read += 1
        if self.fail_at is not None and self.read > self.fail_at:
            raise self.error if self.read == self.fail_at + 1 else RuntimeError(f"read {self.read} after the failure")
        if self.n is not None and self.read > self.n:
            raise StopIteration
        return {"batch": self.read - 1}


def test_batches_pass_unchanged_and_the_end_of_the_data_is_no_failure():
    watched = WatchedBatches(Pipeline(n=3))
    assert iter(watched) is watched
    assert [b["batch"] for b in watched] == [0, 1, 2]
    with pytest.raises(StopIteration):
        next(watched)
    assert watched.failure is None


def test_the_first_exception_is_kept_and_raised_on_as_it_was():
    error = ValueError("row 3: bad chat template")
    watched = WatchedBatches(Pipeline(fail_at=2, error=error))
    assert [next(watched)["batch"] for _ in range(2)] == [0, 1]
    with pytest.raises(ValueError) as raised:
        next(watched)
    assert raised.value is error and watched.failure is error
    with pytest.raises(RuntimeError, match="read 4 after the failure"):  # a later one is raised, not kept
        next(watched)
    assert watched.failure is error


def _maxtext_hooks(pipeline: Pipeline) -> object:
    """MaxText's SFT data hooks and data loader reading ``pipeline`` (built without MaxText's data pipeline
    and mesh: their ``__init__`` creates them), as the trainer holds them (``trainer.data_hooks``)."""
    from maxtext.common.data_loader import DataLoader
    from maxtext.trainers.post_train.sft.hooks import SFTDataHooks

    loader = DataLoader.__new__(DataLoader)
    loader.config = SimpleNamespace(
        reuse_example_batch=False, max_checkify=False, enable_diloco=False, elastic_enabled=False
    )
    loader.goodput_recorder = None
    loader.data_iterator = pipeline
    loader.last_batch = None
    loader.input_data_shardings = None
    hooks = SFTDataHooks.__new__(SFTDataHooks)
    hooks.train_data_loader, hooks.train_batch = loader, None
    return hooks


def _read_through_maxtext(pipeline: Pipeline, backend: str, reads: int) -> tuple[list[Any], WatchedBatches]:
    """``reads`` calls of MaxText's ``load_next_train_batch`` over ``pipeline``, read in the loop ("cpu") or
    ahead in a thread ("tpu"), with the watch under the loader; the batches (None where MaxText gave none)
    and the watch."""
    hooks = _maxtext_hooks(pipeline)
    trainer = SimpleNamespace(data_hooks=hooks)
    ahead = prepare_batches_ahead(trainer, lambda _: None, backend=backend)
    watched = watch_batches(trainer)
    assert hooks.train_data_loader.data_iterator is watched
    try:
        return [hooks.load_next_train_batch(None) for _ in range(reads)], watched
    finally:
        if ahead is not None:
            ahead.close()


@pytest.mark.parametrize("backend", ["cpu", "tpu"])  # in the loop; read ahead in a thread
def test_maxtext_swallows_the_pipeline_s_error_and_the_watch_keeps_it(backend):
    """MaxText's ``load_next_train_batch`` gives the loop the batches, then None (the loop's end) where the
    pipeline raised: the watch, over the loop's reader or over the thread reading ahead, keeps the exception."""
    pipeline = Pipeline(fail_at=3, error=UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"))
    got, watched = _read_through_maxtext(pipeline, backend, 4)
    assert [None if b is None else int(b["batch"]) for b in got] == [0, 1, 2, None]
    assert watched.failure is pipeline.error
    assert stopped_early(3, 10, watched.failure) == (
        "training stopped at step 3 of 10: the data pipeline failed: UnicodeDecodeError: 'utf-8' codec can't "
        "decode byte 0xff in position 0: invalid start byte (its traceback is in the task log above)"
    )


@pytest.mark.parametrize("backend", ["cpu", "tpu"])
def test_data_that_runs_out_is_no_failure_through_maxtext(backend):
    got, watched = _read_through_maxtext(Pipeline(n=2), backend, 3)
    assert got[2] is None and watched.failure is None
    assert stopped_early(2, 10, watched.failure) == "training stopped at step 2 of 10 (data ran out?)"


class TextAt(Pipeline):
    """Numbered batches, but read ``at`` gives a batch of text, which MaxText's ``jax.device_put`` rejects."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def __next__(self) -> dict[str, int]:
        batch = super().__next__()
        return {"batch": "text"} if self.read == self.at else batch  # type: ignore[dict-item]


@pytest.mark.parametrize("backend", ["cpu", "tpu"])
def test_a_batch_that_fails_after_it_was_read_is_the_failure_too(backend):
    """The pipeline gives a batch MaxText's loader cannot put on the devices (``jax.device_put`` in its
    ``load_next_batch``, inside the same ``except`` as the read): that error is kept, not "data ran out"."""
    got, watched = _read_through_maxtext(TextAt(3), backend, 3)
    assert [None if b is None else int(b["batch"]) for b in got] == [0, 1, None]
    assert isinstance(watched.failure, TypeError)
    assert stopped_early(2, 10, watched.failure) == (
        "training stopped at step 2 of 10: the data pipeline failed: TypeError: Argument 'text' of type <class "
        "'str'> is not a valid JAX type (its traceback is in the task log above)"
    )


def test_the_loader_s_watch_passes_its_arguments_on():
    """MaxText's ``RampUpDataLoader.load_next_batch`` takes ``rampup_manager=``; the watch hands on what it is
    given, and its result."""
    loader = SimpleNamespace(data_iterator=iter(()), load_next_batch=lambda *args, **kwargs: (args, kwargs))
    watch_batches(SimpleNamespace(data_hooks=SimpleNamespace(train_data_loader=loader)))
    assert loader.load_next_batch(1, rampup_manager=2) == ((1,), {"rampup_manager": 2})


def _host_of_a_job(pipeline: Pipeline, steps: int) -> tuple[Any, list[str]]:
    """MaxText's data hooks over ``pipeline``, watched, failing where the batches end (as on a host of a
    multi-host job); the hooks and the progress lines."""
    hooks = _maxtext_hooks(pipeline)
    trainer = SimpleNamespace(data_hooks=hooks)
    lines: list[str] = []
    stop_where_the_batches_end(trainer, watch_batches(trainer), steps, lines.append)
    return hooks, lines


def test_a_host_of_a_job_whose_pipeline_fails_fails_there_with_the_stage_s_error():
    """Where MaxText's hook would hand the loop None (which ends it, and Tunix would save and close while the
    other hosts wait in the next step's collective), the stage's error is raised, the traceback logged."""
    hooks, lines = _host_of_a_job(Pipeline(fail_at=2), steps=10)
    assert [hooks.load_next_train_batch(SimpleNamespace(train_steps=s))["batch"] for s in range(2)] == [0, 1]
    assert lines == []
    with pytest.raises(LoraflowError) as failed:
        hooks.load_next_train_batch(SimpleNamespace(train_steps=2))
    assert str(failed.value) == (
        "training stopped at step 2 of 10: the data pipeline failed: KeyError: 'content' (its traceback is in "
        "the task log above)"
    )
    assert lines[0] == "Traceback (most recent call last):" and lines[-1] == "KeyError: 'content'", lines


def test_a_host_of_a_job_whose_data_runs_out_early_fails_there_and_at_the_end_does_not():
    hooks, lines = _host_of_a_job(Pipeline(n=2), steps=3)
    assert [hooks.load_next_train_batch(SimpleNamespace(train_steps=s))["batch"] for s in range(2)] == [0, 1]
    with pytest.raises(LoraflowError, match=r"^training stopped at step 2 of 3 \(data ran out\?\)$"):
        hooks.load_next_train_batch(SimpleNamespace(train_steps=2))
    assert lines == []
    # the loop reads one batch more after its last step: none there ends the loop as before
    hooks, _ = _host_of_a_job(Pipeline(n=2), steps=2)
    assert [hooks.load_next_train_batch(SimpleNamespace(train_steps=s)) is None for s in range(3)] == [
        False,
        False,
        True,
    ]


def test_the_message_names_the_type_and_cuts_a_long_message():
    assert describe(KeyError("content")) == "KeyError: 'content'"
    assert describe(StopAsyncIteration()) == "StopAsyncIteration"  # no message: the type alone
    exact = "x" * MESSAGE_CHARS
    assert describe(ValueError(exact)) == f"ValueError: {exact}"
    long = "y" * (MESSAGE_CHARS + 1)
    assert describe(ValueError(long)) == f"ValueError: {'y' * MESSAGE_CHARS}... ({MESSAGE_CHARS + 1} characters)"
    assert MESSAGE_CHARS == 500


def test_the_traceback_s_lines_end_with_the_exception():
    try:
        Pipeline(fail_at=0, error=KeyError("content")).__next__()
    except KeyError as exc:
        lines = traceback_lines(exc)
    assert lines[0] == "Traceback (most recent call last):"
    assert any("in __next__" in line for line in lines) and lines[-1] == "KeyError: 'content'"
