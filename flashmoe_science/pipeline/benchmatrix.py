"""The benchmark's case matrix: prefill over the FA2 benchmark's 16k-token sweep, decode over cache
lengths, batches and GQA ratios, small shapes, and the backward (alone, and with the forward as a
training step) over the prefill sweep; scaled down on the CPU backend."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

from .cases import Case, parse_case_id

KV_CACHE_LIMIT_BYTES = 8 * 1024**3  # decode cases whose K+V exceed this are left out of the matrix


def prefill_cases(seqlens, tokens, heads_for_dim, dtypes=("fp16", "bf16")) -> list[Case]:
    """B*S = tokens for every S (the FA2 benchmark's 16k-token sweep)."""
    return [
        Case("prefill", dtype, tokens // s, heads, heads, s, s, d, causal)
        for dtype in dtypes
        for d, heads in heads_for_dim.items()
        for s in seqlens
        for causal in (False, True)
    ]


def training_cases(
    seqlens, tokens, heads_for_dim, dtypes=("fp16", "bf16"), kinds=("backward", "train"), config=0
) -> list[Case]:
    """The prefill sweep's shapes as backward and training-step cases; config forces a backward
    configuration (the one another card picks, measured on this one)."""
    return [
        Case(
            kind,
            c.dtype,
            c.batch,
            c.heads_q,
            c.heads_kv,
            c.seqlen_q,
            c.seqlen_k,
            c.head_dim,
            c.causal,
            config=config,
        )
        for kind in kinds
        for c in prefill_cases(seqlens, tokens, heads_for_dim, dtypes)
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
        *training_cases((512, 1024, 2048, 4096, 8192, 16384), 16384, {64: 32, 128: 16}),
        # backward configuration 1 is what the L4 (sm_89, 99 KB of shared memory a block) runs
        *training_cases(
            (512, 2048, 8192), 16384, {64: 32, 128: 16}, ("bf16",), ("backward",), config=1
        ),
    ]


def cpu_matrix() -> list[Case]:
    """The GPU matrix shrunk until the CPU implementation gets through it in ~30 s on 2 cores."""
    return [
        *prefill_cases((128, 256, 512), 1024, {64: 4, 128: 2}),
        *decode_cases((1024, 4096), (1, 4), 8, (8, 2)),
        *small_cases(),
        *training_cases((128, 256), 512, {64: 2, 128: 1}),
    ]


QUICK_IDS = {
    "cuda": (
        "fwd-bf16-d128-h16-b4-s4096-causal",
        "fwd-fp16-d64-h32-b16-s1024-full",
        "dec-bf16-d128-h32kv8-b16-q1-k8192",
        "fwd-fp16-d64-h8-b1-s512-full",
        "bwd-bf16-d128-h16-b4-s4096-causal",
    ),
    "cpu": (
        "fwd-bf16-d128-h2-b4-s256-causal",
        "fwd-fp16-d64-h4-b8-s128-full",
        "dec-bf16-d128-h8kv2-b4-q1-k1024",
        "fwd-fp16-d64-h1-b1-s128-full",
        "bwd-bf16-d128-h1-b2-s256-causal",
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
