"""MaxText's command lines: what the trainer steps (convert_checkpoint, lora_sft) share.
Model-family knowledge is not here: :mod:`loraflow.models`."""

from __future__ import annotations

import os
from typing import Any


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
