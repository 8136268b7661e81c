"""The PEFT adapter format, as loraflow writes it (lora_sft's export) and reads it (the merge).

An adapter directory holds ``adapter_model.safetensors`` (``base_model.model.<HF module>.lora_A.weight``
[r, in] and ``...lora_B.weight`` [out, r] per adapted module) and ``adapter_config.json``. Which HF
modules a model has, and how its trained factors become these, is its family's
(:mod:`loraflow.models`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."


def adapter_tensors(modules: Mapping[str, tuple[Any, Any]]) -> dict[str, Any]:
    """PEFT's tensor names for ``{HF module: (lora_A, lora_B)}``."""
    tensors: dict[str, Any] = {}
    for name, (lora_a, lora_b) in modules.items():
        tensors[f"{PEFT_PREFIX}{name}.lora_A.weight"] = lora_a
        tensors[f"{PEFT_PREFIX}{name}.lora_B.weight"] = lora_b
    return tensors


def target_modules(modules: Mapping[str, Any]) -> list[str]:
    """PEFT's ``target_modules``: the HF modules' last names (``q_proj``, ...), sorted."""
    return sorted({name.split(".")[-1] for name in modules})


def adapter_config(base_model: str, rank: int, alpha: float, targets: list[str]) -> dict[str, Any]:
    """``adapter_config.json`` of a plain LoRA adapter (no dropout, bias or DoRA)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": int(rank),
        "lora_alpha": float(alpha),
        "lora_dropout": 0.0,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "use_rslora": False,
        "modules_to_save": None,
    }


def write_adapter(out_dir: Path, tensors: dict[str, Any], config: dict[str, Any]) -> None:
    """Write ``adapter_model.safetensors`` and ``adapter_config.json`` into ``out_dir`` (created)."""
    from safetensors.numpy import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
