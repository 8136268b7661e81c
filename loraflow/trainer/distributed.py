"""A job of several processes (``loraflow.launchers.multihost``): joining it, and the collectives lora_sft uses.

Every process calls ``jax.distributed.initialize`` with its wiring before JAX starts; MaxText's mesh
then spans every process's devices (parameters sharded across hosts, each host loading its share of
every batch). Losing a host: the others stop within ``LORAFLOW_HEARTBEAT_TIMEOUT`` seconds (default
100: JAX's coordination service) and the job fails; the retry resumes from the newest committed
checkpoint. A host whose step fails leaves the same way: lora_sft exits at once when :func:`in_a_job`
(``run_and_exit``'s ``leave_at_once``), whatever it raised, not through JAX's shutdown barrier. A job that
ended well: the other processes wait in that barrier while process 0 commits the outputs, up to
``LORAFLOW_SHUTDOWN_TIMEOUT`` seconds (default :data:`SHUTDOWN_TIMEOUT`, an hour; JAX's own 300 s).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from loraflow.errors import LoraflowError
from loraflow.launchers import multihost
from loraflow.spec import env_rules
from loraflow.trainer.sft_run import Progress

# Seconds, unless the step's environment says otherwise: a host joining (LORAFLOW_JOIN_TIMEOUT), a host
# silent before the others stop (LORAFLOW_HEARTBEAT_TIMEOUT, JAX's default), and the other hosts of a job
# that ended well waiting for process 0's outputs (LORAFLOW_SHUTDOWN_TIMEOUT; JAX's is 300).
JOIN_TIMEOUT, HEARTBEAT_TIMEOUT, SHUTDOWN_TIMEOUT = 300, 100, 3600


def start_distributed(progress: Progress) -> multihost.DistributedConfig | None:
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
    progress(f"process {dist.process_id} of {dist.num_processes} ({dist.source}): joining {dist.coordinator}")
    jax.distributed.initialize(
        **dist.jax_kwargs(),
        initialization_timeout=_seconds("LORAFLOW_JOIN_TIMEOUT", JOIN_TIMEOUT),
        # A lost host: the others stop within this many seconds instead of waiting in a collective.
        heartbeat_timeout_seconds=_seconds("LORAFLOW_HEARTBEAT_TIMEOUT", HEARTBEAT_TIMEOUT),
        # Hosts that ended well wait in JAX's shutdown barrier while process 0 writes, exports and commits the
        # outputs. Past this bound the coordination service aborts every process (status 134), process 0
        # in the middle of its commit: JAX's 300 s is too short for a large model's outputs; a process 0 that
        # dies is caught by the heartbeat, not this bound.
        shutdown_timeout_seconds=_seconds("LORAFLOW_SHUTDOWN_TIMEOUT", SHUTDOWN_TIMEOUT),
        coordinator_bind_address=dist.coordinator if loopback else None,
    )
    if loopback:
        _gloo_on_loopback()
    progress(
        f"process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} local of "
        f"{jax.device_count()} {jax.default_backend()} devices"
    )
    return dist


def _seconds(name: str, default: int) -> int:
    """The step environment's ``name`` (a timeout in whole seconds), checked as a spec's value is
    (:func:`loraflow.spec.env_rules.value_problem`: the deployer may set it too), else ``default``."""
    value = os.environ.get(name)
    if value is None:
        return default
    problem = env_rules.value_problem(name, value)
    if problem:
        raise LoraflowError(f"{name}: {problem} (default {default}), or unset it")
    return int(value)


def in_a_job() -> bool:
    """Whether this process joined a job of several processes (:func:`start_distributed`)."""
    if "jax" not in sys.modules:  # nothing joined anything: no need to import JAX to say so
        return False
    import jax

    return jax.distributed.is_initialized()


def _gloo_on_loopback() -> None:
    """Make the CPU client's gloo collectives listen on 127.0.0.1 (default: the host name's address)."""
    from jax._src import distributed, xla_bridge
    from jax._src.lib import _jax

    def factory() -> Any:
        gloo = _jax.make_gloo_tcp_collectives(distributed.global_state.client, hostname="127.0.0.1")
        return xla_bridge.make_cpu_client(collectives=gloo)

    xla_bridge.register_backend_factory("cpu", factory, priority=0, fail_quietly=False)


def barrier(name: str) -> None:
    """Every process waits here until all have come (a collective)."""
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(f"loraflow lora_sft {name}")


def gather_ints(value: int) -> list[int]:
    """Every process's ``value``, in process order (a collective: every process must call it)."""
    import numpy as np
    from jax.experimental import multihost_utils

    return [int(v) for v in np.asarray(multihost_utils.process_allgather(np.int32(value))).reshape(-1)]


def sharding_note(model: Any, mesh: Any) -> str:
    """How the model's arrays lie across the processes (what a multi-host run logs once)."""
    import jax
    from flax import nnx

    leaves = [x for x in jax.tree_util.tree_leaves(nnx.state(model)) if isinstance(x, jax.Array)]
    split = sum(1 for x in leaves if not x.is_fully_addressable)
    return (
        f"mesh {dict(mesh.shape)} over {jax.process_count()} processes: {split} of {len(leaves)} model arrays "
        "sharded across processes"
    )
