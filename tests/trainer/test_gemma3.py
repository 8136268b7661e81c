"""What the Gemma 3 family does beyond the tables (loraflow/models/gemma3.py), on the tiny Gemma 3.

The family's convert -> train -> PEFT export -> merge chain runs in test_trainer_steps.py (parametrised
by family); here: the converted values are Gemma 3's definition (RMSNorm scale 1 + w, the embedding
times sqrt(hidden) as MaxText stores it, the layers in a scanned block of 6 plus a remainder), the
released multimodal key layout converts to the same checkpoint, and the PEFT export unstacks blocks
and remainder into HF layers 6 * block + i, named as the checkpoint's transformers model names them;
the tiny tokenizer carries Gemma's turn tokens as single special tokens and Gemma 3's chat template;
MaxText's forward applies the local layers' sliding window as the independent numpy Gemma 3 does.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytest

pytest.importorskip("maxtext")

from loraflow.dev import tinymodel
from loraflow.models import gemma3

TINY = tinymodel.tiny("gemma3")
PARITY = Path(__file__).resolve().parents[2] / "pipelines" / "data" / "parity"


def _restore(ckpt: Path) -> dict:
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    tree = ocp.PyTreeCheckpointer().restore(str(ckpt / "maxtext" / "0" / "items"))["params"]["params"]
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(v) for path, v in flat}


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny Gemma 3 (text layout) and its MaxText conversion, made once for the module's tests that only
    read them (``hf``, ``text``: the converted checkpoint's folder)."""
    from loraflow.steps import convert_checkpoint

    root = tmp_path_factory.mktemp("gemma3")
    hf = tinymodel.create(root / "hf", family="gemma3")
    convert_checkpoint.convert(hf, root / "text", TINY.maxtext_model, TINY.maxtext_overrides)
    return {"hf": hf, "text": root / "text"}


def _released_layout(text_only: Path, dest: Path, image_rows: int = 0) -> Path:
    """The tiny model as Google releases Gemma 3 12B/27B: a multimodal config whose text_config is the
    language model's, and its tensors under language_model.model.* (no vision tower: MaxText's text
    training never reads it); ``image_rows``: the embedding then has that many more rows, the first the
    image token's, as the released table has 64 past the 262,144 text tokens."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    dest.mkdir()
    for f in text_only.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            (dest / f.name).write_bytes(f.read_bytes())
    text = json.loads((text_only / "config.json").read_text())
    config = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text}
    tensors = load_file(str(text_only / "model.safetensors"))
    if image_rows:
        table = tensors["model.embed_tokens.weight"]
        extra = np.random.default_rng(2).standard_normal((image_rows, table.shape[1])).astype(table.dtype)
        tensors["model.embed_tokens.weight"] = np.concatenate([table, extra])
        config |= {"image_token_index": text["vocab_size"], "mm_tokens_per_image": 4}
        text["vocab_size"] += image_rows
    (dest / "config.json").write_text(json.dumps(config))
    save_file({"language_model." + k: v for k, v in tensors.items()}, str(dest / "model.safetensors"))
    return dest


def test_the_converted_checkpoint_is_gemma3s_definition_in_either_layout(converted: dict, tmp_path: Path) -> None:
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import load_file

    from loraflow.steps import convert_checkpoint

    hf = converted["hf"]
    mt = _restore(converted["text"])
    w = load_file(str(hf / "model.safetensors"))

    assert not any("lm_head" in k or "logits_dense" in k for k in mt)  # tied: the embedding is the output
    root = float(ml_dtypes.bfloat16(math.sqrt(128)))  # MaxText's factor, rounded as its hook rounds it
    np.testing.assert_array_equal(mt["token_embedder/embedding"], w["model.embed_tokens.weight"] * np.float32(root))
    np.testing.assert_allclose(mt["decoder/decoder_norm/scale"], 1 + w["model.norm.weight"], rtol=0, atol=1e-7)
    # HF layer 6 * block + i is the scanned block's layers_i (block on axis 1), layer 6 the remainder's layers_0.
    for layer, prefix, block in [
        (0, "layers/layers_0", 0),
        (5, "layers/layers_5", 0),
        (6, "layers_remainder/layers_0", None),
    ]:

        def at(name: str, prefix: str = prefix, block: int | None = block) -> np.ndarray:
            value = mt[f"decoder/{prefix}/{name}"]
            return value if block is None else np.take(value, block, axis=1)

        p = f"model.layers.{layer}."
        for mt_norm, hf_norm in [
            ("pre_self_attention_norm", "input_layernorm"),
            ("post_self_attention_norm", "post_attention_layernorm"),
            ("pre_ffw_norm", "pre_feedforward_layernorm"),
            ("post_ffw_norm", "post_feedforward_layernorm"),
            ("self_attention/query_norm", "self_attn.q_norm"),
            ("self_attention/key_norm", "self_attn.k_norm"),
        ]:
            np.testing.assert_allclose(at(f"{mt_norm}/scale"), 1 + w[p + hf_norm + ".weight"], rtol=0, atol=1e-7)
        query = w[p + "self_attn.q_proj.weight"].T.reshape(128, 2, 64)  # (emb, heads, head_dim)
        np.testing.assert_array_equal(at("self_attention/query/kernel"), query)
        np.testing.assert_array_equal(at("mlp/wo/kernel"), w[p + "mlp.down_proj.weight"].T)

    released = _released_layout(hf, tmp_path / "released")
    convert_checkpoint.convert(released, tmp_path / "multimodal", TINY.maxtext_model, TINY.maxtext_overrides)
    again = _restore(tmp_path / "multimodal")
    assert again.keys() == mt.keys() and all(np.array_equal(again[k], mt[k]) for k in mt)


def _mt_config(layers: int):
    from maxtext.configs import pyconfig

    from loraflow.trainer.argv import overrides_args

    overrides = {**TINY.maxtext_overrides, "base_num_decoder_layers": layers}
    argv = ["x", *overrides_args(TINY.maxtext_model, overrides), "hardware=cpu", "skip_jax_distributed_system=true"]
    return pyconfig.initialize([*argv, "scan_layers=true", "attention=dot_product"])


@pytest.mark.parametrize("multimodal", [False, True])
def test_the_peft_export_unstacks_blocks_and_remainder_into_hf_layers(multimodal: bool) -> None:
    """13 layers: two scanned blocks of 6 and one remainder layer. The query factors of block k's layers_i
    become HF layer 6k + i's q_proj (lora_A = a^T, lora_B = b^T); the remainder's, layer 12's. A text-only
    model's modules are model.layers.*, a multimodal one's model.language_model.layers.*."""
    import numpy as np
    import transformers

    rng = np.random.default_rng(0)
    rank, blocks = 4, 2
    flat = {}
    for i in range(6):
        path = ("decoder", "layers", f"layers_{i}", "self_attention", "query")
        flat[(*path, "kernel_lora_a", "value")] = rng.standard_normal((128, blocks, rank))
        flat[(*path, "kernel_lora_b", "value")] = rng.standard_normal((rank, blocks, 128))
    remainder = ("decoder", "layers_remainder", "layers_0", "self_attention", "query")
    flat[(*remainder, "kernel_lora_a", "value")] = rng.standard_normal((128, rank))
    flat[(*remainder, "kernel_lora_b", "value")] = rng.standard_normal((rank, 128))

    text = transformers.Gemma3TextConfig(
        **{**tinymodel.hf_config(TINY.dims, family="gemma3"), "num_hidden_layers": 13, "layer_types": None}
    )
    hf_config = transformers.Gemma3Config(text_config=text.to_dict()) if multimodal else text
    modules, err = gemma3.FAMILY.peft_modules(flat, _mt_config(13), hf_config, 2.0)

    prefix = "model.language_model.layers." if multimodal else "model.layers."
    assert sorted(modules) == sorted(f"{prefix}{n}.self_attn.q_proj" for n in range(13)) and err < 1e-5
    for block in range(blocks):
        for i in range(6):
            path = ("decoder", "layers", f"layers_{i}", "self_attention", "query")
            lora_a, lora_b = modules[f"{prefix}{6 * block + i}.self_attn.q_proj"]
            np.testing.assert_allclose(lora_a, flat[(*path, "kernel_lora_a", "value")][:, block, :].T)
            np.testing.assert_allclose(lora_b, flat[(*path, "kernel_lora_b", "value")][:, block, :].T)
    np.testing.assert_allclose(
        modules[f"{prefix}12.self_attn.q_proj"][0], flat[(*remainder, "kernel_lora_a", "value")].T
    )


def test_a_multimodal_adapter_merges_into_the_released_layout(tmp_path: Path) -> None:
    """The PEFT export names a multimodal Gemma 3's modules as transformers does (model.language_model.*),
    while the released checkpoint (and transformers' save_pretrained) stores language_model.model.*: the
    merge finds each stored tensor through the family and writes W + (alpha/r) B A there."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    from loraflow.lora.merge import merge_checkpoint

    released = _released_layout(tinymodel.create(tmp_path / "hf", family="gemma3"), tmp_path / "released")
    base = load_file(str(released / "model.safetensors"))
    rng = np.random.default_rng(1)
    adapter, expected = {}, {}
    for layer in (0, 6):
        module = f"model.language_model.layers.{layer}.self_attn.q_proj"
        a, b = rng.standard_normal((4, 128)).astype(np.float32), rng.standard_normal((128, 4)).astype(np.float32)
        adapter |= {f"base_model.model.{module}.lora_A.weight": a, f"base_model.model.{module}.lora_B.weight": b}
        stored = f"language_model.model.layers.{layer}.self_attn.q_proj.weight"
        expected[stored] = base[stored].astype(np.float64) + 2.0 * (b.astype(np.float64) @ a.astype(np.float64))
    peft = tmp_path / "adapter" / "peft"
    peft.mkdir(parents=True)
    save_file(adapter, str(peft / "adapter_model.safetensors"))
    (peft / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]})
    )
    report = merge_checkpoint(released, tmp_path / "adapter", tmp_path / "merged")
    assert report.merged == report.changed == 2
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert merged.keys() == base.keys()
    for name, want in expected.items():
        np.testing.assert_allclose(merged[name], want, rtol=1e-5, atol=1e-6)


def test_the_tiny_tokenizer_has_gemmas_turn_tokens_and_template(tmp_path: Path) -> None:
    """As a real Gemma 3 tokenizer: <start_of_turn> and <end_of_turn> are single special tokens, so the
    evaluation prompt loraflow renders (the chat cases: a system turn folded into the first user turn,
    multi-turn) holds each marker as one token id, the text is transformers' apply_chat_template's, and
    generation stops at <end_of_turn> (generation_config's eos ids). That training sees these same ids
    before each answer: test_chat_template_training.py (its gemma3 case)."""
    from transformers import AutoTokenizer

    from loraflow.data import chat_template as ct
    from loraflow.evaluation.examples import Example, render_prompts
    from tests import chat_cases

    hf = tinymodel.create(tmp_path / "hf", [PARITY / "train.jsonl"], family="gemma3")
    tok = AutoTokenizer.from_pretrained(str(hf))
    start, end = (tok.convert_tokens_to_ids(t) for t in ("<start_of_turn>", "<end_of_turn>"))
    assert tok.encode("<start_of_turn>user\n", add_special_tokens=False)[0] == start
    assert json.loads((hf / "generation_config.json").read_text())["eos_token_id"] == [tok.eos_token_id, end]
    for role in ("user", "model"):  # whole pieces, as in Gemma's vocabulary
        assert len(tok.encode(role, add_special_tokens=False)) == 1

    template = ct.resolve("auto", hf)
    rows = chat_cases.eval_rows()
    texts, ids = render_prompts(tok, [Example(r["id"], r["messages"], r["reference"]) for r in rows], template)
    for row, text, prompt_ids in zip(rows, texts, ids, strict=True):
        assert text == tok.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=False)
        assert prompt_ids == tok.encode(text, add_special_tokens=False)
        turns = sum(m["role"] != "system" for m in row["messages"])
        assert prompt_ids.count(start) == turns + 1 and prompt_ids.count(end) == turns  # + the model's turn
        assert "start_of_turn" not in tok.decode([i for i in prompt_ids if i not in (start, end)])
    assert "Answer with a number.\n\nWhat is 4+4?" in texts[1]  # the system turn, folded into the user's


def test_maxtexts_forward_applies_the_sliding_window_as_the_model_defines_it(converted: dict, tmp_path: Path) -> None:
    """The converted tiny Gemma 3 in MaxText (as lora_sft trains it: scanned, dot_product attention)
    scores a prompt four windows long as the independent numpy Gemma 3 with its 16-token window does,
    not as the same model without it. vLLM's side: tests/serving/test_gemma3_serving.py."""
    import gemma3_numpy
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax.core.spmd import logical_axis_rules
    from maxtext.configs import pyconfig
    from maxtext.utils import maxtext_utils, model_creation_utils
    from safetensors.numpy import load_file

    from loraflow.steps import convert_checkpoint
    from loraflow.trainer.argv import overrides_args

    hf = converted["hf"]
    cfg, weights = json.loads((hf / "config.json").read_text()), load_file(str(hf / "model.safetensors"))
    window = cfg["sliding_window"]
    ids = [1, *np.random.default_rng(0).integers(5, cfg["vocab_size"], 4 * window - 1).tolist()]

    def logprobs(logits: np.ndarray) -> np.ndarray:  # log p(ids[t] | ids[:t]), t >= 1
        shifted = logits - logits.max(-1, keepdims=True)
        logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
        return logp[np.arange(len(ids) - 1), ids[1:]]

    windowed = logprobs(gemma3_numpy.forward(cfg, weights, ids))
    unwindowed = logprobs(gemma3_numpy.forward({**cfg, "sliding_window": len(ids)}, weights, ids))
    assert np.abs(windowed - unwindowed).max() > 0.5  # the window matters on this prompt

    argv = ["x", *overrides_args(TINY.maxtext_model, TINY.maxtext_overrides), "hardware=cpu"]
    argv += ["skip_jax_distributed_system=true", "scan_layers=true", "attention=dot_product", "dtype=float32"]
    argv += [
        f"max_target_length={len(ids)}",
        f"load_parameters_path={converted['text'] / convert_checkpoint.PARAMS_RELPATH}",
    ]
    argv += ["enable_checkpointing=false", f"base_output_directory={tmp_path / 'run'}", "run_name=forward"]
    config = pyconfig.initialize(argv)
    mesh = maxtext_utils.get_mesh_from_config(config)
    model = model_creation_utils.from_pretrained(config, mesh)
    tokens = jnp.asarray([ids], jnp.int32)
    with jax.set_mesh(mesh), logical_axis_rules(config.logical_axis_rules):
        logits = model(
            decoder_input_tokens=tokens,
            decoder_positions=jnp.arange(len(ids), dtype=jnp.int32)[None],
            decoder_segment_ids=jnp.ones_like(tokens),
            enable_dropout=False,
        )
    got = logprobs(np.asarray(logits[0], np.float64))
    # MaxText's tied output reads a bfloat16 copy of the embedding (the module docstring): ~2e-3 here.
    np.testing.assert_allclose(got, windowed, rtol=0, atol=1e-2)


def test_a_released_multimodal_table_with_image_rows_converts_without_them(tmp_path: Path) -> None:
    """The released multimodal Gemma 3's embedding has 262,208 rows (text_config.vocab_size), MaxText's
    gemma3 models 262,144: the rows past them begin at the image token, and MaxText's conversion drops
    them. The tiny model in that shape (64 rows more, the image token first) converts to the tiny text
    table; a text-only checkpoint with a larger vocabulary is still refused (those rows would be text)."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import load_file

    from loraflow.steps import convert_checkpoint

    hf = tinymodel.create(tmp_path / "hf", family="gemma3")
    released = _released_layout(hf, tmp_path / "released", image_rows=64)
    assert json.loads((released / "config.json").read_text())["text_config"]["vocab_size"] == 576
    convert_checkpoint.convert(released, tmp_path / "mm", TINY.maxtext_model, TINY.maxtext_overrides)
    table = load_file(str(hf / "model.safetensors"))["model.embed_tokens.weight"]
    root = float(ml_dtypes.bfloat16(math.sqrt(128)))
    np.testing.assert_array_equal(_restore(tmp_path / "mm")["token_embedder/embedding"], table * np.float32(root))

    text_only = json.loads((hf / "config.json").read_text()) | {"vocab_size": 576}
    (hf / "config.json").write_text(json.dumps(text_only))
    with pytest.raises(Exception, match="vocab_size=576 vs MaxText vocab_size=512"):
        convert_checkpoint.convert(hf, tmp_path / "text", TINY.maxtext_model, TINY.maxtext_overrides)
