"""The tiny pipeline end to end on a real local Airflow (API server, scheduler, DAG processor)
against the GCS emulator: every stage runs its real library. The stack is the one the end-to-end modules
share (tests/e2e/conftest.py); these specs keep the default artifact root, the others have roots of their
own. Takes several minutes."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loraflow.dev.demo import LocalAirflow, prepare, verdict
from loraflow.dev.local_gcs import free_port
from loraflow.dev.shared_stack import SharedStack
from loraflow.launchers.local import FORKED_NOTE
from loraflow.reporting.curves import TENSORBOARD, tensorboard_argv
from loraflow.spec.schema import load_spec
from loraflow.spec.stages import STAGES
from loraflow.storage import artifacts, gcs
from tests.bad_datasets import broken_dataset
from tests.tensorboard_events import scalars

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "pipelines" / "tiny-llama-lora.yaml"
QLORA = REPO / "pipelines" / "tiny-llama-qlora.yaml"
# The tiny pipelines of the other model families, run in the same stack: each family's tiny model
# (loraflow.dev.tinymodel) with its converted parameter count and PEFT tensors (2 per module and layer).
OTHER_FAMILIES = {
    "qwen3": (REPO / "pipelines" / "tiny-qwen3-lora.yaml", 361344, 28),  # the tiny Llama - lm_head + q/k norms
    "gemma3": (REPO / "pipelines" / "tiny-gemma3-lora.yaml", 1102336, 98),  # 7 layers of 7 modules
}
HEAVY_STAGES = {"validate_data", "convert_checkpoint", "evaluate_base", "lora_sft", "merge_adapter", "evaluate_tuned"}


def bad_data_spec(folder: Path, data_dir: Path) -> Path:
    """A second pipeline whose training set breaks the data contract (empty and duplicate rows)."""
    text = TINY.read_text().replace("name: tiny-llama-lora", "name: tiny-bad-data")
    text = text.replace("datasets/parity/", "datasets/bad/")
    path = folder / "tiny-bad-data.yaml"
    path.write_text(text)
    broken_dataset(data_dir)
    return path


def last_log(airflow: LocalAirflow, dag_id: str, run_id: str, task_id: str) -> str:
    """The log of the task's last try (a retried try's log, when a crash made Airflow retry it)."""
    status, ti = airflow.call("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}")
    tries = int(ti.get("try_number") or 1) if status == 200 and isinstance(ti, dict) else 1
    return airflow.task_log(dag_id, run_id, task_id, max(tries, 1))


class Runs:
    def __init__(self, airflow: LocalAirflow) -> None:
        self.airflow = airflow
        self.results: dict[str, Any] = {}


@pytest.fixture(scope="module")
def lineage_events(shared_stack_lineage: Path) -> Path:
    """OpenLineage is on for the shared stack (tests/e2e/conftest.py), as a user turns it on: the provider's
    [openlineage] transport, here its file transport (one JSON file per event in the folder returned),
    with an emission policy that keeps the events of tiny-llama-lora's runs only."""
    return shared_stack_lineage


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, shared_stack: SharedStack, lineage_events: Path) -> Iterator[Runs]:
    home = tmp_path_factory.mktemp("stack")
    bad = bad_data_spec(home, home / "bad-data")
    specs = [TINY, QLORA, *(path for path, *_ in OTHER_FAMILIES.values()), bad]
    # The stack's other modules' specs have artifact roots of their own: none takes these runs' cached stages
    # (test_browser.py shares this root, and runs after this module: its run takes what these cached).
    airflow = shared_stack.use(__name__, *specs)
    spec = prepare(TINY, home)
    prepare(bad, home, home / "bad-data")
    airflow.wait_for_dag(spec.name)
    airflow.wait_for_dag("tiny-bad-data")
    r = Runs(airflow)
    r.results["bad_param"] = airflow.call(
        "POST", f"/dags/{spec.name}/dagRuns", {"logical_date": None, "conf": {"training_steps": 5}}
    )
    r.results["bad_data_run"] = airflow.trigger("tiny-bad-data")
    r.results["first"] = airflow.trigger(spec.name)
    r.results["first_state"] = airflow.wait_for_run(spec.name, r.results["first"])
    r.results["first_verdict"] = verdict(spec, airflow, r.results["first"])
    r.results["bad_data_state"] = airflow.wait_for_run("tiny-bad-data", r.results["bad_data_run"])
    r.results["second"] = airflow.trigger(spec.name)
    r.results["second_state"] = airflow.wait_for_run(spec.name, r.results["second"])
    r.results["second_verdict"] = verdict(spec, airflow, r.results["second"])
    # QLoRA (nf4) on the arithmetic task, on its own tiny model, in the same stack.
    qlora = prepare(QLORA, home)
    airflow.wait_for_dag(qlora.name)
    r.results["qlora"] = airflow.trigger(qlora.name)
    r.results["qlora_state"] = airflow.wait_for_run(qlora.name, r.results["qlora"])
    r.results["qlora_verdict"] = verdict(qlora, airflow, r.results["qlora"])
    # A tiny model of each other family through every stage, in the same stack.
    for family, (path, *_) in OTHER_FAMILIES.items():
        other = prepare(path, home)
        airflow.wait_for_dag(other.name)
        r.results[family] = airflow.trigger(other.name)
        r.results[f"{family}_state"] = airflow.wait_for_run(other.name, r.results[family])
        r.results[f"{family}_verdict"] = verdict(other, airflow, r.results[family])
    yield r


def test_first_run_succeeds_and_sft_beats_the_base_by_30_points(runs: Runs) -> None:
    assert runs.results["first_state"] == "success"
    v = runs.results["first_verdict"]
    assert v["tuned"]["n"] == v["base"]["n"] == 400
    assert v["tuned"]["accuracy"] - v["base"]["accuracy"] >= 0.30, v
    assert v["decision"]["promote"] is True
    assert v["published"]["promoted"] is True


def test_every_stage_committed_a_verified_manifest_under_its_run(runs: Runs) -> None:
    spec = load_spec(TINY)
    run_prefix = gcs.join(spec.artifact_root, spec.name, artifacts.safe_run_id(runs.results["first"]))
    for task, state in runs.airflow.task_states(spec.name, runs.results["first"]).items():
        assert state == "success", task
        xcom = runs.airflow.xcom(spec.name, runs.results["first"], task)
        assert len(json.dumps(xcom)) < 4096, f"{task} pushed more than URIs and a summary to XCom"
        manifest = artifacts.read_manifest(xcom["manifest"])
        assert manifest.prefix == f"{run_prefix}/{task}"
        assert manifest.data["lock_version"] and manifest.data["cache_key"] and manifest.files


def _fetched_curves(manifest: artifacts.Manifest, dest: Path, also: tuple[str, ...] = ()) -> dict[str, dict[int, Any]]:
    """A committed stage's tensorboard/ event file (and ``also``), downloaded verified; its scalars."""
    events = [name for name in manifest.files if name.startswith(f"{TENSORBOARD}/events.out.tfevents.")]
    assert len(events) == 1, manifest.files  # committed by the manifest, with its checksum
    artifacts.fetch(manifest, dest, only=[*events, *also])
    return scalars(dest / TENSORBOARD)


def test_the_runs_curves_are_committed_with_its_stages_and_tensorboard_serves_them(runs: Runs, tmp_path: Path) -> None:
    """lora_sft's curves equal its loss.csv step by step; each evaluation's scores sit at its model's training
    step (the base model at 0, the tuned one at training.steps); the command `make ui` prints serves them."""
    spec = load_spec(TINY)
    v = runs.results["first_verdict"]
    sft = artifacts.read_manifest(f"{v['artifacts']}/lora_sft")
    curves = _fetched_curves(sft, tmp_path / "lora_sft", also=("loss.csv",))
    rows = list(csv.DictReader((tmp_path / "lora_sft" / "loss.csv").open()))
    assert len(rows) == spec.training.steps
    assert curves["train/loss"] == {int(r["step"]): pytest.approx(float(r["loss"]), abs=1e-6) for r in rows}
    assert {"train/learning_rate", "perf/step_seconds", "perf/tokens_per_s"} <= set(curves)
    for stage, step in (("evaluate_base", 0), ("evaluate_tuned", spec.training.steps)):
        scores = _fetched_curves(artifacts.read_manifest(f"{v['artifacts']}/{stage}"), tmp_path / stage)
        summary = v["base" if stage == "evaluate_base" else "tuned"]
        assert scores["eval/accuracy"] == {step: pytest.approx(summary["accuracy"], abs=1e-6)}, stage
    assert _tensorboard_tags(v["artifacts"]) >= {
        f"{stage}/{TENSORBOARD}" for stage in ("lora_sft", "evaluate_base", "evaluate_tuned")
    }


def _tensorboard_tags(logdir: str) -> set[str]:
    """The TensorBoard runs the command `make ui` prints finds under ``logdir`` (served on 127.0.0.1)."""
    port = free_port()
    tensorboard = str(Path(sys.executable).with_name("tensorboard"))
    env, argv = tensorboard_argv(tensorboard, logdir, os.environ["STORAGE_EMULATOR_HOST"])
    proc = subprocess.Popen(
        [*argv, "--port", str(port)], env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/plugin/scalars/tags", timeout=10) as r:
                    runs = set(json.loads(r.read(1 << 20)))
                if runs:
                    return runs
            time.sleep(2)
        return set()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_training_progress_is_in_the_task_log(runs: Runs) -> None:
    log = runs.airflow.task_log("tiny-llama-lora", runs.results["first"], "lora_sft")
    assert "loss" in log and "step" in log


def test_the_control_steps_are_forked_from_their_task_and_the_others_are_not(runs: Runs) -> None:
    """On the Airflow worker (the control environment) the light steps start as a fork of their task,
    with what it has imported (loraflow/launchers/forked_step.py); the other environments' are new
    interpreters. Forking needs a task process with one thread at the launch."""
    run = runs.results["first"]
    for task in ("validate_data", "gate", "publish", "report"):
        assert FORKED_NOTE in last_log(runs.airflow, "tiny-llama-lora", run, task), task
    for task in ("convert_checkpoint", "evaluate_base", "lora_sft", "merge_adapter", "evaluate_tuned"):
        log = last_log(runs.airflow, "tiny-llama-lora", run, task)
        assert "launching" in log and FORKED_NOTE not in log, task


def test_first_run_writes_its_report(runs: Runs) -> None:
    v = runs.results["first_verdict"]
    assert v["report"] and v["report"].endswith("/report/report.html")
    page = artifacts.read_manifest(v["report"].rsplit("/", 1)[0])
    assert "report.html" in page.files and "loss.svg" in page.files
    bucket, path = gcs.split_uri(v["report"])
    html = gcs.client().bucket(bucket).blob(path).download_as_bytes().decode()
    assert "PROMOTED" in html and "<polyline" in html and "Sample outputs" in html
    # validate_data, lora_sft and both evaluations rendered prompts with one chat template (the tiny tokenizer's)
    assert "All 4 stage(s) rendered prompts with the same chat template" in html and "MISMATCH" not in html
    assert v["report_url"].startswith("http://") and "alt=media" in v["report_url"]
    link = runs.airflow.call("GET", f"/dags/tiny-llama-lora/dagRuns/{runs.results['first']}/taskInstances/report/links")
    assert link[0] == 200 and v["report_url"] in json.dumps(link[1]), link
    docs = runs.airflow.call(
        "GET", f"/dags/tiny-llama-lora/dagRuns/{runs.results['first']}/taskInstances/validate_data/links"
    )
    assert docs[0] == 200 and "/validate_data/data_docs/index.html" in json.dumps(docs[1]), docs
    assert "Data docs" in json.dumps(docs[1])


def test_rerun_of_unchanged_pipeline_recomputes_nothing_heavy(runs: Runs) -> None:
    assert runs.results["second_state"] == "success"
    v = runs.results["second_verdict"]
    assert HEAVY_STAGES <= set(v["cached"])
    assert v["tuned"] == runs.results["first_verdict"]["tuned"]
    # The gate is never cached (the champion moves): the same model is now the champion itself,
    # so it is not promoted again; publish is skipped and the report still says why.
    assert "gate" not in v["cached"] and v["decision"]["promote"] is False
    assert "champion" in v["decision"]["reason"] and v["decision"]["champion_version"] == 1
    states = runs.airflow.task_states("tiny-llama-lora", runs.results["second"])
    assert states["publish"] == "skipped" and states["report"] == "success"
    assert v["report"]


def test_bad_trigger_parameter_is_refused_before_any_task_runs(runs: Runs) -> None:
    status, body = runs.results["bad_param"]
    assert status == 400
    assert "training_steps" in str(body) and "minimum" in str(body)


def test_bad_dataset_stops_the_run_before_conversion(runs: Runs) -> None:
    assert runs.results["bad_data_state"] == "failed"
    states = runs.airflow.task_states("tiny-bad-data", runs.results["bad_data_run"])
    assert states["validate_data"] == "failed"
    assert states["convert_checkpoint"] == states["lora_sft"] == "upstream_failed"
    log = last_log(runs.airflow, "tiny-bad-data", runs.results["bad_data_run"], "validate_data")
    assert "empty" in log.lower() and "duplicate" in log.lower()
    assert "the data contract is broken: 2 rule(s) failed (no_empty_strings, duplicates)" in log
    spec = load_spec(TINY)
    prefix = gcs.join(spec.artifact_root, "tiny-bad-data", artifacts.safe_run_id(runs.results["bad_data_run"]))
    bucket, path = gcs.split_uri(prefix)
    names = [b.name for b in gcs.client().list_blobs(bucket, prefix=path + "/")]
    # Nothing but the rejection evidence (never an artifact: no manifest) and the run's report.
    assert names and all("/validate_data/_rejected/" in n or "/report/" in n for n in names), names
    assert not [n for n in names if "/validate_data/" in n and n.endswith("_MANIFEST.json")]


def test_a_failed_run_still_writes_a_report_that_says_why(runs: Runs) -> None:
    import urllib.request

    run_id = runs.results["bad_data_run"]
    states = runs.airflow.task_states("tiny-bad-data", run_id)
    assert states["report"] == "failed"  # the report is written, and the run stays failed
    log = last_log(runs.airflow, "tiny-bad-data", run_id, "report")
    assert "the run failed" in log and "validate_data" in log
    spec = load_spec(TINY)
    page_uri = gcs.join(spec.artifact_root, "tiny-bad-data", artifacts.safe_run_id(run_id), "report", "report.html")
    bucket, path = gcs.split_uri(page_uri)
    html = gcs.client().bucket(bucket).blob(path).download_as_bytes().decode()
    assert "RUN FAILED" in html and "the data contract is broken" in html
    assert "no_empty_strings" in html and "duplicates" in html and "line 4 of train.jsonl" in html
    link = runs.airflow.call("GET", f"/dags/tiny-bad-data/dagRuns/{run_id}/taskInstances/report/links")
    assert link[0] == 200 and "report.html" in json.dumps(link[1]), link
    # The validate_data task links GX's data docs of the rejected data; the link opens.
    docs = runs.airflow.call("GET", f"/dags/tiny-bad-data/dagRuns/{run_id}/taskInstances/validate_data/links")
    assert docs[0] == 200, docs
    found = re.search(r'"(http[^"]*/validate_data/_rejected/data_docs/index\.html)"', json.dumps(docs[1]))
    assert found and "Data docs" in json.dumps(docs[1]), docs
    url = found.group(1)
    with urllib.request.urlopen(url, timeout=30) as response:
        assert response.status == 200 and "train_dataset" in response.read().decode()


def test_qlora_run_learns_the_tagged_arithmetic_and_reports_what_merging_cost(runs: Runs) -> None:
    """pipelines/tiny-llama-qlora.yaml: nf4 base weights while training, the adapter merged into the
    full-precision base, evaluated by vLLM on the number in the <answer> tag and on the format."""
    assert runs.results["qlora_state"] == "success"
    v = runs.results["qlora_verdict"]
    base, tuned = v["base"], v["tuned"]
    assert base["n"] == tuned["n"] == 400
    assert tuned["numeric_accuracy"] - base["numeric_accuracy"] >= 0.5, v
    assert tuned["tagged_format_rate"] - base["tagged_format_rate"] >= 0.5, v
    assert v["decision"]["metric"] == "numeric_accuracy" and v["decision"]["promote"] is True
    # the regression guard (gate.guard: general-mc-v1): both evaluations scored it, the gate checked it
    assert 0.0 <= base["guard_accuracy"] <= 1.0 and 0.0 <= tuned["guard_accuracy"] <= 1.0
    assert v["decision"]["guard"]["passed"] is True
    assert v["decision"]["guard"]["delta"] == pytest.approx(tuned["guard_accuracy"] - base["guard_accuracy"])
    assert "guard general-mc-v1 (sha256 e230efbd3157)" in v["decision"]["reason"]
    training = runs.airflow.xcom("tiny-llama-qlora", runs.results["qlora"], "lora_sft")["summary"]
    cost = runs.airflow.xcom("tiny-llama-qlora", runs.results["qlora"], "report")["summary"]["merge_cost"]
    print(f"[e2e] tiny-llama-qlora: base {base}; tuned {tuned}; lora_sft {training}; merge cost {cost}")
    assert cost["n"] == 100 and {r["metric"] for r in cost["metrics"]} >= {"numeric_accuracy", "tagged_format_rate"}
    assert training["quantization"] == "nf4" and training["quantized_eval_examples"] == 100
    assert training["step_temp_bytes"] > 0
    log = last_log(runs.airflow, "tiny-llama-qlora", runs.results["qlora"], "lora_sft")
    assert "hold their base weights as nf4" in log and "compiled train step" in log
    bucket, path = gcs.split_uri(v["report"])
    html = gcs.client().bucket(bucket).blob(path).download_as_bytes().decode()
    assert "What merging cost (QLoRA)" in html and "The first 100 eval examples" in html
    assert "numeric_accuracy" in html and "tagged_format_rate" in html
    assert "Regression guard" in html and "<code>general-mc-v1</code>" in html and "<b>passed</b>" in html


@pytest.mark.parametrize("family", list(OTHER_FAMILIES))
def test_a_tiny_model_of_another_family_runs_every_stage_and_learns_parity(runs: Runs, family: str) -> None:
    """pipelines/tiny-<family>-lora.yaml: MaxText converts the family's tiny model (tiny-qwen3: qwen3-0.6b,
    tied output projection, q/k norms; tiny-gemma3: gemma3-4b, 1 + w norms, a scanned block of 5 local +
    1 global layer and a remainder layer) and trains LoRA, its PEFT export merges, and vLLM evaluates the
    merged model before and after."""
    path, parameters, peft_tensors = OTHER_FAMILIES[family]
    name, run = load_spec(path).name, runs.results[family]
    assert runs.results[f"{family}_state"] == "success"
    v = runs.results[f"{family}_verdict"]
    assert v["tuned"]["n"] == v["base"]["n"] == 400
    assert v["tuned"]["accuracy"] - v["base"]["accuracy"] >= 0.30, v
    assert v["decision"]["promote"] is True
    convert = runs.airflow.xcom(name, run, "convert_checkpoint")["summary"]
    assert convert["parameters"] == parameters, convert
    training = runs.airflow.xcom(name, run, "lora_sft")["summary"]
    assert training["peft_tensors"] == peft_tensors, training


def test_day_two_operations_through_rest_and_the_cli(
    runs: Runs, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loraflow_registry maintenance DAG promotes and rolls back through the REST API, as the
    triggering user; a refused move fails its run with the reason; `loraflow runs` and `loraflow verify`
    read the live stack."""
    from loraflow import cli
    from loraflow.registry import audit, store

    airflow, spec = runs.airflow, load_spec(TINY)
    # A second registry version of the first run's promoted model (what registering it again under a new
    # number would write) gives the rollback a version to go back to without a third training run.
    first = artifacts.read_json(store.version_uri(spec.registry_uri, spec.name, 1))
    artifacts.write_json(store.version_uri(spec.registry_uri, spec.name, 2), {**first, "version": 2}, create_only=True)
    airflow.wait_for_dag("loraflow_registry")
    moves = {}
    for action, extra in (("promote", {"version": 2}), ("rollback", {})):
        conf = {"action": action, "pipeline": spec.name, "reason": f"e2e {action}", **extra}
        run_id = airflow.trigger("loraflow_registry", conf)
        assert airflow.wait_for_run("loraflow_registry", run_id, timeout=600) == "success", action
        moves[action] = airflow.xcom("loraflow_registry", run_id, "registry")["event"]
    assert (moves["promote"]["from_version"], moves["promote"]["to_version"]) == (1, 2)
    assert (moves["rollback"]["from_version"], moves["rollback"]["to_version"]) == (2, 1)
    assert moves["rollback"]["actor"] == "admin" and moves["rollback"]["reason"] == "e2e rollback"
    champion = store.champion(spec.registry_uri, spec.name, spec.artifact_root)
    assert champion is not None and champion["version"] == 1
    trail = audit.read_trail(spec.registry_uri, spec.name)
    assert [(e["action"], e["to_version"]) for e in trail] == [("publish", 1), ("promote", 2), ("rollback", 1)]
    refused = airflow.trigger("loraflow_registry", {"action": "rollback", "pipeline": spec.name, "reason": "again"})
    assert airflow.wait_for_run("loraflow_registry", refused, timeout=600) == "failed"
    assert "has no older version to roll back to" in last_log(airflow, "loraflow_registry", refused, "registry")

    monkeypatch.setenv("LORAFLOW_AIRFLOW_URL", airflow.url)
    monkeypatch.setenv("LORAFLOW_AIRFLOW_USERNAME", "admin")
    monkeypatch.setenv("LORAFLOW_AIRFLOW_PASSWORD", airflow.password)
    capsys.readouterr()
    assert cli.main(["runs", spec.name, "--limit", "5"]) == 0
    out = capsys.readouterr().out
    assert runs.results["first"] in out and "promoted as version 1: accuracy" in out and "not promoted" in out
    model = runs.results["first_verdict"]["artifacts"] + "/merge_adapter"
    assert cli.main(["verify", model]) == 0
    assert capsys.readouterr().out.startswith("ok: ")


def completed_tasks(folder: Path, dag_id: str, run_id: str) -> dict[str, dict[str, Any]]:
    """The OpenLineage COMPLETE event of each task of a run, as the file transport wrote them."""
    found = {}
    for path in sorted(folder.iterdir()):
        event = json.loads(path.read_text())
        dag_run = event["run"]["facets"].get("airflow", {}).get("dagRun", {})
        dag, _, task = event["job"]["name"].rpartition(".")
        if event["eventType"] == "COMPLETE" and dag == dag_id and dag_run.get("run_id") == run_id:
            found[task] = event
    return found


def by_name(datasets: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {f"{d['namespace']}/{d['name']}": d for d in datasets}


def test_openlineage_follows_the_dataset_to_the_published_model_version(runs: Runs, lineage_events: Path) -> None:
    """With the provider's transport set, every stage reports what it read and wrote: each input that
    is a stage's artifact is that stage's output at the same version, and the chain runs from the
    training data through validate_data, lora_sft and merge_adapter to the registry's version, with
    the facts a user looks for on the way."""
    spec, run = load_spec(TINY), runs.results["first"]
    events = completed_tasks(lineage_events, spec.name, run)
    assert set(events) == set(STAGES), sorted(events)
    outputs = {task: by_name(e["outputs"]) for task, e in events.items()}
    made_by = {uri: task for task, out in outputs.items() for uri in out}
    artifact_root = spec.artifact_root + "/"
    for task, event in events.items():
        for uri, dataset in by_name(event["inputs"]).items():
            if uri.startswith(artifact_root):  # another stage's artifact: reported by it, same version
                upstream = outputs[made_by[uri]][uri]
                assert dataset["facets"]["version"] == upstream["facets"]["version"], (task, uri)

    def upstream_of(task: str, name: str) -> str:
        [uri] = [u for u in by_name(events[task]["inputs"]) if u.endswith("/" + name)]
        return made_by[uri]

    assert upstream_of("publish", "merge_adapter") == "merge_adapter"
    assert upstream_of("merge_adapter", "lora_sft") == "lora_sft"
    assert upstream_of("lora_sft", "validate_data") == "validate_data"
    data = by_name(events["validate_data"]["inputs"])[spec.data.train]
    [contract] = outputs["validate_data"].values()
    rows = contract["facets"]["loraflow_data_contract"]["summary"]["train_rows"]
    assert data["inputFacets"]["dataQualityMetrics"]["rowCount"] == rows > 0
    v = runs.results["first_verdict"]
    [tuned] = outputs["evaluate_tuned"].values()
    assert tuned["facets"]["loraflow_evaluation"]["summary"]["accuracy"] == v["tuned"]["accuracy"]
    [gate] = outputs["gate"].values()
    assert gate["facets"]["loraflow_gate_decision"]["summary"]["promote"] is True
    version = next(d for d in outputs["publish"].values() if "loraflow_model_version" in d["facets"])
    assert version["namespace"] + "/" + version["name"] == (
        f"{spec.registry_uri}/{spec.name}/versions/{v['published']['version']:04d}.json"
    )
    model = version["facets"]["loraflow_model_version"]
    assert made_by[model["model"]] == "merge_adapter"
    manifest = artifacts.read_manifest(runs.airflow.xcom(spec.name, run, "merge_adapter")["manifest"])
    assert model["model_fingerprint"] == manifest.fingerprint
    files = outputs["merge_adapter"][model["model"]]["facets"]["loraflow_manifest"]["files"]
    assert {f["name"]: f["crc32c"] for f in files} == {name: f["crc32c"] for name, f in manifest.files.items()}
