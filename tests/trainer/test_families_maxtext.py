"""The model families' tables held to the installed MaxText: every MaxText model a family lists has
MaxText's HF id, parameter mapping and hooks (what convert_checkpoint and the PEFT export call), and its
``ARCHITECTURE`` row is its ``configs/models/<name>.yml``; and Mistral, which docs/architecture.md says
MaxText's converter cannot convert, is still not convertible and still refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from loraflow import models

MODELS = [(family, name) for family in models.FAMILIES for name in family.maxtext_models]


def _maxtext_config(name: str) -> dict:
    """configs/models/<name>.yml (an -Instruct model's is its base model's, as MaxText's pyconfig reads it)."""
    from maxtext.utils.globals import MAXTEXT_CONFIGS_DIR  # type: ignore[attr-defined]

    base = name.replace("-Instruct", "")
    return yaml.safe_load((Path(MAXTEXT_CONFIGS_DIR) / "models" / f"{base}.yml").read_text())


@pytest.mark.parametrize(("family", "name"), MODELS, ids=[name for _, name in MODELS])
def test_a_familys_maxtext_model_is_one_maxtexts_converter_maps(family: models.ModelFamily, name: str) -> None:
    from maxtext.checkpoint_conversion.utils.param_mapping import HOOK_FNS, PARAM_MAPPING
    from maxtext.utils.globals import HF_IDS

    assert name in HF_IDS and name in PARAM_MAPPING and name in HOOK_FNS
    assert family.architecture[name] == {k: _maxtext_config(name)[k] for k in family.architecture[name]}


def test_maxtext_cannot_convert_mistral_so_it_is_no_family() -> None:
    """MaxText 0.2.5 knows the model ``mistral-7b`` (its config and HF id) but its converter (to_maxtext,
    to_huggingface, and the mapping the PEFT export reads) has no entry for it: converting a Mistral
    checkpoint fails with KeyError 'mistral-7b' at PARAM_MAPPING. When this fails, MaxText converts
    Mistral: add the family (docs/architecture.md, "Adding a model family") and drop the docs' sentence."""
    from maxtext.checkpoint_conversion.utils import hf_model_configs, hf_shape, param_mapping
    from maxtext.utils.globals import HF_IDS

    assert "mistral-7b" in HF_IDS and _maxtext_config("mistral-7b")["decoder_block"] == "mistral"
    tables = {
        "param_mapping.PARAM_MAPPING": param_mapping.PARAM_MAPPING,
        "param_mapping.HOOK_FNS": param_mapping.HOOK_FNS,
        "hf_model_configs.HF_MODEL_CONFIGS": hf_model_configs.HF_MODEL_CONFIGS,
        "hf_shape.HF_SHAPE": hf_shape.HF_SHAPE,
    }
    assert {where: [k for k in table if k.startswith("mistral")] for where, table in tables.items()} == {
        where: [] for where in tables
    }
    for name in ("mistral-7b", "mistral"):  # the MaxText model, the HF model_type
        with pytest.raises(models.UnsupportedModelError):
            models.family_for(name)
