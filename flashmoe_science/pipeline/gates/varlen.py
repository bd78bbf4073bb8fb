"""Correctness gates of packed (varlen) batches: flash_attention_varlen_forward on batches that mix
empty, one-token and long sequences, each sequence judged against the reference of that sequence
alone (both gates, its log-sum-exp, determinism; see ragged.py) and against our dense kernel
(flash_attention_forward) on the same sequence, within the gate-2 bound.

The case matrix: per-sequence lengths 0, 1, 17, 128, 1000 and 4096 (the CPU tier shorter), with
Sq == Sk and Sq != Sk both ways per sequence, GQA 1/4/8, both dtypes, causal and not, head dims 64
and 128 and those of matrix.NEW_HEAD_DIMS (v's differing included), and on CUDA each forward tile
configuration forced (the wgmma one also at matrix.WGMMA_WIDE_HEAD_DIMS); and windows, soft-capping
and sinks (FEATURE_CASES), each window aligned per sequence.
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
from .matrix import (
    NEW_HEAD_DIMS,
    NEW_HEAD_DIMS_CPU,
    WGMMA_DV_MATRIX_HEAD_DIMS,
    WGMMA_PADDED_HEAD_DIMS,
    WGMMA_WIDE_HEAD_DIMS,
    WGMMA_WIDE_MATRIX_CONFIG,
)
from .ragged import RaggedCaseParts, RaggedResult, case_seed


@dataclass(frozen=True)
class VarlenCase(RaggedCaseParts):
    dtype: str
    head_dim: int
    heads_q: int
    heads_kv: int
    lengths_q: tuple[int, ...]
    lengths_k: tuple[int, ...]
    causal: bool
    config: int = 0  # forced tile configuration (0: automatic)
    scores: str = "normal"  # cases.SCORES, along each sequence's keys
    head_dim_v: int = 0  # v's and the output's head dim where it differs from head_dim
    window: tuple[int, int] = (-1, -1)  # window_size, softcap and sinks as cases.Case's
    softcap: float = 0.0
    sinks: bool = False

    def __post_init__(self):
        self.normalise()
        if len(self.lengths_q) != len(self.lengths_k):
            raise ValueError(
                f"VarlenCase needs one key length per query length, got {len(self.lengths_q)} "
                f"and {len(self.lengths_k)}"
            )

    @property
    def id(self) -> str:
        parts = [
            "varlen",
            self.dtype,
            self.dims_part(),
            self.heads_part(),
            "q" + "_".join(map(str, self.lengths_q)),
            "k" + "_".join(map(str, self.lengths_k)),
            "causal" if self.causal else "full",
        ]
        if self.config:
            parts.append(f"cfg{self.config}")
        if self.scores != "normal":
            parts.append(self.scores)
        return "-".join(parts) + feature_suffix(self.window, self.softcap, self.sinks)

    def describe(self) -> str:
        return (
            f"varlen B={len(self.lengths_q)} Hq={self.heads_q} Hkv={self.heads_kv} "
            f"D={self.head_dim}"
            + (f" Dv={self.head_dim_v}" if self.head_dim_v else "")
            + f" dtype={self.dtype} causal={self.causal} config={self.config} "
            f"lengths_q={list(self.lengths_q)} lengths_k={list(self.lengths_k)}"
            + (f" scores={self.scores}" if self.scores != "normal" else "")
            + describe_features(self.window, self.softcap, self.sinks)
        )


# (query lengths, key lengths) per batch.
BATCHES = (
    ((17, 0, 1000, 1, 128, 4096), (17, 0, 1000, 1, 128, 4096)),  # Sq == Sk per sequence
    ((1, 17, 128, 1000, 4096, 0), (4096, 1000, 17, 128, 1, 3)),  # Sq != Sk both ways
    ((1, 1, 1, 1, 0), (0, 1, 1000, 129, 0)),  # decode-like, and a query with no key
)
BATCHES_CPU = (
    ((17, 0, 100, 1, 64), (17, 0, 100, 1, 64)),
    ((1, 17, 64, 0, 5), (70, 17, 1, 3, 0)),
)
GQA_RATIOS = (1, 4, 8)
HEADS_Q = 8
# The forward tile configurations with a packed variant (3, the decode kernel, has none).
VARLEN_CONFIGS = (1, 2, 4, 5)
# Windows, soft-capping and sinks: (batch, causal, window, softcap, sinks) per tier, every
# sequence's window aligned to its own bottom-right corner, sequences shorter than the window and
# without keys (a sink's row then keeps lse = the sink).
FEATURE_CASES = (
    (1, True, (16, 0), 5.0, True),
    (0, False, (3, 40), 0.0, False),
    (2, True, (0, 0), 1.0, True),
    (1, False, (-1, 8), 0.0, True),
)
FEATURE_CASES_CPU = (
    (1, True, (16, 0), 5.0, True),
    (0, False, (3, 40), 1.0, False),
)


def varlen_cases(tier: str) -> list[VarlenCase]:
    """Varlen gate cases. tier "gpu": the full matrix; tier "cpu": shorter sequences."""
    return list(_cases(tier))


def _cases(tier: str) -> Iterator[VarlenCase]:
    gpu = tier == "gpu"
    index = 0
    for dtype in DTYPES:
        for head_dim in (64, 128) if gpu else (64,):
            for causal in (False, True):
                for lengths_q, lengths_k in BATCHES if gpu else BATCHES_CPU:
                    ratio = GQA_RATIOS[index % len(GQA_RATIOS)]
                    yield VarlenCase(
                        dtype, head_dim, HEADS_Q, HEADS_Q // ratio, lengths_q, lengths_k, causal
                    )
                    index += 1
    if gpu:
        # Each forward tile configuration any architecture selects, forced on this card.
        for config in VARLEN_CONFIGS:
            for dtype in DTYPES:
                for causal in (False, True):
                    ratio = GQA_RATIOS[index % len(GQA_RATIOS)]
                    head_dim = (64, 128)[index % 2]
                    lengths_q, lengths_k = BATCHES[1]
                    yield VarlenCase(
                        dtype,
                        head_dim,
                        HEADS_Q,
                        HEADS_Q // ratio,
                        lengths_q,
                        lengths_k,
                        causal,
                        config=config,
                    )
                    index += 1
    # Scores that keep growing along each sequence's keys (cases.SCORES): the packed kernels'
    # online softmax then rescales block after block.
    lengths_q, lengths_k = BATCHES[1] if gpu else BATCHES_CPU[1]
    for scores in ("rising", "falling"):
        for head_dim in (64, 128) if gpu else (64,):
            for causal in (False, True):
                yield VarlenCase(
                    "bf16", head_dim, HEADS_Q, 2, lengths_q, lengths_k, causal, scores=scores
                )
    # The head dims past 64 and 128: on the GPU every batch of the matrix, on the CPU one batch
    # (Sq != Sk both ways) each, causal.
    variants = itertools.product(
        NEW_HEAD_DIMS if gpu else NEW_HEAD_DIMS_CPU,
        DTYPES if gpu else ("bf16",),
        (False, True) if gpu else (True,),
        BATCHES if gpu else BATCHES_CPU[1:],
    )
    yield from _head_dim_cases(variants)
    yield from _feature_cases(gpu)
    if gpu:
        yield from _wide_wgmma_cases()
        yield from _dv_padded_wgmma_cases()
        yield from _forced_wgmma_cases(WGMMA_PADDED_HEAD_DIMS)  # the 128 tile run padded


def _head_dim_cases(variants, config: int = 0) -> Iterator[VarlenCase]:
    """A case for each ((head_dim, head_dim_v), dtype, causal, (lengths_q, lengths_k)) of
    `variants`, the GQA ratio taken in turn, on `config` (0: automatic)."""
    for index, ((head_dim, head_dim_v), dtype, causal, (lengths_q, lengths_k)) in enumerate(
        variants
    ):
        ratio = GQA_RATIOS[index % len(GQA_RATIOS)]
        yield VarlenCase(
            dtype,
            head_dim,
            HEADS_Q,
            HEADS_Q // ratio,
            lengths_q,
            lengths_k,
            causal,
            config,
            head_dim_v=head_dim_v,
        )


def _wide_wgmma_cases() -> Iterator[VarlenCase]:
    """The wgmma forward's packed kernel past head dim 128 (matrix.WGMMA_WIDE_HEAD_DIMS), forced."""
    return _forced_wgmma_cases(tuple((d, d) for d in WGMMA_WIDE_HEAD_DIMS))


def _dv_padded_wgmma_cases() -> Iterator[VarlenCase]:
    """The wgmma forward's packed kernel at matrix.WGMMA_DV_MATRIX_HEAD_DIMS (v narrower than q and
    k), forced."""
    return _forced_wgmma_cases(WGMMA_DV_MATRIX_HEAD_DIMS)


def _forced_wgmma_cases(dims: tuple[tuple[int, int], ...]) -> Iterator[VarlenCase]:
    """The wgmma forward's packed kernel (WGMMA_WIDE_MATRIX_CONFIG) at head dims (q's and k's,
    v's) `dims`: every batch of the matrix with both dtypes and masks, then FEATURE_CASES."""
    config = WGMMA_WIDE_MATRIX_CONFIG
    yield from _head_dim_cases(itertools.product(dims, DTYPES, (False, True), BATCHES), config)
    for index, (batch, causal, window, softcap, sinks) in enumerate(FEATURE_CASES):
        lengths_q, lengths_k = BATCHES[batch]
        head_dim, head_dim_v = dims[index % len(dims)]
        yield VarlenCase(
            tuple(DTYPES)[index % len(DTYPES)],
            head_dim,
            HEADS_Q,
            HEADS_Q // GQA_RATIOS[index % len(GQA_RATIOS)],
            lengths_q,
            lengths_k,
            causal,
            config,
            window=window,
            softcap=softcap,
            sinks=sinks,
            head_dim_v=head_dim_v,
        )


def _feature_cases(gpu: bool) -> Iterator[VarlenCase]:
    batches = BATCHES if gpu else BATCHES_CPU
    for index, (batch, causal, window, softcap, sinks) in enumerate(
        FEATURE_CASES if gpu else FEATURE_CASES_CPU
    ):
        lengths_q, lengths_k = batches[batch % len(batches)]
        ratio = GQA_RATIOS[index % len(GQA_RATIOS)]
        yield VarlenCase(
            tuple(DTYPES)[index % len(DTYPES)],
            (64, 128)[index % 2] if gpu else 64,
            HEADS_Q,
            HEADS_Q // ratio,
            lengths_q,
            lengths_k,
            causal,
            window=window,
            softcap=softcap,
            sinks=sinks,
        )


def varlen_sinks(case: VarlenCase, device: str, seed: int) -> torch.Tensor | None:
    """The case's sink logits (cases.draw_sinks), None without sinks."""
    if not case.sinks:
        return None
    keys = max(case.lengths_k) if case.window[0] < 0 else case.window[0] + 1
    return draw_sinks(case.heads_q, keys, seed + 2, device)


def _cumulative(lengths: tuple[int, ...], device: str) -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def make_varlen_inputs(case: VarlenCase, device: str, seed: int):
    """Random packed q [total_q, Hq, D], k [total_k, Hkv, D], v [total_k, Hkv, Dv] and
    cu_seqlens_q/k (int32)."""
    generator = torch.Generator().manual_seed(seed)
    dtype = DTYPES[case.dtype]

    def randn(rows: int, heads: int, head_dim: int = case.head_dim) -> torch.Tensor:
        t = torch.randn((rows, heads, head_dim), generator=generator)
        return t.to(device=device, dtype=dtype)

    q = randn(sum(case.lengths_q), case.heads_q)
    k = randn(sum(case.lengths_k), case.heads_kv)
    v = randn(sum(case.lengths_k), case.heads_kv, case.head_dim_v or case.head_dim)
    if case.scores != "normal":  # each sequence's keys ramp from its first to its last
        start = 0
        for length in case.lengths_k:
            rows = k[start : start + length].permute(1, 0, 2)[None]  # [1, Hkv, length, D]
            k[start : start + length] = ramp_keys(rows, case.scores)[0].permute(1, 0, 2)
            start += length
    return q, k, v, _cumulative(case.lengths_q, device), _cumulative(case.lengths_k, device)


VarlenFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def call_varlen(case: VarlenCase, q, k, v, cu_q, cu_k, scale: float):
    """Call the public API exactly as a user would."""
    from ... import ops

    options = {}
    if case.window != (-1, -1) or case.softcap or case.sinks:
        sinks = varlen_sinks(case, q.device.type, case_seed(case.id))
        options = {"window_size": case.window, "softcap": case.softcap, "sinks": sinks}
    return ops.flash_attention_varlen_forward(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max(case.lengths_q),
        max(case.lengths_k),
        case.causal,
        scale,
        return_lse=True,
        config=case.config,
        **options,
    )


def _dense(rows: torch.Tensor) -> torch.Tensor:
    """[S, H, D] rows of one sequence as the dense layout [1, H, S, D] (a view)."""
    return rows.transpose(0, 1).unsqueeze(0)


def check_varlen_case(case: VarlenCase, device: str, varlen_fn: VarlenFn | None = None):
    """Run one packed call (twice, for determinism) and gate each sequence of it."""
    from ... import ops

    fn = varlen_fn or call_varlen
    seed = case_seed(case.id)
    q, k, v, cu_q, cu_k = make_varlen_inputs(case, device, seed)
    scale = 1.0 / math.sqrt(case.head_dim)
    with poisoned_outputs():
        out, lse = fn(case, q, k, v, cu_q, cu_k, scale)
        out_again, lse_again = fn(case, q, k, v, cu_q, cu_k, scale)
    result = RaggedResult(case.id)
    options = {**features(case), "sinks": varlen_sinks(case, device, seed)}
    api_options = {"window_size": case.window, "softcap": case.softcap, "sinks": options["sinks"]}
    q0 = k0 = 0
    for b, (len_q, len_k) in enumerate(zip(case.lengths_q, case.lengths_k, strict=True)):
        rows_q, rows_k = slice(q0, q0 + len_q), slice(k0, k0 + len_k)
        q0, k0 = q0 + len_q, k0 + len_k
        if len_q == 0:
            continue
        qs, ks, vs = _dense(q[rows_q]), _dense(k[rows_k]), _dense(v[rows_k])
        ref, ref_lse = attention_reference(qs, ks, vs, case.causal, scale, **options)
        out_pt = attention_pytorch_lowp(qs, ks, vs, case.causal, scale, **options)
        seq = result.gate(
            b,
            case.dtype,
            device,
            seed,
            _dense(out[rows_q]),
            lse[:, rows_q].unsqueeze(0),
            _dense(out_again[rows_q]),
            lse_again[:, rows_q].unsqueeze(0),
            ref,
            ref_lse,
            out_pt,
        )
        dense = ops.flash_attention_forward(qs, ks, vs, case.causal, scale, **api_options)
        diff = float((_dense(out[rows_q]).float() - dense.float()).abs().nan_to_num(math.inf).max())
        if not diff <= seq.bound:
            seq.failures.append(
                f"against our dense kernel on the same sequence: max diff {diff:.4g} > gate-2 "
                f"bound {seq.bound:.4g}"
            )
    return result
