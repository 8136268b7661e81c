"""The Gemma 3 family: MaxText's ``gemma3-*`` models, Hugging Face ``model_type: gemma3_text`` (text
only, ``Gemma3ForCausalLM``) and ``gemma3`` (the multimodal ``Gemma3ForConditionalGeneration``, whose
language model is tuned; its vision tower is left as it is).

Tables, plus what Gemma 3 truly does differently (:class:`Gemma3Family`). Its quirks, and where each
is handled:

* RMSNorm scales as ``(1 + w)``: MaxText stores ``1 + w`` and its mapping's hooks add and remove the
  one (``scale_rmsnorm``); norms are no LoRA target;
* the embedding is multiplied by ``sqrt(hidden_size)``: MaxText stores the scaled table (its hook
  ``pad_and_scale_embedding``, with the factor rounded to bfloat16) and computes the tied output
  logits from it divided by the same root, the table rounded to bfloat16 even in a float32 run
  (``attend_on_embedding``): logits agree with HF's to ~0.2 % of their size, not to the bit;
* tied embeddings (no ``lm_head``): MaxText's ``logits_via_embedding``, checked by every family;
* q/k norms: MaxText's gemma3 decoder has them and its mapping converts them;
* sliding-window and global layers (5 local, then 1 global, ``layer_types``): MaxText scans the
  layers in blocks of 6 (``decoder/layers/layers_0..5``, the layer axis one per block) plus up to 5
  unscanned ``decoder/layers_remainder/layers_i``; the mapping lists the HF layers of each, so the
  PEFT export unstacks both. The window is a shape key (``sliding_window`` -> ``sliding_window_size``);
* RoPE: 10k base on local layers, 1M with linear scaling 8 on global ones; checked against MaxText's
  ``local_rope_max_timescale`` / ``rope_max_timescale`` / ``rope_linear_scaling_factor``;
* the query pre-attention scalar: MaxText scales queries by ``head_dim ** -0.5`` for gemma3-4b and
  -12b and by ``(emb_dim / heads) ** -0.5`` for gemma3-27b, whatever HF's ``query_pre_attn_scalar``
  says; the check refuses a checkpoint whose scalar differs from the MaxText model's;
* the released multimodal checkpoints' embedding has 262,208 rows (``text_config.vocab_size``): the
  262,144 text tokens, then the image token (``image_token_index`` 262,144) and padding; MaxText's
  gemma3 models have 262,144 and its conversion hook cuts the table to them (``pad_and_scale_embedding``).
  The check lets a multimodal checkpoint through when the rows MaxText drops begin at its image token
  (:func:`drops_image_rows_only`); the merge leaves the base's full table as it is;
* two config shapes and three key layouts: MaxText's mapping reads the multimodal config (its
  ``text_config``) and names ``model.language_model.layers...``; a text-only checkpoint has a flat
  config and ``model.layers...``, Google's released multimodal ones ``language_model.model.layers...``
  (:meth:`Gemma3Family.conversion_config`, :meth:`Gemma3Family.stored_name`). The PEFT export names
  the modules as the checkpoint's transformers model does (``model.layers`` text only,
  ``model.language_model.layers`` multimodal).

The only MaxText->HF hook on LoRA targets is ``reshape_kernel`` (no query scaling or RoPE permutation:
MaxText's Gemma 3 attention rotates as HF does). MaxText's LoRA module path for gemma3 matches the
scanned blocks and the remainder layers alike (configs/post_train/lora_module_path.yml).
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Mapping
from typing import Any

from loraflow.models.family import DECODER_DIMS, DECODER_OVERRIDES, ModelFamily

NAME = "gemma3"
HF_MODEL_TYPES: tuple[str, ...] = ("gemma3_text", "gemma3")
# The MaxText keys with the Gemma3 parameter mapping (maxtext.checkpoint_conversion.utils.param_mapping).
MAXTEXT_MODELS: tuple[str, ...] = ("gemma3-4b", "gemma3-12b", "gemma3-27b")

# The shared decoder shape keys, the RMSNorm epsilon and the local layers' attention window.
DIMS: dict[str, str] = {
    **DECODER_DIMS,
    "rms_norm_eps": "normalization_layer_epsilon",
    "sliding_window": "sliding_window_size",
}
OVERRIDES: dict[str, str] = {**DECODER_OVERRIDES, "sliding_window": "sliding_window_size"}
# Each MaxText model's architecture (its configs/models/<name>.yml) as far as QLoRA's tile must know it.
ARCHITECTURE: dict[str, dict[str, int]] = {
    "gemma3-4b": {"base_emb_dim": 2560, "head_dim": 256, "base_mlp_dim": 10240},
    "gemma3-12b": {"base_emb_dim": 3840, "head_dim": 256, "base_mlp_dim": 15360},
    "gemma3-27b": {"base_emb_dim": 5376, "head_dim": 128, "base_mlp_dim": 21504},
}
EXPORT_HOOKS = frozenset({"reshape_kernel"})

# Where MaxText's mapping puts the language model, and where each checkpoint layout stores it.
MAPPING_PREFIX = "model.language_model."
TEXT_ONLY_PREFIX = "model."  # Gemma3ForCausalLM (model_type gemma3_text)
RELEASED_PREFIX = "language_model.model."  # Gemma3ForConditionalGeneration as Google released it

# RoPE: (HF rope_parameters entry, its key) -> the MaxText setting that must agree.
ROPE: dict[tuple[str, str], str] = {
    ("full_attention", "rope_theta"): "rope_max_timescale",
    ("sliding_attention", "rope_theta"): "local_rope_max_timescale",
    ("full_attention", "factor"): "rope_linear_scaling_factor",
}


def text_config(hf_cfg: Any) -> Any:
    """The language model's config: a multimodal config's ``text_config``, else the config itself."""
    return getattr(hf_cfg, "text_config", None) or hf_cfg


def query_scale(maxtext_model: str, mt_cfg: Any) -> float:
    """What MaxText multiplies Gemma 3 queries by (maxtext.models.gemma3.get_query_pre_attn_scalar)."""
    if maxtext_model == "gemma3-27b":
        return float(mt_cfg.emb_dim // mt_cfg.num_query_heads) ** -0.5
    return float(mt_cfg.head_dim) ** -0.5


def rope_settings(text_cfg: Any) -> dict[tuple[str, str], float]:
    """The checkpoint's RoPE as ``ROPE`` keys: transformers' ``rope_parameters`` per layer type (a
    default rope has factor 1)."""
    params = getattr(text_cfg, "rope_parameters", None) or {}
    out: dict[tuple[str, str], float] = {}
    for layer_type, key in ROPE:
        entry = params.get(layer_type) if isinstance(params, Mapping) else None
        if not isinstance(entry, Mapping):
            continue
        if key == "factor":
            out[(layer_type, key)] = float(entry.get("factor", 1.0)) if entry.get("rope_type") == "linear" else 1.0
        elif key in entry:
            out[(layer_type, key)] = float(entry[key])
    return out


def drops_image_rows_only(hf_cfg: Any, maxtext_cfg: Any) -> bool:
    """Whether the checkpoint's embedding is larger than MaxText's vocabulary by rows its text never uses: a
    multimodal config whose image token is the first row past MaxText's ``vocab_size`` (the rows after it
    are padding), which MaxText's conversion drops."""
    hv = getattr(text_config(hf_cfg), "vocab_size", None)
    mv = getattr(maxtext_cfg, "vocab_size", None)
    image = getattr(hf_cfg, "image_token_index", None) if getattr(hf_cfg, "text_config", None) is not None else None
    if hv is None or mv is None or image is None:
        return False
    return int(hv) > int(mv) == int(image)


class Gemma3Family(ModelFamily):
    """The tables, plus Gemma 3's config shapes, key layouts, query scaling and RoPE check."""

    def dim_problems(self, hf_cfg: Any, maxtext_cfg: Any) -> list[str]:
        """The shared checks on the language model's config (its vocabulary may exceed MaxText's by the
        image rows of a multimodal checkpoint, :func:`drops_image_rows_only`), and: the query
        pre-attention scalar MaxText derives from the model name, and the local and global RoPE."""
        text = text_config(hf_cfg)
        checked = text
        if drops_image_rows_only(hf_cfg, maxtext_cfg):  # the released multimodal table: image rows MaxText drops
            checked = copy.copy(text)
            checked.vocab_size = maxtext_cfg.vocab_size
        bad = super().dim_problems(checked, maxtext_cfg)
        model = getattr(maxtext_cfg, "model_name", None)
        scalar = getattr(text, "query_pre_attn_scalar", None)
        if model in self.maxtext_models and scalar is not None and hasattr(maxtext_cfg, "head_dim"):
            theirs, ours = float(scalar) ** -0.5, query_scale(model, maxtext_cfg)
            if abs(theirs - ours) > 1e-6 * ours:
                bad.append(
                    f"query_pre_attn_scalar={scalar} vs MaxText {model}'s query scale {ours:.6g} (= head_dim**-0.5 "
                    "for gemma3-4b/12b, (emb_dim/heads)**-0.5 for gemma3-27b; HF scales by query_pre_attn_scalar"
                    "**-0.5): use the MaxText model whose query scale the checkpoint has"
                )
        for (layer_type, key), value in rope_settings(text).items():
            mt_key = ROPE[(layer_type, key)]
            mv = getattr(maxtext_cfg, mt_key, None)
            if mv is not None and abs(float(mv) - value) > 1e-6 * max(1.0, value):
                bad.append(f"rope_parameters.{layer_type}.{key}={value:g} vs MaxText {mt_key}={mv}")
        return bad

    def conversion_config(self, hf_cfg: Any) -> Any:
        """MaxText's Gemma3 mapping reads the multimodal config (``text_config`` and ``vision_config``):
        a text-only config is wrapped as the text config of one with no vision layers."""
        if getattr(hf_cfg, "text_config", None) is not None:
            return hf_cfg
        import transformers

        return transformers.Gemma3Config(text_config=hf_cfg.to_dict(), vision_config={"num_hidden_layers": 0})

    def stored_name(self, name: str, stored: Collection[str]) -> str:
        """The mapping's ``model.language_model.X`` as this checkpoint stores it: as named, else the
        text-only ``model.X``, else the released multimodal ``language_model.model.X``."""
        if name in stored or not name.startswith(MAPPING_PREFIX):
            return name
        rest = name[len(MAPPING_PREFIX) :]
        for prefix in (TEXT_ONLY_PREFIX, RELEASED_PREFIX):
            if prefix + rest in stored:
                return prefix + rest
        return name

    def peft_modules(
        self, flat_lora: Mapping[tuple[str, ...], Any], mt_config: Any, hf_config: Any, scale: float
    ) -> tuple[dict[str, tuple[Any, Any]], float]:
        """The shared export on the multimodal-shaped config; a text-only model's modules renamed to
        its own ``model.layers...`` (PEFT and vLLM name them after the transformers model)."""
        modules, max_err = super().peft_modules(flat_lora, mt_config, self.conversion_config(hf_config), scale)
        if getattr(hf_config, "text_config", None) is not None:
            return modules, max_err
        renamed = {TEXT_ONLY_PREFIX + n.removeprefix(MAPPING_PREFIX): ab for n, ab in modules.items()}
        return renamed, max_err


FAMILY = Gemma3Family(NAME, HF_MODEL_TYPES, MAXTEXT_MODELS, DIMS, OVERRIDES, ARCHITECTURE, EXPORT_HOOKS)
