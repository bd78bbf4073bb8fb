"""Reading the compiler's output: the ptxas resource report, warnings, and the first error.

The build (flashmoe_science/pipeline/build/unit.py) hands this module the log of one compile (nvcc or
c++ through ninja, as torch's cpp_extension runs them) and shows what it finds: one row per kernel
and arch (registers, shared memory, spills), the number of warnings, and on failure the first error
in a few lines with what to do next.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import subprocess
import zlib
from collections.abc import Callable
from pathlib import Path

from ... import _loader
from .. import exitcodes
from ..paths import REPO_ROOT

CHILD_MARK = _loader.CHILD_MARK

_ENTRY_RE = re.compile(r"ptxas info\s*: Compiling entry function '([^']+)' for '(\w+)'")
_PROPS_RE = re.compile(r"ptxas info\s*: Function properties for (\S+)")
_STACK_RE = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)
_USED_RE = re.compile(r"ptxas info\s*: Used (\d+) registers")
_SMEM_RE = re.compile(r"(\d+) bytes smem")
# ptxas's advice on an sm_90a kernel, e.g. '(C7511) Potential Performance Loss: wgmma.mma_async
# instructions are serialized due to insufficient register resources ... in the function 'X''; a
# serialized wgmma pipeline costs several times the kernel's speed.
_LOSS_RE = re.compile(
    r"ptxas info\s*: \((C\d+)\) Potential Performance Loss: (.*?)(?: in the function '([^']+)')?\s*$"
)


def parse_ptxas(text: str, demangle: Callable[[list[str]], list[str]] | None = None) -> list[dict]:
    """`-Xptxas=-v` output -> one dict per (kernel, arch): registers, smem, stack and spill bytes.

    ptxas prints, per entry function: 'Compiling entry function X for sm_NN', 'Function properties
    for X' + a stack/spill line, then 'Used N registers, ... M bytes smem'. Properties of non-entry
    device functions also appear; they are skipped by matching the name against the current entry.
    `demangle` maps mangled names to readable ones (default: c++filt when installed).

    'Potential Performance Loss' advice (serialized wgmma) goes to `performance_loss` of the kernel
    it names, else of the entry being compiled (it may name a function inlined into it). ptxas
    13 prints a run's advice before that run's entries: advice naming an entry still to come goes
    to the next entry of that name (the arch that run compiles); advice printed before any entry
    that names none goes to the next entry compiled.
    """
    kernels: list[dict] = []
    current: dict | None = None
    properties_of: dict | None = None
    entries = {match.group(1) for match in _ENTRY_RE.finditer(text)}
    pending: dict[str | None, str] = {}  # advice for an entry still to come (None: the next one)

    def advise(kernel: dict, advice: str) -> None:
        if kernel["performance_loss"] is None:
            kernel["performance_loss"] = advice

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
                "performance_loss": None,
            }
            kernels.append(current)
            properties_of = None
            for key in (current["mangled"], None):
                if key in pending:
                    advise(current, pending.pop(key))
        elif match := _LOSS_RE.search(line):
            code, what, function = match.groups()
            advice = f"{code}: {what}"
            if current is not None and function == current["mangled"]:
                advise(current, advice)
            elif function in entries:
                pending.setdefault(function, advice)
            elif current is not None:
                advise(current, advice)
            else:
                pending.setdefault(None, advice)
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
    for function, advice in pending.items():  # advice after the last entry of its name
        for kernel in reversed(kernels):
            if function is None or kernel["mangled"] == function:
                advise(kernel, advice)
                break
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


def shorten_kernel_name(name: str, width: int = 100) -> str:
    """'void ns::kern<ns::Traits<128, 64>, __half>(ns::Params)' -> 'kern<Traits<128, 64>, __half>'.

    Namespaces and the parameter list go (the template arguments are what tell instantiations of one
    kernel apart); what is still too long is cut to `width`, ending in a digest of the whole name so
    that two instantiations which differ only past the cut (the dtype, last) stay two rows.
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
    if len(name) <= width:
        return name
    digest = f"{zlib.crc32(name.encode()):08x}"
    return f"{name[: width - 3 - len(digest)]}...{digest}"


def spilling(kernels: list[dict]) -> list[dict]:
    return [k for k in kernels if k["spill_stores"] or k["spill_loads"]]


_WARNING_RE = re.compile(r"^\S.*?(?::\d+(?::\d+)?:|\(\d+\):)\s+warning\b")


def compiler_warnings(log_text: str) -> list[str]:
    return [line for line in log_text.splitlines() if _WARNING_RE.match(line)]


def warning_summary(log_text: str) -> str | None:
    """'3 compiler warning(s); first: ...', or None without warnings."""
    warnings = compiler_warnings(log_text)
    if not warnings:
        return None
    return f"{len(warnings)} compiler warning(s); first: {_clip(_relative(warnings[0]), 160)}"


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
    log = _loader.display_path(log_path)
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


def failure_exit_code(log_text: str) -> int:
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
