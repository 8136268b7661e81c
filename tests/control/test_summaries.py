"""The gate's and publish's summaries (loraflow/storage/summaries.py): read one way by publish, the notices,
the hand-off verdict, ``loraflow runs`` and the registry, and refused with one error naming the object,
the field and the fix when they are not what loraflow writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from loraflow.cli import run_verdicts
from loraflow.storage.json_objects import JsonObjectError
from loraflow.storage.summaries import RERUN_GATE, RERUN_PUBLISH, GateSummary, PublishSummary, SummaryError

#: What steps/gate.py's summary() returns for a promoted model.
WRITTEN = {
    "promote": True,
    "metric": "accuracy",
    "base": 0.5,
    "tuned": 0.75,
    "delta": 0.25,
    "ci": [0.1, 0.4],
    "confidence": 0.95,
    "reason": "gain +0.25 clears 0.1",
    "champion_version": 3,
    "guard": {"passed": True, "delta": 0.0},
}


def test_the_gates_summary_reads_as_written() -> None:
    summary = GateSummary.from_object(WRITTEN, "gate")
    assert summary == GateSummary(True, "gain +0.25 clears 0.1", "accuracy", 0.95, 0.5, 0.75, 0.25, (0.1, 0.4), 3)


def test_fields_older_summaries_lack_read_as_none() -> None:
    summary = GateSummary.from_object({"promote": False, "reason": "no gain"}, "gate")
    assert summary == GateSummary(False, "no gain", None, None)
    assert summary.metric is summary.ci is summary.confidence is summary.champion_version is None
    assert GateSummary.from_object({**WRITTEN, "ci": None, "confidence": None}, "gate").ci is None


@pytest.mark.parametrize(
    ("changed", "problem"),
    [
        ({"promote": "yes"}, "its 'promote' is 'yes', not a boolean"),
        ({"promote": 1}, "its 'promote' is 1, not a boolean"),
        ({"promote": None}, "its 'promote' is None, not a boolean"),
        ({"reason": 7}, "its 'reason' is 7, not a string"),
        ({"metric": ["accuracy"]}, "its 'metric' is ['accuracy'], not a string"),
        ({"base": "0.5"}, "its 'base' is '0.5', not a number"),
        ({"tuned": True}, "its 'tuned' is True, not a number"),
        ({"delta": {}}, "its 'delta' is {}, not a number"),
        ({"ci": [0.1]}, "its 'ci' is [0.1], not two numbers"),
        ({"ci": [0.1, "x"]}, "its 'ci' is [0.1, 'x'], not two numbers"),
        ({"confidence": "95%"}, "its 'confidence' is '95%', not a number"),
        ({"champion_version": 2.5}, "its 'champion_version' is 2.5, not a whole number"),
        ({"champion_version": False}, "its 'champion_version' is False, not a whole number"),
    ],
)
def test_a_field_of_the_wrong_kind_is_one_error_naming_the_object_the_field_and_the_fix(
    changed: dict[str, Any], problem: str
) -> None:
    with pytest.raises(SummaryError) as err:
        GateSummary.from_object({**WRITTEN, **changed}, "gs://b/p/run/gate/decision.json")
    assert (
        str(err.value)
        == f"gs://b/p/run/gate/decision.json is not a gate summary loraflow wrote ({problem}); {RERUN_GATE}"
    )


def test_a_missing_promote_and_a_non_object_are_refused() -> None:
    with pytest.raises(SummaryError) as err:
        GateSummary.from_object({"reason": "x"}, "gate")
    assert str(err.value) == f"gate is not a gate summary loraflow wrote (it has no 'promote'); {RERUN_GATE}"
    with pytest.raises(SummaryError) as err:
        GateSummary.from_object([True], "gate")
    assert (
        str(err.value)
        == f"gate is not a gate summary loraflow wrote (it holds a list, not a JSON object); {RERUN_GATE}"
    )
    # no reason recorded reads as none, so the verdicts say their own ("the tuned model was not better")
    assert GateSummary.from_object({"promote": False}, "gate").reason == ""


def test_a_long_value_is_shortened_in_the_error() -> None:
    with pytest.raises(SummaryError) as err:
        GateSummary.from_object({**WRITTEN, "reason": ["x" * 500]}, "gate")
    assert len(str(err.value)) < 250


def test_the_decision_file_is_read_bounded_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "decision.json"
    path.write_text('{"promote": true, "reason": "ok", "evidence": [1, 2]}')
    assert GateSummary.read(path) == GateSummary(True, "ok", None, None)
    path.write_text('{"promote": "true"}')
    with pytest.raises(SummaryError, match=f"{path} is not a gate summary"):
        GateSummary.read(path)
    path.write_text("[" * 100 + "]" * 100)
    with pytest.raises(JsonObjectError, match=f"{path} is not JSON loraflow reads .nested deeper") as err:
        GateSummary.read(path)
    assert str(err.value).endswith(RERUN_GATE)  # the fix: the gate writes it


def test_an_xcom_without_a_summary_is_no_decision_and_a_bad_one_is_refused() -> None:
    assert GateSummary.from_xcom(None) is None and GateSummary.from_xcom({"manifest": "m"}) is None
    assert GateSummary.from_xcom({"summary": WRITTEN}) == GateSummary.from_object(WRITTEN, "x")
    with pytest.raises(SummaryError, match=r"^the gate task's summary \(XCom\) is not a gate summary"):
        GateSummary.from_xcom({"summary": {"promote": "no"}})
    assert PublishSummary.from_xcom("not a dict") is None
    with pytest.raises(SummaryError) as err:
        PublishSummary.from_xcom({"summary": {"promoted": "yes"}})
    assert str(err.value).startswith("the publish task's summary (XCom) is not a publish summary loraflow wrote")
    assert PublishSummary.from_xcom({"summary": {"promoted": True, "version": 4}}) == PublishSummary(True, 4)


def test_the_publish_summary_reads_as_written_and_refuses_a_wrong_field() -> None:
    written = {"promoted": True, "version": 4, "model_manifest": "gs://b/m/_MANIFEST.json", "vertex_model": "x@1"}
    assert PublishSummary.from_object(written, "publish") == PublishSummary(True, 4, "gs://b/m/_MANIFEST.json")
    assert PublishSummary.from_object({"promoted": False, "version": None}, "publish") == PublishSummary(False)
    with pytest.raises(SummaryError) as err:
        PublishSummary.from_object({"promoted": True, "version": "4"}, "publish")
    assert str(err.value) == (
        f"publish is not a publish summary loraflow wrote (its 'version' is '4', not a whole number); {RERUN_PUBLISH}"
    )
    with pytest.raises(SummaryError, match="it has no 'promoted'"):
        PublishSummary.from_object({"version": 4}, "publish")


class _Client:
    """The Airflow REST client as run_verdicts uses it: one run's task states and XComs."""

    def __init__(self, xcoms: dict[str, Any]) -> None:
        self.xcoms = xcoms

    def task_states(self, dag_id: str, run_id: str) -> dict[str, str]:
        return {task: "success" for task in self.xcoms}

    def xcom(self, dag_id: str, run_id: str, task: str) -> Any:
        return self.xcoms[task]


def test_a_runs_verdict_reads_the_typed_summaries() -> None:
    client = _Client({"gate": {"summary": WRITTEN}, "publish": {"summary": {"promoted": True, "version": 7}}})
    assert run_verdicts.verdict(client, "d", "r", "success") == "promoted as version 7: accuracy 0.5 -> 0.75"  # type: ignore[arg-type]
    refused = {**WRITTEN, "promote": False, "reason": "gain too small"}
    client = _Client({"gate": {"summary": refused}})
    assert run_verdicts.verdict(client, "d", "r", "success") == "not promoted: accuracy 0.5 -> 0.75; gain too small"  # type: ignore[arg-type]


def test_a_malformed_summary_is_said_on_its_runs_line_not_read_as_a_promotion() -> None:
    client = _Client(
        {"gate": {"summary": {**WRITTEN, "promote": "false"}}, "publish": {"summary": {"promoted": False}}}
    )
    said = run_verdicts.verdict(client, "d", "r", "success")  # type: ignore[arg-type]
    assert said.startswith("no verdict: the gate task's summary (XCom) is not a gate summary loraflow wrote")
    assert "its 'promote' is 'false', not a boolean" in said and RERUN_GATE in said
