"""What a deferred GKE stage waits on in Airflow's triggerer: one JobSet, read with kubernetes_asyncio
(``loraflow.launchers.gke.watch_jobset``) until it ends. Thin: the polling is loraflow's."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from loraflow.launchers import gke as launch_gke


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
            "operators.triggers.gke.GkeJobSetTrigger",
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
