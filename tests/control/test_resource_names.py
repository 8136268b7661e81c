"""Names that reach Google Cloud and Kubernetes requests, by class (hypothesis): whatever string a spec
gives as a region, no endpoint but Google's is ever built from it; project ids, buckets and
Kubernetes names that pass carry no character that could change a URL; real names pass."""

from __future__ import annotations

import copy
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from loraflow.errors import SpecError
from loraflow.spec import resource_names as rn
from loraflow.spec.compute import VertexCompute, compute_from
from loraflow.spec.schema import validate_spec

REPO = Path(__file__).resolve().parents[2]
TINY = yaml.safe_load((REPO / "pipelines" / "tiny-llama-lora.yaml").read_text())
VERTEX = {"launcher": "vertex", "image": "trainer:1", "machine_type": "n2-standard-8"}
URL_CHARS = set("/?#@:%\\ \t\r\n.")  # what could move a request to another host or path
REGIONS = st.from_regex(rn.REGION, fullmatch=True)
HOSTILE = st.sampled_from(["/", ".evil.com", "@evil.com", "#", "?x=", ":443", "\n", " ", "%2f", "\\", ".", "-a/"])


@given(st.one_of(st.text(max_size=40), REGIONS))
def test_no_region_string_builds_a_host_that_is_not_googles(region: str) -> None:
    try:
        host = rn.vertex_api_host(region)
    except rn.ResourceNameError as exc:
        assert repr(region) in str(exc)
        return
    url = urlsplit(f"https://{host}/v1/projects/p/locations/{region}/customJobs")
    assert url.hostname == host == f"{region}-aiplatform.googleapis.com"
    assert not set(region) & URL_CHARS


@given(REGIONS, HOSTILE, st.booleans())
def test_a_real_region_with_anything_around_it_is_refused(region: str, extra: str, before: bool) -> None:
    crafted = extra + region if before else region + extra
    with pytest.raises(rn.ResourceNameError):
        rn.vertex_api_host(crafted)
    with pytest.raises(ValueError, match="not a Google Cloud region"):
        rn.check_region(crafted)


@pytest.mark.parametrize(
    "region", ["us-central1", "europe-west4", "northamerica-northeast1", "me-central2", "us-east5"]
)
def test_real_regions_pass(region: str) -> None:
    assert rn.vertex_api_host(region) == f"{region}-aiplatform.googleapis.com"


@given(st.one_of(st.text(max_size=40), st.from_regex(rn.PROJECT_ID, fullmatch=True)))
def test_a_project_id_that_passes_has_no_url_character(project: str) -> None:
    try:
        rn.check_project(project)
    except ValueError as exc:
        assert "not a Google Cloud project id" in str(exc)
        return
    assert not set(project) & URL_CHARS and 6 <= len(project) <= 30


@given(st.one_of(st.text(max_size=70), st.from_regex(r"[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]", fullmatch=True)))
def test_a_bucket_that_passes_is_a_gcs_bucket_name(bucket: str) -> None:
    try:
        rn.check_bucket(bucket)
    except ValueError as exc:
        assert "not a GCS bucket name" in str(exc)
        return
    assert set(bucket) <= set("abcdefghijklmnopqrstuvwxyz0123456789._-")
    assert 3 <= len(bucket) <= 222 and ".." not in bucket


@given(st.one_of(st.text(max_size=70), st.from_regex(rn.DNS_LABEL, fullmatch=True)))
def test_a_kubernetes_name_that_passes_has_no_url_character(name: str) -> None:
    for check in (rn.check_k8s_label, rn.check_k8s_subdomain):
        try:
            check(name)
        except ValueError:
            continue
        assert not set(name) & (URL_CHARS - {"."}) and len(name) <= 253


def spec_with_region(region: str) -> dict:
    data = copy.deepcopy(TINY)
    data.setdefault("compute", {})["lora_sft"] = {**VERTEX, "region": region}
    return data


@given(st.one_of(st.text(max_size=30), REGIONS))
def test_the_spec_takes_a_region_only_if_an_endpoint_can_be_built_from_it(region: str) -> None:
    try:
        spec = validate_spec(spec_with_region(region), "t")
    except SpecError as err:
        assert any(path == "compute.lora_sft.region" for path, _ in err.problems), err.problems
        with pytest.raises(rn.ResourceNameError):
            rn.vertex_api_host(region)
        return
    assert rn.vertex_api_host(spec.compute["lora_sft"].region or "") == f"{region}-aiplatform.googleapis.com"


def test_the_launchers_refuse_a_region_that_slipped_past_the_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    """Defence in depth: a compute entry or registry target built without validation still cannot send a
    request elsewhere; the host is refused where it is built, before any client exists."""
    from loraflow.launchers import vertex as launch_vertex
    from loraflow.launchers import vertex_job as vertex
    from loraflow.registry import vertex as vertex_registry

    monkeypatch.delenv("LORAFLOW_VERTEX_ENDPOINT", raising=False)
    crafted = VertexCompute.model_construct(**{**compute_from(**VERTEX).__dict__, "region": "evil.com/x"})
    with pytest.raises(rn.ResourceNameError, match=r"'evil\.com/x' is not a Google Cloud region"):
        launch_vertex.VertexLauncher(crafted, vertex.JobIdentity("d", "r", "lora_sft", "k"), "gs://bucket/p")
    with pytest.raises(rn.ResourceNameError, match="no Vertex AI endpoint is built from it"):
        launch_vertex.endpoint_for(crafted)
    target = vertex_registry.Target("acme-ml", "us-central1.evil.com", "tiny", "img", (), {})
    with pytest.raises(rn.ResourceNameError):
        vertex_registry.VertexModelRegistry(target, "tiny")


@pytest.mark.parametrize(
    ("check", "value"),
    [
        (rn.check_image, "us-docker.pkg.dev/acme-ml/loraflow/trainer:0.1.0"),
        (rn.check_image, "vllm/vllm-openai:v0.6.3"),
        (rn.check_image, "localhost:5000/x/y@sha256:" + "a" * 64),
        (rn.check_service_account, "loraflow-trainer@acme-ml.iam.gserviceaccount.com"),
        (rn.check_service_account, "123456789-compute@developer.gserviceaccount.com"),
        (rn.check_network, "projects/123456789/global/networks/my-vpc"),
        (rn.check_reservation, "projects/acme-ml/zones/us-central1-a/reservations/r1"),
        (rn.check_machine_type, "ct5lp-hightpu-4t"),
        (rn.check_tpu_topology, "2x2x2"),
        (rn.check_k8s_subdomain, "loraflow.trainer"),
        (rn.check_bucket, "acme-llm-artifacts"),
        (rn.check_bucket, "data.acme.example"),
    ],
)
def test_real_names_pass(check, value: str) -> None:  # type: ignore[no-untyped-def]
    assert check(value) == value


def test_the_shipped_specs_pass() -> None:
    from loraflow.spec.schema import load_spec

    for path in sorted((REPO / "pipelines").glob("*.yaml")):
        load_spec(path)
