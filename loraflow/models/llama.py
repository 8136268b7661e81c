"""The Llama architecture family: MaxText's ``llama3.1-*`` models, Hugging Face ``model_type: llama``.

Everything loraflow knows about the family (the tiny test model, ``loraflow.dev.tinymodel``, is one):

* the dimension check: :data:`DIMS` pairs each HF config key with MaxText's, :func:`check_dims`
  refuses a disagreement, :func:`maxtext_overrides` gives the command-line overrides for HF dimensions;
* the conversion mapping: MaxText's own parameter-name table and MaxText->HF hooks for the model
  (:func:`conversion_tables`), which its HF->MaxText converter uses as well;
* LoRA targets: a LoRA module's MaxText kernel (:func:`maxtext_kernel_key`), its HF module(s) (from
  the mapping) and its kernel's output axes (:func:`lora_out_shape`: attention heads x head_dim for
  query/key/value, flat for out and the MLP's wi_0/wi_1/wo);
* the PEFT export layout (:func:`peft_modules`): lora_A transposed, lora_B through MaxText's
  MaxText->HF hooks, a scanned layer stack unstacked into one module per layer, every module checked.

No heavy import at module level (spec validation imports this module): numpy and MaxText inside.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

from loraflow.errors import LoraflowError

NAME = "llama"
HF_MODEL_TYPES: tuple[str, ...] = ("llama",)
# The MaxText keys with the Llama 3.1 parameter mapping (maxtext.checkpoint_conversion.utils.param_mapping).
MAXTEXT_MODELS: tuple[str, ...] = ("llama3.1-8b", "llama3.1-8b-Instruct", "llama3.1-70b", "llama3.1-405b")

# HF config key -> the MaxText config key that must agree with it.
DIMS: dict[str, str] = {
    "hidden_size": "emb_dim",
    "intermediate_size": "mlp_dim",
    "num_hidden_layers": "num_decoder_layers",
    "num_attention_heads": "num_query_heads",
    "num_key_value_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "vocab_size": "vocab_size",
}
# HF config key -> the MaxText command-line override that sets it.
OVERRIDES: dict[str, str] = {
    "hidden_size": "base_emb_dim",
    "num_attention_heads": "base_num_query_heads",
    "num_key_value_heads": "base_num_kv_heads",
    "head_dim": "head_dim",
    "intermediate_size": "base_mlp_dim",
    "num_hidden_layers": "base_num_decoder_layers",
    "vocab_size": "vocab_size",
}
# Each MaxText model's architecture (its configs/models/<name>.yml) as far as QLoRA's tile must know it.
_ARCHITECTURE: dict[str, dict[str, int]] = {
    "llama3.1-8b": {"base_emb_dim": 4096, "head_dim": 128, "base_mlp_dim": 14336},
    "llama3.1-8b-Instruct": {"base_emb_dim": 4096, "head_dim": 128, "base_mlp_dim": 14336},
    "llama3.1-70b": {"base_emb_dim": 8192, "head_dim": 128, "base_mlp_dim": 28672},
    "llama3.1-405b": {"base_emb_dim": 16384, "head_dim": 128, "base_mlp_dim": 53248},
}
# The MaxText->HF hooks whose effect on a LoRA factor pair loraflow knows (lora_B takes them, lora_A a transpose).
EXPORT_HOOKS = frozenset({"scale_query_layer", "adjust_rope", "reshape_kernel"})


# ------------------------------------------------------------------------------------ dimensions


def check_dims(hf_cfg: Any, maxtext_cfg: Any) -> None:
    """Refuse a MaxText config whose dimensions disagree with the HF checkpoint (clear error, not a reshape failure)."""
    bad = []
    for hf_key, mt_key in DIMS.items():
        hv, mv = getattr(hf_cfg, hf_key, None), getattr(maxtext_cfg, mt_key, None)
        if hv is not None and mv is not None and hv != mv:
            bad.append(f"{hf_key}={hv} vs MaxText {mt_key}={mv}")
    if bad:
        raise LoraflowError(
            "HF checkpoint and MaxText model config disagree: " + "; ".join(bad) + " (fix model_overrides)"
        )


def contracted_dims(maxtext_model: str, overrides: Mapping[str, Any]) -> dict[str, tuple[int, str]]:
    """The dimension each kind of LoRA-targeted kernel contracts over, as ``{name: (size, kernels)}``:
    qwix quantizes in tiles along a kernel's last contracted axis, so a QLoRA tile must divide each.
    Attention's query/key/value and the MLP's wi_0/wi_1 contract the embedding, attention's out the
    head dimension (its last of heads x head_dim), the MLP's wo the MLP dimension."""
    arch = {**_ARCHITECTURE[maxtext_model], **{k: v for k, v in overrides.items() if k in _ARCHITECTURE[maxtext_model]}}
    return {
        "emb_dim": (int(arch["base_emb_dim"]), "query, key, value, wi_0, wi_1"),
        "head_dim": (int(arch["head_dim"]), "out"),
        "mlp_dim": (int(arch["base_mlp_dim"]), "wo"),
    }


def maxtext_overrides(hf_dims: Mapping[str, int]) -> dict[str, int]:
    """MaxText ``model_overrides`` that give a model the HF dimensions ``hf_dims`` (config.json keys)."""
    return {mt_key: hf_dims[hf_key] for hf_key, mt_key in OVERRIDES.items() if hf_key in hf_dims}


# ------------------------------------------------------------------------------------ conversion mapping


def conversion_tables(mt_config: Any, hf_config: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """MaxText's parameter mapping (MaxText key -> HF name, a list of them for a scanned stack) and
    its MaxText->HF hooks, for this model's dimensions and layer layout."""
    from maxtext.checkpoint_conversion.utils.param_mapping import HOOK_FNS, PARAM_MAPPING

    model_key, hf_dict, scan = mt_config.model_name, hf_config.to_dict(), bool(mt_config.scan_layers)
    param_map = PARAM_MAPPING[model_key](hf_dict, mt_config, scan)
    hook_map = HOOK_FNS[model_key](hf_dict, mt_config, scan, saving_to_hf=True)
    return param_map, hook_map


# ------------------------------------------------------------------------------------ LoRA targets


def maxtext_kernel_key(mpath: tuple[str, ...]) -> str:
    """The parameter-mapping key of the kernel a LoRA module adapts (``params-decoder-...-query-kernel``)."""
    return "params-" + "-".join(mpath) + "-kernel"


def lora_out_shape(mpath: tuple[str, ...], mt_config: Any, out_flat: int) -> tuple[int, ...]:
    """The MaxText kernel's output axes for a LoRA module (qwix flattens them row-major into lora_b)."""
    name = mpath[-1]
    shape: tuple[int, ...]
    if name == "query":
        shape = (mt_config.num_query_heads, mt_config.head_dim)
    elif name in ("key", "value"):
        shape = (mt_config.num_kv_heads, mt_config.head_dim)
    else:
        shape = (out_flat,)
    if math.prod(shape) != out_flat:
        raise LoraflowError(f"LoRA module {'/'.join(mpath)}: lora_b has {out_flat} outputs, expected {shape}")
    return shape


def _hf_targets(mpath: tuple[str, ...], tables: tuple[dict[str, Any], dict[str, Any]]) -> tuple[list[str], Any]:
    """The HF weight(s) a LoRA module maps to (one per layer of a scanned stack) and its MaxText->HF hooks."""
    param_map, hook_map = tables
    mt_key = maxtext_kernel_key(mpath)
    if mt_key not in param_map:
        raise LoraflowError(f"no MaxText->HF mapping for LoRA module {'/'.join(mpath)} ({mt_key})")
    hooks = hook_map.get(mt_key)
    hook_list = hooks if isinstance(hooks, list) else ([hooks] if hooks else [])
    names = {getattr(h, "__name__", str(h)) for h in hook_list}
    if not names <= EXPORT_HOOKS:
        raise LoraflowError(f"{mt_key}: MaxText->HF hooks {names - EXPORT_HOOKS} not supported for adapters")
    hf_paths = param_map[mt_key]
    return (hf_paths if isinstance(hf_paths, list) else [hf_paths]), hooks


# ------------------------------------------------------------------------------------ PEFT export


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
    flat_lora: Mapping[tuple[str, ...], Any], mt_config: Any, hf_config: Any, scale: float
) -> tuple[dict[str, tuple[Any, Any]], float]:
    """The PEFT factors of a trained adapter: ``({HF module: (lora_A [r, in], lora_B [out, r])}, max |diff|)``.

    Uses MaxText's own parameter mapping and its MaxText->HF hooks (query scaling, RoPE layout,
    reshape/transpose), applied to the output side of each LoRA factor (lora_B); lora_A needs only
    a transpose for the hooks this supports. Every (module, layer) is then checked: the PEFT delta
    scale·B@A must equal MaxText's hooks applied to the MaxText-space delta scale·a@b; max |diff| is
    the largest difference seen.
    """
    tables = conversion_tables(mt_config, hf_config)
    modules: dict[str, tuple[Any, Any]] = {}
    max_err = 0.0
    for mpath, ab in sorted(lora_factors(flat_lora).items()):
        for name, lora_a, lora_b, err in _export_module(mpath, ab, tables, mt_config, scale):
            modules[name] = (lora_a, lora_b)
            max_err = max(max_err, err)
    return modules, max_err


def _export_module(
    mpath: tuple[str, ...],
    ab: dict[str, Any],
    tables: tuple[dict[str, Any], dict[str, Any]],
    mt_config: Any,
    scale: float,
) -> Iterator[tuple[str, Any, Any, float]]:
    """One LoRA module's PEFT factors, a layer at a time: (HF module, lora_A, lora_B, checked max |diff|)."""
    hf_paths, hooks = _hf_targets(mpath, tables)
    a_all, b_all = ab["kernel_lora_a"], ab["kernel_lora_b"]
    out_shape = lora_out_shape(mpath, mt_config, b_all.shape[-1])
    for layer, hf_path in enumerate(hf_paths):
        a, b = _layer_factors(a_all, b_all, layer, len(hf_paths), mt_config)
        lora_a, lora_b = _peft_factors(a, b, out_shape, hooks)
        err = _check_factors(hf_path, a, b, lora_a, lora_b, out_shape, hooks, scale)
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
