"""The merge's numerics contract (:mod:`loraflow.lora.merge_numerics`), tested exactly where it holds.

* The native kernel, on every instruction set it can dispatch to (each tested where the CPU has
  it, skipped with the reason where it does not), writes the bits of the exact reference: ``B @ A``
  as float32 fused multiply-adds in rank order, then the shared float32 steps. Bit for bit, on
  every element, on any CPU.
* The numpy path sums the rank products in whatever order the BLAS it runs on chooses (OpenBLAS
  picks a different GEMM kernel per CPU). It is held to the derived bound instead: within the
  float32 dot product's ``gamma_r`` reordering bound plus the same roundings, checked per element;
  and under every OpenBLAS kernel this CPU can run, not just the one it picks here.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import re
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from loraflow.lora import merge, merge_kernel
from loraflow.lora import merge_numerics as contract
from loraflow.lora.merge import MergeError, merge_checkpoint, merge_lora
from loraflow.lora.safetensors_io import Checkpoint, SafetensorsError

BF16 = ml_dtypes.bfloat16
HERE = Path(__file__).resolve()


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux reports them (empty where /proc/cpuinfo says none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


FLAGS = cpu_flags()
X86 = platform.machine() in ("x86_64", "AMD64")
# What the kernel must pick here, from the CPU's own flags (its dispatch reads cpuid).
EXPECTED_ISA = 1 if not X86 else 3 if {"avx512f", "avx512bw"} <= FLAGS else 2 if {"avx2", "fma"} <= FLAGS else 1
ALL_LEVELS = sorted(merge_kernel.ISAS)
LEVEL_IDS = [merge_kernel.ISAS[lv] for lv in ALL_LEVELS]


def need_level(level: int) -> None:
    """Skip, saying why, where this CPU cannot run an instruction set (the kernel refuses it there)."""
    if level > merge_kernel.isa():
        pytest.skip(f"this CPU has no {merge_kernel.ISAS[level]} (the kernel runs {merge_kernel.status()} here)")


def without_kernel(w: np.ndarray, a: np.ndarray, b: np.ndarray, scale: float) -> np.ndarray:
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


def assert_same_bits(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.array_equal(bits(got), bits(want)), f"not the exact reference: {contract.agreement(got, want)}"


def assert_within_contract(got: np.ndarray, w: np.ndarray, a: np.ndarray, b: np.ndarray, scale: float) -> None:
    lo, hi = contract.merge_bounds(w, a, b, scale)
    inside = contract.within(got, lo, hi)
    assert inside.all(), (
        f"{int((~inside).sum())} of {inside.size} element(s) outside the reordering bound; "
        f"vs the exact reference: {contract.agreement(got, contract.exact_merge(w, a, b, scale))}"
    )


def test_the_kernel_is_built_and_picks_what_the_cpu_offers() -> None:
    """make envs builds it; it dispatches to the best instruction set in this CPU's flags."""
    assert merge_kernel.LIBRARY.is_file(), f"the native merge kernel is not built: run {merge_kernel.BUILD}"
    assert merge_kernel.isa() == EXPECTED_ISA, (merge_kernel.status(), sorted(f for f in FLAGS if "avx" in f))
    fast = EXPECTED_ISA >= 2
    assert merge_kernel.usable(np.dtype(BF16)) == fast and merge_kernel.usable(np.dtype(np.float32)) == fast
    assert not merge_kernel.usable(np.dtype(np.float16)) and not merge_kernel.usable(np.dtype(np.float64))
    assert ("native merge kernel" in merge_kernel.status()) == fast


def exact_fma(x: float, y: float, z: float) -> np.float32:
    """x·y + z rounded once to float32, to nearest, ties to even: by rational arithmetic."""
    exact = Fraction(x) * Fraction(y) + Fraction(z)
    near = np.float32(float(exact))  # within an ulp: pick the nearest of it and its neighbours
    cands = [np.nextafter(near, np.float32(-np.inf)), near, np.nextafter(near, np.float32(np.inf))]
    return min(cands, key=lambda c: (abs(Fraction(float(c)) - exact), int(c.view(np.uint32)) & 1))


# x·y + z whose float64 sum falls exactly halfway between two float32 values while the exact value
# does not: rounding the float64 sum (or a non-fused multiply-add) takes the wrong neighbour.
HALFWAY = [
    (2.0**-24 * (1 - 2.0**-23), 1 + 2.0**-23, 1 + 2.0**-23),
    (-(2.0**-24) * (1 - 2.0**-23), 1 + 2.0**-23, -(1 + 2.0**-23)),
]


def test_the_reference_fma_is_exact() -> None:
    """contract.fma32 against rational arithmetic: random triples and the double-rounding traps."""
    rng = np.random.default_rng(11)
    x, y, z = (rng.standard_normal(3000) * 10.0 ** rng.integers(-6, 3, 3000)).astype(np.float32).reshape(3, 1000)
    cases = [*zip(x.tolist(), y.tolist(), z.tolist(), strict=True), *HALFWAY]
    got = contract.fma32(*(np.array(col, np.float32) for col in zip(*cases, strict=True)))
    want = np.array([exact_fma(*c) for c in cases], np.float32)
    assert_same_bits(got, want)
    naive = np.float32(np.float64(HALFWAY[0][0]) * HALFWAY[0][1] + HALFWAY[0][2])
    assert naive != want[-2], "the trap must catch a float64-then-round fma"


@pytest.mark.parametrize("level", ALL_LEVELS, ids=LEVEL_IDS)
def test_the_kernel_fuses_its_multiply_adds(level: int) -> None:
    """B @ A on the trap values: a kernel that rounded the product, or the float64 sum, would differ."""
    need_level(level)
    for x, y, z in HALFWAY:
        w = np.zeros((2, 130), np.float32)  # a whole tile and a scalar tail
        a = np.array([[1.0] * 130, [y] * 130], np.float32)
        b = np.array([[z, x], [z, x]], np.float32)
        got = kernel(w, a, b, 1.0, level)[0]
        assert (got == exact_fma(x, y, z)).all(), level


CASES = [(64, 256, 16), (37, 300, 8), (5, 77, 1), (1, 128, 3), (130, 1024, 64)]
CASE_IDS = ["tiles", "odd-rows+tail", "tail-only", "one-row", "rank64"]


def case(rows: int, cols: int, r: int, dtype: type) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(rows * cols + r)
    w = (rng.standard_normal((rows, cols)) * 0.02).astype(dtype)
    w[0, :3] = [0.0, -0.0, 1e-40]  # signed zero and a subnormal
    a = (rng.standard_normal((r, cols)) * 0.01).astype(np.float32)
    b = (rng.standard_normal((rows, r)) * 0.01).astype(np.float32)
    return w, a, b


@pytest.mark.parametrize("level", ALL_LEVELS, ids=LEVEL_IDS)
@pytest.mark.parametrize("dtype", [BF16, np.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("rows,cols,r", CASES, ids=CASE_IDS)
def test_every_instruction_set_writes_the_exact_reference(
    level: int, dtype: type, rows: int, cols: int, r: int
) -> None:
    need_level(level)
    w, a, b = case(rows, cols, r, dtype)
    got, top, changed, bad = kernel(w, a, b, 2.0, level)
    assert bad is None and changed
    assert_same_bits(got, contract.exact_merge(w, a, b, 2.0))
    assert top == float(np.abs(contract.fma_chain(b, a) * np.float32(2.0)).max())


@pytest.mark.parametrize("rows,cols,r", CASES, ids=CASE_IDS)
def test_the_numpy_dot_products_are_within_the_reordering_bound(rows: int, cols: int, r: int) -> None:
    """On a zero F32 weight with scale 1 the numpy path returns its B @ A itself: each element is
    within gamma_r · Σ|B·A| of the exact sum, whatever order this machine's BLAS summed in."""
    _, a, b = case(rows, cols, r, np.float32)
    d = without_kernel(np.zeros((rows, cols), np.float32), a, b, 1.0)
    exact, bound = contract.dot_error_bound(a, b)
    err = np.abs(d.astype(np.float64) - exact)
    assert (err <= bound).all(), f"max error {float((err / bound).max()):.2f} x the bound"


@pytest.mark.parametrize("dtype", [BF16, np.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("rows,cols,r", CASES, ids=CASE_IDS)
def test_the_numpy_path_is_within_the_contract(dtype: type, rows: int, cols: int, r: int) -> None:
    w, a, b = case(rows, cols, r, dtype)
    assert_within_contract(without_kernel(w, a, b, 2.0), w, a, b, 2.0)


def test_the_bound_refuses_a_merge_done_in_the_weights_precision() -> None:
    """Not vacuous: the update rounded to BF16 before the add (a plausible bug) falls outside it."""
    w, a, b = case(64, 256, 16, BF16)
    update = (contract.fma_chain(b, a) * np.float32(2.0)).astype(BF16)
    wrong = (w.astype(np.float32) + update.astype(np.float32)).astype(BF16)
    lo, hi = contract.merge_bounds(w, a, b, 2.0)
    assert (~contract.within(wrong, lo, hi)).sum() > 100


BLAS_KERNELS = {  # OpenBLAS core types with distinct SGEMM kernels, and the CPU flags each needs
    "SkylakeX": {"avx512f", "avx512bw", "avx512dq", "avx512vl"},
    "Haswell": {"avx2", "fma"},
    "Sandybridge": {"avx"},
    "Nehalem": {"sse4_2"},
}


def openblas_core() -> str | None:
    """The kernel family numpy's OpenBLAS runs here, or None where numpy uses another BLAS."""
    libs = Path(np.__file__).parent.parent / "numpy.libs"
    for lib in sorted(libs.glob("libscipy_openblas*.so")):
        dll = ctypes.CDLL(str(lib))
        for name in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename", "openblas_get_corename"):
            if hasattr(dll, name):
                fn = getattr(dll, name)
                fn.restype = ctypes.c_char_p
                return fn().decode()
    return None


@pytest.mark.parametrize("core", sorted(BLAS_KERNELS))
def test_the_numpy_path_keeps_the_contract_on_every_blas_kernel_this_cpu_runs(core: str) -> None:
    """The same checks in a child whose OpenBLAS is told to use another kernel family (OPENBLAS_CORETYPE):
    what an Intel AVX-512 machine and an AMD AVX2 one each pick, on one machine."""
    if not X86 or not BLAS_KERNELS[core] <= FLAGS:
        pytest.skip(f"this CPU cannot run OpenBLAS's {core} kernels (needs {sorted(BLAS_KERNELS[core])})")
    if openblas_core() is None:
        pytest.skip("numpy here does not run on scipy-openblas: OPENBLAS_CORETYPE does not apply")
    env = {**os.environ, "OPENBLAS_CORETYPE": core}
    probe = f"import sys; sys.path.insert(0, {str(HERE.parent)!r}); import {HERE.stem} as t; print(t.openblas_core())"
    got = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert got.stdout.strip() == core, got.stdout + got.stderr
    checks = "numpy_dot_products_are_within or numpy_path_is_within_the_contract"
    run = subprocess.run([sys.executable, "-m", "pytest", str(HERE), "-q", "-p", "no:cacheprovider", "-k", checks],
                         env=env, capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert re.search(r"^15 passed", run.stdout, re.M), run.stdout[-500:]


@pytest.mark.parametrize("level", ALL_LEVELS, ids=LEVEL_IDS)
def test_bf16_rounding_ties_go_to_even(level: int) -> None:
    """1 + 2^-8 lies halfway between two bf16 values: it rounds to the even one, 1.0; 1 + 3*2^-8 up."""
    need_level(level)
    w = np.ones((2, 130), BF16)  # 130 columns: a whole tile and a scalar tail
    a = np.ones((1, 130), np.float32)
    b = np.array([[2.0**-8], [3 * 2.0**-8]], np.float32)
    got = kernel(w, a, b, 1.0, level)[0].astype(np.float32)
    assert (got[0] == 1.0).all() and (got[1] == 1.0 + 2.0**-6).all()
    assert np.array_equal(bits(got.astype(BF16)), bits(without_kernel(w, a, b, 1.0)))


@pytest.mark.parametrize("level", ALL_LEVELS, ids=LEVEL_IDS)
@pytest.mark.parametrize("row,col", [(4, 10), (5, 200), (6, 259)], ids=["even-row", "odd-row", "tail-column"])
def test_kernel_reports_the_first_non_finite_row(level: int, row: int, col: int) -> None:
    need_level(level)
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


@pytest.mark.parametrize("level", ALL_LEVELS, ids=LEVEL_IDS)
def test_a_zero_update_changes_nothing(level: int) -> None:
    need_level(level)
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


SHAPES = {"q_proj": (256, 384), "down_proj": (384, 300), "k_proj": (33, 384)}
RANK, ALPHA = 8, 16.0


def write_model(root: Path, dtype: type, fan_in_fan_out: bool = False) -> tuple[Path, Path]:
    """A two-layer bf16/f32 checkpoint with tile-sized and odd projections, a rank-8 adapter."""
    rng = np.random.default_rng(7)
    base, adapter = root / "base", root / "adapter"
    base.mkdir(parents=True)
    (adapter / "peft").mkdir(parents=True)
    tensors, lora = {"model.embed_tokens.weight": rng.standard_normal((500, 384)).astype(dtype)}, {}
    for i in range(2):
        for mod, (out_dim, in_dim) in SHAPES.items():
            name = f"model.layers.{i}.{mod}"
            stored = (in_dim, out_dim) if fan_in_fan_out else (out_dim, in_dim)
            tensors[f"{name}.weight"] = (rng.standard_normal(stored) * 0.02).astype(dtype)
            lora[f"base_model.model.{name}.lora_A.weight"] = (rng.standard_normal((RANK, in_dim)) * 0.1).astype(
                np.float32
            )
            lora[f"base_model.model.{name}.lora_B.weight"] = (rng.standard_normal((out_dim, RANK)) * 0.1).astype(
                np.float32
            )
    save_file(tensors, str(base / "model.safetensors"), metadata={"format": "pt"})
    (base / "config.json").write_text("{}")
    save_file(lora, str(adapter / "peft" / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "target_modules": list(SHAPES)}
    (adapter / "peft" / "adapter_config.json").write_text(json.dumps({**config, "fan_in_fan_out": fan_in_fan_out}))
    return base, adapter


def merged_tensors(out: Path) -> dict[str, np.ndarray]:
    return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


@pytest.mark.parametrize("dtype", [BF16, np.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("fan_in_fan_out", [False, True], ids=["out-in", "fan-in-fan-out"])
def test_a_merged_checkpoint_keeps_the_contract_on_the_kernel_and_on_numpy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: type, fan_in_fan_out: bool
) -> None:
    """Kernel: every merged tensor is the exact reference. numpy: within the bound. Both: the same
    files, index and untouched tensors, byte for byte."""
    base, adapter = write_model(tmp_path, dtype, fan_in_fan_out)
    lines: list[str] = []
    fast = merge_checkpoint(base, adapter, tmp_path / "fast", shard_bytes=200_000, progress=lines.append)
    assert ("native merge kernel" in lines[0]) == (EXPECTED_ISA >= 2)
    monkeypatch.setattr(merge_kernel, "usable", lambda dtype: False)
    slow = merge_checkpoint(base, adapter, tmp_path / "slow", shard_bytes=200_000)
    assert fast.files == slow.files and len(fast.files) > 1
    assert (fast.tensors, fast.merged, fast.changed, fast.bytes) == (
        slow.tensors,
        slow.merged,
        slow.changed,
        slow.bytes,
    )
    assert fast.max_delta == pytest.approx(slow.max_delta, rel=1e-5)  # max |scale · B @ A|, summed two ways
    index = "model.safetensors.index.json"
    assert (tmp_path / "fast" / index).read_bytes() == (tmp_path / "slow" / index).read_bytes()

    weights, lora = (
        load_file(str(base / "model.safetensors")),
        load_file(str(adapter / "peft/adapter_model.safetensors")),
    )
    on_kernel, on_numpy = merged_tensors(tmp_path / "fast"), merged_tensors(tmp_path / "slow")
    assert set(on_kernel) == set(on_numpy) == set(weights)
    scale = ALPHA / RANK
    for name, w in weights.items():
        key = "base_model.model." + name.removesuffix(".weight")
        if f"{key}.lora_A.weight" not in lora:
            assert bits(on_kernel[name]).tobytes() == bits(on_numpy[name]).tobytes() == bits(w).tobytes(), name
            continue
        a, b = lora[f"{key}.lora_A.weight"], lora[f"{key}.lora_B.weight"]
        if fan_in_fan_out:  # W[in, out] += scale · Aᵀ Bᵀ: the same merge with the roles swapped
            a, b = b.T.copy(), a.T.copy()
        if EXPECTED_ISA >= 2:
            assert_same_bits(on_kernel[name], contract.exact_merge(w, a, b, scale))
        assert_within_contract(on_numpy[name], w, a, b, scale)


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
    assert merge.merge_kernel.isa() == EXPECTED_ISA
