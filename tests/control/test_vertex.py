"""The Vertex AI CustomJob request of a stage: built without the SDK, equal to what the SDK builds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loraflow.launchers import vertex_job as vertex
from loraflow.pipeline.plan import describe
from loraflow.spec.compute import compute_from
from loraflow.spec.schema import load_spec

REPO = Path(__file__).resolve().parents[2]
PRODUCTION = REPO / "pipelines" / "llama31-8b-lora.yaml"


@pytest.fixture(autouse=True)
def no_project_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The project then comes from the service account (the GCS emulator fixture sets GOOGLE_CLOUD_PROJECT)."""
    monkeypatch.delenv("GOOGLE_CLOUD_PROJECT", raising=False)
    monkeypatch.delenv("LORAFLOW_VERTEX_PROJECT", raising=False)


def stage_request(stage: str, run_id: str = "RUN_ID") -> dict:
    plan = describe(load_spec(PRODUCTION), run_id)
    (entry,) = [s for s in plan["stages"] if s["stage"] == stage]
    request: dict = entry["vertex_create_request"]
    return request


def test_identity_is_deterministic_and_valid_vertex_naming() -> None:
    a = vertex.JobIdentity("llama31-8b-lora", "manual__2025-01-01T00:00:00+00:00", "lora_sft", "k" * 64)
    assert a.key == vertex.JobIdentity(a.dag_id, a.run_id, a.stage, a.cache_key).key
    others = {
        vertex.JobIdentity(a.dag_id, "other-run", a.stage, a.cache_key).key,
        vertex.JobIdentity(a.dag_id, a.run_id, "merge_adapter", a.cache_key).key,
        vertex.JobIdentity(a.dag_id, a.run_id, a.stage, "other-key").key,
        vertex.JobIdentity("other-dag", a.run_id, a.stage, a.cache_key).key,
    }
    assert a.key not in others and len(others) == 4
    long = vertex.JobIdentity("x" * 300, a.run_id, a.stage, a.cache_key)
    assert len(long.display_name) <= 128 and long.display_name.endswith(long.key)
    for ident in (a, long):
        for k, v in ident.labels.items():
            assert len(k) <= 63 and len(v) <= 63
            assert all(c.islower() or c.isdigit() or c in "-_" for c in k + v), (k, v)
    assert a.list_filter == f'labels.loraflow-job="{a.key}"'


def test_production_lora_sft_is_a_tpu_slice_of_four_hosts() -> None:
    request = stage_request("lora_sft")
    job = request["customJob"]
    (pool,) = job["jobSpec"]["workerPoolSpecs"]
    assert request["parent"] == "projects/acme-ml/locations/us-central1"  # from the service account
    assert pool["machineSpec"] == {"machineType": "ct5lp-hightpu-4t", "tpuTopology": "4x4"}
    assert pool["replicaCount"] == "4"
    container = pool["containerSpec"]
    assert container["imageUri"] == "us-docker.pkg.dev/acme-ml/loraflow/trainer:0.1.0"
    assert container["command"] == ["python"]
    assert container["args"][:2] == ["-m", "loraflow.steps.lora_sft"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["LORAFLOW_EXPECTED_HOSTS"] == "4" and env["LORAFLOW_LAUNCHER"] == "vertex"
    assert "JAX_PLATFORMS" not in env  # the TPU, not the CPU the local launcher defaults to
    prefix = "gs://acme-llm-artifacts/loraflow/llama31-8b-lora/RUN_ID/lora_sft"
    assert job["jobSpec"]["baseOutputDirectory"] == {"outputUriPrefix": f"{prefix}/_vertex/"}
    assert job["jobSpec"]["serviceAccount"] == "loraflow-trainer@acme-ml.iam.gserviceaccount.com"
    assert job["labels"]["loraflow-job"] == job["displayName"].rsplit(".", 1)[1]


def test_the_argv_is_the_local_launchers_argv() -> None:
    plan = describe(load_spec(PRODUCTION))
    for entry in plan["stages"]:
        if "vertex_create_request" in entry:
            (pool,) = entry["vertex_create_request"]["customJob"]["jobSpec"]["workerPoolSpecs"]
            assert ["python", *pool["containerSpec"]["args"]] == entry["argv"]
    local = [s["stage"] for s in plan["stages"] if "vertex_create_request" not in s]
    assert local == ["validate_data", "gate", "publish", "report"]


def test_gpu_machine_types_name_their_accelerator() -> None:
    (pool,) = stage_request("evaluate_base")["customJob"]["jobSpec"]["workerPoolSpecs"]
    assert pool["machineSpec"] == {
        "machineType": "g2-standard-12",
        "acceleratorType": "NVIDIA_L4",
        "acceleratorCount": 1,
    }
    spec = vertex.machine_spec(compute_from(launcher="vertex", image="i", machine_type="a3-highgpu-8g"))
    assert spec["acceleratorCount"] == 8
    assert vertex.machine_spec(compute_from(launcher="vertex", image="i", machine_type="n2-highmem-16")) == {
        "machineType": "n2-highmem-16"
    }


def test_topology_on_a_cpu_machine_says_what_to_change() -> None:
    compute = compute_from(launcher="vertex", image="i", machine_type="n2-standard-8", tpu_topology="2x2")
    with pytest.raises(vertex.VertexConfigError, match="not a TPU machine type"):
        vertex.machine_spec(compute)


def test_project_comes_from_the_environment_first() -> None:
    compute = compute_from(
        launcher="vertex", image="i", machine_type="n2-standard-8", service_account="sa@acme-ml.iam.gserviceaccount.com"
    )
    assert vertex.project_for(compute, {}) == "acme-ml"
    assert vertex.project_for(compute, {"GOOGLE_CLOUD_PROJECT": "p2"}) == "p2"
    assert vertex.project_for(compute, {"GOOGLE_CLOUD_PROJECT": "p2", "LORAFLOW_VERTEX_PROJECT": "p3"}) == "p3"
    bare = compute_from(launcher="vertex", image="i", machine_type="n2-standard-8")
    assert vertex.project_for(bare, {}) is None


def test_cli_plan_prints_the_request_without_the_sdk_or_network() -> None:
    code = (
        "import sys, socket\n"
        "def no_network(*a, **k): raise AssertionError('network call')\n"
        "socket.socket.connect = no_network\n"
        "from loraflow.cli import main\n"
        f"rc = main(['plan', {str(PRODUCTION)!r}, '--json'])\n"
        "assert 'google.cloud.aiplatform' not in sys.modules\n"
        "sys.exit(rc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    requests = {s["stage"]: s["vertex_create_request"] for s in plan["stages"] if "vertex_create_request" in s}
    assert set(requests) == {"convert_checkpoint", "evaluate_base", "lora_sft", "merge_adapter", "evaluate_tuned"}
    text = subprocess.run(
        [sys.executable, "-m", "loraflow.cli", "plan", str(PRODUCTION)], capture_output=True, text=True, cwd=REPO
    )
    assert '"tpuTopology": "4x4"' in text.stdout and "Vertex AI CustomJob create request" in text.stdout


def test_the_request_is_what_aiplatform_builds_offline() -> None:
    """The SDK (AnonymousCredentials, no network) builds the same CustomJob from the same fields."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import aiplatform
    from google.cloud.aiplatform_v1.types import CustomJob
    from google.protobuf import json_format

    request = stage_request("lora_sft", run_id="scheduled__2025-01-06T03:00:00+00:00")
    ours = request["customJob"]
    (pool,) = ours["jobSpec"]["workerPoolSpecs"]
    container = pool["containerSpec"]
    sdk_job = aiplatform.CustomJob(
        display_name=ours["displayName"],
        worker_pool_specs=[
            {
                "machine_spec": {"machine_type": "ct5lp-hightpu-4t", "tpu_topology": "4x4"},
                "replica_count": 4,
                "container_spec": {
                    "image_uri": container["imageUri"],
                    "command": ["python"],
                    "args": container["args"],
                    "env": container["env"],
                },
            }
        ],
        base_output_dir=ours["jobSpec"]["baseOutputDirectory"]["outputUriPrefix"],
        staging_bucket="gs://acme-llm-artifacts",  # required by the constructor, unused with base_output_dir
        labels=ours["labels"],
        project="acme-ml",
        location="us-central1",
        credentials=AnonymousCredentials(),
    )
    # aiplatform 2.7.0's CustomJob has no to_json() (stack.md says it does); its request message is
    # _gca_resource, which submit() sends as is.
    resource = sdk_job._gca_resource
    sdk = json_format.MessageToDict(type(resource).pb(resource))
    sdk["jobSpec"]["serviceAccount"] = "loraflow-trainer@acme-ml.iam.gserviceaccount.com"  # a submit() argument
    assert sdk == ours
    # and the body parses strictly (no unknown field) into the v1 message the launcher sends
    message = json_format.ParseDict(ours, CustomJob.pb(CustomJob()))
    assert message.job_spec.worker_pool_specs[0].machine_spec.tpu_topology == "4x4"


def test_network_reservation_and_spot_reach_the_request_as_the_v1_proto_has_them() -> None:
    from google.cloud.aiplatform_v1.types import CustomJob, CustomJobSpec, ReservationAffinity, Scheduling
    from google.protobuf import json_format

    reservation = "projects/acme-ml/zones/us-central1-a/reservations/v5e-16"
    network = "projects/123456789/global/networks/ml-vpc"
    reserved = compute_from(
        launcher="vertex",
        image="i",
        machine_type="ct5lp-hightpu-4t",
        tpu_topology="4x4",
        hosts=4,
        network=network,
        reserved_ip_ranges=["vertex-range"],
        reservation=reservation,
    )
    identity = vertex.JobIdentity("d", "r", "lora_sft", "k")
    body = vertex.custom_job(reserved, identity, ["python", "-m", "x"], "gs://b/p")
    message = CustomJob.wrap(json_format.ParseDict(body, CustomJob.pb(CustomJob())))  # strict: no unknown field
    assert message.job_spec.network == network and list(message.job_spec.reserved_ip_ranges) == ["vertex-range"]
    affinity = message.job_spec.worker_pool_specs[0].machine_spec.reservation_affinity
    assert affinity.reservation_affinity_type == ReservationAffinity.Type.SPECIFIC_RESERVATION
    assert affinity.key == vertex.RESERVATION_KEY and list(affinity.values) == [reservation]
    assert "scheduling" not in body["jobSpec"]

    spot = reserved.model_copy(update={"reservation": None, "spot": True})
    spec = CustomJobSpec.pb(CustomJobSpec())
    json_format.ParseDict(vertex.custom_job(spot, identity, ["python", "-m", "x"], "gs://b/p")["jobSpec"], spec)
    assert spec.scheduling.strategy == Scheduling.Strategy.SPOT
    plain = vertex.custom_job(
        compute_from(launcher="vertex", image="i", machine_type="n2-standard-4"),
        identity,
        ["python", "-m", "x"],
        "gs://b",
    )
    assert not {"network", "reservedIpRanges", "scheduling"} & set(plain["jobSpec"])
    assert "reservationAffinity" not in plain["jobSpec"]["workerPoolSpecs"][0]["machineSpec"]


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"reserved_ip_ranges": ["r"]}, "reserved_ip_ranges need a network"),
        ({"reservation": "projects/p/zones/z/reservations/r", "spot": True}, "Spot capacity cannot consume"),
        ({"reservation": "my-reservation"}, "is not projects/PROJECT/zones/ZONE/reservations/NAME"),
    ],
)
def test_network_options_that_cannot_work_are_refused(fields: dict, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        compute_from(launcher="vertex", image="i", machine_type="n2-standard-4", **fields)
