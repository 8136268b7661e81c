"""Every malformed spec in the corpus fails validation with one message naming the key and the fix;
the DAG folder still loads every valid spec beside them."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from loraflow.errors import SpecError
from loraflow.spec.schema import validate_spec

from .spec_corpus import CORPUS, apply

REPO = Path(__file__).resolve().parents[2]
TINY = yaml.safe_load((REPO / "pipelines" / "tiny-llama-lora.yaml").read_text())


def test_corpus_is_large_enough() -> None:
    assert len(CORPUS) >= 30


@pytest.mark.parametrize(("edits", "where", "says"), [c[1:] for c in CORPUS], ids=[c[0] for c in CORPUS])
def test_malformed_spec_is_refused_with_key_and_fix(edits, where: str, says: str) -> None:
    data = apply(copy.deepcopy(TINY), edits)
    with pytest.raises(SpecError) as err:
        validate_spec(data, "corpus.yaml")
    assert any(path == where and says in msg for path, msg in err.value.problems), err.value.problems


def test_all_problems_of_a_spec_come_in_one_message() -> None:
    data = copy.deepcopy(TINY)
    distinct = {}
    for ident, edits, where, _ in CORPUS:
        if where not in distinct and "." in where and not where.startswith(("(", "compute")):
            distinct[where] = ident
            apply(data, edits)
    with pytest.raises(SpecError) as err:
        validate_spec(data, "many.yaml")
    assert {path for path, _ in err.value.problems} >= set(distinct)
    assert len(distinct) >= 15


def test_the_whole_corpus_in_the_dag_folder_leaves_the_valid_dag_loading(tmp_path: Path) -> None:
    folder = tmp_path / "pipelines"
    folder.mkdir()
    (folder / "tiny-llama-lora.yaml").write_text((REPO / "pipelines" / "tiny-llama-lora.yaml").read_text())
    for ident, edits, _, _ in CORPUS:
        data = apply(copy.deepcopy(TINY), edits)
        if isinstance(data, dict) and "name" in data:
            data["name"] = ident if ident != "bad-name" else data["name"]
        (folder / f"{ident}.yaml").write_text(yaml.safe_dump(data))
    code = (
        "import json, os\nfrom airflow.dag_processing.dagbag import DagBag\n"
        "bag = DagBag(dag_folder=os.environ['DAGS'])\n"
        "print(json.dumps({'dags': sorted(bag.dag_ids), 'errors': list(bag.import_errors.values())}))"
    )
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(tmp_path / "af"),
        "LORAFLOW_PIPELINES_DIR": str(folder),
        "DAGS": str(REPO / "dags"),
    }
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["dags"] == ["loraflow_registry", "tiny-llama-lora"]
    [message] = result["errors"]
    for ident, *_ in CORPUS:
        assert f"{ident}.yaml" in message
