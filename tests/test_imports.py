"""Imports among the project's own top-level modules run one way: no module imports, directly or through
others, a module that imports it. Read from the source (ast), so an import inside a function or under
TYPE_CHECKING counts as much as one at the top."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

KNOWN_CYCLES: list[set[str]] = []  # none: any cycle fails the test


def module_name(path: Path) -> str:
    return path.stem if path.parent == ROOT else f"{path.parent.name}.{path.stem}"


def import_graph() -> dict[str, set[str]]:
    """Each project module (the root's .py files and nanonorm/'s) and the project modules it imports anywhere in
    its source; `from nanonorm import guards` counts as importing nanonorm.guards."""
    paths = [*ROOT.glob("*.py"), *(ROOT / "nanonorm").glob("*.py")]
    modules = {module_name(path) for path in paths}
    graph = {}
    for path in paths:
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        graph[module_name(path)] = (imported & modules) - {module_name(path), "nanonorm.__init__"}
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


def test_the_model_imports_only_its_columns():
    """model.py is read alone: it imports nanonorm/columns.py, which imports nothing of the project."""
    graph = import_graph()
    assert graph["model"] == {"nanonorm.columns"}
    assert graph["nanonorm.columns"] == set()


def test_the_library_imports_no_command():
    """nanonorm/ holds what the commands import; it never imports a command a user runs."""
    commands = {"train", "sample", "sweep", "plot", "bench", "gpu_report"}
    graph = import_graph()
    assert {m: graph[m] & commands for m in graph if m.startswith("nanonorm.") and graph[m] & commands} == {}
