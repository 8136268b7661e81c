"""The GKE launcher: the JobSet it renders (checked against the Kubernetes schema, no cluster) and its
create / reattach / poll / fail / delete logic through the real kubernetes client against
tests/gke_standin.py."""

from __future__ import annotations

import copy
import json
import re
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from loraflow.errors import StepError
from loraflow.launchers import gke_jobset as gke
from loraflow.launchers.gke import GkeLauncher
from loraflow.launchers.local import KillSwitch
from loraflow.launchers.multihost import distributed_config
from loraflow.launchers.vertex_job import JobIdentity
from loraflow.pipeline.plan import describe
from loraflow.spec.compute import compute_from
from loraflow.spec.schema import load_spec
from tests.gke_standin import GkeStandIn, serve

IMAGE = "us-docker.pkg.dev/acme-ml/loraflow/trainer:0.1.0"
ARGV = ["python", "-m", "loraflow.steps.lora_sft", "--output", "gs://b/p/run-1/lora_sft", "--cache-key", "K"]
TRAINING = compute_from(
    launcher="gke",
    image=IMAGE,
    machine_type="ct5lp-hightpu-4t",
    tpu_topology="4x4",
    hosts=4,
    namespace="ml",
    kubernetes_service_account="loraflow-trainer",
    node_pool="v5e-4x4",
    env={"LORAFLOW_LOG_LEVEL": "INFO"},
)
IDENTITY = JobIdentity("llama31-8b-lora", "manual__2026-12-03", "lora_sft", "cachekey")


def _pod_spec(js: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    return spec


def _env(js: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in _pod_spec(js)["containers"][0]["env"]}


# --------------------------------------------------------------------------- the rendered JobSet


def test_jobset_runs_one_pod_per_tpu_host_with_the_local_argv() -> None:
    js = gke.jobset(TRAINING, IDENTITY, ARGV)
    assert js["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and js["kind"] == "JobSet"
    assert js["metadata"]["namespace"] == "ml"
    [rjob] = js["spec"]["replicatedJobs"]
    job = rjob["template"]["spec"]
    assert rjob["replicas"] == 1 and job["parallelism"] == job["completions"] == 4
    assert job["completionMode"] == "Indexed"
    pod = _pod_spec(js)
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
        "cloud.google.com/gke-tpu-topology": "4x4",
        "cloud.google.com/gke-nodepool": "v5e-4x4",
    }
    assert pod["serviceAccountName"] == "loraflow-trainer" and pod["restartPolicy"] == "Never"
    [c] = pod["containers"]
    assert c["image"] == IMAGE and c["command"] == ["python"] and c["args"] == ARGV[1:]
    assert c["resources"]["limits"] == {"google.com/tpu": "4"}
    env = _env(js)
    assert env["LORAFLOW_LOG_LEVEL"] == "INFO" and env["LORAFLOW_EXPECTED_HOSTS"] == "4"
    assert js["spec"]["network"]["enableDNSHostnames"] is True
    assert js["spec"]["network"]["subdomain"] == js["metadata"]["name"]


def test_the_name_is_deterministic_and_short_enough_for_pod_host_names() -> None:
    name = gke.jobset(TRAINING, IDENTITY, ARGV)["metadata"]["name"]
    assert name == gke.jobset(TRAINING, JobIdentity(*IDENTITY.__dict__.values()), ARGV)["metadata"]["name"]
    other_run = JobIdentity(IDENTITY.dag_id, "manual__2026-12-04", "lora_sft", "cachekey")
    other_key = JobIdentity(IDENTITY.dag_id, IDENTITY.run_id, "lora_sft", "another")
    assert len({name, gke.jobset_name(other_run), gke.jobset_name(other_key)}) == 3
    for stage in ("convert_checkpoint", "evaluate_tuned"):
        host = gke.pod_hostname(gke.jobset_name(JobIdentity("d" * 60, "r", stage, "k")), 255).split(".")[0]
        assert re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", host), host


@pytest.mark.parametrize("webhook", [False, True])
def test_every_pod_finds_the_same_coordinator_through_multihost(webhook: bool) -> None:
    """What each pod gets (our env + Kubernetes' JOB_COMPLETION_INDEX, and on TPU nodes GKE's
    TPU_WORKER_ID / TPU_WORKER_HOSTNAMES) leads loraflow.launchers.multihost to pod 0 behind the headless service."""
    js = gke.jobset(TRAINING, IDENTITY, ARGV)
    name = js["metadata"]["name"]
    hosts = [f"{name}-workers-0-{i}.{name}" for i in range(4)]  # JobSet's pod host names in its subdomain
    for i in range(4):
        env = _env(js) | {"JOB_COMPLETION_INDEX": str(i)}
        if webhook:
            env |= {"TPU_WORKER_ID": str(i), "TPU_WORKER_HOSTNAMES": ",".join(hosts)}
        cfg = distributed_config(env)
        assert cfg is not None and cfg.source == "gke"
        assert (cfg.coordinator, cfg.num_processes, cfg.process_id) == (f"{hosts[0]}:8476", 4, i)
    ports = _pod_spec(js)["containers"][0]["ports"]
    assert ports == [{"name": "coordinator", "containerPort": 8476}]


def test_hosts_must_match_the_topology() -> None:
    wrong = TRAINING.model_copy(update={"hosts": 2})
    with pytest.raises(gke.GkeConfigError, match=r"16 chips on 4 host.*set hosts: 4"):
        gke.jobset(wrong, IDENTITY, ARGV)


def test_gpu_and_cpu_machines() -> None:
    l4 = compute_from(launcher="gke", image=IMAGE, machine_type="g2-standard-12")
    pod = _pod_spec(gke.jobset(l4, IDENTITY, ARGV))
    assert pod["nodeSelector"]["cloud.google.com/gke-accelerator"] == "nvidia-l4"
    assert pod["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    cpu = compute_from(launcher="gke", image=IMAGE, machine_type="n2-highmem-32")
    pod = _pod_spec(gke.jobset(cpu, IDENTITY, ARGV))
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "n2-highmem-32"}
    assert "resources" not in pod["containers"][0]


# --------------------------------------------------------------------------- against the schema


def _kubernetes_roundtrip(data: dict[str, Any], model: str) -> dict[str, Any]:
    """``data`` read into the kubernetes client's model and written back; a field the model does not
    know is dropped (so the result differs), a missing required one raises, a wrong type raises."""
    from kubernetes.client import ApiClient

    class Response:
        def __init__(self, payload: dict[str, Any]) -> None:
            self.data = json.dumps(payload)

    client = ApiClient()
    obj = client.deserialize(Response(data), model)
    out: dict[str, Any] = client.sanitize_for_serialization(obj)
    return out


# The JobSet v1alpha2 wrapper, by hand: the fields loraflow may use and their types.
_JOBSET_FIELDS: dict[str, Any] = {
    "apiVersion": str,
    "kind": str,
    "metadata": {"name": str, "namespace": str, "labels": dict, "annotations": dict},
    "spec": {
        "replicatedJobs": [{"name": str, "replicas": int, "template": dict}],
        "network": {"enableDNSHostnames": bool, "subdomain": str, "publishNotReadyAddresses": bool},
        "successPolicy": {"operator": str, "targetReplicatedJobs": [str]},
        "failurePolicy": {"maxRestarts": int},
        "suspend": bool,
        "ttlSecondsAfterFinished": int,
    },
}


def _check_shape(value: Any, shape: Any, path: str) -> list[str]:
    if isinstance(shape, dict):
        if not isinstance(value, dict):
            return [f"{path}: expected an object"]
        problems = [f"{path}.{k}: not a JobSet v1alpha2 field" for k in value if k not in shape]
        for k, v in value.items():
            if k in shape:
                problems += _check_shape(v, shape[k], f"{path}.{k}")
        return problems
    if isinstance(shape, list):
        if not isinstance(value, list):
            return [f"{path}: expected a list"]
        return [p for i, v in enumerate(value) for p in _check_shape(v, shape[0], f"{path}[{i}]")]
    ok = isinstance(value, shape) and not (shape is int and isinstance(value, bool))
    return [] if ok else [f"{path}: expected {shape.__name__}, got {type(value).__name__}"]


def jobset_problems(js: dict[str, Any]) -> list[str]:
    problems = _check_shape(js, _JOBSET_FIELDS, "")
    if js.get("apiVersion") != "jobset.x-k8s.io/v1alpha2" or js.get("kind") != "JobSet":
        problems.append("not a jobset.x-k8s.io/v1alpha2 JobSet")
    spec = js.get("spec", {})
    names = [r.get("name") for r in spec.get("replicatedJobs", [])]
    if not names or len(set(names)) != len(names):
        problems.append("replicatedJobs: need at least one, names unique")
    if spec.get("successPolicy", {}).get("operator") not in ("All", "Any"):
        problems.append("successPolicy.operator: All or Any")
    if not set(spec.get("successPolicy", {}).get("targetReplicatedJobs", [])) <= set(names):
        problems.append("successPolicy.targetReplicatedJobs: not replicated jobs of this JobSet")
    if not re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", js.get("metadata", {}).get("name", "")):
        problems.append("metadata.name: not a DNS-1035 label")
    for key, value in js.get("metadata", {}).get("labels", {}).items():
        if not re.fullmatch(r"([A-Za-z0-9][-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?", value):
            problems.append(f"metadata.labels.{key}: not a label value")
    return problems


def test_the_job_template_is_valid_kubernetes() -> None:
    js = gke.jobset(TRAINING, IDENTITY, ARGV)
    assert jobset_problems(js) == []
    template = js["spec"]["replicatedJobs"][0]["template"]
    assert _kubernetes_roundtrip(template, "V1JobTemplateSpec") == template
    pod = template["spec"]["template"]
    assert _kubernetes_roundtrip(pod, "V1PodTemplateSpec") == pod


def test_the_schema_checks_catch_mistakes() -> None:
    """The checks above can fail: an unknown (misspelt) field, a wrong type, a bad wrapper."""
    js = gke.jobset(TRAINING, IDENTITY, ARGV)
    template = copy.deepcopy(js["spec"]["replicatedJobs"][0]["template"])
    template["spec"]["template"]["spec"]["nodeSelecter"] = {"a": "b"}
    assert _kubernetes_roundtrip(template, "V1JobTemplateSpec") != template
    template = copy.deepcopy(js["spec"]["replicatedJobs"][0]["template"])
    del template["spec"]["template"]["spec"]["containers"][0]["name"]
    with pytest.raises(ValueError, match="name"):
        _kubernetes_roundtrip(template, "V1JobTemplateSpec")
    bad = copy.deepcopy(js)
    bad["spec"]["network"]["enableDnsHostnames"] = True
    bad["spec"]["replicatedJobs"][0]["replicas"] = "1"
    bad["spec"]["successPolicy"]["operator"] = "Every"
    assert sorted(jobset_problems(bad)) == sorted(
        [
            ".spec.network.enableDnsHostnames: not a JobSet v1alpha2 field",
            ".spec.replicatedJobs[0].replicas: expected int, got str",
            "successPolicy.operator: All or Any",
        ]
    )


def test_plan_prints_the_jobset_offline(tmp_path) -> None:
    import yaml

    from loraflow.launchers.environments import REPO_ROOT

    raw = yaml.safe_load((REPO_ROOT / "pipelines" / "llama31-8b-lora.yaml").read_text())
    raw["compute"]["lora_sft"] = TRAINING.model_dump(mode="json", exclude_defaults=True)
    (tmp_path / "llama31-8b-lora.yaml").write_text(yaml.safe_dump(raw))
    spec = load_spec(tmp_path / "llama31-8b-lora.yaml")
    [entry] = [s for s in describe(spec)["stages"] if s["stage"] == "lora_sft"]
    js = entry["gke_jobset"]
    assert jobset_problems(js) == []
    assert _pod_spec(js)["containers"][0]["args"] == entry["argv"][1:]
    assert js["metadata"]["name"] == gke.jobset_name(JobIdentity(spec.name, "RUN_ID", "lora_sft", "CACHE_KEY"))
    assert "vertex_create_request" not in entry


# --------------------------------------------------------------------------- the launcher


@pytest.fixture
def standin(monkeypatch: pytest.MonkeyPatch) -> Iterator[GkeStandIn]:
    with serve() as server:
        monkeypatch.setenv("LORAFLOW_GKE_ENDPOINT", server.url)
        yield server


COMPUTE = compute_from(launcher="gke", image=IMAGE, machine_type="n2-standard-4", namespace="ml")


def _launcher(run_id: str = "run-1") -> GkeLauncher:
    return GkeLauncher(COMPUTE, JobIdentity("toy-dag", run_id, "toy", "cachekey"), poll_seconds=0.05)


def _run_in_thread(launcher: GkeLauncher, lines: list[str]) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def target() -> None:
        try:
            launcher.run(ARGV, lines.append)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, errors


def _wait_for(predicate: Any, what: str, seconds: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.025)


RUNNING = {"replicatedJobsStatus": [{"name": "workers", "active": 1, "ready": 1, "succeeded": 0, "failed": 0}]}
COMPLETED = {"conditions": [{"type": "Completed", "status": "True", "message": "jobset completed successfully"}]}
FAILED = {
    "conditions": [
        {"type": "Failed", "status": "True", "reason": "FailedJobs", "message": "jobset failed due to failed jobs"}
    ]
}


def test_submit_poll_succeed(standin: GkeStandIn) -> None:
    launcher, lines = _launcher(), []
    thread, errors = _run_in_thread(launcher, lines)
    _wait_for(lambda: ("ml", launcher.jobset_name) in standin.jobsets, "the JobSet")
    stored = standin.jobsets[("ml", launcher.jobset_name)]
    assert _pod_spec(stored)["containers"][0]["args"] == ARGV[1:]
    standin.set_status("ml", launcher.jobset_name, RUNNING)
    _wait_for(lambda: any(line.endswith(": running") for line in lines), "running")
    standin.set_status("ml", launcher.jobset_name, COMPLETED)
    thread.join(30)
    assert not thread.is_alive() and errors == []
    assert standin.creates() == 1 and any("succeeded" in line for line in lines)


def test_a_retry_reattaches_instead_of_creating_twice(standin: GkeStandIn) -> None:
    first, lines = _launcher(), []
    thread, _ = _run_in_thread(first, lines)
    _wait_for(lambda: standin.created == 1, "the first create")
    standin.set_status("ml", first.jobset_name, RUNNING)
    # The task is retried (or the worker restarted) while the JobSet runs: same identity, same name.
    retry, retry_lines = _launcher(), []
    thread2, errors2 = _run_in_thread(retry, retry_lines)
    _wait_for(lambda: any("reattaching" in line for line in retry_lines), "the reattach")
    standin.set_status("ml", first.jobset_name, COMPLETED)
    thread.join(30)
    thread2.join(30)
    assert errors2 == [] and standin.creates() == 1


def test_a_failed_jobset_fails_the_stage_with_the_pod_message_and_is_replaced_on_retry(standin: GkeStandIn) -> None:
    launcher, lines = _launcher(), []
    thread, errors = _run_in_thread(launcher, lines)
    _wait_for(lambda: standin.created == 1, "the create")
    standin.add_pod("ml", launcher.jobset_name, 0, 0, "")
    standin.add_pod("ml", launcher.jobset_name, 1, 2, "[lora_sft] ERROR: dataset input has no train.jsonl")
    standin.set_status("ml", launcher.jobset_name, FAILED)
    thread.join(30)
    [err] = errors
    assert isinstance(err, StepError)
    assert "FailedJobs: jobset failed due to failed jobs" in str(err)
    assert f"pod {launcher.jobset_name}-workers-0-1-abcde exited with status 2" in str(err)
    assert "dataset input has no train.jsonl" in str(err)

    retry, retry_lines = _launcher(), []
    thread2, errors2 = _run_in_thread(retry, retry_lines)
    _wait_for(lambda: standin.created == 2, "the re-create")
    assert any("failed" in line and "creating it again" in line for line in retry_lines)
    assert standin.deletions[-1].get("propagationPolicy") == "Foreground"
    standin.set_status("ml", retry.jobset_name, COMPLETED)
    thread2.join(30)
    assert errors2 == []


def test_kill_deletes_the_jobset(standin: GkeStandIn) -> None:
    switch = KillSwitch()
    launcher, lines = _launcher(), []
    switch.arm(launcher)
    thread, errors = _run_in_thread(launcher, lines)
    _wait_for(lambda: ("ml", launcher.jobset_name) in standin.jobsets, "the JobSet")
    standin.set_status("ml", launcher.jobset_name, RUNNING)
    _wait_for(lambda: any(line.endswith(": running") for line in lines), "running")
    switch.kill()
    thread.join(30)
    assert ("ml", launcher.jobset_name) not in standin.jobsets
    assert standin.deletions == [{"propagationPolicy": "Foreground"}]
    [err] = errors
    assert isinstance(err, StepError) and "killed" in str(err)


def test_transient_api_errors_are_retried_and_lasting_ones_explained(standin: GkeStandIn) -> None:
    launcher, lines = _launcher(), []
    thread, errors = _run_in_thread(launcher, lines)
    _wait_for(lambda: standin.created == 1, "the create")
    standin.faults += [503, 503]
    standin.set_status("ml", launcher.jobset_name, COMPLETED)
    thread.join(30)
    assert errors == [] and sum("retrying" in line for line in lines) == 2

    standin.faults += [403]
    with pytest.raises(StepError, match=r"403.*jobsets\.jobset\.x-k8s\.io.*namespace ml"):
        _launcher("run-2").run(ARGV, lines.append)


def play_the_pod(js: dict[str, Any], emulator: Any) -> None:
    """What the cluster would do with the JobSet's pod: run its container command with its environment."""
    import os
    import subprocess
    import sys

    from loraflow.launchers.environments import REPO_ROOT

    [container] = _pod_spec(js)["containers"]
    pod_env = {e["name"]: e["value"] for e in container["env"]} | {"JOB_COMPLETION_INDEX": "0"}
    image_env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(
        [sys.executable, *container["args"]],
        env=image_env | emulator.env() | pod_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def test_runner_sends_a_gke_stage_to_the_cluster_end_to_end(standin: GkeStandIn, parity_spec, gcs_emulator) -> None:
    """The runner creates validate_data's JobSet; the test plays the cluster (it runs the pod's
    container command with the pod's env, as Kubernetes would, then marks the JobSet completed) and
    the runner returns the committed manifest."""

    from loraflow.pipeline import runner
    from loraflow.spec.schema import with_overrides
    from loraflow.storage import artifacts

    spec = with_overrides(
        parity_spec.model_copy(update={"compute": {**parity_spec.compute, "validate_data": COMPUTE}}), {}
    )
    lines: list[str] = []
    results: list[Any] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            results.append(runner.run_stage(spec, "validate_data", "run-g", {}, lines.append, KillSwitch()))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    _wait_for(lambda: len(standin.jobsets) == 1 or errors, "the JobSet", 180)
    assert errors == []
    [((namespace, name), js)] = standin.jobsets.items()
    assert namespace == "ml" and js["metadata"]["labels"]["loraflow-dag"] == spec.name
    play_the_pod(js, gcs_emulator)
    standin.set_status(namespace, name, COMPLETED)
    thread.join(30)
    assert errors == [] and len(results) == 1
    assert results[0].summary["train_rows"] == 2000
    assert artifacts.read_manifest(results[0].manifest).prefix.endswith("/run-g/validate_data")
    assert any("launching loraflow.steps.validate_data on GKE" in line for line in lines)
