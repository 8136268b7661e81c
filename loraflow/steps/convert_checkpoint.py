"""convert_checkpoint: a Hugging Face checkpoint -> a MaxText (Orbax, scanned) parameter checkpoint.

Input ``hf_checkpoint``: a directory with config.json, *.safetensors and the tokenizer files.
Config (``loraflow.spec.step_configs.ConvertCheckpointConfig``): ``{"model_name": "llama3.1-8b",
"model_overrides": {MaxText key: value}, "scan_layers": true}``; model_name is required (the spec's
base_model.maxtext_model); internal: ``save_dtype`` (float32), ``hardware`` (from JAX's devices).

Uses MaxText's own converter, ``maxtext.checkpoint_conversion.to_maxtext.main``, in-process, with
its snags handled:

* the model must be of a family loraflow supports (``loraflow.models``: the dimension check is the
  family's) and its key one MaxText knows; its HF config is taken from
  ``HF_MODEL_CONFIGS[model_name]``, which for ``llama3.1-8b`` is the real 8B config. We register
  the checkpoint's own config.json under the key, so the parameter mapping and hooks see the
  dimensions of the weights actually being converted (in the shape the family's mapping reads:
  MaxText's Gemma3 mapping wants the multimodal config's ``text_config``, a text-only checkpoint
  has none).
* MaxText's mapping names one key layout per model (Gemma3: ``model.language_model.layers...``);
  a family whose checkpoints come in several (a text-only Gemma3 stores ``model.layers...``, the
  released multimodal ones ``language_model.model.layers...``) says which stored name to read.
* the eager loader opens safetensors with ``framework="pt"`` (torch is not in the trainer image);
  the lazy loader uses numpy when torch is absent and reads one tensor at a time (mmap), so we use
  the lazy loader ...
* ... whose ``LazyTensor`` leaves Orbax v1 refuses to save ("Could not identify a valid handler").
  ``loraflow.trainer.streaming_save`` gives Orbax a handler for them that reads, converts and writes
  one tensor at a time, so peak memory is about the largest converted tensor, not the model (the
  eager path holds the HF state dict and the converted copy at once, and Orbax copies that again):
  on a 1.1 B bf16 checkpoint 2.6 GiB against 10.7 GiB, in 0.82x the wall time (docs/benchmarks.md).
  The task log gets a line per tensor written.

Output: the Orbax checkpoint under ``maxtext/0/items`` and ``loraflow_checkpoint.json`` saying
what to pass as ``load_parameters_path`` (relative to the artifact), the model name, overrides.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from loraflow import models
from loraflow.errors import LoraflowError
from loraflow.spec.step_configs import ConvertCheckpointConfig, parse
from loraflow.steps._harness import StepContext, import_permanently, run_and_exit
from loraflow.trainer.argv import compile_cache_args, hardware_args, overrides_args
from loraflow.trainer.converted import CHECKPOINT_JSON

Progress = Callable[[str], None]  # a line for the task log after each tensor is written

CKPT_SUBDIR = "maxtext"
PARAMS_RELPATH = f"{CKPT_SUBDIR}/0/items"


def register_hf_config(model_name: str, hf_dir: Path) -> Any:
    """Make MaxText's conversion tables use this checkpoint's own config under ``model_name`` (in the
    shape the family's mapping reads, ``ModelFamily.conversion_config``); returns the config as read."""
    import transformers
    from maxtext.checkpoint_conversion.utils import hf_model_configs
    from maxtext.utils.globals import HF_IDS

    if model_name not in HF_IDS:
        raise LoraflowError(f"model_name {model_name!r} is not a MaxText model key (known: {sorted(HF_IDS)[:8]}...)")
    cfg = transformers.AutoConfig.from_pretrained(str(hf_dir))
    hf_model_configs.HF_MODEL_CONFIGS[model_name] = models.family_for(model_name).conversion_config(cfg)
    return cfg


def stored_tensor_names(hf_dir: Path) -> set[str]:
    """Every tensor name the checkpoint holds (the shard index, else each safetensors file's header)."""
    from safetensors import safe_open

    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    names: set[str] = set()
    for path in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="np") as f:
            names.update(f.keys())
    return names


@contextlib.contextmanager
def _stored_names(to_maxtext: Any, family: models.ModelFamily, hf_dir: Path) -> Iterator[None]:
    """While converting, MaxText's loader reads each tensor under the name this checkpoint stores it by
    (``ModelFamily.stored_name``: one family's checkpoints come in more than one key layout)."""
    stored = stored_tensor_names(hf_dir)
    original = to_maxtext.LazyHFLoader.get_tensor

    def get_tensor(self: Any, key: str) -> Any:
        return original(self, family.stored_name(key, stored))

    to_maxtext.LazyHFLoader.get_tensor = get_tensor
    try:
        yield
    finally:
        to_maxtext.LazyHFLoader.get_tensor = original


def progress_line(name: str, nbytes: int, done: dict[str, int], totals: dict[str, Any], seconds: float) -> str:
    """The task log's line after a tensor is written (``done`` counts what is written so far, with it)."""
    return (
        f"wrote {name} ({nbytes / 2**20:,.1f} MiB): {done['tensors']} of {totals.get('tensors')} tensors, "
        f"{done['bytes'] / 2**30:.2f} of {totals.get('bytes', 0) / 2**30:.2f} GiB in {seconds:.0f}s"
    )


@contextlib.contextmanager
def _streaming_save(to_maxtext: Any, captured: dict[str, Any], progress: Progress | None) -> Iterator[None]:
    """While converting, to_maxtext's save counts the tensors into ``captured``, and Orbax writes its lazy
    leaves one at a time (``loraflow.trainer.streaming_save``), with a ``progress`` line after each."""
    import jax
    import numpy as np

    from loraflow.trainer.streaming_save import streaming_leaves

    original = to_maxtext.save_weights_to_checkpoint
    started = time.monotonic()
    done = {"tensors": 0, "bytes": 0}

    def save(path, weights, *a, **kw):
        leaves = jax.tree_util.tree_leaves(weights)
        captured["parameters"] = int(sum(np.prod(x.shape) for x in leaves))
        captured["tensors"] = len(leaves)
        captured["bytes"] = int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in leaves))
        return original(path, weights, *a, **kw)

    def wrote(name: str, nbytes: int) -> None:
        done["tensors"] += 1
        done["bytes"] += nbytes
        if progress is not None:
            progress(progress_line(name, nbytes, done, captured, time.monotonic() - started))

    to_maxtext.save_weights_to_checkpoint = save
    try:
        with streaming_leaves(to_maxtext.LazyTensor, wrote):
            yield
    finally:
        to_maxtext.save_weights_to_checkpoint = original


def _converter_args(
    out_dir: Path, model_name: str, overrides: dict[str, Any], scan_layers: bool, config: dict[str, Any]
) -> list[str]:
    """to_maxtext's command line."""
    return [
        "to_maxtext",
        *overrides_args(model_name, overrides),
        *hardware_args(config.get("hardware")),
        *compile_cache_args(),
        f"scan_layers={str(bool(scan_layers)).lower()}",
        f"base_output_directory={out_dir / CKPT_SUBDIR}",
        "run_name=convert",
        "checkpoint_storage_use_ocdbt=true",
        "checkpoint_storage_use_zarr3=true",
    ]


def convert(
    hf_dir: Path,
    out_dir: Path,
    model_name: str,
    overrides: dict[str, Any],
    scan_layers: bool = True,
    config: dict[str, Any] | None = None,
    save_dtype: str = "float32",
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Convert ``hf_dir`` into ``out_dir/maxtext`` (Orbax); returns facts for the summary."""
    import_permanently("maxtext.checkpoint_conversion.to_maxtext", "maxtext.configs.pyconfig", "transformers")
    from maxtext.checkpoint_conversion import to_maxtext
    from maxtext.configs import pyconfig

    family = models.family_for(model_name)
    hf_cfg = register_hf_config(model_name, hf_dir)
    args = _converter_args(out_dir, model_name, overrides, scan_layers, config or {})
    family.check_dims(hf_cfg, pyconfig.initialize(list(args)))

    captured: dict[str, Any] = {}
    with _streaming_save(to_maxtext, captured, progress), _stored_names(to_maxtext, family, hf_dir):
        to_maxtext.main(
            args,
            lazy_load_tensors=True,
            hf_model_path=str(hf_dir),
            save_dtype=save_dtype,
            simulated_cpu_devices_count=1,
        )
    if not (out_dir / PARAMS_RELPATH).is_dir():
        raise LoraflowError(f"MaxText's converter wrote no checkpoint at {PARAMS_RELPATH}")
    return captured


def _checkpoint_meta(cfg: ConvertCheckpointConfig, parameters: int | None) -> dict[str, Any]:
    """``loraflow_checkpoint.json``: what lora_sft needs to load the converted checkpoint."""
    return {
        "format": "loraflow.maxtext_checkpoint/1",
        "load_parameters_path": PARAMS_RELPATH,
        "model_name": cfg.model_name,
        "model_overrides": cfg.model_overrides,
        "scan_layers": cfg.scan_layers,
        "save_dtype": cfg.save_dtype,
        "parameters": parameters,
    }


def run(ctx: StepContext) -> dict[str, Any]:
    hf_dir = ctx.inputs["hf_checkpoint"]
    cfg = parse(ConvertCheckpointConfig, ctx.config)
    if not (hf_dir / "config.json").is_file() or not list(hf_dir.glob("*.safetensors")):
        raise LoraflowError(f"{hf_dir} holds no HF checkpoint (config.json + *.safetensors)")

    ctx.progress(
        f"converting {hf_dir.name} to MaxText {cfg.model_name} (scan_layers={cfg.scan_layers}, {cfg.save_dtype})"
    )
    started = time.monotonic()
    facts = convert(
        hf_dir,
        ctx.out,
        cfg.model_name,
        cfg.model_overrides,
        cfg.scan_layers,
        cfg.model_dump(),
        cfg.save_dtype,
        progress=ctx.progress,
    )
    seconds = round(time.monotonic() - started, 1)
    (ctx.out / CHECKPOINT_JSON).write_text(json.dumps(_checkpoint_meta(cfg, facts.get("parameters")), indent=2))
    ctx.progress(f"converted {facts.get('parameters')} parameters in {seconds}s -> {PARAMS_RELPATH}")
    return {"parameters": facts.get("parameters"), "path": PARAMS_RELPATH, "convert_seconds": seconds}


if __name__ == "__main__":
    run_and_exit("convert_checkpoint", run)
