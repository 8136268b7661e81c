"""Model families: what loraflow knows about one architecture, one module per family.

A family module (today only :mod:`loraflow.models.llama`) holds, for its architecture:

* ``NAME``, ``HF_MODEL_TYPES`` (config.json's ``model_type``) and ``MAXTEXT_MODELS`` (MaxText model keys);
* the dimension check of a model config (``check_dims``: the HF checkpoint against MaxText's config)
  and the MaxText overrides that give a model given HF dimensions (``maxtext_overrides``);
* the conversion mapping (MaxText's own parameter-name table and MaxText->HF hooks for the model);
* which MaxText and HF modules a LoRA target is, and the PEFT export layout (``peft_modules``: HF
  names, transposes, scanned layers unstacked, each module checked).

:func:`family_for` finds the family of an HF ``model_type`` or a MaxText model name; spec validation
asks it, so nothing here imports a heavy library at module level (numpy, MaxText: inside functions).
Adding a family: docs/architecture.md, "Adding a model family".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from loraflow.errors import LoraflowError
from loraflow.models import llama


class UnsupportedModelError(LoraflowError, ValueError):
    """A model of no family loraflow supports (a ValueError too, so the spec schema reports it at its key)."""


class ModelFamily(Protocol):
    """What every family module provides (a module satisfies it; mypy checks ``FAMILIES``)."""

    NAME: str
    HF_MODEL_TYPES: tuple[str, ...]
    MAXTEXT_MODELS: tuple[str, ...]
    OVERRIDES: dict[str, str]  # HF config key -> the MaxText override that sets it (the spec's shape keys)

    def check_dims(self, hf_cfg: Any, maxtext_cfg: Any) -> None: ...

    def maxtext_overrides(self, hf_dims: Mapping[str, int]) -> dict[str, int]: ...

    def contracted_dims(self, maxtext_model: str, overrides: Mapping[str, Any]) -> dict[str, tuple[int, str]]: ...

    def peft_modules(
        self, flat_lora: Mapping[tuple[str, ...], Any], mt_config: Any, hf_config: Any, scale: float
    ) -> tuple[dict[str, tuple[Any, Any]], float]: ...


FAMILIES: tuple[ModelFamily, ...] = (llama,)


def family_for(name: str) -> ModelFamily:
    """The family of ``name``: an HF config's ``model_type`` or a MaxText model name.

    Raises:
        UnsupportedModelError: no supported family has it; the message names the supported models.
    """
    for family in FAMILIES:
        if name in family.HF_MODEL_TYPES or name in family.MAXTEXT_MODELS:
            return family
    supported = "; ".join(
        f"{f.NAME} (HF model_type {', '.join(f.HF_MODEL_TYPES)}; MaxText {', '.join(f.MAXTEXT_MODELS)})"
        for f in FAMILIES
    )
    raise UnsupportedModelError(
        f"model {name!r} belongs to no model family loraflow supports: {supported} "
        "(a new family: docs/architecture.md, 'Adding a model family')"
    )
