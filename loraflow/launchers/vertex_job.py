"""A stage as a Vertex AI CustomJob: the request, its deterministic identity, where it goes. Pure.

No SDK here: the request is the REST body (``projects.locations.customJobs.create``, v1, camelCase),
built from plain data so that ``loraflow plan`` prints it without importing google-cloud-aiplatform
or touching the network. ``loraflow.launchers.vertex`` parses this same body into the SDK's message
and submits it.

Identity: Vertex assigns a CustomJob's id itself (create takes none), so a retried task cannot name
the job it wants. Instead every job carries the label ``loraflow-job=<key>``, a sha256 of
``dag_id``, ``run_id``, stage and cache key, and the same key ends its display name. A retry lists
jobs with that label and reattaches to a live or succeeded one instead of submitting a duplicate.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from loraflow.errors import LoraflowError
from loraflow.launchers.base import STEP_ENV
from loraflow.launchers.identity import JobIdentity
from loraflow.spec.compute import RemoteCompute, VertexCompute
from loraflow.spec.machines import gpus, is_tpu

DEFAULT_LOCATION = "us-central1"
PLACEHOLDER_PROJECT = "PROJECT"
# The label a specific Compute Engine reservation is selected by (machineSpec.reservationAffinity).
RESERVATION_KEY = "compute.googleapis.com/reservation-name"


class VertexConfigError(LoraflowError):
    """The stage's compute settings cannot make a valid CustomJob."""


def machine_spec(compute: RemoteCompute) -> dict[str, Any]:
    machine_type = compute.machine_type
    if machine_type is None:
        raise VertexConfigError("the vertex launcher needs compute.machine_type")
    spec: dict[str, Any] = {"machineType": machine_type}
    if compute.tpu_topology is not None:
        if not is_tpu(machine_type):
            raise VertexConfigError(
                f"tpu_topology {compute.tpu_topology} is set but {machine_type} is not a TPU machine type "
                "(ct5lp-hightpu-4t, ct6e-standard-4t, ...); remove tpu_topology or choose a TPU machine type"
            )
        spec["tpuTopology"] = compute.tpu_topology
    gpu = gpus(machine_type)
    if gpu:
        spec |= {"acceleratorType": gpu[0], "acceleratorCount": gpu[1]}
    return spec


def reservation_affinity(compute: VertexCompute) -> dict[str, Any]:
    """The machineSpec part that makes the job consume the spec's reservation (none: nothing)."""
    if not compute.reservation:
        return {}
    affinity = {
        "reservationAffinityType": "SPECIFIC_RESERVATION",
        "key": RESERVATION_KEY,
        "values": [compute.reservation],
    }
    return {"reservationAffinity": affinity}


def project_for(compute: RemoteCompute, environ: Mapping[str, str] | None = None) -> str | None:
    """LORAFLOW_VERTEX_PROJECT, else GOOGLE_CLOUD_PROJECT, else the service account's project."""
    env = os.environ if environ is None else environ
    for key in ("LORAFLOW_VERTEX_PROJECT", "GOOGLE_CLOUD_PROJECT"):
        if env.get(key):
            return env[key]
    sa = compute.service_account or ""
    m = re.fullmatch(r"[^@]+@([a-z][a-z0-9-]{4,28}[a-z0-9])\.iam\.gserviceaccount\.com", sa)
    return m.group(1) if m else None


def location_for(compute: VertexCompute) -> str:
    return compute.region or DEFAULT_LOCATION


def parent(project: str, location: str) -> str:
    return f"projects/{project}/locations/{location}"


def container_env(compute: RemoteCompute, extra_env: Mapping[str, str] = {}) -> list[dict[str, str]]:
    """The spec's compute.env < extra < base.STEP_ENV < loraflow's multi-host wiring, sorted by name."""
    env = dict(compute.env) | dict(extra_env) | dict(STEP_ENV)
    env |= {"LORAFLOW_LAUNCHER": "vertex", "LORAFLOW_EXPECTED_HOSTS": str(compute.hosts)}
    return [{"name": k, "value": env[k]} for k in sorted(env)]


def custom_job(
    compute: VertexCompute,
    identity: JobIdentity,
    argv: Sequence[str],
    output_prefix: str,
    extra_env: Mapping[str, str] = {},
) -> dict[str, Any]:
    """The CustomJob body (REST JSON, as ``CustomJob.to_json()`` writes it) for one stage.

    ``argv`` is the stage's argv from ``StagePlan.argv``; its interpreter becomes the container's
    ``python`` and the rest its args, so the image runs exactly what the local launcher runs.
    """
    if compute.image is None:
        raise VertexConfigError(f"stage {identity.stage}: the vertex launcher needs compute.image")
    if len(argv) < 2:
        raise VertexConfigError(f"stage {identity.stage}: argv {list(argv)} has no program to run")
    job_spec: dict[str, Any] = {
        "workerPoolSpecs": [
            {
                "machineSpec": machine_spec(compute) | reservation_affinity(compute),
                "replicaCount": str(compute.hosts),  # int64: a string in proto3 JSON
                "containerSpec": {
                    "imageUri": compute.image,
                    "command": ["python"],
                    "args": list(argv[1:]),
                    "env": container_env(compute, extra_env),
                },
            }
        ],
        "baseOutputDirectory": {"outputUriPrefix": f"{output_prefix.rstrip('/')}/_vertex/"},
    }
    if compute.service_account:
        job_spec["serviceAccount"] = compute.service_account
    if compute.network:
        job_spec["network"] = compute.network
    if compute.reserved_ip_ranges:
        job_spec["reservedIpRanges"] = list(compute.reserved_ip_ranges)
    if compute.spot:
        job_spec["scheduling"] = {"strategy": "SPOT"}
    return {"displayName": identity.display_name, "jobSpec": job_spec, "labels": identity.labels}


def create_request(
    compute: VertexCompute,
    identity: JobIdentity,
    argv: Sequence[str],
    output_prefix: str,
    extra_env: Mapping[str, str] = {},
    project: str | None = None,
) -> dict[str, Any]:
    """``{"parent": ..., "customJob": ...}``: the whole create call, as ``loraflow plan`` prints it."""
    project = project or project_for(compute) or PLACEHOLDER_PROJECT
    return {
        "parent": parent(project, location_for(compute)),
        "customJob": custom_job(compute, identity, argv, output_prefix, extra_env),
    }


def console_url(job_name: str) -> str:
    """The Cloud console page of a CustomJob resource name."""
    m = re.fullmatch(r"projects/([^/]+)/locations/([^/]+)/customJobs/([^/]+)", job_name)
    if not m:
        return job_name
    project, location, job_id = m.groups()
    return f"https://console.cloud.google.com/vertex-ai/locations/{location}/training/{job_id}/cpu?project={project}"
