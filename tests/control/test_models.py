"""Model families (loraflow/models/): the registry finds a family by HF model_type or MaxText model name,
names the supported ones when it finds none, and spec validation refuses an unsupported model at its key."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import yaml

from loraflow import models
from loraflow.errors import SpecError
from loraflow.models import llama, qwen3
from loraflow.spec.schema import validate_spec

TINY = Path(__file__).resolve().parents[2] / "pipelines" / "tiny-llama-lora.yaml"


@pytest.mark.parametrize("name", ["llama", "llama3.1-8b", "llama3.1-70b", "llama3.1-8b-Instruct"])
def test_family_for_llama(name: str) -> None:
    assert models.family_for(name) is llama.FAMILY


@pytest.mark.parametrize("name", ["qwen3", "qwen3-0.6b", "qwen3-8b", "qwen3-32b"])
def test_family_for_qwen3(name: str) -> None:
    assert models.family_for(name) is qwen3.FAMILY


def test_qwen3_moe_sizes_are_no_supported_model() -> None:
    """Their experts are no LoRA target MaxText maps: refused at validation, not after training."""
    with pytest.raises(models.UnsupportedModelError, match="qwen3-8b"):
        models.family_for("qwen3-30b-a3b")


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


@pytest.mark.parametrize(("tied", "via_embedding"), [(True, False), (False, True)])
def test_check_dims_refuses_a_tied_checkpoint_for_an_untied_maxtext_model_and_back(tied: bool, via_embedding: bool):
    """Qwen3-0.6B/4B tie lm_head to the embedding, 8B and larger do not: a checkpoint converted as the
    other kind would lack lm_head.weight, or carry one MaxText never reads."""
    hf = types.SimpleNamespace(hidden_size=128, tie_word_embeddings=tied)
    mt = types.SimpleNamespace(emb_dim=128, logits_via_embedding=via_embedding)
    with pytest.raises(Exception, match=rf"tie_word_embeddings={tied} vs MaxText logits_via_embedding={via_embedding}"):
        qwen3.FAMILY.check_dims(hf, mt)
    qwen3.FAMILY.check_dims(hf, types.SimpleNamespace(emb_dim=128, logits_via_embedding=tied))


def test_every_familys_tiny_model_is_of_its_family_and_its_overrides_are_allowed() -> None:
    from loraflow.dev import tinymodel
    from loraflow.spec import override_rules

    for name, entry in tinymodel.FAMILIES.items():
        assert models.family_for(name) is entry.family
        assert entry.maxtext_model in entry.family.maxtext_models
        config = tinymodel.hf_config(entry.dims, family=name)
        assert models.family_for(str(config["model_type"])) is entry.family
        assert set(entry.maxtext_overrides) <= set(override_rules.ALLOWED)
        assert ("lm_head.weight" in tinymodel.weight_shapes(entry.dims, name)) is not entry.tied_embeddings
