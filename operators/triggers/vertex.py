"""What a deferred Vertex AI stage waits on in Airflow's triggerer: one CustomJob, polled over async REST
(``loraflow.launchers.vertex.watch_job``) until it ends. Thin: the polling is loraflow's."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

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
            "operators.triggers.vertex.VertexJobTrigger",
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
