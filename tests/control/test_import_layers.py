"""loraflow's packages import one another in layers: no package reaches back to one that imports it.

The graph is read from the source (every ``import`` and ``from ... import`` in loraflow/, lazy ones and
``TYPE_CHECKING`` ones included: each is a dependency a reader has to follow), no module is executed.
A node is a package below loraflow (``loraflow.spec``) or a top-level module (``loraflow.errors``).
A cycle fails naming its packages in order and one import that makes each step.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "loraflow"

Graph = dict[str, dict[str, str]]  # package -> imported package -> "file:line" of one import that does it


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.AST, module: str, is_package: bool) -> Iterator[str]:
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
        if node.level == 0:
            yield node.module or ""
            return
        base = module.split(".")[: len(module.split(".")) - node.level + is_package]
        yield ".".join([*base, *([node.module] if node.module else [])])


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def import_graph(package: Path = PACKAGE) -> Graph:
    """Which loraflow package imports which, from the source of every module under ``package``."""
    graph: Graph = {}
    root = package.parent
    for path in sorted(package.rglob("*.py")):
        module = _module_name(path, root)
        source = _package(module)
        edges = graph.setdefault(source, {})
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _imported(node, module, path.name == "__init__.py"):
                if target.startswith("loraflow.") and _package(target) != source:
                    edges.setdefault(_package(target), f"{path.relative_to(root)}:{node.lineno}")
    return graph


def find_cycle(graph: Graph) -> list[str] | None:
    """One cycle of ``graph`` as its nodes in order (the first repeated at the end), or None."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        for target in sorted(graph.get(node, {})):
            cycle = visit(target, [*path, node])
            if cycle:
                return cycle
        done.add(node)
        return None

    return next((cycle for node in sorted(graph) if (cycle := visit(node, []))), None)


def describe(graph: Graph, cycle: list[str]) -> str:
    steps = [f"{a} -> {b} ({graph[a][b]})" for a, b in itertools.pairwise(cycle)]
    return "import cycle " + " -> ".join(cycle) + ":\n  " + "\n  ".join(steps)


def test_loraflows_packages_import_each_other_without_a_cycle() -> None:
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, describe(graph, cycle) + "\nmove the module that closes it to the layer it belongs to"


def test_the_layers_the_house_plan_names_hold() -> None:
    graph = import_graph()
    # The stage table and the data contract live in spec/: spec imports neither the planner nor storage's users.
    assert "loraflow.pipeline" not in graph["loraflow.spec"]
    # storage is the bottom layer every artifact reader shares: it knows only the errors module.
    assert set(graph["loraflow.storage"]) <= {"loraflow.errors"}


@pytest.mark.parametrize(
    ("edges", "expected"),
    [
        ({"a": {"b": "x"}, "b": {"c": "y"}, "c": {}}, None),
        ({"a": {"b": "x"}, "b": {"a": "y"}}, ["a", "b", "a"]),
        ({"a": {"b": "x"}, "b": {"c": "y"}, "c": {"b": "z"}}, ["b", "c", "b"]),
        ({"a": {"b": "x", "c": "w"}, "b": {}, "c": {"d": "y"}, "d": {"a": "z"}}, ["a", "c", "d", "a"]),
    ],
)
def test_a_cycle_is_found_and_named_in_order(edges: Graph, expected: list[str] | None) -> None:
    assert find_cycle(edges) == expected


def test_a_cycle_is_described_with_the_import_that_makes_each_step(tmp_path: Path) -> None:
    (tmp_path / "loraflow" / "one").mkdir(parents=True)
    (tmp_path / "loraflow" / "two").mkdir()
    (tmp_path / "loraflow" / "one" / "a.py").write_text("from loraflow.two import b\n")
    (tmp_path / "loraflow" / "two" / "b.py").write_text("\n\ndef f():\n    from ..one import a\n")
    graph = import_graph(tmp_path / "loraflow")
    cycle = find_cycle(graph)
    assert cycle == ["loraflow.one", "loraflow.two", "loraflow.one"]
    assert describe(graph, cycle) == (
        "import cycle loraflow.one -> loraflow.two -> loraflow.one:\n"
        "  loraflow.one -> loraflow.two (loraflow/one/a.py:1)\n"
        "  loraflow.two -> loraflow.one (loraflow/two/b.py:4)"
    )
