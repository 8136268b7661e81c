"""The trained adapter out of the trainer, and written: ``adapter/`` (Orbax, as MaxText restores it, with
``loraflow_adapter.json``) and ``peft/`` (PEFT's HF layout, checked against MaxText's own MaxText->HF hooks)."""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraflow import models
from loraflow.errors import LoraflowError
from loraflow.launchers import multihost
from loraflow.lora import peft
from loraflow.spec.step_configs import LoraSftConfig
from loraflow.trainer.converted import ConvertedModel
from loraflow.trainer.distributed import barrier
from loraflow.trainer.host_build import host_cpu

ADAPTER_JSON = "loraflow_adapter.json"


@dataclass(frozen=True)
class PeftExport:
    tensors: int
    target_modules: list[str]
    check_max_abs_diff: float  # against MaxText's own MaxText->HF mapping of the full delta


def trained_adapter(trainer: Any, dist: multihost.DistributedConfig | None) -> Any:
    """The trained LoRA params as a tree of numpy arrays (the whole adapter, on every process)."""
    from flax import nnx

    lora_dict = nnx.state(trainer.model, nnx.LoRAParam).to_pure_dict()
    if dist is not None:
        # Sharded across processes: every process gathers the whole adapter (a collective), and
        # nobody goes on before every process's checkpoint writes are done.
        from jax.experimental import multihost_utils

        lora_dict = multihost_utils.process_allgather(lora_dict, tiled=True)
        barrier("training done")
    return _to_numpy_tree(lora_dict)


def write_adapter(
    adapter_dir: Path, params_dir: Path, lora_tree: Any, meta: dict[str, Any], dist: multihost.DistributedConfig | None
) -> None:
    """adapter/: the final LoRA params exactly as Tunix checkpointed them in ``params_dir``
    (lora.lora_restore_path), and ``meta`` as loraflow_adapter.json."""
    if dist is None and params_dir.is_dir():
        shutil.copytree(params_dir, adapter_dir / "model_params")
    else:  # direct mode, or several hosts (this one's directory holds its shards only): save the params ourselves
        _save_params(adapter_dir / "model_params", lora_tree, dist)
    (adapter_dir / ADAPTER_JSON).write_text(json.dumps(meta, indent=2))


def adapter_meta(
    cfg: LoraSftConfig, model: ConvertedModel, mt_config: Any, steps: int, template: dict[str, Any]
) -> dict[str, Any]:
    """``loraflow_adapter.json``: how to restore the adapter into MaxText, and what it was trained for."""
    return {
        "format": "loraflow.lora_adapter/1",
        "lora_restore_path": "model_params",
        "rank": int(cfg.rank),
        "alpha": float(cfg.alpha),
        "target_modules": cfg.target_modules,
        "lora_module_path": _module_path(mt_config),
        "model_name": model.name,
        "model_overrides": model.overrides,
        "scan_layers": model.scan_layers,
        "quantization": cfg.quantization,
        "tile_size": cfg.tile_size,
        "steps": steps,
        "chat_template": template,
    }


def export_peft(
    lora_tree: dict[str, Any],
    mt_config: Any,
    hf_config: Any,
    rank: int,
    alpha: float,
    out_dir: Path,
    base_model: str = "",
) -> PeftExport:
    """Write ``adapter_model.safetensors`` + ``adapter_config.json`` (PEFT, HF layout).

    The model's family (``loraflow.models``) turns the MaxText LoRA factors into PEFT's: its parameter
    mapping names the HF modules, MaxText's own MaxText->HF hooks lay out lora_B, and every (module,
    layer) is checked against those hooks applied to the full MaxText-space delta, on the host's CPU.
    """
    import jax

    family = models.family_for(mt_config.model_name)
    # on the host: MaxText's hooks reach for jax.numpy (Llama's RoPE layout), and on an accelerator the full
    # deltas of the check would land beside the trained model (8B nf4 on a v5e: its peak +0.31 GiB here).
    # Without a CPU backend (JAX_PLATFORMS=tpu), JAX's default device (None): the training is done by now,
    # and the export must not fail for want of a place to check it.
    with jax.default_device(host_cpu()):
        modules, max_err = family.peft_modules(flatten(lora_tree), mt_config, hf_config, float(alpha) / float(rank))
    tensors = peft.adapter_tensors(modules)
    targets = peft.target_modules(modules)
    peft.write_adapter(out_dir, tensors, peft.adapter_config(base_model, rank, alpha, targets))
    return PeftExport(len(tensors), targets, max_err)


def lora_b_norm(lora_tree: Any) -> float:
    """The norm of every lora_b together; refuses an all-zero adapter."""
    norm = math.sqrt(
        sum(float((v.astype("float64") ** 2).sum()) for k, v in flatten(lora_tree).items() if "lora_b" in "/".join(k))
    )
    if norm == 0.0:
        raise LoraflowError("the trained adapter is all zeros (lora_b never moved)")
    return norm


def flatten(tree: dict[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """A nested dict as ``{path: leaf}``."""
    out: dict[tuple[str, ...], Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out |= flatten(v, (*prefix, k))
        else:
            out[(*prefix, k)] = v
    return out


def _save_params(path: Path, lora_tree: Any, dist: multihost.DistributedConfig | None) -> None:
    import orbax.checkpoint as ocp

    # Only this process writes (the others are done): Orbax must not wait for them at its barriers.
    alone = ocp.options.MultiprocessingOptions(primary_host=0, active_processes={0}) if dist is not None else None
    handler = ocp.PyTreeCheckpointHandler(**({"multiprocessing_options": alone} if alone else {}))
    checkpointer = ocp.Checkpointer(handler, **({"multiprocessing_options": alone} if alone else {}))
    checkpointer.save(str(path.resolve()), _with_value(lora_tree))


def _to_numpy_tree(tree: Any) -> Any:
    import numpy as np

    if isinstance(tree, dict):
        return {str(k): _to_numpy_tree(v) for k, v in tree.items()}
    return np.asarray(tree)


def _with_value(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _with_value(v) for k, v in tree.items()}
    return {"value": tree}


def _module_path(mt_config: Any) -> Any:
    from maxtext.utils import lora_utils

    return lora_utils._get_lora_module_path(mt_config)  # pylint: disable=protected-access
