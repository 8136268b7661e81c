"""lora_sft: LoRA supervised fine-tuning with MaxText's ``train_sft`` (Tunix PeftTrainer underneath).

Inputs: ``checkpoint`` (the convert_checkpoint output: Orbax params + loraflow_checkpoint.json),
``dataset`` (``train.jsonl`` of ``{"messages": [...]}`` rows and ``chat_template.json``, the template
validate_data resolved), ``tokenizer`` (the HF checkpoint dir).
Config: :class:`loraflow.spec.step_configs.LoraSftConfig` (defaults the spec's ``lora`` and ``training``).
Outputs: ``adapter/`` (the final LoRA params, Orbax, + ``loraflow_adapter.json``), ``peft/`` (the PEFT
export in HF layout, checked against MaxText's own MaxText->HF weight hooks), ``loss.csv``,
``tensorboard/`` (the same steps' curves as TensorBoard event files, :mod:`loraflow.trainer.curves`) and,
under QLoRA, ``quantized_answers.jsonl``; checkpoints under ``{output}/_checkpoints`` (not committed).

How it trains is the :mod:`loraflow.trainer` package: the examples rendered and ordered (``data``),
MaxText's command line (``argv``), the set-up with loraflow's hooks, LoRA under jit and QLoRA's host
build (``setup``), checkpoints and their persistence (``checkpoints``), a job of several processes
(``distributed``), the outputs (``export``). In a multi-host job only process 0 writes the outputs,
after every process has finished training, and the harness commits the manifest from process 0 only;
the others write no outputs (staged: only their checkpoint parts) and, through JAX's shutdown
barrier, exit when process 0 does. A process of a job that fails exits at once (its threads and that
barrier wait for the others, which wait for it in a collective); the others stop within the heartbeat
timeout (``loraflow.trainer.distributed``).
"""

from __future__ import annotations

import time
from typing import Any

from loraflow.errors import LoraflowError
from loraflow.spec import tuning as tuning_rules
from loraflow.spec.stages import LOSS_CSV
from loraflow.spec.step_configs import LoraSftConfig, parse
from loraflow.steps._harness import StepContext, import_permanently, run_and_exit
from loraflow.trainer.converted import ConvertedModel, read_converted
from loraflow.trainer.curves import training_curves
from loraflow.trainer.data_failure import stopped
from loraflow.trainer.distributed import in_a_job, start_distributed
from loraflow.trainer.export import PeftExport, adapter_meta, export_peft, lora_b_norm, write_adapter
from loraflow.trainer.sft_run import SftRun
from loraflow.trainer.step_log import write_loss_csv
from loraflow.trainer.summary import SftSummary, summarize
from loraflow.trainer.training import Trained, train


def run(ctx: StepContext) -> dict[str, Any]:
    """The step (``loraflow.steps._harness``): the summary its manifest records; nothing on a process
    that does not commit."""
    summary = fine_tune(ctx)
    return summary.to_json() if summary is not None else {}


def fine_tune(ctx: StepContext) -> SftSummary | None:
    """Train the adapter and write the outputs (process 0); None on the other processes of a job."""
    sft = sft_run(ctx)
    ctx.progress("LoRA SFT: " + _settings(sft.cfg, sft.model))
    started = time.monotonic()
    dist = start_distributed(ctx.progress)
    if dist is not None:
        ctx.commits = dist.is_coordinator
    import_permanently("maxtext.configs.pyconfig", "maxtext.trainers.post_train.sft.train_sft")
    with training_curves(ctx.out, writes=ctx.commits) as curves:
        trained = train(sft, dist, curves)
    if trained.final_step < sft.cfg.steps:  # on every process: one that exited 0 here would hide it
        raise stopped(trained.final_step, sft.cfg.steps, trained.data_failure, ctx.progress)
    if not ctx.commits:
        ctx.progress("training done; process 0 writes the outputs and commits them")
        return None
    write_loss_csv(ctx.out / LOSS_CSV, trained.rows)
    if trained.answers is not None:
        trained.answers.write(ctx.out)
    meta = adapter_meta(sft.cfg, sft.model, trained.mt_config, trained.final_step, trained.chat_template)
    params = trained.local_ckpt / str(trained.final_step) / "model_params"
    write_adapter(ctx.out / "adapter", params, trained.lora_tree, meta, dist)
    exported = _export_peft(sft, trained, ctx)
    summary = summarize(trained, sft.cfg.quantization, exported, lora_b_norm(trained.lora_tree), started, dist)
    ctx.progress(f"done: loss {summary.first_loss} -> {summary.final_loss} in {summary.steps} steps")
    return summary


def sft_run(ctx: StepContext) -> SftRun:
    """This attempt: the typed config, the converted checkpoint's model, the inputs and where it writes."""
    cfg = parse(LoraSftConfig, ctx.config)
    _refuse_conflict(cfg, cfg.model_overrides)  # a config sent by hand
    model = read_converted(cfg, ctx.inputs["checkpoint"])
    _refuse_conflict(cfg, model.overrides)  # a checkpoint converted with a remat_policy
    return SftRun(cfg, model, ctx.inputs["dataset"], ctx.inputs["tokenizer"], ctx.output_uri, ctx.work, ctx.progress)


def _refuse_conflict(cfg: LoraSftConfig, overrides: dict[str, Any] | None) -> None:
    """training.tuning: auto beside a remat_policy in MaxText's overrides (the spec refuses it too)."""
    problem = tuning_rules.conflict(cfg.tuning, overrides)
    if problem:
        raise LoraflowError(problem)


def _settings(cfg: LoraSftConfig, model: ConvertedModel) -> str:
    return (
        f"model_name={model.name}, rank={cfg.rank}, alpha={cfg.alpha}, quantization={cfg.quantization}, "
        f"steps={cfg.steps}, batch_size={cfg.batch_size}, learning_rate={cfg.learning_rate}, "
        f"max_length={cfg.max_length}, target_modules={cfg.target_modules}, tuning={cfg.tuning}"
    )


def _export_peft(sft: SftRun, trained: Trained, ctx: StepContext) -> PeftExport:
    """peft/: the adapter in PEFT's HF layout, for the tokenizer input's HF config."""
    import transformers

    hf_config = transformers.AutoConfig.from_pretrained(str(sft.tokenizer))
    exported = export_peft(
        trained.lora_tree, trained.mt_config, hf_config, sft.cfg.rank, sft.cfg.alpha, ctx.out / "peft", sft.model.name
    )
    ctx.progress(
        f"PEFT export: {exported.tensors} tensors for {exported.target_modules}; "
        f"matches MaxText's own MaxText->HF mapping (max |diff| {exported.check_max_abs_diff:.2e})"
    )
    return exported


if __name__ == "__main__":
    # A host of a job that fails leaves at once: its threads and JAX's shutdown barrier would wait for the
    # others, which wait for it in the step's collective; they stop within the heartbeat timeout.
    run_and_exit("lora_sft", run, leave_at_once=in_a_job)
