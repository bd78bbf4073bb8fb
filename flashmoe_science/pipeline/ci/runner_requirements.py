"""What a GPU runner needs for a given torch: `python -m flashmoe_science.pipeline.ci.runner_requirements`.

torch's CUDA build fixes two numbers a runner's owner must install: the NVIDIA driver (at least the
one released with that CUDA toolkit; an older driver of the same major runs it only through
minor-version compatibility, and rejects PTX newer than itself) and nvcc of the same major (torch's
cpp_extension refuses another major). docs/runners.md quotes these numbers and
scripts/runner/register.sh checks them before it registers a runner.

Options: ``--cuda X.Y`` (default: the CUDA of the torch this interpreter imports), ``--driver
VERSION`` and ``--nvcc VERSION`` (default: read from nvidia-smi and nvcc when found). Exit status:
0 when what is installed is new enough (or nothing was found to check), 255 when it is not, 2 for a
CUDA version not in the table.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from dataclasses import dataclass

from ..._toolkit import find_nvcc, parse_nvcc_version
from .. import exitcodes
from ..env.checks import parse_nvidia_smi, parse_version, run_tool

# NVIDIA's CUDA toolkit release notes, table "CUDA Toolkit and Corresponding Driver Versions"
# (Linux x86_64, the GA release of each toolkit): the driver a runner needs to run a torch built
# for that CUDA without relying on minor-version compatibility.
MIN_DRIVER = {
    (13, 0): "580.65.06",
    (12, 9): "575.51.03",
    (12, 8): "570.26",
    (12, 6): "560.28.03",
    (12, 5): "555.42.02",
    (12, 4): "550.54.14",
    (12, 3): "545.23.06",
    (12, 2): "535.54.03",
    (12, 1): "530.30.02",
    (12, 0): "525.60.13",
    (11, 8): "520.61.05",
}
# scripts/setup_environment.sh installs torch==2.14.1, the CUDA 13.0 build, where none is present;
# docs/runners.md's numbers are this CUDA's.
PROJECT_TORCH_CUDA = "13.0"


@dataclass(frozen=True)
class RunnerRequirements:
    cuda: str  # torch.version.cuda, "13.0"
    driver: str  # the minimum NVIDIA driver, "580.65.06"
    nvcc_major: int  # the CUDA toolkit major nvcc must have, 13

    @property
    def driver_branch(self) -> int:
        """The driver branch (R580): NVIDIA's packages are named by it (nvidia-driver-580)."""
        return int(self.driver.split(".")[0])

    def describe(self) -> str:
        return (
            f"torch for CUDA {self.cuda} needs an NVIDIA driver >= {self.driver} "
            f"(branch R{self.driver_branch} or newer) and nvcc {self.nvcc_major}.x "
            f"(CUDA toolkit {self.nvcc_major}.x)"
        )


def requirements_for(cuda: str) -> RunnerRequirements:
    """The driver and nvcc a runner needs for torch built for CUDA `cuda` ("13.0", "12.8.1")."""
    version = parse_version(cuda)
    known = ", ".join(f"{major}.{minor}" for major, minor in MIN_DRIVER)
    if version is None or version[:2] not in MIN_DRIVER:
        raise ValueError(
            f"cuda: no driver requirement known for CUDA {cuda!r}; known: {known} "
            "(add the row from NVIDIA's CUDA toolkit release notes to MIN_DRIVER)"
        )
    major, minor = version[:2]
    return RunnerRequirements(f"{major}.{minor}", MIN_DRIVER[(major, minor)], major)


def driver_ok(installed: str, needed: RunnerRequirements) -> bool:
    """Whether driver version `installed` ("580.95.05") is at least the one `needed` names."""
    have = tuple(int(part) for part in installed.split(".") if part.isdigit())
    want = tuple(int(part) for part in needed.driver.split("."))
    return bool(have) and have >= want


def nvcc_ok(installed: str, needed: RunnerRequirements) -> bool:
    """Whether nvcc release `installed` ("13.0") has the major torch's cpp_extension accepts."""
    version = parse_version(installed)
    return version is not None and version[0] == needed.nvcc_major


def _torch_cuda() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return torch.version.cuda


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flashmoe_science.pipeline.ci.runner_requirements",
        description="The NVIDIA driver and nvcc a GPU runner needs for torch's CUDA; checks them.",
    )
    parser.add_argument("--cuda", help="torch's CUDA version (default: this interpreter's torch)")
    parser.add_argument("--driver", help="the installed driver (default: from nvidia-smi)")
    parser.add_argument("--nvcc", help="the installed nvcc release (default: from nvcc --version)")
    args = parser.parse_args(argv)

    cuda = args.cuda or _torch_cuda()
    if not cuda:
        print(
            "runner requirements: this interpreter's torch is a CPU build (or missing), and no "
            "--cuda was given\n  fix: run with the interpreter that holds the CUDA torch, or pass "
            f"--cuda X.Y (the project's torch: --cuda {PROJECT_TORCH_CUDA})",
            file=sys.stderr,
        )
        return exitcodes.ENV_BROKEN
    try:
        needed = requirements_for(cuda)
    except ValueError as exc:
        print(f"runner requirements: {exc}", file=sys.stderr)
        return exitcodes.USAGE
    print(f"runner requirements: {needed.describe()}")

    driver = args.driver
    if driver is None and (smi := shutil.which("nvidia-smi")):
        run = run_tool([smi], timeout=10.0)
        driver = parse_nvidia_smi(run.out)[0] if run else None
    nvcc = args.nvcc
    if nvcc is None and (path := find_nvcc()[0]):
        run = run_tool([path, "--version"], timeout=10.0)
        nvcc = parse_nvcc_version(run.out) if run else None

    problems = 0
    if driver is None:
        print("  skip  driver: no nvidia-smi here")
    elif driver_ok(driver, needed):
        print(f"  ok    driver: {driver}")
    else:
        problems += 1
        print(
            f"  FAIL  driver: {driver} is older than {needed.driver}\n"
            f"        fix: install NVIDIA driver branch {needed.driver_branch} or newer "
            f"(e.g. nvidia-driver-{needed.driver_branch}-server), then reboot"
        )
    if nvcc is None:
        print("  skip  nvcc: not found (CUDA_HOME, PATH, /usr/local/cuda)")
    elif nvcc_ok(nvcc, needed):
        print(f"  ok    nvcc: {nvcc}")
    else:
        problems += 1
        print(
            f"  FAIL  nvcc: {nvcc}, but torch needs CUDA {needed.nvcc_major}.x\n"
            f"        fix: install the CUDA toolkit {needed.nvcc_major}.x (e.g. cuda-toolkit-"
            f"{needed.cuda.replace('.', '-')}) and point CUDA_HOME at it"
        )
    return exitcodes.ENV_BROKEN if problems else exitcodes.OK


if __name__ == "__main__":
    sys.exit(main())
