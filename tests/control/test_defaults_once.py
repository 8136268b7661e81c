"""Each gate and scoring setting has one default: the spec schema's (loraflow/spec/schema.py).

Below the schema a value arrives from the resolved step config or from a recorded artifact, never from
a fallback of its own: a second default drifts (``gate_rule.decide`` promoted at 0.3 while the spec said
0.0; notices said 95% whatever ``gate.confidence`` was). Read as source, so a new fallback anywhere in
loraflow/ or operators/ fails here naming its file and line.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterator
from pathlib import Path

from loraflow.evaluation.metrics import Scoring
from loraflow.spec.schema import EvaluationSpec, GateSpec, GuardSpec

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = "loraflow/spec/schema.py"

#: The settings: the gate's and its guard's, and what scoring reads of the evaluation section (scoring.py
#: calls evaluation.answer_pattern ``pattern``).
SETTINGS = {*GateSpec.model_fields, *GuardSpec.model_fields, *(f.name for f in dataclasses.fields(Scoring)), "pattern"}
#: Defaults distinctive enough to ban as literals too; the others (0.0, 0.05, 0.1, 2000, "accuracy",
#: "pattern") are everyday values in unrelated code, and the checks by name below cover them.
DISTINCT = {GateSpec().confidence, EvaluationSpec().answer_pattern}


def _sources() -> Iterator[tuple[str, ast.AST]]:
    for folder in ("loraflow", "operators"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            name = path.relative_to(ROOT).as_posix()
            if name != SCHEMA:
                yield name, ast.parse(path.read_text(), name)


def _empty(node: ast.expr) -> bool:
    """``None``, ``{}``, ``[]``, ``()``, ``""``: "nothing recorded", not a value."""
    if isinstance(node, ast.Constant):
        return node.value is None or node.value == ""
    return (
        isinstance(node, (ast.Dict, ast.List, ast.Tuple))
        and not getattr(node, "keys", None)
        and not getattr(node, "elts", None)
    )


def _parameter_defaults(node: ast.AST) -> Iterator[tuple[str, ast.expr]]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        args = node.args
        positional = args.posonlyargs + args.args
        yield from zip((a.arg for a in positional[len(positional) - len(args.defaults) :]), args.defaults, strict=True)
        yield from ((a.arg, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None)


def _field_defaults(node: ast.AST) -> Iterator[tuple[str, ast.expr]]:
    if isinstance(node, ast.ClassDef):
        for statement in node.body:
            if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name) and statement.value:
                yield statement.target.id, statement.value


def _read_back_defaults(node: ast.AST) -> Iterator[tuple[str, ast.expr]]:
    """``x.get("min_improvement", 0)``: a recorded value read back with a value of its own."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        if len(node.args) == 2 and isinstance(node.args[0], ast.Constant) and not _empty(node.args[1]):
            yield str(node.args[0].value), node.args[1]


def test_no_gate_or_scoring_setting_has_a_default_below_the_schema() -> None:
    found = [
        f"{name}:{default.lineno}: {setting} = {ast.unparse(default)}"
        for name, tree in _sources()
        for node in ast.walk(tree)
        for kind in (_parameter_defaults, _field_defaults, _read_back_defaults)
        for setting, default in kind(node)
        if setting in SETTINGS
    ]
    assert not found, (
        "a gate or scoring setting with a default of its own below the spec schema (take it from the step's "
        "config or the recorded artifact instead):\n" + "\n".join(found)
    )


def test_the_distinctive_defaults_are_written_in_the_schema_only() -> None:
    found = [
        f"{name}:{node.lineno}: {node.value!r}"
        for name, tree in _sources()
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and not isinstance(node.value, bool) and node.value in DISTINCT
    ]
    assert not found, f"a default of {SCHEMA} written again (read it from the config):\n" + "\n".join(found)


def test_the_checks_see_a_second_default() -> None:
    """The scan itself: each kind of second default is found (a check that finds nothing proves nothing)."""
    tree = ast.parse(
        "def decide(*, min_improvement=0.3): ...\n"
        "class Scoring:\n    relative_tolerance: float = 0.1\n"
        "level = decision.get('confidence', 0.95)\n"
        "rows = cost.get('metrics', [])\n"
    )
    kinds = (_parameter_defaults, _field_defaults, _read_back_defaults)
    seen = {setting for node in ast.walk(tree) for kind in kinds for setting, _ in kind(node)}
    assert seen == {"min_improvement", "relative_tolerance", "confidence"}
