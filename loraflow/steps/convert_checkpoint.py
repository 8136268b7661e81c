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
  dimensions of the weights actually being converted.
* the eager loader opens safetensors with ``framework="pt"`` (torch is not in the trainer image);
  the lazy loader uses numpy when torch is absent and reads one tensor at a time (mmap), so we use
  the lazy loader ...
* ... whose ``LazyTensor`` leaves Orbax v1 refuses to save ("Could not identify a valid handler").
  We wrap ``save_weights_to_checkpoint`` to materialise the leaves one by one into numpy arrays
  just before the save. Peak memory is one copy of the converted weights (the eager path holds
  the HF state dict and the converted copy at once).

Output: the Orbax checkpoint under ``maxtext/0/items`` and ``loraflow_checkpoint.json`` saying
what to pass as ``load_parameters_path`` (relative to the artifact), the model name, overrides.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from loraflow import models
from loraflow.errors import LoraflowError
from loraflow.spec.step_configs import ConvertCheckpointConfig, parse
from loraflow.steps._harness import StepContext, exit_process, run_step
from loraflow.steps._maxtext import CHECKPOINT_JSON, hardware_args, overrides_args

CKPT_SUBDIR = "maxtext"
PARAMS_RELPATH = f"{CKPT_SUBDIR}/0/items"


def register_hf_config(model_name: str, hf_dir: Path) -> Any:
    """Make MaxText's conversion tables use this checkpoint's own config under ``model_name``."""
    import transformers
    from maxtext.checkpoint_conversion.utils import hf_model_configs
    from maxtext.utils.globals import HF_IDS

    if model_name not in HF_IDS:
        raise LoraflowError(f"model_name {model_name!r} is not a MaxText model key (known: {sorted(HF_IDS)[:8]}...)")
    cfg = transformers.AutoConfig.from_pretrained(str(hf_dir))
    hf_model_configs.HF_MODEL_CONFIGS[model_name] = cfg
    return cfg


def _materialising_save(original):
    import jax
    import numpy as np

    def save(path, weights, *args, **kwargs):
        # Orbax v1 cannot save to_maxtext's LazyTensor leaves; read them one at a time.
        weights = jax.tree_util.tree_map(
            lambda x: x if isinstance(x, (np.ndarray, jax.Array)) else np.asarray(x), weights
        )
        return original(path, weights, *args, **kwargs)

    return save


@contextlib.contextmanager
def _counting_materialising_save(to_maxtext: Any, captured: dict[str, Any]) -> Iterator[None]:
    """While converting, to_maxtext's save counts the parameters into ``captured`` and materialises the leaves."""
    import jax
    import numpy as np

    original = to_maxtext.save_weights_to_checkpoint
    materialise = _materialising_save(original)

    def save(path, weights, *a, **kw):
        captured["parameters"] = int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(weights)))
        return materialise(path, weights, *a, **kw)

    to_maxtext.save_weights_to_checkpoint = save
    try:
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
        *hardware_args(config),
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
) -> dict[str, Any]:
    """Convert ``hf_dir`` into ``out_dir/maxtext`` (Orbax); returns facts for the summary."""
    from maxtext.checkpoint_conversion import to_maxtext
    from maxtext.configs import pyconfig

    family = models.family_for(model_name)
    hf_cfg = register_hf_config(model_name, hf_dir)
    args = _converter_args(out_dir, model_name, overrides, scan_layers, config or {})
    family.check_dims(hf_cfg, pyconfig.initialize(list(args)))

    captured: dict[str, Any] = {}
    with _counting_materialising_save(to_maxtext, captured):
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
        hf_dir, ctx.out, cfg.model_name, cfg.model_overrides, cfg.scan_layers, cfg.model_dump(), cfg.save_dtype
    )
    seconds = round(time.monotonic() - started, 1)
    (ctx.out / CHECKPOINT_JSON).write_text(json.dumps(_checkpoint_meta(cfg, facts.get("parameters")), indent=2))
    ctx.progress(f"converted {facts.get('parameters')} parameters in {seconds}s -> {PARAMS_RELPATH}")
    return {"parameters": facts.get("parameters"), "path": PARAMS_RELPATH, "convert_seconds": seconds}


if __name__ == "__main__":
    exit_process(run_step("convert_checkpoint", run))
