"""`python -m flashmoe_science sanitize` (`nox -s sanitize`): NVIDIA compute-sanitizer's memcheck,
initcheck, synccheck and racecheck over a small workload that still reaches every kernel code path.

    python -m flashmoe_science sanitize                      # all four tools (budget: 10 min, H100)
    python -m flashmoe_science sanitize --tool memcheck      # one tool (repeatable, or a,b)
    python -m flashmoe_science sanitize --tool memcheck --define FLASHMOE_PLANT_BUG=3
    python -m flashmoe_science sanitize --jobs 1                # one tool after another
    python -m flashmoe_science.pipeline.tools.sanitize --list               # the workload's calls (case ids)

The workload (`python -m flashmoe_science.pipeline.tools.sanitize --workload`, run under each tool) calls the
public API once per case, inputs on the GPU, with a torch.cuda.synchronize after each call, and
prints a `sanitize-case: ID` line before each call so a finding can be tied to the call that made
it. The cases cover: odd lengths (1, 17, 65, 129, 257, and Sq != Sk both ways, so causal rows that
see no key and KV blocks that are only partly valid), causal and not, fp16 and bf16, head dims 64
and 128, GQA ratio 4 (packed and unpacked), every kernel configuration the card can run (`config=1`
to `6`; 4 needs sm_90, 5 and 6 an sm_90a build on a 9.0 GPU; 6 at head dim 64 only, its 128 being
5's kernel), the [B, S, H, D] view layout, forced 1 and 3 splits and automatic splitting, and
decode with 1, 3, 7 and 128 splits, automatic splits over a 4097-token cache, and cache_seqlens
holding 0 and short lengths, so that many splits are empty, and of 65 and 257 query rows against
such a cache on the wgmma kernels (copying K and V with cp.async); the backward of every
backward configuration; packed (varlen) batches that mix lengths 0, 1, 17 and one past a block's
end with Sq != Sk both ways, per forward configuration that has a packed variant, and their
backward; decode against paged caches of block sizes 16, 64 and 256 with shuffled page tables,
empty caches and partial last pages, forced and automatic splits; and for head dims 192 and 256 a
smaller block of the same paths (wide_head_dim_workload). Varlen and paged inputs come from their
gates' own builders (varlen_gates.py, paged_gates.py).

Each tool runs as `compute-sanitizer --tool T --error-exitcode 99 --print-limit 20
[--racecheck-report all] [--check-bulk-copy yes] [--check-warpgroup-mma yes] --kernel-name kns=K
... python -m flashmoe_science.pipeline.tools.sanitize --workload`, the Hopper options where the installed
tool offers them (its --help, read once) and they concern T (sanitize_coverage), one --kernel-name
for each of our kernels (KERNEL_OPERATORS; see sanitizer_command);
--all-kernels drops the filter, which otherwise keeps torch's own kernels uninstrumented and the run
fast. memcheck and initcheck run with PYTORCH_NO_CUDA_MEMORY_CACHING=1: out of the caching
allocator's large segments, a read past a tensor lands in another tensor of the same segment and is
not reported. The extension is built before any tool starts, never under one. memcheck stops a
kernel at its first error and the CUDA context is lost, so the workload stops at the first faulty
call; the report is about that call.

The runs go at once on the one GPU (--jobs, default half the cores, at most MAX_JOBS; plan):
racecheck, the slowest, as SHARES of the workload (`--workload --share K/N`: every N-th call,
workload_share), each other tool as one run; a tool's report merges its shares (merged_report), and
its log holds each share's output in turn.

Any finding fails the run: per tool, the check, the kernel, the source line, the thread and block,
and the case, condensed from the tool's output (parse_sanitizer_output, a pure function); the full
output is in <reports>/sanitize-<tool>.log. <reports>/sanitize.json holds, per tool, the status, the
wall time, the findings and the coverage: for TMA, bulk reductions, wgmma, mbarriers and named
barriers, whether the tool checks them, does not, or is not documented to
(sanitize_coverage.coverage), so a PASS says what it did not look at; the console summary and the
PR report show what is not checked. racecheck runs the wgmma backward's tile before the
warp-specialized one (sanitize_coverage.RACECHECK_ENV). stages.json gets a "sanitize" stage.

Exit codes (flashmoe_science.pipeline.exitcodes): 0 every tool clean; 1 a finding (or the workload crashed,
or a tool timed out); 2 usage; 125 the extension does not build; 126 compute-sanitizer is missing or
may not instrument this GPU here; 255 no GPU.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import itertools
import json
import math
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ... import _loader
from ..._toolkit import find_cuda_tool, run_streaming
from .. import background, exitcodes, paths
from ..cli import program
from ..provenance import clear_outputs, provenance
from . import sanitize_coverage
from .cudatools import UNUSABLE_PATTERNS, paths_display, short_kernel

SCHEMA = "flashmoe-science/sanitize/2"  # 2: per tool "coverage"
TOOLS = ("memcheck", "initcheck", "synccheck", "racecheck")  # racecheck, the slowest, last
SANITIZER_ERROR_EXIT = 99
PRINT_LIMIT = 20
TOOL_TIMEOUT_S = 900
# The kernels the sanitizer instruments (name prefixes), each with the operator whose CUDA
# implementation launches it: the workload calls every one of these operators.
KERNEL_OPERATORS = {
    "flash_fwd_kernel": "attention",
    "flash_fwd_varlen_kernel": "varlen_fwd",
    "flash_fwd_sm90_kernel": "attention",  # configs 5 to 7, wgmma (an sm_90a build on a 9.0 GPU)
    "flash_fwd_sm90_varlen_kernel": "varlen_fwd",
    "varlen_offsets_check_kernel": "varlen_fwd",  # the packed batch's offsets, checked on the GPU
    "flash_decode_kernel": "fwd",
    "flash_decode_paged_kernel": "paged_fwd",
    "split_kv_combine_kernel": "attention",  # a prefill's forced or automatic splits
    "flash_bwd_": "attention_backward",  # the backward's pre-pass, dK/dV, dQ and conversion kernels
}
KERNEL_SUBSTRINGS = tuple(KERNEL_OPERATORS)
# A read past a tensor stays inside one of the caching allocator's segments and goes unreported.
NO_CACHING_TOOLS = ("memcheck", "initcheck")
CASE_MARK = "sanitize-case: "
DONE_MARK = "sanitize-done: "
SHOWN_PER_TOOL = 3
HEARTBEAT_S = 30.0
# How many shares of the workload a tool's run is split into when several may run at once: racecheck
# takes most of sanitize's time (benches/notes/harness.md), the others one process each.
SHARES = {"racecheck": 4}
MAX_JOBS = 7  # racecheck's shares and the three other tools, all at once

# --------------------------------------------------------------------------------------------------
# The workload
# --------------------------------------------------------------------------------------------------

FWD_LENGTHS = ((1, 1), (65, 65), (129, 129), (257, 257), (17, 257), (257, 17))


def _target() -> tuple[tuple[int, int], tuple[str, ...] | None]:
    """The GPU's compute capability and build targets the workload is for: this GPU and the
    loaded build's, or an H100's own build when no GPU is visible (for listing)."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_capability(), None
    return (9, 0), ("9.0a",)


def workload_configs() -> list[int]:
    """The kernel configurations the workload forces: all that this GPU can run (all of them when
    no GPU is visible, for listing)."""
    from ...ops import CONFIGS, config_supported

    capability, archs = _target()
    return [c for c in CONFIGS if config_supported(c, capability, archs)]


def workload_backward_configs() -> list[int]:
    """The backward configurations the workload forces, chosen as workload_configs does."""
    from ...ops import BACKWARD_CONFIGS, backward_config_supported

    capability, archs = _target()
    return [c for c in BACKWARD_CONFIGS if backward_config_supported(c, capability, archs)]


def many_row_decode_case(
    dtype: str, head_dim: int, seqlen_q: int, causal: bool, splits: int, config: int
):
    """A decode Case of many query rows (GQA 4, unpacked) against a cache with lengths 0, short
    and full: on the wgmma kernels the producer then copies K, V and Q with cp.async, not TMA
    (matrix.MANY_ROW_DECODE)."""
    from ..cases import Case
    from ..gates.matrix import MANY_ROW_DECODE_HEADS

    batch, heads_q = MANY_ROW_DECODE_HEADS[seqlen_q]
    return Case(
        "decode",
        dtype,
        batch,
        heads_q,
        heads_q // 4,
        seqlen_q,
        300,
        head_dim,
        causal,
        num_splits=splits,
        cache_seqlens=(0, 17, 300),
        config=config,
    )


def workload_cases(restriction: _loader.Restriction | None = None) -> list:
    """Every forward kernel instantiation (dtype x head dim x tile configuration) with and without
    the causal mask over odd lengths, then the decode paths, the backward, packed batches and paged
    decode. Shapes rotate through GQA ratios 1 and 4, batch 1 and 2, both layouts and forced or
    automatic split counts. On a restricted build (`restriction`; None: this process's,
    _loader.build_restriction), the cases whose kernels it holds, in the same order."""
    from ..gates import kernels

    restriction = _loader.build_restriction() if restriction is None else restriction
    cases = _all_workload_cases()
    if restriction:
        cases = [case for case in cases if kernels.holds(restriction, case_needs(case))]
    return cases


def case_needs(case) -> set:
    """The kernels a workload call may run (gates.kernels.needs; a packed batch's gradients:
    the packed forward and the backward of each sequence)."""
    from ..gates import kernels

    if isinstance(case, VarlenBackward):
        forward = case.forward
        packed = {("varlen", forward.dtype, forward.head_dim, forward.config or None)}
        return packed | kernels.backward_needs(forward.dtype, forward.head_dim, 0)
    return kernels.needs(case)


def _all_workload_cases() -> list:
    from ..cases import Case
    from ..gates.matrix import MANY_ROW_DECODE_CONFIGS, gated_head_dims

    configs = workload_configs()
    cases = []
    index = 0
    for dtype in ("fp16", "bf16"):
        for head_dim in (64, 128):
            for config in (c for c in configs if head_dim in gated_head_dims(c)):
                for causal in (False, True):
                    for seqlen_q, seqlen_k in FWD_LENGTHS:
                        four = (index // 2) % 2 == 1  # GQA ratio 4, packed and not
                        heads_kv = 1 if four else 2
                        heads_q = heads_kv * (4 if four else 1)
                        cases.append(
                            Case(
                                "prefill",
                                dtype,
                                2 if index % 4 == 1 else 1,
                                heads_q,
                                heads_kv,
                                seqlen_q,
                                seqlen_k,
                                head_dim,
                                causal,
                                layout="bshd" if index % 5 == 3 else "bhsd",
                                config=config,
                                num_splits=(0, 1, 3)[index % 3],
                            )
                        )
                        index += 1
    # (Sq, Sk, Hq, Hkv, causal, splits, cache_seqlens): splits 0 = automatic
    decode = (
        (1, 257, 8, 2, True, 1, None),
        (4, 257, 8, 2, False, 3, (0, 1, 257)),
        (1, 257, 8, 2, True, 7, (257, 100, 0)),
        (16, 65, 8, 1, True, 7, (5, 0, 65)),  # 128 packed rows; short caches, most splits empty
        (1, 4097, 8, 2, True, 0, (4097, 0, 33)),
        (2, 129, 4, 4, True, 128, (0, 3, 129)),
    )
    for dtype in ("fp16", "bf16"):
        for head_dim in (64, 128):
            for seqlen_q, seqlen_k, heads_q, heads_kv, causal, splits, lens in decode:
                cases.append(
                    Case(
                        "decode",
                        dtype,
                        3 if lens else 1,
                        heads_q,
                        heads_kv,
                        seqlen_q,
                        seqlen_k,
                        head_dim,
                        causal,
                        num_splits=splits,
                        cache_seqlens=lens,
                    )
                )
    # Many query rows against a cache with lengths 0, short and full, on the wgmma kernels, whose
    # producer then copies K and V with cp.async, not TMA (matrix.MANY_ROW_DECODE), where the card
    # runs them. (dtype, head dim, Sq, causal, splits); GQA 4, unpacked.
    many_rows = (
        ("fp16", 64, 65, True, 0),
        ("fp16", 128, 257, False, 3),
        ("bf16", 64, 257, True, 3),
        ("bf16", 128, 65, False, 0),
    )
    for config, (dtype, head_dim, seqlen_q, causal, splits) in itertools.product(
        (c for c in MANY_ROW_DECODE_CONFIGS if c in configs), many_rows
    ):
        if head_dim not in gated_head_dims(config):
            continue
        cases.append(many_row_decode_case(dtype, head_dim, seqlen_q, causal, splits, config))
    # The backward: every configuration, with dQ by atomics and deterministic, over odd lengths
    # (keys and queries past a block's end, rows that see no key), GQA 4 and a strided view.
    backward = ((65, 65, 4, 1, False), (129, 257, 8, 2, True), (257, 17, 2, 2, True))
    for dtype in ("fp16", "bf16"):
        for head_dim in (64, 128):
            for config in workload_backward_configs():
                for deterministic in (False, True):
                    for seqlen_q, seqlen_k, heads_q, heads_kv, causal in backward:
                        cases.append(
                            Case(
                                "backward",
                                dtype,
                                1,
                                heads_q,
                                heads_kv,
                                seqlen_q,
                                seqlen_k,
                                head_dim,
                                causal,
                                layout="bshd" if seqlen_q == 129 else "bhsd",
                                config=config,
                                deterministic=deterministic,
                            )
                        )
    return [
        *cases,
        *varlen_workload(configs),
        *paged_workload(),
        *wide_head_dim_workload(configs),
        *feature_workload(),
        *forced_feature_workload(configs, workload_backward_configs()),
        *padded_head_dim_workload(configs),
        *wide_wgmma_backward_workload(),
    ]


@dataclasses.dataclass(frozen=True)
class VarlenBackward:
    """The gradients of a packed call (autograd through flash_attention_varlen_forward, whose
    backward runs the backward kernels on each sequence's rows)."""

    forward: Any  # a varlen_gates.VarlenCase

    @property
    def id(self) -> str:
        return "varlenbwd" + self.forward.id.removeprefix("varlen")


# Packed batches, (query lengths, key lengths): empty and one-token sequences, 17, lengths one past
# a 64- and a 128-row block (65, 129, 257), Sq == Sk, Sq < Sk and Sq > Sk (queries that see no key).
VARLEN_LENGTHS = (
    ((17, 0, 1, 129, 1, 65), (17, 3, 0, 257, 1, 33)),
    ((0, 65, 257, 1), (0, 129, 17, 1)),
)


def varlen_workload(configs: Sequence[int]) -> list:
    """Every packed-batch kernel instantiation (dtype x head dim x each forced configuration that
    has a packed variant) with and without the causal mask, GQA ratios 1 and 4; then the backward
    once per dtype and head dim."""
    from ..gates.varlen import VARLEN_CONFIGS, VarlenCase

    cases: list = []
    blocks = [(dtype, head_dim) for dtype in ("fp16", "bf16") for head_dim in (64, 128)]
    for block, (dtype, head_dim) in enumerate(blocks):
        # Over the four blocks, each configuration meets both batches with each mask, and both
        # GQA ratios.
        for config in (c for c in configs if c in VARLEN_CONFIGS):
            for causal in (False, True):
                lengths_q, lengths_k = VARLEN_LENGTHS[(block + causal) % 2]
                heads_kv = 1 if (block + config) % 2 else 4
                cases.append(
                    VarlenCase(dtype, head_dim, 4, heads_kv, lengths_q, lengths_k, causal, config)
                )
        lengths_q, lengths_k = VARLEN_LENGTHS[block % 2]
        forward = VarlenCase(dtype, head_dim, 4, 1, lengths_q, lengths_k, block % 3 != 1)
        cases.append(VarlenBackward(forward))
    return cases


# Paged decode: cache lengths empty, one token, one past a page of 16 and a 64-key tile, and many
# pages with a partial last one.
PAGED_LENGTHS = (0, 1, 17, 65, 300)
PAGED_LONG_LENGTHS = (4097, 0, 33)  # automatic splitting that does split
PAGE_SIZES = (16, 64, 256)


def paged_workload() -> list:
    """The paged decode kernel per dtype and head dim over block sizes 16, 64 and 256 and shuffled
    page tables (paged_gates.make_paged_inputs), GQA ratios 1 and 4, forced 3 and 7 splits (most
    of them empty) and automatic, causal and not."""
    from ..gates.paged import PagedCase

    cases: list = []
    blocks = [(dtype, head_dim) for dtype in ("fp16", "bf16") for head_dim in (64, 128)]
    for block, (dtype, head_dim) in enumerate(blocks):
        for i, page_size in enumerate(PAGE_SIZES):
            turn = block + i  # rotates the other choices over the block sizes
            cases.append(
                PagedCase(
                    dtype,
                    head_dim,
                    8,
                    2 if turn % 2 else 8,
                    seqlen_q=(1, 4)[(block // 2 + i) % 2],
                    lengths=PAGED_LENGTHS,
                    page_size=page_size,
                    num_splits=(0, 3, 7)[turn % 3],
                    causal=turn % 4 != 3,
                )
            )
        page_size = PAGE_SIZES[block % len(PAGE_SIZES)]
        cases.append(PagedCase(dtype, head_dim, 8, 2, 1, PAGED_LONG_LENGTHS, page_size))
    return cases


# The head dims past 128 (_loader.CUDA_HEAD_DIMS), whose kernels copy rows in column passes and
# whose backward shares each 16 keys between warps through shared memory. Configuration 1 takes
# more shared memory at 256 than an sm86/sm89 block has (the operator refuses it there), so it is
# forced at 192 only; the automatic choice (0) runs 1 or 4 at 256 where they fit. The backward
# forces 1 (it fits every card) and runs 2 through the automatic choice where it fits.
WIDE_HEAD_DIMS = tuple(d for d in _loader.CUDA_HEAD_DIMS if d > 128)
WIDE_FWD_SHAPES = ((65, 65, True, 0), (17, 257, False, 3), (257, 17, True, 1))


def feature_workload() -> list:
    """Sliding windows, softcap and sinks, alone and combined: the CPU gate tier's cases of them
    (prefill with split-KV, decode and paged decode with splits, packed batches, the backward with
    dQ by atomics and deterministic; at most 24 small calls), run on the GPU's kernels."""
    from ..gates import matrix
    from ..gates import paged as paged_gates
    from ..gates import varlen as varlen_gates

    every = [
        *matrix.gate_cases("cpu"),
        *matrix.backward_cases("cpu"),
        *varlen_gates.varlen_cases("cpu"),
        *paged_gates.paged_cases("cpu"),
    ]
    return [c for c in every if c.window != (-1, -1) or c.softcap or c.sinks]


def forced_feature_workload(configs: Sequence[int], backward_configs: Sequence[int]) -> list:
    """The features on every configuration this GPU runs, forced: the gate matrix's forced
    feature cases (matrix.forced_feature_cases: each combination on each configuration) below
    1000 keys. The CPU tier's small cases above run the decode kernel on a large GPU (its automatic
    choice for a grid that leaves SMs idle), so without these the mma.sync and wgmma kernels'
    feature instantiations would not be watched."""
    from ..gates import matrix

    return [
        c
        for kind, allowed in (("prefill", configs), ("backward", backward_configs))
        for c in matrix.forced_feature_cases(kind)
        if c.config in allowed and c.seqlen_k < 1000
    ]


def wide_head_dim_workload(configs: Sequence[int]) -> list:
    """The kernels of WIDE_HEAD_DIMS per dtype: the forward configurations this GPU runs (mma.sync,
    and 5, the wgmma kernel of 5 to 7 there) and the automatic choice over odd lengths (forced and
    automatic splits, GQA 4 and a strided view), decode with a fused split combine over short
    caches, the wgmma kernel's cp.async path (many query rows against a cache), paged decode (a
    small and a large block size), packed batches (the wgmma kernel's too) and their backward, and
    the backward (automatic, 1 and 2 where the card runs it) with dQ by atomics and
    deterministic."""
    from ..cases import Case
    from ..gates.paged import PagedCase
    from ..gates.varlen import VarlenCase

    cases: list = []
    for dtype, head_dim in itertools.product(("fp16", "bf16"), WIDE_HEAD_DIMS):
        forced = [c for c in (1, 2, 3, 4, 5) if c in configs and (c != 1 or head_dim <= 192)]
        for index, (config, shape) in enumerate(itertools.product((0, *forced), WIDE_FWD_SHAPES)):
            seqlen_q, seqlen_k, causal, splits = shape
            cases.append(
                Case(
                    "prefill",
                    dtype,
                    1 + index % 2,
                    8,
                    2 if index % 3 == 1 else 8,
                    seqlen_q,
                    seqlen_k,
                    head_dim,
                    causal,
                    layout="bshd" if index % 4 == 2 else "bhsd",
                    config=config,
                    num_splits=splits,
                )
            )
        for splits, lens in ((7, (0, 1, 257)), (0, None)):
            cases.append(
                Case(
                    "decode",
                    dtype,
                    3 if lens else 1,
                    8,
                    2,
                    1,
                    257,
                    head_dim,
                    True,
                    num_splits=splits,
                    cache_seqlens=lens,
                )
            )
        if 5 in configs:  # K, V and Q by cp.async: no TMA with cache lengths
            splits = 3 if dtype == "fp16" else 0
            cases.append(many_row_decode_case(dtype, head_dim, 65, dtype == "bf16", splits, 5))
        page_size = 16 if dtype == "fp16" else 64
        cases.append(PagedCase(dtype, head_dim, 8, 2, 1, PAGED_LENGTHS, page_size, num_splits=3))
        for config in (0, 2, 5):
            if config not in (0, *configs):
                continue
            lengths_q, lengths_k = VARLEN_LENGTHS[min(config // 2, 1)]
            cases.append(
                VarlenCase(
                    dtype, head_dim, 4, 1 if config else 4, lengths_q, lengths_k, True, config
                )
            )
        lengths_q, lengths_k = VARLEN_LENGTHS[1]
        cases.append(VarlenBackward(VarlenCase(dtype, head_dim, 4, 1, lengths_q, lengths_k, False)))
        # 0: on a Hopper card with the sm_90a build, the wgmma backward past 128 (its forced calls
        # are the last block), so 2 (the mma.sync kernel elsewhere) is forced too
        backward = (0, 1, *(c for c in (2,) if c in workload_backward_configs()))
        for config, deterministic in itertools.product(backward, (False, True)):
            layout = "bshd" if config else "bhsd"
            cases.append(small_backward_case(dtype, head_dim, config, deterministic, layout=layout))
    return cases


def small_backward_case(dtype: str, head_dim: int, config: int, deterministic: bool, **options):
    """A backward call of the workload's head-dim blocks: GQA 4 (8 query heads on 2), 129 queries
    against 65 keys (causal: rows that see no key), or against 257 keys deterministic."""
    from ..cases import Case

    options.setdefault("causal", True)
    return Case(
        "backward",
        dtype,
        1,
        8,
        2,
        129,
        257 if deterministic else 65,
        head_dim=head_dim,
        config=config,
        deterministic=deterministic,
        **options,
    )


def wide_wgmma_backward_workload() -> list:
    """The wgmma backward past 128 (backward configuration 3 at 192, 256 and v's 128 under 192:
    Sm90BwdWideTraits) where this GPU runs it: each of its kernels (both dtypes, dQ by atomics
    and deterministic), causal with rows that see no key, GQA 4, and a window, softcap and sinks
    on a third of the calls; appended after every other block."""
    from ..gates.matrix import WGMMA_WIDE_FORCED_BACKWARD

    if 3 not in workload_backward_configs():
        return []
    cases = []
    variants = itertools.product(WGMMA_WIDE_FORCED_BACKWARD, ("fp16", "bf16"), (False, True))
    for index, ((head_dim, head_dim_v), dtype, deterministic) in enumerate(variants):
        featured = index % 3 == 1
        cases.append(
            small_backward_case(
                dtype,
                head_dim,
                3,
                deterministic,
                causal=not featured,
                head_dim_v=head_dim_v,
                window=(16, 3) if featured else (-1, -1),
                softcap=5.0 if featured else 0.0,
                sinks=featured,
            )
        )
    return cases


# Head dims padded onto a wider tile (ops.head_dims_supported: q's and k's, v's): 80 and 96 on the
# 128 tile, v's 128 under q's and k's 192 on the 192 tile. Their copies zero-fill the tile's
# columns past each tensor's head dim and their stores leave them out, in every kernel family.
PADDED_HEAD_DIMS = ((80, 80), (96, 96), (192, 128))
# Those the wgmma forward (configuration 5) runs as well: v's 128 under q's and k's 192 (a kernel
# of its own), 80 and 96 (its 128 tile run padded: Sm90PaddedTraits).
WGMMA_PADDED_FORCED = ((192, 128), (80, 80), (96, 96))
# Those the wgmma backward (configuration 3) runs, its 128 tile padded (Sm90BwdPaddedTraits).
WGMMA_BWD_PADDED_FORCED = ((80, 80), (96, 96))


def padded_head_dim_workload(configs: Sequence[int]) -> list:
    """PADDED_HEAD_DIMS in bf16: the mma.sync forward configurations this GPU runs and the
    automatic choice, with forced splits (the partials and the combine); decode with a fused
    combine; the backward (automatic, 1, 2, and 3 at 80 and 96 where this GPU runs it: the
    wgmma backward's tile padded) with dQ by atomics and deterministic; paged decode
    and packed batches where v's head dim is q's (their cases have one head dim). v's 128 under
    q's and k's 192, 80 and 96 run on the wgmma forward too, where this GPU runs configuration 5
    (WGMMA_PADDED_FORCED: TMA with split partials, cp.async with cache lengths)."""
    from ..cases import Case
    from ..gates.paged import PagedCase
    from ..gates.varlen import VarlenCase

    cases: list = []
    for head_dim, head_dim_v in PADDED_HEAD_DIMS:
        dims = {"head_dim": head_dim, "head_dim_v": head_dim_v}
        forced = [c for c in (1, 2, 4) if c in configs]
        if (head_dim, head_dim_v) in WGMMA_PADDED_FORCED and 5 in configs:
            forced.append(5)
            cases.append(
                Case(
                    "decode",
                    "bf16",
                    3,
                    16,
                    4,
                    65,
                    300,
                    causal=True,
                    config=5,
                    cache_seqlens=(101, 299, 300),
                    **dims,
                )
            )
        for index, config in enumerate((0, *forced)):
            seqlen_q, seqlen_k, causal, splits = WIDE_FWD_SHAPES[index % len(WIDE_FWD_SHAPES)]
            cases.append(
                Case(
                    "prefill",
                    "bf16",
                    2,
                    8,
                    2,
                    seqlen_q,
                    seqlen_k,
                    causal=causal,
                    config=config,
                    num_splits=splits,
                    **dims,
                )
            )
        cases.append(Case("prefill", "bf16", 1, 8, 8, 65, 300, causal=False, num_splits=3, **dims))
        cases.append(
            Case(
                "decode",
                "bf16",
                3,
                8,
                2,
                1,
                257,
                causal=True,
                num_splits=7,
                cache_seqlens=(0, 1, 257),
                **dims,
            )
        )
        # 0: on a Hopper card with the sm_90a build, 80 and 96 run the wgmma backward's 128 tile
        # padded (Sm90BwdPaddedTraits), so 2 (their mma.sync kernel elsewhere) is forced too
        backward = (0, 1, *(c for c in (2, 3) if c in workload_backward_configs()))
        if (head_dim, head_dim_v) not in WGMMA_BWD_PADDED_FORCED:
            backward = tuple(c for c in backward if c != 3)
        for config, deterministic in itertools.product(backward, (False, True)):
            cases.append(
                small_backward_case("bf16", head_dim, config, deterministic, head_dim_v=head_dim_v)
            )
        if head_dim == head_dim_v:
            cases.append(PagedCase("bf16", head_dim, 8, 2, 1, PAGED_LENGTHS, 16, num_splits=3))
            lengths_q, lengths_k = VARLEN_LENGTHS[0]
            cases.append(VarlenCase("bf16", head_dim, 4, 4, lengths_q, lengths_k, True, 0))
    return cases


def run_workload(cases: Sequence | None = None, device: str = "cuda") -> int:
    """Call the API once per case; on the GPU, what the sanitizer under it watches (the tests run
    it on the CPU to prove every call is a valid one)."""
    import torch

    from ... import ops

    ops.load_library()
    cases = workload_cases() if cases is None else cases
    for case in cases:
        print(f"{CASE_MARK}{case.id}", flush=True)
        call_case(case, device)
        if device == "cuda":
            torch.cuda.synchronize()  # a finding is reported before the next case's line
    print(f"{DONE_MARK}{len(cases)} calls", flush=True)
    return exitcodes.OK


def call_case(case, device: str) -> None:
    """One call of the public API on the inputs the case's gates draw for it."""
    import torch

    from ..cases import make_inputs, make_output_grad
    from ..gates import backward as grad_gates
    from ..gates import paged as paged_gates
    from ..gates import varlen as varlen_gates
    from ..gates.forward import call_api
    from ..gates.ragged import case_seed

    if isinstance(case, VarlenBackward):
        seed = case_seed(case.id)
        q, k, v, cu_q, cu_k = varlen_gates.make_varlen_inputs(case.forward, device, seed)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        scale = 1.0 / math.sqrt(case.forward.head_dim)
        out, _ = varlen_gates.call_varlen(case.forward, q, k, v, cu_q, cu_k, scale)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1))
        torch.autograd.grad(out, (q, k, v), grad.to(out))
        return
    scale = 1.0 / math.sqrt(case.head_dim)
    if isinstance(case, varlen_gates.VarlenCase):
        inputs = varlen_gates.make_varlen_inputs(case, device, case_seed(case.id))
        varlen_gates.call_varlen(case, *inputs, scale)
    elif isinstance(case, paged_gates.PagedCase):
        inputs = paged_gates.make_paged_inputs(case, device, case_seed(case.id))
        paged_gates.call_paged(case, *inputs, scale)
    elif case.kind == "backward":
        q, k, v, _ = make_inputs(case, device)
        grad_gates.call_api(case, q, k, v, make_output_grad(case, device), scale)
    else:
        call_api(case, *make_inputs(case, device), scale)


# --------------------------------------------------------------------------------------------------
# Parsing compute-sanitizer's output (pure functions)
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Finding:
    """One reported error or hazard, condensed."""

    tool: str
    check: str  # "Invalid __global__ read of size 16 bytes", "Race reported between Write and Read"
    severity: str = (
        "error"  # "error", "warning", or "api" (a failed CUDA call, usually a consequence)
    )
    kernel: str | None = None
    where: str | None = None  # "flash_fwd_kernel.cuh:93", or "+0x1f30" without line info
    thread: str | None = None
    block: str | None = None
    detail: str | None = None  # "Access at 0x... is out of bounds and is 4 GiB after ..."
    other: str | None = None  # racecheck: the other access, "Read at flash_fwd_kernel.cuh:160"
    hazards: int | None = None
    case: str | None = None
    count: int = 1  # identical findings (same check, kernel, place) merged

    def key(self) -> tuple:
        return (self.check, self.kernel, self.where, self.other)

    def line(self) -> str:
        text = self.check
        if self.other:  # racecheck: the two accesses, then the kernel
            text += f" between {self.where or '?'} and {self.other}"
        if self.kernel:
            text += f" in {self.kernel}"
        if self.where and not self.other:
            text += f" at {self.where}"
        if self.hazards:
            text += f" [{self.hazards} hazards]"
        who = " ".join(
            f"{name} ({value})"
            for name, value in (("thread", self.thread), ("block", self.block))
            if value
        )
        if who:
            text += f", {who}"
        if self.detail:
            text += f": {self.detail}"
        if self.count > 1:
            text += f" (x{self.count})"
        if self.case:
            text += f" [case {self.case}]"
        return text

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class ToolReport:
    tool: str
    errors: int | None = None  # from ERROR SUMMARY (or racecheck's summary)
    warnings: int = 0
    findings: list[Finding] = dataclasses.field(default_factory=list)
    unusable: str | None = None  # the line saying the tool cannot run here
    cases_started: int = 0
    workload_done: bool = False

    def kernel_findings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity != "api"]


SANITIZER_PREFIX = "========="  # how compute-sanitizer starts each line it prints
_PREFIX_RE = re.compile(r"^========= ?(?P<body>.*)$")
_ACCESS_RE = re.compile(r"^(?:Invalid|Misaligned) \S+ (?:read|write|atomic)\w* of size \d+ bytes?")
_UNINIT_RE = re.compile(r"^Uninitialized \S+ memory read of size \d+ bytes?")
_RACE_RE = re.compile(
    r"^(?P<sev>Error|Warning|Information|ERROR|WARNING|INFO)\S*: Race reported between "
    r"(?P<access>\w+) access at (?P<loc>.+)$"
)
_HAZARD_RE = re.compile(
    r"^(?P<sev>\w+): Potential (?P<kind>RAW|WAR|WAW) hazard detected at (?P<space>\S+) "
    r"(?P<addr>0x[0-9a-fA-F]+) in block \((?P<block>[^)]*)\)"
)
_BARRIER_RE = re.compile(r"^Barrier error detected\b")
_API_RE = re.compile(
    r"^Program hit (?P<err>\S+) \(error (?P<code>\d+)\) due to \"(?P<msg>[^\"]*)\""
    r"(?: on CUDA API call to (?P<call>\w+))?"
)
_ERROR_SUMMARY_RE = re.compile(r"^ERROR SUMMARY: ([\d,]+) errors?")
_RACE_SUMMARY_RE = re.compile(
    r"^RACECHECK SUMMARY: ([\d,]+) hazards? displayed \(([\d,]+) errors?, ([\d,]+) warnings?\)"
)
_AT_RE = re.compile(r"^at (?P<loc>.+)$")
_AND_RE = re.compile(
    r"^and (?P<access>\w+) access at (?P<loc>.+?)(?: \[(?P<n>[\d,]+) hazards?\])?$"
)
# The caller frames of an inlined device function (the kernel that inlined load_kv_tile, say).
_DEVICE_FRAME_RE = re.compile(r"^Device Frame:\s*(?P<loc>.+?)(?:\s+\[0x[0-9a-fA-F]+\])?$")
_BY_THREAD_RE = re.compile(r"^by thread \((?P<thread>[^)]*)\) in block \((?P<block>[^)]*)\)")
_HAZARD_ACCESS_RE = re.compile(
    r"^(?P<access>Write|Read)\w* Thread \((?P<thread>[^)]*)\) at (?P<loc>.+)$"
)
_ADDRESS_RE = re.compile(r"^(?:Address|Access at|Access to) 0x[0-9a-fA-F]+ (?P<what>is .+)$")
_AND_IS_RE = re.compile(r"^and (?P<what>is .+)$")
# Header lines that are not findings, even when an indented line follows them.
_NOT_FINDINGS = (
    "COMPUTE-SANITIZER",
    "Target application returned an error",
    "Saved host backtrace",
    "LEAK SUMMARY",
    "RACECHECK SUMMARY",
    "ERROR SUMMARY",
    "Program finished",
)


def unusable_reason(text: str) -> str | None:
    """The first line saying the sanitizer (or the profiler) cannot work here, else None."""
    for line in text.splitlines():
        if any(p.search(line) for p in UNUSABLE_PATTERNS):
            return _PREFIX_RE.sub(r"\g<body>", line).strip()[:300]
    return None


def is_our_kernel(name: str) -> bool:
    return any(name.startswith(kernel) for kernel in KERNEL_SUBSTRINGS)


def parse_location(text: str) -> tuple[str | None, str | None]:
    """(kernel, where) from the text after 'at'. compute-sanitizer writes, by version and build,
    'FUNC+0x1f30 in /path/file.cuh:93', 'FUNC+0x80', '0x3f0 in FUNC' or '0x30 in /p/f.cu:6:FUNC'."""
    text = text.strip()
    if match := re.match(r"^(?P<func>.+?)\+(?P<off>0x[0-9a-fA-F]+)(?: in (?P<src>.+))?$", text):
        src = match["src"]
        return short_kernel(match["func"]), (Path(src).name if src else f"+{match['off']}")
    if match := re.match(r"^(?P<pc>0x[0-9a-fA-F]+) in (?P<rest>.+)$", text):
        rest = match["rest"]
        if inner := re.match(r"^(?P<file>[^:\s]+):(?P<line>\d+):(?P<func>.+)$", rest):
            return short_kernel(inner["func"]), f"{Path(inner['file']).name}:{inner['line']}"
        return short_kernel(rest), match["pc"]
    return short_kernel(text), None


def _number(text: str) -> int:
    return int(text.replace(",", ""))


def _header_finding(tool: str, body: str) -> Finding | None:
    """A finding for a record's first line, or None when the line is not one."""
    if _ACCESS_RE.match(body) or _UNINIT_RE.match(body):
        return Finding(tool, body.split(" at 0x")[0].strip())
    if match := _RACE_RE.match(body):
        severity = "warning" if match["sev"].lower().startswith("warn") else "error"
        finding = Finding(tool, "Race reported", severity)
        finding.kernel, where = parse_location(match["loc"])
        finding.where = f"{match['access']} access at {where}" if where else match["access"]
        return finding
    if match := _HAZARD_RE.match(body):
        severity = "warning" if match["sev"].lower().startswith("warn") else "error"
        finding = Finding(tool, f"Potential {match['kind']} hazard on {match['space']}", severity)
        finding.block = match["block"]
        return finding
    if _BARRIER_RE.match(body):
        return Finding(tool, body)
    if match := _API_RE.match(body):
        call = f" in {match['call']}" if match["call"] else ""
        return Finding(tool, f"CUDA error {match['err']} ({match['msg']}){call}", "api")
    return None


def _what(text: str) -> str:
    """'is 1,024 bytes after the nearest allocation at 0x7f.. of size 65,792 bytes' ->
    '1,024 bytes after the nearest allocation of size 65,792 bytes'."""
    text = re.sub(r"^is ", "", text.strip())
    return re.sub(r" at 0x[0-9a-fA-F]+", "", text)


def _continue(finding: Finding, body: str, pending_generic: bool) -> bool:
    """Apply an indented line to the finding; True when a generic header became a finding."""
    if match := _AT_RE.match(body):
        if finding.kernel is None:
            finding.kernel, finding.where = parse_location(match["loc"])
            return pending_generic
    elif match := _DEVICE_FRAME_RE.match(body):
        # The fault sat in a device function inlined into a kernel: name the kernel, keep the
        # innermost place (the line that faulted).
        caller, _ = parse_location(match["loc"])
        if caller and is_our_kernel(caller) and not is_our_kernel(finding.kernel or ""):
            helper = finding.kernel
            finding.kernel = caller
            if helper and finding.where:
                finding.where = f"{finding.where} ({helper.split('<')[0]})"
    elif match := _AND_RE.match(body):
        _, where = parse_location(match["loc"])
        finding.other = finding.other or f"{match['access']} access at {where}"
        if match["n"]:
            finding.hazards = (finding.hazards or 0) + _number(match["n"])
    elif match := _BY_THREAD_RE.match(body):
        finding.thread = finding.thread or match["thread"]
        finding.block = finding.block or match["block"]
    elif match := _HAZARD_ACCESS_RE.match(body):
        kernel, where = parse_location(match["loc"])
        if finding.kernel is None:
            finding.kernel, finding.where = kernel, f"{match['access']} at {where}"
            finding.thread = match["thread"]
        else:
            finding.other = finding.other or f"{match['access']} at {where}"
    elif match := _ADDRESS_RE.match(body):
        finding.detail = _what(match["what"])
    elif (match := _AND_IS_RE.match(body)) and finding.detail:
        finding.detail = f"{finding.detail}, {_what(match['what'])}"[:300]
    return False


def parse_sanitizer_output(tool: str, text: str) -> ToolReport:
    """compute-sanitizer's (merged stdout and stderr) output -> counts and condensed findings.

    Records start at '========= X' and continue on '=========     y' lines; lines without the
    prefix are the workload's own ('sanitize-case: ID' ties the findings that follow to a call)."""
    report = ToolReport(tool)
    case: str | None = None
    current: Finding | None = None
    generic: Finding | None = None  # an unknown header, a finding once an 'at' line follows
    for raw in text.splitlines():
        match = _PREFIX_RE.match(raw)
        if match is None:
            line = raw.strip()
            if line.startswith(CASE_MARK):
                case = line[len(CASE_MARK) :].strip()
                report.cases_started += 1
            elif line.startswith(DONE_MARK):
                report.workload_done = True
            continue
        body = match["body"]
        if not body.strip():
            continue
        if body[0] == " ":  # continuation of the current record
            body = body.strip()
            if current is not None:
                _continue(current, body, False)
            elif generic is not None and _continue(generic, body, True):
                current, generic = generic, None
                report.findings.append(current)
            continue
        body = body.strip()
        current, generic = None, None
        if match := _ERROR_SUMMARY_RE.match(body):
            report.errors = max(report.errors or 0, _number(match[1]))
        elif match := _RACE_SUMMARY_RE.match(body):
            report.errors = max(report.errors or 0, _number(match[2]))
            report.warnings = _number(match[3])
        elif finding := _header_finding(tool, body):
            finding.case = case
            report.findings.append(finding)
            current = finding
        elif not body.startswith(_NOT_FINDINGS):
            generic = Finding(tool, body[:200], case=case)
    report.unusable = unusable_reason(text)
    return report


def merge_findings(findings: Sequence[Finding]) -> list[Finding]:
    """Identical findings (same check, kernel and place: other threads, other blocks) merged into
    the first, with a count; kernel findings before failed API calls (their consequence)."""
    merged: dict[tuple, Finding] = {}
    for finding in findings:
        first = merged.get(finding.key())
        if first is None:
            merged[finding.key()] = dataclasses.replace(finding)
        else:
            first.count += finding.count
            if finding.hazards:
                first.hazards = (first.hazards or 0) + finding.hazards
    return sorted(merged.values(), key=lambda f: f.severity == "api")


def tool_status(report: ToolReport, returncode: int | None, timed_out: bool = False) -> str:
    """'unusable', 'timeout', 'fail' (a finding), 'error' (crashed or stopped without a finding)
    or 'pass'."""
    if report.unusable and not report.kernel_findings():  # a tool that reports kernels works
        return "unusable"
    if timed_out:
        return "timeout"
    if report.findings or report.errors or report.warnings or returncode == SANITIZER_ERROR_EXIT:
        return "fail"
    if returncode != 0 or not report.workload_done:
        return "error"
    return "pass"


def condensed(report: ToolReport, status: str, limit: int = SHOWN_PER_TOOL) -> list[str]:
    """A few lines for a failing tool: its kernels, then the first distinct findings."""
    merged = merge_findings(report.findings)
    if status != "fail" or not merged:
        return []
    kernels = sorted({f.kernel for f in report.kernel_findings() if f.kernel})
    lines = [f"  {report.tool}: kernels {', '.join(kernels)}"] if kernels else []
    lines += [f"  {report.tool}: {f.line()}" for f in merged[:limit]]
    if len(merged) > limit:
        lines.append(f"  {report.tool}: ... and {len(merged) - limit} more distinct findings")
    return lines


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" + ("" if count == 1 else "s")


def count_text(report: ToolReport) -> str:
    if report.tool == "racecheck" and report.errors is not None:
        return f"{_plural(report.errors, 'error')}, {_plural(report.warnings, 'warning')}"
    if report.errors is None:
        return _plural(len(report.findings), "finding")
    return _plural(report.errors, "error")


# --------------------------------------------------------------------------------------------------
# Finding and running the tool
# --------------------------------------------------------------------------------------------------


def sanitizer_command(
    exe: str,
    tool: str,
    print_limit: int = PRINT_LIMIT,
    kernel_filter: bool = True,
    offered: Sequence[str] = (),
    share: tuple[int, int] = (0, 1),
) -> list[str]:
    """The one place the compute-sanitizer command line is put together. `offered`: the Hopper
    options the installed tool lists (sanitize_coverage.offered_options); `share`: (k, n), the
    workload's k-th of n shares (workload_share)."""
    command = [exe, "--tool", tool, "--error-exitcode", str(SANITIZER_ERROR_EXIT)]
    command += ["--print-limit", str(print_limit)]
    # The workload is the one process to watch; a stale build's nvcc children need no watching.
    command += ["--target-processes", "application-only"]
    if tool == "racecheck":
        command += ["--racecheck-report", "all"]
    # Explicit, so that a check of TMA or wgmma never rests on the tool's default.
    command += sanitize_coverage.tool_options(tool, offered)
    if kernel_filter:  # torch's own kernels run uninstrumented: much faster
        for substring in KERNEL_SUBSTRINGS:
            command += ["--kernel-name", f"kns={substring}"]
    workload = [sys.executable, "-m", "flashmoe_science.pipeline.tools.sanitize", "--workload"]
    if share[1] > 1:
        workload += ["--share", f"{share[0] + 1}/{share[1]}"]
    return [*command, *workload]


def workload_share(cases: Sequence, share: tuple[int, int]) -> list:
    """The k-th of n shares of the workload (0-based k): every n-th call from the k-th, so each
    share holds calls of every part of it (forward, decode, backward, packed, paged)."""
    k, n = share
    return list(cases[k::n])


def plan(tools: Sequence[str], jobs: int) -> list[tuple[str, tuple[int, int]]]:
    """The runs of compute-sanitizer, (tool, share), longest first: with one job at a time each tool
    runs once over the whole workload, in `tools`' order; with more, a tool splits into up to
    SHARES[tool] shares (never more than the jobs)."""
    if jobs <= 1:
        return [(tool, (0, 1)) for tool in tools]
    shares = {tool: min(SHARES.get(tool, 1), jobs) for tool in tools}
    order = sorted(tools, key=lambda tool: -shares[tool])
    return [(tool, (k, shares[tool])) for tool in order for k in range(shares[tool])]


def default_jobs() -> int:
    """Runs at once: half the cores (each run is a process instrumenting the GPU, plus its Python
    driving the workload), at most MAX_JOBS."""
    return max(1, min(MAX_JOBS, (os.cpu_count() or 1) // 2))


def tool_env(tool: str, defines: Sequence[str]) -> dict[str, str]:
    env = dict(os.environ, FLASHMOE_BUILD_DEFINES=",".join(defines), PYTHONUNBUFFERED="1")
    if tool in NO_CACHING_TOOLS:
        env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    if tool == "racecheck":  # what it cannot see, left to the other tools (sanitize_coverage)
        env.update(sanitize_coverage.RACECHECK_ENV)
    return env


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------


def _tools(values: Sequence[str]) -> list[str]:
    chosen: list[str] = []
    for value in values:
        for tool in filter(None, (v.strip() for v in value.split(","))):
            if tool not in TOOLS:
                raise argparse.ArgumentTypeError(
                    f"unknown tool {tool!r}: choose from {', '.join(TOOLS)}"
                )
            if tool not in chosen:
                chosen.append(tool)
    return chosen or list(TOOLS)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"{program()} sanitize",
        description="Run compute-sanitizer's memcheck, initcheck, synccheck and racecheck over a "
        "small workload that reaches every kernel code path; any finding fails.",
    )
    p.add_argument(
        "--tool",
        action="append",
        default=[],
        metavar="TOOL",
        help=f"run only these tools (repeatable or comma-separated; default: {','.join(TOOLS)})",
    )
    p.add_argument(
        "--define",
        action="append",
        default=[],
        metavar="NAME=VAL",
        help="sanitize a build with this -D define, e.g. FLASHMOE_PLANT_BUG=3 (default: "
        "$FLASHMOE_BUILD_DEFINES)",
    )
    p.add_argument(
        "--all-kernels",
        action="store_true",
        help="instrument torch's kernels too (slower; default: only this project's kernels)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=TOOL_TIMEOUT_S,
        metavar="S",
        help=f"seconds allowed per tool (default {TOOL_TIMEOUT_S})",
    )
    p.add_argument(
        "--print-limit", type=int, default=PRINT_LIMIT, help="errors each tool prints at most"
    )
    p.add_argument(
        "--jobs",
        type=_jobs,
        default=None,
        metavar="N",
        help="runs of compute-sanitizer at once on the one GPU, racecheck split into up to "
        f"{SHARES['racecheck']} shares of the workload (default: half the cores, at most "
        f"{MAX_JOBS}; 1: one tool after another)",
    )
    when = p.add_mutually_exclusive_group()
    when.add_argument(
        "--background",
        action="store_true",
        help="start the run detached and return at once (the GPU job starts it before its test "
        "stage, beside it); `--wait` waits for it (pipeline/background.py)",
    )
    when.add_argument(
        "--wait",
        action="store_true",
        help="wait for the run --background started, print its output and exit with its status",
    )
    p.add_argument("--list", action="store_true", help="print the workload's case ids and exit")
    p.add_argument("--workload", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--share", type=_share, default=(0, 1), help=argparse.SUPPRESS)
    return p


def _jobs(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--jobs takes a whole number >= 1, got {text!r}")
    return int(text)


def _share(text: str) -> tuple[int, int]:
    """'K/N' (1-based) -> (K - 1, N)."""
    match = re.fullmatch(r"(\d+)/(\d+)", text)
    if not match or not 1 <= int(match[1]) <= int(match[2]):
        raise argparse.ArgumentTypeError(f"--share takes K/N with 1 <= K <= N, got {text!r}")
    return int(match[1]) - 1, int(match[2])


def _say(text: str) -> None:
    print(text, flush=True)


def _defines(args) -> tuple[str, ...]:
    return tuple(args.define) if args.define else _loader.env_defines()


def _gpu_name() -> str | None:
    """The GPU's name, or None when torch sees none."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(torch.cuda.current_device())


def _tool_version(exe: str) -> tuple[str | None, str | None]:
    """(version line, unusable reason)."""
    try:
        done = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"{exe} --version failed: {exc}"
    text = done.stdout + done.stderr
    version = next((ln.strip() for ln in text.splitlines() if "ersion" in ln), None)
    return version, unusable_reason(text)


def _offered_options(exe: str) -> frozenset[str] | None:
    """The Hopper options the tool's --help lists; None when --help cannot be run."""
    try:
        done = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None
    return sanitize_coverage.offered_options(done.stdout + done.stderr)


def _unusable_line(exe: str, reason: str) -> str:
    return (
        f"sanitize: {exe} cannot instrument this GPU here ({reason}); run it where the driver "
        "allows GPU debugging (root or a permitted user, not a restricted container) with a CUDA "
        f"toolkit new enough for this GPU (exit {exitcodes.TOOL_MISSING})"
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        tools = _tools(args.tool)
    except argparse.ArgumentTypeError as exc:
        p.error(str(exc))
    if args.list:
        print("\n".join(case.id for case in workload_share(workload_cases(), args.share)))
        return exitcodes.OK
    if args.wait:
        return background.wait("sanitize")
    if args.background:
        rest = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--background"]
        return background.start("sanitize", ["sanitize", *rest], f"{program()} sanitize --wait")
    if args.workload:
        status = run_workload(workload_share(workload_cases(), args.share))
        # Out without the interpreter's teardown: with another sanitizer on the GPU, torch's exit
        # under memcheck or initcheck aborted ("terminate called without an active exception")
        # after every call had run clean (benches/notes/harness.md, v5.9).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return run(args, tools)


def run(args, tools: list[str]) -> int:
    start = time.monotonic()
    clear_outputs("sanitize.json", *(f"sanitize-{tool}.log" for tool in tools))
    gpu = _gpu_name()
    if gpu is None:
        _say(
            "sanitize: torch sees no GPU, and compute-sanitizer checks kernels as they run on one; "
            "run on a GPU machine (check `nvidia-smi`, CUDA_VISIBLE_DEVICES) "
            f"(exit {exitcodes.ENV_BROKEN})"
        )
        return exitcodes.ENV_BROKEN
    exe = find_cuda_tool("compute-sanitizer")
    if exe is None:
        _say(
            "sanitize: compute-sanitizer not found in $CUDA_HOME/bin, on PATH or in "
            "/usr/local/cuda/bin; install the CUDA toolkit (it ships compute-sanitizer) or put its "
            "bin/ on PATH "
            f"(exit {exitcodes.TOOL_MISSING})"
        )
        return exitcodes.TOOL_MISSING
    version, problem = _tool_version(exe)
    if problem:
        _say(_unusable_line(exe, problem))
        return exitcodes.TOOL_MISSING
    offered = _offered_options(exe)

    defines = _defines(args)
    from ..build import unit as build

    library = build.ensure_built_for("sanitize", defines)
    if isinstance(library, int):
        return library

    restriction = _loader.build_restriction(defines)
    total = len(workload_cases(restriction))
    with_defines = f" with -D{' -D'.join(defines)}" if defines else ""
    if restriction:  # the calls are the workload's cases this build holds
        with_defines += f", the kernels of {restriction.text()!r} only"
    _say(
        f"sanitize: {', '.join(tools)} over {total} calls on {gpu}{with_defines} "
        f"({version or exe}); build {paths_display(library.parent)}"
    )
    out = paths.report_dir()
    doc: dict = {
        "schema": SCHEMA,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "provenance": provenance(),
        "gpu": gpu,
        "sanitizer": exe,
        "sanitizer_version": version,
        # The Hopper options its --help lists (None: unreadable); each tool's "coverage" says
        # what they and the tool's own scope leave unchecked.
        "sanitizer_options": None if offered is None else sorted(offered),
        "defines": list(defines),
        "calls": total,
        "kernel_filter": None if args.all_kernels else list(KERNEL_SUBSTRINGS),
        "tools": {},
    }
    jobs = args.jobs or default_jobs()
    runs = plan(tools, jobs)
    if jobs > 1 and len(runs) > 1:
        split = ", ".join(
            f"{t} in {n} shares" for t, n in sorted({(t, n) for t, (_, n) in runs}) if n > 1
        )
        _say(
            f"sanitize: {len(runs)} runs, {min(jobs, len(runs))} at a time{f' ({split})' if split else ''}"
        )
    calls = workload_cases(restriction)
    stop = threading.Event()  # Ctrl-C reaches this thread: the runs' threads then stop theirs
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=jobs)
    try:
        futures = [
            pool.submit(
                _run_share,
                exe,
                tool,
                share,
                args,
                defines,
                len(workload_share(calls, share)),
                out,
                offered,
                stop,
            )
            for tool, share in runs
        ]
        done = [future.result() for future in futures]
    except BaseException:
        stop.set()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    results: list[tuple[str, ToolReport, str, float]] = []
    for tool in tools:
        report, status, elapsed = _tool_result(
            tool, [r for r in done if r.tool == tool], args, out, doc, offered
        )
        if status == "unusable":
            _say(_unusable_line(exe, report.unusable or "unusable"))
            _write(doc, out)
            return exitcodes.TOOL_MISSING
        results.append((tool, report, status, elapsed))

    elapsed_all = time.monotonic() - start
    failed = [tool for tool, _, status, _ in results if status != "pass"]
    doc["status"] = "fail" if failed else "pass"
    doc["elapsed_s"] = round(elapsed_all, 1)
    _write(doc, out)

    _say("")
    for tool, report, status, elapsed in results:
        _say(f"sanitize: {tool:<9} {status.upper():<7} {count_text(report):<24} {elapsed:7.1f} s")
        if gaps := sanitize_coverage.gap_line(doc["tools"][tool]["coverage"]):
            _say(f"  {tool}: {gaps}")  # what this tool's PASS does not cover
    for tool, report, status, _ in results:
        lines = condensed(report, status)
        if not lines and status != "pass":
            log = doc["tools"][tool]["log"]
            lines = [f"  {tool}: {status}: {doc['tools'][tool]['reason']} (see {log})"]
        for line in lines:
            _say(line)
    logs = paths_display(out / "sanitize-<tool>.log")
    verdict = f"FAILED ({', '.join(failed)})" if failed else "clean"
    doc_path = paths_display(out / "sanitize.json")
    _say(f"sanitize: {verdict} in {elapsed_all:.1f} s; {doc_path}, {logs}")
    return exitcodes.GATE_FAILED if failed else exitcodes.OK


@dataclasses.dataclass
class ShareRun:
    """One run of compute-sanitizer: a tool over one share of the workload."""

    tool: str
    share: tuple[int, int]
    command: list[str]
    log: Path
    returncode: int | None
    text: str
    timed_out: bool
    elapsed: float
    report: ToolReport
    status: str


def _run_share(
    exe: str,
    tool: str,
    share: tuple[int, int],
    args,
    defines: Sequence[str],
    total: int,
    out: Path,
    offered: frozenset[str] | None,
    stop: threading.Event | None = None,
) -> ShareRun:
    kernel_filter = not args.all_kernels
    command = sanitizer_command(exe, tool, args.print_limit, kernel_filter, offered or (), share)
    k, n = share
    name = tool if n == 1 else f"{tool} {k + 1}/{n}"
    log_path = out / (f"sanitize-{tool}.log" if n == 1 else f"sanitize-{tool}.{k + 1}of{n}.log")
    started = time.monotonic()
    state = {"calls": 0, "said": started}

    def progress(line: str) -> None:
        if line.startswith(CASE_MARK):
            state["calls"] += 1
        now = time.monotonic()
        if now - state["said"] >= HEARTBEAT_S:
            state["said"] = now
            _say(f"  {name}: {state['calls']}/{total} calls, {now - started:.0f} s")

    _say(f"  {name}: running ({shlex.join(command[:3])} ...)")
    run = run_streaming(
        command,
        tool_env(tool, defines),
        log_path,
        cwd=paths.REPO_ROOT,
        timeout_s=args.timeout,
        on_line=progress,
        stop=stop,
    )
    elapsed = time.monotonic() - started
    report = parse_sanitizer_output(tool, run.text)
    status = tool_status(report, run.returncode, run.timed_out)
    _say(f"  {name}: {status} in {elapsed:.1f} s ({count_text(report)})")
    return ShareRun(
        tool, share, command, log_path, run.returncode, run.text, run.timed_out, elapsed, report,
        status,
    )  # fmt: skip


# A tool's status over its shares: the first of these that any share has
STATUS_ORDER = ("unusable", "timeout", "fail", "error", "pass")


def merged_report(tool: str, reports: Sequence[ToolReport]) -> ToolReport:
    """One tool's report over the shares of the workload its runs took."""
    counted = [r.errors for r in reports if r.errors is not None]
    return ToolReport(
        tool,
        errors=sum(counted) if counted else None,
        warnings=sum(r.warnings for r in reports),
        findings=[f for r in reports for f in r.findings],
        unusable=next((r.unusable for r in reports if r.unusable), None),
        cases_started=sum(r.cases_started for r in reports),
        workload_done=all(r.workload_done for r in reports),
    )


def _tool_result(
    tool: str,
    shares: Sequence[ShareRun],
    args,
    out: Path,
    doc: dict,
    offered: frozenset[str] | None,
) -> tuple[ToolReport, str, float]:
    """Merge a tool's runs (its report, its one log) into doc["tools"][tool]."""
    report = merged_report(tool, [r.report for r in shares])
    status = min((r.status for r in shares), key=STATUS_ORDER.index)
    first = next(r for r in shares if r.status == status)  # the run that says why
    elapsed = max(r.elapsed for r in shares)
    log_path = out / f"sanitize-{tool}.log"
    if len(shares) > 1:  # one log per tool: the shares' in order, each under its command
        with open(log_path, "w", encoding="utf-8") as log:
            for run in shares:
                k, n = run.share
                log.write(f"=== share {k + 1}/{n} ({run.elapsed:.1f} s, {run.status})\n")
                log.write(run.log.read_text(encoding="utf-8", errors="replace"))
                run.log.unlink()
    doc["tools"][tool] = {
        "status": status,
        "elapsed_s": round(elapsed, 1),
        "returncode": first.returncode,
        "errors": report.errors,
        "warnings": report.warnings,
        "calls_started": report.cases_started,
        "findings": [f.to_json() for f in merge_findings(report.findings)[:PRINT_LIMIT]],
        "coverage": sanitize_coverage.coverage(tool, offered),
        "reason": _reason(first.report, status, first.returncode, args.timeout, first.text),
        "log": paths_display(log_path),
        "command": shlex.join(first.command),
        "shares": len(shares),
    }
    return report, status, elapsed


def _reason(report: ToolReport, status: str, returncode, timeout: float, text: str) -> str | None:
    if status == "timeout":
        return f"stopped after {timeout:.0f} s ({report.cases_started} calls started)"
    if status == "error":
        # The workload's own last line (a traceback's exception), not the tool's summary after it.
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        own = [ln for ln in lines if not ln.startswith(SANITIZER_PREFIX)]
        tail = own[-1:] or lines[-1:] or ["no output"]
        where = f"after {report.cases_started} calls" if report.cases_started else "before any call"
        return f"the workload exited {returncode} {where} without a finding: {tail[0][:200]}"
    if status == "unusable":
        return report.unusable
    if status == "fail" and not report.findings:
        return f"exit {returncode} ({count_text(report)}), but no finding this parser knows"
    return None


def _write(doc: dict, out: Path) -> None:
    path = out / "sanitize.json"
    tmp = path.with_name(".sanitize.json.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)


if __name__ == "__main__":
    sys.exit(main())
