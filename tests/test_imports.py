"""Imports among the project's own top-level modules run one way: no module imports, directly or through
others, a module that imports it. Read from the source (ast), so an import inside a function or under
TYPE_CHECKING counts as much as one at the top."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

KNOWN_CYCLES: list[set[str]] = []  # none: any cycle fails the test


def import_graph() -> dict[str, set[str]]:
    """Each top-level .py module and the project modules it imports anywhere in its source."""
    modules = {path.stem for path in ROOT.glob("*.py")}
    graph = {}
    for path in ROOT.glob("*.py"):
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
        graph[path.stem] = (imported & modules) - {path.stem}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The groups of modules that reach each other through imports (strongly connected, two or more)."""
    reach = {}
    for start in graph:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        reach[start] = seen
    groups = {frozenset({m} | {o for o in reach[m] if m in reach[o]}) for m in graph if m in reach[m]}
    return [set(g) for g in groups]


def test_cycles_finds_a_cycle_and_leaves_a_chain_alone():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_imports_form_a_tree():
    found = [group for group in cycles(import_graph()) if group not in KNOWN_CYCLES]
    assert not found, f"modules that import each other: {found}"


def test_building_blocks_import_nothing_above_them():
    """fused.py imports none of the project's modules; layers.py only fused.py; ngpt.py only those two."""
    graph = import_graph()
    assert graph["fused"] == set()
    assert graph["layers"] == {"fused"}
    assert graph["ngpt"] <= {"fused", "layers"}
