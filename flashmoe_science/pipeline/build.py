"""Build the extension: one compilation unit, compiled by torch's cpp_extension in a child process.

`python -m flashmoe_science build` and `nox -s build` call :func:`main`; the operator loader calls
:func:`ensure_built`. The CUDA build compiles exactly ``csrc/flashmoe_science.cu``, the CPU-only build
exactly ``csrc/flashmoe_science.cpp``; both pull in the headers beside them.

Why a child process: the parent reads the compiler's output line by line, so it can show short progress
lines, a heartbeat during long nvcc runs, the ptxas resource table, and, on failure, the compiler's
first error in a few lines instead of a Python traceback. The full output always lands in
``<build_dir>/build.log``.

Why the up-to-date check avoids torch: importing torch costs seconds, and `build` on an unchanged tree
must be instant. The torch and CUDA versions are read from torch's ``version.py`` file, GPUs are found
through the driver library, and the sources are hashed.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import ctypes
import dataclasses
import datetime
import fcntl
import hashlib
import importlib.util
import json
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from . import exitcodes
from .env import find_nvcc, find_toolkit_home, parse_nvcc_version
from .paths import CSRC_DIR, REPO_ROOT, build_root, report_dir, require_gpu_from_env

LIBRARY_NAME = "flashmoe_science_C"
CUDA_SOURCE = "flashmoe_science.cu"
CPU_SOURCE = "flashmoe_science.cpp"
HEARTBEAT_S = 15.0

# No -std flag: cpp_extension passes the standard this torch was built with (C++17 for torch 2.11,
# C++20 for 2.14). Forcing C++20 on torch 2.11 built a unit whose C++ exceptions (every input-check
# error) crashed the process with a segmentation fault on the H200 machine.
HOST_CFLAGS = ("-O3", "-fopenmp")
NVCC_FLAGS = (
    "-O3",
    "--use_fast_math",
    "-lineinfo",
    "--expt-relaxed-constexpr",
    "-Xptxas=-v",  # the resource table below is parsed from this output
    "-Xptxas=--warn-on-spills",
    "-Xcompiler=-fopenmp",
    # torch adds -D__CUDA_NO_HALF_OPERATORS__ and friends to every nvcc command; undo them so kernels
    # can use __half / __nv_bfloat16 arithmetic, as flash-attention's own build does.
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_HALF2_OPERATORS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
)
LDFLAGS = ("-fopenmp",)
CUDA_DEFINE = "FLASHMOE_WITH_CUDA"

CHILD_MARK = "FLASHMOE_BUILD_CHILD:"  # prefix of the child's own status lines in the log


class ConfigError(Exception):
    """The requested build cannot be configured on this machine (message says what is missing)."""

    def __init__(self, message: str, exit_code: int = exitcodes.ENV_BROKEN):
        super().__init__(message)
        self.exit_code = exit_code


class BuildError(Exception):
    """Compilation failed; the message is the compiler's first error, condensed, plus what to do next."""

    def __init__(
        self, message: str, log_path: Path | None = None, exit_code: int = exitcodes.BUILD_FAILED
    ):
        super().__init__(message)
        self.log_path = log_path
        self.exit_code = exit_code


# --------------------------------------------------------------------------------------------------
# Configuration: which unit, which targets, which directory
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CudaToolkit:
    nvcc: str | None = None
    home: str | None = None
    version: str | None = None  # "13.0"
    problem: str | None = None  # why it is unusable, in a few words


@dataclasses.dataclass(frozen=True)
class BuildConfig:
    backend: str  # "cuda" or "cpu"
    reason: str  # one line: why this backend
    arch_list: tuple[str, ...]  # ("8.9", "9.0"); empty for the CPU unit
    defines: tuple[str, ...]  # ("FLASHMOE_PLANT_BUG=2",)
    torch_version: str  # "2.14.1+cu130"
    torch_cuda: str | None  # torch's CUDA version, "13.0"
    toolkit: CudaToolkit
    sources_dir: Path = CSRC_DIR
    name: str = LIBRARY_NAME

    @property
    def source(self) -> Path:
        return self.sources_dir / (CUDA_SOURCE if self.backend == "cuda" else CPU_SOURCE)

    @property
    def key(self) -> str:
        return build_key(
            self.torch_version,
            self.torch_cuda if self.backend == "cuda" else None,
            self.arch_list,
            self.defines,
            self.name,
        )

    @property
    def build_dir(self) -> Path:
        return build_root() / self.key


@dataclasses.dataclass
class BuildResult:
    config: BuildConfig
    library: Path
    cold: bool  # True when this call compiled
    elapsed_s: float
    kernels: list[dict]
    log_path: Path
    record: dict


def resolve_config(
    backend: str = "auto",
    arch_list: str | Sequence[str] | None = None,
    defines: Sequence[str] = (),
    sources_dir: Path = CSRC_DIR,
    name: str = LIBRARY_NAME,
) -> BuildConfig:
    """Pick the unit and targets. auto builds CUDA when torch, nvcc and a target agree, else says why not."""
    if backend not in ("auto", "cuda", "cpu"):
        raise ConfigError(f"unknown backend {backend!r}: use auto, cuda or cpu", exitcodes.USAGE)
    torch_version, torch_cuda = torch_versions()
    defines = normalize_defines(defines)
    common = dict(
        defines=defines,
        torch_version=torch_version,
        torch_cuda=torch_cuda,
        sources_dir=Path(sources_dir),
        name=name,
    )
    if backend == "cpu":
        return BuildConfig("cpu", "backend=cpu requested", (), toolkit=CudaToolkit(), **common)

    toolkit = find_cuda_toolkit() if torch_cuda else CudaToolkit()
    problem = _cuda_problem(torch_version, torch_cuda, toolkit)
    archs, arch_source = _requested_archs(arch_list) if problem is None else ((), "")
    if problem is None and not archs:
        problem = "no GPU visible and TORCH_CUDA_ARCH_LIST unset"
    if problem is None:
        return BuildConfig("cuda", arch_source, archs, toolkit=toolkit, **common)
    if backend == "cuda":
        raise ConfigError(f"backend=cuda is impossible: {problem}. {_cuda_fix(problem)}")
    return BuildConfig(
        "cpu", f"{problem}: building the CPU-only unit", (), toolkit=toolkit, **common
    )


def _requested_archs(arch_list: str | Sequence[str] | None) -> tuple[tuple[str, ...], str]:
    """Targets in priority order: the argument, TORCH_CUDA_ARCH_LIST, then the visible GPUs."""
    if arch_list:
        text = arch_list if isinstance(arch_list, str) else ";".join(arch_list)
        return parse_arch_list(text), f"--arch {text}"
    env = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if env and env != "native":
        return parse_arch_list(env), f"TORCH_CUDA_ARCH_LIST={env}"
    gpus = visible_gpu_archs()
    return tuple(sorted(set(gpus), key=_arch_sort_key)), "visible GPU: " + ", ".join(
        arch_label(a) for a in gpus
    )


def _cuda_problem(torch_version: str, torch_cuda: str | None, toolkit: CudaToolkit) -> str | None:
    if not torch_cuda:
        return f"torch {torch_version} has no CUDA"
    if toolkit.problem:
        return toolkit.problem
    if _major(toolkit.version) != _major(torch_cuda):
        return f"nvcc {toolkit.version} ({toolkit.nvcc}) does not match torch's CUDA {torch_cuda}"
    return None


def _cuda_fix(problem: str) -> str:
    if problem.startswith("no GPU"):
        return "Pass --arch 9.0 (or set TORCH_CUDA_ARCH_LIST) to build without a GPU."
    if "nvcc" in problem or "CUDA_HOME" in problem:
        return "Install the CUDA toolkit whose major version matches torch's, and set CUDA_HOME."
    return "Install a CUDA build of torch, or build with --backend cpu."


def _major(version: str | None) -> str | None:
    return version.split(".")[0] if version else None


_ARCH_RE = re.compile(r"^(?:sm_?)?(\d+)\.?(\d)([af]?)(\+ptx)?$", re.IGNORECASE)


def parse_arch_list(text: str) -> tuple[str, ...]:
    """'8.9;9.0' / '90,89' / 'sm_90a 9.0+PTX' -> ('8.9', '9.0', ...), sorted and without repeats."""
    archs = set()
    for item in re.split(r"[;,\s]+", text.strip()):
        if not item:
            continue
        match = _ARCH_RE.match(item)
        if not match:
            raise ConfigError(
                f"bad CUDA arch {item!r} in {text!r}: write e.g. '8.9;9.0' or '9.0a'",
                exitcodes.USAGE,
            )
        major, minor, suffix, ptx = match.groups()
        archs.add(f"{int(major)}.{minor}{suffix.lower()}{'+PTX' if ptx else ''}")
    if not archs:
        raise ConfigError(f"empty CUDA arch list {text!r}", exitcodes.USAGE)
    return tuple(sorted(archs, key=_arch_sort_key))


def _arch_sort_key(arch: str) -> tuple[int, int, str]:
    major, rest = arch.split(".", 1)
    return int(major), int(rest[0]), rest[1:]


def arch_label(arch: str) -> str:
    """'9.0a' -> 'sm_90a', '9.0+PTX' -> 'sm_90+PTX' (how nvcc and people name it)."""
    return "sm_" + arch.replace(".", "")


def arch_tag(arch: str) -> str:
    """'9.0a' -> 'sm90a', '9.0+PTX' -> 'sm90ptx' (safe in a directory name)."""
    return "sm" + arch.replace(".", "").replace("+PTX", "ptx")


def normalize_defines(defines: Sequence[str]) -> tuple[str, ...]:
    """Accept 'NAME', 'NAME=VAL' or '-DNAME=VAL'; keep order, drop repeats."""
    seen: dict[str, None] = {}
    for define in defines:
        define = define[2:] if define.startswith("-D") else define
        if not re.match(r"^[A-Za-z_]\w*(=.*)?$", define):
            raise ConfigError(f"bad define {define!r}: write NAME or NAME=VALUE", exitcodes.USAGE)
        seen[define] = None
    return tuple(seen)


def build_key(
    torch_version: str,
    cuda: str | None,
    arch_list: Sequence[str],
    defines: Sequence[str] = (),
    name: str = LIBRARY_NAME,
) -> str:
    """'torch2.14.1-cu13.0-sm89_sm90' / 'torch2.14.1-cpu'; a different torch never reuses a build."""
    key = f"torch{torch_version.split('+')[0]}-"
    key += (f"cu{cuda}-" + "_".join(arch_tag(a) for a in arch_list)) if cuda else "cpu"
    if defines:
        key += "-d" + hashlib.sha256("\0".join(defines).encode()).hexdigest()[:8]
    if name != LIBRARY_NAME:
        key += f"-{name}"
    return key


# --------------------------------------------------------------------------------------------------
# Probing the machine without importing torch
# --------------------------------------------------------------------------------------------------


def torch_package_dir() -> Path:
    spec = importlib.util.find_spec("torch")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "torch is not installed: run scripts/setup_environment.sh (or pip install torch)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def torch_versions() -> tuple[str, str | None]:
    """(torch.__version__, torch.version.cuda), read from torch/version.py in a millisecond."""
    version_file = torch_package_dir() / "version.py"
    values: dict[str, object] = {}
    try:
        for node in ast.parse(version_file.read_text()).body:
            target = (
                node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
            )
            if isinstance(target, ast.Name) and getattr(node, "value", None) is not None:
                with contextlib.suppress(ValueError):
                    values[target.id] = ast.literal_eval(node.value)
    except (OSError, SyntaxError) as exc:
        raise ConfigError(f"torch looks broken: cannot read {version_file}: {exc}") from exc
    if not isinstance(values.get("__version__"), str):
        raise ConfigError(f"torch looks broken: no __version__ in {version_file}")
    cuda = values.get("cuda")
    return str(values["__version__"]), str(cuda) if cuda else None


def find_cuda_toolkit() -> CudaToolkit:
    """nvcc the way torch finds it (CUDA_HOME, then PATH, then /usr/local/cuda), plus its version.

    The lookup is env's (the environment check reports the same nvcc and toolkit this builds with)."""
    nvcc, home_set = find_nvcc()
    if nvcc is None:
        if home_set:
            return CudaToolkit(problem=f"CUDA_HOME={home_set} has no bin/nvcc")
        return CudaToolkit(problem="nvcc not found (CUDA_HOME unset, no nvcc on PATH)")
    # Without a toolkit beside it (no include/cuda_runtime.h), keep nvcc's grandparent: the
    # compile then names what is missing.
    home = (
        home_set or find_toolkit_home(nvcc, None, 60.0) or str(Path(nvcc).resolve().parent.parent)
    )
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return CudaToolkit(nvcc, home, problem=f"{nvcc} --version failed: {exc}")
    version = parse_nvcc_version(out)
    if version is None:
        return CudaToolkit(nvcc, home, problem=f"cannot read the version of {nvcc}")
    return CudaToolkit(nvcc, home, version)


def visible_gpu_archs() -> list[str]:
    """Compute capabilities of the GPUs this process may use, e.g. ['9.0'].

    Asks torch when it is already imported (the operator loader), else the driver library directly,
    which honours CUDA_VISIBLE_DEVICES like torch does and costs no torch import.
    """
    torch = sys.modules.get("torch")
    if torch is not None:
        if not torch.cuda.is_available():
            return []
        caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
        return [f"{major}.{minor}" for major, minor in sorted(caps)]
    return _driver_gpu_archs()


def _driver_gpu_archs() -> list[str]:
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return []
    count = ctypes.c_int()
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return []
    caps = set()
    for ordinal in range(count.value):
        device, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        if cuda.cuDeviceGet(ctypes.byref(device), ordinal) != 0:
            continue
        # 75 and 76: CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR / _MINOR
        cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, device)
        cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, device)
        caps.add((major.value, minor.value))
    return [f"{major}.{minor}" for major, minor in sorted(caps)]


# --------------------------------------------------------------------------------------------------
# Flags, hashing, staleness
# --------------------------------------------------------------------------------------------------


def compile_flags(config: BuildConfig) -> dict[str, list[str]]:
    """The flags handed to torch.utils.cpp_extension.load (parallelism excluded: it must not force
    a rebuild when MAX_JOBS changes)."""
    defines = [f"-D{d}" for d in config.defines]
    if config.backend == "cpu":
        return {
            "cflags": [*HOST_CFLAGS, *defines],
            "cuda_cflags": [],
            "ldflags": list(LDFLAGS),
            "include_paths": [str(config.sources_dir)],
        }
    includes, libs = _pip_nvidia_dirs()
    with_cuda = f"-D{CUDA_DEFINE}"
    return {
        "cflags": [*HOST_CFLAGS, with_cuda, *defines],
        "cuda_cflags": [*NVCC_FLAGS, with_cuda, *defines],
        "ldflags": [*LDFLAGS, *(f"-L{lib}" for lib in libs)],
        "include_paths": [str(config.sources_dir), *includes],
    }


def _pip_nvidia_dirs() -> tuple[list[str], list[str]]:
    """Headers and libraries of torch's own pip `nvidia-*` packages (cuBLAS, cuDNN, ... headers that
    torch's CUDA headers include and a bare toolkit may lack). Empty where they are absent."""
    nvidia = torch_package_dir().parent / "nvidia"
    includes = sorted(str(p) for p in nvidia.glob("*/include") if p.is_dir())
    libs = sorted(str(p) for p in nvidia.glob("*/lib") if p.is_dir())
    return includes, libs


def nvcc_threads(config: BuildConfig) -> int:
    """nvcc compiles the archs in parallel: one thread per arch (at least 2), never above MAX_JOBS."""
    threads = max(2, len(config.arch_list))
    max_jobs = os.environ.get("MAX_JOBS", "")
    return max(1, min(threads, int(max_jobs))) if max_jobs.isdigit() else threads


def source_hash(config: BuildConfig) -> str:
    """Every file under sources_dir (names and bytes) + flags + defines + key + toolkit version."""
    digest = hashlib.sha256()
    for path in sorted(_source_files(config.sources_dir)):
        digest.update(path.relative_to(config.sources_dir).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    signature = {
        "key": config.key,
        "backend": config.backend,
        "name": config.name,
        "defines": config.defines,
        "flags": compile_flags(config),
        "nvcc": config.toolkit.version if config.backend == "cuda" else None,
    }
    digest.update(json.dumps(signature, sort_keys=True).encode())
    return digest.hexdigest()


def _source_files(sources_dir: Path) -> Iterator[Path]:
    # dotfiles are editor swap files and the like: they must not force a rebuild
    for path in sources_dir.rglob("*"):
        if path.is_file() and not any(
            part.startswith(".") for part in path.relative_to(sources_dir).parts
        ):
            yield path


def library_path(config: BuildConfig) -> Path:
    """Where the built library lives (it may not exist yet, or be stale: see ensure_built)."""
    return config.build_dir / f"{config.name}.so"


def record_path(config: BuildConfig) -> Path:
    return config.build_dir / "build.json"


def read_record(config: BuildConfig) -> dict | None:
    try:
        return json.loads(record_path(config).read_text())
    except (OSError, ValueError):
        return None


def is_up_to_date(config: BuildConfig, digest: str | None = None) -> bool:
    record = read_record(config)
    return (
        record is not None
        and record.get("status") == "ok"
        and library_path(config).exists()
        and record.get("hash") == (digest or source_hash(config))
    )


# --------------------------------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------------------------------


def describe(config: BuildConfig) -> str:
    """The first line `build` prints: what it builds, for which targets, into which directory."""
    source = _display_path(config.source)
    torch_short = config.torch_version.split("+")[0]
    if config.backend == "cuda":
        targets = ", ".join(arch_label(a) for a in config.arch_list)
        what = f"CUDA unit {source} for {targets} (torch {torch_short}, CUDA {config.torch_cuda})"
    else:
        what = f"CPU-only unit {source} (torch {torch_short})"
    defines = f" with {' '.join('-D' + d for d in config.defines)}" if config.defines else ""
    return f"build: {what}{defines} -> {_display_path(config.build_dir)}"


def build(
    config: BuildConfig, force: bool = False, quiet: bool = False, heartbeat_s: float = HEARTBEAT_S
) -> BuildResult:
    """Compile the unit unless an identical build exists. Raises BuildError with the first error."""
    say = _printer(quiet)
    start = time.perf_counter()
    if not config.source.exists():
        raise BuildError(
            f"{_display_path(config.source)} does not exist\n"
            f"next: write it, or build the other backend (--backend cpu|cuda)",
            exit_code=exitcodes.BUILD_FAILED,
        )
    config.build_dir.mkdir(parents=True, exist_ok=True)
    with _build_lock(config.build_dir, say):
        # checked under the lock: another process may have just finished this very build
        digest = source_hash(config)
        if not force and is_up_to_date(config, digest):
            return _up_to_date_result(config, time.perf_counter() - start)
        return _compile(config, digest, start, say, heartbeat_s)


def ensure_built(
    backend: str = "auto",
    defines: Sequence[str] = (),
    sources_dir: Path = CSRC_DIR,
    name: str = LIBRARY_NAME,
) -> Path:
    """The library for this machine, built first if missing or stale (the operator loader's entry)."""
    config = resolve_config(backend, defines=defines, sources_dir=sources_dir, name=name)
    if is_up_to_date(config):
        return library_path(config)
    print(
        f"flashmoe_science: building the {config.backend.upper()} unit (first use or sources changed); "
        f"log: {_display_path(config.build_dir / 'build.log')}",
        file=sys.stderr,
        flush=True,
    )
    return build(config, quiet=True).library


def _up_to_date_result(config: BuildConfig, elapsed: float) -> BuildResult:
    record = read_record(config) or {}
    report = {**record, "cold": False, "elapsed_s": round(elapsed, 3), "timestamp": _now()}
    _write_report(report)
    return BuildResult(
        config,
        library_path(config),
        False,
        elapsed,
        record.get("kernels", []),
        config.build_dir / "build.log",
        report,
    )


def _compile(
    config: BuildConfig, digest: str, start: float, say: Callable[[str], None], heartbeat_s: float
) -> BuildResult:
    log_path = config.build_dir / "build.log"
    record_path(config).unlink(missing_ok=True)  # a half-finished build must never look up to date
    command, env = _child_command(config)
    say(
        f"  compiling {config.source.name} with {'nvcc' if config.backend == 'cuda' else 'c++'}"
        f" (MAX_JOBS={os.environ.get('MAX_JOBS', 'unset')})"
    )
    returncode, log_text = _run_streaming(
        command, env, log_path, config.source.name, say, heartbeat_s
    )
    elapsed = time.perf_counter() - start
    kernels = parse_ptxas(log_text) if config.backend == "cuda" else []
    record = _record(config, digest, elapsed, kernels, log_text, ok=returncode == 0)
    if returncode != 0 or not library_path(config).exists():
        message = condense_failure(log_text, log_path, returncode)
        record["error"] = message
        _write_json(record_path(config), record)
        _write_report(record)
        raise BuildError(message, log_path, _failure_exit_code(log_text))
    _write_json(record_path(config), record)
    _write_report(record)
    _print_resources(kernels, say)
    _print_spill_warnings(kernels)
    _print_warning_summary(log_text, say)
    say(f"  log: {_display_path(log_path)}")
    return BuildResult(config, library_path(config), True, elapsed, kernels, log_path, record)


def _record(
    config: BuildConfig, digest: str, elapsed: float, kernels: list[dict], log_text: str, ok: bool
) -> dict:
    """build.json: what the PR report and the next `build` read."""
    return {
        "status": "ok" if ok else "failed",
        "backend": config.backend,
        "reason": config.reason,
        "arch_list": list(config.arch_list),
        "defines": list(config.defines),
        "torch_version": config.torch_version,
        "cuda_version": config.torch_cuda if config.backend == "cuda" else None,
        "nvcc_version": config.toolkit.version if config.backend == "cuda" else None,
        "key": config.key,
        "source": _display_path(config.source),
        "so_path": str(library_path(config)),
        "elapsed_s": round(elapsed, 3),
        "compile_s": round(elapsed, 3),
        "cold": True,
        "timestamp": _now(),
        "hash": digest if ok else None,
        "compiler_warnings": len(compiler_warnings(log_text)),
        "kernels": kernels,
        "log": str(config.build_dir / "build.log"),
    }


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)  # atomic: a reader never sees half a file


def _write_report(record: dict) -> None:
    _write_json(report_dir() / "build.json", record)


@contextlib.contextmanager
def _build_lock(build_dir: Path, say: Callable[[str], None]) -> Iterator[None]:
    """One builder per directory (pytest-xdist workers, parallel nox sessions). flock is released
    by the kernel if the holder dies, so a killed build never leaves a stale lock behind."""
    with open(build_dir / "build.lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"  waiting for another process building {_display_path(build_dir)} ...")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _child_command(config: BuildConfig) -> tuple[list[str], dict[str, str]]:
    flags = compile_flags(config)
    if config.backend == "cuda":
        flags["cuda_cflags"] += ["--threads", str(nvcc_threads(config))]
    spec = {
        "name": config.name,
        "sources": [str(config.source)],
        "build_directory": str(config.build_dir),
        "with_cuda": config.backend == "cuda",
        **flags,
    }
    spec_path = config.build_dir / "child.json"
    _write_json(spec_path, spec)
    env = dict(os.environ)
    # the venv's bin holds ninja even when the venv is not activated
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    if config.backend == "cuda":
        env["TORCH_CUDA_ARCH_LIST"] = ";".join(config.arch_list)
        env["CUDA_HOME"] = config.toolkit.home or ""
    command = [sys.executable, "-m", "flashmoe_science.pipeline.build", "--child", str(spec_path)]
    return command, env


def _run_streaming(
    command: list[str],
    env: dict[str, str],
    log_path: Path,
    source_name: str,
    say: Callable[[str], None],
    heartbeat_s: float,
) -> tuple[int, str]:
    """Run the child, log every line, show ninja progress and a heartbeat. Returns (rc, full log)."""
    start = time.perf_counter()
    lines: list[str] = []
    with open(log_path, "w", encoding="utf-8") as log:
        log.write(f"$ {shlex.join(command)}\n")
        log.write(
            f"TORCH_CUDA_ARCH_LIST={env.get('TORCH_CUDA_ARCH_LIST', '')} "
            f"CUDA_HOME={env.get('CUDA_HOME', '')} MAX_JOBS={env.get('MAX_JOBS', '')}\n"
        )
        child = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO_ROOT,
            text=True,
            encoding="utf-8",
            errors="replace",
            bufsize=1,
            start_new_session=True,
        )
        try:
            last_shown = start
            for line in _lines_with_timeouts(child, min(1.0, heartbeat_s)):
                now = time.perf_counter()
                if line is not None:
                    log.write(line + "\n")
                    log.flush()
                    lines.append(line)
                    progress = ninja_progress(line)
                    if progress:
                        say(f"  {progress}  ({now - start:.1f} s)")
                        last_shown = now
                if now - last_shown >= heartbeat_s:
                    say(f"  still compiling {source_name} ... {now - start:.0f} s")
                    last_shown = now
        except BaseException:
            _kill_group(child)  # Ctrl-C: take nvcc/ninja down with the child
            raise
        returncode = child.wait()
    return returncode, "\n".join(lines)


def _lines_with_timeouts(child: subprocess.Popen, timeout: float) -> Iterator[str | None]:
    """The child's lines as they come; None every `timeout` seconds of silence (for the heartbeat)."""
    pending: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for raw in child.stdout:
            pending.put(raw.rstrip("\n"))
        pending.put(None)

    threading.Thread(target=pump, daemon=True).start()
    while True:
        try:
            line = pending.get(timeout=timeout)
        except queue.Empty:
            yield None
            continue
        if line is None:
            return
        yield line


def _kill_group(child: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(timeout=10)


def _printer(quiet: bool) -> Callable[[str], None]:
    if quiet:
        return lambda _message: None
    return lambda message: print(message, flush=True)


# --------------------------------------------------------------------------------------------------
# Reading the compiler's output
# --------------------------------------------------------------------------------------------------

_NINJA_RE = re.compile(r"^\[(\d+)/(\d+)\]\s+(.*)$")


def ninja_progress(line: str) -> str | None:
    """'[1/2] <2 KB nvcc command>' -> '[1/2] nvcc flashmoe_science.cu'; None for other lines."""
    match = _NINJA_RE.match(line)
    if not match:
        return None
    step, command = f"[{match.group(1)}/{match.group(2)}]", match.group(3)
    try:
        tokens = shlex.split(command)
    except ValueError:
        tokens = command.split()
    if not tokens:
        return step
    tool = os.path.basename(tokens[0])
    if "-c" in tokens[:-1]:
        return f"{step} {tool} {os.path.basename(tokens[tokens.index('-c') + 1])}"
    if "-shared" in tokens and "-o" in tokens[:-1]:
        return f"{step} link {os.path.basename(tokens[tokens.index('-o') + 1])}"
    return f"{step} {command[:80]}"


_ENTRY_RE = re.compile(r"ptxas info\s*: Compiling entry function '([^']+)' for '(\w+)'")
_PROPS_RE = re.compile(r"ptxas info\s*: Function properties for (\S+)")
_STACK_RE = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)
_USED_RE = re.compile(r"ptxas info\s*: Used (\d+) registers")
_SMEM_RE = re.compile(r"(\d+) bytes smem")


def parse_ptxas(text: str, demangle: Callable[[list[str]], list[str]] | None = None) -> list[dict]:
    """`-Xptxas=-v` output -> one dict per (kernel, arch): registers, smem, stack and spill bytes.

    ptxas prints, per entry function: 'Compiling entry function X for sm_NN', 'Function properties
    for X' + a stack/spill line, then 'Used N registers, ... M bytes smem'. Properties of non-entry
    device functions also appear; they are skipped by matching the name against the current entry.
    `demangle` maps mangled names to readable ones (default: c++filt when installed).
    """
    kernels: list[dict] = []
    current: dict | None = None
    properties_of: dict | None = None
    for line in text.splitlines():
        if match := _ENTRY_RE.search(line):
            current = {
                "kernel": match.group(1),
                "mangled": match.group(1),
                "arch": match.group(2),
                "registers": 0,
                "smem_bytes": 0,
                "stack_bytes": 0,
                "spill_stores": 0,
                "spill_loads": 0,
            }
            kernels.append(current)
            properties_of = None
        elif match := _PROPS_RE.search(line):
            properties_of = current if current and match.group(1) == current["mangled"] else None
        elif (match := _STACK_RE.search(line)) and properties_of is not None:
            stack, stores, loads = (int(g) for g in match.groups())
            properties_of.update(stack_bytes=stack, spill_stores=stores, spill_loads=loads)
            properties_of = None
        elif (match := _USED_RE.search(line)) and current is not None:
            current["registers"] = int(match.group(1))
            smem = _SMEM_RE.search(line)
            current["smem_bytes"] = int(smem.group(1)) if smem else 0
    names = (demangle or demangle_names)([k["mangled"] for k in kernels])
    for kernel, name in zip(kernels, names, strict=True):
        kernel["kernel"] = shorten_kernel_name(name)
    return kernels


def demangle_names(mangled: list[str]) -> list[str]:
    """Readable names through c++filt (or cu++filt), one call for all; unchanged when neither exists.

    c++filt first: kernels use the ordinary Itanium mangling, and cu++filt writes template arguments
    as 'heavy<(int)96>' where c++filt writes 'heavy<96>'.
    """
    tool = shutil.which("c++filt") or shutil.which("cu++filt")
    if not mangled or tool is None:
        return list(mangled)
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            [tool], input="\n".join(mangled) + "\n", capture_output=True, text=True, timeout=30
        ).stdout.splitlines()
        if len(out) == len(mangled):
            return out
    return list(mangled)


def shorten_kernel_name(name: str, width: int = 72) -> str:
    """'void ns::kern<ns::Traits<128, 64>, __half>(ns::Params)' -> 'kern<Traits<128, 64>, __half>'.

    Namespaces and the parameter list go (the template arguments are what tell instantiations of one
    kernel apart); what is still too long is cut to `width`.
    """
    name = name.replace("(anonymous namespace)::", "").strip()
    name = re.sub(r"^void\s+", "", name)
    if name.endswith(")"):
        depth = 0
        for index in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[index], 0)
            if depth == 0:
                name = name[:index]
                break
    name = re.sub(r"\b(?:\w+::)+", "", name)
    name = re.sub(r"\s+", " ", name).strip()
    return name if len(name) <= width else name[: width - 3] + "..."


def spilling(kernels: list[dict]) -> list[dict]:
    return [k for k in kernels if k["spill_stores"] or k["spill_loads"]]


def format_resource_table(kernels: list[dict]) -> list[str]:
    width = max([len("kernel"), *(len(k["kernel"]) for k in kernels)])
    # ptxas knows static shared memory only; dynamic (extern __shared__) smem is set at launch
    rows = [
        f"  {'kernel':<{width}}  {'arch':<7} {'regs':>5} {'static smem':>11} {'spills (st/ld B)':>17}"
    ]
    for k in kernels:
        spills = f"{k['spill_stores']}/{k['spill_loads']}"
        rows.append(
            f"  {k['kernel']:<{width}}  {k['arch']:<7} {k['registers']:>5} {k['smem_bytes']:>11} "
            f"{spills:>17}"
        )
    return rows


def _print_resources(kernels: list[dict], say: Callable[[str], None]) -> None:
    for row in format_resource_table(kernels) if kernels else []:
        say(row)


def _print_spill_warnings(kernels: list[dict]) -> None:
    # printed even with --quiet: a spill is a bug report, not a detail
    for k in spilling(kernels):
        print(
            f"WARNING: {k['kernel']} ({k['arch']}) spills registers: {k['spill_stores']} B stores, "
            f"{k['spill_loads']} B loads to local memory",
            flush=True,
        )


_WARNING_RE = re.compile(r"^\S.*?(?::\d+(?::\d+)?:|\(\d+\):)\s+warning\b")


def compiler_warnings(log_text: str) -> list[str]:
    return [line for line in log_text.splitlines() if _WARNING_RE.match(line)]


def _print_warning_summary(log_text: str, say: Callable[[str], None]) -> None:
    warnings = compiler_warnings(log_text)
    if warnings:
        say(f"  {len(warnings)} compiler warning(s); first: {_clip(_relative(warnings[0]), 160)}")


# nvcc: 'file.cu(12): error: ...' / 'catastrophic error'; gcc: 'file.cpp:3:5: error:' / 'fatal error:'
_COMPILE_ERROR_RE = re.compile(
    r"^(?P<file>[^\s\[].*?)(?::(?P<line>\d+)(?::\d+)?:|\((?P<nvline>\d+)\):)\s+"
    r"(?:fatal |catastrophic )?error\b"
)
_DIAGNOSTIC_RE = re.compile(
    r"^\S.*?(?::\d+(?::\d+)?:|\(\d+\):)\s+(?:\w+ )?(?:error|warning|note)\b"
)
_PTXAS_ERROR_RE = re.compile(r"^ptxas (?:error|fatal)\s*:")
_LINK_ERROR_RE = re.compile(
    r"undefined reference to|multiple definition of|cannot find -l|\bld(?:\.\w+)?: "
)
_GENERIC_ERROR_RE = re.compile(r"\berror\b", re.IGNORECASE)
_NOISE_RE = re.compile(r"^(\[\d+/\d+\]|FAILED:|ninja: |Traceback|  File )")


@dataclasses.dataclass
class FirstError:
    kind: str  # "compile", "ptxas", "link", "load", "environment" or "other"
    location: str | None  # "csrc/flashmoe_science.cu:12"
    lines: list[str]  # the error line and a few lines of context
    more: int = 0  # further compiler errors in the log


def extract_first_error(log_text: str) -> FirstError | None:
    """The compiler's first error and 2-3 lines of context, from a full nvcc/gcc/ld/ninja log."""
    lines = [
        line for line in log_text.splitlines() if len(line) < 1000
    ]  # skip ninja's command lines
    for index, line in enumerate(lines):
        if match := _COMPILE_ERROR_RE.match(line):
            location = (
                f"{_relative(match.group('file'))}:{match.group('line') or match.group('nvline')}"
            )
            more = sum(1 for other in lines[index + 1 :] if _COMPILE_ERROR_RE.match(other))
            return FirstError("compile", location, [line, *_context_after(lines, index)], more)
    for kind, pattern in (("ptxas", _PTXAS_ERROR_RE), ("link", _LINK_ERROR_RE)):
        for index, line in enumerate(lines):
            if pattern.search(line):
                return FirstError(kind, None, [line, *_context_after(lines, index)])
    child_errors = [
        line[len(CHILD_MARK) :].strip()
        for line in lines
        if line.startswith(CHILD_MARK) and "error" in line
    ]
    for line in lines:
        if (
            not line.startswith(CHILD_MARK)
            and not _NOISE_RE.match(line)
            and _GENERIC_ERROR_RE.search(line)
        ):
            return FirstError("other", None, [line])
    if child_errors:
        kind = (
            "load"
            if "undefined symbol" in child_errors[0] or "OSError" in child_errors[0]
            else "other"
        )
        if "ninja" in child_errors[0].lower() or "torch import failed" in child_errors[0]:
            kind = "environment"
        return FirstError(kind, None, [child_errors[0]])
    return None


def _context_after(lines: list[str], index: int, limit: int = 3) -> list[str]:
    """Source line, caret and 'detected during' lines; stops at a blank line or the next diagnostic."""
    context = []
    for line in lines[index + 1 : index + 1 + limit]:
        if (
            not line.strip()
            or _DIAGNOSTIC_RE.match(line)
            or _NOISE_RE.match(line)
            or _PTXAS_ERROR_RE.match(line)
            or line.startswith(CHILD_MARK)
        ):
            break
        context.append(line)
    return context


def condense_failure(log_text: str, log_path: Path, returncode: int = 1) -> str:
    """At most ~8 lines of error, then one line saying what to do next."""
    first = extract_first_error(log_text)
    log = _display_path(log_path)
    if first is None:
        cause = f"killed by signal {-returncode}" if returncode < 0 else f"exit status {returncode}"
        tail = [line for line in log_text.splitlines() if line.strip()][-3:]
        body = [f"the build stopped ({cause}) without a compiler error", *tail]
        hint = "next: a killed build is usually out of memory: retry with MAX_JOBS=1"
        return "\n".join([*(_clip(_relative(line)) for line in body), f"{hint}; full log: {log}"])
    body = [_clip(_relative(line)) for line in first.lines]
    if first.more:
        body.append(f"(+{first.more} more error{'s' if first.more > 1 else ''} in the log)")
    return "\n".join([*body, f"{_next_step(first)}; full log: {log}"])


def _next_step(first: FirstError) -> str:
    if first.kind == "compile":
        return f"next: fix {first.location}, then rerun `python -m flashmoe_science build`"
    if first.kind == "ptxas":
        return "next: a kernel exceeds a hardware limit for this arch (shared memory, registers): shrink its tile"
    if first.kind == "link":
        return "next: a symbol is missing or defined twice at link time: check declarations against definitions"
    if first.kind == "load":
        return "next: the library built but does not load: a declared function was never defined (or torch changed)"
    if first.kind == "environment":
        return (
            "next: fix the environment (pip install ninja; a working torch), then rerun the build"
        )
    return "next: read the full log"


def _failure_exit_code(log_text: str) -> int:
    first = extract_first_error(log_text)
    return (
        exitcodes.ENV_BROKEN
        if first is not None and first.kind == "environment"
        else exitcodes.BUILD_FAILED
    )


def _relative(text: str) -> str:
    return text.replace(f"{REPO_ROOT}{os.sep}", "")


def _clip(line: str, width: int = 200) -> str:
    return line if len(line) <= width else line[: width - 3] + "..."


def _display_path(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


# --------------------------------------------------------------------------------------------------
# The child: the only place that imports torch
# --------------------------------------------------------------------------------------------------


def _child_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    try:
        from torch.utils import cpp_extension
    except Exception as exc:  # any failure here means the environment, not the commit, is broken
        print(f"{CHILD_MARK} error: torch import failed: {type(exc).__name__}: {exc}", flush=True)
        return exitcodes.ENV_BROKEN
    try:
        library = cpp_extension.load(
            name=spec["name"],
            sources=spec["sources"],
            extra_cflags=spec["cflags"],
            extra_cuda_cflags=spec["cuda_cflags"],
            extra_ldflags=spec["ldflags"],
            extra_include_paths=spec["include_paths"],
            build_directory=spec["build_directory"],
            with_cuda=spec["with_cuda"],
            is_python_module=False,
            verbose=True,
        )
    except Exception as exc:
        import traceback

        traceback.print_exc()
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(f"{CHILD_MARK} error: {type(exc).__name__}: {first_line}", flush=True)
        return 1
    print(f"{CHILD_MARK} ok: built and loaded {library}", flush=True)
    return 0


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flashmoe_science build",
        description="Build the extension (one compilation unit) for this machine; a no-op when up to date.",
    )
    parser.add_argument(
        "--backend",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="auto: CUDA when torch, nvcc and a target (GPU or --arch) agree, else CPU-only",
    )
    parser.add_argument(
        "--arch",
        metavar="LIST",
        help="CUDA targets, e.g. '8.9;9.0' (default: TORCH_CUDA_ARCH_LIST, else the visible GPUs)",
    )
    parser.add_argument(
        "--define",
        metavar="NAME=VAL",
        action="append",
        default=[],
        help="extra -D define, repeatable (e.g. FLASHMOE_PLANT_BUG=2 for test variants)",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even when up to date")
    parser.add_argument("--quiet", action="store_true", help="no progress lines or resource table")
    parser.add_argument(
        "--sources-dir",
        type=Path,
        default=CSRC_DIR,
        help="directory holding the unit and its headers (default: csrc/)",
    )
    parser.add_argument(
        "--require-gpu",
        action="store_true",
        default=require_gpu_from_env(),
        help="build the CUDA unit or fail (default: FLASHMOE_REQUIRE_GPU=1)",
    )
    parser.add_argument("--child", metavar="SPEC", help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.child:
        return _child_main(args.child)
    start = time.perf_counter()
    if args.require_gpu and args.backend == "auto":
        args.backend = "cuda"
    try:
        config = resolve_config(args.backend, args.arch, args.define, sources_dir=args.sources_dir)
    except ConfigError as exc:
        print(f"build: {exc}", file=sys.stderr)
        return exc.exit_code
    print(describe(config), flush=True)
    if config.backend == "cpu" and args.backend == "auto":
        print(f"  {config.reason}", flush=True)
    try:
        result = build(config, force=args.force, quiet=args.quiet)
    except BuildError as exc:
        sys.stdout.flush()
        print(
            f"build: FAILED after {time.perf_counter() - start:.1f} s\n{exc}",
            file=sys.stderr,
            flush=True,
        )
        return exc.exit_code
    except ConfigError as exc:
        print(f"build: {exc}", file=sys.stderr)
        return exc.exit_code
    elapsed = time.perf_counter() - start
    print(
        f"build: done in {elapsed:.1f} s" if result.cold else f"build: up to date ({elapsed:.1f} s)"
    )
    return exitcodes.OK


if __name__ == "__main__":
    sys.exit(main())
