"""Model families (loraflow/models/): the registry finds a family by HF model_type or MaxText model name,
names the supported ones when it finds none, and spec validation refuses an unsupported model at its key."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import yaml

from loraflow import models
from loraflow.errors import SpecError
from loraflow.models import gemma3, llama, qwen3
from loraflow.spec.schema import validate_spec

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"
TINY = PIPELINES / "tiny-llama-lora.yaml"


@pytest.mark.parametrize(
    ("family", "names"),
    [
        (llama.FAMILY, ["llama", "llama3.1-8b", "llama3.1-70b", "llama3.1-8b-Instruct"]),
        (qwen3.FAMILY, ["qwen3", "qwen3-0.6b", "qwen3-8b", "qwen3-32b"]),
        (gemma3.FAMILY, ["gemma3_text", "gemma3", "gemma3-4b", "gemma3-12b", "gemma3-27b"]),
    ],
)
def test_family_for(family: models.ModelFamily, names: list[str]) -> None:
    assert all(models.family_for(name) is family for name in names)


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


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_the_tiny_specs_overrides_are_the_familys_for_the_tiny_dimensions(family: str) -> None:
    from loraflow.dev import tinymodel

    spec = yaml.safe_load((PIPELINES / f"tiny-{family}-lora.yaml").read_text())["base_model"]
    entry = tinymodel.tiny(family)
    assert (spec["maxtext_model"], spec["model_overrides"]) == (entry.maxtext_model, entry.maxtext_overrides)
    assert set(entry.family.overrides) <= set(entry.family.dims)
    if family == "llama":
        assert tinymodel.MAXTEXT_OVERRIDES == spec["model_overrides"]


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


# A Gemma 3 text config as the HF checkpoint's config.json gives it (only what the checks read).
GEMMA3_TEXT = {
    "hidden_size": 128,
    "num_attention_heads": 2,
    "head_dim": 64,
    "sliding_window": 16,
    "query_pre_attn_scalar": 64,
    "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
}
# ... and MaxText's gemma3-4b with the tiny overrides.
GEMMA3_MAXTEXT = {
    "model_name": "gemma3-4b",
    "emb_dim": 128,
    "num_query_heads": 2,
    "head_dim": 64,
    "sliding_window_size": 16,
    "rope_max_timescale": 1000000,
    "local_rope_max_timescale": 10000,
    "rope_linear_scaling_factor": 8.0,
}


@pytest.mark.parametrize("multimodal", [False, True])
def test_gemma3_checks_the_language_models_config_of_either_shape(multimodal: bool) -> None:
    """A text-only checkpoint's config is flat, a multimodal one's language model is its text_config."""
    text = types.SimpleNamespace(**GEMMA3_TEXT)
    hf = types.SimpleNamespace(text_config=text, vision_config=None) if multimodal else text
    gemma3.FAMILY.check_dims(hf, types.SimpleNamespace(**GEMMA3_MAXTEXT))
    text.sliding_window = 1024
    with pytest.raises(Exception, match=r"sliding_window=1024 vs MaxText sliding_window_size=16"):
        gemma3.FAMILY.check_dims(hf, types.SimpleNamespace(**GEMMA3_MAXTEXT))


def test_gemma3_refuses_a_query_scale_or_rope_the_maxtext_model_does_not_have() -> None:
    """MaxText derives the query scale from the model name (head_dim ** -0.5 for 4b/12b, (emb/heads) ** -0.5
    for 27b), not from the checkpoint: a 27b-style scalar on gemma3-12b, or another RoPE, would train a
    model that computes something else than the checkpoint. Every problem is named at once."""
    hf = types.SimpleNamespace(**{**GEMMA3_TEXT, "query_pre_attn_scalar": 168})
    rope = dict(GEMMA3_TEXT["rope_parameters"], sliding_attention={"rope_type": "default", "rope_theta": 20000.0})
    hf.rope_parameters = rope
    with pytest.raises(Exception) as err:
        gemma3.FAMILY.check_dims(hf, types.SimpleNamespace(**GEMMA3_MAXTEXT))
    message = str(err.value)
    assert "query_pre_attn_scalar=168 vs MaxText gemma3-4b's query scale 0.125" in message
    assert "rope_parameters.sliding_attention.rope_theta=20000 vs MaxText local_rope_max_timescale=10000" in message
    # gemma3-27b scales by (emb_dim / heads) ** -0.5: 168 for 5376 / 32
    big = {**GEMMA3_MAXTEXT, "model_name": "gemma3-27b", "emb_dim": 5376, "num_query_heads": 32, "head_dim": 128}
    gemma3.FAMILY.check_dims(types.SimpleNamespace(query_pre_attn_scalar=168), types.SimpleNamespace(**big))


@pytest.mark.parametrize(
    ("stored", "expected"),
    [
        ("model.layers.3.mlp.up_proj.weight", "model.layers.3.mlp.up_proj.weight"),  # text only
        ("language_model.model.layers.3.mlp.up_proj.weight", "language_model.model.layers.3.mlp.up_proj.weight"),
        ("model.language_model.layers.3.mlp.up_proj.weight", "model.language_model.layers.3.mlp.up_proj.weight"),
    ],
)
def test_gemma3_reads_each_checkpoint_layout_under_its_own_names(stored: str, expected: str) -> None:
    """MaxText's mapping names the language model model.language_model.*; a text-only checkpoint stores it
    as model.*, Google's released multimodal ones as language_model.model.*."""
    names = {stored, "model.vision_tower.vision_model.post_layernorm.weight"}
    assert gemma3.FAMILY.stored_name("model.language_model.layers.3.mlp.up_proj.weight", names) == expected
    assert gemma3.FAMILY.stored_name("model.vision_tower.vision_model.post_layernorm.weight", names).startswith(
        "model.vision_tower"
    )
    assert llama.FAMILY.stored_name("model.language_model.x", {"model.x"}) == "model.language_model.x"


def test_the_gemma3_12b_spec_validates_and_a_qlora_tile_must_fit_the_gemma3_size() -> None:
    """gemma3-12b's contracted dimensions (3840, 256, 15360) take a tile of 256; gemma3-27b's head_dim is
    128, so the same tile is refused there with one that fits."""
    data = yaml.safe_load((PIPELINES / "gemma3-12b-lora.yaml").read_text())
    assert validate_spec(data, "gemma3-12b-lora.yaml").base_model.maxtext_model == "gemma3-12b"
    data["lora"].update(quantization="nf4", tile_size=256)
    validate_spec(data, "gemma3-12b-lora.yaml")
    data["base_model"]["maxtext_model"] = "gemma3-27b"
    with pytest.raises(SpecError, match=r"but not head_dim 128 \(out\); set lora.tile_size to .* e\.g\. 128"):
        validate_spec(data, "gemma3-12b-lora.yaml")


def test_gemma3_lets_a_multimodal_table_through_only_by_its_image_rows() -> None:
    """Released multimodal Gemma 3: text_config.vocab_size 262,208, image token 262,144, MaxText's vocab
    262,144 (its conversion drops the rows from the image token on). Rows past MaxText's that begin below
    the image token, or a text-only checkpoint's, would be text: refused."""
    maxtext = types.SimpleNamespace(**GEMMA3_MAXTEXT, vocab_size=262144)

    def multimodal(vocab: int, image: int) -> types.SimpleNamespace:
        text = types.SimpleNamespace(**GEMMA3_TEXT, vocab_size=vocab)
        return types.SimpleNamespace(text_config=text, image_token_index=image)

    gemma3.FAMILY.check_dims(multimodal(262208, 262144), maxtext)
    for hf in (multimodal(262208, 262000), types.SimpleNamespace(**GEMMA3_TEXT, vocab_size=262208)):
        with pytest.raises(Exception, match="vocab_size=262208 vs MaxText vocab_size=262144"):
            gemma3.FAMILY.check_dims(hf, maxtext)
    with pytest.raises(Exception, match="vocab_size=262000 vs MaxText vocab_size=262144"):
        gemma3.FAMILY.check_dims(multimodal(262000, 262144), maxtext)  # fewer rows than MaxText's
