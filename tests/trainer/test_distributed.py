"""Joining a multi-host job (loraflow/trainer/distributed.py): the timeouts a spec may set reach JAX's
coordination service, and their defaults are loraflow's, not JAX's where JAX's fail a job that ended well."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytest

pytest.importorskip("jax")

import jax

from loraflow.trainer import distributed

# a job of two processes, this one the second; a coordinator that is not loopback (no gloo rewiring)
JOB = {"LORAFLOW_COORDINATOR": "10.0.0.2:8476", "LORAFLOW_NUM_PROCESSES": "2", "LORAFLOW_PROCESS_ID": "1"}
TIMEOUTS = ("LORAFLOW_JOIN_TIMEOUT", "LORAFLOW_HEARTBEAT_TIMEOUT", "LORAFLOW_SHUTDOWN_TIMEOUT")


def _joined(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> dict[str, Any]:
    """What start_distributed asks jax.distributed.initialize for, under ``env`` (nothing is joined)."""
    for name in TIMEOUTS:
        monkeypatch.delenv(name, raising=False)
    for name, value in {**JOB, **env}.items():
        monkeypatch.setenv(name, value)
    asked: dict[str, Any] = {}
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: asked.update(kwargs))
    collectives = jax.config.jax_cpu_collectives_implementation
    try:
        assert distributed.start_distributed(lambda line: None) is not None
    finally:
        jax.config.update("jax_cpu_collectives_implementation", collectives)
    return asked


def test_a_job_that_ended_well_waits_an_hour_for_process_0_not_jaxs_five_minutes(monkeypatch) -> None:
    """Past the shutdown barrier's bound JAX's coordination service aborts every process of the job (status
    134), process 0 in the middle of writing and committing the outputs the others wait for: measured with
    two CPU processes, a 5 s bound and a process 0 that took 15 s. JAX's 300 s is less than a large model's
    outputs may take; a process 0 that dies is caught by the heartbeat (100 s), whatever this bound."""
    asked = _joined(monkeypatch, {})
    assert asked["shutdown_timeout_seconds"] == distributed.SHUTDOWN_TIMEOUT == 3600
    assert (distributed.JOIN_TIMEOUT, distributed.HEARTBEAT_TIMEOUT) == (300, 100)
    assert (asked["initialization_timeout"], asked["heartbeat_timeout_seconds"]) == (300, 100)
    assert (asked["coordinator_address"], asked["num_processes"], asked["process_id"]) == ("10.0.0.2:8476", 2, 1)


def test_the_timeouts_a_spec_sets_reach_the_coordination_service(monkeypatch) -> None:
    asked = _joined(
        monkeypatch,
        {"LORAFLOW_JOIN_TIMEOUT": "600", "LORAFLOW_HEARTBEAT_TIMEOUT": "120", "LORAFLOW_SHUTDOWN_TIMEOUT": "7200"},
    )
    assert (asked["initialization_timeout"], asked["heartbeat_timeout_seconds"]) == (600, 120)
    assert asked["shutdown_timeout_seconds"] == 7200


@pytest.mark.parametrize("value", ["1h", "0", "86401", " 60"])
def test_a_timeout_that_is_not_whole_seconds_in_range_is_refused_by_name_before_joining(monkeypatch, value) -> None:
    """Set by the deployer, not a spec (which refuses it at validation): named with its range and the
    fix, before anything is joined, not a bare ValueError from int() or a bound JAX takes as it is."""
    from loraflow.errors import LoraflowError

    with pytest.raises(LoraflowError) as refused:
        _joined(monkeypatch, {"LORAFLOW_SHUTDOWN_TIMEOUT": value})
    assert str(refused.value).startswith("LORAFLOW_SHUTDOWN_TIMEOUT: the value ")
    assert "whole seconds from 1 to 86400" in str(refused.value) and "(default 3600), or unset it" in str(refused.value)
