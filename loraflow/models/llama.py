"""The Llama architecture family: MaxText's ``llama3.1-*`` models, Hugging Face ``model_type: llama``.

Tables only (:class:`loraflow.models.family.ModelFamily` says what each is for); the tiny test model
of the family is ``loraflow.dev.tinymodel``'s ``llama`` entry.
"""

from __future__ import annotations

from loraflow.models.family import DECODER_DIMS, DECODER_OVERRIDES, ModelFamily

NAME = "llama"
HF_MODEL_TYPES: tuple[str, ...] = ("llama",)
# The MaxText keys with the Llama 3.1 parameter mapping (maxtext.checkpoint_conversion.utils.param_mapping).
MAXTEXT_MODELS: tuple[str, ...] = ("llama3.1-8b", "llama3.1-8b-Instruct", "llama3.1-70b", "llama3.1-405b")

# The shape keys: those every decoder family shares (HF config key -> MaxText config key / override).
DIMS: dict[str, str] = dict(DECODER_DIMS)
OVERRIDES: dict[str, str] = dict(DECODER_OVERRIDES)
# Each MaxText model's architecture (its configs/models/<name>.yml) as far as QLoRA's tile must know it.
ARCHITECTURE: dict[str, dict[str, int]] = {
    "llama3.1-8b": {"base_emb_dim": 4096, "head_dim": 128, "base_mlp_dim": 14336},
    "llama3.1-8b-Instruct": {"base_emb_dim": 4096, "head_dim": 128, "base_mlp_dim": 14336},
    "llama3.1-70b": {"base_emb_dim": 8192, "head_dim": 128, "base_mlp_dim": 28672},
    "llama3.1-405b": {"base_emb_dim": 16384, "head_dim": 128, "base_mlp_dim": 53248},
}
# Llama's MaxText->HF hooks on LoRA targets: query scaling, RoPE layout, reshape/transpose.
EXPORT_HOOKS = frozenset({"scale_query_layer", "adjust_rope", "reshape_kernel"})

FAMILY = ModelFamily(NAME, HF_MODEL_TYPES, MAXTEXT_MODELS, DIMS, OVERRIDES, ARCHITECTURE, EXPORT_HOOKS)

maxtext_overrides = FAMILY.maxtext_overrides  # what bench/ and the tiny model call
