"""Each file a stage writes for others to read is named once: in the stage table (loraflow/spec/stages.py),
listed in its stage's row. A second spelling elsewhere would let a writer and its readers drift apart
(a renamed decision.json that publish still looks for under its old name), so the source is read and any
string that is such a name, or a path ending in one, outside the table fails naming where it is."""

from __future__ import annotations

import ast
from pathlib import Path

from loraflow.spec import stages

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "loraflow" / "spec" / "stages.py"
CODE = ["loraflow", "operators", "dags"]


def _declared() -> set[str]:
    return {name for stage in stages.STAGE_TABLE for name in stage.outputs}


def _docstrings(tree: ast.AST) -> set[int]:
    bodies = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, bodies) and node.body and isinstance(node.body[0], ast.Expr)
    }


def spellings(names: set[str], folders: list[Path]) -> list[str]:
    """``file:line: value`` of every string constant (docstrings aside) that is one of ``names`` or ends in
    ``/name``, in the Python files under ``folders``."""
    found = []
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            skip = _docstrings(tree)
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
                    if any(node.value == n or node.value.endswith("/" + n) for n in names):
                        found.append(f"{path.relative_to(folder.parent)}:{node.lineno}: {node.value}")
    return found


def test_every_output_name_is_spelled_only_in_the_stage_table() -> None:
    names = _declared()
    assert {"decision.json", "report.html", "predictions.jsonl", "metrics.json"} <= names
    elsewhere = [s for s in spellings(names, [ROOT / f for f in CODE]) if not s.startswith("loraflow/spec/stages.py")]
    assert elsewhere == []


def test_the_table_spells_each_name_once_and_the_rows_list_them() -> None:
    in_table = spellings(_declared(), [TABLE.parent])
    spelled = [s.split(": ", 1)[1] for s in in_table if s.startswith("spec/stages.py")]
    assert sorted(spelled) == sorted(_declared())  # one constant each, every one in some row
    assert stages.BY_NAME["gate"].outputs == (stages.DECISION,)
    assert stages.BY_NAME["report"].outputs == (stages.REPORT_HTML,)
    assert stages.BY_NAME["evaluate_base"].outputs == stages.BY_NAME["evaluate_tuned"].outputs


def test_a_second_spelling_is_found(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "m.py").write_text(
        '"""Writes decision.json (a docstring names it freely)."""\n'
        'A = "decision.json"\n'
        'B = "gs://b/run/report/report.html"\n'
        'C = "no decision.json here"\n'
    )
    assert spellings({"decision.json", "report.html"}, [package]) == [
        "pkg/m.py:2: decision.json",
        "pkg/m.py:3: gs://b/run/report/report.html",
    ]
