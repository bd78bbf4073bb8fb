"""The loader: finds or builds the compiled unit the operators live in.

The first use of the operators on a machine compiles the kernel sources (one compilation unit,
through torch's cpp_extension, in a child process) and later uses load the result. The CUDA unit is
``csrc/flashmoe_science.cu``, the CPU-only unit ``csrc/flashmoe_science.cpp``; both pull in the
headers beside them.

Where things are:
- the sources: ``flashmoe_science/csrc/`` in an installed package (the wheel ships them there), else
  the checkout's ``csrc/``;
- the builds: one directory per key (torch, CUDA, archs, defines) under :func:`build_root`: the
  checkout's ``build/`` when running from a checkout, else the per-user cache
  (``$FLASHMOE_CACHE_DIR``, else ``$XDG_CACHE_HOME/flashmoe-science``, else
  ``~/.cache/flashmoe-science``); ``FLASHMOE_BUILD_ROOT`` overrides both.

Nothing is written into the current directory. Progress goes to the terminal (stderr by default),
the full compiler output to ``<build_dir>/build.log``. Reading the compiler's output (resource
table, first error) is the pipeline's job (``flashmoe_science.pipeline.build.compiler_output``).

Why a child process: the parent reads the compiler's output line by line (progress, a heartbeat
during long nvcc runs) and a compiler crash cannot take the caller down.

Why the up-to-date check avoids torch: importing torch costs seconds, and `build` on an unchanged
tree must be instant. The torch and CUDA versions are read from torch's ``version.py`` file, GPUs
are found through the driver library, and the sources are hashed.
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
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from . import _toolkit

PACKAGE_DIR = Path(__file__).resolve().parent
PACKAGED_SOURCES = PACKAGE_DIR / "csrc"  # where the wheel puts the kernel sources
CHECKOUT_ROOT = PACKAGE_DIR.parent
CHECKOUT_SOURCES = CHECKOUT_ROOT / "csrc"

LIBRARY_NAME = "flashmoe_science_C"
CUDA_SOURCE = "flashmoe_science.cu"
CPU_SOURCE = "flashmoe_science.cpp"
HEARTBEAT_S = 15.0
CACHE_NAME = "flashmoe-science"

# The pipeline's exit-code contract (flashmoe_science/pipeline/exitcodes.py, which a test keeps
# equal to these); the library cannot import the pipeline, and its errors carry the code to use.
USAGE = 2
BUILD_FAILED = 125
ENV_BROKEN = 255

# No -std flag: cpp_extension passes the standard this torch was built with (C++17 for torch 2.11,
# C++20 for 2.14). Forcing C++20 on torch 2.11 built a unit whose C++ exceptions (every input-check
# error) crashed the process with a segmentation fault on the H200 machine.
HOST_CFLAGS = ("-O3", "-fopenmp")
NVCC_FLAGS = (
    "-O3",
    "--use_fast_math",
    "-lineinfo",
    "--expt-relaxed-constexpr",
    "-Xptxas=-v",  # the pipeline's resource table is parsed from this output
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
# The wgmma kernels exist only for sm_90a (wgmma has no plain sm_90 or PTX form). Their host code
# is compiled when the unit targets sm_90a, which this define tells the host pass (it cannot see
# the device passes' __CUDA_ARCH_FEAT_SM90_ALL).
SM90A_ARCH = "9.0a"
SM90A_DEFINE = "FLASHMOE_SM90A"
# The plant build: every plant compiled in, one picked at run time from $FLASHMOE_PLANT_BUG
# (csrc/attention_params.h), the CPU implementation's and the CUDA kernels' alike: one build serves
# every plant test of a device.
PLANT_DEFINE = "FLASHMOE_PLANT_BUG=-1"

CHILD_MARK = "FLASHMOE_BUILD_CHILD:"  # prefix of the child's own status lines in the log


class ConfigError(Exception):
    """The requested build cannot be configured on this machine (message says what is missing)."""

    def __init__(self, message: str, exit_code: int = ENV_BROKEN):
        super().__init__(message)
        self.exit_code = exit_code


class BuildError(Exception):
    """Compilation failed (or the sources are missing); the message says what to do next.

    `log_text` and `returncode` let a caller condense the compiler's output its own way."""

    def __init__(
        self,
        message: str,
        log_path: Path | None = None,
        exit_code: int = BUILD_FAILED,
        log_text: str = "",
        returncode: int | None = None,
    ):
        super().__init__(message)
        self.log_path = log_path
        self.exit_code = exit_code
        self.log_text = log_text
        self.returncode = returncode


# --------------------------------------------------------------------------------------------------
# Where: sources and builds
# --------------------------------------------------------------------------------------------------


def installed() -> bool:
    """True for an installed package (its sources travel inside it), False in a checkout."""
    return PACKAGED_SOURCES.is_dir()


def default_sources_dir() -> Path:
    return PACKAGED_SOURCES if installed() else CHECKOUT_SOURCES


def cache_dir() -> Path:
    """The per-user build cache of an installed package."""
    if os.environ.get("FLASHMOE_CACHE_DIR"):
        return Path(os.environ["FLASHMOE_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / CACHE_NAME


def build_root() -> Path:
    """Root of the build directories (one subdirectory per key): FLASHMOE_BUILD_ROOT, else the
    checkout's build/ in a checkout, else the per-user cache."""
    if os.environ.get("FLASHMOE_BUILD_ROOT"):
        return Path(os.environ["FLASHMOE_BUILD_ROOT"])
    return cache_dir() if installed() else CHECKOUT_ROOT / "build"


def display_path(path: Path | str) -> str:
    """A path inside the checkout relative to it (short lines), any other path as it is."""
    if installed():
        return str(path)
    try:
        return str(Path(path).resolve().relative_to(CHECKOUT_ROOT))
    except ValueError:
        return str(path)


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
    sources_dir: Path = CHECKOUT_SOURCES
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
    log_path: Path
    log_text: str  # the compiler's output of this build ("" when it was up to date)
    record: dict  # <build_dir>/build.json


def resolve_config(
    backend: str = "auto",
    arch_list: str | Sequence[str] | None = None,
    defines: Sequence[str] | None = None,
    sources_dir: Path | None = None,
    name: str = LIBRARY_NAME,
    only: str | None = None,
) -> BuildConfig:
    """Pick the unit and targets. auto builds CUDA when torch, nvcc and a target agree, else says why not.

    `defines` are the extra -D defines (None: FLASHMOE_BUILD_DEFINES', env_defines: the library
    this process's commands load). `only` restricts a CUDA build to some kernels (Restriction;
    None: FLASHMOE_BUILD_ONLY's); the CPU-only unit has no kernels to leave out, and its build
    ignores it."""
    if backend not in ("auto", "cuda", "cpu"):
        raise ConfigError(f"unknown backend {backend!r}: use auto, cuda or cpu", USAGE)
    torch_version, torch_cuda = torch_versions()
    defines = restricted_defines(
        normalize_defines(env_defines() if defines is None else defines), only
    )
    # FLASHMOE_SM90A follows the targets (compile_flags adds it): given by hand it would promise
    # wgmma kernels to a host whose device code has none, so it only says sm_90a was meant.
    wants_sm90a = any(d.split("=", 1)[0] == SM90A_DEFINE for d in defines)
    defines = tuple(d for d in defines if d.split("=", 1)[0] != SM90A_DEFINE)
    common = dict(
        defines=defines,
        torch_version=torch_version,
        torch_cuda=torch_cuda,
        sources_dir=Path(sources_dir) if sources_dir else default_sources_dir(),
        name=name,
    )
    cpu_common = {**common, "defines": tuple(d for d in defines if not is_only_define(d))}
    if backend == "cpu":
        return BuildConfig("cpu", "backend=cpu requested", (), toolkit=CudaToolkit(), **cpu_common)

    toolkit = find_cuda_toolkit() if torch_cuda else CudaToolkit()
    problem = _cuda_problem(torch_version, torch_cuda, toolkit)
    archs, arch_source = _requested_archs(arch_list) if problem is None else ((), "")
    if problem is None and not archs:
        problem = "no GPU visible and TORCH_CUDA_ARCH_LIST unset"
    if problem is None:
        if wants_sm90a and not targets_sm90a(archs):
            raise ConfigError(
                f"-D{SM90A_DEFINE} without the sm_90a target ({arch_source}): build with "
                f"--arch {SM90A_ARCH} (the define then comes by itself)",
                USAGE,
            )
        return BuildConfig("cuda", arch_source, archs, toolkit=toolkit, **common)
    if backend == "cuda":
        raise ConfigError(f"backend=cuda is impossible: {problem}. {_cuda_fix(problem)}")
    return BuildConfig(
        "cpu", f"{problem}: building the CPU-only unit", (), toolkit=toolkit, **cpu_common
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
    archs = tuple(sorted({visible_gpu_target(a) for a in gpus}, key=_arch_sort_key))
    return archs, "visible GPU: " + ", ".join(arch_label(a) for a in gpus)


def visible_gpu_target(capability: str) -> str:
    """The target a build for a visible GPU of this capability uses: '9.0' -> '9.0a' (the wgmma
    kernels need it, and an sm_90a cubin runs on exactly the 9.0 GPUs such a build is for); any
    other capability is its own target."""
    return SM90A_ARCH if capability == "9.0" else capability


def targets_sm90a(arch_list: Sequence[str]) -> bool:
    """Whether a CUDA build for these targets carries the sm_90a (wgmma) kernels."""
    return any(arch.removesuffix("+PTX") == SM90A_ARCH for arch in arch_list)


def arch_defines(arch_list: Sequence[str]) -> tuple[str, ...]:
    """The defines the targets imply, for the host and the nvcc flags alike."""
    return (SM90A_DEFINE,) if targets_sm90a(arch_list) else ()


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
        return "Pass --arch 9.0a (or set TORCH_CUDA_ARCH_LIST) to build without a GPU."
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
                USAGE,
            )
        major, minor, suffix, ptx = match.groups()
        archs.add(f"{int(major)}.{minor}{suffix.lower()}{'+PTX' if ptx else ''}")
    if not archs:
        raise ConfigError(f"empty CUDA arch list {text!r}", USAGE)
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


DEFINES_VAR = "FLASHMOE_BUILD_DEFINES"


def split_defines(text: str) -> tuple[str, ...]:
    """'A=1,B' -> ('A=1', 'B'): a comma-separated list of defines, as FLASHMOE_BUILD_DEFINES and
    bench --base-defines write them ('' is none)."""
    return tuple(d for d in text.split(",") if d)


def define_flags(defines) -> str:
    """('A=1', 'B') -> '-DA=1 -DB': defines as a compiler command line spells them ('' for none)."""
    return " ".join(f"-D{d}" for d in defines)


def env_defines() -> tuple[str, ...]:
    """The extra -D defines FLASHMOE_BUILD_DEFINES names (comma-separated): the build every command
    of this process loads, and builds, unless it is given --define (tests load planted-bug
    variants this way; an experiment's switch goes the same way)."""
    return split_defines(os.environ.get(DEFINES_VAR, ""))


def switch_on(define: str, defines: Sequence[str] | None = None) -> bool:
    """Whether a build with `defines` (default: env_defines()) has kernel switch `define` on: its
    `NAME=VAL` there (0 or empty is off; a bare NAME is 1, as -DNAME is), else its default,
    `#define NAME VAL` in csrc/attention_params.h. Tests of a switch's code run where it is built
    in."""
    for entry in normalize_defines(env_defines() if defines is None else defines):
        name, assigned, value = entry.partition("=")
        if name == define:
            return value not in ("", "0") if assigned else True
    header = (default_sources_dir() / "attention_params.h").read_text()
    default = re.search(rf"^#define {re.escape(define)} (\d+)$", header, re.M)
    if default is None:
        raise ConfigError(
            f"{define} has no default in csrc/attention_params.h; name a kernel switch defined "
            "there (`#define NAME VAL`)",
            USAGE,
        )
    return default.group(1) != "0"


def plant_defines(extra: Sequence[str] = ()) -> tuple[str, ...]:
    """The plant unit's defines: this process's (FLASHMOE_BUILD_DEFINES), then `extra` (one of the
    same name replaces the environment's), then PLANT_DEFINE. A test stage run under a switch
    (FLASHMOE_BUILD_DEFINES=FLASHMOE_BWD_WS=1, say) then plants its bugs into the kernels it
    gates, and `build --plants` builds the unit its planted-bug processes load."""
    merged: dict[str, str] = {}
    for define in (*env_defines(), *normalize_defines(extra), PLANT_DEFINE):
        merged[define.split("=", 1)[0]] = define
    return tuple(merged.values())


def normalize_defines(defines: Sequence[str]) -> tuple[str, ...]:
    """Accept 'NAME', 'NAME=VAL' or '-DNAME=VAL'; keep order, drop repeats."""
    seen: dict[str, None] = {}
    for define in defines:
        define = define[2:] if define.startswith("-D") else define
        if not re.match(r"^[A-Za-z_]\w*(=.*)?$", define):
            raise ConfigError(f"bad define {define!r}: write NAME or NAME=VALUE", USAGE)
        seen[define] = None
    return tuple(seen)


# --------------------------------------------------------------------------------------------------
# Restricted builds: only the kernels a test needs (csrc/build_only.cuh)
# --------------------------------------------------------------------------------------------------

ONLY_VAR = "FLASHMOE_BUILD_ONLY"
# The kernel families a build can be restricted to, each with the option that picks among its tile
# configurations and the ones it has (csrc/flash_api_cuda.cuh; combine has one kernel per dtype and
# head dim).
ONLY_OPS = {
    "fwd": ("config", (1, 2, 4)),
    "fwd_sm90a": ("config", (5, 6, 7)),
    "decode": ("config", (3,)),
    "combine": (None, ()),
    "varlen": ("config", (1, 2, 4, 5)),
    "paged": ("config", (3,)),
    "bwd": ("backward_config", (1, 2)),
    "bwd_sm90a": ("backward_config", (3,)),
}
CUDA_HEAD_DIMS = (64, 128, 192, 256)  # the head dims the CUDA kernels are instantiated for


def tile_head_dim(head_dim: int, head_dim_v: int | None = None) -> int | None:
    """The CUDA tile that runs q's and k's `head_dim` with v's (default: the same): the narrowest
    of CUDA_HEAD_DIMS that holds both, where both are multiples of 8; None where none does. The
    copy of csrc/attention_ops.h's cuda_tile_head_dim, for the build's restrictions."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    if min(head_dim, head_dim_v) < 8 or head_dim % 8 or head_dim_v % 8:
        return None
    return next((d for d in CUDA_HEAD_DIMS if d >= max(head_dim, head_dim_v)), None)


# key of the FLASHMOE_BUILD_ONLY text -> (define, the values it takes)
ONLY_KEYS = {
    "op": ("FLASHMOE_ONLY_OPS", tuple(ONLY_OPS)),
    "head_dim": ("FLASHMOE_ONLY_HEAD_DIMS", CUDA_HEAD_DIMS),
    "config": ("FLASHMOE_ONLY_CONFIGS", (1, 2, 3, 4, 5, 6, 7)),
    "backward_config": ("FLASHMOE_ONLY_BACKWARD_CONFIGS", (1, 2, 3)),
    "dtype": ("FLASHMOE_ONLY_DTYPES", ("fp16", "bf16")),
}
ONLY_EXAMPLE = "op=fwd_sm90a,combine head_dim=128 config=5,6"


@dataclasses.dataclass(frozen=True)
class Restriction:
    """The kernels a restricted build holds: per dimension (the keys of ONLY_KEYS) the values it
    keeps, or None where it keeps every one. Written `op=fwd,combine head_dim=128 dtype=bf16`
    (FLASHMOE_BUILD_ONLY, `build --only`); the unit reads it as -DFLASHMOE_ONLY_OPS=fwd+combine
    and the like. The empty restriction is the full build."""

    op: tuple[str, ...] | None = None
    head_dim: tuple[int, ...] | None = None
    config: tuple[int, ...] | None = None
    backward_config: tuple[int, ...] | None = None
    dtype: tuple[str, ...] | None = None

    def __post_init__(self):
        # one spelling per restriction (and one build key): values in ONLY_KEYS' order, and a
        # dimension that keeps every value is not restricted
        for key, (_, allowed) in ONLY_KEYS.items():
            values = getattr(self, key)
            if values is not None:
                ordered = tuple(v for v in allowed if v in values)
                ordered += tuple(sorted(set(values) - set(allowed)))
                full = set(allowed) <= set(ordered)
                object.__setattr__(self, key, None if full else ordered)

    def __bool__(self) -> bool:
        return any(getattr(self, key) is not None for key in ONLY_KEYS)

    @classmethod
    def parse(cls, text: str, source: str = ONLY_VAR) -> Restriction:
        """'op=fwd,combine head_dim=128' (whitespace between keys; a key given twice keeps the
        values of both) -> Restriction; ConfigError naming the bad item and what is supported."""
        values: dict[str, set] = {}
        for item in text.split():
            key, sep, listed = item.partition("=")
            if not sep or key not in ONLY_KEYS:
                raise ConfigError(
                    f"bad {source} item {item!r}: write KEY=V1,V2 with KEY one of "
                    f"{', '.join(ONLY_KEYS)}, e.g. '{ONLY_EXAMPLE}'",
                    USAGE,
                )
            values.setdefault(key, set()).update(_only_values(key, listed, source))
        return cls(**{key: tuple(chosen) for key, chosen in values.items()})._checked(source)

    @classmethod
    def from_defines(cls, defines: Sequence[str]) -> Restriction:
        """The restriction -DFLASHMOE_ONLY_* defines (as normalize_defines leaves them) spell."""
        by_define = {define: key for key, (define, _) in ONLY_KEYS.items()}
        values: dict[str, set] = {}
        for define in defines:
            name, _, value = define.partition("=")
            if name not in by_define:
                continue
            key = by_define[name]
            values.setdefault(key, set()).update(_only_values(key, value, f"-D{name}", sep="+"))
        return cls(**{key: tuple(chosen) for key, chosen in values.items()})._checked(
            "-DFLASHMOE_ONLY_*"
        )

    def defines(self) -> tuple[str, ...]:
        return tuple(
            f"{define}={'+'.join(map(str, getattr(self, key)))}"
            for key, (define, _) in ONLY_KEYS.items()
            if getattr(self, key) is not None
        )

    def text(self) -> str:
        """The FLASHMOE_BUILD_ONLY spelling ('' for the full build)."""
        return " ".join(
            f"{key}={','.join(map(str, getattr(self, key)))}"
            for key in ONLY_KEYS
            if getattr(self, key) is not None
        )

    def holds(self, op: str, dtype: str, head_dim: int, config: int | None = 0) -> bool:
        """Whether the build holds family `op`'s kernel for this dtype, head dim and tile
        configuration (its option's: config or backward_config; 0 where one kernel serves all,
        None for 'whichever the automatic choice takes', held only where that option is not
        restricted). The unit's own test is csrc/build_only.cuh's `built`."""
        option = ONLY_OPS[op][0]
        picked = getattr(self, option) if option else None
        return (
            (self.op is None or op in self.op)
            and (self.dtype is None or dtype in self.dtype)
            and (self.head_dim is None or head_dim in self.head_dim)
            and (picked is None or config == 0 or config in picked)
        )

    def _checked(self, source: str) -> Restriction:
        for op in self.op or ():
            option, configs = ONLY_OPS[op]
            picked = getattr(self, option) if option else None
            if picked is not None and not set(configs) & set(picked):
                raise ConfigError(
                    f"{source}: op={op} with {option}={','.join(map(str, picked))} selects no "
                    f"kernel: {op}'s are {option} {', '.join(map(str, configs))}",
                    USAGE,
                )
        return self


def _only_values(key: str, text: str, source: str, sep: str = ",") -> set:
    allowed = ONLY_KEYS[key][1]
    values = set()
    for word in text.split(sep):
        value: str | int = word
        if isinstance(allowed[0], int) and word.isdigit():
            value = int(word)
        if value not in allowed:
            raise ConfigError(
                f"bad {source} value {key}={word!r}: {key} is one of "
                f"{', '.join(map(str, allowed))}",
                USAGE,
            )
        values.add(value)
    return values


def is_only_define(define: str) -> bool:
    return define.split("=", 1)[0].startswith("FLASHMOE_ONLY_")


def env_restriction() -> Restriction:
    """The restriction FLASHMOE_BUILD_ONLY names (empty: the full build)."""
    return Restriction.parse(os.environ.get(ONLY_VAR, ""))


def build_restriction(defines: Sequence[str] | None = None) -> Restriction:
    """The restriction of the build this process loads: FLASHMOE_BUILD_ONLY's, or that of the
    FLASHMOE_ONLY_* defines among `defines` (default: FLASHMOE_BUILD_DEFINES', env_defines)."""
    return env_restriction() or Restriction.from_defines(
        env_defines() if defines is None else defines
    )


def restricted_defines(defines: Sequence[str], only: str | None) -> tuple[str, ...]:
    """`defines` with the restriction's: `only` (a FLASHMOE_BUILD_ONLY text; None: the
    variable's), or FLASHMOE_ONLY_* defines given by hand, checked and spelt one way; given both
    ways, a ConfigError."""
    restriction = Restriction.parse(only, "--only") if only is not None else env_restriction()
    by_hand = Restriction.from_defines(defines)
    if restriction and by_hand:
        raise ConfigError(
            f"the build restriction is given twice (-D{' -D'.join(by_hand.defines())} and "
            f"{restriction.text()!r}): give it once, as {ONLY_VAR} or --only",
            USAGE,
        )
    plain = tuple(d for d in defines if not is_only_define(d))
    return (*plain, *(restriction or by_hand).defines())


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
            "torch is not installed: pip install torch (in a checkout: scripts/setup_environment.sh)"
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
    """nvcc in the toolkit module's one lookup order (the environment check reports the same nvcc
    and toolkit this builds with), plus its version."""
    nvcc, home_set = _toolkit.find_nvcc()
    if nvcc is None:
        if home_set:
            return CudaToolkit(problem=f"CUDA_HOME={home_set} has no bin/nvcc")
        return CudaToolkit(problem="nvcc not found (CUDA_HOME unset, no nvcc on PATH)")
    # Without a toolkit beside it (no include/cuda_runtime.h), keep nvcc's grandparent: the
    # compile then names what is missing.
    home = (
        home_set
        or _toolkit.find_toolkit_home(nvcc, None, 60.0)
        or str(Path(nvcc).resolve().parent.parent)
    )
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return CudaToolkit(nvcc, home, problem=f"{nvcc} --version failed: {exc}")
    version = _toolkit.parse_nvcc_version(out)
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
    cuda_defines = [f"-D{d}" for d in (CUDA_DEFINE, *arch_defines(config.arch_list))]
    return {
        "cflags": [*HOST_CFLAGS, *cuda_defines, *defines],
        "cuda_cflags": [*NVCC_FLAGS, *cuda_defines, *defines],
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


def nvcc_split_flags(config: BuildConfig) -> list[str]:
    """nvcc's flags that spread one unit's compile over the machine's cores (never above
    MAX_JOBS; outside the build's hash, as they leave its kernels what they are):
    - the production unit splits ptxas alone, over every core: ptxas assembles each kernel on
      its own, so the SASS is the same with or without the split (186 sm_90a kernels compared,
      benches/notes/harness.md v5.15), and the build is shorter by its ptxas time (137 -> 111 s
      on 2 cores);
    - the plant unit, built beside it, splits nvcc's optimizer too, over the cores but one. That
      split moves the SASS of ~50 kernels (harness.md v5.11): the plant tests accept it, the
      production unit would need the gates and a bench on a GPU."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    plants = PLANT_DEFINE in config.defines
    split = max(1, (cores or 1) - plants)
    max_jobs = os.environ.get("MAX_JOBS", "")
    split = max(1, min(split, int(max_jobs))) if max_jobs.isdigit() else split
    if split == 1:
        return []
    return [f"--split-compile={split}"] if plants else [f"-Xptxas=--split-compile={split}"]


def portable_flags(config: BuildConfig) -> dict[str, list[str]]:
    """compile_flags with the two machine-specific prefixes in them (the checkout's sources and
    torch's site-packages, in include paths and the linker's -L folders) written as placeholders:
    what the hash sees, so that a copy of the checkout elsewhere, a runner with another workspace
    path, or another machine with the same torch and toolkit release recognises the same build as
    its own."""
    prefixes = [(str(config.sources_dir), "<sources>")]
    if config.backend == "cuda":
        prefixes.append((str(torch_package_dir().parent), "<site-packages>"))

    def portable(flag: str) -> str:
        # a path alone (include_paths) or after its option (ldflags' -L<dir>)
        option = "-L" if flag.startswith("-L") else ""
        path = flag[len(option) :]
        for prefix, placeholder in prefixes:
            if path == prefix or path.startswith(prefix + os.sep):
                return option + placeholder + path[len(prefix) :]
        return flag

    return {kind: [portable(f) for f in flags] for kind, flags in compile_flags(config).items()}


def source_hash(config: BuildConfig) -> str:
    """Every file under sources_dir (names and bytes) + flags (portable_flags) + defines + key +
    toolkit release: nothing that depends on where the checkout or torch lies."""
    digest = hashlib.sha256()
    for path in sorted(_source_files(config.sources_dir)):
        digest.update(path.relative_to(config.sources_dir).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    signature = {
        "key": config.key,
        "backend": config.backend,
        "name": config.name,
        "defines": config.defines,
        "flags": portable_flags(config),
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


def library_arch_list(library: Path) -> tuple[str, ...]:
    """The CUDA targets the library at this path was built for ('8.9', '9.0a'), from the build
    record beside it; empty for the CPU-only unit or a library without a readable record."""
    try:
        archs = json.loads((Path(library).parent / "build.json").read_text()).get("arch_list")
    except (OSError, ValueError, AttributeError):
        return ()
    return tuple(str(a) for a in archs) if isinstance(archs, list) else ()


def read_record(config: BuildConfig) -> dict | None:
    try:
        return json.loads(record_path(config).read_text())
    except (OSError, ValueError):
        return None


def finished_build(directory: Path, library_name: str) -> dict | None:
    """The record of the finished build `directory` holds (a build directory, or a kept or reused
    copy of one): its build.json says ok and its library is there. None otherwise."""
    try:
        record = json.loads((directory / "build.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("status") != "ok":
        return None
    return record if (directory / library_name).exists() else None


def is_up_to_date(config: BuildConfig, digest: str | None = None) -> bool:
    record = finished_build(config.build_dir, library_path(config).name)
    return record is not None and record.get("hash") == (digest or source_hash(config))


# What a finished build's copy holds beside the library and build.json: the kernels' registers
# and spills (the build report's) and the compiler's log. Object files and ninja's state stay.
REUSED_FILES = ("kernels.json", "build.log")
# Builds of earlier sources kept beside each key's (in <key>.previous/<hash>), the newest first,
# so that going back to those sources (a git bisect, a branch switch) restores instead of compiling
# the unit again: 2-3 minutes of nvcc on a GPU runner for 10-60 MB of disk each.
KEEP_PREVIOUS = 3


def _install_build(src: Path, library_name: str, dest: Path, record: dict) -> None:
    """A finished build's files from `src` into `dest`, with `record` as its build.json (written
    last and removed first, so a half-done copy never looks up to date). Each file goes in under a
    temporary name and is renamed into place: a process that has the old library loaded keeps it."""
    if not (src / library_name).is_file():  # never a build.json without its library
        raise FileNotFoundError(f"no {library_name} in {src} to install")
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "build.json").unlink(missing_ok=True)
    for name in (library_name, *REUSED_FILES):
        if not (src / name).is_file():
            (dest / name).unlink(missing_ok=True)
            continue
        staged = dest / f".{name}.{os.getpid()}.tmp"
        shutil.copy2(src / name, staged)
        staged.replace(dest / name)
    where = {"so_path": str(dest / library_name), "log": str(dest / "build.log")}
    write_json(dest / "build.json", {**record, **where})


PREVIOUS_SUFFIX = ".previous"


def previous_dir(config: BuildConfig) -> Path:
    return config.build_dir.with_name(f"{config.key}{PREVIOUS_SUFFIX}")


def kept_builds_bytes(root: Path) -> int:
    """What the kept builds of earlier sources (every key's <key>.previous under build root
    `root`) take on disk, in bytes."""
    if not root.is_dir():
        return 0
    return sum(
        f.stat().st_size
        for kept in root.glob(f"*{PREVIOUS_SUFFIX}")
        for f in kept.rglob("*")
        if f.is_file() and not f.is_symlink()
    )


def _keep_previous(config: BuildConfig) -> None:
    """Before the build directory is rebuilt for other sources: keep its finished build under its
    hash, and only the KEEP_PREVIOUS most recently used."""
    library = library_path(config)
    record = finished_build(config.build_dir, library.name)
    if record is None or not record.get("hash"):
        return
    slot = previous_dir(config) / str(record["hash"])[:20]
    if slot.exists() and not slot.is_dir():  # an empty file an earlier version's touch() made
        slot.unlink()
    if not (slot / "build.json").is_file():
        _install_build(config.build_dir, library.name, slot, record)
    os.utime(slot)  # the most recently used
    slots = sorted(previous_dir(config).iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in slots[KEEP_PREVIOUS:]:
        shutil.rmtree(old, ignore_errors=True)


def _restore_previous(config: BuildConfig, digest: str) -> dict | None:
    """The kept build of these very sources (hash `digest`) put back in the build directory (the
    current one kept first); its record, or None when none is kept."""
    slot = previous_dir(config) / digest[:20]
    library = library_path(config)
    record = finished_build(slot, library.name)
    if record is None or record.get("hash") != digest:
        return None
    # Used now, before the current build is kept: that keeping drops the least recently used
    # slot, which would otherwise be this one when it is the oldest (a bisect's first step back).
    os.utime(slot)
    _keep_previous(config)
    _install_build(slot, library.name, config.build_dir, record)
    for stale in config.build_dir.glob("*.o"):  # the other sources' object: ninja must not see it
        stale.unlink()
    return read_record(config)


def reuse_build(config: BuildConfig, sources_dir: Path, root: Path) -> bool:
    """Give build root `root` config's up-to-date build for the sources at `sources_dir` (another
    tree, e.g. a worktree of another commit) when those hash the same as the build's (same bytes,
    flags, defines, torch and toolkit): that tree's build then finds its library made instead of
    compiling the same unit again. A build `root` already has of those sources stays; a stale or
    failed one there is replaced. False, and nothing written, when there is nothing to reuse."""
    library = library_path(config)
    record = finished_build(config.build_dir, library.name)
    digest = source_hash(config)
    if record is None or record.get("hash") != digest:
        return False
    theirs = dataclasses.replace(config, sources_dir=Path(sources_dir))
    if not theirs.source.exists() or source_hash(theirs) != digest:
        return False
    dest = Path(root) / config.key
    held = finished_build(dest, library.name)
    if held is not None and held.get("hash") == digest:
        return True
    _install_build(
        config.build_dir, library.name, dest, {**record, "source": display_path(theirs.source)}
    )
    return True


# --------------------------------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------------------------------


def describe(config: BuildConfig) -> str:
    """One line: what is built, for which targets, into which directory."""
    source = display_path(config.source)
    torch_short = config.torch_version.split("+")[0]
    if config.backend == "cuda":
        targets = ", ".join(arch_label(a) for a in config.arch_list)
        what = f"CUDA unit {source} for {targets} (torch {torch_short}, CUDA {config.torch_cuda})"
    else:
        what = f"CPU-only unit {source} (torch {torch_short})"
    defines = f" with {define_flags(config.defines)}" if config.defines else ""
    return f"build: {what}{defines} -> {display_path(config.build_dir)}"


def missing_source_error(config: BuildConfig) -> BuildError:
    """The unit's source is absent: in an installed package the package is broken; in a checkout
    (or a --sources-dir) the tree lacks it."""
    where = display_path(config.source)
    if installed() and config.sources_dir == PACKAGED_SOURCES:
        return BuildError(
            f"{where} is missing: this installation of flashmoe-science is incomplete\n"
            "next: reinstall it: pip install --force-reinstall --no-deps flashmoe-science "
            "(or the wheel or checkout you installed it from)",
            exit_code=ENV_BROKEN,
        )
    if config.sources_dir == CHECKOUT_SOURCES:
        fix = "restore it (git checkout -- csrc/), or build the other backend (--backend cpu|cuda)"
    else:
        fix = f"point --sources-dir at a directory that holds {config.source.name}"
    return BuildError(f"{where} does not exist\nnext: {fix}")


def build(
    config: BuildConfig,
    force: bool = False,
    say: Callable[[str], None] | None = None,
    heartbeat_s: float = HEARTBEAT_S,
) -> BuildResult:
    """Compile the unit unless an identical build exists. Raises BuildError when it fails.

    `say` receives progress lines (default: none)."""
    say = say or (lambda _line: None)
    start = time.perf_counter()
    if not config.source.exists():
        raise missing_source_error(config)
    config.build_dir.mkdir(parents=True, exist_ok=True)
    with _build_lock(config.build_dir, say):
        # checked under the lock: another process may have just finished this very build
        digest = source_hash(config)
        record = read_record(config) if is_up_to_date(config, digest) else None
        if not force and record is None:
            record = _restore_previous(config, digest)
            if record is not None:
                say(f"  these sources were built before: restored from {previous_dir(config)}")
        if not force and record is not None:
            return BuildResult(
                config,
                library_path(config),
                False,
                time.perf_counter() - start,
                config.build_dir / "build.log",
                "",
                record,
            )
        _keep_previous(config)
        return _compile(config, digest, start, say, heartbeat_s)


def ensure_built(
    backend: str = "auto",
    defines: Sequence[str] = (),
    sources_dir: Path | None = None,
    name: str = LIBRARY_NAME,
) -> Path:
    """The library for this machine, built first if missing or stale (the operator loader's entry).

    Progress goes to stderr, so a program's own output stays clean."""
    config = resolve_config(backend, defines=defines, sources_dir=sources_dir, name=name)
    if is_up_to_date(config):
        return library_path(config)

    def say(line: str) -> None:
        print(f"flashmoe_science: {line.strip()}", file=sys.stderr, flush=True)

    say(
        f"building the {config.backend.upper()} unit (first use or sources changed) in "
        f"{display_path(config.build_dir)}"
    )
    result = build(config, say=say)
    say(f"built in {result.elapsed_s:.1f} s")
    return result.library


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

    def on_line(line: str) -> None:
        progress = ninja_progress(line)
        if progress:
            say(f"  {progress}  ({time.perf_counter() - start:.1f} s)")

    run = _toolkit.run_streaming(
        command,
        env,
        log_path,
        cwd=config.build_dir,
        on_line=on_line,
        heartbeat_s=heartbeat_s,
        on_silence=lambda s: say(f"  still compiling {config.source.name} ... {s:.0f} s"),
        log_header=[
            f"TORCH_CUDA_ARCH_LIST={env.get('TORCH_CUDA_ARCH_LIST', '')} "
            f"CUDA_HOME={env.get('CUDA_HOME', '')} MAX_JOBS={env.get('MAX_JOBS', '')}"
        ],
    )
    elapsed = time.perf_counter() - start
    ok = run.returncode == 0 and library_path(config).exists()
    record = _record(config, digest if ok else None, elapsed, ok)
    write_json(record_path(config), record)
    if not ok:
        tail = [line for line in run.text.splitlines() if line.strip()][-3:]
        raise BuildError(
            "\n".join(
                [
                    f"compiling {config.source.name} failed (exit {run.returncode}); last lines:",
                    *(f"  {line[:200]}" for line in tail),
                    f"next: read the full log: {display_path(log_path)}",
                ]
            ),
            log_path,
            ENV_BROKEN if environment_failure(run.text) else BUILD_FAILED,
            log_text=run.text,
            returncode=run.returncode,
        )
    return BuildResult(config, library_path(config), True, elapsed, log_path, run.text, record)


def environment_failure(log_text: str) -> bool:
    """The child could not import torch or run ninja: the machine is at fault, not the sources."""
    return any(
        line.startswith(CHILD_MARK) and ("torch import failed" in line or "ninja" in line.lower())
        for line in log_text.splitlines()
    )


def _record(config: BuildConfig, digest: str | None, elapsed: float, ok: bool) -> dict:
    """<build_dir>/build.json: what the next up-to-date check and the environment check read."""
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
        "source": display_path(config.source),
        "so_path": str(library_path(config)),
        "compile_s": round(elapsed, 3),
        "timestamp": now(),
        "hash": digest,
        "log": str(config.build_dir / "build.log"),
    }


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def write_json(path: Path, data: dict) -> None:
    """Write atomically: a reader never sees half a file."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


@contextlib.contextmanager
def _build_lock(build_dir: Path, say: Callable[[str], None]) -> Iterator[None]:
    """One builder per directory (pytest-xdist workers, parallel nox sessions, two programs of one
    user). flock is released by the kernel if the holder dies, so a killed build never leaves a
    stale lock behind."""
    with open(build_dir / "build.lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"  waiting for another process building {display_path(build_dir)} ...")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _child_command(config: BuildConfig) -> tuple[list[str], dict[str, str]]:
    flags = compile_flags(config)
    if config.backend == "cuda":
        flags["cuda_cflags"] += ["--threads", str(nvcc_threads(config))]
        flags["cuda_cflags"] += nvcc_split_flags(config)
    spec = {
        "name": config.name,
        "sources": [str(config.source)],
        "build_directory": str(config.build_dir),
        "with_cuda": config.backend == "cuda",
        **flags,
    }
    spec_path = config.build_dir / "child.json"
    write_json(spec_path, spec)
    env = dict(os.environ)
    # the interpreter's bin holds ninja (a dependency) even when its venv is not activated
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    if not installed():  # the child imports this very package, whatever the current directory
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(CHECKOUT_ROOT), env.get("PYTHONPATH")])
        )
    env["PYTHONUNBUFFERED"] = "1"
    if config.backend == "cuda":
        env["TORCH_CUDA_ARCH_LIST"] = ";".join(config.arch_list)
        env["CUDA_HOME"] = config.toolkit.home or ""
    command = [sys.executable, "-m", "flashmoe_science._loader", "--child", str(spec_path)]
    return command, env


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


# --------------------------------------------------------------------------------------------------
# The child: the only place that imports torch
# --------------------------------------------------------------------------------------------------


def _child_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    try:
        from torch.utils import cpp_extension
    except Exception as exc:  # any failure here means the environment, not the commit, is broken
        print(f"{CHILD_MARK} error: torch import failed: {type(exc).__name__}: {exc}", flush=True)
        return ENV_BROKEN
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
# Command line: `python -m flashmoe_science build` in an installed package
# --------------------------------------------------------------------------------------------------


def parser(prog: str = "python -m flashmoe_science build") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Build the extension for this machine into the per-user cache, so the first "
        "call does not wait for the compiler; a no-op when up to date.",
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
        action="append",  # `--arch 8.9 --arch 9.0a` is both, not the last one alone
        help="CUDA targets, e.g. '8.9;9.0a', repeatable (default: TORCH_CUDA_ARCH_LIST, else the "
        "visible GPUs, a 9.0 GPU as 9.0a)",
    )
    parser.add_argument(
        "--define",
        metavar="NAME=VAL",
        action="append",
        default=[],
        help="extra -D define, repeatable",
    )
    parser.add_argument(
        "--only",
        metavar="SPEC",
        action="append",
        help=f"build only these kernels, e.g. '{ONLY_EXAMPLE}' (keys: {', '.join(ONLY_KEYS)}); "
        f"repeatable (default: ${ONLY_VAR}; CUDA builds only)",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even when up to date")
    parser.add_argument("--child", metavar="SPEC", help=argparse.SUPPRESS)
    return parser


def only_arg(values: Sequence[str] | None) -> str | None:
    """--only given several times is one restriction (None: not given)."""
    return " ".join(values) if values is not None else None


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.child:
        return _child_main(args.child)

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        config = resolve_config(args.backend, args.arch, args.define, only=only_arg(args.only))
        say(describe(config))
        if config.backend == "cpu" and args.backend == "auto":
            say(f"  {config.reason}")
        result = build(config, force=args.force, say=say)
    except (ConfigError, BuildError) as exc:
        say(f"build: {exc}")
        return exc.exit_code
    say(
        f"build: done in {result.elapsed_s:.1f} s: {display_path(result.library)}"
        if result.cold
        else f"build: up to date: {display_path(result.library)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
