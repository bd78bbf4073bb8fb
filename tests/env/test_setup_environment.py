"""scripts/setup_environment.sh's choice of torch, where it has to install one: the CUDA build on a
machine with an NVIDIA GPU or with nvcc (CI compiles the CUDA unit without a GPU), the CPU build
from PyTorch's CPU index where it has neither, saying so and naming --cuda, which overrides.

The script runs up to its torch install, against a venv without torch whose `pip` is a stand-in that
prints its arguments and fails: nothing is downloaded, and the run stops there."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flashmoe_science.pipeline.paths import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "setup_environment.sh"
# What the script runs before it installs torch
TOOLS = ("bash", "env", "dirname", "basename", "sed", "ls", "cat", "rm", "mkdir")
FAKE_PIP = "import sys\nprint('pip-args:', *sys.argv[1:])\nsys.exit(3)\n"


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A venv without pip or torch, and a stand-in pip module for it (through PYTHONPATH)."""
    root = tmp_path_factory.mktemp("setup")
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(root / "venv")],
        check=True,
        capture_output=True,
    )
    (root / "fake" / "pip").mkdir(parents=True)
    (root / "fake" / "pip" / "__init__.py").write_text("")
    (root / "fake" / "pip" / "__main__.py").write_text(FAKE_PIP)
    return root


def run_setup(
    root: Path, tmp_path: Path, *args: str, tools=(), cuda_home=None, df=None, installs=True
) -> str:
    """The script's output, with PATH holding the basic tools, `tools` (stand-ins that exit 0) and,
    where `df` is given, a df that prints it (without one, the script skips its disk check)."""
    bindir = tmp_path / "bin"
    bindir.mkdir(parents=True)
    for name in TOOLS:
        (bindir / name).symlink_to(shutil.which(name))
    for name in tools:
        (bindir / name).write_text("#!/bin/sh\nexit 0\n")
        (bindir / name).chmod(0o755)
    if df is not None:
        (bindir / "df").write_text(f"#!/bin/sh\ncat <<'EOF'\n{df}EOF\n")
        (bindir / "df").chmod(0o755)
    env = {"PATH": str(bindir), "HOME": str(tmp_path), "PYTHONPATH": str(root / "fake")}
    if cuda_home:
        env["CUDA_HOME"] = str(cuda_home)
    python = str(root / "venv" / "bin" / "python")
    done = subprocess.run(
        [str(SCRIPT), "--venv", str(root / "venv"), "--python", python, "--no-hooks", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0  # the stand-in pip fails the install: the run stops there
    assert ("pip-args: install" in done.stdout) == installs, done.stdout + done.stderr
    return done.stdout + done.stderr


def pip_args(out: str) -> list[str]:
    return next(line for line in out.splitlines() if line.startswith("pip-args:")).split()[1:]


def test_no_gpu_and_no_nvcc_installs_the_cpu_build_and_says_how_to_override(venv, tmp_path):
    out = run_setup(venv, tmp_path)
    assert (
        "installing torch==2.13.0 (index https://download.pytorch.org/whl/cpu): a CPU build: this "
        "machine has no NVIDIA GPU (no nvidia-smi) and no nvcc; --cuda installs the CUDA build "
        "instead"
    ) in out
    assert pip_args(out) == [
        "install",
        "--index-url",
        "https://download.pytorch.org/whl/cpu",
        "torch==2.13.0",
    ]


@pytest.mark.parametrize(
    ("case", "tools", "args"),
    [
        ("a GPU", ("nvidia-smi",), ()),
        ("nvcc without a GPU (CI)", ("nvcc",), ()),
        ("--cuda", (), ("--cuda",)),
    ],
)
def test_a_gpu_or_nvcc_or_cuda_keeps_the_cuda_build(venv, tmp_path, case, tools, args):
    out = run_setup(venv, tmp_path, *args, tools=tools)
    assert pip_args(out) == ["install", "torch==2.14.1"], case
    assert "the CUDA 13.0 build, the default" in out and "a CPU build:" not in out


def test_nvcc_in_cuda_home_counts_as_nvcc(venv, tmp_path):
    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    (home / "bin" / "nvcc").write_text("#!/bin/sh\nexit 0\n")
    (home / "bin" / "nvcc").chmod(0o755)
    out = run_setup(venv, tmp_path, cuda_home=home)
    assert pip_args(out) == ["install", "torch==2.14.1"]


def test_a_given_index_wins_and_cpu_and_cuda_exclude_each_other(venv, tmp_path):
    out = run_setup(venv, tmp_path, "--cpu", "--torch-index-url", "https://example.invalid/cpu")
    assert pip_args(out) == [
        "install",
        "--extra-index-url",
        "https://example.invalid/cpu",
        "torch==2.13.0",
    ]
    done = subprocess.run(
        [str(SCRIPT), "--cpu", "--cuda"],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=60,
    )
    assert done.returncode == 2 and "--cpu and --cuda exclude each other" in done.stderr


def df_output(free_mib: int) -> str:
    return (
        "Filesystem     1024-blocks      Used Available Capacity Mounted on\n"
        f"/dev/vda         263174212  23000000 {free_mib * 1024} 22% /\n"
    )


def test_a_disk_too_small_for_torch_fails_before_pip_and_says_what_to_do(venv, tmp_path):
    """CI's install once died in pip with 'No space left on device' after 24 s, and the hint
    spoke of torch versions. The check fails first, names the free space, the need and the way out."""
    out = run_setup(venv, tmp_path / "cuda", tools=("nvcc",), df=df_output(287), installs=False)
    assert (
        "failed: 287 MiB free on the disk that holds "
        f"{venv / 'venv'}; torch==2.14.1 (the CUDA build) with the tools needs about 6500 MiB"
    ) in out
    assert (
        "next: free some on that disk, or pass --venv DIR on a disk with more, or pass --cpu" in out
    )
    # The CPU build needs less, and its way out does not offer --cpu again.
    out = run_setup(venv, tmp_path / "cpu", df=df_output(1000), installs=False)
    assert "torch==2.13.0 (the CPU build) with the tools needs about 1300 MiB" in out
    assert "--cpu" not in out.split("next:")[1]
    # Enough room: pip runs.
    run_setup(venv, tmp_path / "room", tools=("nvcc",), df=df_output(80_000))
