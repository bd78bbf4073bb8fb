"""The read floor of a decode case: the time this card takes to read the case's K and V once and do
nothing else, under the benchmark's own timer (L2 flushed by writing, CUDA events, median).

A decode step must read every valid K and V byte, so no decode kernel is expected to run much
below this floor; SDPA's time over the floor is the most any kernel can gain on SDPA there. That
bound is what limits the short caches (benches/notes/decode.md, v2.7).

The reader is a Triton kernel (Triton ships with PyTorch's CUDA builds): each program sums a
contiguous stretch of K and V. The floor is the fastest of CONFIGS, since which is fastest depends
on the size: evict-first wins on the smaller caches, the default policy on the larger ones.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

BLOCK = 8192  # elements per program and step: 16 KB of K and 16 KB of V in flight per program
NUM_WARPS = 8
# (programs per SM, L2 eviction policy): the three that won some size in a sweep (decode.md, v2.7)
CONFIGS = ((4, "evict_first"), (8, "evict_first"), (8, ""))


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def read_kv(k_ptr, v_ptr, out_ptr, n, per_program, BLOCK: tl.constexpr, EVICT: tl.constexpr):
        pid = tl.program_id(0)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        start = pid.to(tl.int64) * per_program
        for offset in range(0, per_program, BLOCK):
            index = start + offset + tl.arange(0, BLOCK)
            inside = index < n
            acc += tl.load(k_ptr + index, mask=inside, other=0.0, eviction_policy=EVICT).to(
                tl.float32
            )
            acc += tl.load(v_ptr + index, mask=inside, other=0.0, eviction_policy=EVICT).to(
                tl.float32
            )
        tl.store(out_ptr + pid, tl.sum(acc))  # the sum keeps the loads from being dropped

    return read_kv


def config_name(programs: int, evict: str) -> str:
    return f"{programs} programs, {evict.replace('_', '-') or 'default L2 policy'}"


def read_calls(k: torch.Tensor, v: torch.Tensor) -> dict[str, Callable[[], object]]:
    """One call per configuration, each reading all of k and v (contiguous, same shape) once.
    Raises ImportError without Triton."""
    if k.shape != v.shape or not (k.is_contiguous() and v.is_contiguous()):
        raise ValueError(
            f"k and v must be contiguous and of one shape; got {tuple(k.shape)} and "
            f"{tuple(v.shape)}"
        )
    kernel = _kernel()
    sms = torch.cuda.get_device_properties(k.device).multi_processor_count
    n = k.numel()
    calls = {}
    for per_sm, evict in CONFIGS:
        programs = per_sm * sms
        per_program = -(-n // (programs * BLOCK)) * BLOCK
        out = torch.empty(programs, device=k.device, dtype=torch.float32)
        launch = kernel[(programs,)]
        calls[config_name(programs, evict)] = functools.partial(
            launch, k, v, out, n, per_program, BLOCK=BLOCK, EVICT=evict, num_warps=NUM_WARPS
        )
    return calls
