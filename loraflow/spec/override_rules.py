"""Which MaxText settings a spec may override (``base_model.model_overrides``): the allow-list.

``model_overrides`` become MaxText ``key=value`` arguments of convert_checkpoint and lora_sft. MaxText
has some 790 settings, and most of them are no business of a spec: output and checkpoint folders,
compilation caches and XLA flags, profilers, metrics servers and ports, TensorBoard and cloud
projects, datasets and tokenizers, the run's own name and steps (loraflow sets those from the spec's
sections, or they write and send outside the run). A spec may set the model's shape (each model
family's ``OVERRIDES``: the MaxText keys its Hugging Face dimensions map to) and a few tuning knobs,
each listed in ``ALLOWED`` with the reason a spec author needs it and the values it takes.
``problem(key, value)`` says why an entry is refused; the spec schema calls it for every entry.

Asking for a setting that is not here: docs/security.md, "Asking for a variable, flag or override".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from loraflow import models
from loraflow.errors import excerpt

ASK = "to ask for another, see docs/security.md, 'Asking for a variable, flag or override'"
_KEY = re.compile(r"[a-z][a-z0-9_]{0,63}")


@dataclass(frozen=True)
class Override:
    """A MaxText setting a spec may override: why, and its values (whole numbers within bounds, a
    boolean, or one of ``choices``)."""

    reason: str
    kind: type[int] | type[bool] | type[str]
    minimum: int = 0
    maximum: int = 0
    choices: tuple[str, ...] = ()

    def values(self) -> str:
        if self.kind is bool:
            return "true or false"
        if self.kind is int:
            return f"a whole number from {self.minimum} to {self.maximum}"
        return "one of " + ", ".join(self.choices)

    def takes(self, value: object) -> bool:
        if self.kind is bool or isinstance(value, bool):
            return self.kind is bool and isinstance(value, bool)
        if self.kind is int:
            return isinstance(value, int) and self.minimum <= value <= self.maximum
        return value in self.choices


_MAX_DIM = 2**20  # beyond any dimension, head count, layer count or vocabulary a model family has


def _shape() -> dict[str, Override]:
    """The model families' shape keys: what a checkpoint of other dimensions than MaxText's named
    model (a tiny test model, a pruned one) needs."""
    out: dict[str, Override] = {}
    for family in models.FAMILIES:
        for hf_key, key in family.overrides.items():
            out[key] = Override(
                f"the model's shape: its {hf_key} (loraflow/models/{family.name}.py OVERRIDES)", int, 1, _MAX_DIM
            )
    return out


_SHARDING = "how the model is sharded over the chips"
_SPLASH = "splash attention's block size on TPU (speed against memory)"
_FLOAT32 = "numerics: computes this part in float32 for stability"

ALLOWED: dict[str, Override] = {
    **_shape(),
    "remat_policy": Override(
        "what the backward pass recomputes instead of keeping: memory against speed (training.tuning: auto "
        "chooses it instead)", str,
        choices=("full", "minimal", "save_dot_with_context_except_mlp", "save_dot_except_mlpwi", "save_dot_except_mlp",
                 "save_qkv_proj", "qkv_proj_offloaded", "minimal_offloaded", "save_out_proj"),
    ),
    "attention": Override(
        "the attention kernel (flash on TPU; a CPU run uses dot_product whatever is set)", str,
        choices=("autoselected", "dot_product", "flash", "cudnn_flash_te"),
    ),
    "matmul_precision": Override(
        "precision of matrix multiplications", str, choices=("default", "high", "highest", "bfloat16", "float32")
    ),
    "ici_fsdp_parallelism": Override(f"{_SHARDING} of one slice, fully sharded data parallel (-1: the rest)", int, -1, 2**16),
    "ici_tensor_parallelism": Override(f"{_SHARDING} of one slice, tensor parallel", int, -1, 2**16),
    "ici_data_parallelism": Override(f"{_SHARDING} of one slice, data parallel", int, -1, 2**16),
    "dcn_data_parallelism": Override(f"{_SHARDING} across slices, data parallel (-1: the rest)", int, -1, 2**16),
    "dcn_fsdp_parallelism": Override(f"{_SHARDING} across slices, fully sharded data parallel", int, -1, 2**16),
    "sa_block_q": Override(_SPLASH, int, 1, 2**16),
    "sa_block_kv": Override(_SPLASH, int, 1, 2**16),
    "sa_block_kv_compute": Override(_SPLASH, int, 1, 2**16),
    "float32_logits": Override(f"{_FLOAT32} (attention logits before the softmax)", bool),
    "float32_qk_product": Override(f"{_FLOAT32} (the query-key product)", bool),
    "logits_dot_in_fp32": Override(f"{_FLOAT32} (the output logits)", bool),
}  # fmt: skip


def problem(key: str, value: object) -> str | None:
    """Why a spec may not override MaxText's ``key`` with ``value``, or None."""
    if not _KEY.fullmatch(key):
        return "is not a MaxText setting name (lowercase letters, digits and '_')"
    allowed = ALLOWED.get(key)
    if allowed is None:
        return "is not on the allow-list of MaxText settings a spec may override"
    if not allowed.takes(value):
        return f"the value {excerpt(value)} is not {allowed.values()}"
    return None
