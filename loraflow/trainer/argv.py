"""MaxText's command lines: ``train_sft``'s for lora_sft (:func:`sft_argv`), and the pieces the trainer
steps (convert_checkpoint, lora_sft) share. Model-family knowledge is not here: :mod:`loraflow.models`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loraflow.spec.step_configs import LoraSftConfig
    from loraflow.trainer.converted import ConvertedModel
    from loraflow.trainer.data import PreparedData

RUN_NAME = "sft"  # MaxText's run_name: checkpoints go to {base_output_directory}/sft/checkpoints


def overrides_args(model_name: str, overrides: dict[str, Any]) -> list[str]:
    """MaxText command-line ``key=value`` args for a model and its overrides."""
    args = [f"model_name={model_name}"]
    if overrides:
        args.append("override_model_config=True")
    for key, value in overrides.items():
        if isinstance(value, bool):
            value = str(value).lower()
        args.append(f"{key}={value}")
    return args


def hardware_args(hardware: str | None) -> list[str]:
    """The hardware MaxText runs on: the config's ``hardware`` or ``LORAFLOW_HARDWARE``; CPU when JAX has only CPUs.

    MaxText never starts JAX's distributed system itself: a job of several processes has joined it
    before MaxText runs (``loraflow.launchers.multihost``), and a single process needs none. (Left to
    MaxText, a single TPU host with checkpointing on calls ``jax.distributed.initialize()`` and waits
    for a coordinator that does not exist.)
    """
    hardware = hardware or os.environ.get("LORAFLOW_HARDWARE")
    if not hardware:
        import jax

        hardware = "cpu" if jax.default_backend() == "cpu" else "tpu"
    args = [f"hardware={hardware}", "skip_jax_distributed_system=true"]
    if hardware == "cpu":
        args.append("attention=dot_product")
    return args


def compile_cache_args() -> list[str]:
    """Where JAX's persistent compilation cache lies: ``JAX_COMPILATION_CACHE_DIR`` when the step's
    environment names one, else MaxText's ``jax_cache_dir`` default (``~/jax_cache``).

    MaxText points the cache at its ``jax_cache_dir`` whatever JAX's own variable says, so the variable is
    passed on here. The test suite sets it to a folder of its session (``tests/conftest.py``: every step
    program of the run compiles the tiny model's programs once); the local launcher passes it through
    from the worker. A spec cannot set it (``loraflow.spec.env_rules``: the cache holds native code that
    is run as found)."""
    folder = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    return [f"jax_cache_dir={folder}"] if folder else []


def sft_argv(
    cfg: LoraSftConfig,
    model: ConvertedModel,
    data: PreparedData,
    tokenizer_dir: Path,
    base_output: str,
    remat_policy: str | None = None,
    data_workers: int = 0,
) -> list[str]:
    """MaxText's ``train_sft`` command line: the model, the prepared examples (read by ``data_workers`` grain
    worker processes: 0, in the training process), the spec's training and LoRA (and the remat policy
    ``training.tuning: auto`` chose, :func:`training_args`)."""
    from maxtext.utils.globals import MAXTEXT_CONFIGS_DIR  # type: ignore[attr-defined]

    return [
        "lora_sft",
        os.path.join(MAXTEXT_CONFIGS_DIR, "post_train", "sft.yml"),
        *overrides_args(model.name, model.overrides),
        *hardware_args(cfg.hardware),
        *compile_cache_args(),
        f"scan_layers={str(bool(model.scan_layers)).lower()}",
        f"load_parameters_path={model.parameters_path}",
        *_data_args(data, tokenizer_dir, data_workers),
        *training_args(cfg, remat_policy=remat_policy),
        *_output_args(cfg, base_output),
    ]


def training_args(cfg: LoraSftConfig, devices: int | None = None, remat_policy: str | None = None) -> list[str]:
    """The spec's training and LoRA settings as MaxText's: the batch (split over ``devices``, see
    :func:`_batch_args`), the optimizer, LoRA's targets and quantization, and ``remat_policy`` when
    ``training.tuning: auto`` chose one (:mod:`loraflow.spec.tuning`; None: MaxText's default, or the
    spec's ``model_overrides``). lora_sft's command line and ``plan --fit``'s compile
    (:mod:`loraflow.trainer.fit`) both take them from here."""
    remat = [f"remat_policy={remat_policy}"] if remat_policy is not None else []
    return [*_batch_args(cfg, devices), *_optimizer_args(cfg), *_target_args(cfg), *_quantization_args(cfg), *remat]


def _data_args(data: PreparedData, tokenizer_dir: Path, workers: int) -> list[str]:
    """Read the ordered, rendered examples once, as they are, with the HF tokenizer; loss on the answers only."""
    return [
        "dataset_type=hf",
        "hf_path=json",
        f"hf_train_files={data.ordered}",
        "train_split=train",
        "train_data_columns=['messages']",
        "num_epoch=1",
        f"grain_worker_count={workers}",
        "tokenizer_type=huggingface",
        f"tokenizer_path={tokenizer_dir}",
        f"chat_template_path={data.passthrough.resolve()}",
        "sft_train_on_completion_only=true",
    ]


def _batch_args(cfg: LoraSftConfig, devices: int | None = None) -> list[str]:
    """The global batch split over every device of every process (``devices``: JAX's count, or the
    slice's when the step is compiled for chips that are not here); rows packed or padded; no shuffle.

    ``dtype`` is both MaxText's compute and weight dtype: with bfloat16 activations and float32
    weights, qwix's LoRA branch (float32 factors) promotes a layer's output to float32 and the layer
    scan refuses a carry that changes dtype. The frozen base weights, the LoRA factors and Adam's
    moments are then all held in ``dtype`` (half the memory in bfloat16)."""
    if devices is None:
        import jax

        devices = jax.device_count()
    return [
        f"dtype={cfg.dtype}",
        f"weight_dtype={cfg.dtype}",
        f"per_device_batch_size={cfg.batch_size / devices}",
        f"max_target_length={cfg.max_length}",
        f"packing={str(bool(cfg.packing)).lower()}",
        "enable_data_shuffling=false",
    ]


def _optimizer_args(cfg: LoraSftConfig) -> list[str]:
    """Steps, learning rate and seeds, and LoRA on at the spec's rank and alpha."""
    return [
        f"steps={cfg.steps}",
        f"learning_rate={cfg.learning_rate}",
        f"warmup_steps_fraction={cfg.warmup_fraction}",
        f"data_shuffle_seed={cfg.seed}",
        f"init_weights_seed={cfg.seed}",
        "lora.enable_lora=True",
        f"lora.lora_rank={cfg.rank}",
        f"lora.lora_alpha={float(cfg.alpha)}",
    ]


def _output_args(cfg: LoraSftConfig, base_output: str) -> list[str]:
    """Checkpoints every ``checkpoint_period`` steps under ``base_output``; no evaluation, goodput or tensorboard."""
    return [
        f"base_output_directory={base_output}",
        f"run_name={RUN_NAME}",
        "enable_checkpointing=true",
        f"checkpoint_period={cfg.checkpoint_period}",
        "eval_interval=-1",
        "enable_goodput_recording=false",
        "monitor_goodput=false",
        "enable_tensorboard=false",
    ]


def _target_args(cfg: LoraSftConfig) -> list[str]:
    """``lora.lora_module_path``: the target_modules regexes as one alternation (none: MaxText's default)."""
    if not cfg.target_modules:
        return []
    return ["lora.lora_module_path=" + "|".join(f"(?:{t})" for t in cfg.target_modules)]


def _quantization_args(cfg: LoraSftConfig) -> list[str]:
    """QLoRA: the targeted kernels' base weights held in ``quantization`` (qwix), tiled when asked."""
    if cfg.quantization == "none":
        return []
    tile = [f"lora.lora_tile_size={cfg.tile_size}"] if cfg.tile_size is not None else []
    return [f"lora.lora_weight_qtype={cfg.quantization}", *tile]
