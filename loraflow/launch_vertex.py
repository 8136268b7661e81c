"""The Vertex AI launcher: a stage's argv as a CustomJob, submitted once, watched, cancellable.

Same surface as ``LocalLauncher``: ``run(argv, sink, extra_env)`` returns when the job succeeded and
raises ``StepError`` with the job's own error otherwise; ``kill()`` cancels the job.

Idempotent: before submitting, it lists the jobs labelled with the stage's deterministic key
(``loraflow.vertex.JobIdentity``). A queued, running or succeeded one is reattached to (a retried
or restarted task does not submit a duplicate); only when every earlier attempt failed or was
cancelled is a new job submitted.

The SDK (google-cloud-aiplatform's v1 ``JobServiceClient``, REST transport) is imported when a job
is launched, never at module import. ``LORAFLOW_VERTEX_ENDPOINT`` overrides the regional endpoint;
an ``http://`` one (the test stand-in) is used with anonymous credentials.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from loraflow import vertex
from loraflow.errors import LoraflowError, StepError
from loraflow.launch import LineSink
from loraflow.spec import ComputeSpec

SUCCEEDED = "JOB_STATE_SUCCEEDED"
# A job in one of these states is not reattached to: a retry submits a new one.
DEAD = {"JOB_STATE_FAILED", "JOB_STATE_CANCELLED", "JOB_STATE_EXPIRED"}
TERMINAL = {SUCCEEDED, *DEAD, "JOB_STATE_PARTIALLY_SUCCEEDED"}
# A failed poll is retried with backoff this many times in a row before the launcher gives up.
MAX_POLL_ERRORS = 6
# After kill(), how long run() waits for the job to reach CANCELLED before it gives up waiting.
CANCEL_WAIT_SECONDS = 120.0


def _state_name(state: Any) -> str:
    return getattr(state, "name", str(state))


class VertexLauncher:
    """Runs one stage as a Vertex AI CustomJob."""

    def __init__(
        self,
        compute: ComputeSpec,
        identity: vertex.JobIdentity,
        output_prefix: str,
        *,
        project: str | None = None,
        endpoint: str | None = None,
        credentials: Any = None,
        poll_seconds: float | None = None,
    ) -> None:
        self.compute = compute
        self.identity = identity
        self.output_prefix = output_prefix
        self.location = vertex.location_for(compute)
        self.project = project or vertex.project_for(compute)
        self.endpoint = (
            endpoint or os.environ.get("LORAFLOW_VERTEX_ENDPOINT") or f"{self.location}-aiplatform.googleapis.com"
        )
        self.credentials = credentials
        self.poll_seconds = poll_seconds or float(os.environ.get("LORAFLOW_VERTEX_POLL_SECONDS", "30"))
        self.job_name: str | None = None
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

    def run(self, argv: Sequence[str], sink: LineSink, extra_env: Mapping[str, str] = {}) -> None:
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
        self._wait(job, sink)

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
        state = _state_name(newest.state)
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
            state = _state_name(job.state)
            if state != last:
                sink(f"{job.name}: {state}")
                last = state
            if state == SUCCEEDED:
                return
            if state in TERMINAL:
                message = job.error.message if job.error and job.error.message else "no error message"
                how = "was cancelled" if state == "JOB_STATE_CANCELLED" else f"ended {state}"
                raise StepError(f"Vertex AI job {job.name} for stage {self.identity.stage} {how}: {message}")
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
                if not _transient(exc) or errors > MAX_POLL_ERRORS:
                    raise self._explain("get", exc) from exc
                backoff = min(self.poll_seconds * 2**errors, 300.0)
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
        """The SDK's error, with what to change when it is the user's to fix."""
        name = type(exc).__name__
        c = self.compute
        hint = {
            "PermissionDenied": (
                "the Airflow workers' credentials need roles/aiplatform.user on the project and "
                f"iam.serviceAccounts.actAs on {c.service_account or 'the Vertex AI service agent'}"
            ),
            "ResourceExhausted": (
                f"quota exhausted for {c.machine_type}"
                + (f" {c.tpu_topology}" if c.tpu_topology else "")
                + f" in {self.location}: request more (IAM & Admin > Quotas) or set compute.{self.identity.stage}.region"
            ),
            "InvalidArgument": (
                f"Vertex AI rejected the job: check compute.{self.identity.stage} (machine_type {c.machine_type}, "
                f"tpu_topology {c.tpu_topology}, region {self.location}, image {c.image})"
            ),
            "NotFound": f"check the project ({self.project}) and region ({self.location})",
            "Unauthenticated": "no valid Google credentials on the Airflow worker (gcloud auth application-default login, or workload identity)",
        }.get(name)
        text = f"Vertex AI {what} failed for stage {self.identity.stage}: {name}: {exc}"
        return StepError(f"{text}; {hint}" if hint else text)


def _transient(exc: Exception) -> bool:
    return type(exc).__name__ in {
        "ServiceUnavailable",
        "InternalServerError",
        "TooManyRequests",
        "DeadlineExceeded",
        "GatewayTimeout",
        "BadGateway",
        "ConnectionError",
        "RetryError",
    }
