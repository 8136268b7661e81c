"""The data-team hand-off: spec rules, which version a run takes (on the GCS emulator), the verdict."""

from __future__ import annotations

import datetime as dt
import json
import re
import uuid
from pathlib import Path
from typing import Any

import pytest

from loraflow.errors import LoraflowError, SpecError
from loraflow.pipeline import handoff
from loraflow.reporting import notify
from loraflow.spec.schema import HandoffSpec, PipelineSpec, load_spec, validate_spec
from loraflow.storage import artifacts, gcs
from loraflow.storage.summaries import GateSummary, PublishSummary

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "pipelines" / "tiny-llama-lora.yaml"
PARITY = REPO / "pipelines" / "data" / "parity"


def tiny_data(**changes: Any) -> dict[str, Any]:
    data = load_spec(TINY).model_dump(mode="json")
    data["name"] = "tiny-handoff"
    data.update(changes)
    return data


def handoff_spec(prefix: str = "gs://team/handoff/parity", **changes: Any) -> PipelineSpec:
    data = tiny_data(handoff={"prefix": prefix}, **changes)
    del data["data"]["train"], data["data"]["eval"]
    return validate_spec(data, "test")


# ------------------------------------------------------------------------------------ spec


def test_a_handoff_spec_reads_its_dataset_from_the_version_a_run_takes() -> None:
    spec = handoff_spec()
    assert spec.data.train == "gs://team/handoff/parity/{version}/train.jsonl"
    run = handoff.apply_version(spec, "2026-12-03")
    assert run.data.train == "gs://team/handoff/parity/2026-12-03/train.jsonl"
    assert run.data.eval == "gs://team/handoff/parity/2026-12-03/eval.jsonl"
    assert run.data.model_dump(exclude={"train", "eval"}) == spec.data.model_dump(exclude={"train", "eval"})
    assert run.handoff == spec.handoff


def test_a_handoff_spec_with_its_own_dataset_uris_is_refused_naming_the_fix() -> None:
    data = tiny_data(handoff={"prefix": "gs://team/handoff/parity"})
    with pytest.raises(SpecError) as err:
        validate_spec(data, "test")
    assert "data.train is taken from the hand-off" in str(err.value) and "remove data.train" in str(err.value)


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        ({"prefix": "team/handoff"}, "not a GCS URI"),
        ({"prefix": "gs://team/h", "train": "sub/train.jsonl"}, "not a file name"),
        ({"prefix": "gs://team/h", "eval": "_READY"}, "not a file name"),
    ],
)
def test_bad_handoff_sections_are_refused(section: dict[str, Any], expected: str) -> None:
    data = tiny_data(handoff=section)
    del data["data"]["train"], data["data"]["eval"]
    with pytest.raises(SpecError, match=expected):
        validate_spec(data, "test")


def test_handoff_and_notify_cannot_be_overridden_at_trigger_time() -> None:
    data = tiny_data(params=[{"path": "handoff.prefix"}], handoff={"prefix": "gs://team/h"})
    del data["data"]["train"], data["data"]["eval"]
    with pytest.raises(SpecError, match=r"handoff\.prefix cannot be overridden"):
        validate_spec(data, "test")


@pytest.mark.parametrize("version", ["a/b", "..", "", "_READY", "v 1"])
def test_version_names_that_are_not_one_plain_segment_are_refused(version: str) -> None:
    with pytest.raises(handoff.HandoffError) as err:
        handoff.apply_version(handoff_spec(), version)
    assert str(err.value) == (
        f"dataset version {version!r} is not a valid name; use letters, digits, '.', '_', '=' or '-' "
        "(one path segment, e.g. 2026-12-03 or v7)"
    )


def test_a_version_whose_dataset_uris_grow_too_long_is_refused_naming_the_version() -> None:
    """The spec's own ``{version}`` URIs fit GCS's 1,024-byte object names; a longer version name can make them
    too long, and the refusal says it comes from that dataset version (not from trigger parameters)."""
    spec = handoff_spec(prefix="gs://team/" + "a" * 1000)
    with pytest.raises(SpecError) as err:
        handoff.apply_version(spec, "2026-12-03-full")
    assert str(err.value).startswith(f"dataset version gs://team/{'a' * 1000}/2026-12-03-full: 2 problem(s) in ")
    assert "  - data.train: gs://team/... has a path of 1028 bytes; GCS object names are at most 1024 bytes: " in str(
        err.value
    )


def test_a_version_is_applied_only_to_a_pipeline_with_a_handoff() -> None:
    with pytest.raises(LoraflowError) as err:
        handoff.apply_version(load_spec(TINY), "v1")
    assert str(err.value) == "pipeline tiny-llama-lora has no handoff section; there is no dataset version to apply"


# ------------------------------------------------------------------------------------ choosing (pure)


def at(minute: int) -> dt.datetime:
    return dt.datetime(2026, 12, 3, 1, minute, tzinfo=dt.UTC)


def test_candidates_are_ready_unclaimed_unjudged_versions_newest_ready_first() -> None:
    states = [
        handoff.VersionState("v1", ready_at=at(1)),
        handoff.VersionState("v2", ready_at=at(5), claimed=True),
        handoff.VersionState("v3", ready_at=at(3)),
        handoff.VersionState("v4"),  # files, no _READY yet
        handoff.VersionState("v5", ready_at=at(4), judged=True),
        handoff.VersionState("v0", ready_at=at(3)),
    ]
    assert handoff.candidates(states) == ["v3", "v0", "v1"]


def test_the_latest_triggering_event_names_the_version() -> None:
    assert handoff.requested_version([{"version": "v1"}, {"note": "x"}, {"version": 7}]) == "7"
    assert handoff.requested_version([{}, {"note": "no version"}]) is None


# ------------------------------------------------------------------------------------ on GCS


@pytest.fixture
def team(gcs_bucket: str) -> HandoffSpec:
    return HandoffSpec(prefix=f"{gcs_bucket}/handoff/parity")


def drop(team: HandoffSpec, version: str, ready: bool = True) -> None:
    files = {n: PARITY / n for n in ("train.jsonl", "eval.jsonl")}
    if ready:
        handoff.drop_version(team, version, files)
    else:
        bucket, path = gcs.split_uri(handoff.version_uri(team, version))
        gcs.client().bucket(bucket).blob(f"{path}/train.jsonl").upload_from_filename(str(files["train.jsonl"]))


def test_a_poll_takes_the_newest_ready_version_and_no_run_takes_it_again(team: HandoffSpec) -> None:
    drop(team, "v1")
    drop(team, "v2")
    drop(team, "v3", ready=False)
    first = handoff.pick(team, "dag", "run-a")
    assert first.version == "v2" and first.train == f"{team.prefix}/v2/train.jsonl"
    assert first.reason == f"the newest ready version under {team.prefix}"
    second = handoff.pick(team, "dag", "run-b")
    assert second.version == "v1"
    third = handoff.pick(team, "dag", "run-c")
    assert third.version is None and "no ready, untrained dataset version" in third.reason
    claim = artifacts.read_json(f"{team.prefix}/v2/{handoff.CLAIM}")
    assert claim["run_id"] == "run-a" and claim["dag_id"] == "dag"


def test_a_retried_pick_keeps_the_version_its_first_try_claimed(team: HandoffSpec) -> None:
    drop(team, "v1")
    assert handoff.pick(team, "dag", "run-a").version == "v1"
    drop(team, "v2")
    again = handoff.pick(team, "dag", "run-a")
    assert again.version == "v1" and again.reason == "claimed by an earlier try of this run"


def test_a_poll_never_takes_another_dags_claim_for_its_own(team: HandoffSpec) -> None:
    """Scheduled runs of two DAGs share run ids (scheduled__<date>): a claim is this run's only if it names
    this DAG too, or both pipelines would train the same version."""
    run_id = "scheduled__2026-12-06T00:00:00+00:00"
    drop(team, "v1")
    assert handoff.pick(team, "other-dag", run_id).version == "v1"
    drop(team, "v0")  # older, still pending
    picked = handoff.pick(team, "dag", run_id)
    assert picked.version == "v0" and picked.reason == f"the newest ready version under {team.prefix}"
    assert (handoff.read_claim(team, "v1") or {}).get("dag_id") == "other-dag"


def test_a_claim_is_held_by_one_run(team: HandoffSpec) -> None:
    drop(team, "v1")
    assert handoff.claim(team, "v1", "dag", "run-a") is True
    assert handoff.claim(team, "v1", "dag", "run-b") is False
    assert handoff.claim(team, "v1", "other-dag", "run-a") is False
    assert handoff.claim(team, "v1", "dag", "run-a") is True


# The session's emulator (fake-gcs-server) enforces the create-only precondition as GCS does.


@pytest.fixture
def strict_team(strict_gcs_bucket: str) -> HandoffSpec:
    return HandoffSpec(prefix=f"{strict_gcs_bucket}/handoff/parity")


def test_a_run_that_looked_before_the_claim_landed_cannot_take_it_too(
    strict_team: HandoffSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    """run-b found no claim, then run-a claimed, then run-b writes its own: the write itself is
    refused. Without the precondition run-b would replace run-a's claim and both would train v1."""
    drop(strict_team, "v1")
    assert handoff.claim(strict_team, "v1", "dag", "run-a") is True
    real_read, looks = handoff.read_claim, []

    def looked_too_early(h: HandoffSpec, version: str) -> dict[str, Any] | None:
        looks.append(version)
        return None if len(looks) == 1 else real_read(h, version)

    monkeypatch.setattr(handoff, "read_claim", looked_too_early)
    assert handoff.claim(strict_team, "v1", "dag", "run-b") is False
    assert looks == ["v1"], "refused by the create-only write, not by reading the claim back"
    monkeypatch.undo()
    assert handoff.read_claim(strict_team, "v1")["run_id"] == "run-a"  # type: ignore[index]


def test_runs_claiming_one_version_at_once_have_exactly_one_winner(
    strict_team: HandoffSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four runs look (no claim yet), all four wait until every one has looked, then all write."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    drop(strict_team, "v1")
    runs = 4
    all_looked = threading.Barrier(runs)
    real_read, local = handoff.read_claim, threading.local()

    def look_together(h: HandoffSpec, version: str) -> dict[str, Any] | None:
        held = real_read(h, version)
        if not getattr(local, "looked", False):
            local.looked = True
            all_looked.wait(timeout=300)  # a guard against a hang, not a measurement
        return held

    monkeypatch.setattr(handoff, "read_claim", look_together)
    with ThreadPoolExecutor(runs) as pool:
        won = list(pool.map(lambda i: handoff.claim(strict_team, "v1", "dag", f"run-{i}"), range(runs)))
    assert won.count(True) == 1, won
    monkeypatch.undo()
    assert handoff.read_claim(strict_team, "v1")["run_id"] == f"run-{won.index(True)}"  # type: ignore[index]


def test_an_event_naming_a_version_takes_exactly_that_version(team: HandoffSpec) -> None:
    drop(team, "v1")
    drop(team, "v2")
    picked = handoff.pick(team, "dag", "run-a", requested="v1")
    assert picked.version == "v1" and picked.reason == "named by the triggering asset event"  # the pick's log line
    assert picked.to_xcom() == {
        "version": "v1",
        "reason": picked.reason,
        "uri": f"{team.prefix}/v1",
        "train": f"{team.prefix}/v1/train.jsonl",
        "eval": f"{team.prefix}/v1/eval.jsonl",
        "skipped": [],
    }
    assert handoff.read_claim(team, "v1")["dag_id"] == "dag"
    again = handoff.pick(team, "dag", "run-b", requested="v1")
    assert again.version is None and again.reason == f"{team.prefix}/v1 is being trained by run run-a of dag"
    assert again.to_xcom()["uri"] is None


def test_an_event_naming_a_version_that_is_not_ready_fails_saying_what_to_write(team: HandoffSpec) -> None:
    drop(team, "v1", ready=False)
    with pytest.raises(handoff.HandoffError) as err:
        handoff.pick(team, "dag", "run-a", requested="v1")
    assert "_READY" in str(err.value) and "train.jsonl" in str(err.value)
    assert artifacts.read_json(f"{team.prefix}/v1/{handoff.CLAIM}") is None
    with pytest.raises(handoff.HandoffError) as err:  # nothing uploaded at all
        handoff.pick(team, "dag", "run-a", requested="v2")
    uri = f"{team.prefix}/v2"
    assert str(err.value) == (
        f"dataset version {uri} has no _READY marker (files there: none); upload the files, then write "
        f"{uri}/_READY last, then post the event"
    )


def test_a_judged_version_is_not_taken_even_when_named(team: HandoffSpec) -> None:
    drop(team, "v1")
    bucket, path = gcs.split_uri(f"{team.prefix}/v1/{handoff.RESULT}")
    gcs.client().bucket(bucket).blob(path).upload_from_string("{}")
    picked = handoff.pick(team, "dag", "run-a", requested="v1")
    assert picked.version is None and "already judged" in picked.reason
    assert handoff.pick(team, "dag", "run-a").version is None


def test_a_ready_version_missing_a_file_is_refused(team: HandoffSpec) -> None:
    bucket, path = gcs.split_uri(handoff.version_uri(team, "v1"))
    b = gcs.client().bucket(bucket)
    b.blob(f"{path}/train.jsonl").upload_from_filename(str(PARITY / "train.jsonl"))
    b.blob(f"{path}/{handoff.READY}").upload_from_string(b"")
    with pytest.raises(handoff.HandoffError, match=r"lacks \['eval.jsonl'\]"):
        handoff.pick(team, "dag", "run-a", requested="v1")


# ------------------------------------------------------------------------------------ the verdict


GATE_YES_SUMMARY = {"promote": True, "base": 0.5, "tuned": 0.9, "delta": 0.4, "ci": [0.35, 0.45], "reason": "better"}
GATE_NO_SUMMARY = {"promote": False, "base": 0.5, "tuned": 0.52, "reason": "gain +0.02 below min_improvement 0.3"}
GATE_YES = GateSummary.from_object(GATE_YES_SUMMARY, "gate")
GATE_NO = GateSummary.from_object(GATE_NO_SUMMARY, "gate")
ALL_OK = {"validate_data": "success", "gate": "success", "publish": "success", "report": "success"}


def test_judge_accepts_only_a_promoted_model() -> None:
    verdict, reasons = handoff.judge(ALL_OK, [], GATE_YES, PublishSummary(True, 3))
    assert verdict == "accepted" and reasons == ["better"]


def test_judge_rejects_on_the_data_contract_with_each_failed_rule() -> None:
    states = {"validate_data": "failed", "lora_sft": "upstream_failed"}
    verdict, reasons = handoff.judge(states, ["train: 1 empty completion", "train: 2 duplicates"], None, None)
    assert verdict == "rejected"
    assert reasons == ["data contract: train: 1 empty completion", "data contract: train: 2 duplicates"]


def test_judge_rejects_when_the_gate_says_no() -> None:
    states = {**ALL_OK, "publish": "skipped"}
    assert handoff.judge(states, [], GATE_NO, None) == ("rejected", [f"quality gate: {GATE_NO.reason}"])


def test_judge_calls_a_broken_run_failed_not_the_datas_fault() -> None:
    states = {"validate_data": "success", "lora_sft": "failed", "gate": "upstream_failed"}
    verdict, reasons = handoff.judge(states, [], None, None)
    assert verdict == "failed" and reasons == ["task lora_sft failed; see its log in Airflow"]


def test_the_result_is_written_beside_the_version_with_what_a_data_team_needs(team: HandoffSpec) -> None:
    spec = handoff_spec(prefix=team.prefix)
    drop(team, "v1")
    doc = handoff.result_document(
        spec,
        "tiny-handoff",
        "manual__2026-12-03T01:00:00+00:00",
        "v1",
        "accepted",
        ["better"],
        PublishSummary(True, 3, "gs://x/merge_adapter/_MANIFEST.json"),
        GATE_YES,
        "gs://x/report/report.html",
        None,
    )
    uri = handoff.write_result(spec, "v1", doc)
    assert uri == f"{team.prefix}/v1/_RESULT.json"
    stored = artifacts.read_json(uri)
    assert stored["verdict"] == "accepted" and stored["model"]["version"] == 3
    assert stored["dataset"] == f"{team.prefix}/v1" and stored["gate"]["ci"] == [0.35, 0.45]
    assert stored["model"]["registry"] == f"{spec.registry_uri}/tiny-handoff"
    assert stored["model"]["model_manifest"] == "gs://x/merge_adapter/_MANIFEST.json"
    assert stored["gate"] == GATE_YES_SUMMARY and stored["dag_id"] == "tiny-handoff"
    bucket, path = gcs.split_uri(uri)
    assert gcs.client().bucket(bucket).get_blob(path).content_type == "application/json"
    assert stored["artifacts"].startswith(f"{spec.artifact_root}/tiny-handoff/manual__2026-12-03")
    extra = handoff.event_extra(stored, uri)
    assert extra["verdict"] == "accepted" and extra["model_version"] == 3 and extra["result"] == uri
    assert extra["report"] == "gs://x/report/report.html"
    assert len(json.dumps(extra)) < 2048
    # Not ready for another run any more.
    assert handoff.pick(team, "dag", "run-z").version is None


def test_data_failures_come_from_the_rejected_data_report(gcs_bucket: str) -> None:
    run = f"{gcs_bucket}/artifacts/p/run1"
    bucket, path = gcs.split_uri(f"{run}/validate_data/_rejected/data_report.json")
    report = {"success": False, "failures": ["train: 1 row has an empty completion (line 4)"]}
    gcs.client().bucket(bucket).blob(path).upload_from_string(json.dumps(report))
    assert handoff.data_failures(run) == ["train: 1 row has an empty completion (line 4)"]
    assert handoff.data_failures(f"{gcs_bucket}/artifacts/p/run2") == []


# ------------------------------------------------------------------------------------ the DAG


def test_a_handoff_pipeline_is_wrapped_in_pick_and_verdict(tmp_path: Path) -> None:
    import yaml

    from operators.dag_factory import load_pipelines

    data = handoff_spec().model_dump(mode="json")
    del data["data"]["train"], data["data"]["eval"]
    data["schedule"] = {"asset": "gs://team/handoff/parity"}
    (tmp_path / "tiny-handoff.yaml").write_text(yaml.safe_dump(data))
    dag = load_pipelines(tmp_path)["tiny-handoff"]
    pick, verdict = dag.get_task(handoff.PICK_TASK), dag.get_task(handoff.VERDICT_TASK)
    assert pick.is_setup and verdict.is_teardown
    stages = {t.task_id for t in dag.tasks} - {pick.task_id, verdict.task_id}
    assert verdict.upstream_task_ids == stages | {pick.task_id}
    assert pick.downstream_task_ids == {"validate_data", verdict.task_id}
    assert [o.uri for o in verdict.outlets] == ["loraflow://tiny-handoff/verdict"]
    assert "gs://team/handoff/parity" in str(dag.timetable.asset_condition)


# ------------------------------------------------------------------------------------ more verdicts


def test_judge_calls_a_run_that_ended_before_a_decision_failed_naming_the_tasks_not_done() -> None:
    states = {"validate_data": "success", "gate": "success", "publish": "running", "report": "queued"}
    assert handoff.judge(states, [], None, None) == (
        "failed",
        ["the run ended before a decision (tasks not done: publish, report)"],
    )
    done = {"validate_data": "success", "publish": "skipped"}
    assert handoff.judge(done, [], None, None) == ("failed", ["the run ended before a decision (tasks not done: none)"])
    # a promoting gate whose publish did not happen is no acceptance
    assert handoff.judge(done, [], GATE_YES, PublishSummary(False))[0] == "failed"
    # data rejection outranks failed tasks; failed tasks outrank the gate
    assert handoff.judge({"gate": "failed"}, ["x"], GATE_NO, None)[0] == "rejected"
    assert handoff.judge({"b": "failed", "a": "failed"}, [], GATE_NO, None) == (
        "failed",
        ["task a failed; see its log in Airflow", "task b failed; see its log in Airflow"],
    )
    assert handoff.judge(ALL_OK, [], GateSummary(promote=False, reason="", metric=None, confidence=None), None) == (
        "rejected",
        ["quality gate: the tuned model was not better"],
    )
    assert handoff.judge(ALL_OK, [], None, PublishSummary(True)) == (
        "accepted",
        ["the quality gate promoted the tuned model"],
    )


def test_a_rejected_result_names_no_model_and_keeps_the_gate_figures(team: HandoffSpec) -> None:
    spec = handoff_spec(prefix=team.prefix)
    doc = handoff.result_document(
        spec, "d", "run-1", "v1", "rejected", ["quality gate: no"], PublishSummary(False), GATE_NO, None, "http://r"
    )
    assert doc["model"] is None and doc["report"] is None and doc["report_url"] == "http://r"
    assert doc["gate"] == {k: GATE_NO_SUMMARY[k] for k in ("promote", "base", "tuned", "reason")}
    assert (doc["pipeline"], doc["dag_id"], doc["run_id"], doc["version"]) == ("tiny-handoff", "d", "run-1", "v1")
    assert doc["reasons"] == ["quality gate: no"] and doc["verdict"] == "rejected"
    assert doc["format"] == handoff.RESULT_FORMAT
    assert re.fullmatch(r"20\d\d-[01]\d-[0-3]\dT[0-2]\d:[0-5]\d:[0-5]\dZ", doc["finished_at"])  # ISO 8601, UTC
    none = handoff.result_document(spec, "d", "run-1", "v1", "failed", [], None, None, None, None)
    assert none["model"] is None and none["gate"] is None
    extra = handoff.event_extra(none, "gs://x/_RESULT.json")
    assert extra == {"pipeline": "tiny-handoff", "version": "v1", "dataset": f"{team.prefix}/v1", "verdict": "failed",
                     "reasons": [], "model_version": None, "result": "gs://x/_RESULT.json", "report": None,
                     "run_id": "run-1"}  # fmt: skip
    many = handoff.event_extra({**none, "reasons": [str(i) for i in range(30)]}, "u")
    assert many["reasons"] == [str(i) for i in range(10)]
    # Reasons quote the dataset: ten of 300 CJK characters (6 bytes each as JSON escapes) are 18 KB, the
    # extra stays within its quarter of a JSON notice's budget (Airflow keeps every event's extra).
    quoted = handoff.result_document(spec, "d", "run-1", "v1", "rejected", ["行" * 400] * 12, None, None, None, None)
    assert len(json.dumps(quoted["reasons"])) > 16 << 10
    capped = handoff.event_extra(quoted, "gs://x/_RESULT.json")
    assert len(json.dumps(capped)) <= notify.MAX_EXTRA_BYTES and capped["reasons"][0].startswith("行")


def test_the_state_of_a_version_reports_its_markers(team: HandoffSpec) -> None:
    assert handoff.state_of(team, "v1") == handoff.VersionState("v1")
    drop(team, "v1")
    state = handoff.state_of(team, "v1")
    assert state.ready_at is not None and not state.claimed and not state.judged and state.pending
    assert state.files == {"train.jsonl", "eval.jsonl", handoff.READY}
    handoff.claim(team, "v1", "dag", "run-a")
    claimed = handoff.state_of(team, "v1")
    assert claimed.claimed and not claimed.judged and not claimed.pending


def test_a_scan_sees_each_version_folder_and_nothing_nested_or_loose(team: HandoffSpec) -> None:
    drop(team, "v1")
    drop(team, "v2", ready=False)
    bucket, path = gcs.split_uri(team.prefix)
    b = gcs.client().bucket(bucket)
    b.blob(f"{path}/v1/sub/{handoff.READY}").upload_from_string(b"")  # nested: not a marker of v1
    b.blob(f"{path}/loose.txt").upload_from_string(b"")  # not in a version folder
    b.blob(f"{path}/_staging/{handoff.READY}").upload_from_string(b"")  # no valid version name
    handoff.claim(team, "v1", "dag", "run-a")
    states = {s.version: s for s in handoff.scan(team)}
    assert set(states) == {"v1", "v2"}
    assert states["v1"].files == {"train.jsonl", "eval.jsonl", handoff.READY, handoff.CLAIM}
    assert states["v1"].claimed and states["v1"].ready_at is not None and not states["v1"].judged
    assert states["v2"].ready_at is None and states["v2"].files == {"train.jsonl"}


def test_data_failures_list_load_problems_before_failed_rules(gcs_bucket: str) -> None:
    run = f"{gcs_bucket}/artifacts/p/run1"
    bucket, path = gcs.split_uri(f"{run}/validate_data/_rejected/data_report.json")
    report = {"load_problems": ["eval: line 3 is not JSON"], "failures": ["train: too few rows"]}
    gcs.client().bucket(bucket).blob(path).upload_from_string(json.dumps(report))
    assert handoff.data_failures(run) == ["eval: line 3 is not JSON", "train: too few rows"]


def test_a_handoff_prefix_ending_in_a_capital_x_is_scanned_whole(gcs_bucket: str) -> None:
    """Only '/' is stripped from the prefix: a team folder named `parityX` keeps its X."""
    team = HandoffSpec(prefix=f"{gcs_bucket}/handoff/parityX")
    drop(team, "v1")
    assert [s.version for s in handoff.scan(team)] == ["v1"]


def test_a_handoff_prefix_that_is_a_whole_bucket_is_scanned(gcs_bucket: str) -> None:
    """A data team's own bucket as the prefix (gs://BUCKET, which the spec takes): its versions lie at the root."""
    name = f"handoff-{uuid.uuid4().hex[:8]}"
    gcs.client().create_bucket(name)
    team = HandoffSpec(prefix=f"gs://{name}")
    drop(team, "v1")
    assert [s.version for s in handoff.scan(team)] == ["v1"]
    picked = handoff.pick(team, "dag", "run-a")
    assert picked.version == "v1" and picked.train == f"gs://{name}/v1/train.jsonl"


# ------------------------------------------------------------------------------------ hostile markers


def put(team: HandoffSpec, name: str, body: bytes) -> None:
    bucket, path = gcs.split_uri(team.prefix)
    gcs.client().bucket(bucket).blob(f"{path}/{name}").upload_from_string(body)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"not json", "not JSON"),
        (b"[]", "not a JSON object"),
        (b'"x"', "not a JSON object"),
        (b"", "not JSON"),
        (b"[" * 50_000, "not JSON"),  # nested too deep to parse, within the cap
        (b"{}", "names no dag_id and run_id"),
        (b'{"dag_id": "dag", "run_id": 5}', "names no dag_id and run_id"),
        (json.dumps({"dag_id": "dag", "run_id": "r" * 300}).encode(), "names no dag_id and run_id"),
    ],
    ids=["text", "list", "string", "empty", "deep", "empty-object", "number", "long-run-id"],
)
def test_a_garbage_claim_on_an_old_version_is_skipped_and_reported_never_crashing_a_pick(
    team: HandoffSpec, body: bytes, says: str
) -> None:
    drop(team, "v1")
    put(team, f"v1/{handoff.CLAIM}", body)
    drop(team, "v2")
    picked = handoff.pick(team, "dag", "run-a")
    assert picked.version == "v2"
    assert len(picked.skipped) == 1 and picked.skipped[0].startswith(f"{team.prefix}/v1/{handoff.CLAIM}")
    assert says in picked.skipped[0] and "publish the data again under a new version name" in picked.skipped[0]
    assert picked.to_xcom()["skipped"] == list(picked.skipped)
    nothing = handoff.pick(team, "dag", "run-b")  # every later run skips it too, and says so
    assert nothing.version is None and nothing.skipped == picked.skipped
    with pytest.raises(handoff.HandoffError, match=says):  # named by an event: refused, naming it
        handoff.pick(team, "dag", "run-c", requested="v1")


def test_a_claim_names_its_dag_and_run_in_1_to_250_characters(team: HandoffSpec) -> None:
    """The bounds docs/data-handoff.md and the refusal state: 1 and 250 characters are a claim, 0 and 251 not."""
    uri = f"{team.prefix}/v1/{handoff.CLAIM}"
    for dag_id, run_id in (("d", "r"), ("d" * 250, "r" * 250)):
        put(team, f"v1/{handoff.CLAIM}", json.dumps({"dag_id": dag_id, "run_id": run_id}).encode())
        assert handoff.read_claim(team, "v1") == {"dag_id": dag_id, "run_id": run_id}
    for dag_id, run_id in (("", "r"), ("d", ""), ("d" * 251, "r"), ("d", "r" * 251)):
        put(team, f"v1/{handoff.CLAIM}", json.dumps({"dag_id": dag_id, "run_id": run_id}).encode())
        with pytest.raises(handoff.BadClaimError) as err:
            handoff.read_claim(team, "v1")
        assert str(err.value) == (
            f"{uri} names no dag_id and run_id (strings of 1-250 characters): it is not a claim loraflow writes, so "
            "no run takes that version; publish the data again under a new version name (or, if no run is training "
            "it, delete that _CLAIM)"
        )


def test_a_bad_claim_written_after_the_scan_is_skipped_and_the_next_version_taken(
    team: HandoffSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scan saw v2, the newest, unclaimed; a garbage _CLAIM lands on it before this run claims it
    (deterministic: written as the scan returns). The pick passes v2 over, says why, and takes v1."""
    drop(team, "v1")
    drop(team, "v2")
    real_scan = handoff.scan

    def scan_then_a_bad_claim_lands(h: HandoffSpec) -> list[handoff.VersionState]:
        states = real_scan(h)
        put(team, f"v2/{handoff.CLAIM}", b"not a claim")
        return states

    monkeypatch.setattr(handoff, "scan", scan_then_a_bad_claim_lands)
    picked = handoff.pick(team, "dag", "run-a")
    assert picked.version == "v1" and picked.reason == f"the newest ready version under {team.prefix}"
    [skipped] = picked.skipped
    assert skipped.startswith(f"{team.prefix}/v2/{handoff.CLAIM} is not JSON")
    assert skipped.endswith("it is not a claim loraflow writes, so no run takes that version; publish the data again "
                            "under a new version name (or, if no run is training it, delete that _CLAIM)")  # fmt: skip
    held = handoff.read_claim(team, "v1") or {}
    assert (held.get("dag_id"), held.get("run_id")) == ("dag", "run-a")


def test_a_huge_claim_is_never_read_whole(team: HandoffSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    from google.cloud.storage import Blob

    read, real = [], Blob.download_as_bytes

    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        data = real(self, *args, **kwargs)
        read.append(len(data))
        return data

    monkeypatch.setattr(Blob, "download_as_bytes", counted)
    drop(team, "v1")
    put(team, f"v1/{handoff.CLAIM}", json.dumps({"dag_id": "dag", "run_id": "x", "pad": "x" * (3 << 20)}).encode())
    picked = handoff.pick(team, "dag", "run-a")
    assert picked.version is None and "larger than" in picked.skipped[0]
    assert read and max(read) <= handoff.CLAIM_MAX_BYTES + 1


def test_a_claim_naming_this_run_on_a_version_without_ready_is_not_taken(team: HandoffSpec) -> None:
    """A forged claim naming the next scheduled run used to make it train a version nobody marked ready."""
    drop(team, "v3", ready=False)
    put(team, "v3/eval.jsonl", (PARITY / "eval.jsonl").read_bytes())
    put(team, f"v3/{handoff.CLAIM}", json.dumps({"dag_id": "dag", "run_id": "run-next"}).encode())
    drop(team, "v1")
    picked = handoff.pick(team, "dag", "run-next")
    assert picked.version == "v1" and "newest ready version" in picked.reason
    uri = f"{team.prefix}/v3"
    assert picked.skipped == (
        f"{uri}/_CLAIM names this run but the version has no _READY marker of its own: not taken (loraflow claims "
        f"only ready versions, so that claim was written by someone else); write {uri}/_READY last when the "
        "version is complete, or publish it under a new version name",
    )


def test_a_nested_ready_is_not_the_versions_own(team: HandoffSpec) -> None:
    drop(team, "v3", ready=False)
    put(team, "v3/eval.jsonl", (PARITY / "eval.jsonl").read_bytes())
    put(team, f"v3/sub/{handoff.READY}", b"")
    put(team, "v3/sub/extra.jsonl", b"{}")
    state = handoff.state_of(team, "v3")
    assert state.ready_at is None and state.files == {"train.jsonl", "eval.jsonl"}
    with pytest.raises(handoff.HandoffError, match="has no _READY marker"):
        handoff.pick(team, "dag", "run-a", requested="v3")
    assert handoff.read_claim(team, "v3") is None
    assert handoff.pick(team, "dag", "run-a").version is None


def test_the_versions_a_pick_skipped_reach_the_verdict_and_the_task_log(
    team: HandoffSpec, capsys: pytest.CaptureFixture[str]
) -> None:
    from operators.handoff import PickDatasetOperator

    spec = handoff_spec(prefix=team.prefix)
    drop(team, "v1")
    put(team, f"v1/{handoff.CLAIM}", b"[]")
    drop(team, "v2")
    operator = PickDatasetOperator(spec=spec.model_dump(mode="json"))
    xcom = operator.execute({"params": {}, "run_id": "run-a"})  # type: ignore[arg-type]
    assert xcom["version"] == "v2" and len(xcom["skipped"]) == 1
    log = capsys.readouterr().out  # the task log (Airflow's structlog writes it to stdout here)
    assert f"skipped: {team.prefix}/v1/{handoff.CLAIM} is not a JSON object" in log
    doc = handoff.result_document(
        spec, "d", "run-a", "v2", "rejected", ["quality gate: no"], None, GATE_NO, None, None, skipped=xcom["skipped"]
    )
    assert doc["skipped"] == xcom["skipped"]
    assert handoff.result_document(spec, "d", "run-a", "v2", "failed", [], None, None, None, None)["skipped"] == []


def test_a_data_report_that_cannot_be_read_is_no_crash(gcs_bucket: str, caplog: pytest.LogCaptureFixture) -> None:
    run = f"{gcs_bucket}/artifacts/p/run1"
    bucket, path = gcs.split_uri(f"{run}/validate_data/_rejected/data_report.json")
    uri = f"{run}/validate_data/_rejected/data_report.json"
    said = {  # the warning names the report and its problem (the verdict then names no rule)
        b"not json": f"the data report {uri} cannot be read (is not JSON (Expecting value: line 1 column 1 (char 0))); "
        "the verdict names no data-contract rule",
        b"[1]": f"the data report {uri} cannot be read (is not a JSON object (it holds a list)); the verdict "
        "names no data-contract rule",
        b'{"failures": "abc", "load_problems": 7}': f"the data report {uri} lists its problems as no list; the "
        "verdict names no data-contract rule",
    }
    for body, warning in said.items():
        caplog.clear()
        gcs.client().bucket(bucket).blob(path).upload_from_string(body)
        assert handoff.data_failures(run) == []
        assert [r.getMessage() for r in caplog.records] == [warning]


def test_a_long_rejected_data_report_still_names_its_rules(gcs_bucket: str) -> None:
    """validate_data keeps every failure (the verdict caps its reasons): a report of 2,000 of them (~150 KiB)
    is read whole, up to REPORT_MAX_BYTES, not the 64 KiB of a small object."""
    run = f"{gcs_bucket}/artifacts/p/run1"
    bucket, path = gcs.split_uri(f"{run}/validate_data/_rejected/data_report.json")
    failures = [f"train: row {i} has an empty completion (line {i + 1} of train.jsonl)" for i in range(2000)]
    body = json.dumps({"success": False, "failures": failures})
    assert len(body) > 128 << 10
    gcs.client().bucket(bucket).blob(path).upload_from_string(body)
    assert handoff.data_failures(run) == failures
