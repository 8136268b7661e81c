"""merge_adapter: a Hugging Face base checkpoint + the LoRA adapter of lora_sft -> a merged HF checkpoint.

Inputs: ``base`` (HF checkpoint directory: config.json, tokenizer, ``model*.safetensors``) and
``adapter`` (the lora_sft artifact; its PEFT export, ``adapter_model.safetensors`` +
``adapter_config.json``, lies in ``peft/``). Config (``loraflow.spec.step_configs.MergeAdapterConfig``):
``{"shard_size_mb": 500}``, fixed by loraflow (the largest shard of the merged checkpoint).

Output: a checkpoint transformers and vLLM load as is: ``model.safetensors`` or
``model-0000x-of-0000y.safetensors`` + ``model.safetensors.index.json``, plus every non-weight file
of the base. The merge streams one tensor at a time (``loraflow.lora.merge``): memory stays around the
largest adapted tensor, whatever the model size. Needs numpy (+ ml_dtypes for bf16 weights); runs
on the native kernel (``loraflow/lora/native``, built by ``make envs`` and the trainer image) where it
is built, else on numpy (same arithmetic), and says which in the log.
Fails (NoOpMergeError) when no stored weight changed: an adapter that did nothing is never passed on.
"""

from __future__ import annotations

import time
from typing import Any

from loraflow.errors import LoraflowError
from loraflow.lora.merge import MergeReport, find_adapter, merge_checkpoint
from loraflow.spec.step_configs import MergeAdapterConfig, parse
from loraflow.steps._harness import StepContext, run_and_exit


class NoOpMergeError(LoraflowError):
    """The merged checkpoint equals the base: the adapter changed no stored weight."""


def run(ctx: StepContext) -> dict[str, Any]:
    base, adapter = ctx.inputs.get("base"), ctx.inputs.get("adapter")
    if base is None or adapter is None:
        raise LoraflowError(f"merge_adapter needs inputs base and adapter, got {sorted(ctx.inputs)}")
    shard_mb = parse(MergeAdapterConfig, ctx.config).shard_size_mb
    weights, _ = find_adapter(adapter)
    ctx.progress(f"merging {weights.relative_to(adapter)} into {base.name} (shards <= {shard_mb} MiB)")
    started = time.monotonic()
    report = merge_checkpoint(base, adapter, ctx.out, int(shard_mb * 1024 * 1024), ctx.progress)
    check_changed(report)
    return {**report.summary(), "merge_seconds": round(time.monotonic() - started, 2), **_adapter_steps(ctx)}


def _adapter_steps(ctx: StepContext) -> dict[str, int]:
    """The adapter's training steps (lora_sft's manifest records them), for the evaluation's curves; none
    for an adapter without a lora_sft manifest."""
    manifest = ctx.input_manifests.get("adapter")
    steps = manifest.summary.get("steps") if manifest is not None else None
    return {"adapter_steps": int(steps)} if isinstance(steps, int) else {}


def check_changed(report: MergeReport) -> None:
    """Refuse a merge whose weights equal the base bit for bit: the adapter did nothing.

    Promoting such a model would publish the base model under a new name; evaluating it would
    spend serving time to learn what is already known. Fail here, with what to look at.
    """
    if report.changed == 0:
        example = f" (e.g. {report.unchanged_targets[0]})" if report.unchanged_targets else ""
        raise NoOpMergeError(
            f"merge_adapter: the merged weights equal the base weights bit for bit: {report.merged} tensor(s) got a "
            f"LoRA update{example} and none changed (largest update {report.max_delta:.3g}). The adapter did "
            "nothing, so this run stops here. Check lora_sft: the learning rate (training.learning_rate), the "
            "number of steps (training.steps), that lora.target_modules names modules of this model, and the "
            "LoRA rank/alpha (an update below the weights' dtype resolution rounds away)"
        )


if __name__ == "__main__":
    run_and_exit("merge_adapter", run)
