"""Shared fixtures, and the plugin that writes every gate case's figures to reports/gates.json."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from flashmoe_science.pipeline import paths


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


_gate_rows: list[dict] = []


def pytest_runtest_logreport(report):
    # Runs on the controller too under pytest-xdist, with user_properties carried over.
    if report.when != "call":
        return
    for name, value in report.user_properties:
        if name == "gate":
            _gate_rows.append({**value, "outcome": report.outcome})


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("PYTEST_XDIST_WORKER") or not _gate_rows:
        return
    path = paths.report_dir() / "gates.json"
    failed = [r for r in _gate_rows if r["outcome"] != "passed"]
    worst = max(_gate_rows, key=lambda r: r.get("max_diff") or 0.0)
    doc = {
        "schema": "flashmoe-science/gates/1",
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "total": len(_gate_rows),
        "failed": len(failed),
        "worst_max_diff": worst.get("max_diff"),
        "worst_case": worst.get("case_id"),
        "worst_ratio": max((r.get("ratio") or 0.0) for r in _gate_rows),
        "cases": sorted(_gate_rows, key=lambda r: (r["outcome"] == "passed", r["case_id"])),
    }
    path.write_text(json.dumps(doc, indent=1))
