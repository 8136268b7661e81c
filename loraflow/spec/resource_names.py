"""Patterns for the names a spec puts into Google Cloud and Kubernetes requests: one place, one rule each.

Every spec value that ends up in an endpoint host, a request path or a resource name is one of the
kinds below, checked by the spec schema (``loraflow/spec/schema.py``) with these functions. The one value
that becomes part of a host name, the Vertex AI region, is checked again where the host is built
(``vertex_api_host``), so a crafted region can never send a request (with the worker's credentials)
to a host that is not Google's, whichever path built the request.

Each ``check_*`` function returns the value or raises ``ValueError`` saying what the value is not
and what to write instead; pydantic turns that into a spec error at the value's key path.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from loraflow.errors import LoraflowError
from loraflow.storage.gcs import check_bucket as check_bucket  # GCS's own naming rule, beside its URIs

# Google Cloud regions: us-central1, europe-west4, northamerica-northeast1, me-central2.
REGION = re.compile(r"[a-z]{2,20}-[a-z]{2,20}[0-9]{1,2}")
ZONE = re.compile(REGION.pattern + r"-[a-z]")
# Project ids: 6-30 characters, lowercase letters, digits and '-', starting with a letter.
PROJECT_ID = re.compile(r"[a-z][a-z0-9-]{4,28}[a-z0-9]")
PROJECT_NUMBER = re.compile(r"[1-9][0-9]{0,19}")
# Compute Engine resource names (RFC 1035): networks, reservations, IP ranges.
GCE_NAME = re.compile(r"[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?")
# Kubernetes names: a DNS-1123 label (namespaces, node pools), a DNS-1123 subdomain (service accounts).
DNS_LABEL = re.compile(r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?")
DNS_SUBDOMAIN = re.compile(rf"(?=.{{1,253}}$){DNS_LABEL.pattern}(?:\.{DNS_LABEL.pattern})*")
# Machine types: ct5lp-hightpu-4t, n2-highmem-32, g2-standard-12, n2-custom-8-16384.
MACHINE_TYPE = re.compile(r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?")
TPU_TOPOLOGY = re.compile(r"[1-9][0-9]{0,2}(?:x[1-9][0-9]{0,2}){1,2}")
SERVICE_ACCOUNT = re.compile(r"[a-z0-9][a-z0-9-]{0,99}@(?:[a-z0-9][a-z0-9-]{0,62}\.){1,3}gserviceaccount\.com")
# Container images: [registry[:port]/]path[:tag][@sha256:digest], as the OCI distribution spec names them.
_IMAGE_PART = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
IMAGE = re.compile(
    rf"(?:[a-z0-9](?:[a-z0-9.-]*[a-z0-9])?(?::[0-9]{{1,5}})?/)?{_IMAGE_PART}(?:/{_IMAGE_PART})*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[a-f0-9]{64})?"
)
NETWORK = re.compile(rf"projects/(?:{PROJECT_NUMBER.pattern}|{PROJECT_ID.pattern})/global/networks/{GCE_NAME.pattern}")
TENSORBOARD = re.compile(
    rf"projects/(?:{PROJECT_NUMBER.pattern}|{PROJECT_ID.pattern})/locations/{REGION.pattern}/tensorboards/[1-9][0-9]{{0,19}}"
)
# Vertex AI Experiments: an experiment's name, and a run's (the run's context id is "{experiment}-{run}").
EXPERIMENT = re.compile(r"[a-z0-9][a-z0-9-]{0,63}")
RESERVATION = re.compile(rf"projects/{PROJECT_ID.pattern}/zones/{ZONE.pattern}/reservations/{GCE_NAME.pattern}")


class ResourceNameError(LoraflowError):
    """A name that goes into a cloud request does not have its kind's form."""


def _checker(pattern: re.Pattern[str], what: str, example: str) -> Callable[[str], str]:
    def check(value: str) -> str:
        if not pattern.fullmatch(value):
            raise ValueError(f"{value!r} is not {what}; write one such as {example}")
        return value

    check.__doc__ = f"``value`` if it is {what} (e.g. {example}), else ValueError."
    return check


check_region = _checker(REGION, "a Google Cloud region", "us-central1 or europe-west4")
check_project = _checker(PROJECT_ID, "a Google Cloud project id (6-30 of a-z, 0-9, '-')", "acme-ml")
check_machine_type = _checker(MACHINE_TYPE, "a machine type", "ct5lp-hightpu-4t or n2-highmem-32")
check_tpu_topology = _checker(TPU_TOPOLOGY, "a TPU topology", "4x4 or 2x2x2")
check_service_account = _checker(
    SERVICE_ACCOUNT, "a Google service account email", "trainer@acme-ml.iam.gserviceaccount.com"
)
check_image = _checker(IMAGE, "a container image reference", "us-docker.pkg.dev/acme-ml/loraflow/trainer:0.1.0")
check_network = _checker(NETWORK, "a VPC network name", "projects/123456789/global/networks/my-vpc")
check_reservation = _checker(RESERVATION, "a reservation name", "projects/acme-ml/zones/us-central1-a/reservations/r1")
check_tensorboard = _checker(
    TENSORBOARD, "a Vertex AI TensorBoard resource name", "projects/acme-ml/locations/us-central1/tensorboards/123"
)
check_experiment = _checker(
    EXPERIMENT,
    "a Vertex AI experiment name (1-64 of a-z, 0-9, '-', starting with a letter or digit)",
    "tiny-llama-lora",
)
check_gce_name = _checker(GCE_NAME, "a Compute Engine resource name (RFC 1035)", "my-ip-range")
check_k8s_label = _checker(DNS_LABEL, "a Kubernetes name (a DNS-1123 label)", "ml-jobs")
check_k8s_subdomain = _checker(DNS_SUBDOMAIN, "a Kubernetes name (a DNS-1123 subdomain)", "loraflow-trainer")


def vertex_api_host(region: str) -> str:
    """The Vertex AI API host of ``region``: ``{region}-aiplatform.googleapis.com``, built only from a
    region of the region pattern (``ResourceNameError`` otherwise)."""
    if not REGION.fullmatch(region):
        raise ResourceNameError(
            f"region {region!r} is not a Google Cloud region such as us-central1: no Vertex AI endpoint is "
            "built from it; fix the spec's region"
        )
    return f"{region}-aiplatform.googleapis.com"
