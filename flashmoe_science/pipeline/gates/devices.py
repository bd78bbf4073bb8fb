"""Which GPU each process of the test stage runs on: every GPU of the machine, one per
pytest-xdist worker, round robin when there are more workers than GPUs.

A worker is pinned by CUDA_VISIBLE_DEVICES in its environment, set when pytest-xdist starts it
(plugin.GateRecorder.pytest_xdist_setupnodes), so nothing in the worker can have touched CUDA
before: each worker sees one GPU, as device 0, and so does every process it starts (a planted-bug
build, a bench subprocess). A crashed worker's replacement keeps its GPU.

The GPUs the stage may use, as CUDA_VISIBLE_DEVICES entries (indexes or UUIDs):
  $FLASHMOE_TEST_DEVICES when set ("0,1"; empty: none): a subset, or a list to try the placement
                         with on a machine without GPUs (the workers then see no GPU at all)
  $CUDA_VISIBLE_DEVICES  when set: the entries it lists ("" hides every GPU)
  else                   every GPU torch counts, "0" to "N-1"
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence

DEVICES_VAR = "FLASHMOE_TEST_DEVICES"
VISIBLE_VAR = "CUDA_VISIBLE_DEVICES"
MAX_WORKERS = 8  # the default ceiling: each worker imports torch and collects the suite
# Each worker's share of the cores: torch's OpenMP pool, and inductor's pool of compile processes
# (torch.compile), both sized to the whole machine by default.
THREAD_VARS = ("OMP_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS")


def split(value: str) -> list[str]:
    """'0, 1,GPU-ab12' -> ['0', '1', 'GPU-ab12']; '' -> []."""
    return [entry.strip() for entry in value.split(",") if entry.strip()]


def _torch_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def visible_devices(
    environ: Mapping[str, str] | None = None, count: Callable[[], int] = _torch_count
) -> list[str]:
    """The GPUs the stage spreads its workers over (see the module's docstring)."""
    environ = os.environ if environ is None else environ
    for name in (DEVICES_VAR, VISIBLE_VAR):
        if name in environ:
            return split(environ[name])
    return [str(index) for index in range(count())]


def device_of(worker: int, devices: Sequence[str]) -> str | None:
    """The GPU of the `worker`-th worker (0-based): round robin over `devices`; None without any."""
    return devices[worker % len(devices)] if devices else None


def worker_count(cpus: int | None, devices: Sequence[str]) -> int:
    """The default number of workers: three per two CPU cores up to MAX_WORKERS, and at least one
    per GPU, so that no GPU of the machine sits idle. The half worker over the cores fills the time
    the others wait on the subprocesses many tests start (builds, act, nested pytest runs): on 2
    cores the stage took 193 s with 2 workers, 172.5 s with 3, 174.9 s with 4
    (benches/notes/harness.md v5.4)."""
    return max(len(devices), min(MAX_WORKERS, (cpus or 1) * 3 // 2), 1)


def threads_per_worker(cpus: int | None, workers: int) -> int:
    """CPU threads each worker's torch may use: the cores shared out, at least one. torch's default
    is every core in every process, so n workers ran n times too many threads and the CPU gates'
    spinning OpenMP threads took each other's cores (benches/notes/harness.md v5.3)."""
    return max(1, (cpus or 1) // max(1, workers))


def placement_text(workers: int, devices: Sequence[str]) -> str:
    """'8 workers over 2 GPUs (CUDA_VISIBLE_DEVICES 0, 1), 4 on each' for the stage's log."""
    if not devices or workers < 1:
        return ""
    used = sorted({device_of(i, devices) for i in range(workers)}, key=list(devices).index)
    text = (
        f"{workers} worker{'s' if workers != 1 else ''} over {len(used)} "
        f"GPU{'s' if len(used) != 1 else ''} ({VISIBLE_VAR} {', '.join(used)})"
    )
    if len(used) > 1 and workers % len(used) == 0:
        text += f", {workers // len(used)} on each"
    return text


def gpu_name() -> str | None:
    """The name of the GPU this process uses (its device 0), where torch is loaded and sees one;
    never the first thing to touch CUDA in a process that has not imported torch."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # a driver error at the end of a run must not lose the run's record
        return None
