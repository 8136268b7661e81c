"""The data-team hand-off on a real local Airflow against the GCS emulator, as a data team sees it.

The data team drops dataset version v1 (files, then _READY) and posts an Asset event through the
REST API naming it: the asset-scheduled pipeline trains exactly v1 and writes the verdict beside it
(_RESULT.json), as an Asset event and as notices in a file. While that run trains, the team drops a
broken v2 and a scheduled-style poll (a plain trigger) takes it: rejected, with the data contract's
reasons. Then a poll and a repeated event for v1 find nothing new to train. On the stack the end-to-end
modules share (tests/e2e/conftest.py), with an artifact root of its own; ~5 minutes.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from loraflow.dev.demo import LocalAirflow, prepare
from loraflow.dev.shared_stack import SharedStack
from loraflow.pipeline import handoff
from loraflow.spec.schema import load_spec
from loraflow.storage import artifacts, gcs
from tests.bad_datasets import broken_dataset

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "pipelines" / "tiny-llama-lora.yaml"
PARITY = REPO / "pipelines" / "data" / "parity"
DAG = "tiny-handoff"
PREFIX = "gs://loraflow-demo/handoff/parity"
# Its own artifact root in the shared stack: no stage of its runs comes from another module's cache.
ARTIFACT_ROOT = "gs://loraflow-demo/handoff-artifacts"


def handoff_spec(folder: Path, notices: Path) -> Path:
    """The tiny pipeline, scheduled on the hand-off prefix's Asset, its data taken from the hand-off."""
    data = yaml.safe_load(TINY.read_text())
    data["name"] = DAG
    data["artifact_root"] = ARTIFACT_ROOT
    data["schedule"] = {"asset": PREFIX}
    data["handoff"] = {"prefix": PREFIX}
    del data["data"]["train"], data["data"]["eval"]
    data["notify"] = [{"kind": "file", "path": str(notices)}]
    path = folder / f"{DAG}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def asset_id(airflow: LocalAirflow, uri: str) -> int:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        _, body = airflow.call("GET", "/assets?limit=100")
        for asset in body.get("assets", []) if isinstance(body, dict) else []:
            if asset["uri"] == uri:
                return int(asset["id"])
        time.sleep(2)
    raise AssertionError(f"asset {uri} was not registered")


def post_event(airflow: LocalAirflow, uri: str, extra: dict[str, Any]) -> None:
    status, body = airflow.call("POST", "/assets/events", {"asset_id": asset_id(airflow, uri), "extra": extra})
    assert status == 200, body


def new_asset_run(airflow: LocalAirflow, known: set[str], timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _, body = airflow.call("GET", f"/dags/{DAG}/dagRuns?limit=100")
        for run in body.get("dag_runs", []):
            if run["run_type"] == "asset_triggered" and run["dag_run_id"] not in known:
                return str(run["dag_run_id"])
        time.sleep(2)
    raise AssertionError("the asset event started no run")


def wait_for_task(airflow: LocalAirflow, run_id: str, task: str, timeout: float = 180) -> str | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = airflow.task_states(DAG, run_id).get(task)
        if state in ("success", "failed", "skipped", "upstream_failed"):
            return state
        time.sleep(2)
    raise AssertionError(f"{task} of {run_id} did not finish")


def read_result(version: str) -> dict[str, Any]:
    result = artifacts.read_json(f"{PREFIX}/{version}/{handoff.RESULT}")
    assert result is not None, f"no {handoff.RESULT} beside {version}"
    return dict(result)


class Story:
    def __init__(self, airflow: LocalAirflow, notices: Path) -> None:
        self.airflow = airflow
        self.notices = notices
        self.r: dict[str, Any] = {}

    def notices_of(self, run_id: str) -> list[dict[str, Any]]:
        lines = self.notices.read_text().splitlines() if self.notices.exists() else []
        return [n for n in map(json.loads, lines) if n["run_id"] == run_id]


@pytest.fixture(scope="module")
def story(tmp_path_factory: pytest.TempPathFactory, shared_stack: SharedStack):
    home = tmp_path_factory.mktemp("handoff")
    notices = home / "notices.jsonl"
    spec_path = handoff_spec(home, notices)
    spec = load_spec(spec_path)
    assert spec.handoff is not None
    bad = broken_dataset(home / "bad")
    airflow = shared_stack.use(__name__, spec_path)
    prepare(TINY, home)  # the tiny model (the hand-off spec shares its base_model)
    airflow.wait_for_dag(DAG)
    airflow.call("PATCH", f"/dags/{DAG}", {"is_paused": False})
    s = Story(airflow, notices)
    good = {n: PARITY / n for n in ("train.jsonl", "eval.jsonl")}
    handoff.drop_version(spec.handoff, "v1", good)
    post_event(airflow, PREFIX, {"version": "v1", "note": "weekly export"})
    s.r["v1_run"] = new_asset_run(airflow, set())
    s.r["v1_pick"] = wait_for_task(airflow, s.r["v1_run"], handoff.PICK_TASK)
    # v1 is claimed and training: the team drops a broken v2; the next poll must take v2, not v1.
    handoff.drop_version(spec.handoff, "v2", {n: bad / n for n in ("train.jsonl", "eval.jsonl")})
    s.r["v2_run"] = airflow.trigger(DAG)
    s.r["v2_state"] = airflow.wait_for_run(DAG, s.r["v2_run"])
    s.r["v1_state"] = airflow.wait_for_run(DAG, s.r["v1_run"])
    s.r["v1_result"] = read_result("v1")
    # Nothing new: a poll and a repeated event for v1 both train nothing.
    s.r["poll_run"] = airflow.trigger(DAG)
    post_event(airflow, PREFIX, {"version": "v1"})
    s.r["repeat_run"] = new_asset_run(airflow, {s.r["v1_run"]})
    s.r["poll_state"] = airflow.wait_for_run(DAG, s.r["poll_run"])
    s.r["repeat_state"] = airflow.wait_for_run(DAG, s.r["repeat_run"])
    verdict_id = asset_id(airflow, handoff.verdict_asset_uri(spec.name))
    _, events = airflow.call("GET", f"/assets/events?asset_id={verdict_id}&limit=50")
    s.r["verdict_events"] = {e["source_run_id"]: e["extra"] for e in events.get("asset_events", [])}
    yield s


def test_the_asset_event_trains_exactly_the_named_version_and_accepts_it(story: Story) -> None:
    r = story.r
    assert r["v1_pick"] == "success" and r["v1_state"] == "success"
    picked = story.airflow.xcom(DAG, r["v1_run"], handoff.PICK_TASK)
    assert picked["version"] == "v1" and picked["train"] == f"{PREFIX}/v1/train.jsonl"
    validated = story.airflow.xcom(DAG, r["v1_run"], "validate_data")
    manifest = artifacts.read_manifest(validated["manifest"])
    assert manifest.data["inputs"]["train"]["uri"] == f"{PREFIX}/v1/train.jsonl"
    result = r["v1_result"]
    assert result["verdict"] == "accepted" and result["version"] == "v1"
    assert result["run_id"] == r["v1_run"] and result["model"]["version"] == 1
    assert result["report"].endswith("/report/report.html") and result["gate"]["promote"] is True


def test_the_verdict_is_an_asset_event_a_data_team_dag_can_schedule_on(story: Story) -> None:
    events = story.r["verdict_events"]
    assert events[story.r["v1_run"]]["verdict"] == "accepted"
    assert events[story.r["v1_run"]]["model_version"] == 1
    assert events[story.r["v1_run"]]["result"] == f"{PREFIX}/v1/{handoff.RESULT}"
    assert events[story.r["v2_run"]]["verdict"] == "rejected"
    assert set(events) == {story.r["v1_run"], story.r["v2_run"]}, "runs that took nothing announce nothing"


def test_a_broken_version_is_rejected_with_the_data_contracts_reasons(story: Story) -> None:
    r = story.r
    assert r["v2_state"] == "failed"
    states = story.airflow.task_states(DAG, r["v2_run"])
    assert states["validate_data"] == "failed" and states["lora_sft"] == "upstream_failed"
    assert states[handoff.VERDICT_TASK] == "success"
    result = read_result("v2")
    assert result["verdict"] == "rejected" and result["model"] is None
    reasons = " ".join(result["reasons"]).lower()
    assert "data contract" in reasons and "empty" in reasons and "duplicate" in reasons


def test_no_version_trains_twice(story: Story) -> None:
    r = story.r
    for run in ("poll_run", "repeat_run"):
        assert r[run.replace("run", "state")] == "success"
        states = story.airflow.task_states(DAG, r[run])
        assert states[handoff.PICK_TASK] == "skipped", (run, states)
        assert states["lora_sft"] == "skipped" and states[handoff.VERDICT_TASK] == "skipped"
    assert read_result("v1") == r["v1_result"], "a later run rewrote v1's verdict"
    claim = artifacts.read_json(f"{PREFIX}/v1/{handoff.CLAIM}")
    assert claim["run_id"] == r["v1_run"]


def test_notices_for_the_promotion_the_failure_and_both_verdicts(story: Story) -> None:
    r = story.r
    v1 = {n["event"]: n for n in story.notices_of(r["v1_run"])}
    assert set(v1) == {"promotion", "verdict"}
    assert "promoted model version 1" in v1["promotion"]["text"]
    assert v1["verdict"]["data"]["verdict"] == "accepted"
    v2 = story.notices_of(r["v2_run"])
    failures = {n["data"]["task"]: n for n in v2 if n["event"] == "failure"}
    failed = {t for t, state in story.airflow.task_states(DAG, r["v2_run"]).items() if state == "failed"}
    assert set(failures) == failed and "validate_data" in failed, "one failure notice per failed task"
    assert failures["validate_data"]["subject"] == f"[loraflow] {DAG}: validate_data failed"
    assert re.search(r"Refused|DataValidation|expectation", failures["validate_data"]["data"]["error"])
    assert [n["data"]["verdict"] for n in v2 if n["event"] == "verdict"] == ["rejected"]
    assert not story.notices_of(r["poll_run"]) and not story.notices_of(r["repeat_run"])


def test_the_result_points_at_the_run_artifacts(story: Story) -> None:
    result = story.r["v1_result"]
    bucket, path = gcs.split_uri(result["artifacts"])
    names = {b.name for b in gcs.client().list_blobs(bucket, prefix=path + "/")}
    assert any(n.endswith("/publish/_MANIFEST.json") for n in names)
