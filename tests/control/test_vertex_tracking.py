"""tracking.vertex: the report logs the run to Vertex AI Experiments (google-cloud-aiplatform, REST) against the
Vertex stand-in (tests/vertex_tracking_standin.py): parameters, metrics, and the stages' TensorBoard curves as
the experiment run's time series in the experiment's TensorBoard instance."""

from __future__ import annotations

import csv
import io
import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from loraflow.errors import LoraflowError
from loraflow.pipeline.plan import REPORTED
from loraflow.reporting import vertex_tracking
from loraflow.spec.schema import VertexTrackingSpec, load_spec
from loraflow.spec.step_configs import ReportConfig
from loraflow.steps import _tracking
from loraflow.steps import report as report_step
from loraflow.storage import artifacts, gcs
from loraflow.storage.summaries import RERUN_GATE, SummaryError
from tests.tensorboard_events import scalars
from tests.vertex_standin import VertexStandIn

ROOT = Path(__file__).resolve().parents[2]
PROJECT, REGION, EXPERIMENT = "acme-ml", "europe-west4", "tiny-llama-lora"  # not the SDK's default region
RUN_ID = "manual__2026-12-06T08:00:00+00:00"
LOSS = "step,loss,tokens_per_s,seconds\n" + "".join(f"{s},{6 / s:.6f},{1000 + s},0.25\n" for s in range(1, 6))
TRAINING = {"learning_rate": 0.001, "rank": 8, "alpha": 16.0, "steps": 5, "targets": ["q", "v"], "qtype": None}


@pytest.fixture
def standin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[VertexStandIn, Any, str]]:
    """The Vertex stand-in serving Experiments and TensorBoard for the run's project, one TensorBoard made."""
    with VertexStandIn({}, tmp_path / "vertex") as s:
        tracking = s.serve_tracking(PROJECT, REGION)
        tensorboard = tracking.add_tensorboard("4242")
        monkeypatch.setenv("LORAFLOW_VERTEX_ENDPOINT", s.url)
        yield s, tracking, tensorboard


def events(folder: Path, by_step: dict[int, dict[str, float]]) -> None:
    """An event file in ``folder`` written with TensorBoard's own writer: each tag's value at each step."""
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    writer = EventFileWriter(str(folder))
    for step, values in by_step.items():
        summary = summary_pb2.Summary(
            value=[summary_pb2.Summary.Value(tag=t, simple_value=v) for t, v in values.items()]
        )
        writer.add_event(event_pb2.Event(step=step, wall_time=time.time(), summary=summary))
    writer.close()


def commit(
    prefix: str, tmp_path: Path, files: dict[str, str], curves: dict[int, dict[str, float]], config: dict[str, Any]
) -> artifacts.Manifest:
    local = tmp_path / prefix.replace("/", "_").replace(":", "")
    (local / "tensorboard").mkdir(parents=True)
    for name, text in files.items():
        (local / name).write_text(text)
    events(local / "tensorboard", curves)
    stage = prefix.rsplit("/", 1)[-1]
    table = artifacts.upload_tree(local, prefix)
    return artifacts.commit(
        prefix, table, stage=stage, inputs={}, config=config, lock_version="t", cache_key="k",
        summary={"seconds": 1.0, **({"first_loss": 6.0, "final_loss": 1.2} if stage == "lora_sft" else {})},
    )  # fmt: skip


def committed_run(run: str, tmp_path: Path, promote: bool = True) -> dict[str, artifacts.Manifest]:
    """lora_sft's curves (loss.csv's rows), the evaluations' scores and guard's (base at step 0, tuned at step 5),
    the gate's verdict."""
    rows = list(csv.DictReader(io.StringIO(LOSS)))
    train = {
        int(r["step"]): {"train/loss": float(r["loss"]), "perf/tokens_per_s": float(r["tokens_per_s"])} for r in rows
    }
    base = {"accuracy": 0.2, "format_rate": 0.5, "n": 10, "guard": {"set": "general-mc-v1", "accuracy": 0.3}}
    tuned = {"accuracy": 0.9, "format_rate": 1.0, "n": 10, "guard": {"set": "general-mc-v1", "accuracy": 0.25}}
    decision = {"promote": promote, "metric": "accuracy", "reason": "accuracy rose"}
    return {
        "lora_sft": commit(gcs.join(run, "lora_sft"), tmp_path, {"loss.csv": LOSS}, train, TRAINING),
        "evaluate_base": commit(gcs.join(run, "evaluate_base"), tmp_path, {"metrics.json": json.dumps(base)},
                                {0: {"eval/accuracy": 0.2, "eval/format_rate": 0.5}}, {}),
        "evaluate_tuned": commit(gcs.join(run, "evaluate_tuned"), tmp_path, {"metrics.json": json.dumps(tuned)},
                                 {5: {"eval/accuracy": 0.9, "eval/format_rate": 1.0}}, {}),
        "gate": commit(gcs.join(run, "gate"), tmp_path, {"decision.json": json.dumps(decision)}, {}, {}),
    }  # fmt: skip


def report(make_ctx: Callable, manifests: dict[str, artifacts.Manifest], run: str, tensorboard: str) -> Any:
    vertex = {"tensorboard": tensorboard, "experiment": EXPERIMENT}
    ctx = make_ctx("report", {}, {"pipeline": "tiny", "stages": list(REPORTED), "vertex_tracking": vertex}, manifests)
    ctx.output_uri = gcs.join(run, "report")
    return ctx


def test_the_report_logs_the_runs_parameters_metrics_and_curves_to_vertex_ai_experiments(
    standin: tuple[VertexStandIn, Any, str],
    make_ctx: Callable,
    gcs_bucket: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The experiment is made, backed by the spec's TensorBoard; the pipeline run is one experiment run with
    lora_sft's config as parameters, the scores and verdict as metrics, and every point of the committed event
    files (loss.csv's losses, the evaluations at their models' steps) as its time series. A retried report
    task resumes the same run: still one run, the same points."""
    _, tracking, tensorboard = standin
    run = f"{gcs_bucket}/arts/tiny/{RUN_ID}"
    manifests = committed_run(run, tmp_path)
    ctx = report(make_ctx, manifests, run, tensorboard)
    summary = report_step.run(ctx)
    # only the event files were fetched for it
    assert {p.name for p in (ctx.work / "curves-lora_sft").rglob("*") if p.is_file()} == {
        n.rsplit("/", 1)[-1] for n in manifests["lora_sft"].files if n.startswith("tensorboard/")
    }

    name = vertex_tracking.experiment_run_name(RUN_ID)
    assert summary["vertex_experiment_run"] == name
    assert summary["vertex_experiment_url"] == (
        f"https://console.cloud.google.com/vertex-ai/experiments/locations/{REGION}/experiments/{EXPERIMENT}"
        f"/runs/{EXPERIMENT}-{name}?project={PROJECT}"
    )
    assert f"as run {name}: {summary['vertex_experiment_url']}" in capsys.readouterr().out  # the task log
    experiment = tracking.context(EXPERIMENT)
    assert experiment["schemaTitle"] == "system.Experiment"
    assert experiment["metadata"]["backing_tensorboard_resource"] == tensorboard
    context = f"{tracking.parent}/metadataStores/default/contexts/{EXPERIMENT}-{name}"
    assert tracking.children[experiment["name"]] == [context]
    logged = tracking.context(f"{EXPERIMENT}-{name}")
    assert logged["schemaTitle"] == "system.ExperimentRun" and logged["metadata"]["_state"] == "COMPLETE"
    assert logged["metadata"]["_params"] == {
        "learning_rate": 0.001, "rank": 8, "alpha": 16.0, "steps": 5, "targets": "['q', 'v']"
    }  # fmt: skip
    assert logged["metadata"]["_metrics"] == {
        "base_accuracy": 0.2, "base_format_rate": 0.5, "base_n": 10, "tuned_accuracy": 0.9,
        "tuned_format_rate": 1.0, "tuned_n": 10, "first_loss": 6.0, "final_loss": 1.2, "promoted": 1.0,
        "base_guard_accuracy": 0.3, "tuned_guard_accuracy": 0.25,
    }  # fmt: skip

    tensorboard_run = f"{tensorboard}/experiments/{EXPERIMENT}/runs/{name}"
    points = tracking.scalars(tensorboard_run)
    committed: dict[str, dict[int, float]] = {}
    for stage, manifest in manifests.items():  # what TensorBoard's own reader finds in the committed files
        events_files = [n for n in manifest.files if n.startswith("tensorboard/")]
        local = artifacts.fetch(manifest, tmp_path / "read" / stage, only=events_files)
        for tag, by_step in scalars(local / "tensorboard").items():
            committed.setdefault(tag, {}).update(by_step)
    assert points == committed
    rows = list(csv.DictReader(io.StringIO(LOSS)))
    assert points["train/loss"] == {int(r["step"]): pytest.approx(float(r["loss"]), rel=1e-6) for r in rows}
    assert points["eval/accuracy"] == {0: pytest.approx(0.2), 5: pytest.approx(0.9)}

    again = report_step.run(report(make_ctx, manifests, run, tensorboard))  # the task's retry
    assert again["vertex_experiment_run"] == name
    assert tracking.children[experiment["name"]] == [context]
    assert tracking.scalars(tensorboard_run) == points


def test_an_experiment_whose_tensorboard_lies_in_another_project_is_refused_and_the_report_fails(
    standin: tuple[VertexStandIn, Any, str], make_ctx: Callable, gcs_bucket: str, tmp_path: Path
) -> None:
    """What Vertex answers an identity without rights there (the stand-in serves one project): the task
    fails, saying so, instead of reporting a run it did not log."""
    run = f"{gcs_bucket}/arts/tiny/{RUN_ID}"
    ctx = report(
        make_ctx, committed_run(run, tmp_path), run, "projects/other-team/locations/us-central1/tensorboards/1"
    )
    with pytest.raises(LoraflowError, match=r"failed: 403 .*not the run's.* roles/aiplatform.user in other-team"):
        report_step.run(ctx)


def test_run_names_are_vertex_ids_and_keep_run_ids_apart() -> None:
    ids = (RUN_ID, RUN_ID.replace("+", "-"), "x" * 300, "__", "_" + "a" * 60, "a" * 53 + "_b")
    names = [vertex_tracking.experiment_run_name(i) for i in ids]
    assert len(set(names)) == len(ids)
    assert all(len(n) <= 63 and re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", n) for n in names), names
    assert names[0].startswith("manual-2026-12-06t08-00-00-00-00-")
    assert [n.rsplit("-", 1)[0] for n in names[3:]] == ["run", "a" * 54, "a" * 53]  # 54 characters of the id


def test_a_run_without_training_logs_what_it_has(
    standin: tuple[VertexStandIn, Any, str], make_ctx: Callable, gcs_bucket: str, tmp_path: Path
) -> None:
    """lora_sft failed, the gate did not promote: no parameters, the base's curves and scores, promoted 0."""
    _, tracking, tensorboard = standin
    run = f"{gcs_bucket}/arts/tiny/{RUN_ID}"
    manifests = committed_run(run, tmp_path, promote=False)
    del manifests["lora_sft"]
    summary = report_step.run(report(make_ctx, manifests, run, tensorboard))
    logged = tracking.context(f"{EXPERIMENT}-{summary['vertex_experiment_run']}")["metadata"]
    assert "_params" not in logged or logged["_params"] == {}
    assert logged["_metrics"]["promoted"] == 0.0 and "final_loss" not in logged["_metrics"]
    points = tracking.scalars(f"{tensorboard}/experiments/{EXPERIMENT}/runs/{summary['vertex_experiment_run']}")
    assert set(points) == {"eval/accuracy", "eval/format_rate"}


def test_the_verdict_is_logged_as_the_gate_wrote_it_and_a_forged_one_is_refused() -> None:
    """``promoted`` is 1 or 0 from the gate's typed summary; a "promote" that is not a boolean ("no", which a
    truthy read logs as promoted) is refused naming the file and the fix, as the report refuses it."""
    nothing: dict[str, Any] = {"base_metrics": {}, "tuned_metrics": {}, "training_summary": {}}
    assert _tracking.run_metrics({**nothing, "decision": {"promote": True, "reason": "r"}}) == {"promoted": 1.0}
    assert _tracking.run_metrics({**nothing, "decision": {"promote": False, "reason": "r"}}) == {"promoted": 0.0}
    assert _tracking.run_metrics({**nothing, "decision": None}) == {}  # the gate did not run
    with pytest.raises(SummaryError) as err:
        _tracking.run_metrics({**nothing, "decision": {"promote": "no", "reason": "r"}})
    assert str(err.value) == (
        "the gate's decision.json is not a gate summary loraflow wrote (its 'promote' is 'no', not a boolean); "
        f"{RERUN_GATE}"
    )


def test_event_files_beyond_the_reports_limit_are_refused_naming_the_way_out(
    make_ctx: Callable, gcs_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = f"{gcs_bucket}/arts/tiny/{RUN_ID}"
    manifests = committed_run(run, tmp_path)
    size = sum(m["size"] for n, m in manifests["lora_sft"].files.items() if n.startswith("tensorboard/"))
    ctx = make_ctx("report", {}, {}, manifests)
    monkeypatch.setattr(_tracking, "MAX_EVENT_BYTES", size)
    assert set(_tracking.stage_curves(ctx)) >= {"train/loss", "eval/accuracy"}  # at the limit: read
    monkeypatch.setattr(_tracking, "MAX_EVENT_BYTES", size - 1)
    with pytest.raises(
        LoraflowError,
        match=rf"lora_sft's tensorboard/ holds {size} bytes, over the {size - 1} the "
        r"report reads for Vertex AI Experiments; point TensorBoard at it instead \(docs/operations.md\)",
    ):
        _tracking.stage_curves(ctx)


def test_tracking_is_off_unless_the_spec_sets_it_and_its_names_are_checked() -> None:
    spec = load_spec(ROOT / "pipelines" / "tiny-llama-lora.yaml")
    assert spec.tracking.vertex is None and ReportConfig.from_spec(spec).vertex_tracking is None
    on = spec.model_copy(update={"tracking": spec.tracking.model_copy(update={"vertex": VertexTrackingSpec(
        tensorboard="projects/acme-ml/locations/europe-west4/tensorboards/77", experiment=EXPERIMENT)})})  # fmt: skip
    settings = ReportConfig.from_spec(on).vertex_tracking
    assert settings is not None and (settings.project, settings.region) == ("acme-ml", "europe-west4")
    by_number = VertexTrackingSpec(
        tensorboard="projects/123456789012/locations/us-east1/tensorboards/5", experiment="e"
    )
    assert (by_number.project, by_number.region) == ("123456789012", "us-east1")  # as the console names it
    for bad in (
        {"tensorboard": "acme-ml/tensorboards/77", "experiment": EXPERIMENT},  # not a resource name
        {"tensorboard": "projects/acme-ml/locations/us-central1/tensorboards/77", "experiment": "Tiny_Llama"},
        {"tensorboard": "projects/acme-ml/locations/us-central1/tensorboards/77", "experiment": "x" * 65},
    ):
        with pytest.raises(ValidationError):
            VertexTrackingSpec(**bad)


def test_the_report_task_links_the_experiment_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The report task's 'Vertex AI experiment' link is the logged run's page; none without tracking."""
    import yaml

    from operators.links import ExperimentLink, ReportLink
    from operators.stages import LoraflowStageOperator, ReportOperator

    class TI:
        dag_id, run_id, task_id = "tiny", "r1", "report"

        def __init__(self) -> None:
            self.pushed: dict[str, Any] = {}

        def xcom_push(self, key: str, value: Any) -> None:
            self.pushed[key] = value

        def get_task_states(self, dag_id: str, run_ids: list[str]) -> dict[str, dict[str, str]]:
            return {"r1": {"report": "running"}}

    data = yaml.safe_load((ROOT / "pipelines" / "tiny-llama-lora.yaml").read_text())
    op = ReportOperator.for_spec(data)
    assert [link.name for link in op.operator_extra_links] == ["Run report", "Vertex AI experiment", "Artifacts"]
    url = "https://console.cloud.google.com/vertex-ai/experiments/locations/r/experiments/e/runs/e-x?project=p"
    for summary, expected in (({"vertex_experiment_url": url}, url), ({}, None)):
        result = {"manifest": "gs://b/a/tiny/r1/report/_MANIFEST.json", "summary": summary}
        ti = TI()
        monkeypatch.setattr(LoraflowStageOperator, "execute", lambda self, context, result=result: result)
        op.execute({"ti": ti})  # type: ignore[arg-type]
        assert ti.pushed.get(ExperimentLink().xcom_key) == expected
        assert ReportLink().xcom_key in ti.pushed  # the report's own link either way
