"""A stage as a GKE JobSet: the request, its deterministic name, the multi-host wiring. Pure.

No Kubernetes client here: the JobSet (``jobset.x-k8s.io/v1alpha2``) is plain data, so ``loraflow
plan`` prints it offline; ``loraflow.launchers.gke`` submits the same object.

One replicated job (``workers``) of one Indexed Job with ``parallelism = completions = hosts``: one
pod per TPU host, each running the stage's image with the argv the local launcher runs. The JobSet
turns on DNS hostnames for its pods (a headless service named after the JobSet), so pod ``i`` is
reachable as ``{name}-workers-0-{i}.{name}``; process 0 (``{name}-workers-0-0``) is the
coordinator. Each pod gets ``LORAFLOW_COORDINATOR_HOST`` (that host), ``LORAFLOW_COORDINATOR_PORT``
and ``LORAFLOW_EXPECTED_HOSTS``; Kubernetes adds ``JOB_COMPLETION_INDEX`` (the process id) and, on
TPU nodes, GKE adds ``TPU_WORKER_ID`` / ``TPU_WORKER_HOSTNAMES`` naming the same hosts.
``loraflow.launchers.multihost`` reads either form and arrives at the same coordinator.

Name: ``lf-{stage}-{key}``, the key being ``loraflow.launchers.vertex_job.JobIdentity``'s hash of dag_id, run_id,
stage and cache key: a retried task finds its JobSet by name instead of creating a second one.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from loraflow.errors import LoraflowError
from loraflow.launchers import vertex_job as vertex
from loraflow.launchers.base import STEP_ENV
from loraflow.launchers.identity import JobIdentity
from loraflow.launchers.multihost import DEFAULT_COORDINATOR_PORT
from loraflow.spec.compute import GkeCompute

GROUP = "jobset.x-k8s.io"
VERSION = "v1alpha2"
PLURAL = "jobsets"
API_VERSION = f"{GROUP}/{VERSION}"
REPLICATED_JOB = "workers"
CONTAINER = "step"
DEFAULT_NAMESPACE = "default"
# The label JobSet puts on every pod it creates (how the launcher finds a failed pod's message).
POD_LABEL = "jobset.sigs.k8s.io/jobset-name"
# GKE's TPU node label values, by Vertex/Compute machine-type family (ct5lp-hightpu-4t -> ct5lp).
TPU_ACCELERATORS = {
    "ct4p": "tpu-v4-podslice",
    "ct5lp": "tpu-v5-lite-podslice",
    "ct5p": "tpu-v5p-slice",
    "ct6e": "tpu-v6e-slice",
}
_DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")  # fullmatch: '$' passes a final newline


class GkeConfigError(LoraflowError):
    """The stage's compute settings cannot make a valid JobSet."""


def jobset_name(identity: JobIdentity) -> str:
    """``lf-<stage>-<16 hex>``: short enough that every pod's host name stays a DNS label."""
    return f"lf-{identity.stage.replace('_', '-')}-{identity.key[:16]}"


def pod_hostname(name: str, index: int) -> str:
    """Pod ``index``'s host name inside the JobSet's headless service (as JobSet and GKE name it)."""
    return f"{name}-{REPLICATED_JOB}-0-{index}.{name}"


def namespace_for(compute: GkeCompute) -> str:
    return compute.namespace or DEFAULT_NAMESPACE


def tpu_resources(compute: GkeCompute) -> tuple[str, int] | None:
    """(GKE accelerator label, chips per host) for a TPU machine type; None for other machines.

    Checks ``hosts`` against the topology: a 4x4 slice of 4-chip hosts is 4 hosts, and a JobSet with
    another count would never be scheduled (or would hang in jax.distributed).
    """
    machine_type = compute.machine_type or ""
    if not vertex.is_tpu(machine_type):
        return None
    family = machine_type.split("-", 1)[0]
    chips = re.search(r"-(\d+)t$", machine_type)
    if family not in TPU_ACCELERATORS or chips is None:
        raise GkeConfigError(
            f"TPU machine type {machine_type} is not one loraflow maps to a GKE node pool "
            f"(families {', '.join(sorted(TPU_ACCELERATORS))}, ending in -<chips>t, e.g. ct5lp-hightpu-4t)"
        )
    if compute.tpu_topology is None:
        raise GkeConfigError(f"{machine_type} on GKE needs compute.tpu_topology (e.g. 4x4): it picks the node pool")
    try:
        total = math.prod(int(d) for d in compute.tpu_topology.split("x"))
    except ValueError:
        raise GkeConfigError(f"tpu_topology {compute.tpu_topology!r} is not like 2x4 or 2x2x2") from None
    per_host = int(chips.group(1))
    expected = max(1, total // per_host)
    if compute.hosts != expected:
        raise GkeConfigError(
            f"topology {compute.tpu_topology} of {machine_type} is {total} chips on {expected} host(s) of {per_host}, "
            f"but hosts is {compute.hosts}; set hosts: {expected}"
        )
    return TPU_ACCELERATORS[family], min(per_host, total)


def container_env(
    compute: GkeCompute, name: str, extra_env: Mapping[str, str] = {}, port: int = DEFAULT_COORDINATOR_PORT
) -> list[dict[str, str]]:
    """compute.env < extra < base.STEP_ENV < the multi-host wiring, sorted by name (as for Vertex)."""
    env = dict(compute.env) | dict(extra_env) | dict(STEP_ENV)
    env |= {
        "LORAFLOW_LAUNCHER": "gke",
        "LORAFLOW_EXPECTED_HOSTS": str(compute.hosts),
        "LORAFLOW_COORDINATOR_HOST": pod_hostname(name, 0),
        "LORAFLOW_COORDINATOR_PORT": str(port),
    }
    return [{"name": k, "value": env[k]} for k in sorted(env)]


def _placement(compute: GkeCompute) -> tuple[dict[str, str], dict[str, str]]:
    """(node selector, resource limits) for the stage's machine."""
    selector: dict[str, str] = {}
    limits: dict[str, str] = {}
    tpu = tpu_resources(compute)
    if tpu is not None:
        accelerator, chips = tpu
        selector = {"cloud.google.com/gke-tpu-accelerator": accelerator}
        selector["cloud.google.com/gke-tpu-topology"] = str(compute.tpu_topology)
        limits = {"google.com/tpu": str(chips)}
    else:
        machine = vertex.machine_spec(compute)
        selector = {"node.kubernetes.io/instance-type": machine["machineType"]}
        if "acceleratorType" in machine:
            selector["cloud.google.com/gke-accelerator"] = machine["acceleratorType"].lower().replace("_", "-")
            limits = {"nvidia.com/gpu": str(machine["acceleratorCount"])}
    if compute.node_pool:
        selector["cloud.google.com/gke-nodepool"] = compute.node_pool
    return selector, limits


def _labels(identity: JobIdentity) -> dict[str, str]:
    # Kubernetes label values must also start and end with a letter or digit.
    return {k: v.strip("-_") for k, v in identity.labels.items()}


def jobset(
    compute: GkeCompute,
    identity: JobIdentity,
    argv: Sequence[str],
    extra_env: Mapping[str, str] = {},
) -> dict[str, Any]:
    """The JobSet for one stage; ``argv`` is ``StagePlan.argv``'s (its interpreter becomes ``python``)."""
    if compute.image is None:
        raise GkeConfigError(f"stage {identity.stage}: the gke launcher needs compute.image")
    if len(argv) < 2:
        raise GkeConfigError(f"stage {identity.stage}: argv {list(argv)} has no program to run")
    name = jobset_name(identity)
    if not _DNS_LABEL.fullmatch(pod_hostname(name, compute.hosts - 1).split(".")[0]):
        raise GkeConfigError(f"JobSet name {name} makes pod host names that are not DNS labels")
    return {
        "apiVersion": API_VERSION,
        "kind": "JobSet",
        "metadata": _metadata(compute, identity, name),
        "spec": {
            "replicatedJobs": [
                {
                    "name": REPLICATED_JOB,
                    "replicas": 1,
                    "template": _job_template(compute, identity, name, argv, extra_env),
                }
            ],
            # The headless service: pod i is {name}-workers-0-i.{name}, resolvable before it is ready.
            "network": {"enableDNSHostnames": True, "subdomain": name, "publishNotReadyAddresses": True},
            "successPolicy": {"operator": "All", "targetReplicatedJobs": [REPLICATED_JOB]},
            "failurePolicy": {"maxRestarts": 0},
        },
    }


def _metadata(compute: GkeCompute, identity: JobIdentity, name: str) -> dict[str, Any]:
    """The JobSet's name, namespace and labels, and its identity as annotations (a person reads them)."""
    annotations = {
        "loraflow/dag-id": identity.dag_id,
        "loraflow/run-id": identity.run_id,
        "loraflow/stage": identity.stage,
        "loraflow/cache-key": identity.cache_key,
    }
    return {"name": name, "namespace": namespace_for(compute), "labels": _labels(identity), "annotations": annotations}


def _job_template(
    compute: GkeCompute, identity: JobIdentity, name: str, argv: Sequence[str], extra_env: Mapping[str, str]
) -> dict[str, Any]:
    """One indexed Job of ``hosts`` pods, one per host; any failed pod fails it (no Kubernetes retry)."""
    labels = _labels(identity)
    selector, limits = _placement(compute)
    container = _container(compute, name, argv, extra_env)
    if limits:
        container["resources"] = {"limits": limits, "requests": dict(limits)}
    pod_spec: dict[str, Any] = {"restartPolicy": "Never", "nodeSelector": selector, "containers": [container]}
    if compute.kubernetes_service_account:
        pod_spec["serviceAccountName"] = compute.kubernetes_service_account
    return {
        "metadata": {"labels": labels},
        "spec": {
            "parallelism": compute.hosts,
            "completions": compute.hosts,
            "completionMode": "Indexed",  # JOB_COMPLETION_INDEX = the process id
            "backoffLimit": 0,  # a failed host fails the job; Airflow's retry resumes from checkpoints
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }


def _container(compute: GkeCompute, name: str, argv: Sequence[str], extra_env: Mapping[str, str]) -> dict[str, Any]:
    """The step program's container: the image's ``python`` with the stage's argv and environment."""
    port = DEFAULT_COORDINATOR_PORT
    return {
        "name": CONTAINER,
        "image": compute.image,
        "command": ["python"],
        "args": list(argv[1:]),
        "env": container_env(compute, name, extra_env, port),
        "ports": [{"name": "coordinator", "containerPort": port}],
        # A failed step's last log lines become the pod's termination message (the launcher shows it).
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def state(obj: Mapping[str, Any]) -> tuple[str, str]:
    """(``pending`` | ``running`` | ``suspended`` | ``succeeded`` | ``failed``, message) of a JobSet."""
    status = obj.get("status") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or [] if c.get("status") == "True"}
    terminal = status.get("terminalState")
    if "Failed" in conditions or terminal == "Failed":
        c = conditions.get("Failed", {})
        return "failed", ": ".join(x for x in (c.get("reason"), c.get("message")) if x) or "no message"
    if "Completed" in conditions or terminal == "Completed":
        return "succeeded", conditions.get("Completed", {}).get("message", "")
    if "Suspended" in conditions:
        return "suspended", conditions["Suspended"].get("message", "")
    jobs = status.get("replicatedJobsStatus") or []
    if any((j.get("active") or 0) + (j.get("ready") or 0) > 0 for j in jobs):
        return "running", ""
    return "pending", ""


def describe_workload(namespace: str, name: str) -> str:
    """How a person looks at the JobSet (there is no console page for JobSets)."""
    return f"kubectl -n {namespace} get jobset {name}; kubectl -n {namespace} logs -l {POD_LABEL}={name}"


def object_ref(namespace: str, name: str) -> tuple[str, str, str, str, str]:
    """(group, version, namespace, plural, name): how the Kubernetes clients' custom-object calls name a JobSet."""
    return GROUP, VERSION, namespace, PLURAL, name


def logs_url(namespace: str, name: str, project: str | None) -> str:
    """The Cloud console's Logs Explorer showing the JobSet's pods' logs (every host's step output)."""
    import urllib.parse

    query = (
        f'resource.type="k8s_container"\nresource.labels.namespace_name="{namespace}"\n'
        f'labels."k8s-pod/jobset_sigs_k8s_io/jobset-name"="{name}"'
    )
    url = "https://console.cloud.google.com/logs/query;query=" + urllib.parse.quote(query, safe="")
    return url + (f"?project={project}" if project else "")
