"""`python -m flashmoe_science build` (and `nox -s build`): build the extension and report on it.

The loader (flashmoe_science._loader) configures, compiles and caches the unit; this module is the
pipeline's layer over it: progress and the resource table on stdout, spill warnings, the compiler's
first error condensed (flashmoe_science.pipeline.build.compiler_output), and ``build.json`` in the report
directory, which the PR report and the environment check read.

Each kernel row carries ptxas's figures (registers, static shared memory, stack, spills) and the
dynamic shared memory its launch asks for, which the CUDA unit itself reports
(``flashmoe_science::kernel_launches``, csrc/flash_api_cuda.cuh): ptxas cannot see it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ... import _loader
from ..._loader import (
    BuildConfig,
    BuildError,
    ConfigError,
    CudaToolkit,
    arch_label,
    build_key,
    describe,
    parse_arch_list,
    resolve_config,
)
from .. import basetree, exitcodes
from ..cli import program
from ..paths import REPORTS_VAR, report_dir, require_gpu_from_env
from ..provenance import clear_outputs, provenance
from .compiler_output import (
    compiler_warnings,
    condense_failure,
    failure_exit_code,
    parse_ptxas,
    shorten_kernel_name,
    spilling,
    warning_summary,
)

__all__ = [
    "BuildConfig",
    "BuildError",
    "BuildResult",
    "ConfigError",
    "CudaToolkit",
    "arch_label",
    "build",
    "build_key",
    "describe",
    "ensure_built",
    "main",
    "parse_arch_list",
    "resolve_config",
]

REPORT_NAME = "build.json"
KERNELS_NAME = "kernels.json"  # beside the library: the kernel table of that build, with its hash
LAUNCHES_TIMEOUT_S = 120.0


@dataclasses.dataclass
class BuildResult:
    config: BuildConfig
    library: Path
    cold: bool  # True when this call compiled
    elapsed_s: float
    kernels: list[dict]
    log_path: Path
    record: dict  # what was written to <report dir>/build.json


def build(
    config: BuildConfig,
    force: bool = False,
    quiet: bool = False,
    heartbeat_s: float = _loader.HEARTBEAT_S,
) -> BuildResult:
    """Build (unless up to date) and write build.json. Raises BuildError with the first error."""
    say = _printer(quiet)
    start = time.perf_counter()
    try:
        result = _loader.build(config, force=force, say=say, heartbeat_s=heartbeat_s)
    except BuildError as exc:
        error = condensed(exc)
        record = {
            **(_loader.read_record(config) or _failed_record(config)),
            "status": "failed",
            "error": str(error),
            "elapsed_s": round(time.perf_counter() - start, 3),
            "cold": True,
            "kernels": parse_ptxas(exc.log_text) if config.backend == "cuda" else [],
        }
        _write_report(record)
        raise error from None
    log_text = result.log_text if result.cold else _read_text(result.log_path)
    kernels = kernel_table(config, result.record.get("hash"), log_text)
    record = {
        **result.record,
        "cold": result.cold,
        "elapsed_s": round(time.perf_counter() - start, 3),
        "timestamp": _loader.now(),
        "compiler_warnings": len(compiler_warnings(log_text)),
        "kernels": kernels,
    }
    _write_report(record)
    if result.cold:
        for row in format_resource_table(kernels) if kernels else []:
            say(row)
        _print_spill_warnings(kernels)
        unknown = [k for k in kernels if k.get("dynamic_smem") is None]
        if unknown:
            say(
                f"  dynamic smem unknown for {len(unknown)} kernel(s): the unit did not report "
                "them (flashmoe_science::kernel_launches in csrc/flash_api_cuda.cuh)"
            )
        summary = warning_summary(log_text)
        if summary:
            say(f"  {summary}")
        say(f"  log: {_loader.display_path(result.log_path)}")
    return BuildResult(
        config, result.library, result.cold, record["elapsed_s"], kernels, result.log_path, record
    )


def ensure_built(
    backend: str = "auto",
    defines: Sequence[str] = (),
    sources_dir: Path | None = None,
    name: str = _loader.LIBRARY_NAME,
) -> Path:
    """The loader's ensure_built, with a failure condensed to the compiler's first error."""
    try:
        return _loader.ensure_built(backend, defines, sources_dir, name)
    except BuildError as exc:
        raise condensed(exc) from None


def ensure_built_for(command: str, defines: Sequence[str] = ()) -> Path | int:
    """A CUDA build for a pipeline command (sanitize, phases): the library's path, or, after one
    line that names the command, the failure's exit code."""
    try:
        return ensure_built("cuda", defines=defines)
    except ConfigError as exc:
        print(f"{command}: cannot configure the CUDA build: {exc}", flush=True)
        return exc.exit_code
    except BuildError as exc:
        print(f"{command}: the extension does not build (exit {exc.exit_code})\n{exc}", flush=True)
        return exc.exit_code


def condensed(exc: BuildError) -> BuildError:
    """The loader's error with the compiler's first error and the pipeline's exit code."""
    if not exc.log_text or exc.log_path is None:
        return exc  # no compiler ran (a missing source): the loader's message says it all
    message = condense_failure(exc.log_text, exc.log_path, exc.returncode or 1)
    return BuildError(
        message, exc.log_path, failure_exit_code(exc.log_text), exc.log_text, exc.returncode
    )


# --------------------------------------------------------------------------------------------------
# The kernel table
# --------------------------------------------------------------------------------------------------


def kernel_table(config: BuildConfig, digest: str | None, log_text: str) -> list[dict]:
    """One row per (kernel, arch) of a CUDA build: ptxas's figures plus the launch's dynamic shared
    memory. Kept beside the library, so an up-to-date build costs no torch import."""
    if config.backend != "cuda":
        return []
    cache = config.build_dir / KERNELS_NAME
    try:
        stored = json.loads(cache.read_text())
        if digest and stored.get("hash") == digest:
            return stored["kernels"]
    except (OSError, ValueError, KeyError):
        pass
    kernels = parse_ptxas(log_text)
    table = launch_table(_loader.library_path(config))
    add_dynamic_smem(kernels, table)
    if digest and table is not None:  # a failed query is asked again next time
        _loader.write_json(cache, {"hash": digest, "kernels": kernels})
    return kernels


# Runs in a child: loading the CUDA unit needs torch (no GPU), and a bad library must not take the
# build down with it.
LAUNCHES_SNIPPET = """\
import sys
import torch
torch.ops.load_library(sys.argv[1])
sys.stdout.write(torch.ops.flashmoe_science.kernel_launches())
"""


def launch_table(library: Path) -> dict[str, int] | None:
    """{short kernel name: dynamic shared memory bytes} for every kernel the library launches, as
    the library itself reports it; None when it cannot say (an older unit, a load failure)."""
    try:
        run = subprocess.run(
            [sys.executable, "-c", LAUNCHES_SNIPPET, str(library)],
            capture_output=True,
            text=True,
            timeout=LAUNCHES_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_launch_table(run.stdout) if run.returncode == 0 else None


def parse_launch_table(text: str) -> dict[str, int]:
    """'<demangled kernel name>\\t<bytes>' lines -> {short name (as the rows have it): bytes}."""
    table = {}
    for line in text.splitlines():
        name, _, size = line.rpartition("\t")
        if name and size.strip().isdigit():
            table[shorten_kernel_name(name)] = int(size)
    return table


def add_dynamic_smem(kernels: list[dict], table: dict[str, int] | None) -> None:
    """Each row gets `dynamic_smem` (bytes), None where the library did not report the kernel."""
    for kernel in kernels:
        kernel["dynamic_smem"] = None if table is None else table.get(kernel["kernel"])


def format_resource_table(kernels: list[dict]) -> list[str]:
    width = max([len("kernel"), *(len(k["kernel"]) for k in kernels)])
    rows = [
        f"  {'kernel':<{width}}  {'arch':<7} {'regs':>5} {'static smem':>11} {'dynamic smem':>12} "
        f"{'spills (st/ld B)':>17}"
    ]
    for k in kernels:
        spills = f"{k['spill_stores']}/{k['spill_loads']}"
        dynamic = k.get("dynamic_smem")
        rows.append(
            f"  {k['kernel']:<{width}}  {k['arch']:<7} {k['registers']:>5} {k['smem_bytes']:>11} "
            f"{'?' if dynamic is None else dynamic:>12} {spills:>17}"
        )
    return rows


def _print_spill_warnings(kernels: list[dict]) -> None:
    # printed even with --quiet: a spill is a bug report, not a detail; so is a serialized wgmma
    for k in spilling(kernels):
        print(
            f"WARNING: {k['kernel']} ({k['arch']}) spills registers: {k['spill_stores']} B stores, "
            f"{k['spill_loads']} B loads to local memory",
            flush=True,
        )
    for k in kernels:
        if k.get("performance_loss"):
            print(
                f"WARNING: {k['kernel']} ({k['arch']}): ptxas {k['performance_loss']}", flush=True
            )


# --------------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------------


def _failed_record(config: BuildConfig) -> dict:
    return {
        "status": "failed",
        "backend": config.backend,
        "reason": config.reason,
        "arch_list": list(config.arch_list),
        "defines": list(config.defines),
        "torch_version": config.torch_version,
        "key": config.key,
        "source": _loader.display_path(config.source),
        "hash": None,
    }


def _write_report(record: dict) -> None:
    _loader.write_json(report_dir() / REPORT_NAME, {**record, "provenance": provenance()})


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def _printer(quiet: bool) -> Callable[[str], None]:
    if quiet:
        return lambda _message: None
    return lambda message: print(message, flush=True)


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = _loader.parser(prog=f"{program()} build")
    parser.description = (
        "Build the extension (one compilation unit) for this machine and write build.json to the "
        "report directory; a no-op when up to date."
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines or resource table")
    parser.add_argument(
        "--sources-dir",
        type=Path,
        default=None,
        help="directory holding the unit and its headers (default: csrc/)",
    )
    parser.add_argument(
        "--strict",
        action="store_true",
        help="exit 1 when ptxas serialized a kernel's wgmma pipeline (correct but several times "
        "slower); nox -s compile passes it",
    )
    parser.add_argument(
        "--require-gpu",
        action="store_true",
        default=require_gpu_from_env(),
        help="build the CUDA unit or fail (default: FLASHMOE_REQUIRE_GPU=1)",
    )
    parser.add_argument(
        "--base",
        metavar="REF",
        default=None,
        help="also build REF's unit beside this one, in the worktree and build root `bench --base "
        "REF` uses, so the bench finds it built; nothing when REF's kernel sources are these. Its "
        "failure is the bench's to report: this step warns and goes on (the GPU job passes a "
        "pull request's base)",
    )
    parser.add_argument(
        "--plants",
        action="store_true",
        help=f"also build the plant unit beside this one (-D{_loader.PLANT_DEFINE}: every planted "
        "bug in, picked at run time), which the planted-bug tests load; the GPU job's build step "
        "passes it so its test stage compiles nothing",
    )
    return parser


@dataclasses.dataclass
class BesideBuild:
    """A build in a child process beside this one's: the plant unit, or the bench's base."""

    what: str  # "the plant unit (-D...)", "the base 0123abcd4567"
    process: subprocess.Popen
    log: Path
    start: float
    reports: Path  # the child's report folder: its build.json says how long its own build took

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


def start_plant_build(args: argparse.Namespace, backend: str) -> BesideBuild:
    """`build --define PLANT_DEFINE` (with FLASHMOE_BUILD_DEFINES' defines: plant_defines) for the
    same backend and targets, quiet, in a child whose report (build.json) goes to a folder of its
    own: the report directory holds this build's."""
    root = _loader.build_root()
    root.mkdir(parents=True, exist_ok=True)
    log = root / "plants.log"
    command = [sys.executable, "-m", "flashmoe_science", "build", "--backend", backend, "--quiet"]
    for arch in args.arch or ():
        command += ["--arch", arch]
    for define in _loader.plant_defines():
        command += ["--define", define]
    reports = root / "plants-reports"
    env = {**os.environ, REPORTS_VAR: str(reports)}
    env.pop(_loader.ONLY_VAR, None)
    with log.open("w") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
        )
    what = f"the plant unit (-D{_loader.PLANT_DEFINE})"
    return BesideBuild(what, process, log, time.perf_counter(), reports)


def start_base_build(ref: str, config: _loader.BuildConfig) -> BesideBuild | None:
    """REF's unit as `bench --base REF` builds it (basetree.start_prebuild), so the bench step
    finds it built; None where there is nothing to build ahead (the reason is said)."""
    start = time.perf_counter()
    base = basetree.start_prebuild(ref, config)
    if base is None:
        return None
    what = f"the base {base.sha[:12]} ({ref})"
    return BesideBuild(what, base.process, base.log, start, base.reports)


def _own_time(beside: BesideBuild, waited: float) -> float:
    """The child's own build time, from its report; the wait's where it has none."""
    try:
        return float(json.loads((beside.reports / REPORT_NAME).read_text())["elapsed_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return waited


def finish_beside(beside: BesideBuild, required: bool = True) -> int:
    """Waits for a build beside this one; says how it went (its own time: the wait ends when this
    build does, which may be long after), its log's last lines where it failed. A failure fails
    the step only where `required`."""
    code = beside.process.wait()
    waited = time.perf_counter() - beside.start
    where = _loader.display_path(beside.log)
    if code == 0:
        print(f"build: {beside.what} done in {_own_time(beside, waited):.1f} s; log {where}")
        return exitcodes.OK
    tail = "\n".join(_read_text(beside.log).splitlines()[-12:])
    if not required:
        print(
            f"build: WARNING: {beside.what} did not build (exit {code}, {waited:.1f} s): the bench "
            f"step will try again and say why. Its log, {where}, ends:\n{tail}",
            file=sys.stderr,
            flush=True,
        )
        return exitcodes.OK
    print(
        f"build: {beside.what} FAILED after {waited:.1f} s (exit {code}); the planted-bug tests "
        f"cannot load it. Its log, {where}, ends:\n{tail}",
        file=sys.stderr,
        flush=True,
    )
    return code if code > 0 else exitcodes.BUILD_FAILED


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.child:  # older callers name this module for the compile child
        return _loader.main(["--child", args.child])
    clear_outputs(REPORT_NAME)
    start = time.perf_counter()
    if args.require_gpu and args.backend == "auto":
        args.backend = "cuda"
    try:
        # --define, else FLASHMOE_BUILD_DEFINES: the library the other commands will load
        defines = args.define or _loader.env_defines()
        config = resolve_config(
            args.backend,
            args.arch,
            defines,
            sources_dir=args.sources_dir,
            only=_loader.only_arg(args.only),
        )
    except ConfigError as exc:
        print(f"build: {exc}", file=sys.stderr)
        return exc.exit_code
    print(describe(config), flush=True)
    if config.backend == "cpu" and args.backend == "auto":
        print(f"  {config.reason}", flush=True)
    plants = start_plant_build(args, config.backend) if args.plants else None
    base = start_base_build(args.base, config) if args.base else None
    beside = [b for b in (plants, base) if b]
    try:
        result = build(config, force=args.force, quiet=args.quiet)
    except (BuildError, ConfigError) as exc:
        sys.stdout.flush()
        failed = (
            f"FAILED after {time.perf_counter() - start:.1f} s\n"
            if isinstance(exc, BuildError)
            else ""
        )
        print(f"build: {failed}{exc}", file=sys.stderr, flush=True)
        for child in beside:
            child.kill()
        return exc.exit_code
    if beside:
        print(f"build: this unit done in {time.perf_counter() - start:.1f} s", flush=True)
    if base:  # its failure is the bench's to report (it falls back to a stored run)
        finish_beside(base, required=False)
    if plants and (code := finish_beside(plants)) != exitcodes.OK:
        return code
    elapsed = time.perf_counter() - start
    print(
        f"build: done in {elapsed:.1f} s" if result.cold else f"build: up to date ({elapsed:.1f} s)"
    )
    serialized = [k for k in result.kernels if k.get("performance_loss")]
    if args.strict and serialized:
        names = ", ".join(f"{k['kernel']} ({k['arch']})" for k in serialized[:3])
        more = f" and {len(serialized) - 3} more" if len(serialized) > 3 else ""
        print(
            f"build: FAILED (--strict): ptxas serialized the wgmma pipeline of {len(serialized)} "
            f"kernel(s): {names}{more}. Look for a non-wgmma instruction touching an accumulator "
            "while its wgmma may still run (the advice in the build log names the cause)",
            file=sys.stderr,
        )
        return exitcodes.GATE_FAILED
    return exitcodes.OK


if __name__ == "__main__":
    sys.exit(main())
