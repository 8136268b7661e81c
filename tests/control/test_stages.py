"""The stage table (loraflow/spec/stages.py): every stage declared once, and everything that reads it agrees."""

from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from loraflow.launchers.environments import ENVIRONMENTS
from loraflow.pipeline.plan import stage_plans
from loraflow.spec import schema
from loraflow.spec.schema import load_spec
from loraflow.spec.stages import STAGE_TABLE, STAGES, Stage
from loraflow.spec.step_configs import STEP_CONFIGS

REPO = Path(__file__).resolve().parents[2]
SPEC = REPO / "pipelines" / "tiny-llama-lora.yaml"


def test_the_schema_knows_the_tables_stages_and_names_them_when_refusing_one() -> None:
    assert schema.STAGES == STAGES == tuple(row.name for row in STAGE_TABLE)
    data = load_spec(SPEC).model_dump(mode="json")
    data["compute"] = {"lora_sfft": {"launcher": "local"}}
    with pytest.raises(schema.SpecError) as err:
        schema.validate_spec(data, "spec")
    assert "lora_sfft" in str(err.value) and all(stage in str(err.value) for stage in STAGES)


@pytest.mark.parametrize("row", STAGE_TABLE, ids=lambda row: row.name)
def test_every_stage_has_a_plan_a_step_program_and_a_config(row: Stage) -> None:
    plan = stage_plans(load_spec(SPEC))[row.name]
    assert plan.env is ENVIRONMENTS[row.env]
    assert plan.module == row.module and importlib.util.find_spec(row.module) is not None
    assert STEP_CONFIGS[row.name].__name__ == row.config
    assert plan.config == STEP_CONFIGS[row.name].from_spec(load_spec(SPEC)).wire()
    assert plan.cacheable == row.cacheable


def test_stages_follow_what_they_read_and_run_after() -> None:
    plans = stage_plans(load_spec(SPEC))
    assert list(plans) == list(STAGES)
    for position, row in enumerate(STAGE_TABLE):
        assert set(row.after) <= set(plans[row.name].upstream)
        assert set(plans[row.name].upstream) <= set(STAGES[:position]), f"{row.name} runs before an upstream"


def test_the_special_orderings_are_kept() -> None:
    plans = stage_plans(load_spec(SPEC))
    assert plans["convert_checkpoint"].upstream == ("validate_data",)  # nothing converted before the data holds
    assert plans["report"].upstream[-1] == "publish"  # the report follows publish without reading it
    assert "publish" not in plans["report"].inputs


@pytest.mark.parametrize("row", STAGE_TABLE, ids=lambda row: row.name)
def test_every_stage_has_its_operator_with_the_tables_traits(row: Stage) -> None:
    from operators import stages as operators
    from operators.stages import LINKS, OPERATORS

    op = OPERATORS[row.name]
    assert getattr(operators, row.operator_name) is op  # what serialized DAGs and imports name
    assert (op.__module__, op.__qualname__, op.stage) == ("operators.stages", row.operator_name, row.name)
    task = op.for_spec({"name": "p"}, task_id=row.name)
    assert task.trigger_rule == row.trigger_rule
    assert task.ui_color == row.ui_color
    assert [type(link) for link in op.operator_extra_links] == [LINKS[link] for link in row.links]


def test_the_report_runs_whatever_happened_and_links_to_itself() -> None:
    from operators.links import ReportLink
    from operators.stages import OPERATORS

    report = OPERATORS["report"].for_spec({"name": "p"})
    assert report.trigger_rule == "all_done"
    assert isinstance(report.operator_extra_links[0], ReportLink)


def test_the_schema_imports_neither_the_planner_nor_the_step_configs() -> None:
    code = (
        "import json, sys, loraflow.spec.schema; "
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('loraflow.', 'google.cloud.')))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    loaded = set(json.loads(out.stdout))
    assert "loraflow.spec.stages" in loaded
    assert not loaded & {
        "loraflow.pipeline.plan",
        "loraflow.storage.artifacts",
        "loraflow.spec.step_configs",
        "loraflow.launchers.environments",
    }
    # storage.gcs (the bucket-name rule) lies beneath the spec; the GCS client it builds loads on first use only
    assert not {m for m in loaded if m.startswith("google.cloud.")}


def test_the_stage_table_imports_only_the_standard_library() -> None:
    module = importlib.import_module("loraflow.spec.stages")
    source = Path(str(module.__file__)).read_text()
    imports = [line for line in source.splitlines() if line.startswith(("import ", "from "))]
    assert all(not line.split()[1].startswith(("loraflow", "pydantic", "airflow")) for line in imports), imports
