"""The native merge kernel gives the numpy path's bits, on every instruction set this CPU has.

The numpy path is the reference here (it is itself checked against einsum in test_merge.py and
against PEFT in tests/serving). A merged checkpoint written on the kernel must be byte-identical
to one written on numpy.
"""

from __future__ import annotations

import json
import os
from fractions import Fraction
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from loraflow import merge, merge_kernel
from loraflow.merge import MergeError, merge_checkpoint, merge_lora
from loraflow.safetensors_io import Checkpoint, SafetensorsError

BF16 = ml_dtypes.bfloat16
LEVELS = [level for level in merge_kernel.ISAS if level <= merge_kernel.isa()]


def reference(w: np.ndarray, a: np.ndarray, b: np.ndarray, scale: float) -> np.ndarray:
    """The numpy path, whatever the kernel's state."""
    saved = merge_kernel.usable
    merge_kernel.usable = lambda dtype: False  # type: ignore[assignment]
    try:
        return merge_lora(w, a, b, scale)
    finally:
        merge_kernel.usable = saved  # type: ignore[assignment]


def kernel(w: np.ndarray, a: np.ndarray, b: np.ndarray, scale: float, level: int) -> tuple:
    out = np.empty_like(w)
    top, changed, bad = merge_kernel.merge_rows(w, out, a, merge_kernel.pack(a), b, scale, level)
    return out, top, changed, bad


def bits(x: np.ndarray) -> np.ndarray:
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


def test_the_kernel_is_built_and_used_here() -> None:
    """make envs builds it; an x86-64 CI machine has AVX2+FMA at least."""
    assert merge_kernel.LIBRARY.is_file(), f"the native merge kernel is not built: run {merge_kernel.BUILD}"
    assert merge_kernel.isa() >= 2, merge_kernel.status()
    assert merge_kernel.usable(np.dtype(BF16)) and merge_kernel.usable(np.dtype(np.float32))
    assert not merge_kernel.usable(np.dtype(np.float16)) and not merge_kernel.usable(np.dtype(np.float64))
    assert "native merge kernel" in merge_kernel.status()


def f32_fma_chain(b_row: np.ndarray, a_col: np.ndarray) -> np.float32:
    """sum_k b[k]·a[k] as float32 fused multiply-adds in k order, each rounded once, exactly (rationals)."""
    acc = np.float32(0.0)
    for bk, ak in zip(b_row.tolist(), a_col.tolist(), strict=True):
        exact = Fraction(bk) * Fraction(ak) + Fraction(float(acc))
        near = np.float32(float(exact))  # within an ulp: pick the nearest of it and its neighbours, ties to even
        cands = [np.nextafter(near, np.float32(-np.inf)), near, np.nextafter(near, np.float32(np.inf))]
        acc = min(cands, key=lambda c: (abs(Fraction(float(c)) - exact), int(c.view(np.uint32)) & 1))
    return acc


CASES = [(64, 256, 16), (37, 300, 8), (5, 77, 1), (1, 128, 3), (130, 1024, 64)]
CASE_IDS = ["tiles", "odd-rows+tail", "tail-only", "one-row", "rank64"]


def case(rows: int, cols: int, r: int, dtype: type) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(rows * cols + r)
    w = (rng.standard_normal((rows, cols)) * 0.02).astype(dtype)
    w[0, :3] = [0.0, -0.0, 1e-40]  # signed zero and a subnormal
    a = (rng.standard_normal((r, cols)) * 0.01).astype(np.float32)
    b = (rng.standard_normal((rows, r)) * 0.01).astype(np.float32)
    return w, a, b


def test_the_update_is_an_fma_chain_in_rank_order() -> None:
    """What the kernel computes, checked against exact rational arithmetic, on a tile and a tail."""
    w, a, b = case(3, 140, 16, np.float32)
    got = kernel(w, a, b, 1.5, LEVELS[-1])[0]
    for i in range(3):
        for j in (0, 1, 77, 127, 128, 139):
            update = np.float32(f32_fma_chain(b[i], a[:, j]) * np.float32(1.5))
            assert got[i, j] == np.float32(w[i, j] + update), (i, j)


@pytest.mark.parametrize("level", LEVELS[1:], ids=[merge_kernel.ISAS[lv] for lv in LEVELS[1:]])
@pytest.mark.parametrize("dtype", [BF16, np.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("rows,cols,r", CASES, ids=CASE_IDS)
def test_every_instruction_set_gives_the_scalar_bits(level: int, dtype: type, rows: int, cols: int, r: int) -> None:
    w, a, b = case(rows, cols, r, dtype)
    ref, ref_top, ref_changed, _ = kernel(w, a, b, 2.0, 1)
    got, top, changed, bad = kernel(w, a, b, 2.0, level)
    assert bad is None and (top, changed) == (ref_top, ref_changed)
    assert np.array_equal(bits(got), bits(ref)), f"{int((bits(got) != bits(ref)).sum())} element(s) differ"


@pytest.mark.parametrize("dtype", [BF16, np.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("rows,cols,r", CASES, ids=CASE_IDS)
def test_the_kernel_agrees_with_the_numpy_path(dtype: type, rows: int, cols: int, r: int) -> None:
    """Same bits up to rank 16 (OpenBLAS sums in rank order there too); beyond, BLAS may sum in
    another order: then an element may differ by one unit in the last place, no more."""
    w, a, b = case(rows, cols, r, dtype)
    ref = reference(w, a, b, 2.0)
    got, top, changed, bad = kernel(w, a, b, 2.0, LEVELS[-1])
    assert bad is None and changed
    assert top == pytest.approx(float(np.abs((b @ a) * np.float32(2.0)).max()), rel=1e-6)
    differ = bits(got) != bits(ref)
    if r <= 16:
        assert not differ.any(), f"{int(differ.sum())} element(s) differ"
    else:  # within rounding of the output, plus what reordering a sum of r float32 products can move
        g, f = got.astype(np.float64), ref.astype(np.float64)
        ulp = np.spacing(np.abs(f).astype(np.float32)).astype(np.float64) * (2**16 if dtype is BF16 else 1)
        reorder = r * float(np.finfo(np.float32).eps) * (np.abs(b) @ np.abs(a)).astype(np.float64) * 2.0
        assert (np.abs(g - f) <= ulp + reorder).all() and differ.mean() < 0.01


@pytest.mark.parametrize("level", LEVELS, ids=[merge_kernel.ISAS[lv] for lv in LEVELS])
def test_bf16_rounding_ties_go_to_even(level: int) -> None:
    """1 + 2^-8 lies halfway between two bf16 values: it rounds to the even one, 1.0; 1 + 3*2^-8 up."""
    w = np.ones((2, 130), BF16)  # 130 columns: a whole tile and a scalar tail
    a = np.ones((1, 130), np.float32)
    b = np.array([[2.0**-8], [3 * 2.0**-8]], np.float32)
    got = kernel(w, a, b, 1.0, level)[0].astype(np.float32)
    assert (got[0] == 1.0).all() and (got[1] == 1.0 + 2.0**-6).all()
    assert np.array_equal(bits(got.astype(BF16)), bits(reference(w, a, b, 1.0)))


@pytest.mark.parametrize("level", LEVELS, ids=[merge_kernel.ISAS[lv] for lv in LEVELS])
@pytest.mark.parametrize("row,col", [(4, 10), (5, 200), (6, 259)], ids=["even-row", "odd-row", "tail-column"])
def test_kernel_reports_the_first_non_finite_row(level: int, row: int, col: int) -> None:
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((9, 260)) * 0.02).astype(BF16)
    w[row, col] = np.inf
    w[8, 0] = np.nan  # a later row: the first one is reported
    a, b = np.ones((2, 260), np.float32), np.ones((9, 2), np.float32)
    assert kernel(w, a, b, 1.0, level)[3] == row


def test_merge_lora_names_the_row_of_a_non_finite_weight() -> None:
    w = np.zeros((300, 256), np.float32)
    w[211, 7] = np.nan
    with pytest.raises(MergeError, match="row 211"):
        merge_lora(w, np.ones((2, 256), np.float32), np.ones((300, 2), np.float32), 1.0)


@pytest.mark.parametrize("level", LEVELS, ids=[merge_kernel.ISAS[lv] for lv in LEVELS])
def test_a_zero_update_changes_nothing(level: int) -> None:
    w = (np.random.default_rng(3).standard_normal((6, 256)) * 0.02).astype(BF16)
    out, top, changed, bad = kernel(w, np.ones((4, 256), np.float32), np.zeros((6, 4), np.float32), 2.0, level)
    assert (top, changed, bad) == (0.0, False, None) and np.array_equal(bits(out), bits(w))


def test_the_kernel_refuses_what_it_cannot_merge() -> None:
    w, a, b = np.zeros((4, 8), np.float16), np.zeros((2, 8), np.float32), np.zeros((4, 2), np.float32)
    with pytest.raises(ValueError, match="BF16 and F32"):
        merge_kernel.merge_rows(w, w.copy(), a, merge_kernel.pack(a), b, 1.0)
    w32 = np.zeros((4, 8), np.float32)
    with pytest.raises(ValueError, match="do not fit"):
        merge_kernel.merge_rows(w32, w32.copy(), a, merge_kernel.pack(a), b.T.copy(), 1.0)
    with pytest.raises(ValueError, match="C-contiguous"):
        merge_kernel.merge_rows(w32, w32.copy(), a, merge_kernel.pack(a), np.zeros((2, 4), np.float32).T, 1.0)
    with pytest.raises(RuntimeError, match="not available"):
        merge_kernel.merge_rows(w32, w32.copy(), a, merge_kernel.pack(a), b, 1.0, level=merge_kernel.isa() + 1)


def write_model(root: Path, dtype: type, fan_in_fan_out: bool = False) -> tuple[Path, Path]:
    """A two-layer bf16/f32 checkpoint with tile-sized and odd projections, a rank-8 adapter."""
    rng = np.random.default_rng(7)
    base, adapter = root / "base", root / "adapter"
    base.mkdir(parents=True)
    (adapter / "peft").mkdir(parents=True)
    shapes = {"q_proj": (256, 384), "down_proj": (384, 300), "k_proj": (33, 384)}
    tensors, lora = {"model.embed_tokens.weight": rng.standard_normal((500, 384)).astype(dtype)}, {}
    for i in range(2):
        for mod, (out_dim, in_dim) in shapes.items():
            name = f"model.layers.{i}.{mod}"
            stored = (in_dim, out_dim) if fan_in_fan_out else (out_dim, in_dim)
            tensors[f"{name}.weight"] = (rng.standard_normal(stored) * 0.02).astype(dtype)
            lora[f"base_model.model.{name}.lora_A.weight"] = (rng.standard_normal((8, in_dim)) * 0.1).astype(np.float32)
            lora[f"base_model.model.{name}.lora_B.weight"] = (rng.standard_normal((out_dim, 8)) * 0.1).astype(
                np.float32
            )
    save_file(tensors, str(base / "model.safetensors"), metadata={"format": "pt"})
    (base / "config.json").write_text("{}")
    save_file(lora, str(adapter / "peft" / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": list(shapes)}
    (adapter / "peft" / "adapter_config.json").write_text(json.dumps({**config, "fan_in_fan_out": fan_in_fan_out}))
    return base, adapter


@pytest.mark.parametrize("dtype", [BF16, np.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("fan_in_fan_out", [False, True], ids=["out-in", "fan-in-fan-out"])
def test_merged_checkpoint_is_byte_identical_on_kernel_and_numpy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: type, fan_in_fan_out: bool
) -> None:
    base, adapter = write_model(tmp_path, dtype, fan_in_fan_out)
    lines: list[str] = []
    fast = merge_checkpoint(base, adapter, tmp_path / "fast", shard_bytes=200_000, progress=lines.append)
    assert "native merge kernel" in lines[0]
    monkeypatch.setattr(merge_kernel, "usable", lambda dtype: False)
    slow = merge_checkpoint(base, adapter, tmp_path / "slow", shard_bytes=200_000)
    assert fast.summary() == slow.summary() and fast.files == slow.files and len(fast.files) > 1
    for name in [*fast.files, "model.safetensors.index.json"]:
        assert (tmp_path / "fast" / name).read_bytes() == (tmp_path / "slow" / name).read_bytes(), name


def test_unchanged_tensors_are_streamed_where_copy_file_range_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base, adapter = write_model(tmp_path, BF16)
    merge_checkpoint(base, adapter, tmp_path / "direct")

    def refuse(*args: object) -> int:
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", refuse)
    merge_checkpoint(base, adapter, tmp_path / "streamed")
    assert (tmp_path / "direct/model.safetensors").read_bytes() == (
        tmp_path / "streamed/model.safetensors"
    ).read_bytes()


def test_a_mapped_tensor_equals_the_read_one_and_a_short_file_is_refused(tmp_path: Path) -> None:
    base, _ = write_model(tmp_path, BF16)
    ckpt = Checkpoint.open(base)
    for name in ckpt.names():
        assert np.array_equal(bits(ckpt.map(name)), bits(ckpt.read(name))), name
    data = (base / "model.safetensors").read_bytes()
    (base / "model.safetensors").write_bytes(data[:-100])  # cut after the checkpoint was opened
    with pytest.raises(SafetensorsError, match=r"unexpected end of file inside tensor 'model\.layers\.1\.q_proj"):
        ckpt.map("model.layers.1.q_proj.weight")


def test_numpy_path_still_merges_when_the_kernel_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the library is not built, the merge says so in its log and runs on numpy."""
    monkeypatch.setattr(merge_kernel, "LIBRARY", tmp_path / "missing.so")
    merge_kernel._library.cache_clear()
    try:
        assert merge_kernel.isa() == 0 and not merge_kernel.usable(np.dtype(BF16))
        base, adapter = write_model(tmp_path, BF16)
        lines: list[str] = []
        report = merge_checkpoint(base, adapter, tmp_path / "out", progress=lines.append)
        assert report.merged == 6 and f"run {merge_kernel.BUILD}" in lines[0]
    finally:
        monkeypatch.undo()
        merge_kernel._library.cache_clear()
    assert merge.merge_kernel.isa() >= 2
