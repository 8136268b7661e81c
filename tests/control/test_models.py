"""Model families (loraflow/models/): the registry finds a family by HF model_type or MaxText model name,
names the supported ones when it finds none, and spec validation refuses an unsupported model at its key."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import yaml

from loraflow import models
from loraflow.errors import SpecError
from loraflow.models import llama
from loraflow.spec.schema import validate_spec

TINY = Path(__file__).resolve().parents[2] / "pipelines" / "tiny-llama-lora.yaml"


@pytest.mark.parametrize("name", ["llama", "llama3.1-8b", "llama3.1-70b", "llama3.1-8b-Instruct"])
def test_family_for_llama(name: str) -> None:
    assert models.family_for(name) is llama.FAMILY


def test_an_unsupported_model_names_the_supported_ones() -> None:
    with pytest.raises(models.UnsupportedModelError) as err:
        models.family_for("gemma2-2b")
    assert isinstance(err.value, ValueError)
    assert "'gemma2-2b'" in str(err.value) and "llama3.1-8b" in str(err.value) and "model_type llama" in str(err.value)


def test_every_family_is_the_family_of_a_module_of_the_package() -> None:
    import importlib

    for family in models.FAMILIES:
        assert importlib.import_module(f"loraflow.models.{family.name}").FAMILY is family


def test_a_family_without_the_architecture_of_one_of_its_models_is_refused() -> None:
    with pytest.raises(Exception, match=r"no architecture entry for \['llama3.1-70b'\]"):
        models.ModelFamily(
            "x",
            ("x",),
            ("llama3.1-8b", "llama3.1-70b"),
            {},
            {},
            {"llama3.1-8b": llama.ARCHITECTURE["llama3.1-8b"]},
            frozenset(),
        )


def test_spec_validation_refuses_an_unsupported_model() -> None:
    data = yaml.safe_load(TINY.read_text())
    data["base_model"]["maxtext_model"] = "gemma2-2b"
    with pytest.raises(SpecError) as err:
        validate_spec(data, "other.yaml")
    assert [p for p, _ in err.value.problems] == ["base_model.maxtext_model"]
    assert "llama3.1-8b" in str(err.value)


def test_the_tiny_specs_overrides_are_the_familys_for_the_tiny_dimensions() -> None:
    from loraflow.dev import tinymodel

    spec = yaml.safe_load(TINY.read_text())
    assert llama.FAMILY.maxtext_overrides(tinymodel.DIMS) == spec["base_model"]["model_overrides"]
    assert tinymodel.MAXTEXT_OVERRIDES == spec["base_model"]["model_overrides"]
    assert set(llama.FAMILY.overrides) == set(llama.FAMILY.dims)


def test_check_dims_names_every_disagreement() -> None:
    hf = types.SimpleNamespace(hidden_size=128, num_attention_heads=2, vocab_size=512)
    mt = types.SimpleNamespace(emb_dim=128, num_query_heads=4, vocab_size=256)
    with pytest.raises(Exception, match=r"num_attention_heads=2 vs MaxText num_query_heads=4; vocab_size=512"):
        llama.FAMILY.check_dims(hf, mt)
    llama.FAMILY.check_dims(hf, types.SimpleNamespace(emb_dim=128))  # what either side lacks is not compared
