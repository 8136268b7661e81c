"""The launcher interface: everything the runner, the planner and the operators ask of a launcher.

A launcher runs one stage's step program somewhere (a local process, a Vertex AI CustomJob, a GKE
JobSet) with the same argv, streams or points at its output, and can be killed. A remote launcher
can also hand its job to Airflow's triggerer: ``submit`` starts (or reattaches to) the job and says
what the trigger must watch; ``failure`` turns the trigger's event into the job's own error.
Nobody outside ``loraflow/launchers/`` branches on a launcher's name: they ask the launcher
(``loraflow/launchers/registry.py`` maps ``compute.<stage>.launcher`` to its class). A launcher class
names its config class (and so its name), its trigger and the request ``loraflow plan`` shows.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from loraflow.errors import LoraflowError, StepError
from loraflow.spec.compute import launcher_name

if TYPE_CHECKING:
    from loraflow.launchers.environments import Environment
    from loraflow.launchers.identity import JobIdentity
    from loraflow.spec.compute import AnyCompute, RemoteCompute

LineSink = Callable[[str], None]

#: What every step's environment holds, whatever the worker, the spec's compute.env or a secret says:
#: every launcher sets it last (``local.step_environment``, ``vertex_job.container_env``,
#: ``gke_jobset.container_env``). Steps read models from the stage's inputs, never from the Hugging
#: Face hub; no library reports usage to its makers (vLLM sends usage statistics unless told not to;
#: DO_NOT_TRACK is the convention vLLM and others honour; the hub client's telemetry off as well).
STEP_ENV: Mapping[str, str] = {
    "PYTHONUNBUFFERED": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
}


@dataclass(frozen=True)
class Workload:
    """A remote job a launcher started or reattached to."""

    name: str  # how logs and the trigger name it: a CustomJob's resource name, a JobSet's namespace/name
    link: str  # where a person watches it: the task's "Remote job" link
    succeeded: bool = False  # reattached to one that had already succeeded
    poll_seconds: float = 30.0
    trigger: dict[str, Any] = field(default_factory=dict)  # the launcher's trigger's keyword arguments


@dataclass(frozen=True)
class WorkloadFailure:
    """Why a remote job ended without success, and whether it is the user's to fix (retrying cannot help)."""

    error: StepError
    users: bool


@dataclass(frozen=True)
class PlanRequest:
    """The request a remote launcher would send, as ``loraflow plan`` shows it (not sent)."""

    key: str  # its key in a stage of ``loraflow plan --json``
    title: str  # how ``loraflow plan`` titles it


WorkloadSink = Callable[[Workload], None]


def ignore_workload(_: Workload) -> None:
    return None


class Launcher(ABC):
    """Runs one stage's step program; one subclass per ``compute.<stage>.launcher``."""

    config: ClassVar[type[AnyCompute]]  # its ``compute.<stage>`` class (loraflow/spec/compute.py)
    name: ClassVar[str]  # the spec's launcher name: its config's ``launcher``
    where: ClassVar[str]  # how the task log names the place: "on Vertex AI"
    trigger: ClassVar[str | None] = None  # the class path of the Airflow trigger that watches its job
    plan_request: ClassVar[PlanRequest | None] = None  # what ``loraflow plan`` shows of its request

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "config" in vars(cls):
            cls.name = launcher_name(cls.config)

    def __init__(self, compute: AnyCompute, identity: JobIdentity, output_prefix: str) -> None:
        self.compute = compute
        self.identity = identity
        self.output_prefix = output_prefix

    def python(self, env: Environment, *, installed: bool = True) -> str:
        """The interpreter that runs the step program: the image's ``python`` unless overridden.
        ``installed=False``: where it would be, for a plan made on a machine without it."""
        return "python"

    def check_secrets(self, secrets: Mapping[str, str]) -> None:
        """Refuse secrets this launcher cannot pass to its step (the default: none can be passed)."""
        if secrets:
            raise LoraflowError(
                f"stage {self.identity.stage} runs {self.where}, where loraflow does not pass secrets "
                f"({', '.join(sorted(secrets))}); {self.secrets_advice()}, or limit secrets.*.stages to local stages"
            )

    def secrets_advice(self) -> str:
        return "give the job's identity access instead"

    def summary(self, env: Environment) -> str:
        """Where the stage runs, as the task log says it."""
        return f"{self.where} ({getattr(self.compute, 'machine_type', None)} x {self.compute.hosts})"

    @property
    def deferrable(self) -> bool:
        """Whether a task may wait for this launcher's job in Airflow's triggerer."""
        return False

    @abstractmethod
    def run(
        self,
        argv: Sequence[str],
        sink: LineSink,
        extra_env: Mapping[str, str] = {},
        secrets: Mapping[str, str] = {},
        on_workload: WorkloadSink = ignore_workload,
    ) -> None:
        """Run the step to its end in this process; raise ``StepError`` with its own error otherwise.
        ``on_workload`` is told about a remote job as soon as it exists (its link, for the task)."""

    @abstractmethod
    def kill(self) -> None:
        """Stop the step (Airflow's ``on_kill``); a remote job is cancelled or deleted."""

    def submit(self, argv: Sequence[str], sink: LineSink, extra_env: Mapping[str, str] = {}) -> Workload:
        """Start (or reattach to) the job and return at once: the first half of a deferred task."""
        raise LoraflowError(f"the {self.name} launcher cannot hand its step to Airflow's triggerer")

    def failure(self, event: Mapping[str, Any]) -> WorkloadFailure:
        """The error of a job the trigger saw end without success (``event``: the trigger's)."""
        return WorkloadFailure(StepError(str(event.get("message") or "the job failed")), users=False)

    def describe(self, argv: Sequence[str]) -> dict[str, Any]:
        """What ``loraflow plan`` shows of the request this launcher would send, under ``plan_request.key``."""
        return {self.plan_request.key: self.request(argv)} if self.plan_request else {}

    def request(self, argv: Sequence[str]) -> dict[str, Any]:
        """The request ``plan_request`` names, as it would be sent for ``argv``."""
        raise LoraflowError(f"the {self.name} launcher sends no request")


class RemoteLauncher(Launcher):
    """A launcher whose step runs as a job on cloud machines: ``run`` is ``submit``, then ``wait``."""

    compute: RemoteCompute

    @property
    def deferrable(self) -> bool:
        return self.compute.deferrable

    def run(
        self,
        argv: Sequence[str],
        sink: LineSink,
        extra_env: Mapping[str, str] = {},
        secrets: Mapping[str, str] = {},
        on_workload: WorkloadSink = ignore_workload,
    ) -> None:
        """Submit (or reattach to) the job and wait in this thread until it ends."""
        self.check_secrets(secrets)
        on_workload(self.submit(argv, sink, extra_env))
        self.wait(sink)

    @abstractmethod
    def submit(self, argv: Sequence[str], sink: LineSink, extra_env: Mapping[str, str] = {}) -> Workload:
        """Start (or reattach to) the job: reattaching keeps one writer per stage and run."""

    @abstractmethod
    def wait(self, sink: LineSink) -> None:
        """Wait for the submitted job to end; ``StepError`` with its own error unless it succeeded."""
