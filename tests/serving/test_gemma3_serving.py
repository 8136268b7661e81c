"""Gemma 3's sliding-window layers in vLLM, as loraflow's evaluation engine builds it (serving env).

MaxText trains the tiny Gemma 3 with its local layers' 16-token window (sliding_window_size); the
evaluations must score with the same attention. Reference: the independent numpy Gemma 3 forward
(tests/trainer/gemma3_numpy.py: a local layer sees its last ``sliding_window`` positions, a global one
all of them), with the window and without it, on a prompt four windows long; vLLM's prompt log-probs
must be the windowed model's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from loraflow.dev import tinymodel
from loraflow.steps import evaluate
from tests.trainer import gemma3_numpy

CONFIG = {"max_new_tokens": 1, "batch_size": 8, "seed": 0, "max_model_len": 128, "dtype": "float32"}


def _prompt_logprobs(logits: np.ndarray, ids: list[int]) -> np.ndarray:
    """log p(ids[t] | ids[:t]) for t >= 1, from logits (T, vocab)."""
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return np.array([logp[t - 1, ids[t]] for t in range(1, len(ids))])


def test_vllm_applies_gemma3s_sliding_window_as_the_model_defines_it(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from safetensors.numpy import load_file
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    hf = tinymodel.create(tmp_path / "hf", family="gemma3")
    cfg = json.loads((hf / "config.json").read_text())
    weights = load_file(str(hf / "model.safetensors"))
    window = cfg["sliding_window"]
    ids = [1, *np.random.default_rng(0).integers(5, cfg["vocab_size"], 4 * window - 1).tolist()]

    windowed = _prompt_logprobs(gemma3_numpy.forward(cfg, weights, ids), ids)
    unwindowed = _prompt_logprobs(gemma3_numpy.forward({**cfg, "sliding_window": len(ids)}, weights, ids), ids)
    # The window matters on this prompt: only past its first window do the two models differ.
    assert np.abs(windowed - unwindowed)[: window - 1].max() < 1e-9
    assert np.abs(windowed - unwindowed).max() > 0.1

    engine = evaluate.build_engine(hf, evaluate.resolve_config(CONFIG))
    try:
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        (out,) = engine.llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
    finally:
        engine.close()
    got = np.array([step[token].logprob for step, token in zip(out.prompt_logprobs[1:], ids[1:], strict=True)])
    np.testing.assert_allclose(got, windowed, rtol=0, atol=1e-4)


def test_the_multimodal_gemma3_needs_torchvision_which_this_environment_lacks() -> None:
    """docs/architecture.md says so: vLLM's Gemma3ForConditionalGeneration imports transformers' Gemma 3
    image processor, which needs torchvision, and the CPU serving lock leaves torchvision out. When this
    fails, a multimodal Gemma 3 may load here: test it through the evaluation engine and drop the sentence."""
    import importlib
    import importlib.util

    pytest.importorskip("vllm")
    assert importlib.util.find_spec("torchvision") is None
    with pytest.raises(ModuleNotFoundError, match="torchvision"):
        importlib.import_module("vllm.model_executor.models.gemma3_mm")
