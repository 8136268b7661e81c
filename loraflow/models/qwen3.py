"""The Qwen3 family (dense): MaxText's ``qwen3-*`` models, Hugging Face ``model_type: qwen3``.

Tables only (:class:`loraflow.models.family.ModelFamily`). Qwen3's quirks, and where each is handled:

* q/k norms (an RMSNorm over each head's query and key before RoPE): MaxText's ``qwen3`` decoder has
  them (``use_qk_norm``) and its mapping converts them (``self_attention/query_norm``, ``key_norm``);
  they are no LoRA target (MaxText's default LoRA module path for qwen3 is the Llama one);
* tied embeddings on the small sizes (``tie_word_embeddings``: 0.6B, 4B): MaxText's config says the
  same with ``logits_via_embedding``; the dimension check refuses a checkpoint and a MaxText model
  that disagree (the family-independent check in ``ModelFamily.check_dims``);
* no attention bias: the dense Qwen3 has none (MaxText maps q/k/v biases for Qwen2-style models; a
  Qwen3 checkpoint has no such tensors and its MaxText model no such parameters);
* the MaxText->HF hooks on LoRA targets are only ``reshape_kernel`` (no query scaling or RoPE
  permutation: MaxText's qwen3 attention scales and rotates as HF does).

The MoE sizes (``qwen3-30b-a3b``, ...) are not here: their experts are no LoRA target MaxText maps.
"""

from __future__ import annotations

from loraflow.models.family import DECODER_DIMS, DECODER_OVERRIDES, ModelFamily

NAME = "qwen3"
HF_MODEL_TYPES: tuple[str, ...] = ("qwen3",)
# The dense MaxText keys with the Qwen parameter mapping and an HF id (maxtext.utils.globals.HF_IDS).
MAXTEXT_MODELS: tuple[str, ...] = (
    "qwen3-0.6b",
    "qwen3-4b",
    "qwen3-4b-thinking-2507",
    "qwen3-8b",
    "qwen3-14b",
    "qwen3-32b",
)

# The shape keys every decoder family shares, and the RMSNorm epsilon (Qwen3's 1e-6, Llama's 1e-5).
DIMS: dict[str, str] = {**DECODER_DIMS, "rms_norm_eps": "normalization_layer_epsilon"}
OVERRIDES: dict[str, str] = dict(DECODER_OVERRIDES)
# Each MaxText model's architecture (its configs/models/<name>.yml) as far as QLoRA's tile must know it.
ARCHITECTURE: dict[str, dict[str, int]] = {
    "qwen3-0.6b": {"base_emb_dim": 1024, "head_dim": 128, "base_mlp_dim": 3072},
    "qwen3-4b": {"base_emb_dim": 2560, "head_dim": 128, "base_mlp_dim": 9728},
    "qwen3-4b-thinking-2507": {"base_emb_dim": 2560, "head_dim": 128, "base_mlp_dim": 9728},
    "qwen3-8b": {"base_emb_dim": 4096, "head_dim": 128, "base_mlp_dim": 12288},
    "qwen3-14b": {"base_emb_dim": 5120, "head_dim": 128, "base_mlp_dim": 17408},
    "qwen3-32b": {"base_emb_dim": 5120, "head_dim": 128, "base_mlp_dim": 25600},
}
# Qwen's MaxText->HF hooks on LoRA targets: reshape/transpose only.
EXPORT_HOOKS = frozenset({"reshape_kernel"})

FAMILY = ModelFamily(NAME, HF_MODEL_TYPES, MAXTEXT_MODELS, DIMS, OVERRIDES, ARCHITECTURE, EXPORT_HOOKS)
