"""LoRA applied under jit (loraflow.trainer.lora_apply): the model MaxText's eager LoRA set-up builds,
value for value, without a second copy of the frozen weights. That lora_sft builds its trainer that way is
checked on its training in test_trainer_steps.py (its progress lines)."""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytest

pytest.importorskip("maxtext")

from loraflow.steps._harness import StepContext
from tests.jax_cache import compiled_afresh

TRAINING = {"rank": 8, "alpha": 16.0, "seed": 0, "batch_size": 8, "max_length": 64, "learning_rate": 3e-3}


@pytest.fixture(scope="module")
def converted(base: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The converted tiny Llama (the trainer modules' shared ``base``); this module's runs write under a
    folder of its own."""
    inputs = {"checkpoint": base["ckpt"], "dataset": base["dataset"], "tokenizer": base["hf"]}
    return {"root": tmp_path_factory.mktemp("lora-apply"), **inputs}


def _context(folder: Path, stage: str, inputs: dict[str, Path], config: dict[str, Any]) -> StepContext:
    for sub in ("out", "work"):
        (folder / sub).mkdir(parents=True)
    return StepContext(
        stage, str(folder / "remote"), inputs, {k: None for k in inputs}, folder / "out", folder / "work", config
    )


def _sft_context(converted: dict[str, Path], name: str, **config: Any) -> StepContext:
    inputs = {k: converted[k] for k in ("checkpoint", "dataset", "tokenizer")}
    return _context(converted["root"] / name, "lora_sft", inputs, {**TRAINING, **config})


def _config(ctx: StepContext) -> Any:
    """MaxText's config of the stage's training (no model built)."""
    from absl import flags
    from maxtext.configs import pyconfig

    from loraflow.steps import lora_sft
    from loraflow.trainer.data import training_set
    from loraflow.trainer.training import maxtext_argv

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    sft = lora_sft.sft_run(ctx)
    return pyconfig.initialize_pydantic(maxtext_argv(sft, training_set(sft.dataset), str(ctx.work)))


def _model_and_config(mt_config: Any) -> tuple[Any, Any, Any]:
    """The model MaxText restores from the converted checkpoint, as the stage's trainer starts from it."""
    from maxtext.utils import model_creation_utils

    model, mesh = model_creation_utils.from_pretrained(mt_config)
    return model, mesh, mt_config


def _with_lora(model: Any, mesh: Any, mt_config: Any) -> Any:
    import jax
    from flax.core.spmd import logical_axis_rules
    from maxtext.utils import lora_utils

    with jax.set_mesh(mesh), logical_axis_rules(mt_config.logical_axis_rules):
        return lora_utils.apply_lora_to_model(model, mesh, mt_config)


@pytest.fixture(scope="module")
def eager_builds() -> dict[str, dict[str, Any]]:
    """The arrays of the model MaxText's own eager set-up builds (from_pretrained, then apply_lora_to_model),
    by quantization (:func:`_eager`): built once a module, for every test comparing a build with it."""
    return {}


def _eager(built: dict[str, dict[str, Any]], mt_config: Any, quantization: str) -> dict[str, Any]:
    """The eager model's arrays for the module's training with ``quantization`` (tiles of 32): its tests'
    configs of one quantization differ only in their work folders, so they build the same model."""
    if quantization not in built:
        built[quantization] = _arrays(_with_lora(*_model_and_config(mt_config)))
    return built[quantization]


def _arrays(model: Any) -> dict[str, Any]:
    """Every array of the model's state by path (variable type included; PRNG keys as their data)."""
    import jax
    import numpy as np
    from flax import nnx

    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model)):
        for leaf_path, leaf in jax.tree_util.tree_leaves_with_path(var.get_value()):
            if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                leaf = jax.random.key_data(leaf)
            out["/".join(map(str, path)) + jax.tree_util.keystr(leaf_path) + f" ({type(var).__name__})"] = np.asarray(
                leaf
            )
    return out


@pytest.mark.parametrize("quantization", ["none", "nf4"])
def test_lora_under_jit_is_the_eager_model_and_keeps_the_frozen_weights(converted, eager_builds, quantization):
    import numpy as np
    from flax import nnx

    from loraflow.trainer import lora_apply

    extra = {"quantization": quantization, "tile_size": 32} if quantization != "none" else {}
    ctx = _sft_context(converted, f"apply-{quantization}", steps=2, **extra)
    mt_config = _config(ctx)
    eager = _eager(eager_builds, mt_config, quantization)

    model, mesh, _ = _model_and_config(mt_config)
    frozen = {path: var.get_value() for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    notes: list[str] = []
    with lora_apply.applied_under_jit(notes.append):
        traced_model = _with_lora(model, mesh, mt_config)
    traced = _arrays(traced_model)

    assert traced.keys() == eager.keys()
    assert any("lora_a" in k for k in traced) and any("lora_b" in k for k in traced)
    different = [k for k in eager if eager[k].dtype != traced[k].dtype or not np.array_equal(eager[k], traced[k])]
    assert different == [], different

    # Frozen weights LoRA leaves alone are the very arrays the model had (no copy); with nf4 the
    # targeted kernels are replaced by their quantized form, the rest (embeddings, norms) kept.
    after = {path: var.get_value() for path, var in nnx.to_flat_state(nnx.state(traced_model, nnx.Param))}
    kept = [path for path, value in frozen.items() if after.get(path) is value]
    kernels = [path for path in frozen if path[-1] == "kernel" and "layers" in path]
    assert kernels and any("embedding" in path for path in kept)
    if quantization == "none":
        assert set(kept) == set(frozen)
    else:
        assert not set(kernels) & set(kept)
    assert len(notes) == 1 and f"{len(kept)} frozen weights kept, not copied" in notes[0], notes
    assert qwix_is_restored()


def qwix_is_restored() -> bool:
    import qwix
    from qwix._src.providers import lora

    return qwix.apply_lora_to_model is lora.apply_lora_to_model


@pytest.mark.parametrize("quantization", ["nf4", "int8"])
def test_qlora_built_on_the_host_is_the_model_maxtext_builds(converted, eager_builds, quantization, monkeypatch):
    """QLoRA's model restored and quantized in host memory, then placed (loraflow.trainer.host_build): the
    same model state, value for value, as MaxText's own from_pretrained + apply_lora_to_model; nf4's values
    looked up in loraflow.trainer.nf4_table's table (bf16 weights), not computed by qwix's argmin, and the
    scales calibrated by loraflow.trainer.abs_max."""
    import numpy as np
    from maxtext.trainers.post_train.sft import train_sft

    from loraflow.trainer import abs_max, host_build, lora_apply, nf4_table

    looked_up, lookups = nf4_table.looked_up, []
    apart, calibrations = abs_max.apart, []

    def counted_apart(qwix_calibrate: Any) -> Any:
        calibrate = apart(qwix_calibrate)
        return lambda array, how: calibrations.append(how.calibration_method) or calibrate(array, how)

    monkeypatch.setattr(abs_max, "apart", counted_apart)

    def counted(levels: Any, qwix_nf4: Any) -> Any:
        by_table = looked_up(levels, qwix_nf4)
        return lambda array: lookups.append(array.dtype) or by_table(array)

    monkeypatch.setattr(nf4_table, "looked_up", counted)

    ctx = _sft_context(converted, f"host-{quantization}", steps=2, quantization=quantization, tile_size=32)
    mt_config = _config(ctx)
    reference = _eager(eager_builds, mt_config, quantization)

    notes: list[str] = []
    with lora_apply.applied_under_jit(notes.append), host_build.built_on_host(notes.append):
        model, mesh = train_sft.model_creation_utils.from_pretrained(mt_config)
        assert train_sft.lora_utils.apply_lora_to_model(model, mesh, mt_config) is model
    built = _arrays(model)

    assert built.keys() == reference.keys() and any("qvalue" in k for k in built)
    different = [k for k in built if built[k].dtype != reference[k].dtype or not np.array_equal(built[k], reference[k])]
    assert different == [], different
    assert any("restored into host memory" in n for n in notes)
    # every targeted kernel of the (bf16) layer stack quantized through the table; int8 has no nf4 to look up
    assert lookups == (["bfloat16"] * 7 if quantization == "nf4" else []), lookups
    # and every one's scales calibrated with its abs kept apart (loraflow.trainer.abs_max), nf4 and int8 alike
    assert calibrations == ["absmax"] * 7, calibrations
    # the set-up's time, phase by phase (where an 8B QLoRA's minute of set-up goes): every phase named once
    placed = [n for n in notes if "model placed on" in n]
    assert len(placed) == 1, notes
    phases = {"checkpoint read", "host layout", "quantize", "abstract model", "transfers", "layer-axis moves"}
    if quantization == "nf4":  # its 4-bit values are packed on the host and unpacked where they land
        phases |= {"packing", "unpacking"}
    # the host layout's own parts beside it: its stacks' moved copies, JAX's copies, the waits for let-go
    outer, layout, rest = re.fullmatch(r".*built in \d+s \((.*host layout \d+s) \(([^()]*)\)(.*)\)", placed[0]).groups()
    named = re.findall(r"([a-z -]+?) (\d+)s", outer + rest)
    assert sorted(phase.strip(", ") for phase, _ in named) == sorted(phases), placed
    parts = re.findall(r"([a-z -]+?) (\d+)s", layout)
    assert sorted(part.strip(", ") for part, _ in parts) == ["copies", "let-go", "moves"], placed


def test_qlora_on_the_host_keeps_no_checkpoint_array_beside_its_placed_copy(converted, monkeypatch):
    """The checkpoint is read into host memory once, as numpy arrays (no jax.Array of it yet), and each is
    gone as soon as its jax.Array copy exists (a stack's, copied into the host's layout, before JAX takes
    that copy): host memory holds the model and at most one array more. Orbax's jax.Array read kept the
    buffers it had copied from until jaxlib's next garbage collection (the read's peak 0.6-0.9 GiB above
    the model at 1.5 B), the restore's result kept each stack beside its moved copy (1.56x), the numpy
    array lived on through its move (1.42x at 3.6 B, bench/notes.md section 13b), and an nnx.State's
    reference cycle kept a moved stack's array read until the next collection (section 13c). Counted in
    live arrays and in references, not RSS."""
    import weakref

    import jax
    import numpy as np
    from maxtext.trainers.post_train.sft import train_sft

    from loraflow.trainer import host_build, lora_apply

    ctx = _sft_context(converted, "host-layout", steps=2, quantization="nf4", tile_size=32)
    mt_config = _config(ctx)
    from_host, laid_out, restored = host_build._from_host_memory, host_build._laid_out, []
    read: list[weakref.ref[Any]] = []  # the checkpoint's numpy arrays not taken by JAX as they are
    moved: list[tuple[int, ...]] = []  # the stacks copied into the host's layout
    kept: list[tuple[int, int]] = []

    def held() -> int:  # each live buffer once: unsafe_buffer_pointer makes a second jax.Array of its buffer
        return sum({x.unsafe_buffer_pointer(): x.nbytes for x in jax.live_arrays()}.values())

    def counted(value: Any, *args: Any) -> Any:
        assert isinstance(value, np.ndarray), type(value)  # read into host memory, no jax.Array of it yet
        alive = [r() is not None for r in read]
        assert not any(alive), f"{alive.count(True)} of the {len(alive)} arrays placed so far alive"
        before, nbytes = held(), value.nbytes
        placed, gone = from_host(value, *args)
        kept.append((held() - before, nbytes))
        # a numpy array JAX took as its buffer (aligned, not copied) lives on as the jax.Array: no second copy
        if placed.unsafe_buffer_pointer() != value.ctypes.data:
            read.append(weakref.ref(value))
        return placed, gone

    def laying_out(value: Any, *args: Any) -> Any:
        alive = [r() is not None for r in read]
        assert not any(alive), f"{alive.count(True)} of the {len(read)} checkpoint arrays alive at a move"
        moved.append(value.shape)
        return laid_out(value, *args)

    monkeypatch.setattr(host_build, "_from_host_memory", counted)
    monkeypatch.setattr(host_build, "_laid_out", laying_out)
    # no automatic collections: an array read that only a collection frees (a reference cycle) is found
    # whatever the tests before left for the collector's counts; the build's own collections still run
    gc.disable()
    try:
        with lora_apply.applied_under_jit(restored.append), host_build.built_on_host(restored.append):
            train_sft.model_creation_utils.from_pretrained(mt_config)
    finally:
        gc.enable()
    # a moved stack is never the array read (read holds it); an unmoved one JAX copies unless it is aligned
    assert len(kept) > 1 and len(moved) > 1 and len(read) >= len(moved), (read, moved)
    assert not any(r() is not None for r in read), read
    # each placing added its array's bytes in jax.Arrays (its copy) and nothing more
    assert all(added == nbytes for added, nbytes in kept), kept


def test_qlora_reads_the_checkpoint_in_groups_of_bounded_bytes_and_builds_the_same_model(converted, monkeypatch):
    """QLoRA's host read (host_build._read) is one Orbax restore per group of arrays (:func:`_groups`, in
    bytes), in the tree's order, each array once: one restore of the whole tree let chunks read but not
    yet decoded pile up beside the model (bench/notes.md section 13b). The model built from the grouped
    reads is the one built from a single read of the whole tree. Counted in the bytes each restore
    returned, not RSS."""
    import numpy as np
    import orbax.checkpoint as ocp
    from flax import traverse_util

    from loraflow.trainer import host_build

    mt_config = _config(_sft_context(converted, "host-read", steps=2, quantization="nf4", tile_size=32))
    restore, calls = ocp.Checkpointer.restore, []

    def recorded(self: Any, *args: Any, **kwargs: Any) -> Any:
        read = restore(self, *args, **kwargs)
        calls.append({path: array.nbytes for path, array in traverse_util.flatten_dict(read).items()})
        return read

    def built(bound: int) -> tuple[dict[str, Any], list[dict[Any, int]]]:
        calls.clear()
        monkeypatch.setattr(host_build, "READ_GROUP_BYTES", bound)
        model, _ = host_build._restored_on_host(mt_config, host_build.Phases())
        return _arrays(model), list(calls)

    monkeypatch.setattr(ocp.Checkpointer, "restore", recorded)
    whole, [tree] = built(1 << 40)  # the whole tree in one restore
    sizes = list(tree.values())
    # one byte short of the layers' two norm scales (the tree's 5th and 6th arrays): each is read alone,
    # and so is every kernel (larger than the bound)
    bound = sizes[4] + sizes[5] - 1
    assert sizes[4] <= bound < max(sizes) and len(sizes) > 6, list(tree.items())
    grouped, groups = built(bound)

    assert [path for group in groups for path in group] == list(tree)
    assert all(group and (sum(group.values()) <= bound or len(group) == 1) for group in groups), groups
    closed = [(sum(group.values()), next(iter(after.values()))) for group, after in itertools.pairwise(groups)]
    assert all(total + first > bound for total, first in closed), (bound, closed)
    assert grouped.keys() == whole.keys()
    different = [k for k in whole if grouped[k].dtype != whole[k].dtype or not np.array_equal(grouped[k], whole[k])]
    assert different == [], different


def test_qlora_reads_the_next_group_while_it_lays_out_this_one_and_never_two_ahead(converted, monkeypatch):
    """host_build._read_ahead: the second group's restore starts while the first group's first array is
    being laid out (the layout waits for it, up to WAIT_S: read one group after the other, it never starts),
    and a group's restore starts only once the group two before it is laid out whole (a slow layout: read
    further ahead, restores would run past it). The model is the one a single read builds (the test above)."""
    import threading
    import time

    import orbax.checkpoint as ocp
    from flax import traverse_util

    from loraflow.trainer import host_build

    wait_s = 10.0
    mt_config = _config(_sft_context(converted, "read-ahead", steps=2, quantization="nf4", tile_size=32))
    monkeypatch.setattr(host_build, "READ_GROUP_BYTES", 1)  # every array a group of its own
    restore, lay_out = ocp.Checkpointer.restore, host_build._from_host_memory
    groups: list[list[Any]] = []  # each restore's paths, in the order the restores started
    laid_out: list[Any] = []
    second_started, lock = threading.Event(), threading.Lock()
    seen_before_start: list[tuple[int, int]] = []  # (restore k, arrays laid out when it started)

    def recorded(self: Any, directory: Any, item: Any = None, **kwargs: Any) -> Any:
        with lock:
            seen_before_start.append((len(groups), len(laid_out)))
            groups.append([path[2:] for path in traverse_util.flatten_dict(item)])
        if len(groups) == 2:
            second_started.set()
        return restore(self, directory, item=item, **kwargs)

    waited: list[bool] = []

    def slow_layout(array: Any, *args: Any) -> Any:
        if not laid_out:
            waited.append(second_started.wait(wait_s))
        time.sleep(0.05)
        result = lay_out(array, *args)
        with lock:
            laid_out.append(array.shape)
        return result

    monkeypatch.setattr(ocp.Checkpointer, "restore", recorded)
    monkeypatch.setattr(host_build, "_from_host_memory", slow_layout)
    host_build._restored_on_host(mt_config, host_build.Phases())
    assert waited == [True]
    assert len(groups) == len(laid_out) > 3 and all(len(group) == 1 for group in groups)
    # restore k started with at least the groups before k-1 laid out (each group one array here)
    assert all(done >= k - 1 for k, done in seen_before_start), seen_before_start
    assert not [t for t in threading.enumerate() if t.name.startswith("loraflow-checkpoint-read")]


def test_a_checkpoint_read_that_fails_fails_the_host_build_and_leaves_no_reader(converted, monkeypatch):
    """A restore that raises while the layout runs (the third group: a truncated file, a lost disk) is the
    host build's error, raised where the layout asks for that group; the reading thread ends."""
    import threading

    import orbax.checkpoint as ocp

    from loraflow.errors import LoraflowError
    from loraflow.trainer import host_build

    mt_config = _config(_sft_context(converted, "read-fails", steps=2, quantization="nf4", tile_size=32))
    monkeypatch.setattr(host_build, "READ_GROUP_BYTES", 1)
    restore, calls = ocp.Checkpointer.restore, []

    def fails_third(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 3:
            raise OSError("checkpoint chunk 7 of layers/mlp/wo: unexpected end of file")
        return restore(self, *args, **kwargs)

    monkeypatch.setattr(ocp.Checkpointer, "restore", fails_third)
    with pytest.raises(OSError, match="unexpected end of file"):
        host_build._restored_on_host(mt_config, host_build.Phases())
    assert len(calls) == 3
    assert not [t for t in threading.enumerate() if t.name.startswith("loraflow-checkpoint-read")]
    # a read whose groups leave out one of the model's arrays is refused, not a model with a hole in it
    monkeypatch.setattr(ocp.Checkpointer, "restore", restore)
    groups = host_build._groups
    monkeypatch.setattr(host_build, "_groups", lambda sizes: groups(sizes)[:-1])
    with pytest.raises(LoraflowError, match="1 of the model's arrays are not in the checkpoint read"):
        host_build._restored_on_host(mt_config, host_build.Phases())


def test_read_groups_take_arrays_in_order_while_their_bytes_fit_the_bound(monkeypatch):
    """host_build._groups: a group takes the next array while the group's bytes stay at most the bound
    (filling it exactly too), and an array larger than the bound is a group of its own."""
    from loraflow.trainer import host_build

    monkeypatch.setattr(host_build, "READ_GROUP_BYTES", 10)
    sizes = {"a": 4, "b": 6, "c": 3, "d": 3, "e": 5, "f": 12, "g": 1, "h": 10}
    assert host_build._groups(sizes) == [["a", "b"], ["c", "d"], ["e"], ["f"], ["g"], ["h"]]
    assert host_build._groups({}) == []


class _Held:
    """An object that weak references can follow, standing in for a checkpoint array."""


def test_a_placed_array_held_in_an_old_reference_cycle_is_freed_before_the_next_is_read():
    """A checkpoint array that only a garbage collection can free, from a cycle that outlived the young
    generation: the build's wait frees it (a full collection) before it reads the next array."""
    import weakref

    from loraflow.trainer import host_build

    held = _Held()
    held.cycle = held  # type: ignore[attr-defined]
    gc.collect()  # the cycle is now in the oldest generation
    read = weakref.ref(held)
    del held
    gc.collect(0)
    assert read() is not None  # a young collection does not reach it
    host_build._let_go(read, seconds=30)
    assert read() is None


@contextlib.contextmanager
def _jaxlib_garbage() -> Iterator[list[Any]]:
    """A stand-in for the list jaxlib hands the host buffers it lets go of to: only a garbage collection
    (its callback, any generation) empties it, freeing what the list alone held."""
    garbage: list[Any] = []

    def collect(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            garbage.clear()

    gc.callbacks.append(collect)
    try:
        yield garbage
    finally:
        gc.callbacks.remove(collect)


def test_a_placed_array_let_go_by_one_collection_costs_no_full_collection():
    """The usual case: the young collection after a placing frees its array; no full collection (which
    walks every object in the trainer's process) is paid for it."""
    import weakref

    from loraflow.trainer import host_build

    generations: list[int] = []

    def counted(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            generations.append(info["generation"])

    with _jaxlib_garbage() as garbage:
        garbage.append(_Held())
        read = weakref.ref(garbage[0])
        gc.callbacks.append(counted)
        try:
            host_build._let_go(read, seconds=30)
        finally:
            gc.callbacks.remove(counted)
    assert read() is None
    assert generations and 2 not in generations, generations


def test_a_placed_array_let_go_late_on_another_thread_is_waited_for():
    """jaxlib may let go of the buffer it copied from after the copy was waited for, on its own thread,
    into its garbage: the wait lasts until a collection after that, not one collection."""
    import threading
    import weakref

    from loraflow.trainer import host_build

    holder = [_Held()]
    read = weakref.ref(holder[0])
    with _jaxlib_garbage() as garbage:
        # holder keeps it until the timer hands it to the garbage: gone means the wait outlasted that
        threading.Timer(0.3, lambda: garbage.append(holder.pop())).start()
        host_build._let_go(read, seconds=30)
    assert read() is None


def test_a_placed_array_that_is_never_let_go_stops_the_wait_at_its_bound():
    """An array something else keeps (no fault of the build's) costs the wait's bound, not a hang."""
    import time
    import weakref

    from loraflow.trainer import host_build

    kept = _Held()
    started = time.monotonic()
    host_build._let_go(weakref.ref(kept), seconds=0.5)
    assert 0.5 <= time.monotonic() - started < 20


def _at(offset: int, values: Any) -> Any:
    """A numpy copy of ``values`` whose data lies ``offset`` bytes past a 64-byte boundary (Orbax's reads lie
    16 past one), in a buffer of its own: gone when the copy is."""
    import numpy as np

    buffer = np.empty(values.nbytes + 128, dtype=np.uint8)
    start = -buffer.ctypes.data % 64 + offset
    array = buffer[start : start + values.nbytes].view(values.dtype).reshape(values.shape)
    np.copyto(array, values)
    return array


def _laid_out_on_threads(monkeypatch: pytest.MonkeyPatch, array: Any, *args: Any) -> tuple[Any, list[int]]:
    """host_build._laid_out(array, *args), and the thread each of its numpy copies ran on, in order."""
    import threading

    import numpy as np

    from loraflow.trainer import host_build

    copyto, copies = np.copyto, []

    def copying(*copy_args: Any) -> None:
        copies.append(threading.get_ident())
        copyto(*copy_args)

    with monkeypatch.context() as patched:
        patched.setattr(np, "copyto", copying)
        copy = host_build._laid_out(array, *args)
    return copy, copies


@pytest.mark.parametrize(("source", "target"), [(1, 0), (2, 0), (0, 2)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_checkpoint_stack_is_moved_in_one_aligned_copy_that_jax_takes_as_it_is(monkeypatch, source, target, dtype):
    """A stacked weight read from the checkpoint (unaligned, as Orbax's are) is copied once, by numpy, into
    the host's layout at a 64-byte boundary, which JAX takes as its buffer (no copy of its own: nothing left
    to wait for), with every value where ``moveaxis`` puts it and its dtype kept; the array read is gone
    before JAX gets the copy (the model and one stack more). JAX's own copy of the unaligned array and a
    compiled ``moveaxis`` after it were two passes over fresh memory: the host layout took 32 s at 8B."""
    import weakref

    import jax
    import ml_dtypes
    import numpy as np

    from loraflow.trainer import host_build

    values = (np.arange(3 * 5 * 4 * 6, dtype=np.float32).reshape(3, 5, 4, 6) + 1).astype(
        getattr(ml_dtypes, dtype, dtype)
    )
    arrays = [_at(16, values)]
    assert arrays[0].ctypes.data % 64 == 16
    checkpoint = weakref.ref(arrays[0])
    put, at_put = host_build.put, []
    monkeypatch.setattr(host_build, "put", lambda value, *a: at_put.append(checkpoint()) or put(value, *a))
    on_cpu = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
    phases = host_build.Phases()
    placed, copied_from = host_build._from_host_memory(arrays.pop(), source, target, on_cpu, phases)
    assert at_put == [None]  # the array read was gone when JAX got its copy
    expected = np.moveaxis(values, source, target)
    assert placed.dtype == values.dtype and placed.shape == expected.shape
    assert np.array_equal(np.asarray(placed), expected)
    assert copied_from is None  # JAX took the aligned copy as its buffer: it is the model's memory
    assert placed.unsafe_buffer_pointer() % 64 == 0
    assert list(phases.seconds) == ["moves", "copies"]


def test_an_array_that_does_not_move_is_taken_as_it_is_or_copied_by_numpy_and_a_4bit_stack_lands_narrowed():
    """An array with no layer axis to move is JAX's to take where it lies on JAX's boundary; off it (Orbax's
    reads lie 16 bytes past one) numpy copies it into memory JAX takes, not JAX (a quarter of numpy's speed:
    the 8B embedding and head took most of the host layout's 4 s of copies on the chip's host); a scalar is
    JAX's either way. A 4-bit stack (ml_dtypes keeps it a byte a value) is moved by numpy and narrowed where it
    lands, every value in place, and its moved copy is let go (JAX copied from it)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from loraflow.trainer import host_build

    on_cpu = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
    for values in (np.arange(4 * 6, dtype=np.float32).reshape(4, 6), np.arange(7, dtype=np.float32)):
        for offset in (16, 0):
            phases = host_build.Phases()
            read = _at(offset, values)
            placed, copied_from = host_build._from_host_memory(read, None, 0, on_cpu, phases)
            assert np.array_equal(np.asarray(placed), values) and placed.shape == values.shape
            assert copied_from is None  # no copy of JAX's: nothing to let go
            # on the boundary JAX took the array read itself; off it, numpy's copy
            assert (placed.unsafe_buffer_pointer() == read.ctypes.data) == (offset == 0), offset
            assert list(phases.seconds) == ["copies"]
    scalar = _at(16, np.array(2.5, dtype=np.float32))  # off the boundary, with no rows to copy by
    placed, _ = host_build._from_host_memory(scalar, None, 0, on_cpu, host_build.Phases())
    assert placed.shape == () and float(placed) == 2.5
    nibbles = (np.arange(3 * 4 * 2) % 16).reshape(3, 4, 2).astype(jnp.uint4)
    placed, copied_from = host_build._from_host_memory(_at(16, nibbles), 1, 0, on_cpu, host_build.Phases())
    assert placed.dtype == jnp.uint4 and placed.shape == (4, 3, 2)
    assert np.array_equal(np.asarray(placed.astype(jnp.uint8)), np.moveaxis(nibbles, 1, 0).astype(np.uint8))
    assert copied_from is not None
    host_build._let_go(copied_from, seconds=30)
    assert copied_from() is None


@pytest.mark.parametrize("layers", [1, 2, 3, 5, 8])
def test_a_stack_copied_by_several_threads_has_every_layer_once_in_place(monkeypatch, layers):
    """The host layout's copy is split over threads by slices of the layer axis: with parts of any size,
    every layer lands in place, once, whether there are more threads than layers or fewer; the copy is
    aligned and of the array's dtype."""
    import threading

    import numpy as np

    from loraflow.trainer import host_build

    monkeypatch.setattr(host_build, "COPY_PART_BYTES", 1)
    values = np.arange(7 * layers * 3 * 2, dtype=np.float32).reshape(7, layers, 3, 2) + 1
    main = threading.get_ident()
    for threads in (1, 2, 3, 8):
        copy, copies = _laid_out_on_threads(monkeypatch, _at(16, values), 1, 0, threads)
        assert copy.ctypes.data % 64 == 0 and copy.dtype == values.dtype
        assert np.array_equal(copy, np.moveaxis(values, 1, 0)), (layers, threads)
        parts = min(threads, layers)  # one copy a part, on a thread of the pool where there are several
        assert len(copies) == parts, (layers, threads, copies)
        assert copies == [main] if parts == 1 else main not in copies, (layers, threads, copies)
    for cores, expected in ((13, 8), (8, 8), (2, 2), (1, 1), (None, 1)):
        monkeypatch.setattr(os, "cpu_count", lambda cores=cores: cores)
        assert host_build._copy_threads() == expected, cores


def test_a_stack_is_split_in_parts_of_at_least_the_part_bytes(monkeypatch):
    """A thread for each part of a small array costs more than it saves: a stack of a few KiB is copied on
    the calling thread whatever the host's cores, one of twice COPY_PART_BYTES in two parts."""
    import threading

    import numpy as np

    from loraflow.trainer import host_build

    monkeypatch.setattr(os, "cpu_count", lambda: 13)  # the chip's host: threads enough for more parts
    small = np.ones((4, 8, 16), dtype=np.float32)
    large = np.ones((host_build.COPY_PART_BYTES // 4 // 8, 8, 2), dtype=np.float32)
    for values, parts in ((small, 1), (large, 2)):
        copy, copies = _laid_out_on_threads(monkeypatch, _at(16, values), 1, 0)
        assert len(copies) == parts and np.array_equal(copy, np.moveaxis(values, 1, 0)), (values.shape, copies)
        assert copies == [threading.get_ident()] if parts == 1 else threading.get_ident() not in copies


def test_a_copy_that_fails_on_a_thread_fails_the_layout(monkeypatch):
    """A copy that fails on one of the threads (out of memory, say) is raised, not left half-made behind an
    exception that nothing read."""
    import numpy as np

    from loraflow.trainer import host_build

    monkeypatch.setattr(host_build, "COPY_PART_BYTES", 1)
    copyto = np.copyto

    def failing(destination: Any, source: Any) -> None:
        if destination.shape[0] == 1:  # the first part of three layers on two threads
            raise MemoryError("no memory for this part")
        copyto(destination, source)

    array = _at(16, np.ones((4, 3, 2), dtype=np.float32))
    monkeypatch.setattr(np, "copyto", failing)
    with pytest.raises(MemoryError, match="no memory for this part"):
        host_build._laid_out(array, 1, 0, 2)


def test_layer_slices_for_the_threads_take_every_layer_once_in_order():
    """host_build._row_slices: at most the parts asked for (no empty one), consecutive, each row in exactly
    one, of sizes within one of each other."""
    from loraflow.trainer import host_build

    for rows, parts in ((0, 3), (1, 1), (1, 4), (5, 1), (5, 2), (5, 5), (5, 9), (16, 3), (17, 8)):
        slices = host_build._row_slices(rows, parts)
        assert len(slices) == min(parts, rows), (rows, parts, slices)
        covered = [row for part in slices for row in range(rows)[part]]
        assert covered == list(range(rows)), (rows, parts, slices)  # in order, each row once
        sizes = [part.stop - part.start for part in slices]
        assert not sizes or max(sizes) - min(sizes) <= 1, sizes


def test_fresh_arrays_start_where_jax_takes_them_as_they_are():
    """host_build._fresh: the shape and dtype asked for, at a 64-byte boundary (a page's), whatever numpy's
    own offset would be; JAX's CPU client takes such a buffer without a copy."""
    import jax
    import ml_dtypes
    import numpy as np

    from loraflow.trainer import host_build

    for shape, dtype in (
        ((3, 5), ml_dtypes.bfloat16),
        ((7,), np.float32),
        ((2, 1, 3), np.int8),
        ((1 << 20,), np.uint16),
        ((0, 4), np.float32),
    ):
        array = host_build._fresh(shape, dtype)
        assert array.shape == shape and array.dtype == dtype and array.ctypes.data % 64 == 0
        assert array.flags.writeable and array.flags.c_contiguous
        array[...] = 1
        if array.size:
            on_cpu = jax.device_put(array, jax.local_devices(backend="cpu")[0])
            assert on_cpu.unsafe_buffer_pointer() == array.ctypes.data


def test_the_set_up_text_shows_a_phase_s_parts_beside_it():
    """The task log's set-up breakdown: a phase with parts of its own (the host layout) shows them in
    parentheses beside its seconds."""
    from loraflow.trainer import host_build

    parts = host_build.Phases({"moves": 20.2, "copies": 8.0, "let-go": 3.6})
    phases = host_build.Phases({"checkpoint read": 22.0, "host layout": 31.8, "quantize": 13.0}, {"host layout": parts})
    assert phases.text() == "checkpoint read 22s, host layout 32s (moves 20s, copies 8s, let-go 4s), quantize 13s"
    assert host_build.Phases({"a": 1.0}, {"a": host_build.Phases()}).text() == "a 1s"


def test_qlora_on_the_host_needs_scratch_for_a_layer_not_the_layer_stack(converted, tmp_path):
    """Quantizing on the host is one compiled program over the whole layer stack; its scratch must stay
    about one layer's, whatever the depth (an 8B model's stack in f32 is ~30 GiB: more than a TPU host
    has beside the model). Compiled from shapes only, for a 16-layer model: nothing is allocated (and
    compiled here, not read from the session's compilation cache)."""
    import jax
    import qwix
    from flax import nnx
    from flax.core.spmd import logical_axis_rules
    from maxtext.utils import lora_utils, model_creation_utils

    from loraflow.trainer import host_build, lora_apply

    ctx = _sft_context(converted, "host-scratch", steps=2, quantization="nf4", tile_size=32)
    mt_config = _config(ctx)
    layers = 16
    config = host_build.host_config(mt_config.model_copy(update={"num_decoder_layers": layers}))
    eager, scratch = qwix.apply_lora_to_model, []

    class Compiled(Exception):
        pass

    def compile_only(model: Any, provider: Any, **inputs: Any) -> Any:
        program, *_ = lora_apply.compiled(eager, model, provider, **inputs)
        scratch.append(program.memory_analysis().temp_size_in_bytes)
        raise Compiled

    host = jax.local_devices(backend="cpu")[:1]
    with logical_axis_rules(config.logical_axis_rules):
        _, abstract = model_creation_utils.create_nnx_abstract_model(config, devices=host)
        qwix.apply_lora_to_model = compile_only
        try:
            with compiled_afresh(tmp_path / "jax-cache"), jax.set_mesh(abstract.mesh), pytest.raises(Compiled):
                lora_utils.apply_lora_to_model(abstract, abstract.mesh, config)
        finally:
            qwix.apply_lora_to_model = eager
    kernels = [
        var.get_value()
        for path, var in nnx.to_flat_state(nnx.state(abstract, nnx.Param))
        if "layers" in path and path[-1] == "kernel"
    ]
    stack = sum(k.size for k in kernels) * 4  # every targeted kernel of every layer, in f32
    assert kernels and all(k.shape[0] == layers for k in kernels)  # the host's stacks: layer axis first
    assert scratch and scratch[0] < 3 * stack / layers, (scratch, stack)


def test_a_4bit_array_crosses_to_its_device_as_bytes_and_lands_with_every_value(monkeypatch, caplog):
    """QLoRA's placement never sends 4-bit values (uint4 crossed to a TPU at a tenth of uint8's rate): a 4-bit
    array whose last dimension pairs up crosses packed, two values to a byte, and one that does not as the
    bytes the host keeps it in; either is turned back into its 4-bit values where it lands, every uint4 and
    int4 value in place, at odd and even positions. An array of another dtype crosses as it is. It runs under
    the trainer's mesh, as lora_sft calls it."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from loraflow.trainer import host_build

    sent: list[tuple[str, tuple[int, ...]]] = []
    device_put = jax.device_put
    monkeypatch.setattr(
        jax, "device_put", lambda x, *a, **k: sent.append((str(x.dtype), x.shape)) or device_put(x, *a, **k)
    )
    target = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    with jax.set_mesh(mesh):
        for dtype, values in ((jnp.uint4, np.arange(16)), (jnp.int4, np.arange(-8, 8))):
            grid = np.stack([values, values[::-1], np.roll(values, 5)])
            for width, row in (
                (32, np.concatenate([grid, grid[:, ::-1]], axis=1)),
                (31, np.concatenate([grid, grid[:, :-1]], axis=1)),
            ):
                array = jnp.asarray(row, dtype=dtype)
                phases = host_build.Phases()
                placed = host_build.put(array, target, phases)
                assert placed.dtype == array.dtype and placed.shape == array.shape == (3, width)
                assert np.array_equal(np.asarray(placed.astype(jnp.int8)), np.asarray(array.astype(jnp.int8)))
                packed = width % 2 == 0
                assert list(phases.seconds) == (["packing"] if packed else []) + ["transfers", "unpacking"]
    # packed: half the bytes, uint8 for both; not packed: ml_dtypes' own bytes (int4 as int8)
    assert sent == [("uint8", (3, 16)), ("uint8", (3, 31)), ("uint8", (3, 16)), ("int8", (3, 31))]
    sent.clear()
    for other in (jnp.zeros((2, 4), jnp.int8), jnp.ones((2, 3), jnp.bfloat16)):
        placed = host_build.put(other, target)
        assert placed.dtype == other.dtype and np.array_equal(np.asarray(placed), np.asarray(other))
    assert sent == [("int8", (2, 4)), ("bfloat16", (2, 3))]
    sent.clear()
    # a 4-bit numpy array and a 4-bit scalar cross as their bytes (nothing to pack, no device of their own)
    for value in (np.asarray([[3, 12]], dtype=jnp.uint4), jnp.asarray(-5, jnp.int4)):
        placed = host_build.put(value, target)
        assert placed.dtype == value.dtype and np.array_equal(
            np.asarray(placed.astype(jnp.int8)), np.asarray(value).astype(np.int8)
        )
    assert sent == [("uint8", (1, 2)), ("int8", ())]
    # each program compiles once per shape, not once per array (an 8B model has hundreds of arrays)
    with jax.log_compiles(True), caplog.at_level(logging.WARNING, logger="jax"):
        for _ in range(3):
            host_build.put(jnp.zeros((4, 6), jnp.uint4), target)
            host_build.put(jnp.zeros((4, 5), jnp.uint4), target)
    compiled = [r.getMessage() for r in caplog.records if "compilation of jit(" in r.getMessage()]
    assert [sum(f"compilation of jit({f})" in m for m in compiled) for f in ("_pack", "unpack", "narrow")] == [1, 1, 1]


def test_a_4bit_array_is_packed_on_its_own_device_under_another_devices_mesh(tmp_path):
    """lora_sft places the host-built model under its own mesh (the TPU's): packing a host array with a program
    compiled for that mesh fails there ("incompatible devices"). Two CPU devices stand in for the host and the
    chip, in a process of their own (the device count is fixed when JAX starts); a packed array sharded over
    both lands with every value in place too."""
    import subprocess

    script = tmp_path / "two_devices.py"
    script.write_text(
        "import jax, jax.numpy as jnp, numpy as np\n"
        "from loraflow.trainer import host_build\n"
        "host, chip = jax.devices()[:2]\n"
        "values = jax.device_put(jnp.asarray(np.arange(-8, 8).reshape(2, 8), jnp.int4), host)\n"
        "with jax.set_mesh(jax.sharding.Mesh(np.array([chip]), ('data',))):\n"
        "    placed = host_build.put(values, jax.sharding.SingleDeviceSharding(chip))\n"
        "assert placed.devices() == {chip} and placed.dtype == jnp.int4, placed\n"
        "assert np.array_equal(np.asarray(placed.astype(jnp.int8)), np.arange(-8, 8).reshape(2, 8))\n"
        "both = jax.sharding.Mesh(np.array([host, chip]), ('x',))\n"
        "with jax.set_mesh(both):\n"
        "    split = host_build.put(values, jax.sharding.NamedSharding(both, jax.sharding.PartitionSpec(None, 'x')))\n"
        "assert split.devices() == {host, chip} and split.addressable_shards[1].data.shape == (2, 4), split\n"
        "assert np.array_equal(np.asarray(split.astype(jnp.int8)), np.arange(-8, 8).reshape(2, 8))\n"
        "print('placed')\n"
    )
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode == 0 and done.stdout.strip() == "placed", done.stderr[-3000:]
