"""How the benchmark times one call, as triton.testing.do_bench does it (without depending on
triton): CUDA events around each call; a 256 MB write (`zero_` of an int32 buffer) before every timed
call, so each starts from a cold L2; a warm-up of ~25 ms (at least 3 calls) without flushing; then up
to 100 timed calls in a ~100 ms budget. On the CPU backend: time.perf_counter_ns around as many
back-to-back calls as last at least MIN_SAMPLE_MS per sample, no flush, fewer samples.
Also the card's ceilings (a large copy and a large matmul), timed the same way.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable

import torch

from . import stats
from .stats import sig

# triton's do_bench flush size: several times any current L2 (H100: 50 MB, L4: 48 MB)
L2_FLUSH_BYTES = 256 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class TimingConfig:
    warmup_ms: float  # warm-up budget, without L2 flushes
    rep_ms: float  # budget for the timed calls
    min_warmup: int
    min_reps: int
    max_reps: int
    estimate_calls: int  # calls that estimate the runtime to size the budgets
    # A case whose spread shows a disturbance is timed again at most this often: a disturbance
    # (another process, a clock change) lasts a moment, so one retake usually clears it; the
    # second covers one that spans a retake, and a third would add only time to a case that stays
    # disturbed. 0 for a run that checks the plumbing, not the figures.
    retakes: int = 2

    @classmethod
    def for_device(
        cls,
        device: str,
        warmup_ms: float | None = None,
        rep_ms: float | None = None,
        retakes: int | None = None,
    ):
        if device == "cuda":  # do_bench's defaults (25 ms, 100 ms), with the repeats capped
            base = cls(
                warmup_ms=25, rep_ms=100, min_warmup=3, min_reps=10, max_reps=100, estimate_calls=5
            )
        else:  # CPU calls take ~1-30 ms: a few of them are enough for plumbing numbers
            base = cls(
                warmup_ms=10, rep_ms=150, min_warmup=1, min_reps=5, max_reps=30, estimate_calls=1
            )
        changes = {"warmup_ms": warmup_ms, "rep_ms": rep_ms, "retakes": retakes}
        return dataclasses.replace(base, **{k: v for k, v in changes.items() if v is not None})


class CudaTimer:
    """CUDA events around each call, with a 256 MB write before every timed call to empty the L2."""

    method = "cuda-events"
    flush_bytes = L2_FLUSH_BYTES

    def __init__(self):
        self._flush_buffer = torch.empty(self.flush_bytes // 4, dtype=torch.int32, device="cuda")

    def warm(self, fn: Callable[[], object], count: int) -> None:
        for _ in range(count):
            fn()
        torch.cuda.synchronize()

    def time(self, fn: Callable[[], object], count: int, flush: bool = True) -> list[float]:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(count)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(count)]
        for start, end in zip(starts, ends, strict=True):
            if flush:
                self._flush_buffer.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in zip(starts, ends, strict=True)]


# A CPU sample is a batch of back-to-back calls lasting at least this long: a short call timed alone
# reads the clock's steps and the scheduler's ticks (whole multiples of a tick on a loaded machine),
# a batch their share of its length.
MIN_SAMPLE_MS = 5.0
MAX_CALLS_PER_SAMPLE = 100_000
CALIBRATION_STEPS = 12  # batches tried while sizing one (each at most 10 times the last)


class CpuTimer:
    """The wall clock (`clock`, time.perf_counter_ns) around a batch of calls that lasts at least
    min_sample_ms; a sample is the batch's time per call. The batch is sized afresh on each
    `time`, from batches that double as a warm-up. No cache flush: writing 256 MB takes ~50 ms,
    longer than most cases."""

    method = "perf-counter"
    flush_bytes = 0

    def __init__(
        self,
        min_sample_ms: float = MIN_SAMPLE_MS,
        clock: Callable[[], int] = time.perf_counter_ns,
    ):
        self.min_sample_ms = min_sample_ms
        self._clock = clock

    def warm(self, fn: Callable[[], object], count: int) -> None:
        for _ in range(count):
            fn()

    def _batch_ns(self, fn: Callable[[], object], calls: int) -> int:
        start = self._clock()
        for _ in range(calls):
            fn()
        return self._clock() - start

    def calls_per_sample(self, fn: Callable[[], object]) -> tuple[int, int]:
        """The fewest calls (grown at most tenfold per try) whose batch lasts min_sample_ms, and
        the last batch's time in ns (a sample already, when it reached the minimum)."""
        target = self.min_sample_ms * 1e6
        calls = 1
        for _ in range(CALIBRATION_STEPS):
            elapsed = self._batch_ns(fn, calls)
            if elapsed >= target or calls >= MAX_CALLS_PER_SAMPLE:
                break
            factor = min(10.0, 1.2 * target / elapsed) if elapsed > 0 else 10.0
            calls = min(MAX_CALLS_PER_SAMPLE, max(calls + 1, math.ceil(calls * factor)))
        return calls, elapsed

    def time(self, fn: Callable[[], object], count: int, flush: bool = True) -> list[float]:
        calls, last = self.calls_per_sample(fn)
        # the batch that reached the minimum is the first sample: a call that alone lasts the
        # minimum (most CPU cases) is timed no more often than `count` times
        first = [last] if last >= self.min_sample_ms * 1e6 and count else []
        rest = [self._batch_ns(fn, calls) for _ in range(count - len(first))]
        return [ns / calls / 1e6 for ns in first + rest]


def make_timer(device: str):
    return CudaTimer() if device == "cuda" else CpuTimer()


class UnderXdistError(Exception):
    """Not a RuntimeError, so the per-case error handling never swallows it."""


def xdist_problem() -> str | None:
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        return None
    return (
        f"refusing to time under pytest-xdist (PYTEST_XDIST_WORKER={worker}): other workers "
        "share the GPU and the CPUs. Run `python -m flashmoe_science bench` (or `nox -s bench`) "
        "on its own."
    )


def refuse_under_xdist() -> None:
    """Timings taken while other pytest-xdist workers load the same GPU and CPUs are meaningless."""
    problem = xdist_problem()
    if problem:
        raise UnderXdistError(problem)


@dataclasses.dataclass(frozen=True)
class Timing:
    samples_ms: list[float]
    summary: stats.Summary

    @property
    def median_ms(self) -> float:
        return self.summary.median

    @property
    def iqr_ms(self) -> float:
        return self.summary.iqr


def benchmark(
    fn: Callable[[], object], timer, config: TimingConfig, samples: int | None = None
) -> Timing:
    """do_bench's procedure: estimate the runtime, warm up for warmup_ms, then time calls for rep_ms
    (clamped to [min_reps, max_reps], or exactly `samples` calls), each after an L2 flush."""
    refuse_under_xdist()
    estimate_ms = max(sum(timer.time(fn, config.estimate_calls)) / config.estimate_calls, 1e-4)
    timer.warm(fn, min(max(config.min_warmup, int(config.warmup_ms / estimate_ms)), 10_000))
    count = samples or min(max(config.min_reps, int(config.rep_ms / estimate_ms)), config.max_reps)
    measured = timer.time(fn, count)
    return Timing(measured, stats.summarize(measured))


def host_cost_us(
    fn: Callable[[], object], calls: int, loops: int = 3, warmup: int = 50
) -> list[float]:
    """The time per call, in microseconds, of `calls` back-to-back calls with no synchronisation
    inside the loop: CUDA events around the whole loop, after `warmup` calls; one value per loop.
    What a serving loop without CUDA graphs pays: when the host is slower than the GPU work, the
    GPU waits for it and the events measure the host. No L2 flush (it would queue GPU work)."""
    refuse_under_xdist()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(loops):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) * 1e3 / calls)
    return per_call


def peak_memory_bytes(fn: Callable[[], object], device: str) -> int | None:
    """Peak allocation of one untimed call beyond what was allocated before it (inputs, flush)."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out
    return peak


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


# --------------------------------------------------------------------------------------------------
# Ceilings
# --------------------------------------------------------------------------------------------------


def copy_ceiling(device: str, n_bytes: int, timer, config: TimingConfig) -> dict:
    src = torch.randn(n_bytes // 2, device=device, dtype=torch.float16)
    dst = torch.empty_like(src)
    timing = benchmark(lambda: dst.copy_(src), timer, config)
    moved = 2 * n_bytes  # read + written
    return {
        "bytes": moved,
        "ms": sig(timing.median_ms),
        "gbps": sig(moved / timing.median_ms / 1e6, 4),
    }


def matmul_ceiling(device: str, n: int, dtype: torch.dtype, timer, config: TimingConfig) -> dict:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    timing = benchmark(lambda: a @ b, timer, config)
    return {
        "n": n,
        "dtype": str(dtype).replace("torch.", ""),
        "ms": sig(timing.median_ms),
        "tflops": sig(2 * n**3 / timing.median_ms / 1e9, 4),
    }


def measure_ceilings(device: str, timer, config: TimingConfig) -> dict:
    """What this card reaches on a large copy and a large matmul, timed like the cases."""
    if device == "cuda":  # 512 MiB: ten times any L2; 8192^3 fp16 keeps the tensor cores saturated
        copy_bytes, matmul_n, matmul_dtype = 512 * 2**20, 8192, torch.float16
    else:  # CPU: sizes of ~1-10 ms; fp32 because CPU half-precision matmul is not representative
        copy_bytes, matmul_n, matmul_dtype = 32 * 2**20, 1024, torch.float32
    result = {}
    try:
        result["copy"] = copy_ceiling(device, copy_bytes, timer, config)
        result["matmul"] = matmul_ceiling(device, matmul_n, matmul_dtype, timer, config)
    except RuntimeError as exc:  # out of memory on a small card: percentages are then left out
        result["error"] = first_line(exc)
    if device == "cuda":
        torch.cuda.empty_cache()
    return result
