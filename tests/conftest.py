"""Shared fixtures. The `gate` marker, `--gates-only` and reports/gates.json come from the package's
plugin (flashmoe_science/pipeline/gates/plugin.py), loaded here so plain `pytest` behaves as the
test stage does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence

import pytest

from flashmoe_science import _loader as loader
from flashmoe_science.pipeline.gates import timelimit
from flashmoe_science.pipeline.paths import REPO_ROOT

# torch is imported where a hook or fixture needs it, not here: pytest-xdist's controller loads this
# file before it starts the workers and collects nothing, so an import here held every worker back
# by the 1.8 s it takes on 2 cores.

pytest_plugins = ("flashmoe_science.pipeline.gates.plugin",)


def cuda_build_loaded() -> bool:
    """True when a GPU is visible and the loaded extension has CUDA kernels."""
    import torch

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


class TritonProbeState:
    """torch.utils._triton.has_triton as this process first saw it, and whether its cached answer
    has been checked against a fresh one (see _leaves_tritons_probe_alone)."""

    def __init__(self) -> None:
        self.original = None
        self.checked = False


_TRITON_PROBE = TritonProbeState()


def triton_probe_left_wrong(modules=sys.modules, state: TritonProbeState = _TRITON_PROBE):
    """Why torch's Triton probe is now wrong for the rest of this process (repaired); None when it
    is right. Two ways a test can leave it wrong, each seen as a TritonMissing from a later
    torch.compile on a GPU in the same worker: (1) torch._inductor.scheduler was first imported
    while has_triton was patched, and bound the patch at its import; (2) has_triton caches its
    answer (functools.cache) and was first called while CUDA looked unavailable (a patched
    torch.cuda.is_available), so it holds False."""
    probe = modules.get("torch.utils._triton")
    if probe is None:
        return None
    if state.original is None:
        state.original = probe.has_triton
    original = state.original
    scheduler = modules.get("torch._inductor.scheduler")
    bound = getattr(scheduler, "has_triton", original)
    if bound is not original and probe.has_triton is original:
        scheduler.has_triton = original
        return (
            f"torch._inductor.scheduler.has_triton is {bound!r}: inductor was first imported while "
            "torch.utils._triton.has_triton was patched; patch the module's own seam instead"
        )
    info = getattr(original, "cache_info", None)
    if info is None or state.checked or not info().currsize:
        return None
    state.checked = True
    if not original() and original.__wrapped__():
        original.cache_clear()
        return (
            "torch.utils._triton.has_triton() was first called while CUDA looked unavailable and "
            "cached False; call it (or torch.compile) outside the patch"
        )
    return None


@pytest.fixture(autouse=True)
def _leaves_tritons_probe_alone():
    """A test that leaves torch's Triton probe wrong fails, named, instead of a later
    torch.compile on the same worker (test_opcheck_and_compile_of_forward_and_backward failed
    with TritonMissing in a GPU job on a host whose Triton worked: benches/notes/harness.md)."""
    yield
    why = triton_probe_left_wrong()
    if why:
        pytest.fail(f"this test left torch's Triton probe wrong for its worker: {why}")


@pytest.fixture(autouse=True)
def _hermetic_reports(tmp_path_factory, monkeypatch):
    # A test that runs a pipeline command (build, bench, ...) writes and clears reports in a folder
    # of its own, never the report folder of the run that is testing (its build.json, stages.json
    # are that run's record). The gates.json of the run is written after the tests, outside them.
    monkeypatch.setenv("FLASHMOE_REPORTS_DIR", str(tmp_path_factory.mktemp("reports")))
    monkeypatch.delenv("FLASHMOE_REPORT_DIR", raising=False)  # the earlier name, read as a fallback


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


@pytest.fixture
def require_cuda_build(has_cuda_kernels):
    """What a CUDA gate calls first: a GPU is visible (the `gpu` marker skips the test where none
    is), so a loaded build without CUDA kernels fails the gate rather than pass without running
    it; a forced tile configuration (forward or backward) this GPU or build cannot run skips,
    saying what it needs (ops.config_unsupported_reason, ops.backward_config_unsupported_reason),
    and so do head dims the CUDA kernels do not take (ops.head_dims_unsupported_reason: q's and
    k's `head_dim`, v's `head_dim_v`, 0 for the same), and a gate `case` whose kernels a
    restricted build left out (gates.kernels.outside_reason)."""

    def require(
        config: int = 0,
        backward_config: int = 0,
        head_dim: int = 64,
        head_dim_v: int = 0,
        case=None,
    ) -> None:
        if not has_cuda_kernels:
            pytest.fail(
                "a GPU is visible but the loaded build has no CUDA kernels: run `nox -s build`",
                pytrace=False,
            )
        import torch

        from flashmoe_science.ops import (
            backward_config_unsupported_reason,
            config_unsupported_reason,
            head_dims_unsupported_reason,
        )

        capability = torch.cuda.get_device_capability()
        reason = (
            head_dims_unsupported_reason(head_dim, head_dim_v or head_dim)
            or config_unsupported_reason(config, capability)
            or backward_config_unsupported_reason(backward_config, capability)
        )
        if not reason and case is not None:
            from flashmoe_science.pipeline.gates import kernels

            reason = kernels.outside_reason(case, loader.build_restriction())
        if reason:
            pytest.skip(reason)

    return require


@pytest.fixture
def record_gate(record_property):
    """A gate's result as its row of reports/gates.json (the result's figures, then op, dtype,
    head dim, "192v128" where v's differs, and the rerun fields), and the test failed with
    `failure()`'s report when the gate failed."""

    def record(case, result, op: str, reruns: dict, failure: Callable[[], str]) -> None:
        row = {
            **result.to_json(),
            "op": op,
            "dtype": case.dtype,
            "head_dim": f"{case.head_dim}v{case.head_dim_v}" if case.head_dim_v else case.head_dim,
            **reruns,
        }
        record_property("gate", row)
        if not result.passed:
            pytest.fail(failure(), pytrace=False)

    return record


def planted_process_env(
    bug: int,
    device: str,
    case_ids: Sequence[str] = (),
    defines: Sequence[str] = (),
    only: str | None = None,
) -> dict[str, str]:
    """The environment of a planted-bug process: its build carries bug `bug`, and the CPU device
    hides the GPU. Its working directory is the repository root. `defines`: more -D defines for
    its build (a kernel behind a switch; the plant build then serves bug 0 too) beside those of
    FLASHMOE_BUILD_DEFINES (loader.plant_defines: a stage under a switch plants into its kernels),
    `only`: the build restricted to these kernels (FLASHMOE_BUILD_ONLY's spelling).

    Every plant of a device runs on that device's one plant build (every plant compiled in, the bug
    picked at run time from FLASHMOE_PLANT_BUG): the CPU's small unit, built for the CPU even where
    a job's TORCH_CUDA_ARCH_LIST asks every build for CUDA, and on the cuda device the whole CUDA
    unit, compiled once for all of its plants rather than a restricted unit per plant (each paid
    the host side's compile again). `case_ids`: the cases the process runs (kept for callers).
    """
    env = dict(os.environ)
    env.pop("FLASHMOE_PLANT_BUG", None)
    env.pop(loader.ONLY_VAR, None)
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    if only:
        env[loader.ONLY_VAR] = only
    if not bug and not defines:  # the unplanted build the checkout has already (no second compile)
        return env
    if device == "cpu":
        env.pop("TORCH_CUDA_ARCH_LIST", None)
    env["FLASHMOE_BUILD_DEFINES"] = ",".join(loader.plant_defines(defines))
    env["FLASHMOE_PLANT_BUG"] = str(bug)
    return env


# A gate script's process ends once its verdict is printed, without the interpreter's finalization:
# on an H100 (torch 2.11), 2 to 3 of 20 such processes run five at a time aborted in it after
# printing a complete verdict ("terminate called without an active exception", no Python frame
# on the stack), with and without the bwd v7 switches (benches/notes/harness.md, v5.20; likely
# torch's autograd device thread at exit, pytorch/pytorch#38228). A script that raises never
# reaches this line, so its failure still shows.
PLANT_SCRIPT_EXIT = "\nimport os, sys\nsys.stdout.flush()\nsys.stderr.flush()\nos._exit(0)\n"
# ... and starts by taking the stage's time limit from its worker (timelimit.child_watch): at the
# limit it prints its stacks beside the worker's rather than ending unseen.
PLANT_SCRIPT_WATCH = (
    "from flashmoe_science.pipeline.gates.timelimit import watch_as_child\nwatch_as_child()\n"
)


@pytest.fixture
def run_planted():
    """Runs a gate script (`python -c SCRIPT DEVICE CASE_ID...`) in a process whose build carries
    planted bug `bug` (-DFLASHMOE_PLANT_BUG; one process holds one build) and, on the cuda device,
    only the kernels those cases run (planted_process_env), with the GPU hidden for the CPU device,
    and returns the JSON its last line prints, after checking the bug is in the build."""

    def run(
        bug: int,
        script: str,
        device: str,
        *case_ids: str,
        defines: Sequence[str] = (),
        only: str | None = None,
    ) -> dict:
        watch_env, watch_fds = timelimit.child_watch()  # a hang names the child's stack too
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                PLANT_SCRIPT_WATCH + script + PLANT_SCRIPT_EXIT,
                device,
                *case_ids,
            ],
            cwd=REPO_ROOT,
            env={**planted_process_env(bug, device, case_ids, defines, only), **watch_env},
            pass_fds=watch_fds,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        result = json.loads(done.stdout.strip().splitlines()[-1])
        assert result["planted"] == bug
        return result

    return run


@pytest.fixture
def check_plant_split(run_planted):
    """Runs a gate script with planted bug `bug` (run_planted) over `failing` and `passing` case
    ids: each failing case fails a gate and no passing one does (the bug is caught, and only where
    it can act). `name`, what the bug plants, goes into the failure message."""

    def check(
        bug: int,
        script: str,
        device: str,
        failing: Sequence[str],
        passing: Sequence[str],
        name: str = "",
        **kw,
    ) -> dict:
        results = run_planted(bug, script, device, *failing, *passing, **kw)["results"]
        assert sorted(results) == sorted((*failing, *passing))
        label = f"planted bug {bug}" + (f" ({name})" if name else "")
        for case_id in failing:
            assert results[case_id], f"{label} passed the gates on {case_id}"
        assert not any(results[case_id] for case_id in passing), {c: results[c] for c in passing}
        return results

    return check


def pytest_collection_modifyitems(config, items):
    import torch

    skip_gpu = pytest.mark.skip(
        reason="needs a CUDA GPU and the CUDA build (nox -s build on a GPU machine)"
    )
    if not torch.cuda.is_available():
        for item in items:
            # the marker, not the keyword: a parameter id "gpu" (a list of the GPU's cases checked
            # on any machine) is a keyword too
            if item.get_closest_marker("gpu"):
                item.add_marker(skip_gpu)
