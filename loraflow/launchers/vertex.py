"""The Vertex AI launcher: a stage's argv as a CustomJob, submitted once, watched, cancellable.

The ``Launcher`` interface (``loraflow/launchers/base.py``): ``run`` returns when the job succeeded
and raises ``StepError`` with the job's own error otherwise; ``kill()`` cancels the job; ``submit``
hands the job to ``operators/triggers/vertex.py``'s trigger.

Idempotent: before submitting, it lists the jobs labelled with the stage's deterministic key
(``loraflow.launchers.vertex_job.JobIdentity``). A queued, running or succeeded one is reattached to (a retried
or restarted task does not submit a duplicate); only when every earlier attempt failed or was
cancelled is a new job submitted.

The SDK (google-cloud-aiplatform's v1 ``JobServiceClient``, REST transport) is imported when a job
is launched, never at module import. ``LORAFLOW_VERTEX_ENDPOINT`` overrides the regional endpoint;
an ``http://`` one (the test stand-in) is used with anonymous credentials.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from loraflow.errors import LoraflowError, StepError
from loraflow.launchers import vertex_errors
from loraflow.launchers import vertex_job as vertex
from loraflow.launchers.base import LineSink, PlanRequest, RemoteLauncher, Workload, WorkloadFailure
from loraflow.launchers.identity import JobIdentity
from loraflow.spec.compute import VertexCompute
from loraflow.spec.resource_names import vertex_api_host

SUCCEEDED = "JOB_STATE_SUCCEEDED"
# A job in one of these states is not reattached to: a retry submits a new one.
DEAD = {"JOB_STATE_FAILED", "JOB_STATE_CANCELLED", "JOB_STATE_EXPIRED"}
TERMINAL = {SUCCEEDED, *DEAD, "JOB_STATE_PARTIALLY_SUCCEEDED"}
# A failed poll is retried with backoff this many times in a row before the launcher gives up.
MAX_POLL_ERRORS = 6
# After kill(), how long run() waits for the job to reach CANCELLED before it gives up waiting.
CANCEL_WAIT_SECONDS = 120.0


def state_name(state: Any) -> str:
    return getattr(state, "name", str(state))


class VertexLauncher(RemoteLauncher):
    """Runs one stage as a Vertex AI CustomJob."""

    config = VertexCompute
    where = "on Vertex AI"
    trigger = "operators.triggers.vertex.VertexJobTrigger"
    plan_request = PlanRequest("vertex_create_request", "Vertex AI CustomJob create request")
    compute: VertexCompute

    def __init__(
        self,
        compute: VertexCompute,
        identity: JobIdentity,
        output_prefix: str,
        *,
        project: str | None = None,
        endpoint: str | None = None,
        credentials: Any = None,
        poll_seconds: float | None = None,
    ) -> None:
        super().__init__(compute, identity, output_prefix)
        self.location = vertex.location_for(compute)
        self.project = project or vertex.project_for(compute)
        self.endpoint = endpoint or endpoint_for(compute)
        self.credentials = credentials
        self.poll_seconds = poll_seconds or float(os.environ.get("LORAFLOW_VERTEX_POLL_SECONDS", "30"))
        self.job_name: str | None = None
        self._job: Any = None  # the SDK's CustomJob message, once submitted
        self._killed = threading.Event()
        self._client_obj: Any = None

    # --- the SDK, lazily ------------------------------------------------------------------------

    def _client(self) -> Any:
        if self._client_obj is None:
            try:
                from google.api_core.client_options import ClientOptions
                from google.cloud.aiplatform_v1.services.job_service import JobServiceClient
            except ImportError:
                raise LoraflowError(
                    "the vertex launcher needs google-cloud-aiplatform; install it in the Airflow workers' "
                    "environment (it is in envs/control.lock)"
                ) from None
            credentials = self.credentials
            if credentials is None and self.endpoint.startswith("http://"):
                from google.auth.credentials import AnonymousCredentials

                credentials = AnonymousCredentials()
            self._client_obj = JobServiceClient(
                credentials=credentials, transport="rest", client_options=ClientOptions(api_endpoint=self.endpoint)
            )
        return self._client_obj

    # --- the launcher surface -------------------------------------------------------------------

    def secrets_advice(self) -> str:
        return f"grant compute.{self.identity.stage}.service_account access instead"

    def submit(self, argv: Sequence[str], sink: LineSink, extra_env: Mapping[str, str] = {}) -> Workload:
        """The first half of ``run``: a deferrable operator calls this, then defers to the job's trigger."""
        self._job = self._submit_or_reattach(argv, sink, extra_env)
        return self._workload(self._job)

    def wait(self, sink: LineSink) -> None:
        self._wait(self._job, sink)

    def _workload(self, job: Any) -> Workload:
        return Workload(
            name=job.name,
            link=vertex.console_url(job.name),
            succeeded=state_name(job.state) == SUCCEEDED,
            poll_seconds=self.poll_seconds,
            trigger={"job_name": job.name, "endpoint": self.endpoint, "stage": self.identity.stage},
        )

    def failure(self, event: Mapping[str, Any]) -> WorkloadFailure:
        code, message, state = event.get("code"), str(event.get("message", "")), str(event.get("state") or "")
        name = str(event.get("job_name") or self.job_name or "")
        m = re.fullmatch(r"projects/([^/]+)/locations/([^/]+)/customJobs/[^/]+", name)
        if m:  # the job's own project, whatever the workers' environment says now
            self.project = m.group(1)
        error = StepError(self.job_failure(name, state, code, message))
        return WorkloadFailure(error, users=vertex_errors.classify(code, message, job_failed=True).users)

    def request(self, argv: Sequence[str]) -> dict[str, Any]:
        return vertex.create_request(self.compute, self.identity, argv, self.output_prefix, self.compute.env)

    def _submit_or_reattach(self, argv: Sequence[str], sink: LineSink, extra_env: Mapping[str, str]) -> Any:
        """Reattach to this stage's live or succeeded job, else submit one; the job (SDK message)."""
        if self.project is None:
            raise LoraflowError(
                f"stage {self.identity.stage}: no Google Cloud project for Vertex AI; set LORAFLOW_VERTEX_PROJECT "
                "or GOOGLE_CLOUD_PROJECT on the workers, or a service_account of that project in the spec"
            )
        body = vertex.custom_job(self.compute, self.identity, argv, self.output_prefix, extra_env)
        parent = vertex.parent(self.project, self.location)
        job = self._find_live(parent, sink)
        if job is None:
            job = self._submit(parent, body, sink)
        self.job_name = job.name
        sink(f"Vertex AI job {job.name}: {vertex.console_url(job.name)}")
        if self._killed.is_set():  # killed while submitting
            self._cancel(sink)
        return job

    def kill(self) -> None:
        """Cancel the job (Airflow's on_kill); run() then returns with a StepError once it is cancelled."""
        self._killed.set()
        if self.job_name is not None:
            self._cancel(lambda line: None)

    # --- steps ----------------------------------------------------------------------------------

    def _find_live(self, parent: str, sink: LineSink) -> Any:
        jobs = list(
            self._call(
                "list", lambda c: c.list_custom_jobs(request={"parent": parent, "filter": self.identity.list_filter})
            )
        )
        if not jobs:
            return None
        jobs.sort(key=lambda j: j.create_time.timestamp() if j.create_time else 0, reverse=True)
        newest = jobs[0]
        state = state_name(newest.state)
        if state in DEAD:
            sink(f"earlier attempt {newest.name} ended {state}; submitting a new job")
            return None
        sink(f"reattaching to {newest.name} ({state}), submitted earlier for this run and stage; not resubmitting")
        return newest

    def _submit(self, parent: str, body: dict[str, Any], sink: LineSink) -> Any:
        from google.cloud.aiplatform_v1.types import CustomJob
        from google.protobuf import json_format

        message = CustomJob.wrap(json_format.ParseDict(body, CustomJob.pb(CustomJob())))
        job = self._call("create", lambda c: c.create_custom_job(parent=parent, custom_job=message))
        sink(f"submitted Vertex AI CustomJob {job.display_name} as {job.name}")
        return job

    def _cancel(self, sink: LineSink) -> None:
        name = self.job_name
        try:
            self._call("cancel", lambda c: c.cancel_custom_job(name=name))
            sink(f"cancel requested for {name}")
        except StepError as exc:
            sink(f"could not cancel {name}: {exc}")

    def _wait(self, job: Any, sink: LineSink) -> None:
        last = ""
        errors = 0
        cancel_deadline: float | None = None
        while True:
            state = state_name(job.state)
            if state != last:
                sink(f"{job.name}: {state}")
                last = state
            if state == SUCCEEDED:
                return
            if state in TERMINAL:
                code = job.error.code if job.error else None
                message = job.error.message if job.error else ""
                raise StepError(self.job_failure(job.name, state, code, message))
            if self._killed.is_set():
                if cancel_deadline is None:
                    cancel_deadline = time.monotonic() + CANCEL_WAIT_SECONDS
                elif time.monotonic() > cancel_deadline:
                    raise StepError(f"cancelled {job.name}, which is still {state} after {CANCEL_WAIT_SECONDS}s")
                time.sleep(min(self.poll_seconds, 2.0))
            else:
                self._killed.wait(self.poll_seconds)
            try:
                job = self._client().get_custom_job(name=job.name)
                errors = 0
            except Exception as exc:
                errors += 1
                if not _retry_poll(exc) or errors > MAX_POLL_ERRORS:
                    raise self._explain("get", exc) from exc
                backoff = backoff_seconds(self.poll_seconds, errors)
                sink(f"polling {job.name} failed ({type(exc).__name__}: {exc}); retrying in {backoff:.0f}s")
                time.sleep(backoff)

    def _call(self, what: str, fn: Any) -> Any:
        try:
            return fn(self._client())
        except LoraflowError:
            raise
        except Exception as exc:
            raise self._explain(what, exc) from exc

    def _explain(self, what: str, exc: Exception) -> StepError:
        """The SDK's error, with which kind of failure it is and what to change when it is the user's."""
        code = getattr(exc, "code", None)
        status = code if isinstance(code, int) else type(exc).__name__
        message = getattr(exc, "message", None) or str(exc)
        headline = f"Vertex AI {what} failed for stage {self.identity.stage}: {type(exc).__name__}"
        _, text = vertex_errors.explain(
            headline, status, message, self.compute, self.identity.stage, self.location, self.project
        )
        return StepError(text)

    def job_failure(self, job_name: str, state: str, code: int | str | None, message: str) -> str:
        """Why a job ended without success: its own error, then which kind and what to change."""
        how = (
            "was cancelled" if state == "JOB_STATE_CANCELLED" else f"ended {state}" if state else "could not be watched"
        )
        headline = f"Vertex AI job {job_name} for stage {self.identity.stage} {how}"
        if state == "JOB_STATE_CANCELLED":
            return f"{headline}: {message or 'no error message'}"
        _, text = vertex_errors.explain(
            headline, code, message, self.compute, self.identity.stage, self.location, self.project, job_failed=True
        )
        return text


def backoff_seconds(poll_seconds: float, errors: int) -> float:
    """How long to wait after the ``errors``-th failed poll in a row: doubling, at most five minutes."""
    return float(min(poll_seconds * 2**errors, 300.0))


def _retry_poll(exc: Exception) -> bool:
    return vertex_errors.retry_poll(vertex_errors.classify(type(exc).__name__, str(exc)))


# --- asynchronous: what the deferrable operator's trigger runs in Airflow's triggerer -----------


class VertexApiError(LoraflowError):
    """A v1 REST call answered with Google's error JSON."""

    def __init__(self, http_status: int, status: str, message: str) -> None:
        super().__init__(f"HTTP {http_status} {status}: {message}")
        self.http_status, self.status, self.message = http_status, status, message


def endpoint_for(compute: VertexCompute) -> str:
    """The API endpoint a stage's jobs live at: ``LORAFLOW_VERTEX_ENDPOINT`` (the deployer's), else the
    region's, built only from a valid region (``resource_names.vertex_api_host``)."""
    return os.environ.get("LORAFLOW_VERTEX_ENDPOINT") or vertex_api_host(vertex.location_for(compute))


class AsyncJobClient:
    """``customJobs.get`` and ``customJobs.cancel`` over v1 REST with httpx, for an asyncio event loop.

    An ``http://`` endpoint (the stand-in) is called without credentials; otherwise the
    application default credentials' token is sent (refreshed in a thread: google-auth is blocking).
    """

    def __init__(self, endpoint: str, timeout: float = 60.0) -> None:
        self.base = endpoint.rstrip("/") if "://" in endpoint else f"https://{endpoint.rstrip('/')}"
        self.timeout = timeout
        self._credentials: Any = None

    async def _headers(self) -> dict[str, str]:
        if self.base.startswith("http://"):
            return {}
        import asyncio

        import google.auth
        from google.auth.transport.requests import Request

        if self._credentials is None:
            self._credentials, _ = await asyncio.to_thread(
                google.auth.default, scopes=["https://www.googleapis.com/auth/cloud-platform"]
            )
        if not self._credentials.valid:
            await asyncio.to_thread(self._credentials.refresh, Request())
        return {"Authorization": f"Bearer {self._credentials.token}"}

    async def _call(self, method: str, path: str) -> dict[str, Any]:
        import httpx

        async with httpx.AsyncClient(timeout=self.timeout) as http:
            response = await http.request(method, f"{self.base}/v1/{path}", headers=await self._headers())
        try:
            payload = response.json() if response.content else {}
        except ValueError:
            payload = {"error": {"message": response.text[:500]}}
        if response.status_code >= 400:
            error = payload.get("error", {}) if isinstance(payload, dict) else {}
            raise VertexApiError(
                response.status_code,
                error.get("status") or vertex_errors.status_name(response.status_code),
                error.get("message") or response.reason_phrase,
            )
        return payload if isinstance(payload, dict) else {}

    async def get(self, job_name: str) -> dict[str, Any]:
        return await self._call("GET", job_name)

    async def cancel(self, job_name: str) -> None:
        await self._call("POST", f"{job_name}:cancel")


def diagnose(exc: BaseException) -> vertex_errors.Diagnosis:
    """The kind of a failed call of either client (REST error JSON, SDK exception, network error)."""
    if isinstance(exc, VertexApiError):
        return vertex_errors.classify(exc.status, exc.message)
    return vertex_errors.classify(type(exc).__name__, str(exc))


async def watch_job(
    client: AsyncJobClient,
    job_name: str,
    poll_seconds: float,
    sink: LineSink,
    max_errors: int = MAX_POLL_ERRORS,
) -> dict[str, Any]:
    """Poll until the job reaches a terminal state and return its resource (REST JSON).

    Failed polls that are transient (or read rate limits) are retried with backoff, ``max_errors``
    in a row at most; any other failure is raised at once.
    """
    import asyncio

    errors = 0
    last = ""
    while True:
        try:
            job = await client.get(job_name)
            errors = 0
        except Exception as exc:
            errors += 1
            if not vertex_errors.retry_poll(diagnose(exc)) or errors > max_errors:
                raise
            backoff = backoff_seconds(poll_seconds, errors)
            sink(f"polling {job_name} failed ({type(exc).__name__}: {exc}); retrying in {backoff:.0f}s")
            await asyncio.sleep(backoff)
            continue
        state = str(job.get("state", ""))
        if state != last:
            sink(f"{job_name}: {state}")
            last = state
        if state in TERMINAL:
            return job
        await asyncio.sleep(poll_seconds)
