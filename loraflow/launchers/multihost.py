"""Multi-host wiring: which process this is, how many there are and where the coordinator listens.

The one place that reads what each platform gives a replica, used by every launcher and by the step
programs (``jax.distributed.initialize(**cfg.jax_kwargs())``). Pure: it reads a mapping, by default
``os.environ``, and returns a :class:`DistributedConfig`, or ``None`` for a single process.

Read in this order (the first form present wins):

1. local / explicit: ``LORAFLOW_COORDINATOR`` (host:port), ``LORAFLOW_NUM_PROCESSES``,
   ``LORAFLOW_PROCESS_ID``, all three or none. What N processes on loopback use, and an escape hatch
   anywhere else.
2. Vertex AI: ``CLUSTER_SPEC``, the JSON every replica of a CustomJob gets:
   ``{"cluster": {"workerpool0": ["host:port", ...], ...}, "task": {"type": "workerpool0", "index": i}}``.
   Processes are numbered across the worker pools in pool order; the coordinator is the first
   replica of workerpool0, on the port Vertex lists for it.
3. GKE (JobSet, one pod per TPU host): the process id from ``TPU_WORKER_ID`` (set by GKE's TPU
   webhook) or ``JOB_COMPLETION_INDEX`` (an indexed Job); the hosts from ``TPU_WORKER_HOSTNAMES``
   (comma-separated; the coordinator is the first) or, without it, ``LORAFLOW_COORDINATOR_HOST`` (the
   JobSet's first pod, behind its headless service) plus ``LORAFLOW_EXPECTED_HOSTS``. The coordinator port is ``LORAFLOW_COORDINATOR_PORT`` (default 8476).

A launcher may also set ``LORAFLOW_EXPECTED_HOSTS``: when the platform reports a different number of
processes, this fails at start-up instead of hanging in a barrier for the missing hosts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from loraflow.errors import LoraflowError

DEFAULT_COORDINATOR_PORT = 8476
LOCAL_KEYS = ("LORAFLOW_COORDINATOR", "LORAFLOW_NUM_PROCESSES", "LORAFLOW_PROCESS_ID")


class MultiHostError(LoraflowError):
    """The environment describes a multi-host job inconsistently."""


@dataclass(frozen=True)
class DistributedConfig:
    coordinator: str  # host:port of process 0's coordination service
    num_processes: int
    process_id: int
    source: str  # "local", "vertex" or "gke": where it was read from

    def __post_init__(self) -> None:
        if self.num_processes < 1:
            raise MultiHostError(f"{self.source}: the number of processes must be >= 1, got {self.num_processes}")
        if not 0 <= self.process_id < self.num_processes:
            raise MultiHostError(
                f"{self.source}: process id {self.process_id} is outside 0..{self.num_processes - 1}; "
                "every host must get a distinct id below the number of processes"
            )
        host, sep, port = self.coordinator.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise MultiHostError(f"{self.source}: coordinator {self.coordinator!r} is not host:port")

    @property
    def is_coordinator(self) -> bool:
        """Process 0: the one that commits manifests."""
        return self.process_id == 0

    def jax_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``jax.distributed.initialize``."""
        return {
            "coordinator_address": self.coordinator,
            "num_processes": self.num_processes,
            "process_id": self.process_id,
        }

    def env(self) -> dict[str, str]:
        """The local form of this config (what a launcher sets for each local process)."""
        return {
            "LORAFLOW_COORDINATOR": self.coordinator,
            "LORAFLOW_NUM_PROCESSES": str(self.num_processes),
            "LORAFLOW_PROCESS_ID": str(self.process_id),
        }


def distributed_config(environ: Mapping[str, str] | None = None) -> DistributedConfig | None:
    """The multi-host wiring this process was started with; ``None`` when it runs alone."""
    env = os.environ if environ is None else environ
    cfg = _local(env) or _vertex(env) or _gke(env)
    expected = env.get("LORAFLOW_EXPECTED_HOSTS")
    got = cfg.num_processes if cfg else 1
    if expected is not None and _int(expected, "LORAFLOW_EXPECTED_HOSTS", "launcher") != got:
        where = f"the {cfg.source} environment" if cfg else "the environment (no multi-host wiring found)"
        raise MultiHostError(
            f"the launcher asked for {expected} hosts but {where} describes {got}; "
            "check compute.hosts against the machine type and TPU topology"
        )
    if cfg is None or cfg.num_processes == 1:
        return None
    return cfg


def _int(value: str, key: str, source: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise MultiHostError(f"{source}: {key}={value!r} is not an integer") from None


def _local(env: Mapping[str, str]) -> DistributedConfig | None:
    present = [k for k in LOCAL_KEYS if k in env]
    if not present:
        return None
    missing = [k for k in LOCAL_KEYS if k not in env]
    if missing:
        raise MultiHostError(
            f"local: {', '.join(present)} set without {', '.join(missing)}; set all three or none of {', '.join(LOCAL_KEYS)}"
        )
    return DistributedConfig(
        env["LORAFLOW_COORDINATOR"],
        _int(env["LORAFLOW_NUM_PROCESSES"], "LORAFLOW_NUM_PROCESSES", "local"),
        _int(env["LORAFLOW_PROCESS_ID"], "LORAFLOW_PROCESS_ID", "local"),
        "local",
    )


def _pool_order(name: str) -> tuple[int, str]:
    digits = name.removeprefix("workerpool")
    return (int(digits), name) if digits.isdigit() else (1 << 30, name)


def _vertex(env: Mapping[str, str]) -> DistributedConfig | None:
    raw = env.get("CLUSTER_SPEC")
    if not raw:
        return None
    try:
        spec = json.loads(raw)
        cluster: dict[str, list[str]] = spec["cluster"]
        task_type: str = spec["task"]["type"]
        index = int(spec["task"]["index"])
    except (ValueError, KeyError, TypeError) as exc:
        raise MultiHostError(
            f"vertex: CLUSTER_SPEC is not the JSON Vertex AI sets ({type(exc).__name__}: {exc}): {raw[:200]}"
        ) from None
    pools = sorted(cluster, key=_pool_order)
    if task_type not in cluster:
        raise MultiHostError(f"vertex: CLUSTER_SPEC task type {task_type!r} is not one of its pools {pools}")
    hosts = [h for p in pools for h in cluster[p]]
    if not cluster.get("workerpool0"):
        raise MultiHostError("vertex: CLUSTER_SPEC has no workerpool0 replica to coordinate")
    offset = sum(len(cluster[p]) for p in pools[: pools.index(task_type)])
    return DistributedConfig(cluster["workerpool0"][0], len(hosts), offset + index, "vertex")


def _gke(env: Mapping[str, str]) -> DistributedConfig | None:
    raw_id = env.get("TPU_WORKER_ID", env.get("JOB_COMPLETION_INDEX"))
    if raw_id is None:
        return None
    port = _int(env.get("LORAFLOW_COORDINATOR_PORT", str(DEFAULT_COORDINATOR_PORT)), "LORAFLOW_COORDINATOR_PORT", "gke")
    hostnames = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
    if hostnames:
        coordinator_host, count = hostnames[0], len(hostnames)
    elif "LORAFLOW_COORDINATOR_HOST" in env and "LORAFLOW_EXPECTED_HOSTS" in env:
        coordinator_host = env["LORAFLOW_COORDINATOR_HOST"]
        count = _int(env["LORAFLOW_EXPECTED_HOSTS"], "LORAFLOW_EXPECTED_HOSTS", "gke")
    else:
        raise MultiHostError(
            "gke: a process index is set (TPU_WORKER_ID / JOB_COMPLETION_INDEX) but not the hosts; set "
            "TPU_WORKER_HOSTNAMES, or LORAFLOW_COORDINATOR_HOST and LORAFLOW_EXPECTED_HOSTS"
        )
    return DistributedConfig(f"{coordinator_host}:{port}", count, _int(raw_id, "process id", "gke"), "gke")
