"""The GKE launcher: a stage's argv as a JobSet, created once, watched, deleted on kill.

The ``Launcher`` interface (``loraflow/launchers/base.py``): ``run`` returns when the JobSet completed
and raises ``StepError`` with its failure (the JobSet's condition and the failed pod's termination
message: the step's last log lines) otherwise; ``kill()`` deletes the JobSet and its pods; ``submit``
hands the JobSet to ``operators/triggers/gke.py``'s trigger.

Idempotent: the JobSet's name derives from dag_id, run_id, stage and cache key
(``loraflow.launchers.gke_jobset.jobset_name``). Before creating, the launcher reads the JobSet of that name: a
pending, running or completed one is reattached to; a failed one is deleted (with its pods) and a new
one created under the same name.

The Kubernetes client is imported when a JobSet is launched, never at module import. Credentials:
``LORAFLOW_GKE_ENDPOINT`` (an ``http://`` URL, e.g. the test stand-in, no credentials), else the
in-cluster service account (Airflow on GKE), else the kubeconfig (``KUBECONFIG``; context
``LORAFLOW_GKE_CONTEXT``, e.g. from ``gcloud container clusters get-credentials``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from loraflow.errors import LoraflowError, StepError
from loraflow.launchers import gke_jobset as gke
from loraflow.launchers import vertex_job as vertex
from loraflow.launchers.base import LineSink, PlanRequest, RemoteLauncher, Workload, WorkloadFailure
from loraflow.launchers.identity import JobIdentity
from loraflow.spec.compute import GkeCompute

# A failed poll is retried with backoff this many times in a row before the launcher gives up.
MAX_POLL_ERRORS = 6
# How long a failed JobSet may take to disappear before its replacement is created.
DELETE_WAIT_SECONDS = 300.0
_TRANSIENT_STATUS = {429, 500, 502, 503, 504}
# API answers that are the user's to fix (credentials, RBAC, a missing namespace or CRD, a rejected JobSet).
USERS_STATUSES = {401, 403, 404, 422}


def _what(exc: BaseException) -> str:
    return str(getattr(exc, "status", None) or type(exc).__name__)


def poll_backoff(exc: BaseException, errors: int, poll_seconds: float, api_error: type) -> float | None:
    """Seconds to wait before reading the JobSet again after ``errors`` failed reads in a row, or
    ``None`` when the failure is not transient (an API answer other than 429/5xx) or lasted too long."""
    if isinstance(exc, api_error) and getattr(exc, "status", None) not in _TRANSIENT_STATUS:
        return None
    if errors > MAX_POLL_ERRORS:
        return None
    return min(poll_seconds * 2**errors, 300.0)


class GkeLauncher(RemoteLauncher):
    """Runs one stage as a JobSet on a GKE cluster."""

    config = GkeCompute
    where = "on GKE"
    trigger = "operators.triggers.gke.GkeJobSetTrigger"
    plan_request = PlanRequest("gke_jobset", "GKE JobSet")
    compute: GkeCompute

    def __init__(
        self,
        compute: GkeCompute,
        identity: JobIdentity,
        output_prefix: str = "",
        *,
        api_client: Any = None,
        poll_seconds: float | None = None,
    ) -> None:
        super().__init__(compute, identity, output_prefix)
        self.namespace = gke.namespace_for(compute)
        self.jobset_name = gke.jobset_name(identity)
        self.poll_seconds = poll_seconds or float(os.environ.get("LORAFLOW_GKE_POLL_SECONDS", "30"))
        self._api_client = api_client
        self._killed = threading.Event()
        self._submitted = threading.Event()

    # --- the client, lazily ---------------------------------------------------------------------

    def _client(self) -> Any:
        if self._api_client is None:
            try:
                from kubernetes import client, config
            except ImportError:
                raise LoraflowError(
                    "the gke launcher needs the kubernetes client; install it in the Airflow workers' environment "
                    "(it is in envs/control.lock)"
                ) from None
            endpoint = os.environ.get("LORAFLOW_GKE_ENDPOINT")
            if endpoint:
                configuration = client.Configuration()
                configuration.host = endpoint
                self._api_client = client.ApiClient(configuration)
            else:
                try:
                    config.load_incluster_config()
                except config.ConfigException:
                    config.load_kube_config(context=os.environ.get("LORAFLOW_GKE_CONTEXT"))
                self._api_client = client.ApiClient()
        return self._api_client

    def _objects(self) -> Any:
        from kubernetes import client

        return client.CustomObjectsApi(self._client())

    # --- the launcher surface -------------------------------------------------------------------

    def secrets_advice(self) -> str:
        return f"use Workload Identity (compute.{self.identity.stage}.kubernetes_service_account)"

    def wait(self, sink: LineSink) -> None:
        if self._killed.is_set():  # killed while creating
            self._delete()
        self._wait(sink)

    def submit(self, argv: Sequence[str], sink: LineSink, extra_env: Mapping[str, str] = {}) -> Workload:
        """The first half of ``run``: a deferrable operator calls this, then defers to the JobSet's trigger."""
        return self._workload(self._create_or_reattach(argv, sink, extra_env))

    def _workload(self, state: str) -> Workload:
        return Workload(
            name=f"{self.namespace}/{self.jobset_name}",
            link=gke.logs_url(self.namespace, self.jobset_name, vertex.project_for(self.compute)),
            succeeded=state == "succeeded",
            poll_seconds=self.poll_seconds,
            trigger={
                "namespace": self.namespace,
                "name": self.jobset_name,
                "stage": self.identity.stage,
                "endpoint": os.environ.get("LORAFLOW_GKE_ENDPOINT"),
            },
        )

    def failure(self, event: Mapping[str, Any]) -> WorkloadFailure:
        code, message, state = event.get("code"), str(event.get("message", "")), str(event.get("state") or "")
        if state == "failed":
            error = self._failed(message)  # with the failed pod's termination message
        elif state == "deleted":
            error = StepError(message)
        else:
            error = self.explain("read", code if isinstance(code, int) else None, message)
        return WorkloadFailure(error, users=code in USERS_STATUSES)

    def request(self, argv: Sequence[str]) -> dict[str, Any]:
        return gke.jobset(self.compute, self.identity, argv, self.compute.env)

    def _create_or_reattach(self, argv: Sequence[str], sink: LineSink, extra_env: Mapping[str, str]) -> str:
        """Create the JobSet, or reattach to the one this run and stage created before (pending, running
        or completed); a failed one is deleted and created again. Returns its state once it exists."""
        body = gke.jobset(self.compute, self.identity, argv, extra_env)
        where = f"JobSet {self.namespace}/{self.jobset_name}"
        existing = self._poll_get(sink)
        now = "pending"
        if existing is not None:
            now, message = gke.state(existing)
            if now == "failed":
                sink(f"earlier attempt {where} failed ({message}); deleting it and creating it again")
                self._delete()
                self._wait_gone(sink)
                existing, now = None, "pending"
            else:
                sink(f"reattaching to {where} ({now}), created earlier for this run and stage; not resubmitting")
        if existing is None:
            if self._killed.is_set():
                raise StepError(f"stage {self.identity.stage} was killed before {where} was created")
            self._create(body, sink)
        self._submitted.set()
        sink(f"{where}: {gke.describe_workload(self.namespace, self.jobset_name)}")
        return now

    def _failed(self, message: str) -> StepError:
        """The error of a failed JobSet: its condition and the failed pod's termination message."""
        pod = self._failed_pod_message()
        return StepError(
            f"JobSet {self.namespace}/{self.jobset_name} for stage {self.identity.stage} failed: {message}"
            + (f"; {pod}" if pod else "")
        )

    def kill(self) -> None:
        """Delete the JobSet and its pods (Airflow's on_kill); run() then raises StepError."""
        self._killed.set()
        if self._submitted.is_set():
            try:
                self._delete()
            except StepError:
                pass  # run() reports what it sees next

    # --- steps ----------------------------------------------------------------------------------

    def _get(self) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            obj: dict[str, Any] = self._objects().get_namespaced_custom_object(
                *gke.object_ref(self.namespace, self.jobset_name)
            )
            return obj
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def _create(self, body: dict[str, Any], sink: LineSink) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            self._objects().create_namespaced_custom_object(gke.GROUP, gke.VERSION, self.namespace, gke.PLURAL, body)
            sink(
                f"created JobSet {self.namespace}/{self.jobset_name} ({self.compute.hosts} pod(s) of {self.compute.image})"
            )
        except ApiException as exc:
            if exc.status == 409:  # another attempt created it between our read and our create
                sink(f"JobSet {self.namespace}/{self.jobset_name} already exists: reattaching to it")
                return
            raise self._explain("create", exc) from exc

    def _delete(self) -> None:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        try:
            self._objects().delete_namespaced_custom_object(
                *gke.object_ref(self.namespace, self.jobset_name),
                body=client.V1DeleteOptions(propagation_policy="Foreground"),
            )
        except ApiException as exc:
            if exc.status != 404:
                raise self._explain("delete", exc) from exc

    def _wait_gone(self, sink: LineSink) -> None:
        deadline = time.monotonic() + DELETE_WAIT_SECONDS
        while self._poll_get(sink) is not None:
            if time.monotonic() > deadline:
                raise StepError(
                    f"JobSet {self.namespace}/{self.jobset_name} is still being deleted after {DELETE_WAIT_SECONDS}s"
                )
            time.sleep(min(self.poll_seconds, 5.0))

    def _poll_get(self, sink: LineSink) -> dict[str, Any] | None:
        """``_get`` with transient errors retried with backoff."""
        from kubernetes.client.exceptions import ApiException

        errors = 0
        while True:
            try:
                return self._get()
            except Exception as exc:  # ApiException, or urllib3's connection errors (transient)
                errors += 1
                backoff = poll_backoff(exc, errors, self.poll_seconds, ApiException)
                if backoff is None:
                    raise self._explain("get", exc) from exc
                sink(f"reading JobSet {self.jobset_name} failed ({_what(exc)}); retrying in {backoff:.0f}s")
                time.sleep(backoff)

    def _wait(self, sink: LineSink) -> None:
        where = f"JobSet {self.namespace}/{self.jobset_name}"
        last = ""
        while True:
            obj = self._poll_get(sink)
            if obj is None:
                how = "deleted because the task was killed" if self._killed.is_set() else "deleted by someone else"
                raise StepError(f"{where} for stage {self.identity.stage} was {how}")
            if self._killed.is_set() and (obj.get("metadata") or {}).get("deletionTimestamp"):
                raise StepError(f"{where} for stage {self.identity.stage} is being deleted because the task was killed")
            now, message = gke.state(obj)
            if now != last:
                sink(f"{where}: {now}" + (f" ({message})" if message else ""))
                last = now
            if now == "succeeded":
                return
            if now == "failed":
                raise self._failed(message)
            self._killed.wait(min(self.poll_seconds, 2.0) if self._killed.is_set() else self.poll_seconds)

    def _failed_pod_message(self) -> str:
        """The first failed pod's container termination message (its last log lines), if readable."""
        from kubernetes import client

        try:
            pods = client.CoreV1Api(self._client()).list_namespaced_pod(
                self.namespace, label_selector=f"{gke.POD_LABEL}={self.jobset_name}"
            )
        except Exception:  # the message is a courtesy: never hide the JobSet's own failure behind it
            return ""
        for pod in sorted(pods.items, key=lambda p: p.metadata.name):
            for cs in (pod.status.container_statuses if pod.status else None) or []:
                term = cs.state.terminated if cs.state else None
                if term is not None and term.exit_code:
                    text = (term.message or term.reason or "").strip()
                    return f"pod {pod.metadata.name} exited with status {term.exit_code}: {text[-2000:]}"
        return ""

    def _explain(self, what: str, exc: Exception) -> StepError:
        reason = getattr(exc, "reason", "") or type(exc).__name__
        return self.explain(what, getattr(exc, "status", None), f"{reason} {getattr(exc, 'body', '') or ''}")

    def explain(self, what: str, status: int | None, detail: str) -> StepError:
        """A failed API call's error, with what to change when it is the user's to fix
        (``USERS_STATUSES``: retrying cannot help)."""
        stage = self.identity.stage
        hint = {
            401: "no valid cluster credentials on the Airflow worker (gcloud container clusters get-credentials, or run in the cluster)",
            403: (
                f"the Airflow workers' Kubernetes identity needs create/get/delete on jobsets.{gke.GROUP} and list on pods in "
                f"namespace {self.namespace} (a Role + RoleBinding)"
            ),
            404: (
                f"namespace {self.namespace} or the JobSet API ({gke.API_VERSION}) is missing: create the namespace "
                f"(compute.{stage}.namespace) and install the JobSet controller on the cluster"
            ),
            422: f"the cluster rejected the JobSet: check compute.{stage} (image, machine_type, tpu_topology, hosts)",
        }.get(status or 0)
        text = f"GKE {what} of JobSet {self.namespace}/{self.jobset_name} failed for stage {stage}: {status} {detail}".strip()
        return StepError(f"{text}; {hint}" if hint else text)


# --- waiting in Airflow's triggerer ---------------------------------------------------------------


class AsyncJobSetClient:
    """Reads and deletes one JobSet with ``kubernetes_asyncio``, for an asyncio event loop (the
    triggerer). Credentials as the launcher's: ``endpoint`` (an ``http://`` URL, no credentials), else
    in-cluster, else the kubeconfig (context ``LORAFLOW_GKE_CONTEXT``)."""

    def __init__(self, namespace: str, name: str, endpoint: str | None = None) -> None:
        self.namespace, self.name, self.endpoint = namespace, name, endpoint

    async def _api_client(self) -> Any:
        from kubernetes_asyncio import client, config

        if self.endpoint:
            configuration = client.Configuration()
            configuration.host = self.endpoint
            return client.ApiClient(configuration)
        try:
            config.load_incluster_config()
        except config.ConfigException:
            await config.load_kube_config(context=os.environ.get("LORAFLOW_GKE_CONTEXT"))
        return client.ApiClient()

    async def get(self) -> dict[str, Any] | None:
        from kubernetes_asyncio import client
        from kubernetes_asyncio.client.exceptions import ApiException

        async with await self._api_client() as api:
            try:
                obj: dict[str, Any] = await client.CustomObjectsApi(api).get_namespaced_custom_object(
                    *gke.object_ref(self.namespace, self.name)
                )
                return obj
            except ApiException as exc:
                if exc.status == 404:
                    return None
                raise

    async def delete(self) -> None:
        from kubernetes_asyncio import client
        from kubernetes_asyncio.client.exceptions import ApiException

        async with await self._api_client() as api:
            try:
                await client.CustomObjectsApi(api).delete_namespaced_custom_object(
                    *gke.object_ref(self.namespace, self.name),
                    body=client.V1DeleteOptions(propagation_policy="Foreground"),
                )
            except ApiException as exc:
                if exc.status != 404:
                    raise


async def watch_jobset(jobsets: AsyncJobSetClient, poll_seconds: float, sink: LineSink) -> tuple[str, str]:
    """Poll until the JobSet ends: (``succeeded`` | ``failed`` | ``deleted``, message). Transient read
    failures are retried with backoff (``poll_backoff``); any other is raised."""
    import asyncio

    from kubernetes_asyncio.client.exceptions import ApiException

    where = f"JobSet {jobsets.namespace}/{jobsets.name}"
    errors, last = 0, ""
    while True:
        try:
            obj = await jobsets.get()
            errors = 0
        except Exception as exc:
            errors += 1
            backoff = poll_backoff(exc, errors, poll_seconds, ApiException)
            if backoff is None:
                raise
            sink(f"reading {where} failed ({_what(exc)}); retrying in {backoff:.0f}s")
            await asyncio.sleep(backoff)
            continue
        if obj is None:
            return "deleted", f"{where} was deleted by someone else"
        now, message = gke.state(obj)
        if now != last:
            sink(f"{where}: {now}" + (f" ({message})" if message else ""))
            last = now
        if now in ("succeeded", "failed"):
            return now, message
        await asyncio.sleep(poll_seconds)
