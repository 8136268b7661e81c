"""The convert_checkpoint artifact as lora_sft reads it: its metadata file and the model it holds."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraflow.errors import LoraflowError
from loraflow.spec.step_configs import LoraSftConfig
from loraflow.storage.local_paths import safe_join

CHECKPOINT_JSON = "loraflow_checkpoint.json"  # convert_checkpoint's output, read by lora_sft


@dataclass(frozen=True)
class ConvertedModel:
    """The model lora_sft trains: the converted checkpoint's, which the config may only repeat."""

    name: str  # MaxText's model_name
    overrides: dict[str, Any]  # MaxText's model config overrides
    scan_layers: bool
    parameters_path: str  # MaxText's load_parameters_path: the Orbax params inside the checkpoint input


def read_converted(cfg: LoraSftConfig, checkpoint_dir: Path) -> ConvertedModel:
    """The model of the checkpoint in ``checkpoint_dir``; the config's model_name and model_overrides
    (null: the checkpoint's) must be the checkpoint's."""
    meta_path = checkpoint_dir / CHECKPOINT_JSON
    if not meta_path.is_file():
        raise LoraflowError(f"input checkpoint has no {CHECKPOINT_JSON}: not a convert_checkpoint artifact")
    meta = json.loads(meta_path.read_text())
    stored_overrides = meta.get("model_overrides") or {}
    name = cfg.model_name or meta["model_name"]
    overrides = dict(stored_overrides if cfg.model_overrides is None else cfg.model_overrides)
    if name != meta["model_name"] or overrides != dict(stored_overrides):
        raise LoraflowError(
            f"model {name} {overrides} differs from the converted checkpoint's "
            f"{meta['model_name']} {meta.get('model_overrides')}"
        )
    parameters = safe_join(checkpoint_dir, meta["load_parameters_path"], what=f"the checkpoint's {CHECKPOINT_JSON}")
    return ConvertedModel(name, overrides, meta.get("scan_layers", True), str(parameters))
