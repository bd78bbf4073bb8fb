"""The CUDA toolkit on this machine, and the one way a long-running tool is run.

One lookup order for every CUDA tool (nvcc, compute-sanitizer, ncu, ...), used by the loader, the
environment check, the sanitizer and the profiler alike:

1. ``$CUDA_HOME/bin``, then ``$CUDA_PATH/bin`` (the toolkit the user named),
2. ``PATH``,
3. the usual install directories (:data:`FALLBACK_CUDA_HOMES`),
4. the newest match of each extra glob (Nsight Compute lives outside the toolkit).

A tool missing from CUDA_HOME is still looked for further down: ncu, for one, is often installed
apart from the toolkit. :func:`find_nvcc` reports which CUDA_HOME was set, so a check can say that
the toolkit it names lacks nvcc.

:func:`run_streaming` runs a tool (the compiler, compute-sanitizer, ncu) in its own process group,
merges its output into a log file line by line, lets the caller show progress, gives a heartbeat
during silence, and kills the whole group on timeout or Ctrl-C.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

FALLBACK_CUDA_HOMES = ("/usr/local/cuda",)
HOME_VARIABLES = ("CUDA_HOME", "CUDA_PATH")

NVCC_RELEASE_RE = re.compile(r"release (\d+\.\d+)")


def cuda_home_set(environ: Mapping[str, str] | None = None) -> str | None:
    """The toolkit directory the environment names (CUDA_HOME, else CUDA_PATH), if any."""
    environ = os.environ if environ is None else environ
    return next((environ[v] for v in HOME_VARIABLES if environ.get(v)), None)


def find_cuda_tool(
    name: str, extra_globs: Sequence[str] = (), environ: Mapping[str, str] | None = None
) -> str | None:
    """The executable `name`, searched in the module's one order (see the module docstring)."""
    environ = os.environ if environ is None else environ
    homes = [environ.get(v) for v in HOME_VARIABLES]
    for home in filter(None, homes):
        if _is_executable(candidate := Path(home) / "bin" / name):
            return str(candidate)
    on_path = shutil.which(name, path=environ.get("PATH", ""))
    if on_path:
        return on_path
    for home in FALLBACK_CUDA_HOMES:
        if _is_executable(candidate := Path(home) / "bin" / name):
            return str(candidate)
    for pattern in extra_globs:
        hits = [p for p in glob.glob(pattern) if os.access(p, os.X_OK)]
        if hits:
            return sorted(hits, key=_version_key)[-1]
    return None


def find_nvcc(environ: Mapping[str, str] | None = None) -> tuple[str | None, str | None]:
    """(nvcc, the CUDA_HOME it came from): the second is None when nvcc was not found there."""
    environ = os.environ if environ is None else environ
    nvcc = find_cuda_tool("nvcc", environ=environ)
    home = cuda_home_set(environ)
    if nvcc is None:
        return None, home  # the caller can say that CUDA_HOME names a toolkit without nvcc
    if home and Path(nvcc).parent == Path(home) / "bin":
        return nvcc, home
    return nvcc, None


def _is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _version_key(path: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path)]


def has_cuda_headers(cuda_home: str | Path | None) -> bool:
    return cuda_home is not None and (Path(cuda_home) / "include" / "cuda_runtime.h").is_file()


def find_toolkit_home(nvcc: str | None, home_set: str | None, timeout: float) -> str | None:
    """The toolkit directory (the one with include/cuda_runtime.h), as the build passes CUDA_HOME.

    torch alone takes nvcc's grandparent, which for a wrapper script such as /usr/local/bin/nvcc is
    /usr/local; so follow links, then ask `nvcc -dryrun` where it lives.
    """
    if home_set:
        return home_set if has_cuda_headers(home_set) else None
    if nvcc is None:
        return None
    for candidate in (Path(nvcc).parent.parent, Path(nvcc).resolve().parent.parent):
        if has_cuda_headers(candidate):
            return str(candidate)
    try:
        out = subprocess.run(
            [nvcc, "-dryrun", "-c", "probe.cu", "-o", os.devnull],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    top = re.search(r"^#\$ TOP=(.+)$", out.stdout + out.stderr, re.MULTILINE)
    if top and has_cuda_headers(Path(top.group(1).strip()).resolve()):
        return str(Path(top.group(1).strip()).resolve())
    return None


def parse_nvcc_version(text: str) -> str | None:
    """'Cuda compilation tools, release 13.0, V13.0.88' -> '13.0'."""
    match = NVCC_RELEASE_RE.search(text)
    return match.group(1) if match else None


# --------------------------------------------------------------------------------------------------
# Running a tool
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class StreamResult:
    returncode: int | None  # None when it was killed for running past its timeout
    text: str  # everything it printed, stdout and stderr merged
    timed_out: bool


def run_streaming(
    command: Sequence[str],
    env: Mapping[str, str],
    log_path: Path,
    *,
    cwd: Path | str | None = None,
    timeout_s: float | None = None,
    on_line: Callable[[str], None] | None = None,
    heartbeat_s: float | None = None,
    on_silence: Callable[[float], None] | None = None,
    log_header: Sequence[str] = (),
    stop: threading.Event | None = None,
) -> StreamResult:
    """Run `command` with stdout and stderr merged into `log_path` as they come.

    `on_line` sees every line (without its newline); `on_silence(elapsed_s)` is called after each
    `heartbeat_s` without a line. The child gets its own process group, which is killed when
    `timeout_s` passes or the caller is interrupted, so nvcc/ninja/the profiled process go too.
    A caller in another thread than the one Ctrl-C reaches passes `stop`: once it is set, the group
    is killed within a second and KeyboardInterrupt raised here.
    """
    start = time.monotonic()
    lines: list[str] = []
    timed_out = False
    with open(log_path, "w", encoding="utf-8", errors="replace") as log:
        log.write(f"$ {shlex.join(command)}\n")
        for line in log_header:
            log.write(line + "\n")
        log.flush()
        child = subprocess.Popen(
            list(command),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=dict(env),
            cwd=cwd,
            text=True,
            encoding="utf-8",
            errors="replace",
            bufsize=1,
            start_new_session=True,
        )
        try:
            last_event = start
            poll = min(1.0, heartbeat_s or 1.0)
            for line in _lines_with_timeouts(child, poll):
                if stop is not None and stop.is_set():
                    raise KeyboardInterrupt
                now = time.monotonic()
                if line is not None:
                    log.write(line + "\n")
                    log.flush()
                    lines.append(line)
                    last_event = now
                    if on_line:
                        on_line(line)
                elif heartbeat_s and on_silence and now - last_event >= heartbeat_s:
                    on_silence(now - start)
                    last_event = now
                if timeout_s is not None and now - start > timeout_s:
                    timed_out = True
                    kill_group(child, signal.SIGKILL)
                    break
            returncode = child.wait()
        except BaseException:
            kill_group(child)  # Ctrl-C: take the whole tool down with the child
            raise
    text = "\n".join(lines) + ("\n" if lines else "")
    return StreamResult(None if timed_out else returncode, text, timed_out)


def _lines_with_timeouts(child: subprocess.Popen, timeout: float) -> Iterator[str | None]:
    """The child's lines as they come; None every `timeout` seconds of silence."""
    pending: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert child.stdout is not None
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


def kill_group(child: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, sig)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(timeout=10)
