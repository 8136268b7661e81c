"""The training batches prepared ahead of the step, in a background thread.

MaxText's SFT data pipeline (``dataset_type=hf`` with ``grain_worker_count=0``) renders, tokenizes and packs
each batch when the training loop asks for it, in the loop's own thread: the chip waits for it between steps.
Packed batches of short examples cost the host a varying time each (1.5 B LoRA case on a CPU: 0.13 to 1.1 s
a batch, alternating; bench/notes.md), so on a v5e chip every second step waited ~0.2 s. What it cannot hide
is Python work in the pipeline that holds the interpreter lock the loop needs to dispatch the next step: the
pipeline tokenizes lazily in chunks of 1,000 examples, and with 16 batches ahead instead of 2 the tiny model's
step at each chunk still took 0.38 s against 0.033 on a v5e chip (bench/notes.md section 14).
:class:`BatchesAhead` reads the same iterator in one thread of its own, at most ``ahead`` batches before the
loop: the loop gets the same batches in the same order, an exception of the pipeline at the ``next()`` where
it would have come, and ``StopIteration`` at the end of the data. :func:`prepare_batches_ahead` puts it under
the trainer's data loader when the step runs on an accelerator (on a CPU the step needs the cores the thread
would take); :meth:`BatchesAhead.close` ends the thread once training is over.

On an accelerator the pipeline itself also runs in a process of its own (:func:`data_workers`: grain's one
worker process, MaxText's own default, which loraflow had turned off): the rendering, tokenizing and packing
then never hold this process's interpreter lock, and the thread here only receives finished batches and puts
them on the mesh. grain starts that process by ``spawn``, not ``fork``: it is a fresh interpreter that never
holds the accelerator. It yields the same batches in the same order (``tests/trainer``: loss.csv equal as
text); :func:`close_data_workers` ends it with training.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

AHEAD = 2  # batches ready before the loop asks (each a few hundred KiB for 8 x 1,024 tokens)
WORKERS = 1  # MaxText's HF pipeline takes 0 or 1 (more would repeat the data: each worker reads it all)
_PUT_WAIT_S = 0.1  # how often a thread waiting for room checks whether it was closed
_END = object()  # the source ran dry
Reader = TypeVar("Reader", bound=Iterator[Any])


class BatchesAhead:
    """An iterator over ``source``'s items, read ``ahead`` items early by a daemon thread started on the first
    ``next()`` (not before: MaxText's iterator restarts on ``iter()`` while nothing was read from it)."""

    def __init__(self, source: Iterator[Any], ahead: int = AHEAD) -> None:
        if ahead < 1:
            raise ValueError(f"ahead must be at least 1, not {ahead}")
        self.ahead = ahead
        self._source = source
        self._ready: queue.Queue[Any] = queue.Queue(maxsize=ahead)
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._last: Any = None  # _END or the exception that ended the source, once taken

    def __iter__(self) -> BatchesAhead:
        return self

    def __next__(self) -> Any:
        if self._last is not None:  # ended: the same end every time, without waiting for a thread
            return self._raise(self._last)
        if self._thread is None:
            if self._closed.is_set():
                raise RuntimeError("BatchesAhead was closed")
            self._thread = threading.Thread(target=self._fill, name="loraflow-batches-ahead", daemon=True)
            self._thread.start()
        item = self._ready.get()
        if item is _END or isinstance(item, BaseException):
            self._last = item
            return self._raise(item)
        return item

    @staticmethod
    def _raise(end: Any) -> Any:
        if end is _END:
            raise StopIteration
        raise end

    def _fill(self) -> None:
        while not self._closed.is_set():
            try:
                item = next(self._source)
            except StopIteration:
                item = _END
            except BaseException as exc:  # handed to the loop, raised there
                item = exc
            self._put(item)
            if item is _END or isinstance(item, BaseException):
                return

    def _put(self, item: Any) -> None:
        """Wait for room for ``item``, or until closed."""
        while not self._closed.is_set():
            try:
                self._ready.put(item, timeout=_PUT_WAIT_S)
                return
            except queue.Full:
                continue

    def close(self, timeout: float = 60.0) -> None:
        """Stop reading ahead and wait (up to ``timeout`` s: the batch being prepared) for the thread to end."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def reading(self) -> bool:
        """Whether the thread is alive."""
        return self._thread is not None and self._thread.is_alive()


def prepare_batches_ahead(
    trainer: Any, progress: Callable[[str], None], ahead: int = AHEAD, backend: str | None = None
) -> BatchesAhead | None:
    """The trainer's data loader (MaxText's ``data_hooks.train_data_loader``) reads its iterator through a
    :class:`BatchesAhead` when the step runs on an accelerator (``backend``: JAX's default); said once in
    ``progress``. Close it after training. None on a CPU backend: there the step computes on the same cores
    the thread would take (the tiny model's steps: 65 ms median without it, 77-89 ms with it, bench/notes.md
    section 11), and the batches are prepared in the loop as MaxText does."""
    if _on_cpu(backend):
        progress(
            "training batches prepared in the loop: the step runs on this host's CPU, whose cores a thread reading ahead would take"
        )
        return None
    batches = read_batches_through(trainer, lambda source: BatchesAhead(source, ahead))
    progress(f"training batches prepared {ahead} ahead of the step, in a background thread")
    return batches


def data_workers(backend: str | None = None) -> int:
    """grain's worker processes for MaxText's data pipeline (its ``grain_worker_count``): :data:`WORKERS` when
    the step runs on an accelerator (``backend``: JAX's default), 0 on a CPU backend, for the reason
    :func:`prepare_batches_ahead` gives (the process would take the step's cores)."""
    return 0 if _on_cpu(backend) else WORKERS


def _on_cpu(backend: str | None) -> bool:
    """Whether the step runs on the host's CPU: ``backend``, or JAX's default backend when None. The one
    test both the thread and the worker process are decided by."""
    if backend is None:
        import jax

        backend = jax.default_backend()
    return backend == "cpu"


def close_data_workers(trainer: Any) -> Callable[[], None]:
    """What ends the worker process of the trainer's data pipeline (MaxText's ``MultiHostDataLoadIterator``,
    taken now, before anything wraps it): grain's process would otherwise live until that iterator is
    collected. Call after training; harmless without a worker."""
    close = getattr(data_loader(trainer).data_iterator, "close", None)
    return close if callable(close) else lambda: None


def data_loader(trainer: Any) -> Any:
    """The trainer's data loader (MaxText's ``data_hooks.train_data_loader``): the one place that knows where
    MaxText keeps it, and in it (``data_iterator``) the iterator its loop reads."""
    return trainer.data_hooks.train_data_loader


def read_batches_through(trainer: Any, reader: Callable[[Iterator[Any]], Reader]) -> Reader:
    """The trainer's data loader (:func:`data_loader`) reads its batches through ``reader(the iterator it
    read until now)``, which is returned."""
    loader = data_loader(trainer)
    loader.data_iterator = wrapped = reader(loader.data_iterator)
    return wrapped
