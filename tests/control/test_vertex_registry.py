"""Vertex AI Model Registry publishing, with the real aiplatform client against the Vertex stand-in."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from loraflow.errors import LoraflowError
from loraflow.registry import vertex as vr
from tests.vertex_standin import VertexStandIn

MODEL = "projects/p1/locations/europe-west4/models/loraflow-tiny-llama-lora"


@pytest.fixture
def standin(tmp_path: Path) -> Iterator[VertexStandIn]:
    with VertexStandIn({}, tmp_path, state_delay=0.3) as s:
        yield s


def registry(standin: VertexStandIn) -> vr.VertexModelRegistry:
    cfg = {
        "project": "p1",
        "region": "europe-west4",
        "serving_container_image": "europe-docker.pkg.dev/p1/serving/vllm:0.32",
        "serving_container_args": ["--max-model-len", "128"],
        "labels": {"team": "support"},
    }
    return vr.VertexModelRegistry(vr.Target.from_config(cfg, "tiny-llama-lora", {}), "tiny-llama-lora", standin.url)


def publish(reg: vr.VertexModelRegistry, version: int, champion: bool, run: str = "manual__2026-12-03T01:00:00+00:00"):  # type: ignore[no-untyped-def]
    return reg.publish(
        version=version,
        champion=champion,
        artifact_uri=f"gs://b/arts/tiny-llama-lora/run-{version}/merge_adapter",
        run_id=run,
        fingerprint=f"{version}" * 40,
        manifest_uri=f"gs://b/arts/tiny-llama-lora/run-{version}/merge_adapter/_MANIFEST.json",
    )


def test_first_promotion_creates_the_model_with_the_champion_alias(standin: VertexStandIn) -> None:
    got = publish(registry(standin), 1, champion=True)
    assert got["model"] == MODEL and got["version_id"] == "1"
    assert got["version_aliases"] == ["champion", "default"]
    assert got["artifact_uri"] == "gs://b/arts/tiny-llama-lora/run-1/merge_adapter"
    assert got["labels"] == {
        "team": "support",
        "loraflow-pipeline": "tiny-llama-lora",
        "loraflow-run": "manual__2026-12-03t01-00-00-00-00",
        "loraflow-version": "1",
        "loraflow-model": "1111111111111111",
    }
    assert "/models/loraflow-tiny-llama-lora/versions/1?project=p1" in got["console_url"]
    # The request as the client sent it: a new model id, the serving container, the run in the description.
    (request,) = standin.models.uploads
    assert request["modelId"] == "loraflow-tiny-llama-lora" and "parentModel" not in request
    assert request["model"]["containerSpec"] == {
        "imageUri": "europe-docker.pkg.dev/p1/serving/vllm:0.32",
        "args": ["--max-model-len", "128"],
    }
    assert "run manual__2026-12-03T01:00:00+00:00" in request["model"]["versionDescription"]
    assert standin.models.polls >= 2  # the upload is a long-running operation, polled until done


def test_a_new_champion_moves_the_aliases_and_keeps_older_versions(standin: VertexStandIn) -> None:
    reg = registry(standin)
    publish(reg, 1, champion=True)
    second = publish(reg, 2, champion=True, run="run-2")
    assert second["version_id"] == "2" and second["version_aliases"] == ["champion", "default"]
    assert standin.models.uploads[1]["parentModel"] == MODEL
    versions = {v["versionId"]: v for v in standin.models.versions(MODEL)}
    assert versions["1"]["versionAliases"] == [] and versions["1"]["artifactUri"].endswith("run-1/merge_adapter")
    # A version registered without the champion alias (the GCS alias already points at a newer one).
    third = publish(reg, 3, champion=False, run="run-3")
    assert third["version_aliases"] == []
    assert {v["versionId"]: v["versionAliases"] for v in standin.models.versions(MODEL)}["2"] == ["champion", "default"]


def test_a_retried_publish_uploads_nothing_twice(standin: VertexStandIn) -> None:
    reg = registry(standin)
    first = publish(reg, 1, champion=True)
    again = publish(reg, 1, champion=True)
    assert again == first and len(standin.models.uploads) == 1


def test_missing_project_is_named_with_the_fix() -> None:
    with pytest.raises(LoraflowError, match=r"set publish.vertex_model_registry.project"):
        vr.Target.from_config({"serving_container_image": "i"}, "tiny", {})
    target = vr.Target.from_config({"serving_container_image": "i"}, "tiny", {"GOOGLE_CLOUD_PROJECT": "p9"})
    assert target.parent == "projects/p9/locations/us-central1" and target.display_name == "tiny"


def test_label_values() -> None:
    assert vr.label_value("scheduled__2026-01-01T03:00:00+00:00") == "scheduled__2026-01-01t03-00-00-00-00"
    assert len(vr.label_value("x" * 100)) == 63
    assert vr.model_id("tiny-llama-lora") == "loraflow-tiny-llama-lora"


def test_the_spec_section_reaches_the_publish_stage() -> None:
    from loraflow.pipeline.plan import stage_plans
    from loraflow.spec.schema import load_spec, with_overrides

    spec = load_spec(Path(__file__).resolve().parents[2] / "pipelines" / "tiny-llama-lora.yaml")
    assert "vertex_model_registry" not in stage_plans(spec)["publish"].config
    data = spec.model_dump(mode="json")
    data["publish"]["vertex_model_registry"] = {"serving_container_image": "img", "project": "acme-ml"}
    from loraflow.spec.schema import validate_spec

    config = stage_plans(validate_spec(data, "t"))["publish"].config["vertex_model_registry"]
    assert config["serving_container_image"] == "img" and config["region"] == "us-central1"
    assert with_overrides(spec, {}).publish.vertex_model_registry is None
