"""Save lazily loaded weights through Orbax one tensor at a time, so a conversion holds one tensor, not the model.

MaxText's ``to_maxtext`` (lazy mode) hands Orbax a tree of ``LazyTensor`` leaves: each reads and transforms
its Hugging Face tensors when turned into an array. Orbax v1 has no handler for that leaf type, and its
numpy handler would take every array at once (copying each first). ``streaming_leaves`` registers, for
the duration of a save, a leaf handler for the lazy type that writes the leaves in turn in the save's
background phase: read one, write it, drop it, then the next.

Written one at a time, a tensor must be compressed in parallel to keep the cores busy: tensorstore
compresses chunk by chunk, and MaxText asks for chunks of up to 2 GiB (one chunk per tensor, one core).
The streamed tensors are written in chunks of at most ``CHUNK_BYTES``; any zarr reader (MaxText's
restore included) reads them as before, and a sharded restore on a pod reads less it does not need.
Otherwise the checkpoint is the one Orbax's numpy handler writes (same layout, type string
``np.ndarray``).

Orbax 0.12's v1 leaf registry has no per-save hook for a new leaf type, so the handler joins the
standard list while the context is open and leaves it after; ``tests/trainer/test_trainer_steps.py``
converts through it and reads the result back, so an Orbax change that breaks this fails there.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from orbax.checkpoint._src.futures import future
from orbax.checkpoint._src.serialization import type_handlers
from orbax.checkpoint.experimental.v1._src.serialization import numpy_leaf_handler, registry

OnWritten = Callable[[str, int], None]  # (tensor name, bytes) after each tensor is written
CHUNK_BYTES = 64 << 20


class _InTurn(type_handlers.NumpyHandler):
    """Orbax's numpy handler, materialising and writing its values one after another."""

    def __init__(self, on_written: OnWritten | None, chunk_bytes: int) -> None:
        super().__init__(deepcopy_host_arrays=False)  # each array is made for its write and owned by it
        self._on_written = on_written
        self._chunk_bytes = chunk_bytes

    async def serialize(
        self,
        values: Sequence[Any],
        infos: Sequence[type_handlers.ParamInfo],
        args: Sequence[type_handlers.SaveArgs] | None = None,
    ) -> Sequence[future.Future]:
        args = args or [type_handlers.SaveArgs()] * len(values)
        work = list(zip(values, infos, args, strict=True))
        return [future.CommitFutureAwaitingContractedSignals(self._write_in_turn(work), name="loraflow_in_turn")]

    async def _write_in_turn(self, work: list[tuple[Any, Any, Any]]) -> None:
        work.reverse()
        while work:
            value, info, arg = work.pop()  # the list lets go of the lazy leaf, and so of what it reads
            array = np.asarray(value)
            del value
            chunk = min(arg.chunk_byte_size or self._chunk_bytes, self._chunk_bytes)
            await self._background_serialize([array], [info], [dataclasses.replace(arg, chunk_byte_size=chunk)])
            if self._on_written is not None:
                self._on_written(str(info.name), int(array.nbytes))
            del array


class _AbstractLazyLeaf:
    """The abstract type paired with the lazy leaf type (no restore sees it: the saved type is np.ndarray)."""


@contextlib.contextmanager
def streaming_leaves(leaf_type: type, on_written: OnWritten | None = None) -> Iterator[None]:
    """While open, Orbax v1 saves the leaves of ``leaf_type`` (anything ``np.asarray`` turns into its array)
    one at a time, in chunks of at most ``CHUNK_BYTES``, calling ``on_written(name, nbytes)`` after each."""
    chunk_bytes = CHUNK_BYTES

    class LazyLeafHandler(numpy_leaf_handler.NumpyLeafHandler):
        def __init__(self, *, context: Any = None) -> None:
            super().__init__(context=context)
            self._handler_impl = _InTurn(on_written, chunk_bytes)

    standard = registry.STANDARD_TYPE_AND_ABSTRACT_TYPE_AND_TYPESTR_TO_HANDLER
    entry = (leaf_type, _AbstractLazyLeaf, ["np.ndarray"], LazyLeafHandler)
    standard.append(entry)
    try:
        yield
    finally:
        standard.remove(entry)
