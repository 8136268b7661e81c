"""What a deferred Vertex AI stage waits on in Airflow's triggerer: one CustomJob, polled over async REST
(``loraflow.launchers.vertex.watch_job``) until it ends. Thin: the polling is loraflow's."""

from __future__ import annotations

from typing import Any

from loraflow.launchers import vertex as launch_vertex
from operators.triggers.base import Ending, WorkloadTrigger


class VertexJobTrigger(WorkloadTrigger):
    """Fires once, when the CustomJob ``job_name`` reaches a terminal state (or cannot be polled)."""

    kind = "Vertex AI job"
    named_by = ("job_name", "endpoint")

    def __init__(self, *, job_name: str, endpoint: str, stage: str, poll_seconds: float = 30.0) -> None:
        super().__init__(stage=stage, poll_seconds=poll_seconds)
        self.job_name = job_name
        self.endpoint = endpoint

    def workload(self) -> str:
        return self.job_name

    def _client(self) -> launch_vertex.AsyncJobClient:
        return launch_vertex.AsyncJobClient(self.endpoint)

    async def watch(self) -> Ending:
        job = await launch_vertex.watch_job(self._client(), self.job_name, self.poll_seconds, self.log.info)
        state, error = str(job.get("state", "")), job.get("error") or {}
        return Ending(state, state == launch_vertex.SUCCEEDED, error.get("code"), str(error.get("message", "")))

    def unreadable(self, exc: Exception) -> tuple[Any, str]:
        return launch_vertex.diagnose(exc).status, f"polling the job failed: {type(exc).__name__}: {exc}"

    async def stop(self) -> None:
        await self._client().cancel(self.job_name)
