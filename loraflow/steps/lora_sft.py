"""lora_sft: LoRA supervised fine-tuning with MaxText's ``train_sft`` (Tunix PeftTrainer underneath).

Inputs: ``checkpoint`` (the convert_checkpoint output: Orbax params + loraflow_checkpoint.json),
``dataset`` (``train.jsonl`` of ``{"messages": [...]}`` rows and ``chat_template.json``, the template
validate_data resolved), ``tokenizer`` (the HF checkpoint dir).
Config (``loraflow.spec.step_configs.LoraSftConfig``; defaults the spec's ``lora`` and ``training``):
model_name, model_overrides (null: the converted checkpoint's), rank, alpha, target_modules (regexes
or null = MaxText's default for the model), steps, batch_size (global, packed rows), learning_rate,
max_length, seed, checkpoint_period, dtype, checkpoint_storage ("staged"|"direct"); internal:
warmup_fraction, hardware, log_every, packing, shuffle.

MaxText's own setup (``train_sft.setup_trainer_state``) runs in-process; loraflow adds:

* the prompts: loraflow renders every example with the dataset's chat template
  (``loraflow.data.chat_template``, the renderer evaluation uses) into prompt and answer pieces and
  hands MaxText the pieces with a template that writes them as they are, so MaxText tokenizes
  exactly the text evaluation prompts with and trains on the answer pieces only
  (``_render_training_file``); the adapter's ``loraflow_adapter.json`` and the summary name the template;
* LoRA applied under ``jax.jit`` (``loraflow.trainer.lora_apply``): MaxText's eager application copies the frozen
  layer stack once more, which alone stops a 3B model fitting one 16 GiB chip;
* QLoRA's model built in host memory (``loraflow.trainer.host_build``, on one chip): the checkpoint restored and the
  targeted kernels quantized on the host's CPU, so the accelerator never holds the full-precision
  model (MaxText's set-up does, which alone stops an 8B nf4 model fitting one 16 GiB chip);
* a training hook that prints ``step N loss L tokens/s T`` lines (flushed: the Airflow log is live)
  and writes ``loss.csv``;
* checkpoint persistence, ``checkpoint_storage: staged`` (the default): Orbax/Tunix saves every
  ``checkpoint_period`` steps into a directory on the host's own disk, and the newest committed step
  is downloaded before the trainer starts, so a restarted run - on new hosts - resumes from it (Tunix
  restores the LoRA params, optimizer state and step; we skip the batches already trained on). One
  host: each finalised step is copied to ``{output}/_checkpoints/<step>/`` (outside the committed
  files), the completion marker last. Several hosts: every host's Orbax is a primary of its own
  directory and writes the metadata and every shard it holds, replicated ones included
  (``_per_host_checkpoint_manager``), so that directory alone restores that host; each host uploads
  its part to ``{output}/_checkpoints/<step>/host-<i>/`` (its ``_LORAFLOW_HOST.json`` last); at each
  training step the hosts agree (a collective) which step all have uploaded, and process 0 commits
  it once (``<step>/_LORAFLOW_COMPLETE.json``, listing every host's files); a resume downloads each
  host's own part of the newest committed step, and needs the same number of hosts
  (``loraflow.pipeline.checkpoint_sync``).
  ``checkpoint_storage: direct`` instead points MaxText's base_output_directory at that gs:// prefix:
  Orbax writes it itself (tensorstore's GCS driver, every host its own shards, process 0 the metadata
  and ``commit_success.txt`` last) and restores the newest committed step from it;
* outputs: ``adapter/`` (the final LoRA params, Orbax, + ``loraflow_adapter.json``), ``peft/`` (the
  PEFT export in HF layout, checked against MaxText's own MaxText->HF weight hooks) and ``loss.csv``.

Multi-host: when ``loraflow.launchers.multihost`` finds a job of several processes (a Vertex AI worker pool, a
GKE JobSet, or N local processes on loopback), every process calls ``jax.distributed.initialize``
with its wiring before JAX starts; MaxText's mesh then spans every process's devices (parameters
sharded across hosts, each host loading its share of every batch). Hosts share no disk: each writes
its checkpoints to its own disk and uploads its own part (``staged``), or Orbax writes them to GCS
(``direct``).
Only process 0 commits checkpoints and writes the outputs; it writes them after every process has
finished training, and the harness commits the manifest from process 0 only. The other
processes write no outputs (staged: only their checkpoint parts) and, through JAX's shutdown
barrier, exit when process 0 does.
Internal configs ``packing`` (default true: several examples per row; false: one padded example
per row) and ``shuffle`` (default true: every epoch in its own order, fixed by the seed). loraflow
writes the examples in training order itself (``loraflow.data.epochs``; MaxText's own shuffle is off,
since it depends on the host count), and each host reads every N-th row of that file, so without
packing N hosts train on exactly the global batches one host would. MaxText packs each host's share
by itself: with packing on, which examples share a row and a step depends on the host count.
Losing a host: the others stop within ``LORAFLOW_HEARTBEAT_TIMEOUT`` seconds (default 100: JAX's
coordination service) and the job fails; the retry resumes from the newest committed checkpoint.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraflow import models
from loraflow.data import chat_template
from loraflow.data.epochs import write_epochs
from loraflow.errors import LoraflowError
from loraflow.launchers import multihost
from loraflow.lora import peft
from loraflow.pipeline import checkpoint_sync, faults, gcs
from loraflow.pipeline.local_paths import safe_join
from loraflow.spec.step_configs import LoraSftConfig, parse
from loraflow.steps._harness import StepContext, exit_process, import_permanently, run_step
from loraflow.trainer import answers, host_build, lora_apply
from loraflow.trainer.argv import hardware_args, overrides_args
from loraflow.trainer.converted import CHECKPOINT_JSON

ADAPTER_JSON = "loraflow_adapter.json"
RUN_NAME = "sft"


def _resolve_config(ctx: StepContext) -> dict[str, Any]:
    """The validated config, with the model and its layout completed from the converted checkpoint."""
    cfg = parse(LoraSftConfig, ctx.config).model_dump()
    meta_path = ctx.inputs["checkpoint"] / CHECKPOINT_JSON
    if not meta_path.is_file():
        raise LoraflowError(f"input checkpoint has no {CHECKPOINT_JSON}: not a convert_checkpoint artifact")
    meta = json.loads(meta_path.read_text())
    cfg["model_name"] = cfg["model_name"] or meta["model_name"]
    if cfg["model_overrides"] is None:
        cfg["model_overrides"] = meta.get("model_overrides") or {}
    if cfg["model_name"] != meta["model_name"] or dict(cfg["model_overrides"]) != dict(
        meta.get("model_overrides") or {}
    ):
        raise LoraflowError(
            f"model {cfg['model_name']} {cfg['model_overrides']} differs from the converted checkpoint's "
            f"{meta['model_name']} {meta.get('model_overrides')}"
        )
    cfg["scan_layers"] = meta.get("scan_layers", True)
    cfg["load_parameters_path"] = str(
        safe_join(ctx.inputs["checkpoint"], meta["load_parameters_path"], what=f"the checkpoint's {CHECKPOINT_JSON}")
    )
    return cfg


def _maxtext_argv(
    cfg: dict[str, Any], train_file: Path, tokenizer_dir: Path, base_output: str, n_rows: int
) -> list[str]:
    """MaxText's ``train_sft`` command line; first renders the examples and writes them in training order
    beside ``train_file``."""
    from maxtext.utils.globals import MAXTEXT_CONFIGS_DIR  # type: ignore[attr-defined]

    rendered = _render_training_file(train_file, tokenizer_dir, _training_template(train_file.parent, tokenizer_dir))
    ordered = _write_training_order(cfg, rendered, n_rows)
    return [
        "lora_sft",
        os.path.join(MAXTEXT_CONFIGS_DIR, "post_train", "sft.yml"),
        *overrides_args(cfg["model_name"], cfg["model_overrides"]),
        *hardware_args(cfg["hardware"]),
        f"scan_layers={str(bool(cfg['scan_layers'])).lower()}",
        f"load_parameters_path={cfg['load_parameters_path']}",
        *_data_args(ordered, tokenizer_dir, rendered.passthrough),
        *_batch_args(cfg),
        *_optimizer_args(cfg),
        *_output_args(cfg, base_output),
        *_target_args(cfg),
        *_quantization_args(cfg),
    ]


def _training_template(dataset_dir: Path, tokenizer_dir: Path, progress: Any = None) -> chat_template.ChatTemplate:
    """The template validate_data recorded beside train.jsonl; a dataset without one (made by hand): the
    tokenizer's own (``auto``), with a warning."""
    recorded = chat_template.read_record(dataset_dir)
    if recorded is not None:
        return recorded
    template = chat_template.resolve(chat_template.AUTO, tokenizer_dir)
    if progress is not None:
        progress(
            f"WARNING: the dataset carries no {chat_template.RECORD_FILE} (not a validate_data output): "
            f"training renders with {template.origin}"
        )
    return template


@dataclass(frozen=True)
class _Rendered:
    path: Path  # train.rendered.jsonl: each example as its prompt and answer pieces
    passthrough: Path  # the template MaxText renders the pieces with: each written as it is
    shortest: int  # tokens of the shortest example


def _render_training_file(train_file: Path, tokenizer_dir: Path, template: chat_template.ChatTemplate) -> _Rendered:
    """Every example of ``train_file`` rendered by loraflow (:func:`loraflow.data.chat_template.pieces`).

    MaxText's SFT pipeline applies a chat template itself, one round (prompt turns + answer) at a time,
    and masks the prompt side out of the loss. It is handed the pieces loraflow rendered, as alternating
    user (prompt piece) and assistant (answer piece) turns, and a template that writes each turn's content
    as it is: it then tokenizes exactly loraflow's pieces, each alone, and trains on the answer pieces
    only; evaluation tokenizes the same prompt pieces (``prompt_pieces``). MaxText finds a round's answer
    as the tokens after the longest common prefix of the round and its prompt alone: each round is
    checked to tokenize as its two pieces do, so that split falls where loraflow cut.
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))

    def encode(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False)["input_ids"])

    def decode(ids: list[int]) -> str:
        return str(tok.decode(ids, skip_special_tokens=False))

    rendered = train_file.with_name("train.rendered.jsonl")
    shortest: int | None = None
    with train_file.open(encoding="utf-8") as src, rendered.open("w", encoding="utf-8") as dst:
        for line_no, line in enumerate(src, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            where = f"{train_file.name} line {line_no} (id {row.get('id')!r})"
            try:
                pieces = chat_template.pieces(template, row["messages"])
                n = chat_template.check_round_tokens(encode, decode, pieces)
            except chat_template.ChatTemplateError as exc:
                raise LoraflowError(f"{where}: {exc}") from None
            shortest = n if shortest is None else min(shortest, n)
            turns = [{"role": "user" if is_prompt else "assistant", "content": text} for text, is_prompt in pieces]
            dst.write(json.dumps({"id": row.get("id"), "messages": turns}, ensure_ascii=False) + "\n")
    passthrough = train_file.with_name("chat_template.passthrough.json")
    passthrough.write_text(json.dumps({"chat_template": chat_template.PASSTHROUGH_TEMPLATE}))
    return _Rendered(rendered, passthrough, shortest or 1)


def _write_training_order(cfg: dict[str, Any], rendered: _Rendered, n_rows: int) -> Path:
    """``train.ordered.jsonl``: enough epochs of the examples for ``steps`` batches, in training order."""
    # Packing puts several short examples in one row, and MaxText stops training when the iterator
    # runs dry: repeat the data enough epochs for `steps` batches of the shortest examples.
    per_row = max(1.0, cfg["max_length"] / max(1, rendered.shortest)) if cfg["packing"] else 1.0
    num_epoch = max(1, math.ceil(cfg["steps"] * cfg["batch_size"] * per_row / max(n_rows, 1)) + 1)
    # MaxText reads the examples in loraflow's training order (every epoch shuffled by the seed, the
    # same file on every host) and shuffles nothing itself: its own shuffle depends on the host count.
    ordered = rendered.path.with_name("train.ordered.jsonl")
    write_epochs(rendered.path, ordered, num_epoch, cfg["seed"], cfg["shuffle"])
    return ordered


def _data_args(ordered: Path, tokenizer_dir: Path, passthrough: Path) -> list[str]:
    """Read the ordered, rendered examples once, as they are, with the HF tokenizer; loss on the answers only."""
    return [
        "dataset_type=hf",
        "hf_path=json",
        f"hf_train_files={ordered}",
        "train_split=train",
        "train_data_columns=['messages']",
        "num_epoch=1",
        "grain_worker_count=0",
        "tokenizer_type=huggingface",
        f"tokenizer_path={tokenizer_dir}",
        f"chat_template_path={passthrough.resolve()}",
        "sft_train_on_completion_only=true",
    ]


def _batch_args(cfg: dict[str, Any]) -> list[str]:
    """The global batch split over every device of every process; rows packed or padded; no shuffle.

    ``dtype`` is both MaxText's compute and weight dtype: with bfloat16 activations and float32
    weights, qwix's LoRA branch (float32 factors) promotes a layer's output to float32 and the layer
    scan refuses a carry that changes dtype. The frozen base weights, the LoRA factors and Adam's
    moments are then all held in ``dtype`` (half the memory in bfloat16)."""
    import jax

    return [
        f"dtype={cfg['dtype']}",
        f"weight_dtype={cfg['dtype']}",
        f"per_device_batch_size={cfg['batch_size'] / jax.device_count()}",
        f"max_target_length={cfg['max_length']}",
        f"packing={str(bool(cfg['packing'])).lower()}",
        "enable_data_shuffling=false",
    ]


def _optimizer_args(cfg: dict[str, Any]) -> list[str]:
    """Steps, learning rate and seeds, and LoRA on at the spec's rank and alpha."""
    return [
        f"steps={cfg['steps']}",
        f"learning_rate={cfg['learning_rate']}",
        f"warmup_steps_fraction={cfg['warmup_fraction']}",
        f"data_shuffle_seed={cfg['seed']}",
        f"init_weights_seed={cfg['seed']}",
        "lora.enable_lora=True",
        f"lora.lora_rank={cfg['rank']}",
        f"lora.lora_alpha={float(cfg['alpha'])}",
    ]


def _output_args(cfg: dict[str, Any], base_output: str) -> list[str]:
    """Checkpoints every ``checkpoint_period`` steps under ``base_output``; no evaluation, goodput or tensorboard."""
    return [
        f"base_output_directory={base_output}",
        f"run_name={RUN_NAME}",
        "enable_checkpointing=true",
        f"checkpoint_period={cfg['checkpoint_period']}",
        "eval_interval=-1",
        "enable_goodput_recording=false",
        "monitor_goodput=false",
        "enable_tensorboard=false",
    ]


def _target_args(cfg: dict[str, Any]) -> list[str]:
    """``lora.lora_module_path``: the target_modules regexes as one alternation (none: MaxText's default)."""
    target = cfg["target_modules"]
    if isinstance(target, (list, tuple)):
        target = "|".join(f"(?:{t})" for t in target)
    return [f"lora.lora_module_path={target}"] if target else []


def _quantization_args(cfg: dict[str, Any]) -> list[str]:
    """QLoRA: the targeted kernels' base weights held in ``quantization`` (qwix), tiled when asked."""
    if cfg["quantization"] == "none":
        return []
    tile = [f"lora.lora_tile_size={cfg['tile_size']}"] if cfg["tile_size"] is not None else []
    return [f"lora.lora_weight_qtype={cfg['quantization']}", *tile]


def _make_hooks(base_cls, ctx: StepContext, cfg: dict[str, Any], syncer, rows: list[tuple[int, float, float, float]]):
    t_start = time.monotonic()

    class LoraflowHooks(base_cls):  # type: ignore[misc, valid-type]
        """MaxText's SFT hooks + live progress lines, loss.csv rows and checkpoint persistence.

        A step's seconds run from the previous step's end to its own (the attempt's first step: from its
        start, compiling included). JAX dispatches a step and returns before the chip has run it, and the
        trainer does work between these hooks: measured from this step's start hook, a 1 B model's 0.58 s
        steps on a TPU v5e read as 0.02 s (25x the real tokens per second)."""

        _lf_last_end: float | None = None

        def on_train_step_start(self, train_ctx):
            if syncer is not None:
                syncer.poll()  # the previous step's checkpoint, once Orbax has finalised it
            super().on_train_step_start(train_ctx)
            batch = train_ctx.data_hooks.train_batch
            self._lf_tokens = _tokens_in(batch["inputs_segmentation"]) if batch is not None else 0
            self._lf_t0 = self._lf_last_end if self._lf_last_end is not None else time.perf_counter()

        def on_train_step_end(self, train_ctx, train_step, train_loss, step_time=0.0):
            super().on_train_step_end(train_ctx, train_step, train_loss, step_time)
            loss = float(train_loss)  # waits for the step's result
            self._lf_last_end = end = time.perf_counter()
            seconds = max(end - self._lf_t0, 1e-9)
            tps = self._lf_tokens / seconds
            rows.append((int(train_step), loss, tps, seconds))
            faults.point("train_step")  # a host lost mid-training (the reliability tests)
            if train_step <= 3 or train_step % max(1, cfg["log_every"]) == 0 or train_step == cfg["steps"]:
                ctx.progress(
                    f"step {train_step}/{cfg['steps']} loss {loss:.4f} tokens/s {tps:.0f} "
                    f"({seconds:.3f}s/step, t+{time.monotonic() - t_start:.0f}s)"
                )

    return LoraflowHooks


def _tokens_in(segmentation: Any) -> int:
    """Non-padding tokens of a batch: counted on the host when this process holds the whole batch (no
    device computation to dispatch and wait for), else on the devices (a multi-host global array)."""
    import numpy as np

    if getattr(segmentation, "is_fully_addressable", True):
        return int(np.count_nonzero(np.asarray(segmentation)))
    import jax.numpy as jnp

    return int(jnp.sum(segmentation != 0))


def _skip_trained_batches(trainer, n: int, ctx: StepContext) -> None:
    """Tunix restores the step but MaxText's data hooks restart the iterator: skip what was trained."""
    if n <= 0:
        return
    hooks = trainer.data_hooks
    original = hooks.load_next_train_batch
    state = {"left": n}

    def load(train_ctx):
        while state["left"] > 0:
            hooks.train_data_loader.load_next_batch()
            state["left"] -= 1
        return original(train_ctx)

    hooks.load_next_train_batch = load
    ctx.progress(f"resuming at step {n}: skipping the {n} batches already trained on")


# ------------------------------------------------------------------------------------ multi-host


def start_distributed(ctx: StepContext) -> multihost.DistributedConfig | None:
    """Join the job's other processes (``jax.distributed``) before JAX starts; ``None`` when alone.

    Must run before anything asks JAX for its devices. On CPU hosts the processes exchange
    collectives over TCP (gloo); with a loopback coordinator they also talk over loopback only.
    """
    dist = multihost.distributed_config()
    if dist is None:
        return None
    import jax

    host = dist.coordinator.rpartition(":")[0]
    loopback = host in ("127.0.0.1", "localhost")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # TPUs ignore it (they use ICI/DCN)
    ctx.progress(f"process {dist.process_id} of {dist.num_processes} ({dist.source}): joining {dist.coordinator}")
    jax.distributed.initialize(
        **dist.jax_kwargs(),
        initialization_timeout=int(os.environ.get("LORAFLOW_JOIN_TIMEOUT", "300")),
        # A lost host: the others stop within this many seconds instead of waiting in a collective.
        heartbeat_timeout_seconds=int(os.environ.get("LORAFLOW_HEARTBEAT_TIMEOUT", "100")),
        coordinator_bind_address=dist.coordinator if loopback else None,
    )
    if loopback:
        _gloo_on_loopback()
    ctx.progress(
        f"process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} local of "
        f"{jax.device_count()} {jax.default_backend()} devices"
    )
    ctx.commits = dist.is_coordinator
    return dist


def _gloo_on_loopback() -> None:
    """Make the CPU client's gloo collectives listen on 127.0.0.1 (default: the host name's address)."""
    from jax._src import distributed, xla_bridge
    from jax._src.lib import _jax

    def factory() -> Any:
        gloo = _jax.make_gloo_tcp_collectives(distributed.global_state.client, hostname="127.0.0.1")
        return xla_bridge.make_cpu_client(collectives=gloo)

    xla_bridge.register_backend_factory("cpu", factory, priority=0, fail_quietly=False)


def _barrier(name: str) -> None:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(f"loraflow lora_sft {name}")


def _gather_ints(value: int) -> list[int]:
    """Every process's ``value``, in process order (a collective: every process must call it)."""
    import numpy as np
    from jax.experimental import multihost_utils

    return [int(v) for v in np.asarray(multihost_utils.process_allgather(np.int32(value))).reshape(-1)]


def train(ctx: StepContext, cfg: dict[str, Any], dist: multihost.DistributedConfig | None = None) -> dict[str, Any]:
    import_permanently("maxtext.configs.pyconfig", "maxtext.trainers.post_train.sft.train_sft")
    from absl import flags
    from maxtext.configs import pyconfig
    from maxtext.trainers.post_train.sft import train_sft

    if not flags.FLAGS.is_parsed():  # grain reads absl flags; the harness parses its own argv
        flags.FLAGS.mark_as_parsed()
    train_file, n_rows = _training_data(ctx)
    template = _training_template(ctx.inputs["dataset"], ctx.inputs["tokenizer"], ctx.progress)
    ctx.progress(f"chat template: {template.origin} (sha256 {template.digest[:12]})")
    if _wants_answers(cfg):
        answers.eval_file(ctx.inputs["dataset"])  # before hours of training, not after
    store = _checkpoint_storage(ctx, cfg, dist)
    argv = _maxtext_argv(cfg, train_file, ctx.inputs["tokenizer"], store.base_output, n_rows)
    mt_config = pyconfig.initialize_pydantic(argv)
    train_sft.validate_config(mt_config)

    rows: list[tuple[int, float, float, float]] = []
    started = time.monotonic()
    trainer, mesh = _setup_trainer(ctx, cfg, mt_config, store, rows, n_rows)
    last_batch = _remember_last_batch(trainer)
    start_step = int(trainer.train_steps)
    if dist is not None:
        ctx.progress(_sharding_note(trainer.model, mesh))
    memory = _state_bytes(trainer)
    ctx.progress(_quantization_note(cfg, trainer.model) + "; " + _memory_note(memory))
    _skip_trained_batches(trainer, start_step, ctx)
    ctx.progress(
        f"set up in {time.monotonic() - started:.0f}s; training from step {start_step} to {cfg['steps']} (compiling first)"
    )
    t_train = time.monotonic()
    train_sft.train_model(mt_config, trainer, mesh)
    train_seconds = time.monotonic() - t_train
    if store.syncer is not None:
        store.syncer.poll()
    memory |= _compiled_step_bytes(trainer, mesh, mt_config, last_batch.get("batch"))
    if "step_temp_bytes" in memory:
        ctx.progress(_compiled_note(memory))
    eval_answers = _answer_eval_prompts(ctx, cfg, trainer.model, mesh, mt_config)
    return {
        "answers": eval_answers,
        "mt_config": mt_config,
        "lora_tree": _trained_adapter(trainer, dist),
        "rows": rows,
        "start_step": start_step,
        "final_step": int(trainer.train_steps),
        "local_ckpt": store.local_ckpt,
        "setup_seconds": t_train - started,
        "train_seconds": train_seconds,
        "memory": memory,
        "chat_template": template.summary(),
    }


def _wants_answers(cfg: dict[str, Any]) -> bool:
    return cfg["quantization"] != "none" and cfg["quantized_eval_examples"] > 0


def _answer_eval_prompts(
    ctx: StepContext, cfg: dict[str, Any], model: Any, mesh: Any, mt_config: Any
) -> answers.Answers | None:
    """QLoRA: the trained model's own answers to the first eval prompts (the report's merge-cost row)."""
    if not _wants_answers(cfg):
        return None
    return answers.answer_eval_prompts(
        model,
        mesh,
        mt_config.logical_axis_rules,
        ctx.inputs["dataset"],
        ctx.inputs["tokenizer"],
        cfg["quantized_eval_examples"],
        cfg["max_new_tokens"],
        cfg["batch_size"],
        ctx.progress,
    )


def _training_data(ctx: StepContext) -> tuple[Path, int]:
    """The dataset's ``train.jsonl`` and its number of examples."""
    train_file = ctx.inputs["dataset"] / "train.jsonl"
    if not train_file.is_file():
        raise LoraflowError(f"dataset input has no train.jsonl ({ctx.inputs['dataset']})")
    return train_file, sum(1 for line in train_file.open() if line.strip())


@dataclass(frozen=True)
class _Checkpoints:
    """Where this run's checkpoints go."""

    base_output: str  # MaxText's base_output_directory: a local directory, or the gs:// prefix (direct)
    local_ckpt: Path  # where Orbax writes them, when local
    syncer: checkpoint_sync.Syncer | checkpoint_sync.HostSyncer | None  # staged: persists each to GCS
    per_host: bool  # staged on several hosts: every host's Orbax writes (and restores) its own shards locally


def _checkpoint_storage(
    ctx: StepContext, cfg: dict[str, Any], dist: multihost.DistributedConfig | None
) -> _Checkpoints:
    """Where Orbax writes checkpoints; staged ones are first fetched from GCS to resume (every host its own part)."""
    remote = ctx.output_uri.rstrip("/") + "/_checkpoints"
    if cfg["checkpoint_storage"] == "direct":
        gcs.route_native_clients()  # Orbax's own GCS clients: at the emulator when there is one
        ctx.progress(f"checkpoints: Orbax writes them to {remote} (direct)")
        local_ckpt = Path(remote) / RUN_NAME / "checkpoints"  # never a directory: nothing local to copy
        if dist is not None:
            _barrier("checkpoint directory ready")
        return _Checkpoints(remote, local_ckpt, None, per_host=False)
    base_output = str(ctx.work / "maxtext")  # this host's own disk
    local_ckpt = Path(base_output) / RUN_NAME / "checkpoints"
    if dist is None:
        return _Checkpoints(base_output, local_ckpt, _staged_syncer(ctx, local_ckpt, remote), per_host=False)
    syncer = _host_syncer(ctx, dist, local_ckpt, remote)
    _barrier("checkpoint directory ready")
    return _Checkpoints(base_output, local_ckpt, syncer, per_host=True)


def _staged_syncer(ctx: StepContext, local_ckpt: Path, remote: str) -> checkpoint_sync.Syncer:
    """Download the newest complete checkpoint (a restarted run resumes from it); then persist each new one."""
    local_ckpt.mkdir(parents=True, exist_ok=True)
    restored = checkpoint_sync.download_latest(remote, local_ckpt)
    if restored is not None:
        ctx.progress(f"found checkpoint step {restored} under {remote}: resuming from it")
    return checkpoint_sync.Syncer(local_ckpt, remote, ctx.progress)


def _host_syncer(
    ctx: StepContext, dist: multihost.DistributedConfig, local_ckpt: Path, remote: str
) -> checkpoint_sync.HostSyncer:
    """This host's part of the newest committed checkpoint onto its own disk; then persist its part of each new one."""
    local_ckpt.mkdir(parents=True, exist_ok=True)
    host, hosts = dist.process_id, dist.num_processes
    ctx.progress(
        f"checkpoints: host {host} stages its own shards on its disk and uploads them to "
        f"{remote}/<step>/{checkpoint_sync.host_part(host)} (staged); host 0 commits each step every host uploaded"
    )
    restored = checkpoint_sync.download_latest(remote, local_ckpt, host=host, hosts=hosts)
    found = _gather_ints(restored or 0)
    if len(set(found)) != 1:
        raise LoraflowError(f"the hosts found different newest checkpoints under {remote} (steps by host: {found})")
    if restored is not None:
        ctx.progress(f"found checkpoint step {restored} under {remote}: host {host} resumes from its part")
    return checkpoint_sync.HostSyncer(local_ckpt, remote, host, hosts, _gather_ints, ctx.progress)


def _per_host_checkpoint_manager(base_cls: Any) -> Any:
    """Tunix's checkpoint manager with every host a primary writing to its own local directory.

    Orbax's default has process 0 write the metadata and each replicated shard written once
    (replica 0): no host's directory then holds everything it restores. Here every host writes the
    metadata and every shard it holds (replicas included), as Orbax's own local checkpointing does,
    so each host restores from its own directory alone.
    """
    import dataclasses

    import jax
    import orbax.checkpoint as ocp

    class PerHostCheckpointManager(base_cls):  # type: ignore[misc, valid-type]
        def __init__(self, root_directory: str | None = None, options: Any = None):
            super().__init__(None, options)  # Tunix's own Orbax manager: none
            if root_directory is None:
                return
            every_host = ocp.options.MultiprocessingOptions(primary_host=None, barrier_sync_key_prefix="loraflow-host")
            registry = ocp.type_handlers.create_type_handler_registry(
                (
                    jax.Array,
                    ocp.type_handlers.ArrayHandler(primary_host=None, replica_id=None, use_replica_parallel=False),
                )
            )

            def pytree() -> Any:
                return ocp.PyTreeCheckpointHandler(multiprocessing_options=every_host, type_handler_registry=registry)

            self._checkpoint_manager = ocp.CheckpointManager(
                root_directory,
                item_handlers={
                    "model_params": pytree(),
                    "optimizer_state": pytree(),
                    "custom_metadata": ocp.JsonCheckpointHandler(multiprocessing_options=every_host),
                },
                options=dataclasses.replace(
                    options or ocp.CheckpointManagerOptions(),
                    multiprocessing_options=every_host,
                    enable_per_process_directory_creation=True,
                ),
            )

    return PerHostCheckpointManager


def _setup_trainer(
    ctx: StepContext,
    cfg: dict[str, Any],
    mt_config: Any,
    store: _Checkpoints,
    rows: list[tuple[int, float, float, float]],
    n_rows: int,
) -> tuple[Any, Any]:
    """MaxText's ``setup_trainer_state`` with loraflow's hooks in place of its SFT hooks (and, staged on
    several hosts, the per-host checkpoint manager in place of Tunix's): (trainer, mesh)."""
    from maxtext.trainers.post_train.sft import hooks as sft_hooks
    from maxtext.trainers.post_train.sft import train_sft
    from tunix.sft import checkpoint_manager as tunix_checkpoints

    original_hooks, original_manager = sft_hooks.SFTTrainingHooks, tunix_checkpoints.CheckpointManager
    # setup_trainer_state builds hooks.SFTTrainingHooks(...); Tunix's PeftTrainer checkpoint_manager.CheckpointManager(...)
    sft_hooks.SFTTrainingHooks = _make_hooks(original_hooks, ctx, cfg, store.syncer, rows)
    if store.per_host:
        tunix_checkpoints.CheckpointManager = _per_host_checkpoint_manager(original_manager)
    try:
        ctx.progress(f"building the MaxText model and data pipeline ({n_rows} rows)")
        with (
            lora_apply.applied_under_jit(ctx.progress),  # no second copy of the frozen weights
            host_build.built_on_host(ctx.progress) if _builds_on_host(cfg) else contextlib.nullcontext(),
        ):
            return train_sft.setup_trainer_state(mt_config)
    finally:
        sft_hooks.SFTTrainingHooks, tunix_checkpoints.CheckpointManager = original_hooks, original_manager


def _builds_on_host(cfg: dict[str, Any]) -> bool:
    """QLoRA on one chip: the full-precision model is built and quantized in host memory
    (``loraflow.trainer.host_build``), the chip only ever holds the quantized one. On several chips MaxText's set-up
    shards the full-precision model across them, each holding its share."""
    import jax

    return cfg["quantization"] != "none" and jax.process_count() == 1 and jax.local_device_count() == 1


def _trained_adapter(trainer: Any, dist: multihost.DistributedConfig | None) -> Any:
    """The trained LoRA params as a tree of numpy arrays (the whole adapter, on every process)."""
    from flax import nnx

    lora_dict = nnx.state(trainer.model, nnx.LoRAParam).to_pure_dict()
    if dist is not None:
        # Sharded across processes: every process gathers the whole adapter (a collective), and
        # nobody goes on before every process's checkpoint writes are done.
        from jax.experimental import multihost_utils

        lora_dict = multihost_utils.process_allgather(lora_dict, tiled=True)
        _barrier("training done")
    return _to_numpy_tree(lora_dict)


def _quantized_kernels(model: Any) -> dict[str, str]:
    """``{kernel path: stored dtype}`` of the kernels qwix holds quantized (QLoRA); empty for LoRA."""
    import jax
    from flax import nnx

    found = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]:
        name = "/".join(str(getattr(p, "key", getattr(p, "name", p))) for p in path)
        if "/qvalue" in name:
            found[name.split("/kernel/")[0]] = str(leaf.dtype)
    return found


def _quantization_note(cfg: dict[str, Any], model: Any) -> str:
    """Which kernels hold their base weights quantized, to what (the task log's QLoRA line)."""
    kernels = _quantized_kernels(model)
    if cfg["quantization"] == "none":
        return "LoRA: base weights in full precision"
    if not kernels:
        raise LoraflowError(
            f"lora.quantization {cfg['quantization']} was asked for, but no kernel was quantized: check "
            "lora.target_modules matches the model's projections"
        )
    tile = f"tiles of {cfg['tile_size']}" if cfg["tile_size"] is not None else "one scale per channel"
    stored = ", ".join(sorted(set(kernels.values())))
    return (
        f"QLoRA: {len(kernels)} kernel stacks hold their base weights as {cfg['quantization']} ({stored}, {tile}): "
        f"{', '.join(sorted(kernels))}; embeddings, LM head and norms stay full precision"
    )


def _state_bytes(trainer: Any) -> dict[str, int]:
    """Device bytes of the training state: the model (base weights, quantized or not, and the adapter),
    the adapter alone, and the optimizer's state (measured with ``on_device_size_in_bytes``: ``nbytes``
    misreports packed 4-bit arrays)."""
    from flax import nnx

    size = host_build.device_bytes
    model, adapter, optimizer = (
        nnx.state(trainer.model),
        nnx.state(trainer.model, nnx.LoRAParam),
        nnx.state(trainer.optimizer),
    )
    return {
        "train_state_bytes": size(model) + size(optimizer),
        "model_bytes": size(model),
        "adapter_bytes": size(adapter),
        "optimizer_bytes": size(optimizer),
    }


def _remember_last_batch(trainer: Any) -> dict[str, Any]:
    """Make the trainer keep the last batch it prepared: the compiled step's memory is read with it."""
    seen: dict[str, Any] = {}
    prepare = trainer._prepare_inputs  # pylint: disable=protected-access

    def remembering(example: Any) -> Any:
        seen["batch"] = prepared = prepare(example)
        return prepared

    trainer._prepare_inputs = remembering  # pylint: disable=protected-access
    return seen


def _compiled_step_bytes(trainer: Any, mesh: Any, mt_config: Any, batch: Any) -> dict[str, int]:
    """XLA's memory analysis of the train step compiled for this run's shapes and shardings (per device):
    its arguments (model, optimizer state, batch), outputs and temporaries (activations, gradients).
    One more compilation of the step (not run); nothing when no step ran (a resumed, finished run)."""
    if batch is None:
        return {}
    import jax
    from flax import nnx
    from flax.core.spmd import logical_axis_rules
    from tunix.sft import sharding_utils

    with jax.set_mesh(mesh), logical_axis_rules(mt_config.logical_axis_rules):
        sharded = sharding_utils.shard_input(batch, trainer.config.data_sharding_axis)
        step = nnx.jit(trainer.create_train_step_fn(), donate_argnames=("optimizer",))
        stats = step.lower(trainer.model, trainer.optimizer, sharded).compile().memory_analysis()
    if stats is None:  # a backend without the analysis
        return {}
    return {
        "step_argument_bytes": int(stats.argument_size_in_bytes),
        "step_output_bytes": int(stats.output_size_in_bytes),
        "step_temp_bytes": int(stats.temp_size_in_bytes),
    }


def _compiled_note(memory: dict[str, int]) -> str:
    return (
        f"compiled train step, per device: arguments {memory['step_argument_bytes'] / 2**20:.2f} MiB, "
        f"temporaries {memory['step_temp_bytes'] / 2**20:.2f} MiB, outputs {memory['step_output_bytes'] / 2**20:.2f} "
        "MiB (XLA's memory analysis)"
    )


def _memory_note(memory: dict[str, int]) -> str:
    mib = {k: v / 2**20 for k, v in memory.items()}
    return (
        f"training state {mib['train_state_bytes']:.2f} MiB (model {mib['model_bytes']:.2f} MiB of which adapter "
        f"{mib['adapter_bytes']:.2f} MiB, optimizer {mib['optimizer_bytes']:.2f} MiB)"
    )


def _sharding_note(model: Any, mesh: Any) -> str:
    """How the model's arrays lie across the processes (what a multi-host run logs once)."""
    import jax
    from flax import nnx

    leaves = [x for x in jax.tree_util.tree_leaves(nnx.state(model)) if isinstance(x, jax.Array)]
    split = sum(1 for x in leaves if not x.is_fully_addressable)
    return (
        f"mesh {dict(mesh.shape)} over {jax.process_count()} processes: {split} of {len(leaves)} model arrays "
        "sharded across processes"
    )


def _to_numpy_tree(tree: Any) -> Any:
    import numpy as np

    if isinstance(tree, dict):
        return {str(k): _to_numpy_tree(v) for k, v in tree.items()}
    return np.asarray(tree)


def _flatten(tree: dict[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    out: dict[tuple[str, ...], Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out |= _flatten(v, (*prefix, k))
        else:
            out[(*prefix, k)] = v
    return out


# ------------------------------------------------------------------------------------ PEFT export


def export_peft(
    lora_tree: dict[str, Any],
    mt_config: Any,
    hf_config: Any,
    rank: int,
    alpha: float,
    out_dir: Path,
    base_model: str = "",
) -> dict[str, Any]:
    """Write ``adapter_model.safetensors`` + ``adapter_config.json`` (PEFT, HF layout).

    The model's family (``loraflow.models``) turns the MaxText LoRA factors into PEFT's: its parameter
    mapping names the HF modules, MaxText's own MaxText->HF hooks lay out lora_B, and every (module,
    layer) is checked against those hooks applied to the full MaxText-space delta.
    """
    family = models.family_for(mt_config.model_name)
    modules, max_err = family.peft_modules(_flatten(lora_tree), mt_config, hf_config, float(alpha) / float(rank))
    tensors = peft.adapter_tensors(modules)
    targets = peft.target_modules(modules)
    peft.write_adapter(out_dir, tensors, peft.adapter_config(base_model, rank, alpha, targets))
    return {"tensors": len(tensors), "target_modules": targets, "check_max_abs_diff": max_err}


# ------------------------------------------------------------------------------------ the step

_LOGGED = (
    "model_name",
    "rank",
    "alpha",
    "quantization",
    "steps",
    "batch_size",
    "learning_rate",
    "max_length",
    "target_modules",
)


def run(ctx: StepContext) -> dict[str, Any]:
    cfg = _resolve_config(ctx)
    ctx.progress("LoRA SFT: " + ", ".join(f"{k}={cfg[k]}" for k in _LOGGED))
    started = time.monotonic()
    dist = start_distributed(ctx)
    res = train(ctx, cfg, dist)
    if not ctx.commits:
        ctx.progress("training done; process 0 writes the outputs and commits them")
        return {}
    if res["final_step"] < cfg["steps"]:
        raise LoraflowError(f"training stopped at step {res['final_step']} of {cfg['steps']} (data ran out?)")
    _write_loss_csv(ctx.out / "loss.csv", res["rows"])
    if res["answers"] is not None:
        _write_jsonl(ctx.out / answers.ANSWERS_JSONL, res["answers"].rows())
    _write_adapter(ctx.out / "adapter", cfg, res, dist)
    exported = _export_peft(ctx, cfg, res)
    norm = _lora_b_norm(res["lora_tree"])
    summary = _summary(cfg, res, exported, norm, started, dist)
    ctx.progress(f"done: loss {summary['first_loss']} -> {summary['final_loss']} in {summary['steps']} steps")
    return summary


def _write_loss_csv(path: Path, rows: list[tuple[int, float, float, float]]) -> None:
    """loss.csv: this attempt's steps: loss, tokens per second and wall seconds of each (the first
    step's include compiling it)."""
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "loss", "tokens_per_s", "seconds"])
        for step, loss, tps, seconds in rows:
            w.writerow([step, f"{loss:.6f}", f"{tps:.1f}", f"{seconds:.4f}"])


def _write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def _write_adapter(
    adapter_dir: Path, cfg: dict[str, Any], res: dict[str, Any], dist: multihost.DistributedConfig | None
) -> None:
    """adapter/: the final LoRA params exactly as Tunix checkpointed them (lora.lora_restore_path)."""
    final_dir = res["local_ckpt"] / str(res["final_step"]) / "model_params"
    if dist is None and final_dir.is_dir():
        shutil.copytree(final_dir, adapter_dir / "model_params")
    else:  # direct mode, or several hosts (this one's directory holds its shards only): save the params ourselves
        _save_params(adapter_dir / "model_params", res["lora_tree"], dist)
    (adapter_dir / ADAPTER_JSON).write_text(json.dumps(_adapter_meta(cfg, res), indent=2))


def _save_params(path: Path, lora_tree: Any, dist: multihost.DistributedConfig | None) -> None:
    import orbax.checkpoint as ocp

    # Only this process writes (the others are done): Orbax must not wait for them at its barriers.
    alone = ocp.options.MultiprocessingOptions(primary_host=0, active_processes={0}) if dist is not None else None
    handler = ocp.PyTreeCheckpointHandler(**({"multiprocessing_options": alone} if alone else {}))
    checkpointer = ocp.Checkpointer(handler, **({"multiprocessing_options": alone} if alone else {}))
    checkpointer.save(str(path.resolve()), _with_value(lora_tree))


def _adapter_meta(cfg: dict[str, Any], res: dict[str, Any]) -> dict[str, Any]:
    """``loraflow_adapter.json``: how to restore the adapter into MaxText, and what it was trained for."""
    return {
        "format": "loraflow.lora_adapter/1",
        "lora_restore_path": "model_params",
        "rank": int(cfg["rank"]),
        "alpha": float(cfg["alpha"]),
        "target_modules": cfg["target_modules"],
        "lora_module_path": _module_path(res["mt_config"]),
        "model_name": cfg["model_name"],
        "model_overrides": cfg["model_overrides"],
        "scan_layers": cfg["scan_layers"],
        "quantization": cfg["quantization"],
        "tile_size": cfg["tile_size"],
        "steps": res["final_step"],
        "chat_template": res["chat_template"],
    }


def _export_peft(ctx: StepContext, cfg: dict[str, Any], res: dict[str, Any]) -> dict[str, Any]:
    """peft/: the adapter in PEFT's HF layout, for the tokenizer input's HF config."""
    import transformers

    hf_config = transformers.AutoConfig.from_pretrained(str(ctx.inputs["tokenizer"]))
    exported = export_peft(
        res["lora_tree"],
        res["mt_config"],
        hf_config,
        cfg["rank"],
        cfg["alpha"],
        ctx.out / "peft",
        base_model=cfg["model_name"],
    )
    ctx.progress(
        f"PEFT export: {exported['tensors']} tensors for {exported['target_modules']}; "
        f"matches MaxText's own MaxText->HF mapping (max |diff| {exported['check_max_abs_diff']:.2e})"
    )
    return exported


def _lora_b_norm(lora_tree: Any) -> float:
    """The norm of every lora_b together; refuses an all-zero adapter."""
    norm = math.sqrt(
        sum(float((v.astype("float64") ** 2).sum()) for k, v in _flatten(lora_tree).items() if "lora_b" in "/".join(k))
    )
    if norm == 0.0:
        raise LoraflowError("the trained adapter is all zeros (lora_b never moved)")
    return norm


def _summary(
    cfg: dict[str, Any],
    res: dict[str, Any],
    exported: dict[str, Any],
    norm: float,
    started: float,
    dist: multihost.DistributedConfig | None,
) -> dict[str, Any]:
    rows = res["rows"]
    trained = [r for r in rows if r[0] > 1]  # step 1 includes compilation
    return {
        "first_loss": rows[0][1] if rows else None,
        "final_loss": rows[-1][1] if rows else None,
        "steps": res["final_step"],
        "resumed_from_step": res["start_step"] or None,
        "train_seconds": round(res["train_seconds"], 1),
        "setup_seconds": round(res["setup_seconds"], 1),
        "step_seconds": round(res["train_seconds"] / max(1, len(rows)), 3),
        "tokens_per_s": round(sum(r[2] for r in trained) / len(trained), 1) if trained else None,
        # the first step of an attempt compiles it; the median of the others is the steady step time
        "first_step_seconds": round(rows[0][3], 3) if rows else None,
        "median_step_seconds": round(statistics.median(r[3] for r in rows[1:]), 4) if len(rows) > 1 else None,
        "lora_b_norm": round(norm, 4),
        "peft_tensors": exported["tensors"],
        "total_seconds": round(time.monotonic() - started, 1),
        "processes": dist.num_processes if dist is not None else 1,
        "quantization": cfg["quantization"],
        "chat_template": res["chat_template"],
        **res["memory"],
        **_answers_summary(res["answers"]),
    }


def _answers_summary(answers: answers.Answers | None) -> dict[str, Any]:
    if answers is None:
        return {}
    return {"quantized_eval_examples": len(answers.ids), "quantized_eval_seconds": round(answers.seconds, 1)}


def _module_path(mt_config: Any) -> str:
    from maxtext.utils import lora_utils

    return lora_utils._get_lora_module_path(mt_config)  # pylint: disable=protected-access


def _with_value(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _with_value(v) for k, v in tree.items()}
    return {"value": tree}


if __name__ == "__main__":
    exit_process(run_step("lora_sft", run))
