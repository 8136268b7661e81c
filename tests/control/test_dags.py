"""The DAG folder: one DAG per spec, trigger-form Params, import discipline, invalid specs isolated."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
HEAVY = [
    "jax", "maxtext", "tunix", "qwix", "vllm", "torch", "transformers", "great_expectations",
    "google.cloud.aiplatform", "gcsfs", "pandas", "numpy",
]  # fmt: skip

# Parse the DAG folder in a fresh interpreter, as the DAG processor does, and report what it saw.
PARSE = r"""
import json, os, sys
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder=os.environ["DAGS"])
heavy = [m for m in json.loads(os.environ["HEAVY"]) if m in sys.modules]
print(json.dumps({
    "dags": sorted(bag.dag_ids),
    "errors": {k: v for k, v in bag.import_errors.items()},
    "heavy": heavy,
    "tasks": {d: sorted(t.task_id for t in bag.dags[d].tasks) for d in bag.dag_ids},
    "params": {d: {k: v.schema for k, v in bag.dags[d].params.items()} for d in bag.dag_ids},
}))
"""


def parse(pipelines: Path, tmp_path: Path, script: str = PARSE, **env: str) -> dict:
    """Run ``script`` (a DagBag parse of dags/ that prints JSON last) in a fresh interpreter."""
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(tmp_path / "airflow"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "LORAFLOW_PIPELINES_DIR": str(pipelines),
        "DAGS": str(REPO / "dags"),
        "HEAVY": json.dumps(HEAVY),
        **env,
    }
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def shipped(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return parse(REPO / "pipelines", tmp_path_factory.mktemp("parse"))


def test_one_dag_per_shipped_spec(shipped: dict) -> None:
    assert shipped["errors"] == {}
    assert shipped["dags"] == [
        "gemma3-12b-lora", "llama31-8b-lora", "llama31-8b-qlora", "loraflow_registry", "qwen3-8b-lora",
        "tiny-gemma3-lora", "tiny-llama-lora", "tiny-llama-qlora", "tiny-qwen3-lora",
    ]  # fmt: skip
    assert shipped["tasks"]["tiny-llama-lora"] == sorted(
        [
            "validate_data",
            "convert_checkpoint",
            "evaluate_base",
            "lora_sft",
            "merge_adapter",
            "evaluate_tuned",
            "gate",
            "publish",
            "report",
        ]
    )


def test_parsing_imports_no_heavy_library(shipped: dict) -> None:
    assert shipped["heavy"] == []


def test_overridable_settings_become_params_with_bounds(shipped: dict) -> None:
    params = shipped["params"]["tiny-llama-lora"]
    assert params["training_steps"] == {"title": "training.steps", "type": "integer", "minimum": 10, "maximum": 2000}
    assert params["training_learning_rate"]["type"] == "number"


def test_invalid_spec_is_an_import_error_and_the_others_still_load(tmp_path: Path) -> None:
    folder = tmp_path / "pipelines"
    folder.mkdir()
    shutil.copy(REPO / "pipelines" / "tiny-llama-lora.yaml", folder)
    broken = yaml.safe_load((REPO / "pipelines" / "tiny-llama-lora.yaml").read_text())
    broken["name"] = "broken-one"
    broken["lora"]["rank"] = "zero"
    broken["training"]["steps"] = -1
    (folder / "broken-one.yaml").write_text(yaml.safe_dump(broken))
    result = parse(folder, tmp_path)
    assert result["dags"] == ["loraflow_registry", "tiny-llama-lora"]
    [message] = result["errors"].values()
    assert "broken-one.yaml" in message
    assert "lora.rank" in message and "training.steps" in message


def test_trigger_values_reach_the_resolved_spec() -> None:
    """What a task runs with: the DAG's spec with the run's trigger values (context["params"]) applied."""
    from loraflow.errors import SpecError
    from loraflow.spec.schema import trigger_fields, validate_spec
    from operators.stages import resolve_spec, run_spec

    data = yaml.safe_load((REPO / "pipelines" / "tiny-llama-lora.yaml").read_text())
    base = validate_spec(data, "tiny")
    params = {"training_steps": 37, "training_learning_rate": 0.0005, "lora_rank": 4, "gate_min_improvement": 0.05}
    resolved = resolve_spec(data, params)
    assert (resolved.training.steps, resolved.training.learning_rate) == (37, 0.0005)
    assert (resolved.lora.rank, resolved.gate.min_improvement) == (4, 0.05)
    expected = base.model_dump(mode="json")
    expected["training"] |= {"steps": 37, "learning_rate": 0.0005}
    expected["lora"]["rank"], expected["gate"]["min_improvement"] = 4, 0.05
    assert resolved.model_dump(mode="json") == expected  # the trigger values and nothing else
    # a task's context: Airflow passes every Param, at its default unless the trigger set it
    defaults = {name: field["default"] for name, field in trigger_fields(base).items()}
    assert run_spec(data, {"params": defaults}) == base
    assert run_spec(data, {"params": {**defaults, "training_steps": 37}}).training.steps == 37
    with pytest.raises(SpecError, match=r"lora\.rank"):
        resolve_spec(data, {"lora_rank": 0})
    # a spec that went bad after the DAG was parsed is reported under its pipeline's name
    with pytest.raises(SpecError, match=r"^pipeline tiny-llama-lora: 1 problem\(s\)"):
        resolve_spec({**data, "training": {**data["training"], "steps": -1}}, {})
