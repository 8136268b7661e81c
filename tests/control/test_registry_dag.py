"""The registry's maintenance DAG (dags/loraflow_registry.py, operators/registry.py): its typed params
as the trigger form and REST see them, and its task against the GCS emulator."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from loraflow.registry import audit, operations
from operators.registry import DAG_ID, RegistryOperator, registry_dag

from .champions import register_champion
from .test_dags import REPO, parse


def test_the_dag_offers_the_actions_and_the_pipelines_as_typed_params(tmp_path: Path) -> None:
    folder = tmp_path / "pipelines"
    folder.mkdir()
    for name in ("tiny-llama-lora", "tiny-llama-qlora"):
        shutil.copy(REPO / "pipelines" / f"{name}.yaml", folder)
    result = parse(folder, tmp_path)
    assert result["errors"] == {} and DAG_ID in result["dags"]
    params = result["params"][DAG_ID]
    assert params["action"]["enum"] == ["list", "promote", "rollback"]
    assert params["pipeline"]["enum"] == ["tiny-llama-lora", "tiny-llama-qlora"]
    assert params["version"]["type"] == ["null", "integer"] and params["version"]["minimum"] == 1
    assert params["reason"]["type"] == "string"
    assert result["tasks"][DAG_ID] == ["registry"]


def test_a_param_outside_its_schema_is_refused_by_the_dag_itself() -> None:
    """What Airflow checks a trigger's conf with (the form and REST answer 400 with the reason)."""
    from airflow.sdk.definitions.param import ParamValidationError

    dag = registry_dag(REPO / "pipelines")
    for name, bad in (("action", "delete"), ("version", 0), ("version", "3"), ("pipeline", "nope")):
        with pytest.raises(ParamValidationError):
            dag.params.get_param(name).resolve(bad)
    assert dag.params.get_param("version").resolve(3) == 3
    assert dag.params.get_param("action").resolve("rollback") == "rollback"


def spec_folder(tmp_path: Path, gcs_bucket: str) -> Path:
    """The tiny spec with its artifact root in this test's GCS prefix."""
    folder = tmp_path / "pipelines"
    folder.mkdir()
    text = (REPO / "pipelines" / "tiny-llama-lora.yaml").read_text()
    (folder / "tiny-llama-lora.yaml").write_text(
        text.replace("artifact_root: gs://loraflow-demo/artifacts", f"artifact_root: {gcs_bucket}/artifacts")
    )
    return folder


def context(params: dict[str, Any], user: str | None = "alice") -> Any:
    run = SimpleNamespace(triggering_user_name=user, run_type="manual", dag_id=DAG_ID, run_id="manual__1")
    return {"params": params, "dag_run": run}


def test_the_task_rolls_back_as_the_triggering_user_and_lists(gcs_bucket: str, tmp_path: Path) -> None:
    folder = spec_folder(tmp_path, gcs_bucket)
    root, registry_uri = f"{gcs_bucket}/artifacts", f"{gcs_bucket}/artifacts/_registry"
    for n in (1, 2):
        register_champion(registry_uri, root, tmp_path, pipeline="tiny-llama-lora", run=f"run-{n}", version=n)
    op = RegistryOperator(task_id="registry", pipelines_dir=str(folder))
    params = {"action": "rollback", "pipeline": "tiny-llama-lora", "version": None, "reason": "v2 is worse"}
    result = op.execute(context(params))  # type: ignore[arg-type]
    assert result["champion"] == 1 and result["summary"].startswith("tiny-llama-lora: #1")
    [event] = audit.read_trail(registry_uri, "tiny-llama-lora")
    assert (event["actor"], event["via"], event["reason"]) == (
        "alice",
        f"airflow {DAG_ID} run manual__1",
        "v2 is worse",
    )
    listed = op.execute(context({**params, "action": "list"}))  # type: ignore[arg-type]
    assert listed["champion"] == 1 and listed["versions"] == [1, 2]
    assert "1 move(s)" in listed["summary"]
    # a run nobody triggered by hand is recorded as what Airflow says it was
    op.execute(context({**params, "action": "promote", "version": 2, "reason": "fixed"}, user=None))  # type: ignore[arg-type]
    assert audit.read_trail(registry_uri, "tiny-llama-lora")[-1]["actor"] == "airflow (manual)"


def test_a_refused_operation_fails_the_task_with_the_reason(gcs_bucket: str, tmp_path: Path) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    op = RegistryOperator(task_id="registry", pipelines_dir=str(spec_folder(tmp_path, gcs_bucket)))
    base = {"pipeline": "tiny-llama-lora", "version": None, "reason": "r"}
    with pytest.raises(AirflowFailException, match=r"promote needs the version"):
        op.execute(context({**base, "action": "promote"}))  # type: ignore[arg-type]
    with pytest.raises(AirflowFailException, match=r"a number from 1; got '3'"):  # a run Airflow never checked
        op.execute(context({**base, "action": "promote", "version": "3"}))  # type: ignore[arg-type]
    with pytest.raises(AirflowFailException, match=r"has no champion yet"):
        op.execute(context({**base, "action": "rollback"}))  # type: ignore[arg-type]
    with pytest.raises(AirflowFailException, match=r"no pipeline 'other' in .*its pipelines: tiny-llama-lora"):
        op.execute(context({**base, "pipeline": "other", "action": "list"}))  # type: ignore[arg-type]
    assert operations.ACTIONS == ("list", "promote", "rollback")  # the DAG's enum, kept import-free
