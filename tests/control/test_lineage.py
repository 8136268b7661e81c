"""What each stage reports to an OpenLineage backend: loraflow/pipeline/lineage.py builds it from a
committed manifest, operators/lineage.py makes the provider's objects, and every stage operator's
OpenLineage hooks return them for the task that committed it."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from loraflow.errors import ArtifactError
from loraflow.pipeline import lineage
from loraflow.pipeline.plan import stage_plans
from loraflow.spec.schema import load_spec, with_overrides
from loraflow.spec.stages import BY_NAME, STAGES, Source
from loraflow.storage import artifacts, gcs

REPO = Path(__file__).resolve().parents[2]
RUN = "gs://lake/artifacts/tiny/run-1"

# Each stage's summary as its step writes it (a few of its figures).
SUMMARIES: dict[str, dict[str, Any]] = {
    "validate_data": {"train_rows": 1600, "eval_rows": 400, "expectations": 14, "failed": 0, "warnings": 0},
    "convert_checkpoint": {"parameters": 404096},
    "evaluate_base": {"accuracy": 0.5, "n": 400},
    "lora_sft": {"first_loss": 6.25, "final_loss": 0.31, "steps": 60},
    "merge_adapter": {"tensors_changed": 14},
    "evaluate_tuned": {"accuracy": 0.9675, "n": 400, "tokens_per_s": 512.0},
    "gate": {"promote": True, "metric": "accuracy", "base": 0.5, "tuned": 0.9675, "delta": 0.4675, "reason": "r"},
    "publish": {"promoted": True, "version": 3, "model_manifest": f"{RUN}/merge_adapter/_MANIFEST.json"},
    "report": {"report": f"{RUN}/report/report.html"},
}


def files(stage: str) -> dict[str, dict[str, Any]]:
    return {f"{stage}.json": {"size": 7, "crc32c": "AAAAAA=="}, "tokenizer.json": {"size": 35, "crc32c": "yZRlqg=="}}


def manifest(stage: str, inputs: dict[str, dict[str, str]], summary: dict[str, Any] | None = None, **more: Any):
    """A stage's manifest as artifacts.commit writes it."""
    return {
        "format": artifacts.MANIFEST_FORMAT,
        "stage": stage,
        "prefix": f"{RUN}/{stage}",
        "files": files(stage),
        "inputs": inputs,
        "config": {},
        "lock_version": "lock16",
        "cache_key": f"key-{stage}",
        "summary": SUMMARIES[stage] if summary is None else summary,
        "committed_at": "2026-12-06T05:00:00Z",
        **more,
    }


def source(uri: str) -> dict[str, str]:
    return {"uri": uri, "fingerprint": hashlib.sha256(uri.encode()).hexdigest()}


def validate_data_manifest(**more: Any) -> dict[str, Any]:
    inputs = {
        "train": source("gs://lake/datasets/parity/train.jsonl"),
        "eval": source("gs://lake/datasets/parity/eval.jsonl"),
        "tokenizer": source("gs://lake/sources/tiny/"),
    }
    return manifest("validate_data", inputs, **{"config": {"max_seq_len": 256}, **more})


def publish_manifest(summary: dict[str, Any] | None = None) -> dict[str, Any]:
    inputs = {
        "model": {"uri": f"{RUN}/merge_adapter/_MANIFEST.json", "fingerprint": "f-model", "cache_key": "k"},
        "decision": {"uri": f"{RUN}/gate/_MANIFEST.json", "fingerprint": "f-gate"},
    }
    config = {"registry_uri": "gs://models/registry", "pipeline": "tiny", "run_id": "run-1"}
    return manifest("publish", inputs, summary, config=config)


# ------------------------------------------------------------------------------------ the core


def test_a_dataset_is_named_by_its_bucket_and_object_path_and_a_manifest_by_its_artifact() -> None:
    assert lineage.dataset_id("gs://lake/datasets/parity/train.jsonl") == ("gs://lake", "datasets/parity/train.jsonl")
    assert lineage.dataset_id("gs://lake/sources/tiny/") == ("gs://lake", "sources/tiny")
    assert lineage.dataset_id("gs://lake/sources/tinyX/") == ("gs://lake", "sources/tinyX")
    assert lineage.dataset_id(f"{RUN}/lora_sft/_MANIFEST.json") == ("gs://lake", "artifacts/tiny/run-1/lora_sft")
    assert lineage.dataset_uri(f"{RUN}/lora_sft/_MANIFEST.json") == f"{RUN}/lora_sft"
    with pytest.raises(ArtifactError, match="not a gs:// URI"):
        lineage.dataset_id("/tmp/train.jsonl")


def test_validate_data_reports_the_rows_it_counted_in_each_input_and_its_contract_on_its_output() -> None:
    got = lineage.stage_lineage(validate_data_manifest(), cached=False)
    inputs = {d.name: d for d in got.inputs}
    assert set(inputs) == {"datasets/parity/train.jsonl", "datasets/parity/eval.jsonl", "sources/tiny"}
    assert inputs["datasets/parity/train.jsonl"].row_count == 1600
    assert inputs["datasets/parity/eval.jsonl"].row_count == 400
    assert inputs["sources/tiny"].row_count is None  # nothing counted there
    assert (
        inputs["datasets/parity/train.jsonl"].version == source("gs://lake/datasets/parity/train.jsonl")["fingerprint"]
    )
    [out] = got.outputs
    assert (out.namespace, out.name) == ("gs://lake", "artifacts/tiny/run-1/validate_data")
    assert out.facets["data_contract"] == {"stage": "validate_data", "summary": SUMMARIES["validate_data"]}


def test_an_output_carries_its_fingerprint_size_and_every_files_checksum() -> None:
    got = lineage.stage_lineage(validate_data_manifest(), cached=True)
    [out] = got.outputs
    assert out.version == artifacts.fingerprint(files("validate_data"))
    assert (out.size, out.file_count) == (42, 2)
    assert out.facets["manifest"] == {
        "uri": f"{RUN}/validate_data/_MANIFEST.json",
        "fingerprint": out.version,
        "cache_key": "key-validate_data",
        "lock_version": "lock16",
        "committed_at": "2026-12-06T05:00:00Z",
        "file_count": 2,
        "files": [  # by name
            {"name": "tokenizer.json", "size": 35, "crc32c": "yZRlqg=="},
            {"name": "validate_data.json", "size": 7, "crc32c": "AAAAAA=="},
        ],
    }
    assert got.run == {
        "stage": "validate_data",
        "manifest": f"{RUN}/validate_data/_MANIFEST.json",
        "cached": True,
        "cache_key": "key-validate_data",
        "lock_version": "lock16",
        "config": {"max_seq_len": 256},
    }


def test_a_large_artifact_lists_its_first_files_by_name_and_counts_them_all(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lineage, "MAX_FILES", 1)
    [out] = lineage.stage_lineage(validate_data_manifest(), cached=False).outputs
    assert out.facets["manifest"]["files"] == [{"name": "tokenizer.json", "size": 35, "crc32c": "yZRlqg=="}]
    assert out.facets["manifest"]["file_count"] == out.file_count == 2


def test_a_row_count_is_an_integer_figure_named_after_the_input() -> None:
    summary = {"train_rows": True, "eval_rows": "400", "tokenizer_rows": 3}
    got = lineage.stage_lineage(validate_data_manifest(summary=summary), cached=False)
    assert {d.name: d.row_count for d in got.inputs} == {
        "datasets/parity/train.jsonl": None,
        "datasets/parity/eval.jsonl": None,
        "sources/tiny": 3,
    }


def test_an_object_two_inputs_name_is_one_dataset() -> None:
    inputs = {"model": source("gs://lake/sources/tiny"), "base": source("gs://lake/sources/tiny/")}
    got = lineage.stage_lineage(manifest("merge_adapter", inputs), cached=False)
    assert [(d.namespace, d.name) for d in got.inputs] == [("gs://lake", "sources/tiny")]


def test_each_stage_reports_its_summary_under_its_stage_table_facet() -> None:
    for stage in STAGES:
        committed = publish_manifest() if stage == "publish" else manifest(stage, {})
        [out, *_] = lineage.stage_lineage(committed, cached=False).outputs
        facet = BY_NAME[stage].lineage_facet
        assert out.facets[facet] == {"stage": stage, "summary": SUMMARIES[stage]}, stage
    assert BY_NAME["gate"].lineage_facet == "gate_decision"
    assert BY_NAME["evaluate_tuned"].lineage_facet == BY_NAME["evaluate_base"].lineage_facet == "evaluation"


def test_publish_reports_the_registry_version_it_registered_and_the_model_it_is() -> None:
    got = lineage.stage_lineage(publish_manifest(), cached=False)
    artifact, version = got.outputs
    assert (artifact.namespace, artifact.name) == ("gs://lake", "artifacts/tiny/run-1/publish")
    assert (version.namespace, version.name, version.version) == (
        "gs://models",
        "registry/tiny/versions/0003.json",
        "3",
    )
    assert version.facets == {
        "model_version": {
            "version": 3,
            "pipeline": "tiny",
            "registry": "gs://models/registry",
            "model": f"{RUN}/merge_adapter",
            "model_manifest": f"{RUN}/merge_adapter/_MANIFEST.json",
            "model_fingerprint": "f-model",
            "vertex_model": None,
        }
    }
    vertex = lineage.stage_lineage(publish_manifest({**SUMMARIES["publish"], "vertex_model": "m@2"}), cached=False)
    assert vertex.outputs[1].facets["model_version"]["vertex_model"] == "m@2"


def test_a_publish_by_hand_names_the_model_its_config_gave() -> None:
    """``loraflow`` run by hand: publish's model comes from its config (``model_manifest``), not an input."""
    by_hand = {**publish_manifest(), "inputs": {"decision": {"uri": f"{RUN}/gate/_MANIFEST.json", "fingerprint": "g"}}}
    facet = lineage.stage_lineage(by_hand, cached=False).outputs[1].facets["model_version"]
    assert (facet["model"], facet["model_fingerprint"]) == (f"{RUN}/merge_adapter", None)


@pytest.mark.parametrize(
    "summary",
    [{"promoted": False, "reason": "not better"}, {"promoted": True}, {"promoted": True, "version": True}],
)
def test_publish_without_a_registered_version_reports_no_registry_version(summary: dict[str, Any]) -> None:
    got = lineage.stage_lineage(publish_manifest(summary), cached=False)
    assert [d.name for d in got.outputs] == ["artifacts/tiny/run-1/publish"]


def test_a_handoff_dataset_version_is_named_on_the_inputs_that_lie_in_it() -> None:
    inputs = {
        "train": source("gs://lake/handoff/v7/train.jsonl"),
        "eval": source("gs://lake/handoff/v7/eval.jsonl"),
        "tokenizer": source("gs://lake/sources/tiny"),
    }
    got = lineage.stage_lineage(manifest("validate_data", inputs), cached=False, handoff_prefix="gs://lake/handoff/")
    facets = {d.name: d.facets for d in got.inputs}
    assert facets["handoff/v7/train.jsonl"] == {"handoff": {"prefix": "gs://lake/handoff/", "version": "v7"}}
    assert facets["handoff/v7/eval.jsonl"]["handoff"]["version"] == "v7"
    assert facets["sources/tiny"] == {}


@pytest.mark.parametrize(
    ("uri", "prefix", "version"),
    [
        ("gs://lake/handoff/v7/train.jsonl", "gs://lake/handoff", "v7"),
        ("gs://lake/handoff/v7/train.jsonl", "gs://lake/handoff/", "v7"),
        ("gs://lake/handoff/v7/train/part-0.jsonl", "gs://lake/handoff", "v7"),
        ("gs://lake/handoffX/v7/train.jsonl", "gs://lake/handoffX", "v7"),
        ("gs://lake/handoff/train.jsonl", "gs://lake/handoff", None),  # no version folder
        ("gs://lake/handoff//train.jsonl", "gs://lake/handoff", None),
        ("gs://lake/handoff-old/v7/train.jsonl", "gs://lake/handoff", None),
        ("gs://lake/other/handoff/v7/train.jsonl", "gs://lake/handoff", None),
        ("gs://lake/handoff/v7/train.jsonl", None, None),
        ("gs://lake/handoff/v7/train.jsonl", "", None),
    ],
)
def test_the_handoff_version_is_the_folder_under_the_prefix(uri: str, prefix: str | None, version: str | None) -> None:
    assert lineage.handoff_version(uri, prefix) == version


# ------------------------------------------------------------------------------------ the operators


@pytest.fixture
def committed(gcs_bucket: str) -> dict[str, artifacts.Manifest]:
    """Every stage of the tiny pipeline committed in the emulator, in order, each recording its inputs
    as the step harness does (a source's fingerprint; an upstream's manifest URI and fingerprint)."""
    spec = with_overrides(load_spec(REPO / "pipelines" / "tiny-llama-lora.yaml"), {})
    spec = spec.model_copy(update={"artifact_root": f"{gcs_bucket}/artifacts"})
    plans = stage_plans(spec)
    done: dict[str, artifacts.Manifest] = {}
    for stage in STAGES:
        inputs = {}
        for name, ref in plans[stage].inputs.items():
            if isinstance(ref, Source):
                inputs[name] = source(ref.uri)
            else:
                upstream = done[ref.stage]
                inputs[name] = {
                    "uri": upstream.uri,
                    "fingerprint": upstream.fingerprint,
                    "cache_key": f"key-{ref.stage}",
                }
        config = {"registry_uri": spec.registry_uri, "pipeline": spec.name} if stage == "publish" else {}
        prefix = gcs.join(spec.artifact_root, spec.name, "run-1", stage)
        done[stage] = artifacts.commit(
            prefix,
            files(stage),
            stage=stage,
            inputs=inputs,
            config=config,
            lock_version="lock16",
            cache_key=f"key-{stage}",
            summary={**SUMMARIES[stage], "model_manifest": done["merge_adapter"].uri}
            if stage == "publish"
            else SUMMARIES[stage],
        )
    return done


def finished_operator(stage: str, commit: artifacts.Manifest, spec: dict[str, Any] | None = None) -> Any:
    """The stage's operator as its task leaves it after execute: holding the XCom value it returned."""
    from operators.stages import OPERATORS

    op = OPERATORS[stage].for_spec(spec or {"name": "tiny-llama-lora"}, task_id=stage)
    op._finished = {"stage": stage, "manifest": commit.uri, "cached": False, "summary": commit.summary}
    return op


def names(datasets: list[Any]) -> dict[str, Any]:
    return {f"{d.namespace}/{d.name}": d for d in datasets}


@pytest.mark.parametrize("stage", STAGES)
def test_each_stage_operator_reports_what_its_commit_read_and_wrote(
    stage: str, committed: dict[str, artifacts.Manifest]
) -> None:
    commit = committed[stage]
    got = finished_operator(stage, commit).get_openlineage_facets_on_complete(None)
    out = names(got.outputs)[commit.prefix]
    assert out.facets["version"].datasetVersion == commit.fingerprint
    summary = out.facets[f"loraflow_{BY_NAME[stage].lineage_facet}"]
    assert (summary.stage, summary.summary) == (stage, commit.summary)
    assert {f["name"]: {"size": f["size"], "crc32c": f["crc32c"]} for f in out.facets["loraflow_manifest"].files} == (
        commit.files
    )
    assert (out.outputFacets["outputStatistics"].size, out.outputFacets["outputStatistics"].fileCount) == (42, 2)
    recorded = commit.data["inputs"].values()
    assert set(names(got.inputs)) == {lineage.dataset_uri(r["uri"]) for r in recorded}
    assert got.run_facets["loraflow_stage"].manifest == commit.uri


def test_the_stage_operators_chain_each_input_to_the_output_that_made_it(
    committed: dict[str, artifacts.Manifest],
) -> None:
    reported = {s: finished_operator(s, m).get_openlineage_facets_on_complete(None) for s, m in committed.items()}
    made = {uri: (stage, d) for stage, got in reported.items() for uri, d in names(got.outputs).items()}
    links = set()
    for stage, got in reported.items():
        for uri, dataset in names(got.inputs).items():
            if uri in made:
                upstream, output = made[uri]
                assert dataset.facets["version"] == output.facets["version"], (stage, uri)
                links.add((upstream, stage))
    for link in [("validate_data", "lora_sft"), ("lora_sft", "merge_adapter"), ("merge_adapter", "publish")]:
        assert link in links
    [version] = [d for d in reported["publish"].outputs if "loraflow_model_version" in d.facets]
    assert made[version.facets["loraflow_model_version"].model][0] == "merge_adapter"
    assert version.name.endswith("/artifacts/_registry/tiny-llama-lora/versions/0003.json")  # the spec's registry


def test_a_task_reports_datasets_only_once_it_committed(committed: dict[str, artifacts.Manifest]) -> None:
    from operators.stages import OPERATORS

    op = OPERATORS["lora_sft"].for_spec({"name": "tiny-llama-lora"}, task_id="lora_sft")
    start = op.get_openlineage_facets_on_start()
    assert (start.inputs, start.outputs) == ([], [])
    failed = op.get_openlineage_facets_on_complete(None)  # execute raised before done(): nothing committed
    assert (failed.inputs, failed.outputs) == ([], [])


def test_a_handoff_pipelines_operator_names_the_dataset_version(gcs_bucket: str) -> None:
    inputs = {"train": source(f"{gcs_bucket}/handoff/2026-12-03/train.jsonl")}
    commit = artifacts.commit(
        f"{gcs_bucket}/a/validate_data", files("validate_data"), stage="validate_data", inputs=inputs, config={},
        lock_version="l", cache_key="k", summary=SUMMARIES["validate_data"],
    )  # fmt: skip
    spec = {"name": "tiny", "handoff": {"prefix": f"{gcs_bucket}/handoff"}}
    [train] = finished_operator("validate_data", commit, spec).get_openlineage_facets_on_complete(None).inputs
    assert train.facets["loraflow_handoff"].version == "2026-12-03"
    assert train.inputFacets["dataQualityMetrics"].rowCount == 1600


def sent(task: str, lineage: Any, folder: Path) -> dict[str, Any]:
    """The event a backend receives for a task's lineage: through the provider's adapter (its secrets
    masking included) and OpenLineage's file transport."""
    from airflow.providers.openlineage.plugins.adapter import OpenLineageAdapter
    from openlineage.client import OpenLineageClient
    from openlineage.client.event_v2 import Job, Run, RunEvent, RunState
    from openlineage.client.transport.file import FileConfig, FileTransport

    transport = FileTransport(FileConfig(log_file_path=str(folder / f"{task}.json"), append=True))
    event = RunEvent(
        eventType=RunState.COMPLETE,
        eventTime="2026-12-06T05:00:00Z",
        run=Run(runId="01937f3c-0000-7000-8000-000000000000", facets=lineage.run_facets),
        job=Job(namespace="default", name=f"tiny-llama-lora.{task}"),
        inputs=lineage.inputs,
        outputs=lineage.outputs,
    )
    OpenLineageAdapter(client=OpenLineageClient(transport=transport)).emit(event)
    return json.loads((folder / f"{task}.json").read_text())


def test_the_event_a_backend_receives_carries_the_facets_as_json(
    committed: dict[str, artifacts.Manifest], tmp_path: Path
) -> None:
    gate = sent("gate", finished_operator("gate", committed["gate"]).get_openlineage_facets_on_complete(None), tmp_path)
    [out] = gate["outputs"]
    verdict = out["facets"]["loraflow_gate_decision"]
    assert verdict["summary"]["promote"] is True and verdict["summary"]["reason"] == "r"
    assert verdict["_schemaURL"] == "urn:loraflow:openlineage:StageSummaryDatasetFacet:1"
    assert gate["run"]["facets"]["loraflow_stage"]["cache_key"] == "key-gate"
    assert {i["name"].rsplit("/", 1)[-1] for i in gate["inputs"]} == {"evaluate_base", "evaluate_tuned"}
    # Keys the provider's masking would take for secrets ("token"): the figures and checksums arrive.
    lineage = finished_operator("evaluate_tuned", committed["evaluate_tuned"]).get_openlineage_facets_on_complete(None)
    [out] = sent("evaluate_tuned", lineage, tmp_path)["outputs"]
    assert out["facets"]["loraflow_evaluation"]["summary"]["tokens_per_s"] == 512.0
    assert {"name": "tokenizer.json", "size": 35, "crc32c": "yZRlqg=="} in out["facets"]["loraflow_manifest"]["files"]


def test_lineage_is_off_until_the_openlineage_provider_is_configured() -> None:
    """As Airflow users expect: with no [openlineage] transport the provider registers no listener (no
    event is sent, no hook called); a transport turns it on."""
    check = "from airflow.providers.openlineage.plugins.openlineage import OpenLineageProviderPlugin as P; print(len(P.listeners))"
    env = {k: v for k, v in os.environ.items() if "OPENLINEAGE" not in k}
    configured = {**env, "AIRFLOW__OPENLINEAGE__TRANSPORT": json.dumps({"type": "console"})}
    off, on = (
        subprocess.Popen([sys.executable, "-c", check], env=e, stdout=subprocess.PIPE, text=True)
        for e in (env, configured)
    )
    assert (off.communicate(timeout=300)[0].strip(), on.communicate(timeout=300)[0].strip()) == ("0", "1")
