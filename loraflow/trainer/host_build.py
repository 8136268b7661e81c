"""QLoRA's model built in host memory: the accelerator receives the quantized model, never the full one.

MaxText's set-up (``model_creation_utils.from_pretrained``) initialises the whole model on the
accelerator, in the training dtype, then overwrites it with the checkpoint; qwix quantizes the
targeted kernels only afterwards, when LoRA is applied. With QLoRA that puts the full-precision model
in device memory for a moment, and that moment decides what fits: an 8B Llama (16 GB in bf16) cannot
be set up on a 16 GiB chip although its nf4 training state is about 6 GB.

:func:`built_on_host` runs the same two MaxText/qwix calls on the host's CPU instead (the checkpoint
restored into host memory, LoRA and the quantization applied there, under ``jit``), builds the
accelerator's model abstractly (the same modules for the accelerator's mesh, LoRA applied under
``nnx.eval_shape``), and places each array of the host-built state onto the accelerator with the
sharding MaxText's rules give it. The model state is the one MaxText's own set-up would build, value
for value (``tests/trainer/test_lora_apply.py``): only where it is built changes. lora_sft uses it
for QLoRA on one chip; on several, MaxText's set-up shards the full-precision model across them.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import math
import os
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from loraflow.errors import LoraflowError
from loraflow.trainer import abs_max, nf4_table

Progress = Callable[[str], None]
GIB = 1 << 30
# The most threads for one of the host layout's copies (:func:`_copy_threads`).
COPY_THREADS = 8
# A copy is split in parts of at least this many bytes: a thread per small array costs more than it saves.
COPY_PART_BYTES = 32 << 20
# JAX's CPU client takes a numpy array's buffer as it is only at this boundary (jaxlib 0.12), else it copies it
TAKEN_AT = 64


def device_bytes(tree: Any) -> int:
    """The bytes a tree's arrays take where they live (``on_device_size_in_bytes``: ``nbytes`` misreports
    packed 4-bit arrays)."""
    import jax

    return sum(x.on_device_size_in_bytes() for x in jax.tree_util.tree_leaves(tree) if isinstance(x, jax.Array))


@dataclass
class Phases:
    """Seconds each phase of the build took, in the order first timed: the task log's breakdown of the set-up."""

    seconds: dict[str, float] = field(default_factory=dict)
    parts: dict[str, Phases] = field(default_factory=dict)  # a phase's own breakdown, shown beside it

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.monotonic() - started

    def text(self) -> str:
        return ", ".join(self._phase(phase, seconds) for phase, seconds in self.seconds.items())

    def _phase(self, phase: str, seconds: float) -> str:
        parts = self.parts.get(phase)
        return f"{phase} {seconds:.0f}s" + (f" ({parts.text()})" if parts is not None and parts.seconds else "")


def host_cpu() -> Any:
    """The host's first CPU device; None where JAX has no CPU backend (a JAX_PLATFORMS without cpu)."""
    import jax

    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return None


def _host_devices() -> list[Any]:
    device = host_cpu()
    if device is None:
        raise LoraflowError(
            "QLoRA builds the base model on the host's CPU, and JAX has no CPU backend here: "
            "let JAX_PLATFORMS include cpu (e.g. JAX_PLATFORMS=tpu,cpu) or leave it unset"
        )
    return [device]


def _place(host_model: Any, abstract_model: Any, mesh: Any, phases: Phases) -> Any:
    """The abstract (accelerator) model with every array taken from the host-built one, sharded as
    MaxText's logical rules say; refuses a host state that does not match the abstract one leaf for leaf."""
    from flax import nnx
    from maxtext.utils import sharding

    graphdef, abstract = nnx.split(abstract_model)
    _, host = nnx.split(host_model)
    host_flat = dict(nnx.to_flat_state(host))
    shardings = dict(nnx.to_flat_state(sharding.nnx_construct_named_sharding(abstract, mesh)))
    placed = []
    for path, var in nnx.to_flat_state(abstract):
        built = host_flat.pop(path, None)
        if built is None or _shape(built, _scan_axis(var)) != getattr(var.get_value(), "shape", None):
            raise LoraflowError(f"QLoRA host build: {'/'.join(map(str, path))} differs from the accelerator's model")
        value = _moved(built.get_value(), _scan_axis(built), _scan_axis(var), shardings[path].get_value(), phases)
        built.set_value(None)  # the host copy goes as soon as it is on the accelerator
        placed.append((path, var.replace(value=value)))
        del value
    if host_flat:
        raise LoraflowError(f"QLoRA host build: {len(host_flat)} arrays the accelerator's model does not have")
    return nnx.merge(graphdef, nnx.from_flat_state(placed))


def _moves(ndim: int, source: int | None, target: int | None) -> bool:
    """Whether an array of ``ndim`` dimensions has a layer axis to move from ``source`` to ``target``
    (MaxText's own rule: an array with no more dimensions than the axis is not stacked along it)."""
    return source is not None and target is not None and source != target and ndim > max(source, target)


def _shape(var: Any, target: int | None) -> tuple[int, ...] | None:
    """The shape of ``var``'s array once its layer axis is at ``target``."""
    shape, source = getattr(var.get_value(), "shape", None), _scan_axis(var)
    if shape is None or not _moves(len(shape), source, target):
        return shape
    assert source is not None and target is not None  # for the type checker: _moves said so
    dims = list(shape)
    dims.insert(target, dims.pop(source))
    return tuple(dims)


def _scan_axis(var: Any) -> int | None:
    """Where a scanned layer stack keeps its layer axis in this variable (MaxText's ``param_scan_axis``
    metadata), or None for a variable outside the stack."""
    axis = var.get_metadata().get("param_scan_axis")
    return None if axis is None else int(axis)


def _moved(value: Any, source: int | None, target: int | None, sharding: Any, phases: Phases) -> Any:
    """``value`` put where ``sharding`` says (:func:`put`), with its layer axis moved from ``source`` to
    ``target`` there (:func:`_moves`). The move runs where the array lands: numpy's copy of a strided 4-bit
    view took minutes at 1.5B. Each step is waited for, so that ``phases`` times them apart."""
    import jax
    import jax.numpy as jnp

    value = put(value, sharding, phases)
    if not _moves(value.ndim, source, target):
        return value
    with phases.timed("layer-axis moves"):
        return jax.jit(jnp.moveaxis, static_argnums=(1, 2))(value, source, target).block_until_ready()


def put(value: Any, sharding: Any, phases: Phases | None = None) -> Any:
    """``value`` where ``sharding`` says, waited for; ``phases`` times its packing, transfer and unpacking.

    A 4-bit array never crosses as 4-bit values: on a TPU v5e uint4 crossed from the host at 1.06 GB/s
    against 11.4 for uint8 (bench/results/tpu-transfer.json). One that :func:`_packable` says pairs up is
    packed two values to a byte where it is, by a program compiled for its own device (:func:`_pack`), and
    unpacked where it lands (:func:`_unpacker`): half the bytes cross, and no host core copies ml_dtypes' one
    value a byte out of it (``np.asarray`` of a 4-bit JAX array took 0.57-1.7 s per 256 Mi values on this
    project's CPU, the compiled pack 0.08-0.2 s: at 8B the transfers were 23 s with that copy). Any other
    4-bit array crosses as the bytes ml_dtypes keeps it in (int4 sign-extended to int8, uint4 as uint8) and
    is narrowed where it lands."""
    import jax
    import numpy as np

    phases = Phases() if phases is None else phases
    if _packable(value):
        # compiled under a mesh of the value's own device: under the trainer's mesh (the TPU) a jit of a
        # host array fails on the chip ("incompatible devices"), which a one-device CPU cannot show
        with phases.timed("packing"), jax.set_mesh(jax.sharding.Mesh(np.array(list(value.devices())), ("host",))):
            packed = jax.jit(_pack)(value).block_until_ready()
        with phases.timed("transfers"):
            on_device = jax.device_put(packed, sharding).block_until_ready()
        with phases.timed("unpacking"):
            return jax.jit(_unpacker(value.dtype), out_shardings=sharding)(on_device).block_until_ready()
    wide = _wide_dtype(value.dtype)
    with phases.timed("transfers"):
        as_sent = value if wide is None else np.asarray(value).view(wide)
        on_device = jax.device_put(as_sent, sharding).block_until_ready()
    if wide is None:
        return on_device
    with phases.timed("unpacking"):
        return jax.jit(_narrower(value.dtype), out_shardings=sharding)(on_device).block_until_ready()


def _packable(value: Any) -> bool:
    """Whether :func:`put` packs ``value``: a 4-bit JAX array (on the host's device) whose last dimension
    pairs up. Where it lands does not matter: the unpacking is one program over the whole array, which XLA
    shards as ``sharding`` says."""
    import jax

    return (
        _wide_dtype(value.dtype) is not None
        and isinstance(value, jax.Array)
        and value.ndim >= 1
        and value.shape[-1] % 2 == 0
    )


def _pack(value: Any) -> Any:
    """A 4-bit array as bytes: element ``2i`` of a row in the low half of the row's byte ``i``, ``2i + 1`` in
    the high half (explicit arithmetic: a bitcast's nibble order is the platform's)."""
    import jax.numpy as jnp

    nibbles = value.astype(jnp.int8).astype(jnp.uint8) & 0xF  # int4's two's complement, four bits of it
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


@functools.cache
def _unpacker(dtype: Any) -> Callable[[Any], Any]:
    """The inverse of :func:`_pack` for arrays of ``dtype`` (uint4 or int4); one function per dtype, so that
    ``jit`` compiles it once per shape, not once per array."""
    import jax.numpy as jnp

    signed = dtype == jnp.dtype(jnp.int4)

    def unpack(packed: Any) -> Any:
        pairs = jnp.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
        if signed:  # the four bits back to a signed value: 0-7 as they are, 8-15 as -8 to -1
            return ((pairs.astype(jnp.int8) ^ 8) - 8).astype(dtype)
        return pairs.astype(dtype)

    return unpack


def _wide_dtype(dtype: Any) -> Any:
    """The byte type a 4-bit ``dtype`` is kept in on the host (int8 for int4, uint8 for uint4), or None."""
    import jax.numpy as jnp
    import numpy as np

    # compared, not looked up: a PRNG key's dtype is no numpy dtype
    if dtype == jnp.dtype(jnp.int4):
        return np.int8
    return np.uint8 if dtype == jnp.dtype(jnp.uint4) else None


@functools.cache
def _narrower(dtype: Any) -> Callable[[Any], Any]:
    """The conversion back from :func:`_wide_dtype`'s bytes to ``dtype``; one function per dtype, so that
    ``jit`` compiles it once per shape, not once per array."""

    def narrow(wide: Any) -> Any:
        return wide.astype(dtype)

    return narrow


def host_config(config: Any) -> Any:
    """``config`` for the host's build: layer stacks with the layer axis first (``param_scan_axis=0``).

    MaxText keeps a stacked weight's layer axis second (``param_scan_axis=1``) and moves it to the
    front for its layer scan, a transposed copy of every stacked weight, all alive while the scan
    runs: applying QLoRA under ``jit`` on the CPU needed scratch the size of the whole layer stack
    (13.3 GiB at 3.6B, about 30 at 8B). With the axis first, the scan reads the weights in place and
    the scratch is one layer's; the accelerator still gets MaxText's layout (:func:`_place`)."""
    return config.model_copy(update={"param_scan_axis": 0})


def _restored_on_host(config: Any, phases: Phases) -> Any:
    """The model on the host's CPU (built with :func:`host_config`) with its weights read from
    loraflow's converted checkpoint (MaxText's linen layout, ``{"params": {"params": tree}}``) straight
    into place: not MaxText's ``from_pretrained``, which first initialises every weight at random and
    keeps a copy of them as the restore target, four times the model in host memory where this needs
    one and a bit (one stacked weight at a time is moved to the host's layout). Its other state (the
    RNG streams) is made as MaxText makes it, by a compiled model build that computes nothing else."""
    import jax
    import orbax.checkpoint as ocp
    from flax import nnx
    from flax.core.spmd import logical_axis_rules
    from maxtext.utils import model_creation_utils

    host = _host_devices()
    on_host = host_config(config)
    with logical_axis_rules(config.logical_axis_rules):
        _, stored = model_creation_utils.create_nnx_abstract_model(config, devices=host)
        create, abstract = model_creation_utils.create_nnx_abstract_model(on_host, devices=host)
        graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
        with jax.default_device(host[0]):
            rest = jax.jit(lambda: nnx.split(create(), nnx.Param, ...)[2])()
    stored_params = nnx.state(stored, nnx.Param)
    target = {"params": {"params": nnx.to_pure_dict(stored_params)}}
    checkpointer = ocp.Checkpointer(
        ocp.PyTreeCheckpointHandler(
            use_ocdbt=config.checkpoint_storage_use_ocdbt, use_zarr3=config.checkpoint_storage_use_zarr3
        )
    )
    # Read as numpy arrays, not as jax.Arrays. Orbax's jax.Array restore reads every array into a numpy
    # buffer and copies it into a CPU jax.Array; jaxlib lets go of a buffer it copied from only at its next
    # garbage collection (a gc callback), so the read peaked at the model and 0.5-0.8 GiB more at 1.5 B on
    # CPU, 0.49 GiB of it still held when the read returned, and took 11-46 s. Read as numpy: the model and
    # about 0.1 GiB, 3.7 s (bench/notes.md section 12). The loop below copies one array at a time into its
    # jax.Array while the next group is read (:func:`_read_ahead`).
    axes = {path: _scan_axis(var) for path, var in nnx.to_flat_state(stored_params)}
    variables = dict(nnx.to_flat_state(params))
    on_cpu = jax.sharding.SingleDeviceSharding(host[0])
    host_phases = Phases()  # the host's own copies: not the accelerator's transfers
    for arrays in _read_ahead(checkpointer, str(config.load_parameters_path), target, phases):
        # flattened as plain dicts, not through an nnx.State: that makes a reference cycle holding every
        # array read, which only a garbage collection frees, and a moved stack, which JAX does not copy
        # from, has no let-go's collection after it (its read array lived on into the next placing)
        for path in list(arrays):
            var = variables.pop(path[2:])  # less the tree's ("params", "params")
            placed, copied_from = _from_host_memory(
                arrays.pop(path), axes[path[2:]], _scan_axis(var), on_cpu, host_phases
            )
            # gone before the next array is laid out: the model and one array more at a time (at 3.6 B on
            # CPU the layout's peak was 1.42x the model while the numpy array lived on beside its copies)
            with host_phases.timed("let-go"):
                if copied_from is not None:
                    _let_go(copied_from)
            var.set_value(placed)
            del placed
        del arrays
    if variables:
        raise LoraflowError(f"QLoRA host build: {len(variables)} of the model's arrays are not in the checkpoint read")
    phases.seconds["host layout"] = sum(host_phases.seconds.values())
    phases.parts["host layout"] = host_phases
    return nnx.merge(graphdef, params, rest), abstract.mesh


READ_GROUP_BYTES = 1 << 30


def _read_ahead(checkpointer: Any, directory: str, target: dict[str, Any], phases: Phases) -> Iterator[dict[Any, Any]]:
    """``target``'s arrays read from the checkpoint in ``directory`` as numpy arrays, a group at a time: each
    group's arrays (flattened paths) in the tree's order, the next group read in a thread of its own while the
    caller lays out this one (one group ahead, never more). ``phases``' "checkpoint read" is the time the
    caller waited for a group: the read that the layout did not hide.

    In groups of at most :data:`READ_GROUP_BYTES` (an array larger than that alone), one Orbax restore a group:
    one restore of the whole tree asks tensorstore for every chunk of every array at once (Orbax's numpy
    handler gathers them all and ignores its ``restore_concurrent_gb`` bound), and chunks read but not yet
    decoded into their arrays pile up beside the model: at 3.6 B on a 2-core CPU the read peaked at
    1.08-1.17x the model, in 1 GiB groups at 1.04x, in the same time (bench/notes.md section 13b). Read ahead,
    what is in memory is still at most the model and one group's chunks: the group being read is part of the
    model not yet laid out. The read and the layout one after the other took 25 + 9 s of the 8B set-up on the
    chip's host (section 15)."""
    import numpy as np
    import orbax.checkpoint as ocp
    from flax import traverse_util

    leaves = traverse_util.flatten_dict(target)
    sizes = {path: math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize for path, leaf in leaves.items()}

    def read(group: list[Any]) -> dict[Any, Any]:
        item = traverse_util.unflatten_dict({path: leaves[path] for path in group})
        args = traverse_util.unflatten_dict(
            {path: ocp.RestoreArgs(restore_type=np.ndarray, dtype=leaves[path].dtype) for path in group}
        )
        return traverse_util.flatten_dict(checkpointer.restore(directory, item=item, transforms={}, restore_args=args))

    groups = _groups(sizes)
    with ThreadPoolExecutor(1, thread_name_prefix="loraflow-checkpoint-read") as reader:
        coming = reader.submit(read, groups[0]) if groups else None
        for later in [*groups[1:], None]:
            assert coming is not None  # for the type checker: a group was submitted for this turn
            with phases.timed("checkpoint read"):
                arrays = coming.result()
            coming = reader.submit(read, later) if later is not None else None
            yield arrays
            del arrays  # the caller's layout let go of each array: nothing here keeps one


def _groups(sizes: dict[Any, int]) -> list[list[Any]]:
    """The keys of ``sizes`` in order, in groups whose sizes add up to at most :data:`READ_GROUP_BYTES`
    (a key whose size is more than that in a group of its own)."""
    groups: list[list[Any]] = []
    total = 0
    for key, size in sizes.items():
        if not groups or total + size > READ_GROUP_BYTES:
            groups.append([])
            total = 0
        groups[-1].append(key)
        total += size
    return groups


def _from_host_memory(
    array: Any, source: int | None, target: int | None, sharding: Any, phases: Phases
) -> tuple[Any, weakref.ref[Any] | None]:
    """``array``, read from the checkpoint into host memory, put where ``sharding`` says (:func:`put`) with its
    layer axis moved from ``source`` to ``target`` (:func:`_moves`), and a weak reference to what JAX copied
    from for :func:`_let_go`: None where JAX took its buffer as it is (no copy: it is the model's memory).

    A stack to move is copied once, by numpy, into the host's layout in memory JAX takes as it is
    (:func:`_laid_out`); the array read is gone before JAX gets the copy (the caller hands over its only
    reference). Before, JAX copied the unaligned array (at 1.5 GB/s, a quarter of numpy's speed) and a
    compiled ``moveaxis`` copied that again, two passes over fresh memory: the host layout took 32 s of an 8B
    set-up's 91 on the chip's host (bench/notes.md section 13), 10.4-12.2 s at 3.6 B on this project's CPU
    against 5.4-5.9 s now (section 13c). An array that does not move goes through :func:`put` as it is (one
    copy either way). An array that does not move but lies off JAX's boundary (:data:`TAKEN_AT`: Orbax's reads do)
    gets the same numpy copy in place of JAX's: the embedding and the output head, 2 GiB at 8B, took most of
    the host layout's "copies 4s" on the chip's host (bench/notes.md section 15)."""
    if _moves(array.ndim, source, target):
        assert source is not None and target is not None  # for the type checker: _moves said so
        with phases.timed("moves"):
            array = _laid_out(array, source, target)
    with phases.timed("copies"):
        if array.ndim and array.ctypes.data % TAKEN_AT:
            array = _laid_out(array, 0, 0)  # no axis moved: a copy by rows into memory JAX takes as it is
        placed = put(array, sharding)
    if placed.unsafe_buffer_pointer() == array.ctypes.data:
        return placed, None
    return placed, weakref.ref(array)


def _laid_out(array: Any, source: int, target: int, threads: int | None = None) -> Any:
    """A copy of ``array`` with axis ``source`` moved to ``target``, in memory JAX's CPU client takes without
    a copy of its own (:func:`_fresh`), made by ``threads`` threads (:func:`_copy_threads`), each copying
    its own slices of the copy's first axis (:func:`_row_slices`). Moving the layer axis to the front keeps
    the dimensions after it contiguous: the copy is rows of a kernel's last dimensions. Its time is mostly
    the first touch of fresh memory, which threads share: at 3.6 B on this project's 2 cores the stacks'
    copies took 11.2-12.7 s on one thread, 6.0-6.6 s on two (with numpy's huge pages; bench/notes.md
    section 13c)."""
    import numpy as np

    view = np.moveaxis(array, source, target)
    copy = _fresh(view.shape, view.dtype)
    parts = min(_copy_threads() if threads is None else threads, max(1, copy.nbytes // COPY_PART_BYTES))
    slices = _row_slices(copy.shape[0], parts)
    if len(slices) <= 1:
        np.copyto(copy, view)
        return copy
    with ThreadPoolExecutor(len(slices)) as pool:
        # list(): a copy's exception is raised here, not dropped with its future
        list(pool.map(lambda rows: np.copyto(copy[rows], view[rows]), slices))
    return copy


def _copy_threads() -> int:
    """Threads for one of the host layout's copies: the host's cores, at most :data:`COPY_THREADS` (numpy
    lets go of the GIL in a copy; the chip's host has 13 cores, this project's CPU 2)."""
    return min(os.cpu_count() or 1, COPY_THREADS)


def _fresh(shape: tuple[int, ...], dtype: Any) -> Any:
    """A numpy array of ``shape`` and ``dtype`` in an anonymous memory mapping of its own (zeros, its pages
    untouched until written). It starts at a page, so JAX's CPU client takes it without a copy (jaxlib 0.12
    takes a buffer as it is only at a 64-byte boundary; numpy places a large array 16 bytes past one), and
    it is unmapped when the last array on it goes. Not ``np.empty``: numpy asks the kernel for huge pages
    for a large array, and their first touch made the host layout slower at 3.6 B on this project's CPU
    (stacks copied on 2 threads in 6.5-7.1 s with huge pages, 4.7-5.3 s without)."""
    import mmap

    import numpy as np

    count = math.prod(shape)
    memory = mmap.mmap(-1, max(count * np.dtype(dtype).itemsize, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(memory, dtype=dtype, count=count).reshape(shape)


def _row_slices(rows: int, parts: int) -> list[slice]:
    """``range(rows)`` cut into at most ``parts`` (at least 1) consecutive, non-empty slices of sizes within
    one of each other, in order: every row in exactly one."""
    bounds = [rows * i // parts for i in range(parts + 1)]
    return [slice(start, stop) for start, stop in itertools.pairwise(bounds) if stop > start]


def _let_go(read: weakref.ref[Any], seconds: float = 10.0) -> None:
    """Return once the checkpoint array behind ``read`` is freed (or after ``seconds``), so that host
    memory holds the model and one array more, never two.

    jaxlib lets go of a host buffer it copied from by
    handing its last reference to its garbage collection callback, which any collection runs, a young-
    generation one too: without one, 2.0 GiB of the 2.8 GiB model's numpy arrays were still alive at the
    loop's end at 1.5 B (1.7x the model). One young collection right after each placing was not always
    enough: a fresh-clone CI run under load found an array alive at the next placing. So: a young
    collection; if the array lives on, a full one (a reference cycle older than the young generation);
    then young ones until it is gone (let go on jaxlib's own thread, after the copy was waited for)."""
    gc.collect(0)
    if read() is not None:
        gc.collect()
    deadline = time.monotonic() + seconds
    while read() is not None and time.monotonic() < deadline:
        time.sleep(0.001)
        gc.collect(0)


def _build(config: Any, apply_lora: Callable[..., Any], progress: Progress) -> tuple[Any, Any]:
    import jax
    from flax import nnx
    from flax.core.spmd import logical_axis_rules
    from maxtext.utils import model_creation_utils

    started = time.monotonic()
    phases = Phases()
    host_model, host_mesh = _restored_on_host(config, phases)
    progress(
        f"QLoRA: base model restored into host memory ({device_bytes(nnx.state(host_model)) / GIB:.2f} GiB) "
        f"in {time.monotonic() - started:.0f}s; quantizing there"
    )
    with (
        phases.timed("quantize"),
        nf4_table.by_table(host_mesh.devices.flat[0]),  # qwix's nf4 values without its 16-way argmin
        abs_max.abs_apart(),  # qwix's scales without YNNPACK's fresh buffer per kernel
        jax.set_mesh(host_mesh),
        logical_axis_rules(config.logical_axis_rules),
    ):
        host_model = apply_lora(host_model, host_mesh, host_config(config))
        # waited for here: the program runs asynchronously, and unwaited its run was timed as the next
        # phases' (the first transfer waits for it)
        jax.block_until_ready(nnx.state(host_model))
    # The bf16 kernels the program read are unreferenced now (no jax.Array of them is alive), yet at 1.5 B
    # their 2.1 GiB stayed in the process until a full garbage collection (generations 0 and 1 freed
    # nothing): collected here, before the placement and the training that follow.
    gc.collect()

    with phases.timed("abstract model"):
        create, abstract = model_creation_utils.create_nnx_abstract_model(config)
    mesh = abstract.mesh
    with jax.set_mesh(mesh), logical_axis_rules(config.logical_axis_rules):
        # mesh=None: traced arrays have no sharding to move; _place gives each its sharding
        with phases.timed("abstract model"):
            abstract_lora = nnx.eval_shape(lambda: apply_lora(create(), None, config))
        model = _place(host_model, abstract_lora, mesh, phases)
    progress(
        f"QLoRA: model placed on {mesh.devices.size} {jax.devices()[0].platform} device(s): "
        f"{device_bytes(nnx.state(model)) / GIB:.2f} GiB, built in {time.monotonic() - started:.0f}s "
        f"({phases.text()})"
    )
    return model, mesh


@contextlib.contextmanager
def built_on_host(progress: Progress) -> Iterator[None]:
    """While open, MaxText's SFT set-up builds its LoRA model through :func:`_build` (``from_pretrained``
    returns the finished LoRA model; the ``apply_lora_to_model`` that follows it passes it through)."""
    from maxtext.trainers.post_train.sft import train_sft

    creation, lora = train_sft.model_creation_utils, train_sft.lora_utils
    from_pretrained, apply_lora = creation.from_pretrained, lora.apply_lora_to_model

    def build(config: Any, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs or not config.load_parameters_path:
            raise LoraflowError("QLoRA host build: MaxText's from_pretrained was called in a way it does not expect")
        return _build(config, apply_lora, progress)

    def applied(model: Any, mesh: Any, config: Any) -> Any:
        return model

    creation.from_pretrained, lora.apply_lora_to_model = build, applied
    try:
        yield
    finally:
        creation.from_pretrained, lora.apply_lora_to_model = from_pretrained, apply_lora
