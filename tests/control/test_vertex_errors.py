"""Which Vertex AI failures are the user's, which are transient, and what the message tells them to change."""

from __future__ import annotations

import pytest

from loraflow.launchers.vertex_errors import Kind, advice, classify, explain, retry_poll, status_name
from loraflow.spec.compute import compute_from

TPU = compute_from(
    launcher="vertex",
    image="us-docker.pkg.dev/acme-ml/loraflow/trainer:0.1.0",
    machine_type="ct5lp-hightpu-4t",
    tpu_topology="4x4",
    hosts=4,
    region="us-central1",
    service_account="loraflow-trainer@acme-ml.iam.gserviceaccount.com",
)


@pytest.mark.parametrize(
    ("code", "message", "job_failed", "kind"),
    [
        # create answered 429 RESOURCE_EXHAUSTED for TPU quota (REST status, SDK exception name, rpc code)
        (429, "The following quota metrics exceed quota limits: custom_model_training_tpu_v5e", False, Kind.QUOTA),
        ("ResourceExhausted", "429 Quota exceeded", False, Kind.QUOTA),
        (8, "Quota exceeded for resource", True, Kind.QUOTA),
        ("RESOURCE_EXHAUSTED", "", False, Kind.QUOTA),
        # topology / capacity
        (3, "TPU topology 4x4 is not supported in region europe-west4 for ct5lp-hightpu-4t", False, Kind.TOPOLOGY),
        (8, "Resources are insufficient in region: us-central1. Please try a different region.", True, Kind.QUOTA),
        (
            13,
            "The zone does not have enough resources available: insufficient capacity (stockout)",
            True,
            Kind.TOPOLOGY,
        ),
        # permissions and credentials
        (403, "Permission 'iam.serviceAccounts.actAs' denied on service account", False, Kind.PERMISSION),
        ("PermissionDenied", "403 caller does not have permission", False, Kind.PERMISSION),
        (401, "Request had invalid authentication credentials.", False, Kind.AUTH),
        # the image
        (3, "Unable to pull the container image 'us-docker.pkg.dev/acme/x:1': not found", True, Kind.IMAGE),
        (5, "Error response from daemon: manifest unknown", True, Kind.IMAGE),
        # transient
        (503, "The service is currently unavailable.", False, Kind.TRANSIENT),
        ("ServiceUnavailable", "503 Connection reset", False, Kind.TRANSIENT),
        ("ConnectError", "All connection attempts failed", False, Kind.TRANSIENT),
        (504, "Deadline exceeded", False, Kind.TRANSIENT),
        # the step program's own failure, and what is none of the above
        (3, "The replica workerpool0-0 exited with a non-zero status of 1. Termination reason: Error.", True, Kind.JOB),
        (400, "Field customJob.displayName is required", False, Kind.INVALID),
        ("ValueError", "something unexpected", False, Kind.OTHER),
    ],
)
def test_classify(code: int | str, message: str, job_failed: bool, kind: Kind) -> None:
    assert classify(code, message, job_failed=job_failed).kind is kind


def test_only_transient_failures_and_read_rate_limits_are_polled_again() -> None:
    assert retry_poll(classify(503, ""))
    assert retry_poll(classify("RESOURCE_EXHAUSTED", "Quota exceeded for aiplatform read requests"))
    assert not retry_poll(classify(403, "permission denied"))
    assert not retry_poll(classify(404, "not found"))
    assert classify(503, "").transient and not classify(503, "").users
    assert classify(429, "quota").users and not classify(429, "quota").transient


def test_status_names_from_every_shape() -> None:
    assert status_name(8) == status_name(429) == status_name("ResourceExhausted") == "RESOURCE_EXHAUSTED"
    assert status_name("7") == status_name(403) == "PERMISSION_DENIED"
    assert status_name(None) == ""


def test_advice_names_what_to_change() -> None:
    quota = advice(classify(429, "quota"), TPU, "lora_sft", "us-central1", "acme-ml")
    assert "ct5lp-hightpu-4t 4x4 x 4 in us-central1" in quota and "compute.lora_sft.region" in quota
    topo = advice(classify(3, "topology 4x4 not available in this region"), TPU, "lora_sft", "us-central1", "p")
    assert "compute.lora_sft.tpu_topology" in topo and "compute.lora_sft.reservation" in topo
    perm = advice(classify(403, "denied"), TPU, "lora_sft", "us-central1", "acme-ml")
    assert "roles/aiplatform.user on project acme-ml" in perm and TPU.service_account in perm  # type: ignore[operator]
    image = advice(classify(3, "Unable to pull the container image", job_failed=True), TPU, "lora_sft", "r", "p")
    assert TPU.image in image and "compute.lora_sft.image" in image  # type: ignore[operator]
    assert advice(classify(503, ""), TPU, "lora_sft", "r", "p") == ""


def test_explain_keeps_the_jobs_own_message_first() -> None:
    diagnosis, text = explain(
        "Vertex AI job J ended JOB_STATE_FAILED",
        8,
        "Quota exceeded",
        TPU,
        "lora_sft",
        "us-central1",
        "acme-ml",
        job_failed=True,
    )
    assert diagnosis.kind is Kind.QUOTA
    assert text.startswith("Vertex AI job J ended JOB_STATE_FAILED: Quota exceeded [quota exhausted] ")
    _, plain = explain("job J ended", 3, "The replica exited", TPU, "lora_sft", "r", "p", job_failed=True)
    assert plain == "job J ended: The replica exited"
