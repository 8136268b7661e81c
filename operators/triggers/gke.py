"""What a deferred GKE stage waits on in Airflow's triggerer: one JobSet, read with kubernetes_asyncio
(``loraflow.launchers.gke.watch_jobset``) until it ends. Thin: the polling is loraflow's."""

from __future__ import annotations

from typing import Any

from loraflow.launchers import gke as launch_gke
from operators.triggers.base import Ending, WorkloadTrigger


class GkeJobSetTrigger(WorkloadTrigger):
    """Fires once, when the JobSet ``namespace/name`` completes, fails or disappears (or cannot be read).

    ``endpoint``: the Kubernetes API URL the worker used when it came from ``LORAFLOW_GKE_ENDPOINT``
    (tests); ``None``: the triggerer's in-cluster identity or kubeconfig.
    """

    kind = "JobSet"
    named_by = ("namespace", "name", "endpoint")

    def __init__(
        self, *, namespace: str, name: str, stage: str, poll_seconds: float = 30.0, endpoint: str | None = None
    ) -> None:
        super().__init__(stage=stage, poll_seconds=poll_seconds)
        self.namespace = namespace
        self.name = name
        self.endpoint = endpoint

    def workload(self) -> str:
        return f"{self.namespace}/{self.name}"

    def _client(self) -> launch_gke.AsyncJobSetClient:
        return launch_gke.AsyncJobSetClient(self.namespace, self.name, self.endpoint)

    async def watch(self) -> Ending:
        state, message = await launch_gke.watch_jobset(self._client(), self.poll_seconds, self.log.info)
        return Ending(state, state == "succeeded", None, message)

    def unreadable(self, exc: Exception) -> tuple[Any, str]:
        return getattr(exc, "status", None), f"reading the JobSet failed: {exc}"

    async def stop(self) -> None:
        """Delete the JobSet and its pods."""
        await self._client().delete()
