"""The package's import graph: no circles, and the algorithm apart from the CPU kernels.

Every import statement of eagle2/ and services/ counts, at module level or inside a function
(a lazy import still ties the two modules together), except those under `if TYPE_CHECKING:`.
Importing a submodule is an edge to that module, not to its parent packages.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("eagle2", "services")
# device-independent: they reach a device's kernels only through eagle2.backend / devices
ALGORITHM = ("eagle2.engine", "eagle2.tree", "eagle2.verify", "eagle2.drafter", "eagle2.budget",
             "eagle2.lookup", "eagle2.ngram", "eagle2.calibration", "eagle2.config")


def _modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            if "_generated" in path.parts:
                continue
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING",
                                                                 "typing.TYPE_CHECKING"):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_lines(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skip:
                continue
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    if full in modules:
                        edges.add(full)
                    elif base in modules:
                        edges.add(base)
        edges.discard(name)
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected component of more than one module (Tarjan), as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in graph.get(todo.pop(), ()):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


def test_the_cycle_finder_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert find_cycles(graph) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_lazy_and_relative_imports():
    graph = import_graph()
    assert "eagle2.cpu" in graph["eagle2.devices"]  # a lazy import inside a function
    assert "eagle2.bench.report" in graph["eagle2.bench.run"]  # `from .report import ...`
    assert "eagle2.cpu.fused" in graph["eagle2.cpu"]


def test_no_import_circles():
    assert find_cycles(import_graph()) == []


def test_the_algorithm_imports_no_cpu_kernels():
    graph = import_graph()
    for name in ALGORITHM:
        cpu = sorted(m for m in graph[name] if m == "eagle2.cpu" or m.startswith("eagle2.cpu."))
        assert cpu == [], f"{name} imports {cpu}: go through eagle2.backend / eagle2.devices"


def test_model_loading_does_not_import_the_cost_model():
    graph = import_graph()
    assert "eagle2.budget" not in reachable(graph, "eagle2.target")
