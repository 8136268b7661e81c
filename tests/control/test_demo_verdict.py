"""What ``make demo`` says at the end of a run (loraflow/dev/demo.py: ``verdict``, ``print_verdict``): the
gate's verdict read from its committed manifest as a typed ``GateSummary``, so a summary loraflow did not
write ("promote": "yes") is refused naming the manifest and the fix, never printed as PROMOTE."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from loraflow.dev import demo
from loraflow.storage import artifacts, gcs
from loraflow.storage.summaries import RERUN_GATE, GateSummary, SummaryError

RUN_ID = "manual__2026-12-06T08:00:00+00:00"
#: What steps/gate.py's summary() returns for a run it did not promote (the evidence beside the verdict).
DECLINED = {
    "promote": False,
    "metric": "accuracy",
    "base": 0.5,
    "tuned": 0.5,
    "delta": 0.0,
    "ci": [-0.1, 0.1],
    "confidence": 0.95,
    "reason": "gain +0 does not clear 0.01",
    "guard": {"passed": True, "delta": 0.0},
}


class FakeAirflow:
    """The two reads verdict() makes of Airflow: the run's task states and each task's XCom."""

    def __init__(self, xcoms: dict[str, Any]) -> None:
        self.xcoms = xcoms

    def task_states(self, dag_id: str, run_id: str) -> dict[str, str]:
        return dict.fromkeys(self.xcoms, "success")

    def xcom(self, dag_id: str, run_id: str, task_id: str) -> Any:
        return self.xcoms[task_id]


def committed_gate(root: str, tmp_path: Path, summary: dict[str, Any]) -> str:
    """A gate stage committed under ``root`` with ``summary`` as its manifest's summary; its manifest URI."""
    prefix = gcs.join(root, "tiny", artifacts.safe_run_id(RUN_ID), "gate")
    (tmp_path / "gate").mkdir()
    (tmp_path / "gate" / "decision.json").write_text("{}")
    table = artifacts.upload_tree(tmp_path / "gate", prefix)
    manifest = artifacts.commit(
        prefix, table, stage="gate", inputs={}, config={}, lock_version="t", cache_key="k", summary=summary
    )
    return manifest.uri


def run_verdict(root: str, xcoms: dict[str, Any]) -> dict[str, Any]:
    spec = SimpleNamespace(name="tiny", artifact_root=root)
    return demo.verdict(spec, FakeAirflow(xcoms), RUN_ID)  # type: ignore[arg-type]


def test_the_gates_verdict_is_read_typed_from_its_manifest_and_printed(
    gcs_bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    uri = committed_gate(gcs_bucket, tmp_path, DECLINED)
    base, tuned = {"accuracy": 0.5, "n": 4}, {"accuracy": 0.5, "n": 4}
    v = run_verdict(
        gcs_bucket,
        {"evaluate_base": {"summary": base}, "evaluate_tuned": {"summary": tuned}, "gate": {"manifest": uri}},
    )
    assert v["gate"] == GateSummary(
        False, "gain +0 does not clear 0.01", "accuracy", 0.95, 0.5, 0.5, 0.0, (-0.1, 0.1), None
    )
    assert v["decision"] == DECLINED  # the evidence too (the e2e tests read the guard's)
    demo.print_verdict(v)
    out = capsys.readouterr().out
    assert "[loraflow] accuracy before SFT: 0.5  after: 0.5\n" in out
    assert "[loraflow] gate: do not promote - gain +0 does not clear 0.01\n" in out
    assert "PROMOTE" not in out


def test_a_promoted_verdict_says_promote(gcs_bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    uri = committed_gate(gcs_bucket, tmp_path, {**DECLINED, "promote": True, "reason": "accuracy rose"})
    demo.print_verdict(run_verdict(gcs_bucket, {"gate": {"manifest": uri}}))
    assert "[loraflow] gate: PROMOTE - accuracy rose\n" in capsys.readouterr().out


def test_a_summary_loraflow_did_not_write_is_refused_naming_the_manifest(gcs_bucket: str, tmp_path: Path) -> None:
    uri = committed_gate(gcs_bucket, tmp_path, {**DECLINED, "promote": "no"})  # truthy: a .get read promoted it
    with pytest.raises(SummaryError) as err:
        run_verdict(gcs_bucket, {"gate": {"manifest": uri}})
    assert str(err.value) == (
        f"the summary in {uri} is not a gate summary loraflow wrote (its 'promote' is 'no', not a boolean); "
        f"{RERUN_GATE}"
    )


def test_a_run_whose_gate_did_not_run_says_so(gcs_bucket: str, capsys: pytest.CaptureFixture[str]) -> None:
    v = run_verdict(gcs_bucket, {"validate_data": None, "gate": None})
    assert v["gate"] is None and v["decision"] == {}
    demo.print_verdict(v)
    out = capsys.readouterr().out
    assert "[loraflow] gate: no decision (the gate did not run)\n" in out and "promote" not in out.lower()
