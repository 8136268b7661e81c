"""The convert_checkpoint artifact as lora_sft reads it: its metadata file."""

from __future__ import annotations

CHECKPOINT_JSON = "loraflow_checkpoint.json"  # convert_checkpoint's output, read by lora_sft
