"""merge_adapter: a Hugging Face base checkpoint + the LoRA adapter of lora_sft -> a merged HF checkpoint.

Inputs: ``base`` (HF checkpoint directory: config.json, tokenizer, ``model*.safetensors``) and
``adapter`` (the lora_sft artifact; its PEFT export, ``adapter_model.safetensors`` +
``adapter_config.json``, lies in ``peft/``). Config: ``{"shard_size_mb": 500}``.

Output: a checkpoint transformers and vLLM load as is: ``model.safetensors`` or
``model-0000x-of-0000y.safetensors`` + ``model.safetensors.index.json``, plus every non-weight file
of the base. The merge streams one tensor at a time (``loraflow.merge``): memory stays around the
largest adapted tensor, whatever the model size. Needs numpy (+ ml_dtypes for bf16 weights) only.
"""

from __future__ import annotations

import time
from typing import Any

from loraflow.errors import LoraflowError
from loraflow.merge import find_adapter, merge_checkpoint
from loraflow.steps._harness import StepContext, run_step


def run(ctx: StepContext) -> dict[str, Any]:
    base, adapter = ctx.inputs.get("base"), ctx.inputs.get("adapter")
    if base is None or adapter is None:
        raise LoraflowError(f"merge_adapter needs inputs base and adapter, got {sorted(ctx.inputs)}")
    shard_mb = ctx.config.get("shard_size_mb", 500)
    if not isinstance(shard_mb, (int, float)) or isinstance(shard_mb, bool) or shard_mb <= 0:
        raise LoraflowError(f"shard_size_mb must be a positive number of MiB, got {shard_mb!r}")
    weights, _ = find_adapter(adapter)
    ctx.progress(f"merging {weights.relative_to(adapter)} into {base.name} (shards <= {shard_mb} MiB)")
    started = time.monotonic()
    report = merge_checkpoint(base, adapter, ctx.out, int(shard_mb * 1024 * 1024), ctx.progress)
    return {**report.summary(), "merge_seconds": round(time.monotonic() - started, 2)}


if __name__ == "__main__":
    raise SystemExit(run_step("merge_adapter", run))
