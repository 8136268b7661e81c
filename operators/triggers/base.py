"""What every deferred stage waits on in Airflow's triggerer: one remote job, watched until it ends.

``WorkloadTrigger`` fires one event naming the job, its state, its code and its own message (or why it
could not be read), stores itself for the triggerer as its class path and keyword arguments, and
stops the job when a user acts on the deferred task. A launcher's trigger adds only its watch: what
names the job, how to read it until it ends, why reading failed, how to stop it.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, ClassVar

from airflow.triggers.base import BaseTrigger, TriggerEvent


@dataclass(frozen=True)
class Ending:
    """How a watched job ended: its own state name, whether that is success, its error's code and message."""

    state: str
    succeeded: bool
    code: Any = None
    message: str = ""


class WorkloadTrigger(BaseTrigger):
    """Fires once, when the job ends (or cannot be read). ``serialize`` stores the class path the
    triggerer re-creates it from: a released trigger's module and name never move (operators/triggers/__init__.py)."""

    kind: ClassVar[str]  # how the log names the job: "Vertex AI job"
    named_by: ClassVar[tuple[str, ...]]  # the keyword arguments (attributes) besides stage and poll_seconds

    def __init__(self, *, stage: str, poll_seconds: float = 30.0) -> None:
        super().__init__()
        self.stage = stage
        self.poll_seconds = float(poll_seconds)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        named = {key: getattr(self, key) for key in self.named_by}
        return f"{type(self).__module__}.{type(self).__qualname__}", named | {
            "stage": self.stage,
            "poll_seconds": self.poll_seconds,
        }

    @abstractmethod
    def workload(self) -> str:
        """The job's name in the event (``job_name``) and the log."""

    @abstractmethod
    async def watch(self) -> Ending:
        """Read the job every ``poll_seconds`` until it ends; raise when it cannot be read."""

    @abstractmethod
    def unreadable(self, exc: Exception) -> tuple[Any, str]:
        """The code and message of an event for a job ``watch`` could not read (``exc``)."""

    @abstractmethod
    async def stop(self) -> None:
        """Cancel or delete the job."""

    async def run(self) -> AsyncIterator[TriggerEvent]:
        named = {"job_name": self.workload(), "stage": self.stage}
        try:
            end = await self.watch()
        except Exception as exc:
            code, message = self.unreadable(exc)
            yield TriggerEvent(named | {"status": "error", "state": "", "code": code, "message": message})
            return
        status = "success" if end.succeeded else "failed"
        yield TriggerEvent(named | {"status": status, "state": end.state, "code": end.code, "message": end.message})

    async def on_kill(self) -> None:
        """The user acted on the deferred task (marked it, cleared it): stop the job. Not called on a triggerer restart."""
        self.log.info("task cancelled by a user action: stopping %s %s", self.kind, self.workload())
        await self.stop()
        self.log.info("stop requested for %s %s", self.kind, self.workload())
