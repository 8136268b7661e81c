"""Triggers: what a deferred stage waits on in Airflow's triggerer. Thin: the polling is loraflow's.

``VertexJobTrigger`` polls one Vertex AI CustomJob (``loraflow.launchers.vertex.watch_job``, async REST),
``GkeJobSetTrigger`` one JobSet (``loraflow.launchers.gke.watch_jobset``, kubernetes_asyncio), until it
ends, and fires one event naming the workload, its state and its own error. When a user marks the
deferred task failed or succeeded, or clears it, Airflow calls ``on_kill`` and the job is cancelled
(the JobSet deleted); a triggerer restart or hand-over to another triggerer does not call it, so the
workload keeps running and the trigger resumes polling it wherever it is re-created from
``serialize()``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from loraflow.launchers import gke as launch_gke
from loraflow.launchers import vertex as launch_vertex


class VertexJobTrigger(BaseTrigger):
    """Fires once, when the CustomJob ``job_name`` reaches a terminal state (or cannot be polled)."""

    def __init__(self, *, job_name: str, endpoint: str, stage: str, poll_seconds: float = 30.0) -> None:
        super().__init__()
        self.job_name = job_name
        self.endpoint = endpoint
        self.stage = stage
        self.poll_seconds = float(poll_seconds)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "operators.triggers.VertexJobTrigger",
            {
                "job_name": self.job_name,
                "endpoint": self.endpoint,
                "stage": self.stage,
                "poll_seconds": self.poll_seconds,
            },
        )

    def _client(self) -> launch_vertex.AsyncJobClient:
        return launch_vertex.AsyncJobClient(self.endpoint)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        base = {"job_name": self.job_name, "stage": self.stage}
        try:
            job = await launch_vertex.watch_job(self._client(), self.job_name, self.poll_seconds, self.log.info)
        except Exception as exc:
            diagnosis = launch_vertex.diagnose(exc)
            yield TriggerEvent(
                base
                | {
                    "status": "error",
                    "state": "",
                    "code": diagnosis.status,
                    "message": f"polling the job failed: {type(exc).__name__}: {exc}",
                }
            )
            return
        state = str(job.get("state", ""))
        error = job.get("error") or {}
        yield TriggerEvent(
            base
            | {
                "status": "success" if state == launch_vertex.SUCCEEDED else "failed",
                "state": state,
                "code": error.get("code"),
                "message": str(error.get("message", "")),
            }
        )

    async def on_kill(self) -> None:
        """The user acted on the deferred task: cancel the job (not called on a triggerer restart)."""
        self.log.info("task cancelled by a user action: cancelling Vertex AI job %s", self.job_name)
        await self._client().cancel(self.job_name)
        self.log.info("cancel requested for %s", self.job_name)


class GkeJobSetTrigger(BaseTrigger):
    """Fires once, when the JobSet ``namespace/name`` completes, fails or disappears (or cannot be read).

    ``endpoint``: the Kubernetes API URL the worker used when it came from ``LORAFLOW_GKE_ENDPOINT``
    (tests); ``None``: the triggerer's in-cluster identity or kubeconfig.
    """

    def __init__(
        self, *, namespace: str, name: str, stage: str, poll_seconds: float = 30.0, endpoint: str | None = None
    ) -> None:
        super().__init__()
        self.namespace = namespace
        self.name = name
        self.stage = stage
        self.poll_seconds = float(poll_seconds)
        self.endpoint = endpoint

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "operators.triggers.GkeJobSetTrigger",
            {
                "namespace": self.namespace,
                "name": self.name,
                "stage": self.stage,
                "poll_seconds": self.poll_seconds,
                "endpoint": self.endpoint,
            },
        )

    def _client(self) -> launch_gke.AsyncJobSetClient:
        return launch_gke.AsyncJobSetClient(self.namespace, self.name, self.endpoint)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        base = {"job_name": f"{self.namespace}/{self.name}", "stage": self.stage}
        try:
            state, message = await launch_gke.watch_jobset(self._client(), self.poll_seconds, self.log.info)
        except Exception as exc:
            code = getattr(exc, "status", None)
            yield TriggerEvent(
                base | {"status": "error", "state": "", "code": code, "message": f"reading the JobSet failed: {exc}"}
            )
            return
        yield TriggerEvent(
            base
            | {
                "status": "success" if state == "succeeded" else "failed",
                "state": state,
                "code": None,
                "message": message,
            }
        )

    async def on_kill(self) -> None:
        """The user acted on the deferred task: delete the JobSet and its pods (not on a triggerer restart)."""
        self.log.info("task cancelled by a user action: deleting JobSet %s/%s", self.namespace, self.name)
        await self._client().delete()
        self.log.info("deletion requested for JobSet %s/%s", self.namespace, self.name)
