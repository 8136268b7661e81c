"""The PEFT export layout, the same for every model family: MaxText LoRA factors -> PEFT's (HF layout).

qwix trains, per targeted kernel, ``a [in, r]`` and ``b [r, out...]`` (plus a layer axis when the
decoder is scanned) with ``y = x W + scale · x a b``. PEFT wants, per HF module, ``lora_A [r, in]``
and ``lora_B [out, r]`` with ``W_hf += scale · lora_B @ lora_A``. MaxText's own parameter mapping
names the HF module(s) of a kernel (one per layer of a scanned stack) and its MaxText->HF hooks say
how a kernel becomes an HF weight; lora_B takes those hooks (as if its rank axis were the kernel's
input axis), lora_A only a transpose. That holds for the hooks a family lists as ``export_hooks``
(reshape/transpose, RoPE layout, query scaling: linear in the output axes); any other hook on a
LoRA target is refused. Every module is then checked on the first and the last layer of its stack:
``scale · lora_B @ lora_A`` must equal the hooks applied to the full MaxText-space delta ``scale · a @ b``.
The hooks are the stack's, the same for each of its layers, so the layers between add nothing to the
check but its cost: the full deltas of an 8B model's 224 (module, layer) pairs take minutes of CPU.

What is family-specific comes in as arguments: the hooks known to be safe and the kernel's output
axes (``loraflow.models.family.ModelFamily.lora_out_shape``). numpy and MaxText are imported inside.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from loraflow.errors import LoraflowError

OutShape = Callable[[tuple[str, ...], Any, int], tuple[int, ...]]  # (module path, MaxText config, outputs) -> axes
Tables = tuple[dict[str, Any], dict[str, Any]]  # MaxText's parameter mapping and MaxText->HF hooks


def conversion_tables(mt_config: Any, hf_config: Any) -> Tables:
    """MaxText's parameter mapping (MaxText key -> HF name, a list of them for a scanned stack) and
    its MaxText->HF hooks, for this model's dimensions and layer layout."""
    from maxtext.checkpoint_conversion.utils.param_mapping import HOOK_FNS, PARAM_MAPPING

    model_key, hf_dict, scan = mt_config.model_name, hf_config.to_dict(), bool(mt_config.scan_layers)
    param_map = PARAM_MAPPING[model_key](hf_dict, mt_config, scan)
    hook_map = HOOK_FNS[model_key](hf_dict, mt_config, scan, saving_to_hf=True)
    return param_map, hook_map


def maxtext_kernel_key(mpath: tuple[str, ...]) -> str:
    """The parameter-mapping key of the kernel a LoRA module adapts (``params-decoder-...-query-kernel``)."""
    return "params-" + "-".join(mpath) + "-kernel"


def hf_targets(mpath: tuple[str, ...], tables: Tables, export_hooks: frozenset[str]) -> tuple[list[str], Any]:
    """The HF weight(s) a LoRA module maps to (one per layer of a scanned stack) and its MaxText->HF hooks."""
    param_map, hook_map = tables
    mt_key = maxtext_kernel_key(mpath)
    if mt_key not in param_map:
        raise LoraflowError(f"no MaxText->HF mapping for LoRA module {'/'.join(mpath)} ({mt_key})")
    hooks = hook_map.get(mt_key)
    hook_list = hooks if isinstance(hooks, list) else ([hooks] if hooks else [])
    names = {getattr(h, "__name__", str(h)) for h in hook_list}
    if not names <= export_hooks:
        raise LoraflowError(f"{mt_key}: MaxText->HF hooks {names - export_hooks} not supported for adapters")
    hf_paths = param_map[mt_key]
    return (hf_paths if isinstance(hf_paths, list) else [hf_paths]), hooks


def lora_factors(flat_lora: Mapping[tuple[str, ...], Any]) -> dict[tuple[str, ...], dict[str, Any]]:
    """The trained LoRA modules: MaxText module path -> ``{"kernel_lora_a": a, "kernel_lora_b": b}`` (float32)."""
    import numpy as np

    modules: dict[tuple[str, ...], dict[str, Any]] = {}
    for path, arr in flat_lora.items():
        if path[-1] == "value":
            path = path[:-1]
        if path[-1] in ("kernel_lora_a", "kernel_lora_b"):
            modules.setdefault(path[:-1], {})[path[-1]] = np.asarray(arr, np.float32)
    return modules


def peft_modules(
    flat_lora: Mapping[tuple[str, ...], Any],
    mt_config: Any,
    hf_config: Any,
    scale: float,
    export_hooks: frozenset[str],
    out_shape: OutShape,
) -> tuple[dict[str, tuple[Any, Any]], float]:
    """The PEFT factors of a trained adapter: ``({HF module: (lora_A [r, in], lora_B [out, r])}, max |diff|)``,
    each module checked against MaxText's hooks applied to the full delta (module docstring)."""
    tables = conversion_tables(mt_config, hf_config)
    modules: dict[str, tuple[Any, Any]] = {}
    max_err = 0.0
    for mpath, ab in sorted(lora_factors(flat_lora).items()):
        hf_paths, hooks = hf_targets(mpath, tables, export_hooks)
        shape = out_shape(mpath, mt_config, ab["kernel_lora_b"].shape[-1])
        for name, lora_a, lora_b, err in _export_module(ab, hf_paths, hooks, shape, mt_config, scale):
            modules[name] = (lora_a, lora_b)
            max_err = max(max_err, err)
    return modules, max_err


def _export_module(
    ab: dict[str, Any], hf_paths: list[str], hooks: Any, out_shape: tuple[int, ...], mt_config: Any, scale: float
) -> Iterator[tuple[str, Any, Any, float]]:
    """One LoRA module's PEFT factors, a layer at a time: (HF module, lora_A, lora_B, checked max |diff|; 0.0
    for the layers between the stack's first and last, which are not checked)."""
    a_all, b_all = ab["kernel_lora_a"], ab["kernel_lora_b"]
    checked = {0, len(hf_paths) - 1}
    for layer, hf_path in enumerate(hf_paths):
        a, b = _layer_factors(a_all, b_all, layer, len(hf_paths), mt_config)
        lora_a, lora_b = _peft_factors(a, b, out_shape, hooks)
        err = _check_factors(hf_path, a, b, lora_a, lora_b, out_shape, hooks, scale) if layer in checked else 0.0
        yield hf_path.removesuffix(".weight"), lora_a, lora_b, err


def _layer_factors(a_all: Any, b_all: Any, layer: int, n_paths: int, mt_config: Any) -> tuple[Any, Any]:
    """One layer's (a, b) out of a scanned stack (stacked along MaxText's ``param_scan_axis``); else as they are."""
    import numpy as np

    if n_paths > 1 or a_all.ndim == 3:
        axis = mt_config.param_scan_axis
        return np.take(a_all, layer, axis=axis), np.take(b_all, layer, axis=axis)
    return a_all, b_all


def _peft_factors(a: Any, b: Any, out_shape: tuple[int, ...], hooks: Any) -> tuple[Any, Any]:
    """MaxText factors a [in, r], b [r, out...] -> PEFT's lora_A [r, in], lora_B [out, r] (HF layout)."""
    import numpy as np
    from maxtext.checkpoint_conversion.utils.tensor_handling import apply_hook_fns

    r = a.shape[-1]
    b_kernel = b.reshape((r, *out_shape))  # as if the "input" axis were the rank axis
    lora_b = np.asarray(apply_hook_fns(b_kernel, (b.shape[-1], r), hooks), np.float32)  # (out, r)
    lora_a = np.ascontiguousarray(a.T)  # (r, in)
    return lora_a, np.ascontiguousarray(lora_b)


def _check_factors(
    hf_path: str, a: Any, b: Any, lora_a: Any, lora_b: Any, out_shape: tuple[int, ...], hooks: Any, scale: float
) -> float:
    """Check the PEFT delta against MaxText's own hooks applied to the full MaxText-space delta; max |diff|."""
    import numpy as np
    from maxtext.checkpoint_conversion.utils.tensor_handling import apply_hook_fns

    delta_mt = (scale * (a @ b)).reshape((a.shape[0], *out_shape))
    ref = np.asarray(apply_hook_fns(delta_mt, (b.shape[-1], a.shape[0]), hooks), np.float32)
    mine = scale * (lora_b @ lora_a)
    err = float(np.max(np.abs(ref - mine))) if ref.size else 0.0
    tol = 1e-5 * max(1.0, float(np.max(np.abs(ref))))
    if ref.shape != mine.shape or err > tol:
        raise LoraflowError(
            f"PEFT export check failed for {hf_path}: max |diff| {err} (shape {ref.shape} vs {mine.shape})"
        )
    return err
