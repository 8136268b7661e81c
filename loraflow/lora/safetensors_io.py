"""Streaming safetensors: read and write checkpoints one tensor at a time, on numpy alone.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length N,
N bytes of JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``
(offsets relative to the end of the header), then the raw little-endian tensor bytes.

* :class:`Checkpoint` is a view over one file or a sharded checkpoint directory
  (``model.safetensors``, or ``model-0000x-of-0000y.safetensors`` + ``model.safetensors.index.json``).
  Opening it reads headers only; :meth:`Checkpoint.read` reads one tensor with seek + readinto, and
  :meth:`Checkpoint.copy_raw` streams one tensor's bytes in bounded chunks without decoding them.
  :meth:`Checkpoint.map` gives a tensor over the file's own pages, without a copy.
* :class:`ShardedWriter` writes a checkpoint whose tensor names, dtypes and shapes are known up front
  (a *plan*): the shard layout and every header are computed from the plan before any data exists,
  so each tensor is written as soon as it is produced, and never held with the others;
  :meth:`ShardedWriter.copy_tensor` copies an unchanged tensor file to file inside the kernel.

Peak memory is the largest tensor read or written plus a constant. ``ml_dtypes`` is imported only
when a BF16 or F8 tensor is decoded (the serving image does not ship it).
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from loraflow.errors import LoraflowError
from loraflow.storage.local_paths import local_paths

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the official library's own limit
COPY_CHUNK_BYTES = 16 * 1024 * 1024
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14+; Python names it only if its headers did

# safetensors dtype -> numpy dtype name; names prefixed "ml:" come from ml_dtypes.
_DTYPES: dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "U16": "uint16",
    "I16": "int16",
    "U32": "uint32",
    "I32": "int32",
    "U64": "uint64",
    "I64": "int64",
    "F16": "float16",
    "F32": "float32",
    "F64": "float64",
    "BF16": "ml:bfloat16",
    "F8_E4M3": "ml:float8_e4m3fn",
    "F8_E5M2": "ml:float8_e5m2",
}
_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "U16": 2, "I16": 2, "U32": 4, "I32": 4, "U64": 8, "I64": 8,
    "F16": 2, "F32": 4, "F64": 8, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip


class SafetensorsError(LoraflowError):
    """A safetensors file or checkpoint directory is malformed, or a write broke its plan."""


def numpy_dtype(st_dtype: str) -> np.dtype:
    """The numpy dtype (little-endian) for a safetensors dtype string such as ``"BF16"``."""
    try:
        name = _DTYPES[st_dtype]
    except KeyError:
        raise SafetensorsError(f"unsupported safetensors dtype {st_dtype!r} (supported: {sorted(_DTYPES)})") from None
    if name.startswith("ml:"):
        try:
            import ml_dtypes
        except ImportError:
            raise SafetensorsError(f"decoding {st_dtype} tensors needs ml_dtypes: pip install ml_dtypes") from None
        return np.dtype(getattr(ml_dtypes, name[3:]))
    return np.dtype(name).newbyteorder("<")


def safetensors_dtype(dtype: np.dtype) -> str:
    """The safetensors dtype string for a numpy dtype (inverse of :func:`numpy_dtype`)."""
    dtype = np.dtype(dtype)
    name = dtype.name
    for st, np_name in _DTYPES.items():
        if np_name.removeprefix("ml:") == name:
            return st
    raise SafetensorsError(f"numpy dtype {dtype} has no safetensors equivalent")


def nbytes_of(st_dtype: str, shape: Sequence[int]) -> int:
    if st_dtype not in _ITEMSIZE:
        raise SafetensorsError(f"unsupported safetensors dtype {st_dtype!r} (supported: {sorted(_DTYPES)})")
    return _ITEMSIZE[st_dtype] * math.prod(shape)


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies: its file, absolute byte offset and size, dtype and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    start: int
    nbytes: int

    @property
    def spec(self) -> TensorSpec:
        return TensorSpec(self.name, self.dtype, self.shape)


@dataclass(frozen=True)
class TensorSpec:
    """A tensor a writer is told to expect: name, safetensors dtype, shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.dtype, self.shape)


def read_header(path: str | os.PathLike[str]) -> tuple[list[TensorInfo], dict[str, str]]:
    """Read and validate one file's header.

    Args:
        path: a ``.safetensors`` file.

    Returns:
        The tensors in data order (by offset), and the ``__metadata__`` dict (empty if none).

    Raises:
        SafetensorsError: truncated file, bad JSON, unknown dtype, size/shape disagreement, or
            offsets that overlap, leave gaps or run past the end of the file.
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise SafetensorsError(f"{path}: {size} bytes is too short for a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise SafetensorsError(f"{path}: header length {n} is impossible for a {size}-byte file (not safetensors?)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SafetensorsError(f"{path}: header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    base = 8 + n
    infos = []
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"{path}: tensor {name!r} has a malformed header entry {entry!r}") from None
        expected = nbytes_of(dtype, shape)
        if end - begin != expected or begin < 0:
            raise SafetensorsError(
                f"{path}: tensor {name!r} ({dtype}{list(shape)}) needs {expected} bytes, offsets {begin}..{end} give {end - begin}"
            )
        infos.append(TensorInfo(name, dtype, shape, path, base + begin, expected))
    infos.sort(key=lambda t: t.start)
    cursor = base
    for t in infos:
        if t.start != cursor:
            raise SafetensorsError(
                f"{path}: tensor {t.name!r} starts at {t.start - base}, expected {cursor - base} (gap or overlap)"
            )
        cursor += t.nbytes
    if cursor > size:
        raise SafetensorsError(f"{path}: data runs to byte {cursor} but the file has {size} (truncated?)")
    return infos, dict(metadata)


def _shard_files(root: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The weight files of a checkpoint directory, and its index's weight_map if it has one."""
    index = root / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise SafetensorsError(f"{index}: not a safetensors index (no weight_map: {exc})") from None
        files = sorted(set(weight_map.values()))
        # The index comes from the bucket: its shard names are read only inside the checkpoint folder.
        paths = local_paths(root, files, what=f"safetensors index {index}")
        missing = [f for f in files if not paths[f].is_file()]
        if missing:
            raise SafetensorsError(f"{index} names shard(s) that are not in {root}: {missing}")
        return [paths[f] for f in files], weight_map
    if (root / SINGLE_FILE).is_file():
        return [root / SINGLE_FILE], None
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise SafetensorsError(f"{root} holds no *.safetensors weights")
    return files, None


class Checkpoint:
    """Tensors of one safetensors file or of a (sharded) checkpoint directory, read one at a time."""

    def __init__(self, files: Sequence[Path], weight_map: dict[str, str] | None = None):
        self.files = list(files)
        self.tensors: dict[str, TensorInfo] = {}
        self.metadata: dict[str, str] = {}
        for path in self.files:
            infos, meta = read_header(path)
            if not self.metadata:
                self.metadata = meta
            for t in infos:
                if t.name in self.tensors:
                    raise SafetensorsError(
                        f"tensor {t.name!r} is in both {self.tensors[t.name].file.name} and {path.name}"
                    )
                self.tensors[t.name] = t
        if weight_map is not None:
            # Tensors a shard holds beyond the index are kept (transformers and vLLM load them too).
            wrong = [n for n, f in weight_map.items() if n not in self.tensors or self.tensors[n].file.name != f]
            if wrong:
                raise SafetensorsError(
                    f"{INDEX_FILE} maps {len(wrong)} tensor(s) to a shard that does not hold them, e.g. {wrong[:3]}: "
                    "the index and the shards come from different checkpoints"
                )

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> Checkpoint:
        """Open a ``.safetensors`` file or a checkpoint directory (headers only)."""
        path = Path(path)
        if path.is_file():
            return cls([path])
        if not path.is_dir():
            raise SafetensorsError(f"{path}: no such file or directory")
        files, weight_map = _shard_files(path)
        return cls(files, weight_map)

    def __len__(self) -> int:
        return len(self.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def names(self) -> list[str]:
        """Tensor names in storage order (file by file, by offset)."""
        return list(self.tensors)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def read(self, name: str, f: BinaryIO | None = None) -> np.ndarray:
        """One tensor as a fresh numpy array (not a view of the file).

        Args:
            name: tensor name.
            f: optionally, an already open handle of the tensor's file (saves an open per tensor).
        """
        t = self.tensors[name]
        buf = np.empty(t.nbytes, np.uint8)
        if f is None:
            with open(t.file, "rb") as fh:
                _readinto(fh, t, buf)
        else:
            _readinto(f, t, buf)
        return buf.view(numpy_dtype(t.dtype)).reshape(t.shape)

    def map(self, name: str) -> np.ndarray:
        """One tensor as a read-only array over the file's pages (no copy); unmapped when dropped.

        The pages are faulted in here, so that whoever uses the array next does not wait for the
        disk. The file must not change while the array is alive.
        """
        t = self.tensors[name]
        begin = t.start - t.start % mmap.ALLOCATIONGRANULARITY
        with open(t.file, "rb") as f:
            if os.fstat(f.fileno()).st_size < t.start + t.nbytes:
                raise SafetensorsError(f"{t.file}: unexpected end of file inside tensor {name!r}")
            if t.nbytes == 0:
                return np.empty(t.shape, numpy_dtype(t.dtype))
            mm = mmap.mmap(f.fileno(), t.start + t.nbytes - begin, offset=begin, access=mmap.ACCESS_READ)
        try:
            mm.madvise(_MADV_POPULATE_READ)
        except (OSError, ValueError):  # kernels before 5.14: ask for read-ahead instead
            mm.madvise(mmap.MADV_WILLNEED)
        raw = np.frombuffer(mm, np.uint8, t.nbytes, t.start - begin)
        return raw.view(numpy_dtype(t.dtype)).reshape(t.shape)

    def copy_raw(self, name: str, f: BinaryIO | None = None, chunk_bytes: int = COPY_CHUNK_BYTES) -> Iterator[bytes]:
        """A tensor's raw bytes in chunks of at most ``chunk_bytes`` (memory stays bounded)."""
        t = self.tensors[name]
        fh = f or open(t.file, "rb")
        try:
            fh.seek(t.start)
            left = t.nbytes
            while left:
                chunk = fh.read(min(chunk_bytes, left))
                if not chunk:
                    raise SafetensorsError(f"{t.file}: unexpected end of file inside tensor {name!r}")
                left -= len(chunk)
                yield chunk
        finally:
            if f is None:
                fh.close()

    def __iter__(self) -> Iterator[tuple[str, np.ndarray]]:
        """``(name, array)`` pairs in storage order, one tensor in memory at a time."""
        for path in self.files:
            with open(path, "rb") as f:
                for t in self.tensors.values():
                    if t.file == path:
                        yield t.name, self.read(t.name, f)


def _write_all(f: BinaryIO, data: bytes | memoryview) -> None:
    """``f.write`` on an unbuffered file may write less than asked (one write() is capped near 2 GiB)."""
    view = memoryview(data).cast("B")
    while view:
        view = view[f.write(view) :]


def pwrite_all(fd: int, data: np.ndarray | bytes | memoryview, offset: int) -> None:
    """``os.pwrite`` until every byte of ``data`` is at ``offset`` (one call may write less)."""
    if isinstance(data, np.ndarray):  # as bytes: numpy cannot export ml_dtypes' BF16 as a buffer
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _readinto(f: BinaryIO, t: TensorInfo, buf: np.ndarray) -> None:
    f.seek(t.start)
    view = memoryview(buf)
    got = 0
    while got < t.nbytes:
        n = f.readinto(view[got:])  # type: ignore[attr-defined]
        if not n:
            raise SafetensorsError(f"{t.file}: unexpected end of file inside tensor {t.name!r}")
        got += n


def shard_name(i: int, n: int) -> str:
    """Hugging Face's shard file name: ``model-00001-of-00003.safetensors``."""
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def plan_shards(specs: Sequence[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Split tensors, in order, into shards of at most ``max_shard_bytes`` of data each.

    A tensor larger than the limit gets a shard of its own (as Hugging Face does).
    """
    if max_shard_bytes <= 0:
        raise SafetensorsError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        if shards[-1] and size + s.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    return shards


def _header_bytes(specs: Sequence[TensorSpec], metadata: dict[str, str] | None) -> bytes:
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for s in specs:
        header[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # align the data to 8 bytes, as the official writer does
    return struct.pack("<Q", len(raw)) + raw


@dataclass(frozen=True)
class WriteResult:
    files: list[Path]
    total_size: int
    index: Path | None


class ShardedWriter:
    """Write a checkpoint whose tensors are known up front, one tensor at a time, in plan order.

    Every header is computed from the plan when the writer opens, so data streams straight to
    disk. Shards are written as ``*.partial`` and renamed when complete; the index is written last
    (and only when there is more than one shard, as Hugging Face does). On an error, or if the
    plan is not fulfilled, partial files are removed::

        with ShardedWriter(out_dir, specs, max_shard_bytes=500 << 20) as w:
            for spec in specs:
                w.write(spec.name, produce(spec))
        w.result.files
    """

    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        plan: Sequence[TensorSpec],
        max_shard_bytes: int,
        metadata: dict[str, str] | None = None,
    ):
        self.out_dir = Path(out_dir)
        names = [s.name for s in plan]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise SafetensorsError(f"the write plan names tensor(s) twice: {dup[:5]}")
        self.metadata = {"format": "pt", **(metadata or {})}
        self.shards = plan_shards(list(plan), max_shard_bytes)
        n = len(self.shards)
        self.names = [SINGLE_FILE] if n == 1 else [shard_name(i + 1, n) for i in range(n)]
        self._queue = [(si, s) for si, shard in enumerate(self.shards) for s in shard]
        self._next = 0
        self._shard = -1
        self._f: BinaryIO | None = None
        self._left = 0  # bytes still owed for the tensor being written
        self.result: WriteResult | None = None
        self.out_dir.mkdir(parents=True, exist_ok=True)
        clash = [p for p in [*self.names, INDEX_FILE] if (self.out_dir / p).exists()]
        if clash:
            raise SafetensorsError(f"{self.out_dir} already holds {clash}: write into an empty directory")

    def _partial(self, i: int) -> Path:
        return self.out_dir / (self.names[i] + ".partial")

    def _expect(self, name: str) -> TensorSpec:
        if self._next >= len(self._queue):
            raise SafetensorsError(f"tensor {name!r} is not in the write plan (all {len(self._queue)} already written)")
        si, spec = self._queue[self._next]
        if spec.name != name:
            raise SafetensorsError(f"tensor {name!r} written out of order: the plan expects {spec.name!r} next")
        if si != self._shard:
            self._finish_shard()
            self._shard = si
            self._f = open(self._partial(si), "wb", buffering=0)
            _write_all(self._f, _header_bytes(self.shards[si], self.metadata))
        self._next += 1
        return spec

    def _finish_shard(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
            os.replace(self._partial(self._shard), self.out_dir / self.names[self._shard])

    def write(self, name: str, array: np.ndarray) -> None:
        """Write the next tensor of the plan; its dtype and shape must be the planned ones."""
        spec = self._expect(name)
        array = np.asarray(array)
        dtype = safetensors_dtype(array.dtype)
        if dtype != spec.dtype or tuple(array.shape) != spec.shape:
            raise SafetensorsError(
                f"tensor {name!r} is {dtype}{list(array.shape)} but the plan says {spec.dtype}{list(spec.shape)}"
            )
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        array = np.ascontiguousarray(array)
        assert self._f is not None
        _write_all(self._f, memoryview(array.reshape(-1).view(np.uint8)))

    def reserve(self, name: str) -> tuple[int, int]:
        """Start the next tensor of the plan and return ``(fd, offset)``: its bytes go at
        ``offset`` of file descriptor ``fd`` (``os.pwrite``, from any thread), all of them before the
        writer's next call. A tensor can so be written in parts, in any order, as they are produced."""
        spec = self._expect(name)
        assert self._f is not None
        offset = self._f.tell()
        self._f.seek(offset + spec.nbytes)
        return self._f.fileno(), offset

    def write_bytes(self, name: str, chunks: Iterable[bytes]) -> None:
        """Write the next tensor of the plan from its raw little-endian bytes (e.g. :meth:`Checkpoint.copy_raw`)."""
        self._write_chunks(self._expect(name), chunks)

    def copy_tensor(self, name: str, source: Checkpoint) -> None:
        """Write the next tensor of the plan as a byte copy of the same tensor in ``source``.

        The kernel copies file to file (``copy_file_range``), the bytes never passing through this
        process; where the file systems refuse that, the tensor is streamed instead.
        """
        t, spec = source.tensors[name], self._expect(name)
        if (t.dtype, t.shape) != (spec.dtype, spec.shape):
            raise SafetensorsError(
                f"tensor {name!r} is {t.dtype}{list(t.shape)} but the plan says {spec.dtype}{list(spec.shape)}"
            )
        assert self._f is not None
        with open(t.file, "rb", buffering=0) as src:
            begin, done = self._f.tell(), 0
            try:
                while done < t.nbytes:
                    n = os.copy_file_range(src.fileno(), self._f.fileno(), t.nbytes - done, t.start + done)
                    if n == 0:
                        raise SafetensorsError(f"{t.file}: unexpected end of file inside tensor {name!r}")
                    done += n
                return
            except OSError:  # EXDEV, EOPNOTSUPP...: undo, then stream
                self._f.truncate(begin)
                self._f.seek(begin)
            self._write_chunks(spec, source.copy_raw(name, src))

    def _write_chunks(self, spec: TensorSpec, chunks: Iterable[bytes]) -> None:
        assert self._f is not None
        written = 0
        for chunk in chunks:
            written += len(chunk)
            if written > spec.nbytes:
                break
            _write_all(self._f, chunk)
        if written != spec.nbytes:
            raise SafetensorsError(f"tensor {spec.name!r}: got {written}+ bytes, the plan says {spec.nbytes}")

    def close(self) -> WriteResult:
        """Finish the last shard and write the index; fails if planned tensors were never written."""
        if self.result is not None:
            return self.result
        if self._next != len(self._queue):
            missing = [s.name for _, s in self._queue[self._next :]]
            self.abort()
            raise SafetensorsError(f"{len(missing)} planned tensor(s) were never written, e.g. {missing[:3]}")
        if self._shard < 0:  # an empty plan still yields a valid (header-only) file
            self._shard = 0
            self._f = open(self._partial(0), "wb", buffering=0)
            _write_all(self._f, _header_bytes([], self.metadata))
        self._finish_shard()
        total = sum(s.nbytes for shard in self.shards for s in shard)
        index = None
        if len(self.names) > 1:
            index = self.out_dir / INDEX_FILE
            weight_map = {s.name: self.names[i] for i, shard in enumerate(self.shards) for s in shard}
            tmp = index.with_name(index.name + ".partial")
            tmp.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
            os.replace(tmp, index)
        self.result = WriteResult([self.out_dir / n for n in self.names], total, index)
        return self.result

    def abort(self) -> None:
        """Close and delete whatever this writer created."""
        if self._f is not None:
            self._f.close()
            self._f = None
        for i in range(len(self.names)):
            self._partial(i).unlink(missing_ok=True)
            if i < self._shard:
                (self.out_dir / self.names[i]).unlink(missing_ok=True)
        self._next = len(self._queue)
        self.result = WriteResult([], 0, None)

    def __enter__(self) -> ShardedWriter:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is not None:
            self.abort()
        else:
            self.close()
