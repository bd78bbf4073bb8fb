"""The package's import graph: no cycles (function-level imports count), and arrows that point down
the layers: the library never imports the pipeline, and a pipeline stage imports only stages that
come before it (pipeline/__init__.py says the order)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from flashmoe_science.pipeline.paths import REPO_ROOT

# Lowest first. `__main__` is the command line: it dispatches to the pipeline by design.
LAYERS = ("library", "shared", "env", "build", "gates", "bench", "tools", "ci", "report")
COMMAND_LINE = "flashmoe_science.__main__"


def import_graph(root: Path, package: str = "flashmoe_science") -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its body (a function's too)."""
    modules: dict[str, tuple[Path, bool]] = {}
    for path in (root / package).rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    graph = {}
    for name, (path, is_package) in modules.items():
        here = name if is_package else name.rsplit(".", 1)[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join([*parts, *([node.module] if node.module else [])])
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.add(full if full in modules else base)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) < 2 or parts[1] != "pipeline":
        return "library"
    if len(parts) >= 3 and (REPO_ROOT / "flashmoe_science" / "pipeline" / parts[2]).is_dir():
        return parts[2]
    return "shared"


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for module, targets in graph.items():
        if module == COMMAND_LINE:
            continue
        for target in targets:
            if LAYERS.index(layer(target)) > LAYERS.index(layer(module)):
                wrong.append(f"{module} ({layer(module)}) imports {target} ({layer(target)})")
    return sorted(wrong)


GRAPH = import_graph(REPO_ROOT)


def test_the_package_has_no_import_cycle():
    assert cycles(GRAPH) == []


def test_imports_point_down_the_layers():
    assert {layer(m) for m in GRAPH} == set(LAYERS)  # every stage is a layer, in a known order
    assert upward_imports(GRAPH) == []


@pytest.mark.parametrize("where", ["module", "function"])
def test_a_planted_cycle_is_found(tmp_path, where):
    package = tmp_path / "flashmoe_science"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from . import b\n")
    body = "from . import a\n" if where == "module" else "def f():\n    from .a import x\n"
    (package / "b.py").write_text(body)
    assert cycles(import_graph(tmp_path)) == [["flashmoe_science.a", "flashmoe_science.b"]]


def test_a_library_module_that_imports_the_pipeline_is_caught():
    graph = {**GRAPH, "flashmoe_science.ops": {"flashmoe_science.pipeline.gates.forward"}}
    assert upward_imports(graph) == [
        "flashmoe_science.ops (library) imports flashmoe_science.pipeline.gates.forward (gates)"
    ]
