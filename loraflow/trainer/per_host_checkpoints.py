"""Tunix's checkpoint manager with every host a primary writing to its own local directory.

Orbax's default has process 0 write the metadata and each replicated shard written once (replica 0):
no host's directory then holds everything it restores. Here every host writes the metadata and every
shard it holds (replicas included), as Orbax's own local checkpointing does, so each host restores
from its own directory alone. lora_sft uses it for staged checkpoints on several hosts
(:mod:`loraflow.trainer.checkpoints`). Imports Tunix and Orbax: imported only once the step program
has loaded them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import orbax.checkpoint as ocp
from tunix.sft.checkpoint_manager import CheckpointManager

_EVERY_HOST = ocp.options.MultiprocessingOptions(primary_host=None, barrier_sync_key_prefix="loraflow-host")


class PerHostCheckpointManager(CheckpointManager):
    def __init__(self, root_directory: str | None = None, options: Any = None) -> None:
        super().__init__(None, options)  # Tunix's own Orbax manager: none
        if root_directory is None:
            return
        arrays = ocp.type_handlers.create_type_handler_registry(
            (jax.Array, ocp.type_handlers.ArrayHandler(primary_host=None, replica_id=None, use_replica_parallel=False))
        )
        self._checkpoint_manager = ocp.CheckpointManager(
            root_directory,
            item_handlers={
                "model_params": _pytree_handler(arrays),
                "optimizer_state": _pytree_handler(arrays),
                "custom_metadata": ocp.JsonCheckpointHandler(multiprocessing_options=_EVERY_HOST),
            },
            options=dataclasses.replace(
                options or ocp.CheckpointManagerOptions(),
                multiprocessing_options=_EVERY_HOST,
                enable_per_process_directory_creation=True,
            ),
        )


def _pytree_handler(arrays: Any) -> Any:
    """A pytree handler that every host writes with, its arrays (``arrays``: the type handler registry) included."""
    return ocp.PyTreeCheckpointHandler(multiprocessing_options=_EVERY_HOST, type_handler_registry=arrays)
