"""Shared fixtures. The `gate` marker, `--gates-only` and reports/gates.json come from the package's
plugin (flashmoe_science/pipeline/gate_plugin.py), loaded here so plain `pytest` behaves as the
test stage does."""

from __future__ import annotations

import pytest
import torch

pytest_plugins = ("flashmoe_science.pipeline.gate_plugin",)


def cuda_build_loaded() -> bool:
    """True when a GPU is visible and the loaded extension has CUDA kernels."""
    if not torch.cuda.is_available():
        return False
    from flashmoe_science import ops

    ops.load_library()
    return torch._C._dispatch_has_kernel_for_dispatch_key("flashmoe_science::fwd", "CUDA")


@pytest.fixture(autouse=True)
def _hermetic_require_gpu(monkeypatch):
    # `nox -s test -- --require-gpu` exports FLASHMOE_REQUIRE_GPU=1 for the run; tests of env/build
    # decide for themselves whether they require a GPU.
    monkeypatch.delenv("FLASHMOE_REQUIRE_GPU", raising=False)


@pytest.fixture(autouse=True)
def _hermetic_reports(tmp_path_factory, monkeypatch):
    # A test that runs a pipeline command (build, bench, ...) writes and clears reports in a folder
    # of its own, never the report folder of the run that is testing (its build.json, stages.json
    # are that run's record). The gates.json of the run is written after the tests, outside them.
    monkeypatch.setenv("FLASHMOE_REPORT_DIR", str(tmp_path_factory.mktemp("reports")))


@pytest.fixture
def no_cuda_tools(tmp_path, monkeypatch):
    """Hides every place the toolkit lookup looks (PATH, CUDA_HOME, CUDA_PATH, the fallback
    install directories), so compute-sanitizer and ncu are found only where a test puts them."""
    from flashmoe_science import _toolkit

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(_toolkit, "FALLBACK_CUDA_HOMES", ())


@pytest.fixture(scope="session")
def has_cuda_kernels() -> bool:
    return cuda_build_loaded()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(
        reason="needs a CUDA GPU and the CUDA build (nox -s build on a GPU machine)"
    )
    if not torch.cuda.is_available():
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)
