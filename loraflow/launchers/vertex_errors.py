"""Why a Vertex AI call or job failed, and what the user should change. Pure: no SDK, no I/O.

Vertex reports a failure in one of three shapes, all reduced here to ``(code, message)``:
- an API call's error (``{"error": {"code": 429, "status": "RESOURCE_EXHAUSTED", ...}}`` over REST,
  an exception such as ``google.api_core.exceptions.ResourceExhausted`` from the SDK);
- a finished job's ``error`` (a ``google.rpc.Status``: numeric canonical code + message);
- a network failure before any answer (no code).

``classify`` names the kind. The user's kinds (quota, topology unavailable, permission, image not
found, invalid request) are never retried; transient ones (unavailable, internal, deadline, rate
limit, connection) are retried with backoff by the launcher and the trigger.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from loraflow.spec.compute import VertexCompute


class Kind(StrEnum):
    QUOTA = "quota exhausted"
    TOPOLOGY = "topology or machine type unavailable"
    PERMISSION = "permission denied"
    IMAGE = "container image not found"
    AUTH = "no valid credentials"
    INVALID = "request rejected"
    NOT_FOUND = "resource not found"
    TRANSIENT = "transient"
    JOB = "the job's program failed"
    OTHER = "unexpected error"


# google.rpc.Code numbers, HTTP statuses and SDK exception names, all to one canonical status name.
_RPC_CODES = {
    1: "CANCELLED",
    2: "UNKNOWN",
    3: "INVALID_ARGUMENT",
    4: "DEADLINE_EXCEEDED",
    5: "NOT_FOUND",
    7: "PERMISSION_DENIED",
    8: "RESOURCE_EXHAUSTED",
    9: "FAILED_PRECONDITION",
    10: "ABORTED",
    13: "INTERNAL",
    14: "UNAVAILABLE",
    16: "UNAUTHENTICATED",
}
_HTTP_CODES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    409: "ABORTED",
    429: "RESOURCE_EXHAUSTED",
    499: "CANCELLED",
    500: "INTERNAL",
    502: "UNAVAILABLE",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}
_EXCEPTION_NAMES = {
    "InvalidArgument": "INVALID_ARGUMENT",
    "BadRequest": "INVALID_ARGUMENT",
    "Unauthenticated": "UNAUTHENTICATED",
    "Unauthorized": "UNAUTHENTICATED",
    "PermissionDenied": "PERMISSION_DENIED",
    "Forbidden": "PERMISSION_DENIED",
    "NotFound": "NOT_FOUND",
    "ResourceExhausted": "RESOURCE_EXHAUSTED",
    "TooManyRequests": "RESOURCE_EXHAUSTED",
    "FailedPrecondition": "FAILED_PRECONDITION",
    "InternalServerError": "INTERNAL",
    "ServiceUnavailable": "UNAVAILABLE",
    "BadGateway": "UNAVAILABLE",
    "GatewayTimeout": "DEADLINE_EXCEEDED",
    "DeadlineExceeded": "DEADLINE_EXCEEDED",
    "RetryError": "UNAVAILABLE",
    "ConnectionError": "UNAVAILABLE",
    "ConnectError": "UNAVAILABLE",
    "ReadTimeout": "DEADLINE_EXCEEDED",
    "ConnectTimeout": "UNAVAILABLE",
    "RemoteProtocolError": "UNAVAILABLE",
}
_TRANSIENT_STATUSES = {"UNAVAILABLE", "INTERNAL", "DEADLINE_EXCEEDED", "ABORTED"}

# Message patterns, checked before the status: Vertex words the user's failures in its messages.
_PATTERNS: tuple[tuple[Kind, re.Pattern[str]], ...] = (
    (Kind.IMAGE, re.compile(r"(unable to pull|image .*not found|manifest unknown|failed to pull|imagepull)", re.I)),
    (
        Kind.TOPOLOGY,
        re.compile(
            r"(topology .*(not |un)(supported|available)|not available in (this|the) (region|zone|location)|"
            r"(machine type|accelerator) .*(not supported|unavailable|is not available)|"
            r"no (available )?(tpu|capacity)|insufficient capacity|resource_pool_exhausted|stockout)",
            re.I,
        ),
    ),
    (Kind.QUOTA, re.compile(r"(quota|exceeds? the limit|rate limit)", re.I)),
    (Kind.PERMISSION, re.compile(r"(permission|iam\.|actAs|not authorized|access denied|forbidden)", re.I)),
)


@dataclass(frozen=True)
class Diagnosis:
    kind: Kind
    status: str  # the canonical status name ("" when there was no answer)

    @property
    def transient(self) -> bool:
        return self.kind is Kind.TRANSIENT

    @property
    def users(self) -> bool:
        """The user's to fix (a setting, a quota, a role), so retrying as is cannot help."""
        return self.kind not in (Kind.TRANSIENT, Kind.JOB, Kind.NOT_FOUND, Kind.OTHER)


def status_name(code: int | str | None) -> str:
    """A google.rpc code number, an HTTP status, a status name or an SDK exception name -> status name."""
    if code is None or code == "":
        return ""
    if isinstance(code, int) or (isinstance(code, str) and code.isdigit()):
        n = int(code)
        return _HTTP_CODES.get(n, "UNKNOWN") if n >= 100 else _RPC_CODES.get(n, "UNKNOWN")
    return _EXCEPTION_NAMES.get(code, code.upper())


def classify(code: int | str | None, message: str, *, job_failed: bool = False) -> Diagnosis:
    """The kind of a failure from its code (any of the shapes above) and message.

    ``job_failed``: the failure is a finished job's error, where an unmatched message means the
    step program itself failed (a replica exited non-zero), not a transient API problem.
    """
    status = status_name(code)
    for kind, pattern in _PATTERNS:
        if pattern.search(message or ""):
            if kind is Kind.QUOTA and status not in ("RESOURCE_EXHAUSTED", "") and not job_failed:
                continue  # "quota" mentioned in an unrelated error
            return Diagnosis(kind, status)
    if status == "RESOURCE_EXHAUSTED":
        return Diagnosis(Kind.QUOTA, status)
    if status == "PERMISSION_DENIED":
        return Diagnosis(Kind.PERMISSION, status)
    if job_failed:  # a job's error: INVALID_ARGUMENT is also how Vertex reports a replica's non-zero exit
        return Diagnosis(Kind.JOB, status)
    if status == "UNAUTHENTICATED":
        return Diagnosis(Kind.AUTH, status)
    if status in ("INVALID_ARGUMENT", "FAILED_PRECONDITION"):
        return Diagnosis(Kind.INVALID, status)
    if status == "NOT_FOUND":
        return Diagnosis(Kind.NOT_FOUND, status)
    if status in _TRANSIENT_STATUSES:
        return Diagnosis(Kind.TRANSIENT, status)
    return Diagnosis(Kind.OTHER, status)


def retry_poll(diagnosis: Diagnosis) -> bool:
    """Whether a failed status poll (a read) is worth retrying: transient, or a read rate limit."""
    return diagnosis.transient or diagnosis.status == "RESOURCE_EXHAUSTED"


def advice(diagnosis: Diagnosis, compute: VertexCompute, stage: str, location: str, project: str | None) -> str:
    """What to change, naming the spec keys and roles involved; "" for failures that are not the user's."""
    where = f"compute.{stage}"
    what = f"{compute.machine_type}" + (f" {compute.tpu_topology}" if compute.tpu_topology else "")
    kind = diagnosis.kind
    if kind is Kind.QUOTA:
        return (
            f"Vertex AI quota for {what} x {compute.hosts} in {location} is exhausted: request more "
            f"(IAM & Admin > Quotas, 'Custom model training' for this machine family in {location}), "
            f"or set {where}.region to a region with quota, or {where}.spot: true"
        )
    if kind is Kind.TOPOLOGY:
        return (
            f"{what} is not available in {location}: choose a region that offers it ({where}.region), "
            f"another {where}.tpu_topology / machine_type, or a reservation ({where}.reservation)"
        )
    if kind is Kind.PERMISSION:
        return (
            f"missing permission: the Airflow workers' identity needs roles/aiplatform.user on project "
            f"{project or '(unset)'} and roles/iam.serviceAccountUser on "
            f"{compute.service_account or 'the Vertex AI service agent'}; the job's service account needs "
            "read access to the image and the buckets"
        )
    if kind is Kind.IMAGE:
        return (
            f"the image {compute.image} cannot be pulled: push it (see docs/production.md, Images), check "
            f"{where}.image for typos, and grant the job's service account roles/artifactregistry.reader"
        )
    if kind is Kind.AUTH:
        return "no valid Google credentials on the Airflow side (application default credentials or workload identity)"
    if kind is Kind.INVALID:
        return (
            f"Vertex AI rejected the request: check {where} (machine_type {compute.machine_type}, "
            f"tpu_topology {compute.tpu_topology}, hosts {compute.hosts}, region {location}, "
            f"network {compute.network}, image {compute.image})"
        )
    if kind is Kind.NOT_FOUND:
        return f"check the project ({project}) and region ({location})"
    return ""


def explain(
    headline: str,
    code: int | str | None,
    message: str,
    compute: VertexCompute,
    stage: str,
    location: str,
    project: str | None,
    *,
    job_failed: bool = False,
) -> tuple[Diagnosis, str]:
    """``(diagnosis, text)``: the headline and message, then which kind and what to change when it is the user's."""
    diagnosis = classify(code, message, job_failed=job_failed)
    hint = advice(diagnosis, compute, stage, location, project)
    text = f"{headline}: {message or 'no error message'}"
    if hint:
        text += f" [{diagnosis.kind.value}] {hint}"
    return diagnosis, text
