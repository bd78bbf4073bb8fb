"""The package's import graph: no cycles (function-level imports count), and arrows that point down
the layers: the library never imports the pipeline, and a pipeline stage imports only stages that
come before it (pipeline/__init__.py says the order)."""

from __future__ import annotations

import pytest
from importgraph import cycles, import_graph

from flashmoe_science.pipeline.paths import REPO_ROOT

# Lowest first. `__main__` is the command line: it dispatches to the pipeline by design.
LAYERS = ("library", "shared", "env", "build", "gates", "bench", "tools", "ci", "report")
COMMAND_LINE = "flashmoe_science.__main__"


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


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    """The package's graph, built when a test asks (at import, it cost every collecting process
    0.8 s)."""
    return import_graph(REPO_ROOT)


def test_the_package_has_no_import_cycle(graph):
    assert cycles(graph) == []


def test_imports_point_down_the_layers(graph):
    assert {layer(m) for m in graph} == set(LAYERS)  # every stage is a layer, in a known order
    assert upward_imports(graph) == []


@pytest.mark.parametrize("where", ["module", "function"])
def test_a_planted_cycle_is_found(tmp_path, where):
    package = tmp_path / "flashmoe_science"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from . import b\n")
    body = "from . import a\n" if where == "module" else "def f():\n    from .a import x\n"
    (package / "b.py").write_text(body)
    assert cycles(import_graph(tmp_path)) == [["flashmoe_science.a", "flashmoe_science.b"]]


def test_a_library_module_that_imports_the_pipeline_is_caught(graph):
    graph = {**graph, "flashmoe_science.ops": {"flashmoe_science.pipeline.gates.forward"}}
    assert upward_imports(graph) == [
        "flashmoe_science.ops (library) imports flashmoe_science.pipeline.gates.forward (gates)"
    ]
