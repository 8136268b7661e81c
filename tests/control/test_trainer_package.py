"""The training program as a package (loraflow/trainer): type-checked like every step, and used through
its public names only, so a module can change its insides without breaking a test or a benchmark."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Modules whose private names stay private: the trainer package and the step program over it.
GUARDED = re.compile(r"^loraflow\.(trainer(\.\w+)?|steps\.lora_sft)$")


def _guarded_aliases(tree: ast.Module) -> tuple[set[str], list[str]]:
    """The names a module binds to guarded modules, and the private names it imports from them."""
    aliases: set[str] = set()
    private: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for name in node.names:
                if GUARDED.match(f"{node.module}.{name.name}"):
                    aliases.add(name.asname or name.name)
                elif GUARDED.match(node.module) and name.name.startswith("_") and name.name != "__version__":
                    private.append(f"from {node.module} import {name.name}")
        elif isinstance(node, ast.Import):
            aliases |= {name.asname for name in node.names if name.asname and GUARDED.match(name.name)}
    return aliases, private


def _private_uses(path: Path, root: Path = REPO) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    aliases, found = _guarded_aliases(tree)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr.startswith("_")
        ):
            found.append(f"{node.value.id}.{node.attr}")
    return [f"{path.relative_to(root)}:{use}" for use in found]


def test_nothing_outside_the_trainer_package_uses_its_private_names() -> None:
    outside = [
        path
        for folder in ("tests", "bench", "loraflow", "operators", "dags", "tools")
        for path in sorted((REPO / folder).rglob("*.py"))
        if "trainer" not in path.relative_to(REPO).parts[:2] and path.name != "lora_sft.py"
    ]
    assert len(outside) > 100
    assert [use for path in outside for use in _private_uses(path)] == []


def test_the_check_finds_a_private_use(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("from loraflow.steps import lora_sft\nfrom loraflow.trainer.data import _x\nlora_sft._run(1)\n")
    assert _private_uses(sample, tmp_path) == [
        "sample.py:from loraflow.trainer.data import _x",
        "sample.py:lora_sft._run",
    ]


def test_the_training_program_is_type_checked() -> None:
    mypy = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]
    assert "loraflow" in mypy["files"]
    program = [
        "loraflow/steps/lora_sft.py",
        *(str(p.relative_to(REPO)) for p in (REPO / "loraflow/trainer").glob("*.py")),
    ]
    excluded = [path for path in program for pattern in mypy.get("exclude", []) if re.search(pattern, path)]
    assert excluded == []
