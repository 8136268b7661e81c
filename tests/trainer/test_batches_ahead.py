"""loraflow.trainer.batches_ahead: the training batches read ahead of the step in a background thread give the
loop what the pipeline gave it, in its order, with its end and its errors, and leave no thread behind."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from loraflow.trainer.batches_ahead import (
    AHEAD,
    BatchesAhead,
    close_data_workers,
    data_workers,
    prepare_batches_ahead,
)

WAIT_S = 10.0  # the longest any test waits for the thread (it needs milliseconds)


class Source:
    """``n`` numbered batches (dicts, as MaxText's are), counting how many were read; ``fail_at``: that read
    raises instead."""

    def __init__(self, n: int | None, fail_at: int | None = None) -> None:
        self.n, self.fail_at, self.read = n, fail_at, 0

    def __iter__(self) -> Iterator[dict[str, int]]:
        return self

    def __next__(self) -> dict[str, int]:
        if self.read == self.fail_at:
            self.read += 1
            raise ValueError(f"row {self.fail_at}: bad chat template")
        if self.n is not None and self.read >= self.n:
            raise StopIteration
        self.read += 1
        return {"batch": self.read - 1}


def _until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def _threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "loraflow-batches-ahead"]


def _next_within(it: BatchesAhead) -> object:
    """``next(it)`` in a thread of its own, so that a hang fails the test instead of stopping the run."""
    got: list[object] = []

    def take() -> None:
        try:
            got.append(next(it))
        except BaseException as exc:
            got.append(exc)

    taker = threading.Thread(target=take, daemon=True)
    taker.start()
    taker.join(WAIT_S)
    assert not taker.is_alive(), "next() hung"
    return got[0]


def test_the_loop_gets_every_batch_in_order_then_the_end_every_time_it_asks():
    it = BatchesAhead(Source(50))
    assert iter(it) is it
    assert [next(it)["batch"] for _ in range(50)] == list(range(50))
    for _ in range(3):  # the end of the data, again and again, without waiting
        assert isinstance(_next_within(it), StopIteration)
    _until(lambda: not it.reading, "the thread did not end with the data")
    assert list(BatchesAhead(Source(7), ahead=1)) == [{"batch": i} for i in range(7)]


def test_nothing_is_read_before_the_loop_asks_then_ahead_batches_are_ready_while_it_steps():
    source = Source(None)
    it = BatchesAhead(source, ahead=3)
    time.sleep(0.2)
    assert source.read == 0 and not it.reading  # MaxText's iterator restarts on iter() while unread
    assert next(it) == {"batch": 0}
    # while the loop runs its step: 3 batches in the queue and a 4th prepared, waiting for room
    _until(lambda: source.read == 1 + 3 + 1, f"read {source.read} ahead")
    time.sleep(0.2)
    assert source.read == 5  # bounded: no more than that
    assert next(it) == {"batch": 1}
    _until(lambda: source.read == 6, "did not refill")
    it.close()


def test_a_pipeline_error_reaches_the_loop_where_it_came_with_its_message_and_stops_the_thread():
    source = Source(None, fail_at=3)
    it = BatchesAhead(source)
    assert [next(it)["batch"] for _ in range(3)] == [0, 1, 2]
    for _ in range(2):  # asked again: the same error, no hang
        error = _next_within(it)
        assert isinstance(error, ValueError) and str(error) == "row 3: bad chat template"
    _until(lambda: not it.reading, "the thread outlived the error")
    assert source.read == 4  # nothing read past the error


def test_close_ends_a_thread_waiting_for_room_and_a_closed_reader_starts_none():
    before = len(_threads())
    it = BatchesAhead(Source(None))
    assert next(it) == {"batch": 0}
    _until(lambda: it._ready.full(), "never filled")
    assert len(_threads()) == before + 1 and _threads()[-1].daemon  # a hung pipeline never holds the process
    started = time.monotonic()
    it.close()
    assert time.monotonic() - started < 2.0
    assert not it.reading and len(_threads()) == before
    unused = BatchesAhead(Source(3))
    unused.close()
    with pytest.raises(RuntimeError, match=r"^BatchesAhead was closed$"):
        next(unused)
    assert len(_threads()) == before


def test_close_waits_no_longer_than_its_timeout_for_a_pipeline_that_hangs():
    stuck = threading.Event()

    class Hanging(Source):
        def __next__(self) -> dict[str, int]:
            if self.read == 1:
                stuck.wait()  # until the test ends
            return super().__next__()

    it = BatchesAhead(Hanging(None))
    assert next(it) == {"batch": 0}
    closing = threading.Thread(target=it.close, kwargs={"timeout": 0.2}, daemon=True)
    closing.start()
    closing.join(WAIT_S)
    assert not closing.is_alive(), "close() waited for the hung pipeline"
    assert it.reading  # still stuck in the pipeline: a daemon, left behind
    stuck.set()
    _until(lambda: not it.reading, "the thread did not end once the pipeline returned")


def test_ahead_must_be_at_least_one():
    with pytest.raises(ValueError, match="at least 1"):
        BatchesAhead(Source(1), ahead=0)


def test_the_trainer_s_data_loader_reads_through_it_and_the_log_says_so_once():
    source = Source(4)
    loader = SimpleNamespace(data_iterator=source)
    trainer = SimpleNamespace(data_hooks=SimpleNamespace(train_data_loader=loader))
    said: list[str] = []
    batches = prepare_batches_ahead(trainer, said.append, backend="tpu")
    assert batches is not None and loader.data_iterator is batches and batches.ahead == AHEAD == 2
    assert said == ["training batches prepared 2 ahead of the step, in a background thread"]
    assert [next(loader.data_iterator)["batch"] for _ in range(4)] == [0, 1, 2, 3]
    batches.close()
    assert not batches.reading
    loader.data_iterator = Source(1)
    three = prepare_batches_ahead(trainer, said.append, ahead=3, backend="gpu")
    assert (
        three is not None
        and three.ahead == 3
        and said[-1] == "training batches prepared 3 ahead of the step, in a background thread"
    )
    three.close()


def test_on_a_cpu_the_loop_prepares_its_batches_itself_and_says_so():
    """JAX's default backend decides (CPU here): the step computes on the cores a thread would take."""
    source = Source(3)
    loader = SimpleNamespace(data_iterator=source)
    trainer = SimpleNamespace(data_hooks=SimpleNamespace(train_data_loader=loader))
    said: list[str] = []
    for backend in ("cpu", None):
        assert prepare_batches_ahead(trainer, said.append, backend=backend) is None
    assert loader.data_iterator is source and source.read == 0
    cpu = "training batches prepared in the loop: the step runs on this host's CPU, whose cores a thread reading ahead would take"
    assert said == [cpu, cpu]


def test_maxtext_s_pipeline_gets_one_worker_process_on_an_accelerator_and_none_on_a_cpu():
    """One: MaxText's HF pipeline repeats its data with more (each worker reads it all); none where the step
    computes on the host's own cores (JAX's default backend decides: CPU here)."""
    assert [data_workers(b) for b in ("tpu", "gpu", "cpu", None)] == [1, 1, 0, 0]


def test_the_worker_is_ended_through_the_iterator_maxtext_built_not_whatever_wraps_it_later():
    closed: list[str] = []
    iterator = SimpleNamespace(close=lambda: closed.append("maxtext's"))
    loader = SimpleNamespace(data_iterator=iterator)
    trainer = SimpleNamespace(data_hooks=SimpleNamespace(train_data_loader=loader))
    end = close_data_workers(trainer)
    loader.data_iterator = BatchesAhead(Source(1))  # what lora_sft puts over it afterwards
    assert closed == []
    end()
    assert closed == ["maxtext's"]
    loader.data_iterator = Source(1)  # an iterator with no close (no worker): nothing to end
    close_data_workers(trainer)()
