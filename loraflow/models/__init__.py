"""Model families: what loraflow knows about one architecture, one module of tables per family.

* :mod:`loraflow.models.family`: :class:`ModelFamily`, what a family's tables are and the behaviour
  they drive (dimension check, MaxText overrides, QLoRA's contracted dimensions, LoRA output axes);
* :mod:`loraflow.models.peft_layout`: the PEFT export, the same for every family (MaxText's own
  parameter mapping and MaxText->HF hooks, scanned layers unstacked, every module checked);
* one module per family (``llama.py``, ...): its tables and a ``FAMILY`` built from them, plus a
  subclass of ``ModelFamily`` only where the family truly behaves differently.

:func:`family_for` finds the family of an HF ``model_type`` or a MaxText model name; spec validation
asks it, so nothing here imports a heavy library at module level (numpy, MaxText: inside functions).
Adding a family: docs/architecture.md, "Adding a model family".
"""

from __future__ import annotations

from loraflow.errors import LoraflowError
from loraflow.models import gemma3, llama, qwen3
from loraflow.models.family import ModelFamily

__all__ = ["FAMILIES", "ModelFamily", "UnsupportedModelError", "family_for"]


class UnsupportedModelError(LoraflowError, ValueError):
    """A model of no family loraflow supports (a ValueError too, so the spec schema reports it at its key)."""


FAMILIES: tuple[ModelFamily, ...] = (llama.FAMILY, qwen3.FAMILY, gemma3.FAMILY)


def family_for(name: str) -> ModelFamily:
    """The family of ``name``: an HF config's ``model_type`` or a MaxText model name.

    Raises:
        UnsupportedModelError: no supported family has it; the message names the supported models.
    """
    for family in FAMILIES:
        if name in family.hf_model_types or name in family.maxtext_models:
            return family
    supported = "; ".join(
        f"{f.name} (HF model_type {', '.join(f.hf_model_types)}; MaxText {', '.join(f.maxtext_models)})"
        for f in FAMILIES
    )
    raise UnsupportedModelError(
        f"model {name!r} belongs to no model family loraflow supports: {supported} "
        "(a new family: docs/architecture.md, 'Adding a model family')"
    )
