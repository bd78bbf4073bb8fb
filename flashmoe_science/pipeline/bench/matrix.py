"""The benchmark's case matrix: prefill over the FA2 benchmark's 16k-token sweep, decode over cache
lengths, batches and GQA ratios, small shapes, and the backward (alone, and with the forward as a
training step) over the prefill sweep; a sliding window, a softcap and sinks beside their plain
twin (feature_cases); then the speed-target cases (target_cases: varlen, paged decode, host cost,
the small model, its training step, the Gemma-2-style training run); scaled down on the CPU
backend."""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Sequence

from ..cases import Case, parse_case_id
from .target_cases import (
    HOST_CALLS,
    HostTarget,
    LossTarget,
    ModelTarget,
    PagedTarget,
    StepTarget,
    Target,
    VarlenTarget,
)

KV_CACHE_LIMIT_BYTES = 8 * 1024**3  # decode cases whose K+V exceed this are left out of the matrix


def prefill_cases(seqlens, tokens, heads_for_dim, dtypes=("fp16", "bf16")) -> list[Case]:
    """B*S = tokens for every S (the FA2 benchmark's 16k-token sweep). heads_for_dim's keys are a
    head dim or (q's and k's, v's)."""
    return [
        Case("prefill", dtype, tokens // s, heads, heads, s, s, d, causal, head_dim_v=dv)
        for dtype in dtypes
        for dims, heads in heads_for_dim.items()
        for d, dv in [dims if isinstance(dims, tuple) else (dims, dims)]
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
            head_dim_v=c.head_dim_v,
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


# Gemma 2's attn_logit_softcapping
FEATURE_SOFTCAP = 50.0


def feature_cases(
    batch: int, heads: int, seqlen: int, window: int, head_dim: int = 128, dtype: str = "bf16"
) -> list[Case]:
    """Causal prefill and backward at one shape: the plain case (the twin), then a sliding window of
    `window` keys (window_size=(window - 1, 0), as a model's sliding_window reads), a softcap and
    sinks, each its own case of the twin's shape, so targets.feature_verdicts judges each from its
    twin's time in the same run (the window also from the twin's causal time)."""
    plain = Case("prefill", dtype, batch, heads, heads, seqlen, seqlen, head_dim, True)
    variants = (
        {},
        {"window": (window - 1, 0)},
        {"softcap": FEATURE_SOFTCAP},
        {"sinks": True},
    )
    return [
        dataclasses.replace(plain, kind=kind, group="features", **features)
        for kind in ("prefill", "backward")
        for features in variants
    ]


# The head dims past the 64/128 sweeps, at hidden size 2048 (2048 // d heads, as FlashAttention-3's
# benchmark takes them): Phi-3's 96 (on the 128 tile, padded), 192 and Gemma's 256, DeepSeek's
# multi-head latent attention prefill (q and k 192, v 128)
WIDE_HEADS = {96: 21, 192: 10, 256: 8, (192, 128): 10}
WIDE_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)


def gpu_matrix() -> list[Case]:
    return [
        *prefill_cases((128, 256, 512, 1024, 2048, 4096, 8192, 16384), 16384, {64: 32, 128: 16}),
        *prefill_cases(WIDE_SEQLENS, 16384, WIDE_HEADS, ("bf16",)),
        *decode_cases((1024, 4096, 8192, 16384, 32768, 65536, 131072), (1, 4, 16), 32, (32, 8)),
        # Gemma 2 9B's decode: 16 query heads on 8 KV heads of 256
        *decode_cases((8192, 32768, 131072), (1, 4), 16, (8,), head_dim=256),
        *small_cases(),
        *training_cases((512, 1024, 2048, 4096, 8192, 16384), 16384, {64: 32, 128: 16}),
        *training_cases(WIDE_SEQLENS, 16384, WIDE_HEADS, ("bf16",), ("backward",)),
        # backward configuration 1 is what the L4 (sm_89, 99 KB of shared memory a block) runs
        *training_cases(
            (512, 2048, 8192), 16384, {64: 32, 128: 16}, ("bf16",), ("backward",), config=1
        ),
        *feature_cases(1, 16, 32768, 4096),
    ]


def cpu_matrix() -> list[Case]:
    """The GPU matrix shrunk until the CPU implementation gets through it in ~30 s on 2 cores."""
    return [
        *prefill_cases((128, 256, 512), 1024, {64: 4, 128: 2}),
        *decode_cases((1024, 4096), (1, 4), 8, (8, 2)),
        *small_cases(),
        *training_cases((128, 256), 512, {64: 2, 128: 1}),
        *feature_cases(1, 2, 512, 128),
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
        *(c.id for c in feature_cases(1, 2, 512, 128)),
    ),
}


def _family(case: Case) -> tuple:
    """What a kernel change moves together: the group, the operator, the head dims, the GQA ratio,
    a forced configuration and the features (dtype, causality and length do not pick a kernel
    family; the cases along them share its code)."""
    return (
        case.group,
        case.kind,
        case.head_dim,
        case.head_dim_v,
        case.heads_q // case.heads_kv,
        case.config,
        case.window,
        case.softcap,
        case.sinks,
    )


def pull_request_cases(matrix: Sequence[Case]) -> list[Case]:
    """The pull request's bench (`bench --pr`): one case for each kernel family of the matrix, its
    bf16 case where it has one, causal where it has one, at its middle sequence length (decode: the
    middle of its cache lengths and batches), in the matrix's order. A change to any family shows
    against the base in minutes; pushes to main and the nightly run time the whole matrix."""
    families: dict[tuple, list[Case]] = {}
    for case in matrix:
        families.setdefault(_family(case), []).append(case)
    chosen = set()
    for members in families.values():
        if any(c.dtype == "bf16" for c in members):
            members = [c for c in members if c.dtype == "bf16"]
        if any(c.causal for c in members):
            members = [c for c in members if c.causal]
        members = sorted(members, key=lambda c: (c.seqlen_k, c.seqlen_q, c.batch))
        chosen.add(members[(len(members) - 1) // 2].id)
    return [c for c in matrix if c.id in chosen]


def varlen_targets(total, shortest, longest, heads_for_dim, dtypes=("fp16", "bf16")):
    """Packed batches of `total` tokens, lengths mixed from shortest to longest, with the prefill
    sweep's heads (Hq == Hkv)."""
    return [
        VarlenTarget(dtype, d, heads, heads, total, shortest, longest, causal)
        for dtype in dtypes
        for d, heads in heads_for_dim.items()
        for causal in (False, True)
    ]


def paged_targets(batch_and_seqlen, block_sizes, heads_q, heads_kv, head_dim=128):
    return [
        PagedTarget("bf16", head_dim, heads_q, heads_kv, b, k, block)
        for b, k in batch_and_seqlen
        for block in block_sizes
    ]


# gpt-oss's sliding layers: d=64 under a causal window of 128 keys (window_size=(127, 0)). Packed,
# a window takes the features kernels, which at d=64 spill in their main loop (features.md); dense
# calls with a window run another configuration.
VARLEN_WINDOW = (127, 0)


def gpu_targets() -> list[Target]:
    return [
        *varlen_targets(16384, 128, 4096, {64: 32, 128: 16}),
        VarlenTarget("bf16", 64, 32, 32, 16384, 128, 4096, True, window=VARLEN_WINDOW),
        # every shape's K+V is at least 64 MiB, where the read-floor target applies
        *paged_targets(((1, 32768), (4, 8192), (16, 8192)), (16, 64, 128, 256), 32, 8),
        *(HostTarget(call) for call in HOST_CALLS),
        ModelTarget(),
        # the training step at 16k tokens a step, Hq:Hkv 4:1, hidden size 1024
        *(
            StepTarget(d, heads, heads // 4, batch, seqlen)
            for d, heads in ((64, 16), (128, 8))
            for batch, seqlen in ((8, 2048), (2, 8192))
        ),
        LossTarget(),
    ]


CPU_LOSS_STEPS = 5


def cpu_targets() -> list[Target]:
    """The host-cost and model cases stay in: on the CPU they become "unsupported" records. The
    training step runs, on one layer and a batch small enough for a second or two of CPU time;
    the loss target's training run for a few steps, its plumbing (the whole run is the GPU's)."""
    return [
        *varlen_targets(1024, 16, 256, {64: 4}, ("bf16",)),
        VarlenTarget("bf16", 64, 4, 4, 1024, 16, 256, True, window=(15, 0)),
        *paged_targets(((4, 1024),), (16, 64, 128, 256), 8, 2),
        *(HostTarget(call) for call in HOST_CALLS),
        ModelTarget(),
        StepTarget(64, 1, 1, 2, 32, layers=1, vocab=128),
        LossTarget(steps=CPU_LOSS_STEPS),
    ]


TARGET_PREFIXES = ("varlen-", "paged-", "host-", "model-", "step-", "loss-")
QUICK_TARGET_IDS = {
    "cuda": (
        "varlen-bf16-d128-h16-t16384-len128_4096-causal",
        "paged-bf16-d128-h32kv8-b4-k8192-page64",
        "host-bf16-d128-h32kv8-b1-k1024-decode-lens",
        "model-llama-bf16-b8-s512-new32",
        "step-llama-bf16-l4-d128-h8kv2-b8-s2048",
        LossTarget().id,
    ),
    "cpu": (
        "varlen-bf16-d64-h4-t1024-len16_256-causal",
        "paged-bf16-d128-h8kv2-b4-k1024-page64",
        "host-bf16-d128-h32kv8-b1-k1024-decode-lens",
        "model-llama-bf16-b8-s512-new32",
        "step-llama-bf16-l1-d64-h1-b2-s32-v128",
        LossTarget(steps=CPU_LOSS_STEPS).id,
    ),
}


def default_targets(device: str) -> list[Target]:
    return gpu_targets() if device == "cuda" else cpu_targets()


def default_matrix(device: str) -> list[Case]:
    return gpu_matrix() if device == "cuda" else cpu_matrix()


def select_cases(device: str, quick: bool = False, patterns: Sequence[str] = ()) -> list[Case]:
    """The default matrix, its --quick subset, or the cases named by ids or globs (in order)."""
    return select(device, quick, patterns)[0]


def select(
    device: str, quick: bool = False, patterns: Sequence[str] = (), pull_request: bool = False
) -> tuple[list[Case], list[Target]]:
    """(matrix cases, target cases): the defaults, their --quick subsets, the pull request's
    (pull_request_cases and the quick target cases), or those named by ids or globs (in order),
    where a glob with --quick or --pr picks among that subset's cases. A glob may match either
    kind; one that matches nothing is an error."""
    matrix, targets = default_matrix(device), default_targets(device)
    by_id = {c.id: c for c in matrix}
    targets_by_id = {t.id: t for t in targets}
    if quick or pull_request:
        matrix = [by_id[i] for i in QUICK_IDS[device]] if quick else pull_request_cases(matrix)
        targets = [targets_by_id[i] for i in QUICK_TARGET_IDS[device]]
    if not patterns:
        return matrix, targets
    chosen: dict[str, Case] = {}
    chosen_targets: dict[str, Target] = {}
    for pattern in patterns:
        if any(ch in pattern for ch in "*?["):
            hits = [c for c in matrix if fnmatch.fnmatchcase(c.id, pattern)]
            target_hits = [t for t in targets if fnmatch.fnmatchcase(t.id, pattern)]
            if not hits and not target_hits:
                raise ValueError(
                    f"--case {pattern!r} matches nothing in the {device} "
                    f"{'--quick subset' if quick else '--pr subset' if pull_request else 'matrix'}"
                    " (see --list)"
                )
            chosen.update((c.id, c) for c in hits)
            chosen_targets.update((t.id, t) for t in target_hits)
        elif pattern in targets_by_id:
            chosen_targets[pattern] = targets_by_id[pattern]
        elif pattern.startswith(TARGET_PREFIXES):
            raise ValueError(
                f"--case {pattern!r} is not a target case of the {device} matrix; "
                "`bench --list` prints them (a glob such as 'paged-*' selects several)"
            )
        else:
            chosen[pattern] = by_id.get(pattern) or parse_case_id(pattern)
    return list(chosen.values()), list(chosen_targets.values())
