"""`python -m flashmoe_science bench` (`nox -s bench -- ARGS`): time our kernels against PyTorch's
SDPA, and optionally the head of the tree against a base commit.

    python -m flashmoe_science bench              # default matrix (scaled down on the CPU backend)
    python -m flashmoe_science bench --quick      # 2 prefill, 1 decode, 1 small case
    python -m flashmoe_science bench --case 'dec-*'   # ids or globs; --list prints the selection
    python -m flashmoe_science bench --base main --fail-on-regression
    git bisect run nox -s bench -- --bisect CASE --max-ms T

Timing, as triton.testing.do_bench does it (without depending on triton): CUDA events around each
call; a 256 MB write (`zero_` of an int32 buffer) before every timed call, so each starts from a
cold L2; a warm-up of ~25 ms (at least 3 calls) without flushing; then up to 100 timed calls in a
~100 ms budget. The median and the interquartile range are reported. On the CPU backend:
time.perf_counter, no flush, fewer calls: those numbers check the plumbing and say nothing about a
GPU. Inputs are torch.randn (seeded).

Baselines, in the same process: F.scaled_dot_product_attention with each backend forced through
torch.nn.attention.sdpa_kernel (FLASH_ATTENTION, CUDNN_ATTENTION, EFFICIENT_ATTENTION), and with its
own choice ("sdpa-default"). A backend that refuses a case is recorded as "unsupported" with its
reason. "ratio" is SDPA's time / ours: above 1, ours is faster.

Read floor (decode cases on CUDA, "read_floor"): the fastest of a few Triton kernels that only read
the case's K and V, timed the same way (flashmoe_science.pipeline.readfloor). No decode kernel is expected
to beat it by much, so SDPA's time over it bounds what any kernel can gain on SDPA there; its
"ratio" is its time / ours (1 would be a decode as fast as a bare read).

Head against base (`--base REF`): REF is checked out as a git worktree in
<build root>/worktrees/<sha12> and built by its own `python -m flashmoe_science build` into its own
build root (<sha12>.build beside it): two builds of one torch library namespace cannot share a
process. One worker process per side (`python -m flashmoe_science.pipeline.bench --worker`, started in its
tree) times one case per JSON-lines request. Requests alternate base, head, base, head, ... for
--rounds rounds per case, so drift of clocks or temperature hits both sides alike. A case is a
"regression" or an "improvement" only when the medians differ by more than --threshold percent AND
a Mann-Whitney U test gives p < --alpha (flashmoe_science.pipeline.stats, after asv), so identical code comes
out "no change" on a GPU. (On the CPU backend, separate processes running identical code were
measured up to 2x apart on a 2-vCPU VM: CPU comparisons check the plumbing only.) `--base-dir DIR`
uses an existing checkout as the base instead of a worktree.

When the base cannot be timed (its tree has no bench module, it does not build, or its worker dies),
the comparison falls back to a stored result for this GPU model. Every full default-matrix run of a
clean tree appends its raw samples to <build root>/bench-history/<gpu-model>.json (the last 20 runs;
--history DIR or FLASHMOE_BENCH_HISTORY moves it; CI can cache that folder). The stored run used is
REF's own, else the newest one of an ancestor of REF. bench.json says comparison.source = "stored"
(samples from another run: machine drift is not controlled), or "none" when nothing is stored, and
gives the reason either way.

Bisecting a slowdown (the `git bisect run` contract; asv find does the same with a threshold):
    git bisect start BAD GOOD
    git bisect run nox -s bench -- --bisect fwd-bf16-d128-h16-b4-s4096-causal --max-ms 1.25
exits 0 when the case's median is below --max-ms (good), 1 when it is not (bad), 125 when the commit
cannot be built or the case does not run on it (skip), and 255 when the environment is broken, e.g.
no GPU, which aborts the bisect instead of blaming commits. Pick --max-ms between the good and the
bad timings measured on the same machine. Every commit bisected needs this bench command: older ones
fail in a way git bisect counts as bad, so bisect older ranges with a driver script kept outside the
tree. --backend cpu bisects CPU timings on a machine without a GPU.

Exit codes (flashmoe_science.pipeline.exitcodes): 0 ok; 1 a regression with --fail-on-regression, or our
kernel failed on a case; 2 usage; 125 this checkout does not build; 255 environment broken (no
torch, no GPU for --backend cuda or --bisect, running under pytest-xdist).

Output: <report dir>/bench.json (schema "flashmoe-science/bench/1", benches/bench.schema.json) and
<report dir>/bench.md. Worker requests have no timeout: the CI job's timeout bounds a hung worker.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import fnmatch
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import build, exitcodes, paths, readfloor, stats

SCHEMA = "flashmoe-science/bench/1"
WORKER_PROTOCOL = 1
# triton's do_bench flush size: several times any current L2 (H100: 50 MB, L4: 48 MB)
L2_FLUSH_BYTES = 256 * 1024 * 1024
KV_CACHE_LIMIT_BYTES = 8 * 1024**3  # decode cases whose K+V exceed this are left out of the matrix
HISTORY_KEEP = 20

# --------------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------------

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
ELEMENT_BYTES = 2

_ID_RE = re.compile(
    r"^(?P<kind>fwd|dec)-(?P<dtype>fp16|bf16)-d(?P<d>\d+)-h(?P<hq>\d+)(?:kv(?P<hkv>\d+))?"
    r"-b(?P<b>\d+)-(?:s(?P<s>\d+)|q(?P<sq>\d+)-k(?P<sk>\d+))(?:-(?P<mask>causal|full))?$"
)


@dataclasses.dataclass(frozen=True)
class Case:
    """One attention shape. prefill runs flash_attention_forward, decode flash_attention_decode."""

    kind: str  # "prefill" or "decode"
    dtype: str  # "fp16" or "bf16"
    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool
    group: str = ""  # "prefill", "decode" or "small": where in the matrix it comes from

    def __post_init__(self):
        if not self.group:
            object.__setattr__(self, "group", self.kind)

    @property
    def id(self) -> str:
        heads = f"h{self.heads_q}" + (f"kv{self.heads_kv}" if self.heads_kv != self.heads_q else "")
        kind = "dec" if self.kind == "decode" else "fwd"
        head = f"{kind}-{self.dtype}-d{self.head_dim}-{heads}-b{self.batch}"
        if self.kind == "decode":  # always causal: the queries are the last positions of the cache
            return f"{head}-q{self.seqlen_q}-k{self.seqlen_k}"
        lengths = (
            f"s{self.seqlen_q}"
            if self.seqlen_q == self.seqlen_k
            else f"q{self.seqlen_q}-k{self.seqlen_k}"
        )
        return f"{head}-{lengths}-{'causal' if self.causal else 'full'}"

    @property
    def flops(self) -> int:
        """4*B*H*Sq*Sk*D (FA2 paper accounting), halved for causal only when Sq == Sk."""
        flops = 4 * self.batch * self.heads_q * self.seqlen_q * self.seqlen_k * self.head_dim
        return flops // 2 if self.causal and self.seqlen_q == self.seqlen_k else flops

    @property
    def kv_bytes(self) -> int:
        return 2 * self.batch * self.heads_kv * self.seqlen_k * self.head_dim * ELEMENT_BYTES

    @property
    def bytes_moved(self) -> int:
        """Bytes that must cross HBM at least once: K and V, plus q read and out written."""
        q_and_out = 2 * self.batch * self.heads_q * self.seqlen_q * self.head_dim * ELEMENT_BYTES
        return self.kv_bytes + q_and_out

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Case:
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in fields})


def parse_case_id(case_id: str) -> Case:
    match = _ID_RE.match(case_id)
    if not match:
        raise ValueError(
            f"bad case id {case_id!r}: expected e.g. fwd-bf16-d128-h16-b4-s4096-causal or "
            "dec-bf16-d128-h32kv8-b4-q1-k8192 (`bench --list` prints the matrix)"
        )
    g = match.groupdict()
    kind = "decode" if g["kind"] == "dec" else "prefill"
    if kind == "prefill" and g["mask"] is None:
        raise ValueError(f"bad case id {case_id!r}: a prefill id ends in -causal or -full")
    if kind == "decode" and g["mask"] is not None:
        raise ValueError(f"bad case id {case_id!r}: a decode id has no -causal/-full suffix")
    seqlen_q = int(g["s"] or g["sq"])
    heads_q = int(g["hq"])
    return Case(
        kind=kind,
        dtype=g["dtype"],
        batch=int(g["b"]),
        heads_q=heads_q,
        heads_kv=int(g["hkv"] or heads_q),
        seqlen_q=seqlen_q,
        seqlen_k=int(g["s"] or g["sk"]),
        head_dim=int(g["d"]),
        causal=kind == "decode" or g["mask"] == "causal",
    )


def prefill_cases(seqlens, tokens, heads_for_dim, dtypes=("fp16", "bf16")) -> list[Case]:
    """B*S = tokens for every S (the FA2 benchmark's 16k-token sweep)."""
    return [
        Case("prefill", dtype, tokens // s, heads, heads, s, s, d, causal)
        for dtype in dtypes
        for d, heads in heads_for_dim.items()
        for s in seqlens
        for causal in (False, True)
    ]


def decode_cases(
    kv_lens, batches, heads_q, heads_kv, head_dim=128, limit=KV_CACHE_LIMIT_BYTES
) -> list[Case]:
    cases = [
        Case("decode", dtype, b, heads_q, hkv, 1, kv, head_dim, True)
        for dtype in ("bf16", "fp16")
        for hkv in heads_kv
        for b in batches
        for kv in kv_lens
    ]
    return [c for c in cases if c.kv_bytes <= limit]


def small_cases(heads=(1, 8), seqlens=(128, 512)) -> list[Case]:
    """Shapes a user reported as slow: one sequence, few heads; launch and tail effects dominate."""
    return [
        Case("prefill", "fp16", 1, h, h, s, s, 64, False, group="small")
        for h in heads
        for s in seqlens
    ]


def gpu_matrix() -> list[Case]:
    return [
        *prefill_cases((128, 256, 512, 1024, 2048, 4096, 8192, 16384), 16384, {64: 32, 128: 16}),
        *decode_cases((1024, 4096, 8192, 16384, 32768, 65536, 131072), (1, 4, 16), 32, (32, 8)),
        *small_cases(),
    ]


def cpu_matrix() -> list[Case]:
    """The GPU matrix shrunk until the CPU implementation gets through it in ~30 s on 2 cores."""
    return [
        *prefill_cases((128, 256, 512), 1024, {64: 4, 128: 2}),
        *decode_cases((1024, 4096), (1, 4), 8, (8, 2)),
        *small_cases(),
    ]


QUICK_IDS = {
    "cuda": (
        "fwd-bf16-d128-h16-b4-s4096-causal",
        "fwd-fp16-d64-h32-b16-s1024-full",
        "dec-bf16-d128-h32kv8-b16-q1-k8192",
        "fwd-fp16-d64-h8-b1-s512-full",
    ),
    "cpu": (
        "fwd-bf16-d128-h2-b4-s256-causal",
        "fwd-fp16-d64-h4-b8-s128-full",
        "dec-bf16-d128-h8kv2-b4-q1-k1024",
        "fwd-fp16-d64-h1-b1-s128-full",
    ),
}


def default_matrix(device: str) -> list[Case]:
    return gpu_matrix() if device == "cuda" else cpu_matrix()


def select_cases(device: str, quick: bool = False, patterns: Sequence[str] = ()) -> list[Case]:
    """The default matrix, its --quick subset, or the cases named by ids or globs (in order)."""
    matrix = default_matrix(device)
    by_id = {c.id: c for c in matrix}
    if quick:
        return [by_id[i] for i in QUICK_IDS[device]]
    if not patterns:
        return matrix
    chosen: dict[str, Case] = {}
    for pattern in patterns:
        if any(ch in pattern for ch in "*?["):
            hits = [c for c in matrix if fnmatch.fnmatchcase(c.id, pattern)]
            if not hits:
                raise ValueError(
                    f"--case {pattern!r} matches nothing in the {device} matrix (see --list)"
                )
            chosen.update((c.id, c) for c in hits)
        else:
            chosen[pattern] = by_id.get(pattern) or parse_case_id(pattern)
    return list(chosen.values())


# --------------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TimingConfig:
    warmup_ms: float  # warm-up budget, without L2 flushes
    rep_ms: float  # budget for the timed calls
    min_warmup: int
    min_reps: int
    max_reps: int
    estimate_calls: int  # calls that estimate the runtime to size the budgets

    @classmethod
    def for_device(cls, device: str, warmup_ms: float | None = None, rep_ms: float | None = None):
        if device == "cuda":  # do_bench's defaults (25 ms, 100 ms), with the repeats capped
            base = cls(
                warmup_ms=25, rep_ms=100, min_warmup=3, min_reps=10, max_reps=100, estimate_calls=5
            )
        else:  # CPU calls take ~1-30 ms: a few of them are enough for plumbing numbers
            base = cls(
                warmup_ms=10, rep_ms=150, min_warmup=1, min_reps=5, max_reps=30, estimate_calls=1
            )
        changes = {"warmup_ms": warmup_ms, "rep_ms": rep_ms}
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


class CpuTimer:
    """Wall clock per call. No cache flush: writing 256 MB takes ~50 ms, longer than most cases."""

    method = "perf-counter"
    flush_bytes = 0

    def warm(self, fn: Callable[[], object], count: int) -> None:
        for _ in range(count):
            fn()

    def time(self, fn: Callable[[], object], count: int, flush: bool = True) -> list[float]:
        samples = []
        for _ in range(count):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        return samples


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


# --------------------------------------------------------------------------------------------------
# What is timed: our kernels and the SDPA baselines
# --------------------------------------------------------------------------------------------------

BASELINES = {
    "sdpa-flash": SDPBackend.FLASH_ATTENTION,
    "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
    "sdpa-default": None,  # SDPA's own choice, which differs by GPU and torch version
}


@dataclasses.dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


def make_inputs(case: Case, device: str, seed: int = 0) -> Inputs:
    generator = torch.Generator(device=device).manual_seed(seed)
    dtype = DTYPES[case.dtype]

    def randn(heads: int, seqlen: int) -> torch.Tensor:
        shape = (case.batch, heads, seqlen, case.head_dim)
        return torch.randn(shape, generator=generator, device=device, dtype=dtype)

    return Inputs(
        randn(case.heads_q, case.seqlen_q),
        randn(case.heads_kv, case.seqlen_k),
        randn(case.heads_kv, case.seqlen_k),
    )


def _ops():
    """flashmoe_science.ops, imported late: importing it loads the extension (building it when
    stale), which must happen in build_checkout, where a failed build becomes exit 125."""
    from .. import ops

    return ops


def our_call(case: Case, x: Inputs) -> Callable[[], torch.Tensor]:
    ops = _ops()
    if case.kind == "decode":
        return lambda: ops.flash_attention_decode(x.q, x.k, x.v, None, causal=case.causal)
    return lambda: ops.flash_attention_forward(x.q, x.k, x.v, causal=case.causal)


_sdpa_has_enable_gqa: bool | None = None


def sdpa_supports_gqa() -> bool:
    """enable_gqa came with torch 2.5; older versions get K and V repeated outside the timing."""
    global _sdpa_has_enable_gqa
    if _sdpa_has_enable_gqa is None:
        tiny = torch.zeros(1, 2, 1, 8)
        try:
            F.scaled_dot_product_attention(tiny, tiny[:, :1], tiny[:, :1], enable_gqa=True)
            _sdpa_has_enable_gqa = True
        except TypeError:
            _sdpa_has_enable_gqa = False
    return _sdpa_has_enable_gqa


def sdpa_call(case: Case, x: Inputs) -> tuple[Callable[[], torch.Tensor] | None, str | None]:
    """(callable, None), or (None, why SDPA cannot express this case)."""
    if case.causal and case.seqlen_q == case.seqlen_k:
        is_causal = True
    elif not case.causal or case.seqlen_q == 1:
        is_causal = False  # one query at the end of the cache sees every key: no mask
    else:
        return (
            None,
            "SDPA's is_causal is aligned top-left, ours bottom-right: they differ when Sq != Sk",
        )
    k, v, kwargs = x.k, x.v, {}
    if case.heads_q != case.heads_kv:
        if sdpa_supports_gqa():
            kwargs["enable_gqa"] = True
        else:
            group = case.heads_q // case.heads_kv
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return lambda: F.scaled_dot_product_attention(x.q, k, v, is_causal=is_causal, **kwargs), None


def backend_context(backend):
    return contextlib.nullcontext() if backend is None else sdpa_kernel(backend)


def _first_call(fn: Callable[[], object]) -> str | None:
    """Run fn once; None if it worked, else why not (SDPA explains refusals in warnings)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = fn()
            del out
            return None
        except Exception as exc:  # a refusal (RuntimeError) or an argument our op rejects
            reasons = [str(w.message).strip() for w in caught]
            reasons.append(_first_line(exc))
            return "; ".join(dict.fromkeys(r for r in reasons if r))[:600]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _is_refusal(reason: str) -> bool:
    return "No available kernel" in reason or "No viable backend" in reason


# --------------------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------------------


def _sig(value: float | None, digits: int = 5) -> float | None:
    return None if value is None or not math.isfinite(value) else float(f"{value:.{digits}g}")


def figures(case: Case, timing: Timing, ceilings: dict) -> dict:
    seconds = timing.median_ms * 1e-3
    tflops = case.flops / seconds / 1e12 if seconds > 0 else None
    gbps = case.bytes_moved / seconds / 1e9 if seconds > 0 else None
    peak_tflops = ceilings.get("matmul", {}).get("tflops")
    peak_gbps = ceilings.get("copy", {}).get("gbps")
    s = timing.summary
    return {
        "status": "ok",
        "median_ms": _sig(s.median),
        "q1_ms": _sig(s.q1),
        "q3_ms": _sig(s.q3),
        "iqr_ms": _sig(s.iqr),
        "n": s.n,
        "tflops": _sig(tflops, 4),
        "gbps": _sig(gbps, 4),
        "pct_matmul_ceiling": _sig(100 * tflops / peak_tflops, 3)
        if tflops and peak_tflops
        else None,
        "pct_copy_ceiling": _sig(100 * gbps / peak_gbps, 3) if gbps and peak_gbps else None,
    }


def measure(
    fn, backend, case: Case, device: str, timer, config: TimingConfig, ceilings: dict
) -> dict:
    """Time one implementation on one case; a refusal or a failure becomes a record, not a raise."""
    with backend_context(backend):
        problem = _first_call(fn)
        if problem is not None:
            status = "unsupported" if _is_refusal(problem) else "error"
            return {"status": status, "reason": problem}
        try:
            peak = peak_memory_bytes(fn, device)
            timing = benchmark(fn, timer, config)
        except RuntimeError as exc:  # out of memory, or a failure that shows only on repetition
            return {"status": "error", "reason": _first_line(exc)}
    return {
        **figures(case, timing, ceilings),
        "peak_mem_bytes": peak,
        "samples_ms": [_sig(t) for t in timing.samples_ms],
    }


def read_floor(case: Case, x: Inputs, device: str, timer, config: TimingConfig, calls=None) -> dict:
    """The fastest of readfloor's pure reads of this case's K and V, each measured as the cases
    are (`measure`): what any decode kernel that reads those bytes could reach on this card."""
    try:
        calls = calls if calls is not None else readfloor.read_calls(x.k, x.v)
    except ImportError as exc:
        return {"status": "unsupported", "reason": f"the read floor needs Triton: {exc}"}
    best = None
    for name, fn in calls.items():
        result = measure(fn, None, case, device, timer, config, {})
        if result["status"] != "ok":
            return {"status": result["status"], "reason": f"{name}: {result['reason']}"}
        if best is None or result["median_ms"] < best[1]:
            best = (name, result["median_ms"])
    name, median_ms = best
    return {
        "status": "ok",
        "median_ms": median_ms,
        "gbps": _sig(case.kv_bytes / median_ms / 1e6, 4),
        "config": name,
    }


def run_case(
    case: Case, device: str, timer, config: TimingConfig, ceilings: dict, baselines: bool
) -> dict:
    x = make_inputs(case, device)
    entry = {"id": case.id, **case.to_dict(), "flops": case.flops, "bytes": case.bytes_moved}
    entry["ours"] = measure(our_call(case, x), None, case, device, timer, config, ceilings)
    if case.kind == "decode" and device == "cuda":
        floor = read_floor(case, x, device, timer, config)
        if floor["status"] == "ok" and entry["ours"]["status"] == "ok":
            floor["ratio"] = _sig(floor["median_ms"] / entry["ours"]["median_ms"], 4)
        entry["read_floor"] = floor
    entry["baselines"] = {}
    for name, backend in BASELINES.items() if baselines else ():
        fn, reason = sdpa_call(case, x)
        result = (
            measure(fn, backend, case, device, timer, config, ceilings)
            if fn
            else {"status": "unsupported", "reason": reason}
        )
        # raw samples are kept for our kernel only (history, comparison)
        result.pop("samples_ms", None)
        if result["status"] == "ok" and entry["ours"]["status"] == "ok":
            result["ratio"] = _sig(result["median_ms"] / entry["ours"]["median_ms"], 4)
        entry["baselines"][name] = result
    del x
    if device == "cuda":
        torch.cuda.empty_cache()  # the next case may need what this one's SDPA workspaces held
    return entry


def copy_ceiling(device: str, n_bytes: int, timer, config: TimingConfig) -> dict:
    src = torch.randn(n_bytes // 2, device=device, dtype=torch.float16)
    dst = torch.empty_like(src)
    timing = benchmark(lambda: dst.copy_(src), timer, config)
    moved = 2 * n_bytes  # read + written
    return {
        "bytes": moved,
        "ms": _sig(timing.median_ms),
        "gbps": _sig(moved / timing.median_ms / 1e6, 4),
    }


def matmul_ceiling(device: str, n: int, dtype: torch.dtype, timer, config: TimingConfig) -> dict:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    timing = benchmark(lambda: a @ b, timer, config)
    return {
        "n": n,
        "dtype": str(dtype).replace("torch.", ""),
        "ms": _sig(timing.median_ms),
        "tflops": _sig(2 * n**3 / timing.median_ms / 1e9, 4),
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
        result["error"] = _first_line(exc)
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


# --------------------------------------------------------------------------------------------------
# Machine and checkout
# --------------------------------------------------------------------------------------------------


def _git(*args: str, cwd: Path = paths.REPO_ROOT, check: bool = True) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    if check and done.returncode != 0:
        raise RuntimeError(
            f"git {' '.join(args)} failed: {done.stderr.strip() or done.stdout.strip()}"
        )
    return done.stdout.strip()


def commit_info(tree: Path = paths.REPO_ROOT) -> dict | None:
    """HEAD's sha, and whether the tree differs from it (untracked files count: they are code)."""
    try:
        return {
            "sha": _git("rev-parse", "HEAD", cwd=tree),
            "dirty": bool(_git("status", "--porcelain", cwd=tree)),
        }
    except (OSError, RuntimeError, subprocess.SubprocessError):
        return None


def gpu_info(device: str) -> dict | None:
    if device != "cuda":
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "memory_bytes": props.total_memory,
    }


def driver_version() -> str | None:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
        return out.splitlines()[0].strip() if out else None
    return None


def machine_slug(gpu: dict | None) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'; CPU runs: 'cpu-x86_64'."""
    name = gpu["name"] if gpu else f"cpu-{platform.machine()}"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


# --------------------------------------------------------------------------------------------------
# Running the matrix
# --------------------------------------------------------------------------------------------------


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def run_matrix(
    cases: Sequence[Case], device: str, config: TimingConfig, baselines: bool, say=print
) -> dict:
    timer = make_timer(device)
    gpu = gpu_info(device)
    start = time.monotonic()
    where = gpu["name"] if gpu else "the CPU"
    say(f"bench: {len(cases)} cases on {where} ({timer.method}); measuring ceilings")
    ceilings = measure_ceilings(device, timer, config)
    doc = {
        "schema": SCHEMA,
        "timestamp": _now(),
        "backend": device,
        "gpu": gpu,
        "driver": driver_version() if device == "cuda" else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if device == "cuda" else None,
        "commit": commit_info(),
        "timing": {
            "method": timer.method,
            "l2_flush_bytes": timer.flush_bytes,
            **dataclasses.asdict(config),
        },
        "ceilings": ceilings,
        "cases": [],
        "comparison": None,
    }
    for index, case in enumerate(cases, 1):
        entry = run_case(case, device, timer, config, ceilings, baselines)
        doc["cases"].append(entry)
        elapsed = time.monotonic() - start
        say(
            f"[{index}/{len(cases)}] {case.id} ... {_progress_text(entry)} "
            f"({elapsed:.1f} s elapsed)"
        )
    return doc


def _progress_text(entry: dict) -> str:
    ours = entry["ours"]
    if ours["status"] != "ok":
        return f"{ours['status'].upper()}: {ours['reason'][:160]}"
    text = f"{ours['median_ms']:.4g} ms"
    default = entry["baselines"].get("sdpa-default", {})
    if default.get("ratio"):
        text += f" (sdpa-default {default['median_ms']:.4g} ms, x{default['ratio']:.3g})"
    return text


# --------------------------------------------------------------------------------------------------
# Head against base: worker processes, interleaving, verdicts
# --------------------------------------------------------------------------------------------------


class WorkerError(RuntimeError):
    """One request failed (the case does not run on that side); the worker lives on."""


class WorkerDied(RuntimeError):
    """The worker process is gone or speaks another protocol."""


class Worker:
    """A `python -m flashmoe_science.pipeline.bench --worker` process in one tree, speaking JSON lines."""

    def __init__(
        self, name: str, tree: Path, env: dict, device: str, timing_args: Sequence[str] = ()
    ):
        self.name = name
        command = [
            sys.executable,
            "-m",
            "flashmoe_science.pipeline.bench",
            "--worker",
            "--backend",
            device,
            *timing_args,
        ]
        self.process = subprocess.Popen(
            command,
            cwd=tree,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        hello = self._receive()
        if hello.get("protocol") != WORKER_PROTOCOL:
            self.close()
            raise WorkerDied(
                f"{name} worker speaks protocol {hello.get('protocol')}, we speak {WORKER_PROTOCOL}"
            )

    def _receive(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            code = self.process.wait()
            raise WorkerDied(
                f"the {self.name} worker exited ({code}); its errors are printed above"
            )
        return json.loads(line)

    def time(self, case: Case, samples: int) -> list[float]:
        try:
            self.process.stdin.write(
                json.dumps({"op": "time", "case": case.to_dict(), "samples": samples}) + "\n"
            )
            self.process.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise WorkerDied(f"the {self.name} worker is gone: {exc}") from exc
        reply = self._receive()
        if not reply.get("ok"):
            raise WorkerError(reply.get("error", "unknown error"))
        return reply["samples_ms"]

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.process.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def interleaved_order(rounds: int) -> list[str]:
    """base, head, base, head, ...: both sides see the same drift of clocks and temperature."""
    return ["base", "head"] * rounds


def compare_interleaved(
    cases: Sequence[Case],
    workers: dict,
    rounds: int,
    samples_per_round: int,
    threshold: float,
    alpha: float,
    say=print,
) -> list[dict]:
    """Time every case on both workers in alternation and decide each with stats.decide."""
    results = []
    start = time.monotonic()
    for index, case in enumerate(cases, 1):
        samples: dict[str, list[float]] = {"base": [], "head": []}
        try:
            for side in interleaved_order(rounds):
                samples[side].extend(workers[side].time(case, samples_per_round))
        except WorkerError as exc:
            results.append({"id": case.id, "verdict": "missing", "reason": f"{side}: {exc}"[:600]})
            say(f"[{index}/{len(cases)}] compare {case.id} ... missing ({side}: {str(exc)[:120]})")
            continue
        verdict = stats.decide(samples["base"], samples["head"], threshold, alpha)
        results.append({"id": case.id, **_verdict_fields(verdict)})
        elapsed = time.monotonic() - start
        say(
            f"[{index}/{len(cases)}] compare {case.id} ... {_verdict_text(verdict)} "
            f"({elapsed:.1f} s elapsed)"
        )
    return results


def _verdict_fields(verdict: stats.Verdict) -> dict:
    return {k: (_sig(v) if isinstance(v, float) else v) for k, v in verdict.to_dict().items()}


def _verdict_text(verdict: stats.Verdict) -> str:
    p = f"p={verdict.p_value:.2g}" if verdict.p_value is not None else "too few samples for a test"
    return (
        f"base {verdict.base.median:.4g} ms, head {verdict.head.median:.4g} ms: {verdict.verdict} "
        f"({(verdict.ratio - 1) * 100:+.1f}%, {p})"
    )


class BaseUnavailable(Exception):
    """The base cannot be timed side by side; the message says why (it goes into bench.json)."""


def resolve_ref(ref: str) -> str:
    try:
        return _git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    except RuntimeError:
        return ""


def _commit_has_file(sha: str, path: str) -> bool:
    done = subprocess.run(
        ["git", "cat-file", "-e", f"{sha}:{path}"], cwd=paths.REPO_ROOT, capture_output=True
    )
    return done.returncode == 0


def prepare_worktree(sha: str) -> Path:
    """A detached worktree of sha under <build root>/worktrees, reused (with its build) if clean."""
    tree = paths.build_root().resolve() / "worktrees" / sha[:12]
    if (tree / ".git").exists() and commit_info(tree) == {"sha": sha, "dirty": False}:
        return tree
    with contextlib.suppress(RuntimeError):
        _git("worktree", "remove", "--force", str(tree))
    shutil.rmtree(tree, ignore_errors=True)
    tree.parent.mkdir(parents=True, exist_ok=True)
    try:
        _git("worktree", "prune")
        _git("worktree", "add", "--detach", "--force", str(tree), sha)
    except RuntimeError as exc:
        raise BaseUnavailable(f"cannot create a worktree of {sha[:12]}: {exc}") from exc
    return tree


def side_env(tree: Path, build_root: Path | None, report_dir: Path | None) -> dict:
    """The environment a side's build and worker run in: its own tree first on the path, and for the
    base its own build root and report dir, so neither its library nor its build.json touch ours."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.pop("PYTEST_XDIST_WORKER", None)
    if build_root is not None:
        env["FLASHMOE_BUILD_ROOT"] = str(build_root)
    if report_dir is not None:
        env["FLASHMOE_REPORT_DIR"] = str(report_dir)
    return env


def build_base(tree: Path, env: dict, log_path: Path, say=print) -> None:
    say(f"bench: building the base in {tree} into {env['FLASHMOE_BUILD_ROOT']} (log {log_path})")
    with open(log_path, "w") as log:
        code = subprocess.call(
            [sys.executable, "-m", "flashmoe_science", "build"],
            cwd=tree,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    if code != 0:
        lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
        tail = " | ".join(lines[-3:])[:400]
        raise BaseUnavailable(f"the base does not build (exit {code}): {tail}; log: {log_path}")


def base_dirs(tree: Path, sha: str | None) -> tuple[Path, Path]:
    """(build root, report dir) of the base, beside the worktree (see paths.base_dirs)."""
    return paths.base_dirs(tree, sha)


def compare_with_tree(tree: Path, sha: str | None, cases, device, args, say=print) -> list[dict]:
    if not (tree / "flashmoe_science" / "bench.py").exists():
        raise BaseUnavailable(
            f"the base tree has no bench command (no flashmoe_science/bench.py in {tree})"
        )
    if device == "cpu":
        say(
            "bench: note: on the CPU backend, separate processes running identical code have been "
            "measured up to 2x apart (2-vCPU VM); read CPU verdicts as a check of the plumbing"
        )
    build_root, base_reports = base_dirs(tree, sha)
    base_reports.mkdir(parents=True, exist_ok=True)
    env = side_env(tree, build_root, base_reports)
    build_base(tree, env, base_reports.parent / f"{build_root.name}.log", say)
    timing_args = []
    for flag, value in (("--warmup-ms", args.warmup_ms), ("--rep-ms", args.rep_ms)):
        timing_args += [flag, str(value)] if value is not None else []
    if device == "cuda":
        torch.cuda.empty_cache()  # leave the card's memory to the two workers
    workers = {}
    try:
        workers["base"] = Worker("base", tree, env, device, timing_args)
        workers["head"] = Worker(
            "head", paths.REPO_ROOT, side_env(paths.REPO_ROOT, None, None), device, timing_args
        )
        samples = args.samples_per_round or (20 if device == "cuda" else 3)
        say(
            f"bench: comparing {len(cases)} cases: {args.rounds} rounds of base, head "
            f"x {samples} calls"
        )
        return compare_interleaved(
            cases, workers, args.rounds, samples, args.threshold / 100, args.alpha, say
        )
    except WorkerDied as exc:
        raise BaseUnavailable(str(exc)) from exc
    finally:
        for worker in workers.values():
            worker.close()


# --------------------------------------------------------------------------------------------------
# Stored results (fallback reference)
# --------------------------------------------------------------------------------------------------


def history_dir(override: str | None = None) -> Path:
    return Path(
        override or os.environ.get("FLASHMOE_BENCH_HISTORY") or paths.build_root() / "bench-history"
    )


def load_history(path: Path) -> list[dict]:
    try:
        return json.loads(path.read_text()).get("entries", [])
    except (OSError, ValueError):
        return []


def record_history(doc: dict, directory: Path) -> Path:
    """Append this run's raw samples to the GPU model's history (atomically; keeps HISTORY_KEEP)."""
    path = directory / f"{machine_slug(doc['gpu'])}.json"
    entry = {
        "commit": doc["commit"]["sha"],
        "timestamp": doc["timestamp"],
        "torch": doc["torch"],
        "cuda": doc["cuda"],
        "samples_ms": {
            c["id"]: c["ours"]["samples_ms"] for c in doc["cases"] if c["ours"]["status"] == "ok"
        },
    }
    entries = [*load_history(path), entry][-HISTORY_KEEP:]
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=directory, delete=False, suffix=".tmp") as tmp:
        json.dump(
            {
                "schema": "flashmoe-science/bench-history/1",
                "machine": path.stem,
                "entries": entries,
            },
            tmp,
        )
    os.replace(tmp.name, path)
    return path


def _is_ancestor(maybe_ancestor: str, sha: str) -> bool:
    done = subprocess.run(
        ["git", "merge-base", "--is-ancestor", maybe_ancestor, sha],
        cwd=paths.REPO_ROOT,
        capture_output=True,
    )
    return done.returncode == 0


def stored_reference(
    entries: Sequence[dict], base_sha: str, is_ancestor=_is_ancestor
) -> dict | None:
    """The stored run of base_sha itself, else the newest one on an ancestor of base_sha."""
    for entry in reversed(entries):
        if entry.get("commit") == base_sha:
            return entry
    for entry in reversed(entries):
        if entry.get("commit") and is_ancestor(entry["commit"], base_sha):
            return entry
    return None


def compare_with_stored(entry: dict, doc: dict, threshold: float, alpha: float) -> list[dict]:
    results = []
    for case in doc["cases"]:
        base = entry["samples_ms"].get(case["id"])
        if not base or case["ours"]["status"] != "ok":
            results.append(
                {
                    "id": case["id"],
                    "verdict": "missing",
                    "reason": "not in the stored run" if not base else case["ours"]["reason"],
                }
            )
            continue
        verdict = stats.decide(base, case["ours"]["samples_ms"], threshold, alpha)
        results.append({"id": case["id"], **_verdict_fields(verdict)})
    return results


def comparison_record(
    source: str, base: dict, results: list[dict] | None, args, reason: str | None = None
) -> dict:
    verdicts = [r["verdict"] for r in results or ()]
    return {
        "source": source,
        "base": base,
        "reason": reason,
        "threshold": args.threshold / 100,
        "alpha": args.alpha,
        "rounds": args.rounds if source == "worktree" else None,
        "summary": {
            v: verdicts.count(v)
            for v in (stats.REGRESSION, stats.IMPROVEMENT, stats.NO_CHANGE, "missing")
        },
        "cases": results or [],
    }


def compare(doc: dict, cases: Sequence[Case], device: str, args, say=print) -> dict:
    """Head against --base REF (or --base-dir DIR) side by side, else against the stored run of the
    base (or its newest stored ancestor), else nothing; the record says which and why."""
    if args.base_dir:
        tree: Path | None = Path(args.base_dir).resolve()
        sha = (commit_info(tree) or {}).get("sha")
        base = {"ref": str(tree), "sha": sha}
    else:
        tree, sha = None, resolve_ref(args.base)
        base = {"ref": args.base, "sha": sha}
    try:
        if tree is None:
            if not _commit_has_file(sha, "flashmoe_science/bench.py"):  # no worktree needed to know
                raise BaseUnavailable(f"the base {sha[:12]} has no bench command (no bench.py)")
            tree = prepare_worktree(sha)
        results = compare_with_tree(tree, sha, cases, device, args, say)
        return comparison_record("worktree", base, results, args)
    except BaseUnavailable as exc:
        reason = str(exc)
    say(f"bench: cannot time the base side by side: {reason}")
    history = load_history(history_dir(args.history) / f"{machine_slug(doc['gpu'])}.json")
    stored = stored_reference(history, sha) if sha else None
    if stored is None:
        say("bench: nothing stored for the base or its ancestors on this machine: no comparison")
        return comparison_record("none", base, None, args, f"{reason}; nothing stored either")
    say(f"bench: comparing with the stored run of {stored['commit'][:12]} ({stored['timestamp']})")
    base |= {
        "stored_commit": stored["commit"],
        "stored_at": stored["timestamp"],
        "stored_torch": stored.get("torch"),
    }
    results = compare_with_stored(stored, doc, args.threshold / 100, args.alpha)
    return comparison_record("stored", base, results, args, reason)


# --------------------------------------------------------------------------------------------------
# Reports
# --------------------------------------------------------------------------------------------------


def write_json(doc: dict, path: Path) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)


def _ms(result: dict) -> str:
    return (
        f"{result['median_ms']:.4g} ({result['iqr_ms']:.2g})"
        if result.get("status") == "ok"
        else result.get("status", "-")
    )


def _ratio(result: dict | None) -> str:
    if not result:
        return "-"
    return f"{result['ratio']:.2f}x" if result.get("ratio") else result["status"]


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def _num(value: float | None, fmt: str = ".1f") -> str:
    return "-" if value is None else format(value, fmt)


def _header_lines(doc: dict) -> list[str]:
    gpu, commit, timing = doc["gpu"], doc["commit"] or {}, doc["timing"]
    if gpu:
        sm = gpu["capability"].replace(".", "")
        where = f"{gpu['name']} (sm_{sm}, {gpu['sm_count']} SMs), driver {doc['driver']}"
    else:
        where = "CPU backend (plumbing numbers, not a performance claim)"
    sha = str(commit.get("sha"))[:12] + (" (dirty)" if commit.get("dirty") else "")
    flush = timing["l2_flush_bytes"] // 2**20
    copy, matmul = doc["ceilings"].get("copy", {}), doc["ceilings"].get("matmul", {})
    return [
        "# Attention benchmark: flashmoe-science against PyTorch SDPA",
        "",
        f"{where}; torch {doc['torch']}, CUDA {doc['cuda']}; commit {sha}.",
        f"Timing: {timing['method']}"
        + (f", {flush} MiB L2 flush before every call" if flush else ", no cache flush")
        + "; median ms (IQR). vs X = X's time / ours (above 1: ours is faster); the read floor "
        "(decode on CUDA) is a bare read of the case's K and V.",
        f"Ceilings measured in this run: copy {_num(copy.get('gbps'), '.0f')} GB/s, "
        f"{matmul.get('dtype', '?')} matmul {matmul.get('n', '?')}^3 "
        f"{_num(matmul.get('tflops'), '.3g')} TFLOP/s; "
        "% ceiling is decode against the copy, prefill against the matmul.",
    ]


def _case_row(case: dict) -> str:
    ours = case["ours"]
    pct = ours.get("pct_copy_ceiling" if case["kind"] == "decode" else "pct_matmul_ceiling")
    sdpa_mem = case["baselines"].get("sdpa-default", {}).get("peak_mem_bytes")
    cells = [
        case["id"],
        _ms(ours),
        _num(ours.get("tflops"), ".3g"),
        _num(ours.get("gbps"), ".3g"),
        _num(pct, ".2g"),
        *(_ratio(case["baselines"].get(name)) for name in BASELINES),
        _ratio(case.get("read_floor")),
        f"{_mib(ours.get('peak_mem_bytes'))} / {_mib(sdpa_mem)}",
    ]
    return "| " + " | ".join(cells) + " |"


def render_markdown(doc: dict) -> str:
    vs = [f"vs {name.removeprefix('sdpa-')}" for name in BASELINES]
    columns = ["case", "ours ms (IQR)", "TFLOP/s", "GB/s", "% ceiling", *vs, "vs read floor"]
    columns.append("peak MiB ours / sdpa")
    lines = [
        *_header_lines(doc),
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]
    lines += [_case_row(case) for case in doc["cases"]]
    reasons: dict[str, set[str]] = {}
    for case in doc["cases"]:
        results = [("ours", case["ours"]), *case["baselines"].items()]
        results += [("read floor", case["read_floor"])] if "read_floor" in case else []
        for name, result in results:
            if result["status"] != "ok":
                reasons.setdefault(f"{name} {result['status']}", set()).add(result["reason"][:200])
    for what, texts in sorted(reasons.items()):
        lines += ["", f"{what}: " + " / ".join(sorted(texts)[:3])]
    if doc["comparison"]:
        lines += ["", *render_comparison(doc["comparison"])]
    return "\n".join(lines) + "\n"


def summary_text(comparison: dict) -> str:
    s = comparison["summary"]
    return (
        f"{s['regression']} regression(s), {s['improvement']} improvement(s), "
        f"{s['no change']} no change, {s['missing']} missing"
    )


def _comparison_row(r: dict) -> str:
    if r["verdict"] == "missing":
        return f"| {r['id']} | - | - | - | - | missing: {r['reason'][:80]} |"
    p = "-" if r["p_value"] is None else f"{r['p_value']:.2g}"
    cells = [r["id"], f"{r['base_median_ms']:.4g}", f"{r['head_median_ms']:.4g}"]
    cells += [f"{r['change_pct']:+.1f}%", p, r["verdict"]]
    return "| " + " | ".join(cells) + " |"


def render_comparison(comparison: dict) -> list[str]:
    base = comparison["base"]
    lines = [
        f"## Head against base {base.get('ref')} ({str(base.get('sha'))[:12]}), "
        f"source: {comparison['source']}",
        "",
        f"Threshold {comparison['threshold'] * 100:.0f}% and Mann-Whitney p < "
        f"{comparison['alpha']}: {summary_text(comparison)}.",
    ]
    if comparison["reason"]:
        lines += ["", f"Why not side by side: {comparison['reason']}"]
    if comparison["source"] == "stored":
        lines += [
            f"Base samples from the stored run of {base['stored_commit'][:12]} "
            f"({base['stored_at']}): another run, so machine drift is not controlled."
        ]
    if comparison["cases"]:
        order = {stats.REGRESSION: 0, stats.IMPROVEMENT: 1, "missing": 2, stats.NO_CHANGE: 3}
        rows = sorted(comparison["cases"], key=lambda r: (order.get(r["verdict"], 9), r["id"]))
        lines += [
            "",
            "| case | base ms | head ms | change | p | verdict |",
            "|---|---|---|---|---|---|",
        ]
        lines += [_comparison_row(r) for r in rows]
    return lines


# --------------------------------------------------------------------------------------------------
# Worker mode (one side of a head/base comparison)
# --------------------------------------------------------------------------------------------------


def worker_main(device: str, config: TimingConfig) -> int:
    """Serve timing requests on stdin/stdout, one JSON object per line, until {"op": "quit"}."""
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(
        sys.stderr.fileno(), sys.stdout.fileno()
    )  # build chatter and prints must not corrupt the protocol
    sys.stdout = sys.stderr

    def send(message: dict) -> None:
        protocol.write(json.dumps(message) + "\n")

    _ops().load_library()
    timer = make_timer(device)
    send({"ready": True, "protocol": WORKER_PROTOCOL, "device": device, "pid": os.getpid()})
    current: tuple[Case, Inputs] | None = None
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("op") != "time":
            break
        case = Case.from_dict(request["case"])
        try:
            if current is None or current[0] != case:
                current = None  # free the previous inputs before allocating the next ones
                if device == "cuda":
                    torch.cuda.empty_cache()
                current = (case, make_inputs(case, device))
            fn = our_call(case, current[1])
            timing = benchmark(fn, timer, config, samples=int(request["samples"]))
            send({"ok": True, "samples_ms": [_sig(t) for t in timing.samples_ms]})
        except Exception as exc:  # the case fails on this side: report it, keep serving
            send({"ok": False, "error": f"{type(exc).__name__}: {str(exc).strip()[:500]}"})
    return exitcodes.OK


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------


class Abort(Exception):
    """Stop with this exit code; the message says what went wrong and what to do."""

    def __init__(self, exit_code: int, message: str):
        super().__init__(message)
        self.exit_code = exit_code


def build_checkout(device: str) -> None:
    """Build (when stale) and load this checkout's extension, exactly as the operator loader does;
    failures become the exit codes `git bisect run` expects (125 skip, 255 abort)."""
    try:
        _ops().load_library()  # a no-op when importing ops already loaded it
    except build.BuildError as exc:
        raise Abort(
            exc.exit_code, f"this checkout does not build (exit {exc.exit_code})\n{exc}"
        ) from exc
    except build.ConfigError as exc:
        raise Abort(exc.exit_code, f"cannot configure the build: {exc}") from exc
    if device == "cuda" and not torch._C._dispatch_has_kernel_for_dispatch_key(
        "flashmoe_science::fwd", "CUDA"
    ):
        reason = build.resolve_config("auto").reason
        raise Abort(
            exitcodes.ENV_BROKEN,
            f"a GPU is visible but the extension has no CUDA kernels ({reason}); "
            "fix the CUDA toolchain, then run `python -m flashmoe_science build`",
        )


def choose_device(backend: str, bisect: bool) -> str:
    if backend != "cpu" and torch.cuda.is_available():
        return "cuda"
    if backend == "cuda" or (backend == "auto" and paths.require_gpu_from_env()):
        required = "--backend cuda" if backend == "cuda" else "FLASHMOE_REQUIRE_GPU=1"
        raise Abort(exitcodes.ENV_BROKEN, f"{required} but torch sees no GPU; check `nvidia-smi`")
    if bisect and backend == "auto":
        raise Abort(
            exitcodes.ENV_BROKEN,
            "--bisect without a GPU: no timing here is comparable to --max-ms (exit 255 stops the "
            "bisect); pass --backend cpu to bisect CPU timings",
        )
    return "cpu"


def _threshold(text: str) -> float:
    value = float(text.rstrip("%"))
    if value < 0:
        raise argparse.ArgumentTypeError("the threshold is a percentage >= 0, e.g. 5")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flashmoe_science bench",
        description="Time our attention kernels against PyTorch SDPA; optionally the head against "
        "a base commit (--base), or one case against a limit for `git bisect run` (--bisect).",
    )
    p.add_argument(
        "--quick", action="store_true", help="a handful of cases: 2 prefill, 1 decode, 1 small"
    )
    p.add_argument(
        "--case",
        action="append",
        default=[],
        metavar="ID",
        help="case id or glob, repeatable (see --list)",
    )
    p.add_argument("--list", action="store_true", help="print the selected case ids and exit")
    p.add_argument(
        "--backend",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="device to time on (auto: the GPU if torch sees one); cpu gives a scaled-down matrix",
    )
    p.add_argument("--no-baselines", action="store_true", help="skip the SDPA baselines")
    p.add_argument(
        "--warmup-ms",
        type=float,
        help="warm-up budget per measurement (default 25 on CUDA, 10 on CPU)",
    )
    p.add_argument(
        "--rep-ms",
        type=float,
        help="timed-call budget per measurement (default 100 on CUDA, 150 on CPU)",
    )
    g = p.add_argument_group("head against base")
    g.add_argument(
        "--base",
        metavar="REF",
        help="git ref to compare against (worktree, own build, interleaved workers)",
    )
    g.add_argument(
        "--base-dir",
        metavar="DIR",
        help="compare against an existing checkout instead of a worktree of REF",
    )
    g.add_argument(
        "--rounds", type=int, default=5, help="base/head alternations per case (default 5)"
    )
    g.add_argument(
        "--samples-per-round",
        type=int,
        help="timed calls per request (default 20 on CUDA, 3 on CPU)",
    )
    g.add_argument(
        "--threshold",
        type=_threshold,
        default=stats.DEFAULT_THRESHOLD * 100,
        metavar="PCT",
        help="smallest change in the median that counts, in percent (default 5)",
    )
    g.add_argument(
        "--alpha",
        type=float,
        default=stats.DEFAULT_ALPHA,
        help="Mann-Whitney significance level (default 0.01)",
    )
    g.add_argument(
        "--fail-on-regression", action="store_true", help="exit 1 when any case regresses"
    )
    g.add_argument(
        "--history", metavar="DIR", help="stored results (default <build root>/bench-history)"
    )
    g.add_argument(
        "--no-history", action="store_true", help="do not record this run in the stored results"
    )
    b = p.add_argument_group("bisect (git bisect run)")
    b.add_argument(
        "--bisect", metavar="CASE", help="time only CASE; exit 0 if its median < --max-ms, else 1"
    )
    b.add_argument("--max-ms", type=float, help="the limit for --bisect, in milliseconds")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p


def _check_args(p: argparse.ArgumentParser, args) -> None:
    if args.bisect and args.max_ms is None:
        p.error("--bisect CASE needs --max-ms T")
    if args.max_ms is not None and not args.bisect:
        p.error("--max-ms goes with --bisect CASE")
    if args.base and args.base_dir:
        p.error("give --base REF or --base-dir DIR, not both")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")


def bisect_main(case: Case, max_ms: float, device: str, config: TimingConfig) -> int:
    """Exit 0 when the case's median is below max_ms, 1 when not, 125 when it cannot run here."""
    fn = our_call(case, make_inputs(case, device))
    problem = _first_call(fn)
    try:
        timing = benchmark(fn, make_timer(device), config) if problem is None else None
    except RuntimeError as exc:
        problem = _first_line(exc)
    if timing is None:  # the kernel fails on this commit: it cannot be judged on speed
        print(f"bench --bisect: {case.id} does not run here ({problem[:300]}); exit 125 (skip)")
        return exitcodes.BUILD_FAILED
    good = timing.median_ms < max_ms
    print(
        f"bench --bisect: {case.id} median {timing.median_ms:.4g} ms "
        f"(IQR {timing.iqr_ms:.2g}, n={timing.summary.n}) {'<' if good else '>='} {max_ms} ms: "
        f"{'good' if good else 'bad'}"
    )
    return exitcodes.OK if good else exitcodes.GATE_FAILED


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    _check_args(p, args)
    try:
        return run(args)
    except Abort as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return exc.exit_code


def run(args) -> int:
    if xdist_problem():
        raise Abort(exitcodes.ENV_BROKEN, xdist_problem())
    device = choose_device(args.backend, bool(args.bisect))
    config = TimingConfig.for_device(device, args.warmup_ms, args.rep_ms)
    if args.worker:
        return worker_main(device, config)
    try:
        bisect_case = parse_case_id(args.bisect) if args.bisect else None
        cases = [] if args.bisect else select_cases(device, args.quick, args.case)
    except ValueError as exc:
        raise Abort(exitcodes.USAGE, str(exc)) from exc
    if args.list:
        print("\n".join(c.id for c in cases))
        return exitcodes.OK
    if args.base and not resolve_ref(args.base):
        raise Abort(
            exitcodes.USAGE, f"--base {args.base!r} is not a commit here (`git log --oneline`)"
        )
    build_checkout(device)
    if bisect_case is not None:
        return bisect_main(bisect_case, args.max_ms, device, config)
    return run_and_report(args, cases, device, config)


def run_and_report(args, cases: list[Case], device: str, config: TimingConfig) -> int:
    doc = run_matrix(cases, device, config, baselines=not args.no_baselines)
    if args.base or args.base_dir:
        doc["comparison"] = compare(doc, cases, device, args)
    # after the comparison, so a fallback to stored results never finds this very run
    full_matrix = not args.quick and not args.case
    if full_matrix and not args.no_history and doc["commit"] and not doc["commit"]["dirty"]:
        print(f"bench: recorded in {record_history(doc, history_dir(args.history))}")
    out = paths.report_dir()
    write_json(doc, out / "bench.json")
    (out / "bench.md").write_text(render_markdown(doc))
    print(f"bench: wrote {out / 'bench.json'} and {out / 'bench.md'}")
    return verdict_exit_code(doc, args.fail_on_regression)


def verdict_exit_code(doc: dict, fail_on_regression: bool) -> int:
    failed = [c["id"] for c in doc["cases"] if c["ours"]["status"] != "ok"]
    if failed:
        print(
            f"bench: our kernel failed on {len(failed)} case(s): {', '.join(failed[:5])}",
            file=sys.stderr,
        )
        return exitcodes.GATE_FAILED
    comparison = doc["comparison"]
    if comparison:
        if comparison["source"] == "none":
            print(f"bench: no comparison with {comparison['base']['ref']}: {comparison['reason']}")
        else:
            source = f"{comparison['base']['ref']} ({comparison['source']})"
            print(f"bench: against {source}: {summary_text(comparison)}")
        if fail_on_regression and comparison["summary"]["regression"]:
            return exitcodes.GATE_FAILED
    return exitcodes.OK


if __name__ == "__main__":
    sys.exit(main())
