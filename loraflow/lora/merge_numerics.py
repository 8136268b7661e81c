"""The merge's numerics contract, as code: what ``W + scale · B @ A`` must give, bit for bit or within a bound.

A merged value is computed in four steps; only the first is free in how it orders its work::

    d   = sum_k B[i, k] · A[k, j]         float32, the r products summed in *some* order
    u   = fl32(d · scale)                  float32 multiply, rounded once
    s   = fl32(W[i, j] + u)                float32 add (a BF16 weight is widened exactly first)
    out = round(s → weight dtype)          to nearest, ties to even (BF16); F32 keeps s

The contract (docs/architecture.md, "The merge's numerics"):

* **The native kernel** computes ``d`` as a chain of float32 fused multiply-adds in rank order,
  ``d = fma(B[i,r-1], A[r-1,j], ... fma(B[i,0], A[0,j], 0))``, on every CPU and every instruction
  set it dispatches to (scalar, AVX2+FMA, AVX-512). Its output equals :func:`exact_merge` bit for
  bit, on any machine.
* **Any other correct merge** (loraflow's numpy path, PEFT's ``merge_and_unload``, a naive torch
  ``W + scale * B @ A``) sums the same r float32 products in an order its BLAS chooses, which
  differs between libraries, CPUs (OpenBLAS picks a different GEMM kernel on AVX-512 Intel, on
  AVX2 AMD, ...) and matrix shapes. Whatever the order, with or without FMA, the float32 dot product
  of r terms is within ``gamma_r · Σ_k |B[i,k] · A[k,j]|`` of the exact sum, ``gamma_r = r·u / (1 - r·u)``,
  ``u = 2^-24`` (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., §3.1). The
  remaining steps are the same monotone roundings for everyone, so the output lies between the
  outputs of the two extreme ``d``: :func:`merge_bounds` gives that interval, per element. Two
  such merges may differ by a unit in the last place or more, and that is correct.

The functions here are pure numpy (float64 where exactness is needed) and run in every environment;
BF16 weights need ``ml_dtypes`` (which any code holding a BF16 array already has).
"""

from __future__ import annotations

import numpy as np

U32 = 2.0**-24  # unit roundoff of float32 (round to nearest)
U64 = 2.0**-53  # unit roundoff of float64


def gamma(n: int, u: float) -> float:
    """Higham's ``gamma_n = n·u / (1 - n·u)``: the relative error bound of an n-term dot product."""
    return n * u / (1.0 - n * u)


def fma32(x: np.ndarray, y: np.ndarray, z: np.ndarray) -> np.ndarray:
    """``x · y + z`` in float32, rounded once (an exact fused multiply-add), element-wise.

    The product of two float32 values is exact in float64; the sum with ``z`` is float64 rounded,
    and its exact error ``e`` follows from TwoSum. Rounding that float64 sum to float32 is exact
    except when it lies exactly halfway between two float32 values and ``e`` is not zero: then the
    true value lies on ``e``'s side of the halfway point, and that neighbour is taken.
    """
    z64 = np.asarray(z, np.float64)
    p = np.asarray(x, np.float64) * np.asarray(y, np.float64)
    s = p + z64
    bv = s - p
    e = (p - (s - bv)) + (z64 - bv)
    r = s.astype(np.float32)
    r64 = r.astype(np.float64)
    toward_s = np.nextafter(r, np.where(s > r64, np.float32(np.inf), np.float32(-np.inf)).astype(np.float32))
    halfway = (s == (r64 + toward_s.astype(np.float64)) / 2) & (e != 0)
    if not halfway.any():
        return r
    above = np.maximum(r, toward_s)
    below = np.minimum(r, toward_s)
    return np.where(halfway, np.where(e > 0, above, below), r).astype(np.float32)


def fma_chain(b: np.ndarray, a: np.ndarray) -> np.ndarray:
    """``B @ A`` as the native kernel computes it: per element, float32 FMAs over k in rank order from 0.

    Args:
        b: ``[n, r]`` float32.
        a: ``[r, m]`` float32.

    Returns:
        ``[n, m]`` float32.
    """
    b32, a32 = np.asarray(b, np.float32), np.asarray(a, np.float32)
    acc = np.zeros((b32.shape[0], a32.shape[1]), np.float32)
    for k in range(b32.shape[1]):
        acc = fma32(b32[:, k : k + 1], a32[k : k + 1, :], acc)
    return acc


def finish(weight: np.ndarray, d: np.ndarray, scale: float) -> np.ndarray:
    """The steps after ``d``: ``round(fl32(W + fl32(d · scale)))`` to the weight's dtype (BF16 or F32)."""
    u = np.asarray(d, np.float32) * np.float32(scale)
    s = weight.astype(np.float32) + u
    return s.astype(weight.dtype)  # float32 -> bfloat16: ml_dtypes rounds to nearest, ties to even


def exact_merge(weight: np.ndarray, a: np.ndarray, b: np.ndarray, scale: float) -> np.ndarray:
    """What the native kernel must write, bit for bit: ``W + scale · B @ A`` with ``B @ A`` an FMA chain.

    Args:
        weight: ``[n, m]`` BF16 or F32 (already oriented: a ``fan_in_fan_out`` weight is merged with
            ``a, b = Bᵀ, Aᵀ``, as :mod:`loraflow.lora.merge` does).
        a: ``[r, m]`` float32.
        b: ``[n, r]`` float32.
        scale: the LoRA scale.
    """
    return finish(weight, fma_chain(b, a), scale)


def dot_error_bound(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(Σ_k B·A in float64, bound)``: every float32 summation order of ``(B @ A)[i, j]`` lies within
    ``bound[i, j]`` of the float64 value (the float32 dot product's ``gamma_r`` bound, plus what the float64
    reference itself may be off by)."""
    r = a.shape[0]
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    magnitude = np.abs(b64) @ np.abs(a64)
    slack = 1.0 + gamma(r + 1, U64)  # the float64 magnitude sum and reference are rounded too
    return b64 @ a64, (gamma(r, U32) + gamma(r, U64)) * magnitude * slack


def _toward(x64: np.ndarray, up: bool) -> np.ndarray:
    """The float32 nearest to ``x64`` on the inside of a bound: at least it (up) or at most it."""
    x32 = x64.astype(np.float32)
    back = x32.astype(np.float64)
    if up:
        return np.where(back < x64, np.nextafter(x32, np.float32(np.inf)), x32).astype(np.float32)
    return np.where(back > x64, np.nextafter(x32, np.float32(-np.inf)), x32).astype(np.float32)


def merge_bounds(weight: np.ndarray, a: np.ndarray, b: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Per element, the least and greatest output any summation order of ``B @ A`` can give.

    Same arguments as :func:`exact_merge`. Both arrays have the weight's dtype; a correct merge's
    output ``x`` satisfies ``lo <= x <= hi`` element-wise (compare as float32).
    """
    exact, bound = dot_error_bound(a, b)
    lo = finish(weight, _toward(exact - bound, up=True), scale)
    hi = finish(weight, _toward(exact + bound, up=False), scale)
    return (lo, hi) if scale >= 0 else (hi, lo)


def ulp_distance(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """How many representable values lie between x and y (same float dtype, finite): 0 means same bits."""

    def ordered(v: np.ndarray) -> np.ndarray:
        bits = v.view(np.uint16 if v.dtype.itemsize == 2 else np.uint32).astype(np.int64)
        sign = np.int64(1) << (8 * v.dtype.itemsize - 1)
        return np.where(bits & sign, sign - bits, bits)  # a monotone integer line through -0 = +0

    return np.abs(ordered(np.ascontiguousarray(x)) - ordered(np.ascontiguousarray(y)))


def agreement(x: np.ndarray, y: np.ndarray) -> dict[str, int]:
    """``{"elements", "differing", "max_ulp"}`` of two same-shaped arrays of one float dtype."""
    dist = ulp_distance(x, y)
    return {"elements": int(dist.size), "differing": int((dist > 0).sum()), "max_ulp": int(dist.max(initial=0))}


def within(x: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Element-wise ``lo <= x <= hi``, compared as float32 values."""
    v = x.astype(np.float32)
    return (lo.astype(np.float32) <= v) & (v <= hi.astype(np.float32))
