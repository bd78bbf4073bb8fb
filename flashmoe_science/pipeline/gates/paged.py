"""Correctness gates of decode against a paged KV cache: flash_attention_decode(block_table=...) on
a cache whose pages are shuffled (a random permutation of three times the pages needed, as
FlashAttention's tests build it), judged against

- our contiguous decode on the same cache contents (the pages gathered in table order): the paged
  path must give bit-identical output and log-sum-exp, since only the loads differ;
- the reference of each sequence (both gates, the log-sum-exp, determinism; see ragged.py).

The case matrix: block sizes 16 to 256, cache lengths that are empty, one token, end inside a page
and inside a 64-key tile, GQA 1/4/8, both dtypes, head dims 64 and 128 and those of
matrix.NEW_HEAD_DIMS (v_cache's differing included), split-KV automatic, off and forced, causal and
not; and caches whose keys ramp along each sequence (cases.SCORES), so the online
softmax's running max moves block after block and the splits' maxima differ; and sliding windows,
soft-capping and sinks (FEATURE_CASES), split and not: a window starts inside a page, and a sink is
added once per row, not once per split.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ..cases import (
    DTYPES,
    describe_features,
    draw_sinks,
    feature_suffix,
    ramp_keys,
)
from .forward import attention_pytorch_lowp, attention_reference, features, poisoned_outputs
from .matrix import NEW_HEAD_DIMS, NEW_HEAD_DIMS_CPU
from .ragged import RaggedCaseParts, RaggedResult, case_seed


@dataclass(frozen=True)
class PagedCase(RaggedCaseParts):
    dtype: str
    head_dim: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    lengths: tuple[int, ...]  # cache_seqlens, one per sequence
    page_size: int
    num_splits: int = 0  # 0: automatic
    causal: bool = True
    scores: str = "normal"  # cases.SCORES, along each sequence's cache positions
    head_dim_v: int = 0  # v_cache's and the output's head dim where it differs from head_dim
    window: tuple[int, int] = (-1, -1)  # window_size, softcap and sinks as cases.Case's
    softcap: float = 0.0
    sinks: bool = False

    def __post_init__(self):
        self.normalise()

    @property
    def id(self) -> str:
        parts = ["paged", self.dtype, self.dims_part(), self.heads_part(), f"q{self.seqlen_q}"]
        parts.append(f"page{self.page_size}")
        if self.num_splits:
            parts.append(f"splits{self.num_splits}")
        parts.append("lens" + "_".join(map(str, self.lengths)))
        if not self.causal:
            parts.append("full")
        if self.scores != "normal":
            parts.append(self.scores)
        return "-".join(parts) + feature_suffix(self.window, self.softcap, self.sinks)

    def describe(self) -> str:
        return (
            f"paged decode B={len(self.lengths)} Hq={self.heads_q} Hkv={self.heads_kv} "
            f"Sq={self.seqlen_q} D={self.head_dim}"
            + (f" Dv={self.head_dim_v}" if self.head_dim_v else "")
            + f" dtype={self.dtype} causal={self.causal} "
            f"block_size={self.page_size} num_splits={self.num_splits or 'auto'} "
            f"cache_seqlens={list(self.lengths)}"
            + (f" scores={self.scores}" if self.scores != "normal" else "")
            + describe_features(self.window, self.softcap, self.sinks)
        )

    @property
    def pages_per_sequence(self) -> int:
        # one spare page: the table is longer than the longest sequence needs
        return max(1, math.ceil(max(self.lengths) / self.page_size)) + 1


# Every power of two from 16 is accepted; the range is 16 to 256, and 512 and 1024 are
# gated as well, so no block size a user may pass goes ungated below a sequence's length.
PAGE_SIZES = (16, 32, 64, 128, 256, 512, 1024)
PAGE_SIZES_CPU = (16, 64, 256, 1024)
LENGTHS = (0, 1, 63, 65, 1000, 4096)
LENGTHS_CPU = (0, 1, 17, 65, 300)
LONG_LENGTHS = (32768, 5)
GQA_RATIOS = (1, 4, 8)
SPLITS = (0, 1, 7)
HEADS_Q = 8
# Ramped cases (cases.SCORES): (head dim, block size, num_splits) for each direction; caches long
# enough for several 64-key blocks in every split.
RAMPED = ((64, 16, 7), (64, 256, 0), (128, 64, 0), (128, 128, 7))
RAMPED_CPU = ((64, 32, 7), (128, 256, 0))
RAMPED_LENGTHS = (4096, 1000, 17)
RAMPED_LENGTHS_CPU = (1000, 130, 0)
# Sliding windows (decode's, causal), softcap and sinks: (block size, num_splits, window, softcap,
# sinks); windows that start inside a page and span several, split and not.
FEATURE_CASES = (
    (16, 7, (100, 0), 0.0, True),
    (64, 0, (16, 0), 5.0, False),
    (256, 0, (1000, 0), 1.0, True),
    (32, 1, (0, 0), 0.0, True),
)
FEATURE_CASES_CPU = ((16, 7, (100, 0), 1.0, True), (64, 0, (16, 0), 5.0, False))


def paged_cases(tier: str) -> list[PagedCase]:
    """Paged gate cases. tier "gpu": the full matrix; tier "cpu": fewer, shorter."""
    return list(_cases(tier))


def _cases(tier: str) -> Iterator[PagedCase]:
    gpu = tier == "gpu"
    index = 0
    for page_size in PAGE_SIZES if gpu else PAGE_SIZES_CPU:
        for dtype in DTYPES:
            for head_dim in (64, 128) if gpu else (64,):
                ratio = GQA_RATIOS[index % len(GQA_RATIOS)]
                yield PagedCase(
                    dtype,
                    head_dim,
                    HEADS_Q,
                    HEADS_Q // ratio,
                    seqlen_q=(1, 2)[index % 2],
                    lengths=LENGTHS if gpu else LENGTHS_CPU,
                    page_size=page_size,
                    num_splits=SPLITS[index % len(SPLITS)],
                    causal=index % 5 != 4,
                )
                index += 1
    if gpu:
        for page_size in (16, 256):
            yield PagedCase("bf16", 128, 32, 8, 1, LONG_LENGTHS, page_size)
    # Scores that keep growing along each sequence's cache (cases.SCORES): the online softmax then
    # rescales block after block, and a split-KV combine must weigh splits whose maxima differ.
    for scores in ("rising", "falling"):
        for head_dim, page_size, num_splits in RAMPED if gpu else RAMPED_CPU:
            ratio = GQA_RATIOS[index % len(GQA_RATIOS)]
            yield PagedCase(
                tuple(DTYPES)[index % len(DTYPES)],
                head_dim,
                HEADS_Q,
                HEADS_Q // ratio,
                seqlen_q=(1, 2)[index % 2],
                lengths=RAMPED_LENGTHS if gpu else RAMPED_LENGTHS_CPU,
                page_size=page_size,
                num_splits=num_splits,
                scores=scores,
            )
            index += 1
    # The head dims past 64 and 128: on the GPU every block size, both dtypes, split-KV in turn;
    # on the CPU one case each.
    variants = itertools.product(
        NEW_HEAD_DIMS if gpu else NEW_HEAD_DIMS_CPU,
        PAGE_SIZES if gpu else (32,),
        DTYPES if gpu else ("fp16",),
    )
    for (head_dim, head_dim_v), page_size, dtype in variants:
        ratio = GQA_RATIOS[index % len(GQA_RATIOS)]
        yield PagedCase(
            dtype,
            head_dim,
            HEADS_Q,
            HEADS_Q // ratio,
            seqlen_q=(1, 2)[index % 2],
            lengths=LENGTHS if gpu else LENGTHS_CPU,
            page_size=page_size,
            num_splits=SPLITS[index % len(SPLITS)] if gpu else 7,
            causal=index % 5 != 4,
            head_dim_v=head_dim_v,
        )
        index += 1
    for page_size, num_splits, window, softcap, sinks in (
        FEATURE_CASES if gpu else FEATURE_CASES_CPU
    ):
        ratio = GQA_RATIOS[index % len(GQA_RATIOS)]
        yield PagedCase(
            tuple(DTYPES)[index % len(DTYPES)],
            (64, 128)[index % 2] if gpu else 64,
            HEADS_Q,
            HEADS_Q // ratio,
            seqlen_q=(1, 4)[index % 2],
            lengths=LENGTHS if gpu else LENGTHS_CPU,
            page_size=page_size,
            num_splits=num_splits,
            window=window,
            softcap=softcap,
            sinks=sinks,
        )
        index += 1


def paged_sinks(case: PagedCase, device: str, seed: int) -> torch.Tensor | None:
    """The case's sink logits (cases.draw_sinks), None without sinks."""
    if not case.sinks:
        return None
    keys = max(case.lengths) if case.window[0] < 0 else case.window[0] + 1
    return draw_sinks(case.heads_q, keys, seed + 2, device)


def make_paged_inputs(case: PagedCase, device: str, seed: int):
    """q [B, Hq, Sq, D], a paged cache [num_pages, page_size, Hkv, D] (v_cache's last dimension
    Dv) of three times the pages the table needs, a shuffled block table (int32) and the cache
    lengths (int32)."""
    generator = torch.Generator().manual_seed(seed)
    dtype = DTYPES[case.dtype]
    batch = len(case.lengths)
    per_seq = case.pages_per_sequence
    num_pages = 3 * batch * per_seq

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator).to(device=device, dtype=dtype)

    q = randn(batch, case.heads_q, case.seqlen_q, case.head_dim)
    k_cache = randn(num_pages, case.page_size, case.heads_kv, case.head_dim)
    v_cache = randn(num_pages, case.page_size, case.heads_kv, case.head_dim_v or case.head_dim)
    table = torch.randperm(num_pages, generator=generator)[: batch * per_seq].view(batch, per_seq)
    table = table.to(torch.int32).to(device)
    if case.scores != "normal":  # each sequence's keys ramp from its first position to its last
        logical = contiguous_cache(k_cache, table)  # [B, Hkv, pages x page_size, D], a copy
        for b, length in enumerate(case.lengths):
            logical[b : b + 1, :, :length] = ramp_keys(logical[b : b + 1, :, :length], case.scores)
        k_cache[table.long().reshape(-1)] = logical.transpose(1, 2).reshape(
            -1, case.page_size, case.heads_kv, case.head_dim
        )
    lengths = torch.tensor(case.lengths, dtype=torch.int32)
    return q, k_cache, v_cache, table, lengths.to(device)


def contiguous_cache(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The pages of each sequence gathered in table order: [B, Hkv, pages x page_size, D]."""
    batch, per_seq = table.shape
    gathered = cache[table.long().reshape(-1)]
    return gathered.view(batch, per_seq * cache.shape[1], *cache.shape[2:]).transpose(1, 2)


PagedFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _options(case: PagedCase, device: str, seed: int) -> dict:
    """flash_attention_decode's window_size, softcap and sinks for the case (none: {})."""
    if case.window == (-1, -1) and not case.softcap and not case.sinks:
        return {}
    sinks = paged_sinks(case, device, seed)
    return {"window_size": case.window, "softcap": case.softcap, "sinks": sinks}


def call_paged(case: PagedCase, q, k_cache, v_cache, table, lengths, scale: float):
    """Call the public API exactly as a user would."""
    from ... import ops

    return ops.flash_attention_decode(
        q,
        k_cache,
        v_cache,
        lengths,
        scale,
        causal=case.causal,
        num_splits=case.num_splits or None,
        return_lse=True,
        block_table=table,
        **_options(case, q.device.type, case_seed(case.id)),
    )


def check_paged_case(case: PagedCase, device: str, paged_fn: PagedFn | None = None):
    """Run one paged decode (twice, for determinism) and gate it per sequence."""
    from ... import ops

    fn = paged_fn or call_paged
    seed = case_seed(case.id)
    q, k_cache, v_cache, table, lengths = make_paged_inputs(case, device, seed)
    scale = 1.0 / math.sqrt(case.head_dim)
    with poisoned_outputs():
        out, lse = fn(case, q, k_cache, v_cache, table, lengths, scale)
        out_again, lse_again = fn(case, q, k_cache, v_cache, table, lengths, scale)
    k, v = contiguous_cache(k_cache, table), contiguous_cache(v_cache, table)
    contiguous_out, contiguous_lse = ops.flash_attention_decode(
        q,
        k,
        v,
        lengths,
        scale,
        causal=case.causal,
        num_splits=case.num_splits or None,
        return_lse=True,
        **_options(case, device, seed),
    )
    options = {**features(case), "sinks": paged_sinks(case, device, seed)}
    ref, ref_lse = attention_reference(q, k, v, case.causal, scale, lengths, **options)
    out_pt = attention_pytorch_lowp(q, k, v, case.causal, scale, lengths, **options)
    result = RaggedResult(case.id)
    for b in range(len(case.lengths)):
        rows = slice(b, b + 1)
        seq = result.gate(
            b,
            case.dtype,
            device,
            seed,
            out[rows],
            lse[rows],
            out_again[rows],
            lse_again[rows],
            ref[rows],
            ref_lse[rows],
            out_pt[rows],
        )
        same_out = torch.equal(out[rows], contiguous_out[rows])
        same_lse = torch.equal(lse[rows], contiguous_lse[rows])
        if not (same_out and same_lse):
            diff = float((out[rows].float() - contiguous_out[rows].float()).abs().max())
            seq.failures.append(
                "not bit-identical to the contiguous decode on the same cache contents "
                f"(output max diff {diff:.4g}, log-sum-exp {'equal' if same_lse else 'differs'})"
            )
    return result
