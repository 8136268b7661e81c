"""The native merge kernel (``loraflow/lora/native/merge_rows.c``), loaded with ctypes.

One call merges a range of rows, ``out = W + scale · B @ A``, for BF16 and F32 weights, in one
pass per row where the numpy path in :mod:`loraflow.lora.merge` makes a dozen (AVX-512 or AVX2+FMA).
Each element of ``B @ A`` is its rank products summed in order with fused multiply-adds, on every
CPU and instruction set alike: the bits of :func:`loraflow.lora.merge_numerics.exact_merge` (the numpy
path agrees within that module's bound).

``loraflow/lora/native/build.sh`` builds it (``make envs`` does, and the trainer image); where it is not
built, or the CPU has neither instruction set, :mod:`loraflow.lora.merge` uses its numpy path and says
so in the log.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np

LIBRARY = Path(__file__).resolve().parent / "native" / "libloraflow_merge.so"
BUILD = "loraflow/lora/native/build.sh"
ISAS = {1: "scalar", 2: "AVX2+FMA", 3: "AVX-512"}
AUTO = 0
_NO_ISA = -3


@functools.cache
def _library() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(LIBRARY))
    except OSError:
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    for fn in (lib.loraflow_merge_rows_bf16, lib.loraflow_merge_rows_f32):
        fn.restype = i64
        fn.argtypes = [p, p, p, p, p, i64, i64, i64, ctypes.c_float, ctypes.c_int32,
                       ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_int32)]  # fmt: skip
    lib.loraflow_merge_isa.restype = ctypes.c_int32
    lib.loraflow_merge_tile.restype = ctypes.c_int32
    return lib


def isa() -> int:
    """The instruction set the kernel uses on this CPU (see :data:`ISAS`); 0 when it is not built."""
    lib = _library()
    return int(lib.loraflow_merge_isa()) if lib is not None else 0


def status() -> str:
    """One line for the log: which merge path runs, and how to get the fast one if it does not."""
    level = isa()
    if level >= 2:
        return f"native merge kernel ({ISAS[level]})"
    if level == 0:
        return f"numpy merge path: the native kernel is not built (run {BUILD}; it needs a C compiler)"
    return "numpy merge path: this CPU has neither AVX2+FMA nor AVX-512 for the native kernel"


def usable(dtype: np.dtype) -> bool:
    """Whether :func:`merge_rows` serves weights of this dtype here (fast path built and worth it)."""
    return dtype.name in ("bfloat16", "float32") and isa() >= 2


def pack(a: np.ndarray) -> np.ndarray:
    """A ``[r, m]`` float32 rearranged for the kernel, once per tensor: its whole tiles of columns as
    ``[m // tile, r, tile]``, so that each tile's ``r`` rows lie together."""
    lib = _library()
    if lib is None:
        raise RuntimeError(f"the native merge kernel is not built: run {BUILD}")
    tile = int(lib.loraflow_merge_tile())
    r, m = a.shape
    whole = m // tile * tile
    return np.ascontiguousarray(a[:, :whole].reshape(r, m // tile, tile).transpose(1, 0, 2), dtype=np.float32)


def merge_rows(
    weight: np.ndarray,
    out: np.ndarray,
    a: np.ndarray,
    a_tiles: np.ndarray,
    b: np.ndarray,
    scale: float,
    level: int = AUTO,
) -> tuple[float, bool, int | None]:
    """``out = weight + scale · b @ a``, for a block of rows.

    Args:
        weight: ``[n, m]`` BF16 or F32, C-contiguous.
        out: like ``weight`` (at least ``n`` rows; the first ``n`` are written).
        a: ``[r, m]`` float32, C-contiguous.
        a_tiles: ``pack(a)``.
        b: ``[n, r]`` float32, C-contiguous.
        scale: the LoRA scale (applied in float32).
        level: force an instruction set (tests); :data:`AUTO` picks the best.

    Returns:
        ``(max |scale · b @ a|, whether any stored value changed, the first row holding a
        non-finite merged value or None)``.

    Raises:
        RuntimeError: the kernel is not built, or the forced instruction set is missing.
        ValueError: arrays that do not fit together.
    """
    lib = _library()
    if lib is None:
        raise RuntimeError(f"the native merge kernel is not built: run {BUILD}")
    for name, arr in (("weight", weight), ("out", out), ("a", a), ("a_tiles", a_tiles), ("b", b)):
        if not arr.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous")
    if weight.dtype.name not in ("bfloat16", "float32"):
        raise ValueError(f"the kernel merges BF16 and F32 weights, not {weight.dtype}")
    n_rows, n_cols = weight.shape
    r, tile = a.shape[0], int(lib.loraflow_merge_tile())
    if out.dtype != weight.dtype or out.shape[0] < n_rows or out.shape[1:] != weight.shape[1:]:
        raise ValueError(f"out {out.dtype}{list(out.shape)} cannot hold weight {weight.dtype}{list(weight.shape)}")
    if a.dtype != np.float32 or b.dtype != np.float32 or a.shape[1] != n_cols or b.shape != (n_rows, r):
        raise ValueError(
            f"a {a.dtype}{list(a.shape)} / b {b.dtype}{list(b.shape)} do not fit weight {list(weight.shape)}"
        )
    if a_tiles.dtype != np.float32 or a_tiles.shape != (n_cols // tile, r, tile):
        raise ValueError(f"a_tiles {list(a_tiles.shape)} is not pack(a) for a {list(a.shape)}")
    fn = lib.loraflow_merge_rows_bf16 if weight.dtype.name == "bfloat16" else lib.loraflow_merge_rows_f32
    top, changed = ctypes.c_float(), ctypes.c_int32()
    rc = fn(weight.ctypes.data, out.ctypes.data, a.ctypes.data, a_tiles.ctypes.data, b.ctypes.data, n_rows, n_cols,
            r, scale, level, ctypes.byref(top), ctypes.byref(changed))  # fmt: skip
    if rc == _NO_ISA:
        raise RuntimeError(f"instruction set {ISAS.get(level, level)} is not available on this CPU")
    return float(top.value), bool(changed.value), (int(rc) if rc >= 0 else None)
