"""What every model family is: its tables, and the behaviour they drive (the same for every family).

A family module (``loraflow/models/<family>.py``) builds one :class:`ModelFamily` from its tables:

* ``name``, ``hf_model_types`` (config.json's ``model_type``) and ``maxtext_models`` (MaxText model
  keys with a parameter mapping, ``maxtext.checkpoint_conversion.utils.param_mapping``);
* ``dims``: HF config key -> the MaxText config key that must agree with it (:meth:`check_dims`);
* ``overrides``: HF config key -> the MaxText command-line override that sets it (:meth:`maxtext_overrides`,
  the spec's shape keys);
* ``architecture``: each MaxText model's sizes (its ``configs/models/<name>.yml``) as far as QLoRA's tile
  must know them (:meth:`contracted_dims`);
* ``export_hooks``: the MaxText->HF hooks of its mapping whose effect on a LoRA factor pair is known
  (the PEFT export, :mod:`loraflow.models.peft_layout`, refuses any other on a LoRA target).

What a family does differently beyond its tables goes into a subclass that overrides a method
(e.g. :meth:`lora_out_shape` for another attention layout). No heavy import at module level: spec
validation imports the families.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from loraflow.errors import LoraflowError
from loraflow.models import peft_layout

# The shape keys HF decoder configs and MaxText name alike across families (a family adds its own).
# HF config key -> the MaxText config key that must agree with it ...
DECODER_DIMS: dict[str, str] = {
    "hidden_size": "emb_dim",
    "intermediate_size": "mlp_dim",
    "num_hidden_layers": "num_decoder_layers",
    "num_attention_heads": "num_query_heads",
    "num_key_value_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "vocab_size": "vocab_size",
}
# ... and HF config key -> the MaxText command-line override that sets it.
DECODER_OVERRIDES: dict[str, str] = {
    "hidden_size": "base_emb_dim",
    "num_attention_heads": "base_num_query_heads",
    "num_key_value_heads": "base_num_kv_heads",
    "head_dim": "head_dim",
    "intermediate_size": "base_mlp_dim",
    "num_hidden_layers": "base_num_decoder_layers",
    "vocab_size": "vocab_size",
}


@dataclass(frozen=True)
class ModelFamily:
    name: str
    hf_model_types: tuple[str, ...]
    maxtext_models: tuple[str, ...]
    dims: Mapping[str, str]
    overrides: Mapping[str, str]
    architecture: Mapping[str, Mapping[str, int]]
    export_hooks: frozenset[str]

    def __post_init__(self) -> None:
        missing = set(self.maxtext_models) - set(self.architecture)
        if missing:
            raise LoraflowError(f"model family {self.name}: no architecture entry for {sorted(missing)}")

    # -------------------------------------------------------------------------------- dimensions

    def check_dims(self, hf_cfg: Any, maxtext_cfg: Any) -> None:
        """Refuse a MaxText config that disagrees with the HF checkpoint (clear error, not a reshape failure):
        every problem :meth:`dim_problems` finds, in one message."""
        bad = self.dim_problems(hf_cfg, maxtext_cfg)
        if bad:
            raise LoraflowError(
                "HF checkpoint and MaxText model config disagree: " + "; ".join(bad) + " (fix model_overrides)"
            )

    def dim_problems(self, hf_cfg: Any, maxtext_cfg: Any) -> list[str]:
        """Where the HF config and the MaxText config disagree: a dimension of ``dims``, or whether the
        output projection is the embedding (HF ``tie_word_embeddings``, MaxText ``logits_via_embedding``:
        the checkpoint would lack, or carry unread, ``lm_head.weight``)."""
        bad = []
        for hf_key, mt_key in self.dims.items():
            hv, mv = getattr(hf_cfg, hf_key, None), getattr(maxtext_cfg, mt_key, None)
            if hv is not None and mv is not None and hv != mv:
                bad.append(f"{hf_key}={hv} vs MaxText {mt_key}={mv}")
        tied, via_embedding = (
            getattr(hf_cfg, "tie_word_embeddings", None),
            getattr(maxtext_cfg, "logits_via_embedding", None),
        )
        if tied is not None and via_embedding is not None and bool(tied) != bool(via_embedding):
            bad.append(
                f"tie_word_embeddings={tied} vs MaxText logits_via_embedding={via_embedding} (use a MaxText "
                f"model whose output projection is {'the embedding' if tied else 'its own'}: "
                f"{', '.join(self.maxtext_models)})"
            )
        return bad

    def maxtext_overrides(self, hf_dims: Mapping[str, Any]) -> dict[str, int]:
        """MaxText ``model_overrides`` that give a model the HF dimensions ``hf_dims`` (config.json keys)."""
        return {mt_key: hf_dims[hf_key] for hf_key, mt_key in self.overrides.items() if hf_key in hf_dims}

    def contracted_dims(self, maxtext_model: str, overrides: Mapping[str, Any]) -> dict[str, tuple[int, str]]:
        """The dimension each kind of LoRA-targeted kernel contracts over, as ``{name: (size, kernels)}``:
        qwix quantizes in tiles along a kernel's last contracted axis, so a QLoRA tile must divide each.
        Attention's query/key/value and the MLP's wi_0/wi_1 contract the embedding, attention's out the
        head dimension (its last of heads x head_dim), the MLP's wo the MLP dimension."""
        base = self.architecture[maxtext_model]
        arch = {**base, **{k: v for k, v in overrides.items() if k in base}}
        return {
            "emb_dim": (int(arch["base_emb_dim"]), "query, key, value, wi_0, wi_1"),
            "head_dim": (int(arch["head_dim"]), "out"),
            "mlp_dim": (int(arch["base_mlp_dim"]), "wo"),
        }

    # -------------------------------------------------------------------------------- conversion

    def conversion_config(self, hf_cfg: Any) -> Any:
        """The HF config MaxText's parameter mapping and hooks are given for this checkpoint (as it is,
        unless the family's mapping expects another shape of config)."""
        return hf_cfg

    def stored_name(self, name: str, stored: Collection[str]) -> str:
        """The name under which the checkpoint stores the tensor MaxText's mapping calls ``name``
        (``stored``: every tensor name the checkpoint has); the same unless the family's checkpoints
        come in more than one layout."""
        return name

    # -------------------------------------------------------------------------------- LoRA targets

    def lora_out_shape(self, mpath: tuple[str, ...], mt_config: Any, out_flat: int) -> tuple[int, ...]:
        """The MaxText kernel's output axes for a LoRA module (qwix flattens them row-major into lora_b):
        attention heads x head_dim for query/key/value, flat for out and the MLP's wi_0/wi_1/wo."""
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

    # -------------------------------------------------------------------------------- PEFT export

    def peft_modules(
        self, flat_lora: Mapping[tuple[str, ...], Any], mt_config: Any, hf_config: Any, scale: float
    ) -> tuple[dict[str, tuple[Any, Any]], float]:
        """The PEFT factors of a trained adapter: ``({HF module: (lora_A [r, in], lora_B [out, r])}, max |diff|)``
        (:func:`loraflow.models.peft_layout.peft_modules` with this family's hooks and output axes)."""
        return peft_layout.peft_modules(flat_lora, mt_config, hf_config, scale, self.export_hooks, self.lora_out_shape)
