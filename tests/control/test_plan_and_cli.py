"""`loraflow validate` / `loraflow plan` and the resolved plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loraflow.cli import main
from loraflow.pipeline.plan import describe, stage_plans
from loraflow.spec.schema import load_spec

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"


def test_validate_all_shipped_specs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate"]) == 0
    assert "0 invalid" in capsys.readouterr().out


def test_validate_fails_and_lists_problems(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text((PIPELINES / "tiny-llama-lora.yaml").read_text().replace("rank: 16", "rank: -3"))
    assert main(["validate", str(bad), str(PIPELINES / "tiny-llama-lora.yaml")]) == 1
    captured = capsys.readouterr()
    assert "1 valid, 1 invalid" in captured.out
    assert "lora.rank" in captured.err and "greater than or equal to 1" in captured.err


def test_plan_prints_every_stage_with_argv(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(PIPELINES / "llama31-8b-lora.yaml"), "--json", "--run-id", "r1"]) == 0
    plan = json.loads(capsys.readouterr().out)
    stages = {s["stage"]: s for s in plan["stages"]}
    assert list(stages) == [
        "validate_data", "convert_checkpoint", "evaluate_base", "lora_sft",
        "merge_adapter", "evaluate_tuned", "gate", "publish", "report",
    ]  # fmt: skip
    sft = stages["lora_sft"]
    assert sft["launcher"]["tpu_topology"] == "4x4" and sft["launcher"]["hosts"] == 4
    assert sft["output"] == "gs://acme-llm-artifacts/loraflow/llama31-8b-lora/r1/lora_sft"
    assert sft["argv"][:3] == ["python", "-m", "loraflow.steps.lora_sft"]
    assert (
        "checkpoint=gs://acme-llm-artifacts/loraflow/llama31-8b-lora/r1/convert_checkpoint/_MANIFEST.json"
        in sft["argv"]
    )


def test_stage_order_and_dependencies() -> None:
    plans = stage_plans(load_spec(PIPELINES / "tiny-llama-lora.yaml"))
    assert plans["convert_checkpoint"].upstream == ("validate_data",)  # nothing trains on bad data
    assert plans["evaluate_base"].upstream == ("validate_data",)  # runs beside convert/train
    assert set(plans["gate"].upstream) == {"evaluate_base", "evaluate_tuned"}
    assert plans["publish"].cacheable is False
    assert plans["gate"].cacheable is False  # it reads the registry's champion, which moves between runs
    assert plans["gate"].config["registry_uri"] == plans["publish"].config["registry_uri"]
    # the report follows publish (skipped when not promoted) and reads the other stages by reference
    assert plans["report"].upstream[-1] == "publish" and plans["report"].cacheable is False
    assert "publish" not in plans["report"].inputs
    assert all(not ref.fetch for ref in plans["report"].inputs.values())  # type: ignore[union-attr]
    assert {p.env.name for p in plans.values()} == {"control", "trainer", "serving"}


def test_plan_argv_never_goes_through_a_shell() -> None:
    spec = load_spec(PIPELINES / "tiny-llama-lora.yaml")
    for stage in describe(spec)["stages"]:
        assert isinstance(stage["argv"], list) and all(isinstance(a, str) for a in stage["argv"])


def test_spec_reference_doc_matches_the_schema() -> None:
    from loraflow.spec.reference import render

    doc = Path(__file__).resolve().parents[2] / "docs" / "spec-reference.md"
    assert doc.read_text() == render(), "regenerate: loraflow spec-reference > docs/spec-reference.md"


def test_the_command_is_one_package_run_as_python_m_or_its_script() -> None:
    import subprocess
    import sys
    import tomllib

    root = PIPELINES.parent
    loose = sorted(p.name for p in (root / "loraflow").glob("*.py") if p.name not in ("__init__.py", "errors.py"))
    assert loose == [], f"{loose} lie loose at the top of loraflow/: the command's modules belong in loraflow/cli/"
    script = tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]["loraflow"]
    assert script == "loraflow.cli:main"
    ran = subprocess.run([sys.executable, "-m", "loraflow.cli", "--help"], capture_output=True, text=True, cwd=root)
    assert ran.returncode == 0 and "validate,plan,spec-reference,seed,registry,runs,trigger,verify" in ran.stdout


def test_validate_without_specs_reads_the_pipelines_folder_the_environment_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "pipelines"
    folder.mkdir()
    (folder / "tiny-llama-lora.yaml").write_text((PIPELINES / "tiny-llama-lora.yaml").read_text())
    (folder / "broken.yaml").write_text("name: broken\n")
    monkeypatch.setenv("LORAFLOW_PIPELINES_DIR", str(folder))
    assert main(["validate"]) == 1
    captured = capsys.readouterr()
    assert f"ok       {folder / 'tiny-llama-lora.yaml'}" in captured.out and "1 valid, 1 invalid" in captured.out
    assert str(folder / "broken.yaml") in captured.err
