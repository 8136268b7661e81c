"""The merged checkpoint computes what base + LoRA computes (serving env: torch + transformers), for
each model family's tiny model (loraflow.dev.tinymodel.FAMILIES: its real HF architecture).

Reference: the tiny base loaded by transformers, with forward hooks adding the LoRA path
``scale · x Aᵀ Bᵀ`` to every target Linear's output (the definition of LoRA, independent of any
merge). Candidate: the checkpoint ``loraflow.lora.merge`` wrote, loaded by transformers from its shards.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from loraflow.dev import tinymodel
from loraflow.lora import merge_kernel
from loraflow.lora import merge_numerics as contract
from loraflow.lora.merge import merge_checkpoint

REPO = Path(__file__).resolve().parents[2]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA = 4, 8.0


@pytest.fixture(scope="module", params=list(tinymodel.FAMILIES))
def base(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    corpus = REPO / "pipelines/data/parity/train.jsonl"
    dest = tmp_path_factory.mktemp(f"base-{request.param}")
    return tinymodel.create(dest, [corpus] if corpus.exists() else [], family=request.param)


def targeted(base: Path) -> int:
    """How many modules TARGETS names in the model: 7 per layer."""
    return len(TARGETS) * json.loads((base / "config.json").read_text())["num_hidden_layers"]


def load(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager")
    return model.eval()


@pytest.mark.parametrize("use_rslora", [False, True])
def test_merged_logits_equal_base_plus_lora(base: Path, tmp_path: Path, use_rslora: bool) -> None:
    model = load(base)
    gen = torch.Generator().manual_seed(0)
    adapter: dict[str, torch.Tensor] = {}
    hooks = []
    scale = ALPHA / (RANK**0.5 if use_rslora else RANK)
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or name.rsplit(".", 1)[-1] not in TARGETS:
            continue
        a = torch.randn(RANK, module.in_features, generator=gen) * 0.1
        b = torch.randn(module.out_features, RANK, generator=gen) * 0.05
        adapter[f"base_model.model.{name}.lora_A.weight"] = a
        adapter[f"base_model.model.{name}.lora_B.weight"] = b

        def add_lora(_mod, inputs, output, a=a, b=b):
            return output + scale * (inputs[0] @ a.T @ b.T)

        hooks.append(module.register_forward_hook(add_lora))
    assert len(hooks) == targeted(base)

    peft = tmp_path / "adapter" / "peft"
    peft.mkdir(parents=True)
    save_file(adapter, str(peft / "adapter_model.safetensors"))
    (peft / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "target_modules": TARGETS,
                    "use_rslora": use_rslora})
    )  # fmt: skip
    report = merge_checkpoint(base, tmp_path / "adapter", tmp_path / "merged", shard_bytes=400_000)
    assert report.merged == report.changed == targeted(base) and len(report.files) > 1  # sharded + index

    ids = torch.randint(6, 512, (2, 24), generator=gen)
    with torch.no_grad():
        reference = model(ids).logits
        for h in hooks:
            h.remove()
        base_logits = model(ids).logits
        merged_logits = load(tmp_path / "merged")(ids).logits

    assert (reference - base_logits).abs().max() > 1e-2, (
        "the adapter must move the logits for the test to mean anything"
    )
    torch.testing.assert_close(merged_logits, reference, atol=1e-5, rtol=1e-5)


def test_a_naive_torch_merge_agrees_with_loraflow_within_the_contract(base: Path, tmp_path: Path) -> None:
    """torch's own ``W + scale * B @ A`` (its BLAS, its summation order) lies within the merge
    contract's bound of the exact reference, and loraflow's merged tensors are that reference
    itself where the native kernel runs (docs/architecture.md, "The merge's numerics")."""
    from safetensors.torch import load_file

    weights = load_file(str(base / "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    adapter = {}
    for name, w in weights.items():
        if name.removesuffix(".weight").rsplit(".", 1)[-1] in TARGETS:
            key = "base_model.model." + name.removesuffix(".weight")
            adapter[f"{key}.lora_A.weight"] = torch.randn(16, w.shape[1], generator=gen) * 0.1
            adapter[f"{key}.lora_B.weight"] = torch.randn(w.shape[0], 16, generator=gen) * 0.05
    peft = tmp_path / "adapter" / "peft"
    peft.mkdir(parents=True)
    save_file(adapter, str(peft / "adapter_model.safetensors"))
    (peft / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 16, "lora_alpha": 32, "target_modules": TARGETS})
    )
    merge_checkpoint(base, tmp_path / "adapter", tmp_path / "merged", shard_bytes=1 << 30)
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    checked = 0
    for name, w in weights.items():
        key = "base_model.model." + name.removesuffix(".weight")
        if f"{key}.lora_A.weight" not in adapter:
            continue
        a, b = adapter[f"{key}.lora_A.weight"], adapter[f"{key}.lora_B.weight"]
        naive = (w.float() + 2.0 * (b @ a)).to(w.dtype)
        w_np, a_np, b_np = w.numpy(), a.numpy(), b.numpy()
        lo, hi = contract.merge_bounds(w_np, a_np, b_np, 2.0)
        inside = contract.within(naive.numpy(), lo, hi)
        assert inside.all(), f"{name}: {int((~inside).sum())} element(s) of torch's merge outside the bound"
        if merge_kernel.usable(w_np.dtype):
            exact = contract.exact_merge(w_np, a_np, b_np, 2.0)
            assert contract.agreement(merged[name].numpy(), exact)["differing"] == 0, name
        else:
            assert contract.within(merged[name].numpy(), lo, hi).all(), name
        checked += 1
    assert checked == targeted(base)


def test_vllm_serves_the_peft_adapter_as_it_serves_the_merged_checkpoint(base: Path, tmp_path: Path) -> None:
    """vLLM loads the family's merged checkpoint, and its base with the PEFT adapter applied by vLLM's
    own LoRA layers (a LoRARequest): greedy generations agree token for token, and differ from the base's."""
    import os

    from safetensors.torch import load_file
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from loraflow.steps import evaluate

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # an in-process engine core, as evaluate runs it

    gen = torch.Generator().manual_seed(2)
    adapter = {}
    for name, w in load_file(str(base / "model.safetensors")).items():
        if name.removesuffix(".weight").rsplit(".", 1)[-1] in TARGETS:
            key = "base_model.model." + name.removesuffix(".weight")
            adapter[f"{key}.lora_A.weight"] = torch.randn(RANK, w.shape[1], generator=gen) * 0.3
            adapter[f"{key}.lora_B.weight"] = torch.randn(w.shape[0], RANK, generator=gen) * 0.3
    peft = tmp_path / "adapter" / "peft"
    peft.mkdir(parents=True)
    save_file(adapter, str(peft / "adapter_model.safetensors"))
    (peft / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "target_modules": TARGETS})
    )
    merge_checkpoint(base, tmp_path / "adapter", tmp_path / "merged")

    tok = AutoTokenizer.from_pretrained(str(base))
    rows = [json.loads(line) for line in (REPO / "pipelines/data/parity/eval.jsonl").read_text().splitlines()[:4]]
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, tokenize=False)
        for r in rows
    ]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    config = evaluate.resolve_config({"max_model_len": 128, "batch_size": 4, "dtype": "float32"})

    def generate(model_dir: Path, lora: LoRARequest | None = None, **engine: object) -> list[list[int]]:
        llm = LLM(**{**evaluate.engine_kwargs(model_dir, config, cpu=True), **engine})
        try:
            out = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, lora_request=lora)]
            if lora is not None:  # the same engine without the adapter: the base model
                return [*out, *([list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)])]
            return out
        finally:
            del llm

    merged = generate(tmp_path / "merged")
    with_adapter = generate(
        base, LoRARequest("adapter", 1, str(peft)), enable_lora=True, max_lora_rank=8
    )  # vLLM takes 8, 16, ...: >= RANK
    served, plain = with_adapter[: len(prompts)], with_adapter[len(prompts) :]
    assert served == merged
    assert plain != merged, "the adapter must change the generations for the test to mean anything"
