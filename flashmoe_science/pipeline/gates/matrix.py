"""The gate matrix: which cases the forward, decode and backward gates run, on the GPU ("gpu") and
on the CPU ("cpu", a representative subset), and how a failing case is run again.

Case ids are stable across commits (git bisect runs one by id), so a case's inputs come from its id
alone (pipeline.cases)."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterator, Sequence

from ..cases import DTYPES, Case

SEQLENS = (1, 2, 17, 64, 65, 127, 128, 129, 255, 256, 257, 512, 1000, 1024, 2048, 4096)
SEQLENS_CPU = (1, 2, 17, 64, 65, 127, 129, 257, 512)
UNEQUAL = (
    (1, 4096),
    (4096, 1),
    (113, 203),
    (203, 113),
    (1024, 1023),
    (1023, 1024),
    (1, 1000),
    (17, 1),
)
UNEQUAL_CPU = ((1, 1000), (1000, 1), (113, 203), (203, 113), (17, 1))
GQA_RATIOS = (1, 4, 8)
# The head dims (q's and k's, v's) of the models people run: GPT-2 and most others 64 or 128, Phi-3
# 96, Gemma 256, DeepSeek's multi-head latent attention (prefill) 192 with v 128; 80 and 160 stand
# for the other multiples of 8, which run padded onto the next larger tile (128's and 192's).
HEAD_DIMS = (
    (64, 64),
    (128, 128),
    (80, 80),
    (96, 96),
    (192, 192),
    (256, 256),
    (192, 128),
    (160, 160),
)
# Those past 64 and 128, the first the kernels took: gated in blocks of their own after the
# earlier cases, whose ids stay as they were. A CUDA case of head dims its kernels do not take
# skips, saying so (ops.head_dims_unsupported_reason).
NEW_HEAD_DIMS = HEAD_DIMS[2:]
# The CPU tier's: 96 runs through its whole forward matrix already, and the CPU implementation is
# the same code at every head dim, so a few cases of each of the others (NEW_HEAD_DIM_SHAPES_CPU);
# 160 pads a CUDA tile the CPU has not, and 80 stands for the padded dims there.
NEW_HEAD_DIMS_CPU = tuple(dims for dims in NEW_HEAD_DIMS if dims not in ((96, 96), (160, 160)))
# (Sq, Sk, causal, layout, forced split count) of the CPU tier's cases of a new head dim: rows
# and keys past a 64-key block, Sq < Sk and Sq > Sk (rows that see no key), a strided view and
# split-KV.
NEW_HEAD_DIM_SHAPES_CPU = (
    (65, 65, True, "bhsd", 0),
    (17, 129, False, "bshd", 0),
    (129, 17, True, "bhsd", 0),
    (16, 300, True, "bhsd", 3),
)
# The forward tile configurations the GPU matrix forces: every id of ops.CONFIGS (a test keeps
# them equal; importing ops here would build the extension at import).
FORCED_CONFIGS = (1, 2, 3, 4, 5, 6, 7)
# Those forced through the whole matrix (every length, strided views), as the automatic choice
# is: the wgmma kernels (ops.SM90A_CONFIGS), which only the H100 runs and nothing else gates.
FULL_MATRIX_CONFIGS = (5, 6, 7)
# Head dims gated per forced configuration where not both: at d128 configuration 6 runs
# configuration 5's kernel, and at d64 configuration 7 does, whose cases would only take the GPU's
# time a second time.
GATED_HEAD_DIMS = {6: (64,), 7: (128,)}
# The wgmma forward's head dims past 128, where configurations 5 to 7 are one kernel (two math
# warpgroups, 112 or 80 keys): gated in blocks of their own after the earlier cases, whose ids stay
# as they were. Configuration 5 runs the whole sequence-length matrix, ramped scores, the features
# and the cp.async path (many-row decode); 6 and 7, whose forced ids reach the same kernel, the
# forced shapes (FORCED_SHAPES) only.
WGMMA_WIDE_HEAD_DIMS = (192, 256)
WGMMA_WIDE_MATRIX_CONFIG = 5
WGMMA_WIDE_FORCED_CONFIGS = (5, 6, 7)
# The wgmma forward's head dims (q's and k's, v's) of v narrower than q and k (DeepSeek's latent
# attention prefill: a kernel of its own, one for 5 to 7), gated in blocks of their own after
# every earlier case. Configuration 5 runs them on FORCED_SHAPES and WGMMA_DV_MATRIX_HEAD_DIMS
# over the whole sequence-length matrix, ramped scores, the features and the cp.async path
# (many-row decode); 6 and 7 the forced shapes at WGMMA_DV_MATRIX_HEAD_DIMS.
WGMMA_DV_HEAD_DIMS = ((192, 128),)
WGMMA_DV_MATRIX_HEAD_DIMS = ((192, 128),)
# The wgmma forward's 128 tile run padded (configuration 5 alone takes them: Sm90PaddedTraits),
# gated after every earlier case: FORCED_SHAPES at each, and 96 (Phi-3) over the whole
# sequence-length matrix, ramped scores, the features and the cp.async path (many-row decode).
# v's 64 under 128 pads V alone: its second panel's boxes lie wholly past the tensor.
WGMMA_PADDED_CONFIGS = (5,)
WGMMA_PADDED_HEAD_DIMS = ((96, 96), (80, 80), (128, 64))
WGMMA_PADDED_MATRIX_HEAD_DIMS = ((96, 96),)
# (Sq, Sk, forced splits) of every forced configuration: one row, a tail block, Sq != Sk, a few
# blocks and split-KV.
FORCED_SHAPES = (
    (1, 1, 0),
    (65, 65, 0),
    (257, 257, 0),
    (1000, 1000, 0),
    (113, 203, 0),
    (2048, 2047, 0),
    (16, 2000, 5),
)


def gated_head_dims(config: int) -> tuple[int, ...]:
    """The CUDA head dims whose kernels a configuration's forced gate cases run (GATED_HEAD_DIMS)."""
    return GATED_HEAD_DIMS.get(config, (64, 128))


def _heads(index: int, total_q_rows: int) -> tuple[int, int, int]:
    """Batch, Hq, Hkv for the index-th case: ratios cycle through 1, 4 and 8, and batch and heads
    shrink as sequences grow so every case stays small enough for the fp32 reference."""
    ratio = GQA_RATIOS[index % len(GQA_RATIOS)]
    heads_q = 8
    batch = 2 if total_q_rows <= 1024 else 1
    return batch, heads_q, heads_q // ratio


def forward_cases(tier: str) -> Iterator[Case]:
    """Forward gate cases. tier "gpu": the full matrix, automatic and for FULL_MATRIX_CONFIGS, and
    every configuration forced on a few shapes; tier "cpu": a representative subset."""
    gpu = tier == "gpu"
    head_dims = (64, 128) if gpu else (64, 128, 96)  # any head dim works on the CPU
    pairs = [(s, s) for s in (SEQLENS if gpu else SEQLENS_CPU)] + list(
        UNEQUAL if gpu else UNEQUAL_CPU
    )
    index = 0

    def matrix(config: int) -> Iterator[Case]:
        nonlocal index
        for dtype in DTYPES:
            for head_dim in head_dims if config == 0 else gated_head_dims(config):
                for causal in (False, True):
                    for seqlen_q, seqlen_k in pairs:
                        heads = None
                        if not gpu and max(seqlen_q, seqlen_k) >= 512:
                            heads = 1, 4, (1, 4, 2)[index % 3]
                        layout = "bshd" if index % 4 == 3 else "bhsd"
                        shape = (seqlen_q, seqlen_k, 0)
                        yield _prefill_case(
                            index,
                            dtype,
                            head_dim,
                            causal,
                            shape,
                            config,
                            layout=layout,
                            heads=heads,
                        )
                        index += 1

    yield from matrix(0)
    if not gpu:
        yield from _ramped_cases((0,), (257, 257))
        yield from _new_head_dim_cases_cpu("prefill")
        yield from feature_cases("cpu", "prefill")
        return
    # Every kernel configuration any architecture selects, forced on this card (ids as in
    # ops.CONFIGS), each also through its split-KV path, then the whole matrix for
    # FULL_MATRIX_CONFIGS; a card or build that cannot run one skips its cases, saying what they
    # need (ops.config_unsupported_reason).
    for config in FORCED_CONFIGS:
        for dtype in DTYPES:
            for head_dim in gated_head_dims(config):
                for causal in (False, True):
                    for seqlen_q, seqlen_k, splits in FORCED_SHAPES:
                        if config in FULL_MATRIX_CONFIGS and (seqlen_q, seqlen_k) in pairs:
                            continue  # its full matrix below has the shape
                        shape = (seqlen_q, seqlen_k, splits)
                        yield _prefill_case(index, dtype, head_dim, causal, shape, config)
                        index += 1
        if config in FULL_MATRIX_CONFIGS:
            yield from matrix(config)
    yield from _ramped_cases((0, *FORCED_CONFIGS), (1000, 1000))
    yield from _new_head_dim_matrix("prefill", pairs)
    yield from _ramped_cases((0,), (1000, 1000), NEW_HEAD_DIMS)
    yield from feature_cases("gpu", "prefill")
    yield from wide_wgmma_cases(pairs)


def _prefill_case(
    index: int,
    dtype: str,
    head_dim: int,
    causal: bool,
    shape: tuple[int, int, int],
    config: int,
    head_dim_v: int = 0,
    layout: str = "bhsd",
    heads: tuple[int, int, int] | None = None,
) -> Case:
    """A prefill case of a shape ((Sq, Sk, splits)) on a configuration (0: automatic), its batch
    and heads from its place in the matrix (`index`) unless `heads` gives them."""
    seqlen_q, seqlen_k, splits = shape
    batch, hq, hkv = heads or _heads(index, max(seqlen_q, seqlen_k))
    return Case(
        "prefill",
        dtype,
        batch,
        hq,
        hkv,
        seqlen_q,
        seqlen_k,
        head_dim,
        causal,
        layout=layout,
        config=config,
        num_splits=splits,
        head_dim_v=head_dim_v,
    )


def _wgmma_shape_cases(
    forced_dims: Callable[[int], Sequence[tuple[int, int]]],
    matrix_dims: Sequence[tuple[int, int]],
    pairs: list[tuple[int, int]],
    configs: Sequence[int] = WGMMA_WIDE_FORCED_CONFIGS,
) -> Iterator[Case]:
    """The wgmma forward at head dims (q's and k's, v's) of its own: each forced configuration of
    `configs` over FORCED_SHAPES at `forced_dims(config)`, then WGMMA_WIDE_MATRIX_CONFIG over
    every (Sq, Sk) of `pairs` at `matrix_dims` (dtypes, masks, GQA ratios 1/4/8, strided views)."""
    index = 0
    for config in configs:
        variants = itertools.product(DTYPES, forced_dims(config), (False, True), FORCED_SHAPES)
        for dtype, (head_dim, head_dim_v), causal, (seqlen_q, seqlen_k, splits) in variants:
            in_matrix = (head_dim, head_dim_v) in matrix_dims and (seqlen_q, seqlen_k) in pairs
            if config == WGMMA_WIDE_MATRIX_CONFIG and in_matrix:
                continue  # its full matrix below has the shape
            shape = (seqlen_q, seqlen_k, splits)
            yield _prefill_case(index, dtype, head_dim, causal, shape, config, head_dim_v)
            index += 1
    variants = itertools.product(DTYPES, matrix_dims, (False, True), pairs)
    for dtype, (head_dim, head_dim_v), causal, (seqlen_q, seqlen_k) in variants:
        layout = "bshd" if index % 4 == 3 else "bhsd"
        shape = (seqlen_q, seqlen_k, 0)
        config = WGMMA_WIDE_MATRIX_CONFIG
        yield _prefill_case(index, dtype, head_dim, causal, shape, config, head_dim_v, layout)
        index += 1


def wide_wgmma_cases(pairs: list[tuple[int, int]]) -> Iterator[Case]:
    """The wgmma forward at WGMMA_WIDE_HEAD_DIMS (GPU tier): every forced configuration over
    FORCED_SHAPES, WGMMA_WIDE_MATRIX_CONFIG over every (Sq, Sk) of `pairs`, ramped scores and each
    feature combination; a card or build that cannot run them skips, saying why."""
    wide = tuple((d, d) for d in WGMMA_WIDE_HEAD_DIMS)
    yield from _wgmma_shape_cases(lambda config: wide, wide, pairs)
    yield from _ramped_cases((WGMMA_WIDE_MATRIX_CONFIG,), (1000, 1000), wide)
    yield from _feature_cases_at(wide)


def dv_padded_wgmma_cases(pairs: list[tuple[int, int]]) -> Iterator[Case]:
    """The wgmma forward at WGMMA_DV_HEAD_DIMS (GPU tier): FORCED_SHAPES on configuration 5 at
    each, on 6 and 7 at WGMMA_DV_MATRIX_HEAD_DIMS, which 5 runs over every (Sq, Sk) of `pairs`,
    with ramped scores and each feature combination; a card or build that cannot run them skips,
    saying why."""

    def forced_dims(config: int) -> Sequence[tuple[int, int]]:
        matrix_config = config == WGMMA_WIDE_MATRIX_CONFIG
        return WGMMA_DV_HEAD_DIMS if matrix_config else WGMMA_DV_MATRIX_HEAD_DIMS

    yield from _wgmma_shape_cases(forced_dims, WGMMA_DV_MATRIX_HEAD_DIMS, pairs)
    yield from _ramped_cases((WGMMA_WIDE_MATRIX_CONFIG,), (1000, 1000), WGMMA_DV_MATRIX_HEAD_DIMS)
    yield from _feature_cases_at(WGMMA_DV_MATRIX_HEAD_DIMS)


def padded_wgmma_cases(pairs: list[tuple[int, int]]) -> Iterator[Case]:
    """The wgmma forward's 128 tile run padded (GPU tier): FORCED_SHAPES on configuration 5 at
    WGMMA_PADDED_HEAD_DIMS, which it runs over every (Sq, Sk) of `pairs` at
    WGMMA_PADDED_MATRIX_HEAD_DIMS, with ramped scores and each feature combination; a card or
    build that cannot run them skips, saying why."""
    dims = WGMMA_PADDED_MATRIX_HEAD_DIMS
    forced = lambda config: WGMMA_PADDED_HEAD_DIMS  # noqa: E731
    yield from _wgmma_shape_cases(forced, dims, pairs, configs=WGMMA_PADDED_CONFIGS)
    yield from _ramped_cases((WGMMA_WIDE_MATRIX_CONFIG,), (1000, 1000), dims)
    yield from _feature_cases_at(dims)


def _feature_cases_at(dims: Sequence[tuple[int, int]]) -> Iterator[Case]:
    """Each feature combination over FORCED_FEATURE_PAIRS on WGMMA_WIDE_MATRIX_CONFIG, the head
    dims (q's and k's, v's) taking turns from `dims`."""
    variants = itertools.product(FORCED_FEATURE_PAIRS, FEATURE_COMBOS)
    for index, ((seqlen_q, seqlen_k), combo) in enumerate(variants):
        case = _turned_case(
            "prefill",
            index,
            seqlen_q,
            seqlen_k,
            config=WGMMA_WIDE_MATRIX_CONFIG,
            num_splits=3 if index % 5 == 4 else 0,
        )
        head_dim, head_dim_v = dims[(index // 2) % len(dims)]
        case = dataclasses.replace(case, head_dim=head_dim, head_dim_v=head_dim_v)
        yield _with_features(case, combo, index)
    # Sinks alone on one split: the plain instantiation's rows' epilogue folds them (split KV
    # leaves them to the combine, which the cases above cover).
    index = len(FORCED_FEATURE_PAIRS) * len(FEATURE_COMBOS)
    case = _turned_case("prefill", index, 1000, 1000, config=WGMMA_WIDE_MATRIX_CONFIG, num_splits=1)
    head_dim, head_dim_v = dims[-1]
    case = dataclasses.replace(case, head_dim=head_dim, head_dim_v=head_dim_v)
    yield _with_features(case, ("sinks",), index)


def _new_head_dim_matrix(kind: str, pairs: list[tuple[int, int]]) -> Iterator[Case]:
    """The GPU tier's cases of NEW_HEAD_DIMS: every (Sq, Sk) of `pairs` for each head dims, dtype
    and mask, GQA ratios 1/4/8, strided views, as 64 and 128 get them."""
    variants = itertools.product(NEW_HEAD_DIMS, DTYPES, (False, True), pairs)
    for index, ((head_dim, head_dim_v), dtype, causal, (seqlen_q, seqlen_k)) in enumerate(variants):
        batch, hq, hkv = _heads(index, max(seqlen_q, seqlen_k))
        layout = "bshd" if index % 4 == 3 else "bhsd"
        yield Case(
            kind,
            dtype,
            batch,
            hq,
            hkv,
            seqlen_q,
            seqlen_k,
            head_dim,
            causal,
            layout=layout,
            head_dim_v=head_dim_v,
        )


def _new_head_dim_cases_cpu(kind: str) -> Iterator[Case]:
    """The CPU tier's cases of NEW_HEAD_DIMS_CPU: the shapes of NEW_HEAD_DIM_SHAPES_CPU (split-KV
    for prefill only), dtypes and GQA ratios in turn."""
    shapes = [s for s in NEW_HEAD_DIM_SHAPES_CPU if kind == "prefill" or not s[4]]
    for index, ((head_dim, head_dim_v), shape) in enumerate(
        itertools.product(NEW_HEAD_DIMS_CPU, shapes)
    ):
        seqlen_q, seqlen_k, causal, layout, splits = shape
        yield Case(
            kind,
            tuple(DTYPES)[index % len(DTYPES)],
            2,
            4,
            4 // (1, 4, 2)[index % 3],
            seqlen_q,
            seqlen_k,
            head_dim,
            causal,
            layout=layout,
            num_splits=splits,
            head_dim_v=head_dim_v,
        )


def _ramped_cases(
    configs: tuple[int, ...],
    shape: tuple[int, int],
    head_dims: tuple[tuple[int, int], ...] = HEAD_DIMS[:2],
) -> Iterator[Case]:
    """Scores that keep growing along the keys, forwards and backwards (cases.SCORES), for each
    configuration: the only cases in which the running max of the online softmax moves by large
    factors after the first key block, so a wrong or skipped rescale of the output shows."""
    variants = itertools.product(configs, DTYPES, head_dims, (False, True), ("rising", "falling"))
    for index, (config, dtype, (head_dim, head_dim_v), causal, scores) in enumerate(variants):
        # (other tiles than 64 and 128 whole: the callers pass only those they gate,
        # wide_wgmma_cases, padded_wgmma_cases)
        whole = head_dim in (64, 128) and head_dim_v == head_dim
        if config and whole and head_dim not in gated_head_dims(config):
            continue
        batch, hq, hkv = _heads(index, max(shape))
        case = Case(
            "prefill",
            dtype,
            batch,
            hq,
            hkv,
            *shape,
            head_dim,
            causal,
            config=config,
            head_dim_v=head_dim_v,
        )
        yield dataclasses.replace(case, scores=scores)


DECODE_SEQLENS_K = (1, 2, 63, 64, 65, 257, 1000, 4096, 32768, 131072)
DECODE_SEQLENS_K_CPU = (1, 2, 63, 65, 257, 1000)
DECODE_SEQLENS_Q = (1, 2, 4, 16)
DECODE_SPLITS = (0, 1, 2, 3, 7, 128)  # 0: automatic


def _mixed_lengths(seqlen_k: int, batch: int, index: int) -> tuple[int, ...]:
    """Per-sequence cache lengths for one batch: empty, one token, lengths that end inside a split,
    and the full cache."""
    pool = [
        0,
        1,
        max(0, seqlen_k // 3 + 1),
        max(0, seqlen_k - 1),
        seqlen_k,
        max(0, seqlen_k // 2 + 7),
    ]
    return tuple(min(seqlen_k, pool[(index + i) % len(pool)]) for i in range(batch))


def decode_cases(tier: str) -> Iterator[Case]:
    """Split-KV decode gate cases: short queries against caches from 1 to 128k tokens, mixed
    cache_seqlens in one batch, GQA ratios 1/4/8, both dtypes, forced and automatic split counts,
    head dims 64 and 128 in turn, then on the GPU tier the same for each of NEW_HEAD_DIMS (on the
    CPU tier two cases of each); on the GPU tier also many query rows against such caches
    (many_row_decode_cases)."""
    gpu = tier == "gpu"
    yield from _decode_sweep(gpu, HEAD_DIMS[:2])
    # Scores that keep growing along the cache (see _ramped_cases): the decode kernel's running
    # max then moves from chunk to chunk and from split to split.
    for scores in ("rising", "falling"):
        for dtype in DTYPES:
            for seqlen_k, splits in ((1000, 0), (4096, 7)) if gpu else ((257, 0), (1000, 3)):
                yield Case(
                    "decode",
                    dtype,
                    2,
                    8,
                    2,
                    4 if splits else 1,
                    seqlen_k,
                    128 if splits else 64,
                    True,
                    num_splits=splits,
                    scores=scores,
                )
    if gpu:
        for head_dims in NEW_HEAD_DIMS:
            yield from _decode_sweep(gpu, (head_dims,))
        yield from many_row_decode_cases()
        yield from feature_cases("gpu", "decode")
        yield from many_row_decode_cases(wide=True)
        return
    for index, (head_dim, head_dim_v) in enumerate(NEW_HEAD_DIMS_CPU):
        dtype = tuple(DTYPES)[index % len(DTYPES)]
        for seqlen_q, seqlen_k, splits, lengths in ((4, 257, 3, (257, 0, 100)), (1, 300, 0, None)):
            yield Case(
                "decode",
                dtype,
                3 if lengths else 1,
                8,
                2,
                seqlen_q,
                seqlen_k,
                head_dim,
                True,
                num_splits=splits,
                cache_seqlens=lengths,
                head_dim_v=head_dim_v,
            )
    yield from feature_cases("cpu", "decode")


def _decode_sweep(gpu: bool, head_dims: tuple[tuple[int, int], ...]) -> Iterator[Case]:
    """Short queries against every cache length of the tier, both dtypes, GQA ratios, split counts,
    mixed cache_seqlens and `head_dims` in turn."""
    index = 0
    for dtype in DTYPES:
        for seqlen_k in DECODE_SEQLENS_K if gpu else DECODE_SEQLENS_K_CPU:
            for seqlen_q in DECODE_SEQLENS_Q:
                if seqlen_q > seqlen_k:
                    continue
                ratio = GQA_RATIOS[index % len(GQA_RATIOS)]
                head_dim, head_dim_v = head_dims[index % len(head_dims)]
                splits = DECODE_SPLITS[index % len(DECODE_SPLITS)]
                batch = 1 if seqlen_k >= 32768 else 3
                heads_q = 8 if seqlen_k < 32768 else 4 * ratio
                lengths = _mixed_lengths(seqlen_k, batch, index) if index % 3 else None
                yield Case(
                    "decode",
                    dtype,
                    batch,
                    heads_q,
                    heads_q // ratio,
                    seqlen_q,
                    seqlen_k,
                    head_dim,
                    True,
                    num_splits=splits,
                    cache_seqlens=lengths,
                    head_dim_v=head_dim_v,
                )
                index += 1


# Many query rows against a cache with per-sequence lengths (chunked prefill, speculative
# decoding), the wgmma kernels forced (configuration 5, 6 at d64 or 7 at d128, which a large enough
# grid of them takes by itself on an H100): their producer copies K and V with cp.async whenever
# cache_seqlens is given (TMA would copy a cache's unused rows), a path no prefill case takes.
# (Sq, Sk, forced splits.)
MANY_ROW_DECODE = ((65, 300, 0), (65, 2000, 3), (257, 1000, 0), (257, 2000, 3))
MANY_ROW_DECODE_CONFIGS = (5, 6, 7)
# Batch and query heads per Sq: 144 tiles (Sq 65: 3 x 48 x 1; Sq 257: 3 x 16 x 3 row tiles), more
# than an H100's 132 SMs, as the automatic choice would need.
MANY_ROW_DECODE_HEADS = {65: (3, 48), 257: (3, 16)}


def many_row_decode_cases(
    wide: bool = False, dims: tuple[tuple[int, int], ...] = ()
) -> Iterator[Case]:
    """Decode of 65 and 257 query rows with mixed cache_seqlens (empty, one token, partial and
    full 128-key tiles), both dtypes, head dims (gated_head_dims; with `wide`,
    WGMMA_WIDE_HEAD_DIMS on WGMMA_WIDE_MATRIX_CONFIG; with `dims`, those (q's and k's, v's) on it)
    and masks, GQA ratios 1/4/8 (none packed), with and without splits, on the wgmma kernels'
    cp.async path (MANY_ROW_DECODE)."""
    configs = (WGMMA_WIDE_MATRIX_CONFIG,) if wide or dims else MANY_ROW_DECODE_CONFIGS
    for config in configs:
        head_dims = WGMMA_WIDE_HEAD_DIMS if wide else gated_head_dims(config)
        pairs = dims or tuple((d, d) for d in head_dims)
        variants = itertools.product(MANY_ROW_DECODE, DTYPES, pairs, (False, True))
        for index, (
            (seqlen_q, seqlen_k, splits),
            dtype,
            (head_dim, head_dim_v),
            causal,
        ) in enumerate(variants):
            batch, heads_q = MANY_ROW_DECODE_HEADS[seqlen_q]
            yield Case(
                "decode",
                dtype,
                batch,
                heads_q,
                heads_q // GQA_RATIOS[index % len(GQA_RATIOS)],
                seqlen_q,
                seqlen_k,
                head_dim,
                causal,
                num_splits=splits,
                cache_seqlens=_mixed_lengths(seqlen_k, batch, index),
                config=config,
                head_dim_v=head_dim_v,
            )


def gate_cases(tier: str) -> list[Case]:
    cases = list(forward_cases(tier)) + list(decode_cases(tier))
    if tier == "gpu":  # after every earlier case: the wgmma forward of narrow v, then padded
        pairs = [(s, s) for s in SEQLENS] + list(UNEQUAL)
        cases += [
            *dv_padded_wgmma_cases(pairs),
            *many_row_decode_cases(dims=WGMMA_DV_MATRIX_HEAD_DIMS),
            *padded_wgmma_cases(pairs),
            *many_row_decode_cases(dims=WGMMA_PADDED_MATRIX_HEAD_DIMS),
        ]
    return cases


@functools.cache
def cpu_tier_ids() -> frozenset[str]:
    """Every CPU-tier gate id, the backward's included."""
    return frozenset(c.id for c in [*gate_cases("cpu"), *backward_cases("cpu")])


# Forced configurations and deterministic calls run over these (Sq, Sk) pairs.
FORCED_PAIRS = ((1, 1), (65, 65), (257, 257), (1000, 1000), (113, 203), (2048, 2047))
# The head dims past 128 the CUDA kernels take, each with backward configuration 1 forced: its
# warps share their keys (16 keys among 2 or 4 warps), and the automatic choice takes it only
# where 2 does not fit (sm86/sm89), so an H100 gates it only here. 2 and 3 (the wgmma kernel past
# 128, the automatic choice of a Hopper card with the sm_90a build) are forced in blocks of their
# own below (WGMMA_WIDE_FORCED_BACKWARD).
WIDE_FORCED_BACKWARD = ((192, 1), (256, 1))
# The wgmma backward's 128 tile run padded (configuration 3: Sm90BwdPaddedTraits), which the
# automatic choice of a Hopper card now takes at 80, 96, 112, v's 64 under 128, ...: each forced
# on the forced shapes, with the mma.sync configurations those head dims ran before (2, and 1 as
# an L4 runs it), so every card's choice stays gated on one card. Appended after every earlier
# case, whose ids stay as they were.
PADDED_FORCED_BACKWARD = ((96, 96), (80, 80), (128, 64))
PADDED_BACKWARD_CONFIGS = (1, 2, 3)
# The wgmma backward past 128 (configuration 3 runs Sm90BwdWideTraits there): forced on every
# forced shape, both dtypes and masks, with a deterministic call and a windowed, soft-capped call
# with sinks of each (its own mask and softcap code). Appended after every earlier case.
WGMMA_WIDE_FORCED_BACKWARD = ((192, 192), (256, 256), (192, 128))
# Configuration 2 at those head dims, which a Hopper card's automatic choice no longer runs: each
# dtype and mask forced on the forced shapes in turn (the automatic cases of a card without the
# sm_90a build run it over the whole matrix). Appended after the above.
WIDE_MMA_SYNC_FORCED_BACKWARD_CONFIG = 2
DETERMINISTIC_PAIRS = ((129, 129), (1000, 1000), (203, 113))
DETERMINISTIC_PAIRS_CPU = ((129, 129), (203, 113))


def backward_cases(tier: str) -> Iterator[Case]:
    """Backward gate cases. tier "gpu": the forward's sequence-length matrix (every S, Sq != Sk both
    ways, GQA 1/4/8, causal both, both dtypes, every head dims of HEAD_DIMS, strided views), every
    backward configuration forced (64 and 128; WIDE_FORCED_BACKWARD past 128), and deterministic
    calls; tier "cpu": a representative subset."""
    from ...ops import BACKWARD_CONFIGS

    gpu = tier == "gpu"
    pairs = [(s, s) for s in (SEQLENS if gpu else SEQLENS_CPU)] + list(
        UNEQUAL if gpu else UNEQUAL_CPU
    )
    index = 0

    def case(dtype, head_dim, causal, seqlen_q, seqlen_k, **options) -> Case:
        nonlocal index
        batch, hq, hkv = _heads(index, max(seqlen_q, seqlen_k))
        if not gpu and max(seqlen_q, seqlen_k) >= 512:
            batch, hq, hkv = 1, 4, (1, 4, 2)[index % 3]
        index += 1
        return Case(
            "backward", dtype, batch, hq, hkv, seqlen_q, seqlen_k, head_dim, causal, **options
        )

    for dtype in DTYPES:
        for head_dim in (64, 128):
            for causal in (False, True):
                for seqlen_q, seqlen_k in pairs:
                    layout = "bshd" if index % 4 == 3 else "bhsd"
                    yield case(dtype, head_dim, causal, seqlen_q, seqlen_k, layout=layout)
                for seqlen_q, seqlen_k in DETERMINISTIC_PAIRS if gpu else DETERMINISTIC_PAIRS_CPU:
                    yield case(dtype, head_dim, causal, seqlen_q, seqlen_k, deterministic=True)
                for config in BACKWARD_CONFIGS if gpu else ():
                    for seqlen_q, seqlen_k in FORCED_PAIRS:
                        yield case(dtype, head_dim, causal, seqlen_q, seqlen_k, config=config)
    if not gpu:
        yield from _new_head_dim_cases_cpu("backward")
        yield from feature_cases("cpu", "backward")
        return
    yield from _new_head_dim_matrix("backward", pairs)
    variants = itertools.product(NEW_HEAD_DIMS, DTYPES, (False, True), DETERMINISTIC_PAIRS)
    for (head_dim, head_dim_v), dtype, causal, (seqlen_q, seqlen_k) in variants:
        yield case(
            dtype, head_dim, causal, seqlen_q, seqlen_k, deterministic=True, head_dim_v=head_dim_v
        )
    variants = itertools.product(WIDE_FORCED_BACKWARD, DTYPES, (False, True), FORCED_PAIRS)
    for (head_dim, config), dtype, causal, (seqlen_q, seqlen_k) in variants:
        yield case(dtype, head_dim, causal, seqlen_q, seqlen_k, config=config)
    yield from feature_cases("gpu", "backward")
    variants = itertools.product(
        PADDED_FORCED_BACKWARD, PADDED_BACKWARD_CONFIGS, DTYPES, (False, True)
    )
    for index, ((head_dim, head_dim_v), config, dtype, causal) in enumerate(variants):
        seqlen_q, seqlen_k = FORCED_PAIRS[index % len(FORCED_PAIRS)]
        yield case(
            dtype,
            head_dim,
            causal,
            seqlen_q,
            seqlen_k,
            config=config,
            head_dim_v=head_dim_v,
            deterministic=config == 3 and index % 4 == 3,
        )
    variants = itertools.product(WGMMA_WIDE_FORCED_BACKWARD, DTYPES, (False, True), FORCED_PAIRS)
    for index, ((head_dim, head_dim_v), dtype, causal, (seqlen_q, seqlen_k)) in enumerate(variants):
        yield case(
            dtype,
            head_dim,
            causal,
            seqlen_q,
            seqlen_k,
            config=3,
            head_dim_v=head_dim_v,
            deterministic=index % len(FORCED_PAIRS) == 4,
        )
    for index, ((head_dim, head_dim_v), causal) in enumerate(
        itertools.product(WGMMA_WIDE_FORCED_BACKWARD, (False, True))
    ):
        forced = case("bf16", head_dim, causal, 257, 257, config=3, head_dim_v=head_dim_v)
        yield _with_features(forced, ("window", "softcap", "sinks"), index)
    variants = itertools.product(WGMMA_WIDE_FORCED_BACKWARD, DTYPES, (False, True))
    for index, ((head_dim, head_dim_v), dtype, causal) in enumerate(variants):
        seqlen_q, seqlen_k = FORCED_PAIRS[index % len(FORCED_PAIRS)]
        yield case(
            dtype,
            head_dim,
            causal,
            seqlen_q,
            seqlen_k,
            config=WIDE_MMA_SYNC_FORCED_BACKWARD_CONFIG,
            head_dim_v=head_dim_v,
        )


# ---- local attention, soft-capping and sinks ------------------------------------------------------

# The combinations gated: each feature alone, Gemma 2's local layers (window and softcap),
# gpt-oss's sliding layers (window and sinks), and all three.
FEATURE_COMBOS = (
    ("window",),
    ("softcap",),
    ("sinks",),
    ("window", "softcap"),
    ("window", "sinks"),
    ("window", "softcap", "sinks"),
)
# Windows (left, right) by mask, taken in turn: 0 (each query its own key), small, a 64-key block
# and one key less, larger than the sequence (None: Sk + 7), and asymmetric or one-sided ones
# where the right side is free (causal sets it to 0).
WINDOWS_CAUSAL = ((0, 0), (16, 0), (64, 0), None, (63, 0))
WINDOWS_FULL = ((0, 0), (16, 3), (5, 37), (-1, 21), None, (40, -1))
# Soft-caps: below the scores' spread (tanh saturates: the derivative matters), moderate, and
# Gemma 2's 50.
SOFTCAPS = (1.0, 5.0, 50.0)
# Sliding windows of decode: the last key alone, a few, a block, and past the cache.
DECODE_WINDOWS = ((0, 0), (16, 0), (64, 0), None)


def _feature_window(variants, index: int, seqlen_k: int) -> tuple[int, int]:
    window = variants[index % len(variants)]
    return (seqlen_k + 7, seqlen_k + 7) if window is None else window


def _with_features(case: Case, combo: tuple[str, ...], index: int) -> Case:
    windows = WINDOWS_CAUSAL if case.causal else WINDOWS_FULL
    return dataclasses.replace(
        case,
        window=_feature_window(windows, index, case.seqlen_k) if "window" in combo else (-1, -1),
        softcap=SOFTCAPS[index % len(SOFTCAPS)] if "softcap" in combo else 0.0,
        sinks="sinks" in combo,
    )


# The CPU tier's cases, (Sq, Sk, causal, combination, window, softcap, layout, num_splits): each
# window kind (0, small, a block, larger than S, asymmetric, right only), each feature alone and in
# every combination, Sq != Sk both ways (rows that see no key, with and without a sink), split-KV
# with sinks (the sink added once), strided views.
FEATURE_PREFILL_CPU = (
    (65, 65, True, ("window",), (16, 0), 0.0, "bhsd", 0),
    (129, 129, False, ("window",), (5, 37), 0.0, "bshd", 0),
    (113, 203, True, ("window",), (0, 0), 0.0, "bhsd", 0),
    (203, 113, False, ("window",), (-1, 21), 0.0, "bhsd", 0),
    (17, 129, True, ("softcap",), (-1, -1), 1.0, "bhsd", 0),
    (129, 17, True, ("sinks",), (-1, -1), 0.0, "bhsd", 0),
    (65, 130, True, ("window", "softcap"), (64, 0), 5.0, "bhsd", 0),
    (129, 129, True, ("window", "sinks"), (63, 0), 0.0, "bhsd", 3),
    (257, 257, False, ("window", "softcap", "sinks"), (264, 264), 1.0, "bshd", 0),
)
FEATURE_BACKWARD_CPU = (
    (65, 65, True, ("window",), (16, 0), 0.0, "bhsd", 0),
    (113, 203, False, ("window", "softcap"), (5, 37), 1.0, "bhsd", 0),
    (129, 17, True, ("sinks",), (-1, -1), 0.0, "bhsd", 0),
    (129, 129, True, ("window", "softcap", "sinks"), (64, 0), 5.0, "bshd", 0),
)
# (Sq, Sk, window, softcap, sinks, num_splits, cache_seqlens) of the CPU tier's decode cases.
FEATURE_DECODE_CPU = (
    (1, 300, (63, 0), 0.0, True, 3, (300, 0, 77)),
    (4, 257, (16, 0), 5.0, False, 0, None),
    (2, 1000, (100, 0), 1.0, True, 7, (1000, 513, 1)),
)


def feature_cases(tier: str, kind: str) -> Iterator[Case]:
    """Cases of local attention, soft-capping and sinks for a kind ("prefill", "backward",
    "decode"). tier "gpu": every (Sq, Sk) of the sequence-length matrix (the decode one for
    decode) with each combination of FEATURE_COMBOS, window, softcap, dtype, mask, head dim (64 and
    128), GQA ratio 1/4/8 and layout taken in turn; backward adds deterministic calls. tier "cpu":
    FEATURE_*_CPU."""
    if kind == "decode":
        yield from _feature_decode_cases(tier)
        return
    if tier == "cpu":
        table = FEATURE_PREFILL_CPU if kind == "prefill" else FEATURE_BACKWARD_CPU
        for index, row in enumerate(table):
            seqlen_q, seqlen_k, causal, combo, window, softcap, layout, splits = row
            yield Case(
                kind,
                tuple(DTYPES)[index % len(DTYPES)],
                2 if max(seqlen_q, seqlen_k) < 257 else 1,
                4,
                4 // (1, 4, 2)[index % 3],
                seqlen_q,
                seqlen_k,
                64,
                causal,
                layout=layout,
                num_splits=splits,
                window=window,
                softcap=softcap,
                sinks="sinks" in combo,
                deterministic=kind == "backward" and index == len(table) - 1,
            )
        return
    pairs = [(s, s) for s in SEQLENS] + list(UNEQUAL)
    variants = itertools.product(pairs, FEATURE_COMBOS)
    for index, ((seqlen_q, seqlen_k), combo) in enumerate(variants):
        case = _turned_case(
            kind,
            index,
            seqlen_q,
            seqlen_k,
            layout="bshd" if index % 4 == 3 else "bhsd",
            deterministic=kind == "backward" and index % 5 == 4,
        )
        yield _with_features(case, combo, index // len(FEATURE_COMBOS))
    yield from forced_feature_cases(kind)


def _turned_case(
    kind: str, index: int, seqlen_q: int, seqlen_k: int, head_dims=(64, 128), **options
) -> Case:
    """The index-th feature case of a shape: dtype, GQA ratio (_heads), head dim and mask taken in
    turn with `index`."""
    batch, hq, hkv = _heads(index, max(seqlen_q, seqlen_k))
    return Case(
        kind,
        tuple(DTYPES)[index % len(DTYPES)],
        batch,
        hq,
        hkv,
        seqlen_q,
        seqlen_k,
        head_dims[(index // 2) % len(head_dims)],
        bool(index // 3 % 2),
        **options,
    )


# The shapes of the features' forced cases: a tail block, Sq < Sk and a few blocks.
FORCED_FEATURE_PAIRS = ((257, 257), (113, 203), (1000, 1000))


def forced_feature_cases(kind: str) -> Iterator[Case]:
    """Each combination of FEATURE_COMBOS with every configuration forced (forward
    FORCED_CONFIGS, backward ops.BACKWARD_CONFIGS): the automatic choice of this card runs one
    family of kernels, so the others' windows, softcaps and sinks (the mma.sync kernels an L4 runs,
    the wgmma ones of a Hopper card) are gated here on any card that can run them."""
    from ...ops import BACKWARD_CONFIGS

    configs = FORCED_CONFIGS if kind == "prefill" else BACKWARD_CONFIGS
    variants = itertools.product(configs, FEATURE_COMBOS)
    for index, (config, combo) in enumerate(variants):
        seqlen_q, seqlen_k = FORCED_FEATURE_PAIRS[index % len(FORCED_FEATURE_PAIRS)]
        case = _turned_case(
            kind,
            index,
            seqlen_q,
            seqlen_k,
            gated_head_dims(config) if kind == "prefill" else (64, 128),
            config=config,
            deterministic=kind == "backward" and index % 4 == 3,
        )
        yield _with_features(case, combo, index)


def _feature_decode_cases(tier: str) -> Iterator[Case]:
    if tier == "cpu":
        for index, row in enumerate(FEATURE_DECODE_CPU):
            seqlen_q, seqlen_k, window, softcap, sinks, splits, lengths = row
            yield Case(
                "decode",
                tuple(DTYPES)[index % len(DTYPES)],
                len(lengths) if lengths else 2,
                8,
                8 // GQA_RATIOS[index % len(GQA_RATIOS)],
                seqlen_q,
                seqlen_k,
                64,
                True,
                num_splits=splits,
                cache_seqlens=lengths,
                window=window,
                softcap=softcap,
                sinks=sinks,
            )
        return
    pairs = [(q, k) for k in DECODE_SEQLENS_K for q in DECODE_SEQLENS_Q if q <= k]
    for index, (seqlen_q, seqlen_k) in enumerate(pairs):
        combo = FEATURE_COMBOS[index % len(FEATURE_COMBOS)]
        ratio = GQA_RATIOS[index % len(GQA_RATIOS)]
        batch = 1 if seqlen_k >= 32768 else 3
        heads_q = 8 if seqlen_k < 32768 else 4 * ratio
        case = Case(
            "decode",
            tuple(DTYPES)[index % len(DTYPES)],
            batch,
            heads_q,
            heads_q // ratio,
            seqlen_q,
            seqlen_k,
            (64, 128)[(index // 2) % 2],
            True,
            num_splits=DECODE_SPLITS[index % len(DECODE_SPLITS)],
            cache_seqlens=_mixed_lengths(seqlen_k, batch, index) if index % 3 else None,
            softcap=SOFTCAPS[index % len(SOFTCAPS)] if "softcap" in combo else 0.0,
            sinks="sinks" in combo,
        )
        if "window" in combo:
            window = _feature_window(DECODE_WINDOWS, index // len(FEATURE_COMBOS), seqlen_k)
            case = dataclasses.replace(case, window=window)
        yield case


def rerun_fields(case: Case, device: str) -> dict:
    """How to run one gate case again: the command, its CPU twin (the same id in the CPU tier, with
    the same inputs) when there is one, and what hardware the case needs, if more than a GPU."""
    from ...ops import config_needs

    twin = device == "cuda" and case.id in cpu_tier_ids()
    return {
        "rerun": case.rerun_command(device),
        "rerun_cpu": case.rerun_command("cpu") if twin else None,
        "rerun_needs": config_needs(case.config, case.kind),
    }
