"""Environment checks: `python -m flashmoe_science env [--require-gpu] [--json PATH]`.

One small function per check, each returning a :class:`Check`. Probing (subprocesses, ctypes,
torch) is kept apart from judging: the ``check_*`` functions take what was probed as arguments, so
the tests can hand them a broken machine (an nvcc for the wrong CUDA, a NumPy 2 that torch cannot
talk to) without having one. Any failed check exits with ``exitcodes.ENV_BROKEN`` so that
`git bisect run` aborts instead of blaming a commit. torch is imported inside the checks, never at
module level: this module must be able to diagnose a machine whose torch is broken.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime as _dt
import io
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ... import _loader, _toolkit
from .. import exitcodes, gpukinds, load
from ..cli import program
from ..paths import build_root, report_dir, require_gpu_from_env
from ..provenance import clear_outputs, provenance

SCHEMA = "flashmoe-science/env/1"
STATUSES = ("ok", "warn", "fail", "skip")
BUDGET_S = 10.0  # the whole run, torch import included; every subprocess timeout is clamped to it
MIN_PYTHON = (3, 10)
MIN_TORCH = (2, 4)  # pyproject's `torch>=2.4` extra
MIN_FREE_GIB = 2.0  # a build of the extension with all its object files stays well under this
FAIL_FREE_GIB = 0.5
REBUILD_FIX = "rebuild it: nox -s build -- --force"
TORCH_WHEELS = "https://download.pytorch.org/whl"


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # one of STATUSES
    detail: str
    fix: str = ""  # one line: what the user should do; empty when there is nothing to do

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"Check status must be one of {STATUSES}, got {self.status!r}")


@dataclass(frozen=True)
class Gpu:
    name: str
    capability: str  # "9.0"
    sm_count: int
    memory_gib: float
    count: int = 1  # visible devices; the other fields describe device 0


@dataclass(frozen=True)
class GpuProbe:
    gpu: Gpu | None
    note: str = ""  # why there is no GPU, or what torch warned about while looking for one
    # torch complained (driver too old, GPU too old for this build): a GPU may be there, unusable.
    suspicious: bool = False


@dataclass(frozen=True)
class TorchProbe:
    module: Any  # the imported torch module, or None
    version: str | None = None
    cuda: str | None = None  # torch.version.cuda; None for a CPU build
    error: str = ""  # first line of the import error
    missing: bool = False  # torch is not installed at all (as opposed to installed but broken)
    numpy_messages: tuple[str, ...] = ()  # NumPy complaints raised while torch was imported


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    name: str
    used_mib: int | None  # None where nvidia-smi says [N/A] (common inside containers)


class Deadline:
    """The time left for the whole run; each subprocess gets at most what is left."""

    def __init__(self, budget_s: float = BUDGET_S) -> None:
        self.end = time.monotonic() + budget_s

    def timeout(self, cap_s: float) -> float:
        return max(0.2, min(cap_s, self.end - time.monotonic()))


@dataclass(frozen=True)
class ToolRun:
    rc: int | None  # None: timed out; negative: killed by that signal
    out: str  # stdout then stderr


# --- helpers


def first_line(text: object) -> str:
    for line in str(text).splitlines():
        if line.strip():
            return line.strip()
    return ""


def parse_version(text: str | None) -> tuple[int, ...] | None:
    """'2.14.1+cu130' -> (2, 14, 1); '13.0' -> (13, 0); None when no version is in the text."""
    match = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    return tuple(int(g) for g in match.groups() if g is not None) if match else None


def run_tool(cmd: list[str], timeout: float) -> ToolRun | None:
    """Run a command with a timeout; None when the program does not exist."""
    try:
        proc = subprocess.run(
            cmd,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout,
        )
    except (FileNotFoundError, PermissionError, NotADirectoryError):
        return None
    except subprocess.TimeoutExpired:
        return ToolRun(None, "")
    return ToolRun(proc.returncode, proc.stdout + proc.stderr)


def _cuda_wheel_index(cuda: str) -> str:
    major_minor = parse_version(cuda) or (0, 0)
    return f"{TORCH_WHEELS}/cu{major_minor[0]}{major_minor[1] if len(major_minor) > 1 else 0}"


def _gib(n_bytes: float) -> float:
    return round(n_bytes / 2**30, 1)


# --- python


def check_python(version_info: tuple[int, ...] = tuple(sys.version_info[:3])) -> Check:
    version = ".".join(str(v) for v in version_info[:3])
    if tuple(version_info[:2]) < MIN_PYTHON:
        need = ".".join(map(str, MIN_PYTHON))
        return Check("python", "fail", f"{version} is older than {need}", f"use Python >= {need}")
    return Check("python", "ok", f"{version} ({sys.executable})")


# --- torch


def _is_numpy_complaint(text: str) -> bool:
    lowered = text.lower()
    return "numpy" in lowered or "_array_api" in lowered


def probe_torch() -> TorchProbe:
    """Import torch, keeping what NumPy prints while torch initialises its bridge to it."""
    captured = io.StringIO()
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stderr(captured):
        warnings.simplefilter("always")
        try:
            import torch
        except Exception as exc:
            return TorchProbe(
                None,
                error=f"{type(exc).__name__}: {first_line(exc)}",
                missing=isinstance(exc, ModuleNotFoundError) and exc.name == "torch",
            )
    stderr_text = captured.getvalue()
    numpy_messages = [first_line(w.message) for w in caught if _is_numpy_complaint(str(w.message))]
    if _is_numpy_complaint(stderr_text):
        numpy_messages.insert(0, first_line(stderr_text))
    elif stderr_text:
        sys.stderr.write(stderr_text)  # not ours to swallow
    return TorchProbe(
        torch,
        version=str(torch.__version__),
        cuda=torch.version.cuda,
        numpy_messages=tuple(numpy_messages),
    )


def check_torch(probe: TorchProbe) -> Check:
    if probe.module is None:
        if probe.missing:
            fix = f"pip install torch --index-url {TORCH_WHEELS}/cu130 (or .../cpu: CPU backend)"
        else:
            fix = "pip install --force-reinstall torch (with the --index-url it came from)"
        return Check("torch", "fail", f"not importable: {probe.error}", fix)
    built_for = f"CUDA {probe.cuda}" if probe.cuda else "CPU build"
    version = parse_version(probe.version)
    if version is not None and version[:2] < MIN_TORCH:
        need = ".".join(map(str, MIN_TORCH))
        return Check(
            "torch",
            "fail",
            f"{probe.version} ({built_for}) is older than {need}",
            f"pip install 'torch>={need}'",
        )
    return Check("torch", "ok", f"{probe.version} ({built_for})")


# --- numpy

NUMPY_ABI_MARKERS = (
    "_ARRAY_API not found",
    "compiled using NumPy 1.x cannot be run in",
    "numpy.core.multiarray failed to import",
    "Numpy is not available",
    "Failed to initialize NumPy",
    "numpy.dtype size changed",
)


def exercise_numpy_bridge(torch: Any) -> str:
    """Round-trip a tensor through NumPy; returns NumPy's version, raises on failure or warning."""
    import numpy as np

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch reports a broken bridge as a UserWarning first
        from_numpy = torch.from_numpy(np.arange(3))
        to_numpy = torch.ones(2).numpy()
    if from_numpy.tolist() != [0, 1, 2] or to_numpy.tolist() != [1.0, 1.0]:
        raise RuntimeError("torch <-> NumPy round trip returned wrong values")
    return str(np.__version__)


def numpy_fix(error: str, numpy_version: str | None, torch_version: str | None) -> str:
    """The one-line fix for a failed NumPy check."""
    if "No module named 'numpy'" in error:
        return "pip install numpy"
    if any(marker.lower() in error.lower() for marker in NUMPY_ABI_MARKERS):
        numpy_major = (parse_version(numpy_version) or (2,))[0]
        if numpy_major >= 2:
            need = ".".join(map(str, MIN_TORCH))
            return f"pip install 'numpy<2' or upgrade torch to >= {need} (built against NumPy 2)"
        return "pip install --upgrade numpy (torch was built against a newer NumPy)"
    return "pip install --force-reinstall numpy"


def check_numpy(
    torch_probe: TorchProbe, bridge: Callable[[Any], str] = exercise_numpy_bridge
) -> Check:
    if torch_probe.module is None:
        return Check("numpy", "skip", "torch is not importable")
    numpy_version = None
    with contextlib.suppress(Exception):
        from importlib.metadata import version

        numpy_version = version("numpy")
    try:
        numpy_version = bridge(torch_probe.module)
    except Exception as exc:
        error = f"{type(exc).__name__}: {first_line(exc)}"
        if isinstance(exc, ImportError) and getattr(exc, "name", None) == "numpy":
            error = "ModuleNotFoundError: No module named 'numpy'"
        # What torch said at import names the cause better than a later "Numpy is not available".
        if torch_probe.numpy_messages:
            error = f"{torch_probe.numpy_messages[0]} (then {error})"
        shown = f"NumPy {numpy_version}: {error}" if numpy_version else error
        return Check("numpy", "fail", shown, numpy_fix(error, numpy_version, torch_probe.version))
    if torch_probe.numpy_messages:
        message = torch_probe.numpy_messages[0]
        return Check(
            "numpy",
            "warn",
            f"{numpy_version}: bridge works, but torch warned at import: {message}",
            numpy_fix(message, numpy_version, torch_probe.version),
        )
    return Check("numpy", "ok", f"{numpy_version} (torch <-> NumPy round trip works)")


# --- GPU


def probe_gpu(torch: Any) -> GpuProbe:
    if torch is None:
        return GpuProbe(None, "torch is not importable")
    if torch.version.cuda is None:
        return GpuProbe(None, "torch is a CPU build")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            available = torch.cuda.is_available()
            count = torch.cuda.device_count() if available else 0
            props = torch.cuda.get_device_properties(0) if count else None
        except Exception as exc:
            return GpuProbe(None, f"{type(exc).__name__}: {first_line(exc)}", suspicious=True)
    complaints = [first_line(w.message) for w in caught]
    if props is None:
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
        if complaints:
            return GpuProbe(None, complaints[0], suspicious=True)
        if hidden is not None and hidden.strip() in ("", "-1"):
            return GpuProbe(None, f"CUDA_VISIBLE_DEVICES={hidden!r} hides every GPU")
        return GpuProbe(None, "no CUDA device visible")
    gpu = Gpu(
        name=props.name,
        capability=f"{props.major}.{props.minor}",
        sm_count=props.multi_processor_count,
        memory_gib=_gib(props.total_memory),
        count=count,
    )
    return GpuProbe(gpu, complaints[0] if complaints else "", suspicious=bool(complaints))


def check_gpu_kind(gpu: Gpu | None, label: str | None) -> Check | None:
    """A GPU CI leg (gpukinds.KIND_VAR set) runs on the card its runner label promises: a
    mislabelled runner fails the leg instead of gating one card's kernels on another."""
    if not label:
        return None
    try:
        kind = gpukinds.kind_of(label)
    except ValueError as exc:
        return Check("gpu-kind", "fail", str(exc), f"set {gpukinds.KIND_VAR} to one of those")
    if gpu is None:
        return Check("gpu-kind", "skip", f"no GPU to check against {kind.card} ({kind.sm})")
    problem = kind.device_problem(gpu.name, gpu.capability)
    if problem:
        fix = f"label this runner with its own card's kind, or run the {kind.label} leg on an {kind.card}"
        return Check("gpu-kind", "fail", f"{problem}: this runner is labelled {kind.label}", fix)
    return Check("gpu-kind", "ok", f"{gpu.name} is the {kind.label} leg's {kind.card} ({kind.sm})")


def check_gpu(probe: GpuProbe, require_gpu: bool, torch_cuda: str | None) -> Check:
    gpu = probe.gpu
    if gpu is not None:
        sm = gpu.capability.replace(".", "")
        detail = f"{gpu.name}, sm_{sm}, {gpu.sm_count} SMs, {gpu.memory_gib} GiB"
        if gpu.count > 1:
            detail += f" (device 0 of {gpu.count})"
        if probe.suspicious:
            return Check(
                "gpu",
                "warn",
                f"{detail}; torch warned: {probe.note}",
                f"use a torch build for sm_{sm} (torch.cuda.get_arch_list() lists this one's)",
            )
        return Check("gpu", "ok", detail)
    if torch_cuda is None and probe.note == "torch is a CPU build":
        fix = f"install a CUDA build of torch: pip install torch --index-url {TORCH_WHEELS}/cu130"
    elif probe.suspicious:
        fix = "check the driver with `nvidia-smi` (see the driver check) and CUDA_VISIBLE_DEVICES"
    else:
        fix = "run on a machine with an NVIDIA GPU (check `nvidia-smi` and CUDA_VISIBLE_DEVICES)"
    if require_gpu:
        return Check("gpu", "fail", f"none ({probe.note}) but --require-gpu was given", fix)
    detail = f"none ({probe.note}): the CPU backend will be used"
    if probe.suspicious:  # something that looks like a GPU is there but torch cannot use it
        return Check("gpu", "warn", detail, fix)
    return Check("gpu", "ok", detail)


# --- driver

SMI_CUDA_RE = re.compile(r"CUDA Version:\s*(\d+\.\d+)")
SMI_DRIVER_RE = re.compile(r"Driver Version:\s*([\d.]+)")


def driver_cuda_from_libcuda() -> str | None:
    """The CUDA version the installed driver supports, from cuDriverGetVersion (no GPU needed)."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int(0)
        if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return f"{version.value // 1000}.{version.value % 1000 // 10}"


def parse_nvidia_smi(text: str) -> tuple[str | None, str | None]:
    """(driver version, CUDA version) from the header of plain `nvidia-smi` output."""
    driver = SMI_DRIVER_RE.search(text)
    cuda = SMI_CUDA_RE.search(text)
    return (driver.group(1) if driver else None, cuda.group(1) if cuda else None)


def check_driver(
    driver_cuda: str | None, driver_version: str | None, torch_cuda: str | None, driver_found: bool
) -> Check:
    if torch_cuda is None:
        return Check("driver", "skip", "torch is a CPU build")
    if not driver_found:
        return Check("driver", "skip", "no NVIDIA driver (no libcuda.so.1, no nvidia-smi)")
    named = f"{driver_version} " if driver_version else ""
    have, need = parse_version(driver_cuda), parse_version(torch_cuda)
    if have is None or need is None:
        return Check(
            "driver",
            "warn",
            f"{named}found, but the CUDA version it supports could not be read",
            "run `nvidia-smi` and compare its 'CUDA Version' with torch.version.cuda",
        )
    detail = f"{named}supports CUDA {driver_cuda}; torch needs {torch_cuda}"
    update = f"update the NVIDIA driver to one for CUDA >= {torch_cuda}"
    if have[0] < need[0]:
        return Check(
            "driver",
            "fail",
            detail,
            f"{update}, or install torch for CUDA {have[0]}.x ({_cuda_wheel_index(driver_cuda)})",
        )
    if (
        have[:2] < need[:2]
    ):  # minor-version compatibility runs it, but PTX newer than the driver won't JIT
        return Check("driver", "warn", detail + " (minor-version compatibility)", update)
    return Check("driver", "ok", detail)


# --- nvcc (found by flashmoe_science._toolkit, the lookup the build and the CUDA tools share)


def check_nvcc(
    nvcc_path: str | None,
    nvcc_version: str | None,
    torch_cuda: str | None,
    gpu_present: bool,
    require_gpu: bool,
    *,
    toolkit_home: str | None = None,
    headers_found: bool = True,
) -> Check:
    toolkit = f"CUDA {torch_cuda}" if torch_cuda else "CUDA"
    install = f"install the {toolkit} toolkit and set CUDA_HOME (or put its bin/ on PATH)"
    # A broken toolkit only matters where CUDA will be built.
    wants_cuda = gpu_present or require_gpu
    if nvcc_path is None:
        where = f"CUDA_HOME={toolkit_home} has no bin/nvcc" if toolkit_home else "not found"
        if require_gpu:
            return Check(
                "nvcc", "fail", f"{where}, and --require-gpu needs the CUDA backend", install
            )
        why = "the CUDA backend cannot be built" if gpu_present else "no GPU"
        return Check("nvcc", "warn", f"{where} ({why}): the CPU build will be used", install)
    if nvcc_version is None:
        status = "fail" if require_gpu else "warn"
        return Check(
            "nvcc", status, f"{nvcc_path}: could not read its version", f"run {nvcc_path} --version"
        )
    if torch_cuda is None:
        return Check("nvcc", "ok", f"{nvcc_version} ({nvcc_path}); unused: torch is a CPU build")
    have, need = parse_version(nvcc_version), parse_version(torch_cuda)
    if have and need and have[0] != need[0]:
        return Check(
            "nvcc",
            "fail",
            f"{nvcc_version} but torch was built for CUDA {torch_cuda} ({nvcc_path})",
            f"point CUDA_HOME at a CUDA {need[0]}.x toolkit, or install torch for CUDA "
            f"{nvcc_version}: pip install torch --index-url {_cuda_wheel_index(nvcc_version)}",
        )
    if not headers_found:
        # cpp_extension takes include/ and lib64/ from CUDA_HOME: without cuda_runtime.h no build.
        where = toolkit_home or str(Path(nvcc_path).parent.parent)
        return Check(
            "nvcc",
            "fail" if wants_cuda else "warn",
            f"{nvcc_version} ({nvcc_path}), but {where} has no include/cuda_runtime.h",
            "set CUDA_HOME to the CUDA toolkit directory (the one with include/cuda_runtime.h)",
        )
    detail = f"{nvcc_version} ({nvcc_path})"
    if toolkit_home and Path(toolkit_home) != Path(nvcc_path).parent.parent:
        detail = f"{nvcc_version} ({nvcc_path} -> toolkit {toolkit_home})"
    if have and need and have[:2] != need[:2]:  # torch itself only warns about a minor mismatch
        detail += f"; torch: CUDA {torch_cuda}, same major"
    return Check("nvcc", "ok", detail)


# --- build tools


def check_ninja(ninja_path: str | None, version: str | None, beside_python: str | None) -> Check:
    """torch's cpp_extension runs `ninja --version` from PATH, so that is the ninja that counts."""
    if ninja_path is None:
        if beside_python:
            return Check(
                "ninja",
                "warn",
                f"not on PATH; only at {beside_python} (torch looks on PATH)",
                f"activate the virtual environment, or add {Path(beside_python).parent} to PATH",
            )
        return Check(
            "ninja", "fail", "not found (torch's cpp_extension needs it)", "pip install ninja"
        )
    if version is None:
        return Check(
            "ninja", "fail", f"{ninja_path} --version failed", "pip install --force-reinstall ninja"
        )
    return Check("ninja", "ok", f"{version} ({ninja_path})")


def check_compiler(cxx: str, cxx_path: str | None, version_line: str | None) -> Check:
    if cxx_path is None:
        return Check(
            "c++",
            "fail",
            f"{cxx} not found (torch's cpp_extension needs a host compiler)",
            "install one (apt-get install g++) or set CXX to its path",
        )
    if version_line is None:
        return Check(
            "c++", "fail", f"{cxx_path} --version failed", "reinstall the compiler or set CXX"
        )
    return Check("c++", "ok", f"{version_line} ({cxx_path})")


def check_disk(path: Path, free_bytes: int | None = None) -> Check:
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if free_bytes is None:
        free_bytes = shutil.disk_usage(existing).free
    free = _gib(free_bytes)
    detail = f"{free} GiB free at {path}"
    fix = "free some space, or set FLASHMOE_BUILD_ROOT to a directory on a larger disk"
    kept = _loader.kept_builds_bytes(path)
    if kept:
        # builds of earlier sources, kept so that a bisect or a branch switch need not compile
        where = path / f"*{_loader.PREVIOUS_SUFFIX}"
        detail += f"; builds of earlier sources kept there: {kept / 2**20:.0f} MiB ({where})"
        fix = f"delete {where} (builds of earlier sources, compiled again when needed), " + fix
    if free < FAIL_FREE_GIB:
        return Check("disk", "fail", detail, fix)
    if free < MIN_FREE_GIB:
        return Check("disk", "warn", detail, fix)
    return Check("disk", "ok", detail)


# --- extension

# Runs in a child process: a bad .so can crash the interpreter, and the env check must outlive that.
LOAD_SNIPPET = """\
import sys
try:
    import torch
    torch.ops.load_library(sys.argv[1])
except BaseException as exc:
    while exc.__cause__ is not None:  # torch wraps the dlopen error ("undefined symbol: ...")
        exc = exc.__cause__
    lines = [line for line in str(exc).splitlines() if line.strip()]
    sys.stderr.write("\\n%s: %s\\n" % (type(exc).__name__, lines[0].strip() if lines else ""))
    sys.exit(1)
"""


def find_build_json(root: Path, torch_version: str | None) -> tuple[Path | None, dict, str]:
    """The newest successful build.json made for this torch: (path, contents, why none fits).

    A failed build is the commit's fault, not the environment's (bisect skips it with 125), so the
    env check leaves failed records alone.
    """
    found = []
    for path in root.glob("*/build.json"):
        try:
            found.append((path.stat().st_mtime, path, json.loads(path.read_text())))
        except (OSError, ValueError):
            continue
    found.sort(key=lambda item: item[0], reverse=True)
    built = [item for item in found if item[2].get("status", "ok") != "failed"]
    if not built:
        return None, {}, "only failed builds so far" if found else ""
    for _, path, info in built:
        if torch_version is None or info.get("torch_version") in (None, torch_version):
            return path, info, ""
    newest = built[0][2].get("torch_version")
    return None, {}, f"the newest build is for torch {newest}, none for torch {torch_version} yet"


LOAD_TIMEOUT_S = (
    8.0  # loading torch plus the extension in a fresh interpreter takes 2-4 s when idle
)


def check_extension(root: Path, torch_probe: TorchProbe, deadline: Deadline) -> Check:
    build_json, info, note = find_build_json(root, torch_probe.version)
    if build_json is None:
        if note.startswith("the newest build"):
            return Check("extension", "warn", note, "build it: nox -s build")
        return Check("extension", "skip", f"not built yet ({note or f'no {root}/*/build.json'})")
    so_path = Path(str(info.get("so_path", "")))
    if not so_path.is_absolute():
        so_path = build_json.parent / so_path
    if not info.get("so_path") or not so_path.is_file():
        return Check(
            "extension", "warn", f"{build_json} names a missing library: {so_path}", REBUILD_FIX
        )
    if torch_probe.module is None:
        return Check("extension", "skip", f"{so_path.name}: torch is not importable")
    timeout = deadline.timeout(LOAD_TIMEOUT_S)
    run = run_tool([sys.executable, "-c", LOAD_SNIPPET, str(so_path)], timeout)
    backend = info.get("backend", "?")
    if run is not None and run.rc == 0:
        return Check("extension", "ok", f"{so_path.name} loads ({backend} backend)")
    if run is None or run.rc is None:
        return Check(
            "extension",
            "warn",
            f"{so_path.name}: loading did not finish within {timeout:.1f} s",
            f"try it by hand: python -c \"import torch; torch.ops.load_library('{so_path}')\"",
        )
    if run.rc < 0:
        try:
            why = f"crashed the interpreter ({signal.Signals(-run.rc).name})"
        except ValueError:
            why = f"crashed the interpreter (signal {-run.rc})"
        return Check("extension", "fail", f"{so_path.name}: loading it {why}", REBUILD_FIX)
    lines = [line.strip() for line in run.out.splitlines() if line.strip()]
    error = lines[-1] if lines else f"exit code {run.rc}"
    return Check("extension", "fail", f"{so_path.name} does not load: {error}", REBUILD_FIX)


# --- GPU processes

COMPUTE_APPS_QUERY = [
    "nvidia-smi",
    "--query-compute-apps=pid,process_name,used_memory",
    "--format=csv,noheader",
]


def parse_compute_apps(text: str) -> list[GpuProcess]:
    """Lines like '1234, /usr/bin/python3, 20480 MiB'."""
    processes = []
    for line in text.splitlines():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) < 3 or not parts[0].isdigit():
            continue
        memory = re.match(r"(\d+)\s*MiB", parts[-1])
        name = ",".join(parts[1:-1])
        processes.append(GpuProcess(int(parts[0]), name, int(memory.group(1)) if memory else None))
    return processes


def check_gpu_processes(gpu_present: bool, smi_output: str | None, own_pid: int) -> Check:
    if not gpu_present:
        return Check("gpu-processes", "skip", "no GPU")
    if smi_output is None:
        return Check("gpu-processes", "skip", "nvidia-smi not available")
    others = [p for p in parse_compute_apps(smi_output) if p.pid != own_pid]
    if not others:
        return Check("gpu-processes", "ok", "no other process holds GPU memory")
    listed = ", ".join(
        f"{p.pid} {Path(p.name).name} ({p.used_mib} MiB)"
        if p.used_mib is not None
        else f"{p.pid} {p.name}"
        for p in others
    )
    return Check(
        "gpu-processes",
        "warn",
        f"{len(others)} other process(es) hold GPU memory: {listed}",
        "wait for them or stop them (kill PID): timings and memory gates are unreliable meanwhile",
    )


# --- the run


@dataclass
class Report:
    require_gpu: bool
    checks: list[Check] = field(default_factory=list)
    gpu: Gpu | None = None
    torch_version: str | None = None
    torch_cuda: str | None = None
    nvcc_version: str | None = None
    cuda_home: str | None = None  # the toolkit the build uses (the one with the headers)
    driver_cuda: str | None = None
    driver_version: str | None = None
    elapsed_s: float = 0.0
    load: dict | None = None  # pipeline.load: CPU count and load average before and after

    @property
    def passed(self) -> bool:
        return all(check.status != "fail" for check in self.checks)

    @property
    def backend(self) -> str:
        """'cuda' when a GPU, a CUDA torch and a CUDA toolkit are all there; otherwise 'cpu'."""
        usable_toolkit = self.nvcc_version and self.cuda_home
        return "cuda" if self.gpu and self.torch_cuda and usable_toolkit else "cpu"

    def to_json(self) -> dict:
        return {
            "schema": SCHEMA,
            "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "require_gpu": self.require_gpu,
            "passed": self.passed,
            "backend": self.backend,
            "gpu": asdict(self.gpu) if self.gpu else None,
            "torch": self.torch_version,
            "cuda": {
                "torch": self.torch_cuda,
                "nvcc": self.nvcc_version,
                "home": self.cuda_home,
                "driver": self.driver_cuda,
                "driver_version": self.driver_version,
            },
            "python": platform.python_version(),
            "platform": platform.platform(),
            "elapsed_s": round(self.elapsed_s, 2),
            "load": self.load,
            "checks": [asdict(check) for check in self.checks],
        }


def run_checks(require_gpu: bool = False, deadline: Deadline | None = None) -> Report:
    started = time.monotonic()
    deadline = deadline or Deadline()
    report = Report(require_gpu, load=load.start())
    add = report.checks.append

    add(check_python())

    torch_probe = probe_torch()
    report.torch_version, report.torch_cuda = torch_probe.version, torch_probe.cuda
    add(check_torch(torch_probe))
    add(check_numpy(torch_probe))

    gpu_probe = probe_gpu(torch_probe.module)
    report.gpu = gpu_probe.gpu
    add(check_gpu(gpu_probe, require_gpu, torch_probe.cuda))
    kind_check = check_gpu_kind(gpu_probe.gpu, os.environ.get(gpukinds.KIND_VAR))
    if kind_check is not None:
        add(kind_check)

    # The driver is looked for even when torch sees no GPU: a driver too old for torch's CUDA is
    # exactly the case where torch sees none.
    smi = shutil.which("nvidia-smi")
    smi_run = run_tool([smi], deadline.timeout(3.0)) if smi and torch_probe.cuda else None
    smi_driver, smi_cuda = parse_nvidia_smi(smi_run.out) if smi_run else (None, None)
    report.driver_cuda = driver_cuda_from_libcuda() or smi_cuda
    report.driver_version = smi_driver
    add(
        check_driver(
            report.driver_cuda,
            report.driver_version,
            torch_probe.cuda,
            driver_found=bool(smi or report.driver_cuda),
        )
    )

    nvcc, cuda_home_set = _toolkit.find_nvcc()
    nvcc_run = run_tool([nvcc, "--version"], deadline.timeout(3.0)) if nvcc else None
    report.nvcc_version = _toolkit.parse_nvcc_version(nvcc_run.out) if nvcc_run else None
    report.cuda_home = _toolkit.find_toolkit_home(nvcc, cuda_home_set, deadline.timeout(3.0))
    add(
        check_nvcc(
            nvcc,
            report.nvcc_version,
            torch_probe.cuda,
            report.gpu is not None,
            require_gpu,
            toolkit_home=report.cuda_home or cuda_home_set,
            headers_found=report.cuda_home is not None,
        )
    )

    ninja = shutil.which("ninja")
    ninja_run = run_tool([ninja, "--version"], deadline.timeout(2.0)) if ninja else None
    beside = Path(sys.executable).parent / "ninja"
    add(
        check_ninja(
            ninja,
            first_line(ninja_run.out) if ninja_run and ninja_run.rc == 0 else None,
            str(beside) if beside.exists() else None,
        )
    )

    cxx = os.environ.get("CXX") or "c++"  # what torch's cpp_extension uses on Linux
    cxx_path = shutil.which(cxx)
    cxx_run = run_tool([cxx_path, "--version"], deadline.timeout(2.0)) if cxx_path else None
    add(
        check_compiler(
            cxx, cxx_path, first_line(cxx_run.out) if cxx_run and cxx_run.rc == 0 else None
        )
    )

    add(check_disk(build_root()))
    add(check_extension(build_root(), torch_probe, deadline))

    apps_run = run_tool(COMPUTE_APPS_QUERY, deadline.timeout(3.0)) if smi and report.gpu else None
    apps_out = apps_run.out if apps_run and apps_run.rc == 0 else None
    add(check_gpu_processes(report.gpu is not None, apps_out, os.getpid()))

    report.elapsed_s = time.monotonic() - started
    report.load = load.finish(report.load)
    return report


def format_check(check: Check) -> str:
    label = "FAIL" if check.status == "fail" else check.status
    line = f"  {label:<4} {check.name:<16} {check.detail}"
    if check.fix and check.status in ("fail", "warn"):
        line += f" -> fix: {check.fix}"
    return line


def summary_line(report: Report, json_path: Path) -> str:
    counts = ", ".join(
        f"{sum(c.status == status for c in report.checks)} {status}" for status in STATUSES
    )
    if report.passed:
        where = "" if report.gpu else " (no GPU: the CPU backend will be used)"
        verdict = f"env: PASS, backend {report.backend}{where}"
    else:
        failed = ", ".join(c.name for c in report.checks if c.status == "fail")
        verdict = f"env: BROKEN ({failed}), exit {exitcodes.ENV_BROKEN} so `git bisect run` aborts"
    return f"{verdict}; {counts}; {report.elapsed_s:.1f} s; wrote {json_path}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=f"{program()} env",
        description="Check that this machine can build and run the flashmoe-science kernels.",
    )
    parser.add_argument(
        "--require-gpu",
        action="store_true",
        default=require_gpu_from_env(),
        help="fail unless a usable CUDA GPU and toolkit are present (default: FLASHMOE_REQUIRE_GPU=1)",
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        help="where to write the findings (default: reports/env.json)",
    )
    args = parser.parse_args(argv)
    if args.json is None:
        clear_outputs("env.json")

    report = run_checks(require_gpu=args.require_gpu)
    for check in report.checks:
        print(format_check(check))
    json_path = args.json or report_dir() / "env.json"
    try:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        doc = {**report.to_json(), "provenance": provenance()}
        json_path.write_text(json.dumps(doc, indent=2) + "\n")
    except OSError as exc:
        print(
            f"env: cannot write {json_path}: {exc} -> fix: pass --json to a writable path",
            file=sys.stderr,
        )
        return exitcodes.ENV_BROKEN
    print(summary_line(report, json_path))
    return exitcodes.OK if report.passed else exitcodes.ENV_BROKEN


if __name__ == "__main__":
    sys.exit(main())
