"""The package as users get it: the wheel and sdist carry the kernel sources, an installed copy
builds into the per-user cache and writes nothing into the current directory, its commands write
their reports where they run (never into site-packages), the library imports no pipeline module,
and one CUDA tool lookup serves the loader, env, sanitize and profile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from flashmoe_science import _loader as loader
from flashmoe_science import _toolkit
from flashmoe_science.pipeline import cli, exitcodes, paths
from flashmoe_science.pipeline.build import wheelcheck
from flashmoe_science.pipeline.env import checks as env
from flashmoe_science.pipeline.paths import REPO_ROOT
from flashmoe_science.pipeline.tools import profile, sanitize

UNITS_AND_HEADERS = sorted(
    p.name for p in (REPO_ROOT / "csrc").iterdir() if p.suffix in (".cpp", ".cu", ".h", ".cuh")
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return wheelcheck.build_wheel(tmp_path_factory.mktemp("wheel"))


def test_wheel_and_sdist_carry_the_kernel_sources(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert sorted(n.split("/")[-1] for n in names if n.startswith("flashmoe_science/csrc/")) == (
        UNITS_AND_HEADERS
    )
    assert not any(n.startswith("csrc/") for n in names)  # inside the package, not beside it
    assert "flashmoe_science/benches/bench.schema.json" in names  # an installed bench validates
    # every module of the package travels (a subpackage missing from pyproject's list would not)
    modules = sorted(
        p.relative_to(REPO_ROOT).as_posix()
        for p in (REPO_ROOT / "flashmoe_science").rglob("*.py")
        if "__pycache__" not in p.parts
    )
    assert sorted(n for n in names if n.endswith(".py")) == modules
    entry_points = zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    )
    # `flashmoe-science build` prebuilds the cache of an installed package, as `python -m` does
    assert b"flashmoe-science = flashmoe_science.__main__:main" in entry_points
    (sdist,) = wheel.parent.glob("*.tar.gz")
    with tarfile.open(sdist) as archive:
        members = archive.getnames()
    assert sorted(m.split("/")[-1] for m in members if "/csrc/" in m) == UNITS_AND_HEADERS


@pytest.mark.slow
@pytest.mark.long
def test_installed_wheel_works_outside_the_checkout_and_writes_nothing_there(wheel, tmp_path):
    """Long (17 CPU-s on 2 cores: it compiles the CPU unit from the wheel's sources), so it runs in
    the scheduled run; on every pull request cpu-ci.yml's CPU job runs the same check as a step
    (python -m flashmoe_science.pipeline.build.wheelcheck; test_the_cpu_job_checks_the_wheel)."""
    # wheelcheck raises CheckFailed when the calls fail, build again after the prebuild, write
    # into the (empty) current directory, or leave no library under FLASHMOE_CACHE_DIR
    summary = wheelcheck.check(wheel, tmp_path)
    assert summary["library"].endswith("-cpu/flashmoe_science_C.so")
    assert (
        summary["fwd_err"] <= wheelcheck.TOLERANCE and summary["decode_err"] <= wheelcheck.TOLERANCE
    )
    assert not (tmp_path / "cwd").exists() or not any((tmp_path / "cwd").iterdir())


def _files(root: Path) -> dict[str, int]:
    return {p.relative_to(root).as_posix(): p.stat().st_size for p in sorted(root.rglob("*"))}


def _checkout(folder: Path) -> Path:
    """A checkout of this project as paths.is_checkout knows one, with a subfolder to run in."""
    (folder / "notes").mkdir(parents=True)
    (folder / "noxfile.py").write_text("")
    (folder / "pyproject.toml").write_text('[project]\nname = "flashmoe-science"\n')
    return folder / "notes"


def test_the_check_venv_sees_the_wheels_dependencies_where_they_are_installed(
    tmp_path, monkeypatch
):
    """A GPU machine without a package index carries the tools as wheels to a folder on PYTHONPATH,
    apart from its torch: the check's venv (no PYTHONPATH, a user's environment) must still import
    jsonschema, which the bench needs, or `bench` from the installed wheel refuses to run."""
    elsewhere = tmp_path / "carried"
    for name in wheelcheck.SHARED_DEPENDENCIES:
        (elsewhere / name).mkdir(parents=True)
    real = wheelcheck._package_dir
    monkeypatch.setattr(
        wheelcheck,
        "_package_dir",
        lambda name: (
            str(elsewhere / name) if name in wheelcheck.SHARED_DEPENDENCIES else real(name)
        ),
    )
    python = wheelcheck.make_venv(tmp_path / "venv")
    (pth,) = (tmp_path / "venv").rglob("flashmoe_shared_packages.pth")
    assert str(elsewhere) in pth.read_text().splitlines()
    assert Path(python).exists()


@pytest.mark.slow
def test_a_read_only_install_writes_its_reports_where_it_runs(wheel, tmp_path):
    """`bench --quick` (one case) from a wheel installed into a site-packages made read only: its
    reports land in reports/ of the checkout it runs in, the library comes from the per-user cache
    (this checkout's build serves the installed sources: nothing compiles), and `report`, through
    the console script outside any checkout, writes into the folder --reports-dir names;
    site-packages stays as it was installed. ~7 CPU-s on 2 cores (a venv, an install, one torch
    import: `env` would add two more, and it finds its reports' folder as every command does)."""
    python = wheelcheck.make_venv(tmp_path / "venv")
    env = wheelcheck.user_env(tmp_path / "cache")
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps"]
    subprocess.run([*pip, "--no-index", str(wheel)], env=env, check=True, capture_output=True)
    where = (
        "import flashmoe_science, pathlib; print(pathlib.Path(flashmoe_science.__file__).parent)"
    )
    found = subprocess.check_output([str(python), "-c", where], cwd=tmp_path, env=env, text=True)
    package = Path(found.strip())
    config = loader.resolve_config("cpu")
    loader.ensure_built("cpu")
    assert loader.reuse_build(config, package / "csrc", tmp_path / "cache")
    site = package.parent
    installed = _files(site)
    for path in [site, *site.rglob("*")]:
        path.chmod(path.stat().st_mode & ~0o222)
    try:
        inside = _checkout(tmp_path / "checkout")

        def run(*args: str, cwd: Path, program: str = "-m flashmoe_science") -> str:
            command = [str(python), *program.split()] if program.startswith("-m") else [program]
            done = subprocess.run(
                [*command, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
            )
            assert done.returncode == 0, done.stdout + done.stderr
            return done.stdout

        bench = ["bench", "--quick", "--case", "fwd-fp16-d64-h1-b1-s128-full", "--no-baselines"]
        run(*bench, "--warmup-ms", "1", "--rep-ms", "5", cwd=inside)
        reports = tmp_path / "checkout" / "reports"
        assert {"bench.json", "bench.md", "stages.json"} <= {p.name for p in reports.iterdir()}
        elsewhere, named = tmp_path / "elsewhere", tmp_path / "named"
        elsewhere.mkdir()
        script = str(python.parent / cli.CONSOLE_SCRIPT)
        assert run("--help", cwd=elsewhere, program=script).startswith("usage: flashmoe-science ")
        # `report`, which imports no torch: the option is the command line's, not a command's
        run("report", "--reports-dir", str(named), cwd=elsewhere, program=script)
        assert (named / "report.md").is_file() and not any(elsewhere.iterdir())
        assert _files(site) == installed
    finally:
        for path in [site, *site.rglob("*")]:
            path.chmod(path.stat().st_mode | 0o200)


def test_reports_go_where_the_commands_run_never_into_the_package(tmp_path, monkeypatch):
    site = tmp_path / "site-packages"
    site.mkdir()
    monkeypatch.setattr(paths, "REPO_ROOT", site)  # as when installed
    for variable in (paths.REPORTS_VAR, paths.OLD_REPORTS_VAR):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.chdir(_checkout(tmp_path / "checkout"))
    assert paths.report_dir() == tmp_path / "checkout" / "reports"
    other = tmp_path / "other"  # another project's checkout is not this one's
    _checkout(other)
    (other / "pyproject.toml").write_text('[project]\nname = "flashmoe-science-notes"\n')
    monkeypatch.chdir(other / "notes")
    assert paths.report_dir() == other / "notes" / "reports"
    monkeypatch.setenv(paths.OLD_REPORTS_VAR, str(tmp_path / "old"))  # the earlier name still works
    assert paths.report_dir() == tmp_path / "old"
    monkeypatch.setenv(paths.REPORTS_VAR, str(tmp_path / "new"))
    assert paths.report_dir() == tmp_path / "new"
    assert not any(site.iterdir())
    monkeypatch.setattr(paths, "REPO_ROOT", REPO_ROOT)  # run from this checkout: its own reports/
    assert paths.checkout_root() == REPO_ROOT


def test_the_reports_dir_option_names_the_folder_for_the_command_and_what_it_starts(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv(paths.REPORTS_VAR, str(tmp_path / "default"))  # restored after the test
    for argv in (
        ["--reports-dir", str(tmp_path / "before"), "report"],
        ["report", f"--reports-dir={tmp_path / 'after'}"],
    ):
        assert cli.main(argv) == exitcodes.OK
    assert (tmp_path / "before" / "report.md").is_file()
    assert (tmp_path / "after" / "report.md").is_file()
    assert os.environ[paths.REPORTS_VAR] == str(tmp_path / "after")  # inherited by child processes
    assert not (tmp_path / "default").exists()
    assert cli.main(["report", "--reports-dir"]) == exitcodes.USAGE
    assert "--reports-dir needs a folder" in capsys.readouterr().err
    # options after `--` belong to pytest (the test command), not to us
    assert cli.take_reports_dir(["test", "--", "--reports-dir", "x"]) == (
        ["test", "--", "--reports-dir", "x"],
        None,
    )


def test_help_names_the_command_it_was_called_by(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["/venv/bin/flashmoe-science", "--help"])
    assert cli.main() == exitcodes.OK
    out = capsys.readouterr().out
    assert out.startswith("usage: flashmoe-science [--reports-dir DIR] COMMAND")
    assert "Run `flashmoe-science COMMAND --help`" in out and "python -m" not in out
    with pytest.raises(SystemExit):
        cli.main(["report", "--help"])
    assert capsys.readouterr().out.startswith("usage: flashmoe-science report")
    monkeypatch.setattr(sys, "argv", ["/x/flashmoe_science/__main__.py"])
    assert cli.usage().startswith("usage: python -m flashmoe_science ")


def test_wheelcheck_fails_a_wheel_without_the_sources(wheel, tmp_path):
    broken = tmp_path / wheel.name
    with zipfile.ZipFile(wheel) as good, zipfile.ZipFile(broken, "w") as bad:
        for item in good.infolist():
            if "/csrc/" not in item.filename:
                bad.writestr(item, good.read(item))
    with pytest.raises(wheelcheck.CheckFailed, match="lacks the kernel sources"):
        wheelcheck.check_contents(broken)


# --------------------------------------------------------------------------------------------------
# Where the loader looks and builds
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """The loader as it runs from an installed package: the sources inside the package."""
    sources = tmp_path / "site-packages" / "flashmoe_science" / "csrc"
    sources.mkdir(parents=True)
    monkeypatch.setattr(loader, "PACKAGED_SOURCES", sources)
    for variable in ("FLASHMOE_BUILD_ROOT", "FLASHMOE_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return sources


def test_cache_dir_follows_the_environment(installed, tmp_path, monkeypatch):
    assert loader.installed() and loader.default_sources_dir() == installed
    assert loader.build_root() == tmp_path / "home" / ".cache" / "flashmoe-science"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert loader.build_root() == tmp_path / "xdg" / "flashmoe-science"
    monkeypatch.setenv("FLASHMOE_CACHE_DIR", str(tmp_path / "mine"))
    assert loader.build_root() == tmp_path / "mine"
    monkeypatch.setenv("FLASHMOE_BUILD_ROOT", str(tmp_path / "root"))
    assert loader.build_root() == tmp_path / "root"
    assert loader.resolve_config("cpu").build_dir.parent == tmp_path / "root"


def test_a_checkout_builds_into_its_build_folder(monkeypatch):
    monkeypatch.delenv("FLASHMOE_BUILD_ROOT", raising=False)
    monkeypatch.setenv("FLASHMOE_CACHE_DIR", "/nowhere")  # read by installed packages only
    assert not loader.installed()
    assert loader.default_sources_dir() == REPO_ROOT / "csrc"
    assert loader.build_root() == REPO_ROOT / "build"


def test_a_missing_source_in_an_installed_package_says_reinstall(installed):
    config = loader.resolve_config("cpu")
    assert config.source == installed / "flashmoe_science.cpp"
    with pytest.raises(loader.BuildError) as excinfo:
        loader.build(config)
    message = str(excinfo.value)
    assert "installation of flashmoe-science is incomplete" in message
    assert "pip install --force-reinstall" in message.splitlines()[-1]
    assert "write it" not in message and excinfo.value.exit_code == exitcodes.ENV_BROKEN


def test_the_loader_uses_the_pipeline_exit_codes():
    assert (loader.USAGE, loader.BUILD_FAILED, loader.ENV_BROKEN) == (
        exitcodes.USAGE,
        exitcodes.BUILD_FAILED,
        exitcodes.ENV_BROKEN,
    )


def test_the_library_imports_no_pipeline_module():
    code = (
        "import sys, flashmoe_science.ops; "
        "print(sorted(m for m in sys.modules if m.startswith('flashmoe_science.pipeline')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_the_base_report_path_is_asked_for_not_spelled(tmp_path, monkeypatch):
    sha = "0123456789abcdef0123456789abcdef01234567"
    monkeypatch.setenv("FLASHMOE_BUILD_ROOT", str(tmp_path / "elsewhere"))
    out = subprocess.run(
        [sys.executable, "-m", "flashmoe_science.pipeline.paths", "base-report", sha],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    from flashmoe_science.pipeline import paths

    # where `bench --base` writes the base's reports, under the build root the variable names
    assert Path(out) == paths.base_dirs(REPO_ROOT, sha)[1] / "build.json"
    assert Path(out) == tmp_path / "elsewhere" / "worktrees" / f"{sha[:12]}.reports" / "build.json"
    workflow = (REPO_ROOT / ".github" / "workflows" / "gpu-ci.yml").read_text()
    assert "flashmoe_science.pipeline.paths base-report" in workflow
    assert "build/worktrees/" not in workflow


# --------------------------------------------------------------------------------------------------
# One CUDA tool lookup
# --------------------------------------------------------------------------------------------------


def _tool(path: Path, text: str = "#!/bin/sh\nexit 0\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


NVCC = "#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n"
SANITIZER = """#!/bin/sh
if [ "$1" = "--version" ]; then echo "Version 2025.3.1.0"; exit 0; fi
if [ "$1" = "--help" ]; then exit 0; fi
echo "$0" >> "$WHO_RAN"
"""


def test_one_lookup_order_for_env_build_sanitize_and_profile(
    tmp_path, no_cuda_tools, monkeypatch, capsys
):
    home, on_path = tmp_path / "cuda", tmp_path / "path"
    for where in (home / "bin", on_path):
        _tool(where / "nvcc", NVCC)
        _tool(where / "compute-sanitizer", SANITIZER)
        _tool(where / "ncu")
    (home / "include").mkdir()
    (home / "include" / "cuda_runtime.h").write_text("")
    monkeypatch.setenv("CUDA_HOME", str(home))
    monkeypatch.setenv("PATH", str(on_path))
    nvcc = str(home / "bin" / "nvcc")

    # the build
    assert loader.find_cuda_toolkit() == loader.CudaToolkit(nvcc, str(home), "13.0")
    # the environment check reports the same nvcc (its extension check, a fresh interpreter that
    # loads the library, has nothing to find here)
    skipped = env.Check("extension", "skip", "not loaded by this test")
    monkeypatch.setattr(env, "check_extension", lambda *args, **kwargs: skipped)
    (nvcc_check,) = [c for c in env.run_checks().checks if c.name == "nvcc"]
    assert nvcc in nvcc_check.detail
    # the profiler's ncu
    assert profile.find_cuda_tool("ncu", profile.NCU_GLOBS) == str(home / "bin" / "ncu")
    # the sanitizer runs the CUDA_HOME one
    monkeypatch.setenv("WHO_RAN", str(tmp_path / "who"))
    monkeypatch.setenv("FLASHMOE_REPORTS_DIR", str(tmp_path / "reports"))
    monkeypatch.setattr(sanitize, "_gpu_name", lambda: "NVIDIA H100 80GB HBM3")
    from flashmoe_science.pipeline.build import unit as build

    monkeypatch.setattr(build, "ensure_built", lambda backend, defines=(): Path("/b/x.so"))
    sanitize.main(["--tool", "memcheck"])
    assert (tmp_path / "who").read_text().split() == [str(home / "bin" / "compute-sanitizer")]
    doc = json.loads((tmp_path / "reports" / "sanitize.json").read_text())
    assert doc["tools"]["memcheck"]["command"].startswith(str(home / "bin" / "compute-sanitizer"))

    # without it in CUDA_HOME, PATH comes next, for every tool alike
    for name in ("nvcc", "compute-sanitizer", "ncu"):
        (home / "bin" / name).unlink()
    assert _toolkit.find_nvcc() == (str(on_path / "nvcc"), None)
    assert loader.find_cuda_toolkit().nvcc == str(on_path / "nvcc")
    assert sanitize.find_cuda_tool("compute-sanitizer") == str(on_path / "compute-sanitizer")
    assert profile.find_cuda_tool("ncu") == str(on_path / "ncu")
