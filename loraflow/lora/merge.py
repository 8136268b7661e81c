"""Fold a LoRA adapter (PEFT format) into Hugging Face base weights, one tensor at a time.

PEFT layout (what ``adapter_model.safetensors`` holds), for a base ``Linear`` whose weight is
``W[out, in]`` and which computes ``y = x Wᵀ``::

    base_model.model.<module>.lora_A.weight   A[r, in]
    base_model.model.<module>.lora_B.weight   B[out, r]
    y = x Wᵀ + scale · x Aᵀ Bᵀ      so      W_merged = W + scale · B @ A

with ``scale = lora_alpha / r`` (``lora_alpha / sqrt(r)`` when ``use_rslora``), from
``adapter_config.json``; ``rank_pattern`` / ``alpha_pattern`` override r / alpha per module and
``fan_in_fan_out`` means W is stored ``[in, out]`` (GPT-2 Conv1D). The base tensor is
``<module>.weight``, where the base's model family stores it (``ModelFamily.stored_name``).
DoRA, LoRA biases, embedding LoRA and ``modules_to_save`` are refused.

The pure pieces (:func:`lora_scale`, :func:`merge_lora`, :func:`peft_module`, :func:`plan_merge`)
are separate from the streaming driver :func:`merge_checkpoint`, which holds at most a few tensors
in memory (the one being merged and the next one, both mapped from the file rather than copied;
merged rows go to the output file a block at a time; tensors without an update are copied file to
file). The arithmetic runs on the native kernel (:mod:`loraflow.lora.merge_kernel`) where it is built,
else on numpy: the same float32 steps, but numpy's BLAS sums each element's rank products in an
order of its own (which depends on the CPU), so the two agree within the bound of
:mod:`loraflow.lora.merge_numerics` (the merge's numerics contract), not always to the bit.
Everything that can be checked before writing is checked first, and all
problems are reported together, each with its fix.
"""

from __future__ import annotations

import functools
import json
import math
import re
import shutil
import sys
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from loraflow.errors import LoraflowError
from loraflow.lora import merge_kernel
from loraflow.lora.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX
from loraflow.lora.safetensors_io import INDEX_FILE, Checkpoint, ShardedWriter, TensorInfo, pwrite_all
from loraflow.storage import faults

FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}
# Weight formats other than safetensors are never copied into a merged checkpoint: they would hold
# the *unmerged* base weights next to the merged ones.
WEIGHT_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf"}
BLOCK_ELEMS = 1 << 16  # merge this many elements at a time (1 MiB of float32 scratch per buffer and thread)
KERNEL_BLOCKS = 4  # the native kernel merges blocks this many times larger (1 MiB of BF16 per thread)

_PEFT_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>A|B)(?:\.(?P<adapter>[^.]+))?\.weight$")
_LAYER = re.compile(r"^(?P<group>.*?\.(?:layers|h|blocks)\.\d+)\.")


class MergeError(LoraflowError):
    """The adapter cannot be merged into this base checkpoint (each message names the key and the fix)."""


@dataclass(frozen=True)
class LoraConfig:
    """The parts of a PEFT ``adapter_config.json`` the merge needs."""

    r: int
    lora_alpha: float
    target_modules: list[str] | str | None = None
    use_rslora: bool = False
    fan_in_fan_out: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)

    def rank_alpha(self, module: str) -> tuple[int, float]:
        """``(r, alpha)`` for one module, after ``rank_pattern`` / ``alpha_pattern`` (PEFT's matching)."""
        r = self.rank_pattern[k] if (k := _pattern_key(self.rank_pattern, module)) else self.r
        alpha = self.alpha_pattern[k] if (k := _pattern_key(self.alpha_pattern, module)) else self.lora_alpha
        return int(r), float(alpha)

    def targets(self, module: str) -> bool:
        """Whether ``target_modules`` names this module (as PEFT matches them)."""
        t = self.target_modules
        if t is None or t == "all-linear":
            return True
        if isinstance(t, str):
            return re.fullmatch(t, module) is not None
        return any(module == m or module.endswith("." + m) for m in t)


def _pattern_key(patterns: Mapping[str, Any], module: str) -> str | None:
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return None


def load_adapter_config(path: str | Path) -> LoraConfig:
    """Read and check a PEFT ``adapter_config.json``.

    Args:
        path: the JSON file.

    Returns:
        The :class:`LoraConfig`.

    Raises:
        MergeError: not a plain LoRA adapter (DoRA, another PEFT type, LoRA bias), or r / lora_alpha
            missing or not positive.
    """
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise MergeError(f"{path}: cannot read the adapter config ({exc})") from None
    problems = []
    if raw.get("peft_type", "LORA").upper() != "LORA":
        problems.append(f"peft_type is {raw['peft_type']!r}: only LORA adapters can be merged")
    if raw.get("use_dora"):
        problems.append("use_dora is true: DoRA adapters are not supported; train with use_dora: false")
    if raw.get("bias", "none") != "none":
        problems.append(f"bias is {raw['bias']!r}: LoRA biases are not supported; train with bias: none")
    r, alpha = raw.get("r"), raw.get("lora_alpha")
    if not isinstance(r, int) or r <= 0:
        problems.append(f"r is {r!r}: set it to the LoRA rank the adapter was trained with")
    if not isinstance(alpha, (int, float)) or alpha <= 0:
        problems.append(f"lora_alpha is {alpha!r}: set it to the alpha the adapter was trained with")
    if problems:
        raise MergeError(f"{path}: " + "; ".join(problems))
    return LoraConfig(
        r=r,
        lora_alpha=float(alpha),
        target_modules=raw.get("target_modules"),
        use_rslora=bool(raw.get("use_rslora", False)),
        fan_in_fan_out=bool(raw.get("fan_in_fan_out", False)),
        rank_pattern=dict(raw.get("rank_pattern") or {}),
        alpha_pattern=dict(raw.get("alpha_pattern") or {}),
    )


def lora_scale(r: int, alpha: float, use_rslora: bool = False) -> float:
    """The factor the LoRA product is multiplied by.

    Args:
        r: LoRA rank.
        alpha: ``lora_alpha``.
        use_rslora: rank-stabilised LoRA (scale alpha / sqrt(r) instead of alpha / r).

    Returns:
        ``alpha / r``, or ``alpha / sqrt(r)`` with ``use_rslora``.
    """
    return alpha / math.sqrt(r) if use_rslora else alpha / r


def merge_lora(
    weight: np.ndarray,
    lora_a: np.ndarray,
    lora_b: np.ndarray,
    scale: float,
    fan_in_fan_out: bool = False,
    block_elems: int = BLOCK_ELEMS,
) -> np.ndarray:
    """Fold one LoRA pair into its base weight: ``W + scale · B @ A``.

    Computed in float32 (float64 for float64 weights), a block of rows at a time, and rounded once
    to the weight's dtype: scratch memory stays a few ``block_elems`` per thread whatever the tensor size.

    Args:
        weight: base weight ``[out, in]`` (``[in, out]`` with ``fan_in_fan_out``); any float dtype
            numpy or ml_dtypes knows (F16, BF16, F32, F64).
        lora_a: ``lora_A`` ``[r, in]``.
        lora_b: ``lora_B`` ``[out, r]``.
        scale: see :func:`lora_scale`.
        fan_in_fan_out: the weight is stored transposed, ``[in, out]``.
        block_elems: elements merged per block.

    Returns:
        A new array with the weight's dtype and shape; ``weight`` is not modified.

    Raises:
        MergeError: shapes that do not compose, or a merged value that overflows the weight's dtype.
    """
    if weight.ndim != 2 or lora_a.ndim != 2 or lora_b.ndim != 2:
        raise MergeError(f"merge needs 2-D tensors, got weight {weight.shape}, A {lora_a.shape}, B {lora_b.shape}")
    (r_a, n_in), (n_out, r_b) = lora_a.shape, lora_b.shape
    expected = (n_in, n_out) if fan_in_fan_out else (n_out, n_in)
    if r_a != r_b or weight.shape != expected:
        raise MergeError(
            f"shapes do not compose: weight {list(weight.shape)}, lora_A {list(lora_a.shape)}, lora_B {list(lora_b.shape)} "
            f"(need A [r, in], B [out, r], weight {'[in, out]' if fan_in_fan_out else '[out, in]'} = {list(expected)})"
        )
    out = np.empty_like(weight)

    def keep(lo: int, block: np.ndarray) -> None:
        out[lo : lo + len(block)] = block

    _merge_blocks(weight, lora_a, lora_b, scale, fan_in_fan_out, keep, block_elems)
    return out


Emit = Callable[[int, np.ndarray], None]
"""Receives merged rows: ``emit(first_row, block)``; called from several threads, on disjoint rows."""


def _merge_blocks(
    weight: np.ndarray,
    lora_a: np.ndarray,
    lora_b: np.ndarray,
    scale: float,
    fan_in_fan_out: bool,
    emit: Emit,
    block_elems: int = BLOCK_ELEMS,
) -> tuple[float, bool]:
    """:func:`merge_lora` (shapes already checked) handing each block of merged rows to ``emit``.

    The rows are split between :data:`MERGE_THREADS` threads, each working through blocks of about
    ``block_elems`` elements in scratch buffers of its own, reused from block to block: on the
    native kernel (:mod:`loraflow.lora.merge_kernel`, one pass per row) where it serves the dtype, else
    on numpy (see :mod:`loraflow.lora.merge_numerics` for how their bits compare). Block sizes and threads
    do not change a bit of the kernel's result.

    Returns:
        max |scale · B @ A| and whether any stored value changed.
    """
    compute = np.float64 if weight.dtype == np.float64 else np.float32
    a: np.ndarray[Any, np.dtype[np.floating[Any]]] = lora_a.astype(compute)
    b: np.ndarray[Any, np.dtype[np.floating[Any]]] = lora_b.astype(compute)
    if fan_in_fan_out:  # W[in, out] += scale · (B @ A)ᵀ = scale · Aᵀ @ Bᵀ
        a, b = b.T, a.T
    merge_rows: Callable[..., tuple[float, bool]] = _merge_rows
    if merge_kernel.usable(weight.dtype):
        weight, a, b = np.ascontiguousarray(weight), np.ascontiguousarray(a), np.ascontiguousarray(b)
        merge_rows = functools.partial(_kernel_rows, a_tiles=merge_kernel.pack(a))
        block_elems *= KERNEL_BLOCKS  # one pass instead of a dozen: larger blocks stay in cache
    n_rows = weight.shape[0]
    rows = max(1, block_elems // max(1, weight.shape[1]))
    parts = min(MERGE_THREADS, -(-n_rows // rows))
    if parts <= 1:
        return merge_rows(weight, a, b, scale, 0, n_rows, rows, emit)
    step = -(-n_rows // parts)
    futures = [
        _pool().submit(merge_rows, weight, a, b, scale, lo, min(lo + step, n_rows), rows, emit)
        for lo in range(0, n_rows, step)
    ]
    results = [f.result() for f in futures]  # the first error, if any, is raised here
    return max(r[0] for r in results), any(r[1] for r in results)


MERGE_THREADS = 2
_UPPER_HALF = 1 if sys.byteorder == "little" else 0  # where a uint32's upper 16 bits lie
SMALL_GEMM = 1 << 18
_POOL: list[ThreadPoolExecutor] = []


def _pool() -> ThreadPoolExecutor:
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(MERGE_THREADS, thread_name_prefix="loraflow-merge"))
    return _POOL[0]


def _kernel_rows(
    weight: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
    scale: float,
    start: int,
    stop: int,
    rows: int,
    emit: Emit,
    *,
    a_tiles: np.ndarray,
) -> tuple[float, bool]:
    """:func:`_merge_rows` on the native kernel: one pass per row."""
    block = np.empty((min(rows, stop - start), weight.shape[1]), weight.dtype)
    max_update, changed = 0.0, False
    for lo in range(start, stop, rows):
        hi = min(lo + rows, stop)
        top, diff, bad = merge_kernel.merge_rows(weight[lo:hi], block, a, a_tiles, b[lo:hi], scale)
        if bad is not None:
            raise MergeError(f"non-finite merged values in row {lo + bad}: the base weight holds NaN/Inf")
        emit(lo, block[: hi - lo])
        max_update, changed = max(max_update, top), changed or diff
    return max_update, changed


def _merge_rows(
    weight: np.ndarray, a: np.ndarray, b: np.ndarray, scale: float, start: int, stop: int, rows: int, emit: Emit
) -> tuple[float, bool]:
    """Merge rows ``start:stop`` of ``weight``, ``rows`` at a time, into ``emit``; (max |update|, changed).

    The numpy path: within :func:`loraflow.lora.merge_numerics.merge_bounds` of the exact reference."""
    n_cols = weight.shape[1]
    k = min(rows, stop - start)
    block = np.empty((k, n_cols), a.dtype)
    merged = np.empty((k, n_cols), weight.dtype)
    # bf16 <-> f32 by bit operations (exact, and far faster than an element-wise cast) need two scratch buffers.
    bf16 = [np.empty((k, n_cols), np.uint32) for _ in range(2)] if weight.dtype.name == "bfloat16" else None
    bits = np.dtype(f"u{weight.dtype.itemsize}")
    # OpenBLAS runs a GEMM of at most SMALL_GEMM multiply-adds on the calling thread: the product is
    # computed in pieces that small, which never start (or wait for) its own thread pool; at rank
    # 16 that pool costs far more than it saves, worst on a busy machine.
    gemm_rows = max(1, SMALL_GEMM // max(1, a.shape[0] * n_cols))
    max_update, changed = 0.0, False
    for lo in range(start, stop, rows):
        hi = min(lo + rows, stop)
        blk, out = block[: hi - lo], merged[: hi - lo]
        _scaled_product(b, a, scale, lo, hi, gemm_rows, blk)
        if blk.size:
            max_update = max(max_update, float(blk.max()), -float(blk.min()))
        _add_weight(blk, weight, lo, hi, bf16)
        if not (math.isfinite(blk.max()) and math.isfinite(blk.min())):  # NaN propagates through max/min
            raise MergeError(f"non-finite merged values in rows {lo}..{hi}: the base weight holds NaN/Inf")
        _round_into(out, blk, weight.dtype, lo, hi, bf16)
        changed = changed or not np.array_equal(out.view(bits), weight[lo:hi].view(bits))
        emit(lo, out)
    return max_update, changed


def _scaled_product(
    b: np.ndarray, a: np.ndarray, scale: float, lo: int, hi: int, gemm_rows: int, blk: np.ndarray
) -> None:
    """``blk = scale · b[lo:hi] @ a``, ``gemm_rows`` rows per GEMM."""
    for g in range(lo, hi, gemm_rows):
        np.matmul(b[g : min(g + gemm_rows, hi)], a, out=blk[g - lo : min(g + gemm_rows, hi) - lo])
    blk *= scale


def _add_weight(blk: np.ndarray, weight: np.ndarray, lo: int, hi: int, bf16: list[np.ndarray] | None) -> None:
    """``blk += weight[lo:hi]``; a BF16 weight is widened to f32 exactly, by bits (``bf16``: its scratch)."""
    if bf16 is None:
        blk += weight[lo:hi]
        return
    wk = bf16[0][: hi - lo]
    np.left_shift(weight.view(np.uint16)[lo:hi], 16, out=wk, dtype=np.uint32)  # bf16 bits are f32's upper half
    blk += wk.view(np.float32)


def _round_into(
    out: np.ndarray, blk: np.ndarray, dtype: np.dtype, lo: int, hi: int, bf16: list[np.ndarray] | None
) -> None:
    """``out = blk`` rounded to the weight's dtype (nearest even); refuses a float16 overflow."""
    if bf16 is not None:
        # f32 -> bf16, round to nearest even (finite values): add 0x7FFF + the kept lowest bit, drop 16 bits
        u, rk = blk.view(np.uint32), bf16[1][: hi - lo]
        np.right_shift(u, 16, out=rk)
        rk &= 1
        rk += 0x7FFF
        rk += u
        out.view(np.uint16)[...] = rk.view(np.uint16)[:, _UPPER_HALF::2]
        return
    with np.errstate(over="ignore"):
        out[...] = blk  # rounds to the weight's dtype (nearest even)
    if dtype == np.float16 and not np.isfinite(out).all():
        raise MergeError(f"merged values overflow float16 in rows {lo}..{hi}: merge into a bf16/f32 copy of the base")


def peft_module(key: str) -> tuple[str, str]:
    """Parse a PEFT adapter key.

    Args:
        key: e.g. ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` (an adapter
            name segment, ``lora_A.default.weight``, is accepted too).

    Returns:
        ``(module, "A" | "B")``, e.g. ``("model.layers.0.self_attn.q_proj", "A")``; the base tensor is
        ``module + ".weight"``.

    Raises:
        MergeError: the key is not a ``lora_A`` / ``lora_B`` weight.
    """
    m = _PEFT_KEY.match(key)
    if not m:
        raise MergeError(
            f"adapter key {key!r} is not a lora_A/lora_B weight: only plain LoRA can be merged "
            "(no DoRA magnitude, LoRA bias, embedding LoRA or modules_to_save); re-export the adapter without it"
        )
    return m["module"].removeprefix(PEFT_PREFIX), m["ab"]


@dataclass(frozen=True)
class LoraTarget:
    """One base tensor to merge, and where its LoRA pair lies."""

    base: str
    lora_a: str
    lora_b: str
    rank: int
    scale: float


StoredName = Callable[[str, Collection[str]], str]  # a tensor's HF module name -> the name the checkpoint stores


def plan_merge(
    adapter: Mapping[str, TensorInfo],
    base: Mapping[str, TensorInfo],
    cfg: LoraConfig,
    stored_name: StoredName | None = None,
) -> dict[str, LoraTarget]:
    """Match adapter tensors to base tensors and check everything that can be checked from headers.

    Args:
        adapter: the adapter's tensors (name -> :class:`TensorInfo`).
        base: the base checkpoint's tensors.
        cfg: the adapter config.
        stored_name: where the base stores ``<module>.weight`` when its file layout differs from its
            transformers model's module names (a released multimodal Gemma 3); None: as named.

    Returns:
        ``{base tensor name: LoraTarget}``.

    Raises:
        MergeError: listing every problem: unparsable keys, a lora_A without its lora_B, keys
            matching no base tensor, shape or rank disagreements, non-float dtypes, modules outside
            ``target_modules``.
    """
    problems: list[str] = []
    pairs = _pair_keys(adapter, problems)
    targets: dict[str, LoraTarget] = {}
    for module, slot in pairs.items():
        target = _plan_target(module, slot, adapter, base, cfg, stored_name)
        if isinstance(target, str):
            problems.append(target)
        else:
            targets[target.base] = target
    if not pairs and not problems:
        problems.append("the adapter holds no lora_A/lora_B tensors")
    if problems:
        raise MergeError(
            f"cannot merge this adapter ({len(problems)} problem(s)):\n" + "\n".join(f"  - {p}" for p in problems)
        )
    return targets


def _pair_keys(adapter: Mapping[str, TensorInfo], problems: list[str]) -> dict[str, dict[str, str]]:
    """``{module: {"A": key, "B": key}}`` from the adapter's keys; unparsable or doubled keys go to ``problems``."""
    pairs: dict[str, dict[str, str]] = {}
    for key in adapter:
        try:
            module, ab = peft_module(key)
        except MergeError as exc:
            problems.append(str(exc))
            continue
        slot = pairs.setdefault(module, {})
        if ab in slot:
            problems.append(f"adapter keys {slot[ab]!r} and {key!r} both give lora_{ab} of {module}: keep one adapter")
        slot[ab] = key
    return pairs


def _plan_target(
    module: str,
    slot: dict[str, str],
    adapter: Mapping[str, TensorInfo],
    base: Mapping[str, TensorInfo],
    cfg: LoraConfig,
    stored_name: StoredName | None = None,
) -> LoraTarget | str:
    """One module's :class:`LoraTarget`, or the problem that keeps it from being merged."""
    if set(slot) != {"A", "B"}:
        have = next(iter(slot.values()))
        return f"adapter key {have!r} has no lora_{'B' if 'A' in slot else 'A'} partner: the export is incomplete"
    name = stored_name(module + ".weight", base.keys()) if stored_name else module + ".weight"
    if name not in base:
        return _missing_base(slot["A"], name, base)
    a, b, w = adapter[slot["A"]], adapter[slot["B"]], base[name]
    bad_dtype = [
        f"{n} is {t.dtype}" for n, t in ((slot["A"], a), (slot["B"], b), (name, w)) if t.dtype not in FLOAT_DTYPES
    ]
    if bad_dtype:
        return f"{'; '.join(bad_dtype)}: only F16/BF16/F32/F64 tensors can be merged (dequantise the base first)"
    rank, alpha = cfg.rank_alpha(module)
    problem = _shape_problem(slot["A"], name, a, b, w, rank, cfg.fan_in_fan_out)
    if problem:
        return problem
    if not cfg.targets(module):
        return (
            f"adapter key {slot['A']!r}: module {module} is not in target_modules {cfg.target_modules!r}: "
            "the config does not belong to these weights"
        )
    return LoraTarget(name, slot["A"], slot["B"], rank, lora_scale(rank, alpha, cfg.use_rslora))


def _missing_base(key: str, name: str, base: Mapping[str, TensorInfo]) -> str:
    import difflib

    close = difflib.get_close_matches(name, list(base), n=1)
    return (
        f"adapter key {key!r} targets base tensor {name!r}, which the base checkpoint does not hold"
        + (f" (closest: {close[0]!r})" if close else "")
        + f": the adapter belongs to another model, or its keys need the form {PEFT_PREFIX}<HF module>.lora_A.weight"
    )


def _shape_problem(
    key: str, name: str, a: TensorInfo, b: TensorInfo, w: TensorInfo, rank: int, fan_in_fan_out: bool
) -> str | None:
    """Why lora_A / lora_B do not fit the base weight at this rank (None when they do)."""
    n_out, n_in = (w.shape[::-1] if fan_in_fan_out else w.shape) if len(w.shape) == 2 else ("out", "in")
    if len(w.shape) != 2 or a.shape != (rank, n_in) or b.shape != (n_out, rank):
        return (
            f"adapter key {key!r}: lora_A {list(a.shape)} / lora_B {list(b.shape)} do not fit base {name} "
            f"{list(w.shape)} at rank {rank} (need A [{rank}, {n_in}], B [{n_out}, {rank}]): the adapter was trained on "
            "another model size, or adapter_config.json's r / rank_pattern is wrong"
        )
    return None


def check_finite(adapter: Checkpoint) -> None:
    """Raise :class:`MergeError` naming every adapter tensor that holds NaN or Inf (reads one at a time)."""
    bad = []
    for name, array in adapter:
        values = array.astype(np.float32) if array.dtype.itemsize < 4 else array
        if not np.isfinite(values).all():
            bad.append(f"{name} ({int(np.isnan(values).sum())} NaN, {int(np.isinf(values).sum())} Inf)")
    if bad:
        raise MergeError(
            f"the adapter holds non-finite values in {len(bad)} tensor(s): {', '.join(bad[:5])}"
            + (" ..." if len(bad) > 5 else "")
            + ": training diverged; use an earlier checkpoint or lower the learning rate"
        )


def find_adapter(adapter_dir: str | Path) -> tuple[Path, Path]:
    """``(adapter_model.safetensors, adapter_config.json)`` in ``adapter_dir`` or its ``peft/`` subdir."""
    root = Path(adapter_dir)
    for d in (root, root / "peft"):
        if (d / ADAPTER_CONFIG).is_file() and (d / ADAPTER_WEIGHTS).is_file():
            return d / ADAPTER_WEIGHTS, d / ADAPTER_CONFIG
    if any(root.rglob("adapter_model.bin")):
        raise MergeError(f"{root} holds adapter_model.bin: export the adapter as safetensors (safe_serialization=True)")
    raise MergeError(f"{root} holds no PEFT adapter ({ADAPTER_WEIGHTS} + {ADAPTER_CONFIG}, here or under peft/)")


@dataclass
class MergeReport:
    """What :func:`merge_checkpoint` did."""

    tensors: int = 0
    merged: int = 0  # tensors an adapter pair was folded into
    changed: int = 0  # of those, tensors whose stored values actually differ from the base
    bytes: int = 0  # tensor bytes written
    max_delta: float = 0.0  # max |scale · B @ A| over all merged tensors (float32, before rounding)
    files: list[str] = field(default_factory=list)  # weight files written
    copied: list[str] = field(default_factory=list)  # other files copied from the base
    skipped: list[str] = field(default_factory=list)  # non-safetensors weight files not copied
    unchanged_targets: list[str] = field(default_factory=list)  # merged but rounded back to the base

    def add_merged(self, name: str, delta: float, changed: bool) -> None:
        """Count one merged tensor (its max |update| and whether its stored values changed)."""
        self.merged += 1
        self.max_delta = max(self.max_delta, delta)
        if changed:
            self.changed += 1
        else:
            self.unchanged_targets.append(name)

    def summary(self) -> dict[str, Any]:
        return {
            "tensors": self.tensors,
            "merged": self.merged,
            "changed": self.changed,
            "bytes": self.bytes,
            "max_delta": self.max_delta,
            "files": len(self.files),
        }


def _group(name: str) -> str:
    m = _LAYER.match(name)
    return m["group"] if m else "other tensors"


def copy_side_files(base_dir: Path, out_dir: Path) -> tuple[list[str], list[str]]:
    """Copy everything but weights (config, tokenizer, generation config...); returns (copied, skipped)."""
    copied, skipped = [], []
    for src in sorted(p for p in base_dir.rglob("*") if p.is_file()):
        rel = src.relative_to(base_dir)
        if src.suffix in WEIGHT_SUFFIXES or src.name.endswith(".index.json") or src.name == "_MANIFEST.json":
            top_safetensors = src.parent == base_dir and (src.suffix == ".safetensors" or src.name == INDEX_FILE)
            if not top_safetensors and src.name != "_MANIFEST.json":
                skipped.append(str(rel))
            continue
        dest = out_dir / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest)
        copied.append(str(rel))
    return copied, skipped


def _scales(targets: Iterable[LoraTarget]) -> str:
    """``r=16, scale=2`` for one setting; ``r/scale per module (rank_pattern / alpha_pattern): 8/2 x4, ...``."""
    counts = Counter((t.rank, t.scale) for t in targets)
    if len(counts) <= 1:
        return ", ".join(f"r={r}, scale={scale:g}" for r, scale in counts)
    parts = ", ".join(f"{r}/{scale:g} x{n}" for (r, scale), n in sorted(counts.items()))
    return f"r/scale per module (rank_pattern / alpha_pattern): {parts}"


def merge_checkpoint(
    base_dir: str | Path,
    adapter_dir: str | Path,
    out_dir: str | Path,
    shard_bytes: int = 500 * 1024 * 1024,
    progress: Callable[[str], None] | None = None,
) -> MergeReport:
    """Write ``base + adapter`` as a sharded safetensors HF checkpoint, streaming tensor by tensor.

    Args:
        base_dir: HF checkpoint directory (config.json, tokenizer, ``model*.safetensors`` [+ index]).
        adapter_dir: directory with ``adapter_model.safetensors`` + ``adapter_config.json`` (or
            those under its ``peft/`` subdir).
        out_dir: where the merged checkpoint goes (created; must hold no weights yet).
        shard_bytes: maximum tensor bytes per output shard.
        progress: called with one line per tensor group (transformer layer) and at the end.

    Returns:
        A :class:`MergeReport`.

    Raises:
        MergeError: adapter keys that match no base tensor, shape/rank/dtype disagreements,
            NaN/Inf in the adapter, overflow when merging; checked before any weight is written
            (overflow excepted).
    """
    say = progress or (lambda _msg: None)
    base_dir, out_dir = Path(base_dir), Path(out_dir)
    _check_dirs(base_dir, out_dir)
    base = Checkpoint.open(base_dir)
    weights_file, config_file = find_adapter(adapter_dir)
    cfg = load_adapter_config(config_file)
    adapter = Checkpoint.open(weights_file)
    targets = plan_merge(adapter.tensors, base.tensors, cfg, _stored_names(base_dir))
    check_finite(adapter)
    say(
        f"{len(targets)} of {len(base)} base tensors get a LoRA update ({_scales(targets.values())}); "
        f"writing shards of <= {shard_bytes / 2**20:g} MiB; " + merge_kernel.status()
    )
    report = _stream_merge(base, adapter, targets, cfg.fan_in_fan_out, out_dir, shard_bytes, say)
    report.copied, report.skipped = copy_side_files(base_dir, out_dir)
    _say_done(report, say)
    return report


def _stored_names(base_dir: Path) -> StoredName | None:
    """The base's model family's ``stored_name`` (``loraflow.models``), for a model_type of a supported family."""
    from loraflow import models

    model_type = json.loads((base_dir / "config.json").read_text()).get("model_type")
    try:
        return models.family_for(str(model_type)).stored_name
    except models.UnsupportedModelError:
        return None  # any other HF model: the adapter names the stored tensors


def _check_dirs(base_dir: Path, out_dir: Path) -> None:
    """Refuse an output inside the base, and a base that is not an HF safetensors checkpoint."""
    if out_dir.resolve().is_relative_to(base_dir.resolve()):
        raise MergeError(f"out_dir {out_dir} lies inside base_dir {base_dir}: write the merged checkpoint elsewhere")
    if not (base_dir / "config.json").is_file():
        raise MergeError(f"{base_dir} is not a Hugging Face checkpoint (no config.json)")
    if not list(base_dir.glob("*.safetensors")):
        raise MergeError(f"{base_dir} holds no *.safetensors weights: convert the base checkpoint to safetensors first")


def _stream_merge(
    base: Checkpoint,
    adapter: Checkpoint,
    targets: dict[str, LoraTarget],
    fan_in_fan_out: bool,
    out_dir: Path,
    shard_bytes: int,
    say: Callable[[str], None],
) -> MergeReport:
    """Write every base tensor, merged where it has a target, in file order; the report of what was done.

    Two things overlap: paging in the next base tensor (mapped, not copied) and merging this
    one (the native kernel, numpy and file I/O release the GIL). The merge threads write each
    block of merged rows straight to its place in the output file while it is still in cache;
    tensors without an update are copied file to file. Memory: two mapped tensors and a few
    blocks per thread, whatever the model size.
    """
    report, groups = MergeReport(), _GroupProgress(say)
    order = [t for path in base.files for t in base.tensors.values() if t.file == path]
    plan = [t.spec for t in base.tensors.values()]
    load = functools.partial(_load, base, adapter, targets)
    with (
        ShardedWriter(out_dir, plan, shard_bytes, base.metadata) as writer,
        ThreadPoolExecutor(1, thread_name_prefix="loraflow-merge-read") as reader,
    ):
        ahead = reader.submit(load, order[0]) if order else None
        for i, info in enumerate(order):
            assert ahead is not None
            loaded = ahead.result()
            ahead = reader.submit(load, order[i + 1]) if i + 1 < len(order) else None
            groups.tensor(info.name)
            report.tensors += 1
            report.bytes += info.nbytes
            if loaded is None:
                writer.copy_tensor(info.name, base)
                continue
            delta, changed = _merge_tensor(info, loaded, targets[info.name], fan_in_fan_out, writer)
            del loaded  # the mapped base tensor: at most two are held
            faults.point("mid_merge")
            groups.merged(delta)
            report.add_merged(info.name, delta, changed)
        groups.flush()
    assert writer.result is not None
    report.files = [p.name for p in writer.result.files]
    return report


def _load(
    base: Checkpoint, adapter: Checkpoint, targets: dict[str, LoraTarget], info: TensorInfo
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(base weight mapped, lora_A, lora_B) of a tensor to merge; None for one to copy."""
    target = targets.get(info.name)
    if target is None:
        return None
    return base.map(info.name), adapter.read(target.lora_a), adapter.read(target.lora_b)


def _merge_tensor(
    info: TensorInfo,
    loaded: tuple[np.ndarray, np.ndarray, np.ndarray],
    target: LoraTarget,
    fan_in_fan_out: bool,
    writer: ShardedWriter,
) -> tuple[float, bool]:
    """Merge one tensor, each block of merged rows written to its place in the output; (max |update|, changed)."""
    weight, lora_a, lora_b = loaded
    fd, offset = writer.reserve(info.name)
    row_bytes = info.nbytes // max(1, weight.shape[0])

    def to_file(lo: int, block: np.ndarray) -> None:
        pwrite_all(fd, block, offset + lo * row_bytes)

    try:
        return _merge_blocks(weight, lora_a, lora_b, target.scale, fan_in_fan_out, to_file)
    except MergeError as exc:
        raise MergeError(f"{info.name} (adapter key {target.lora_a!r}): {exc}") from None


class _GroupProgress:
    """One progress line per tensor group (a transformer layer): its tensors, how many merged, max |update|."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.say = say
        self.group: str | None = None
        self.tensors, self.n_merged, self.delta = 0, 0, 0.0

    def tensor(self, name: str) -> None:
        if _group(name) != self.group:
            self.flush()
            self.group, self.tensors, self.n_merged, self.delta = _group(name), 0, 0, 0.0
        self.tensors += 1

    def merged(self, delta: float) -> None:
        self.n_merged += 1
        self.delta = max(self.delta, delta)

    def flush(self) -> None:
        if self.group is not None:
            self.say(f"{self.group}: {self.tensors} tensor(s), {self.n_merged} merged, max |update| {self.delta:.3g}")


def _say_done(report: MergeReport, say: Callable[[str], None]) -> None:
    say(
        f"merged {report.merged} tensor(s), {report.changed} changed, of {report.tensors}; "
        f"{report.bytes / 2**20:.1f} MiB in {len(report.files)} file(s); copied {len(report.copied)} other file(s)"
    )
    if report.unchanged_targets:
        say(
            f"WARNING: {len(report.unchanged_targets)} merged tensor(s) equal the base after rounding to their dtype "
            f"(e.g. {report.unchanged_targets[0]}): is lora_B still all zeros (an untrained adapter)?"
        )
    if report.skipped:
        say(f"not copied (unmerged weights in another format): {report.skipped}")
