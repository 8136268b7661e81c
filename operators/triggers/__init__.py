"""Triggers: what a deferred stage waits on in Airflow's triggerer, one module per launcher that can defer,
each a ``WorkloadTrigger`` (``operators/triggers/base.py``: the event, serialization, on_kill) with only its watch.

``VertexJobTrigger`` polls one Vertex AI CustomJob (``loraflow.launchers.vertex.watch_job``, async REST),
``GkeJobSetTrigger`` one JobSet (``loraflow.launchers.gke.watch_jobset``, kubernetes_asyncio), until it
ends, and fires one event naming the workload, its state and its own error. When a user marks the
deferred task failed or succeeded, or clears it, Airflow calls ``on_kill`` and the job is cancelled
(the JobSet deleted); a triggerer restart or hand-over to another triggerer does not call it, so the
workload keeps running and the trigger resumes polling it wherever it is re-created from
``serialize()``.

A launcher class names its trigger's class path (``loraflow.launchers.base.Launcher.trigger``) and its
``submit`` says what to watch (``loraflow.launchers.base.Workload.trigger``). A trigger's class path is stored in the triggerer's
database while a task is deferred: every path a released version wrote keeps importing here
(``operators.triggers.VertexJobTrigger`` and ``operators.triggers.GkeJobSetTrigger`` from before the
split into modules), so an upgrade does not strand a running job.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from loraflow.launchers.registry import LAUNCHERS
from operators.triggers.gke import GkeJobSetTrigger
from operators.triggers.vertex import VertexJobTrigger

if TYPE_CHECKING:
    from airflow.triggers.base import BaseTrigger

    from loraflow.launchers.base import Workload

__all__ = ["GkeJobSetTrigger", "VertexJobTrigger", "trigger_class", "trigger_for"]


def trigger_class(launcher: str) -> type[BaseTrigger]:
    """The trigger class the launcher ``launcher`` names (its class path, as the triggerer stores it)."""
    path = LAUNCHERS[launcher].trigger
    if path is None:
        raise TypeError(f"the {launcher} launcher has no trigger: its tasks cannot defer")
    module, _, name = path.rpartition(".")
    cls: type[BaseTrigger] = getattr(importlib.import_module(module), name)
    return cls


def trigger_for(launcher: str, workload: Workload) -> BaseTrigger:
    """The trigger that watches ``workload``, a job the launcher ``launcher`` submitted."""
    return trigger_class(launcher)(**workload.trigger, poll_seconds=workload.poll_seconds)
