"""Which kernels a gate case runs, as the build restriction that holds them (FLASHMOE_BUILD_ONLY,
flashmoe_science._loader.Restriction; csrc/build_only.cuh).

A planted-bug test on the GPU builds only the kernels its cases' gates run (restriction_for), and
a restricted build runs only the cases it holds (holds): the sanitizer's workload keeps those, and
a CUDA gate whose case needs a kernel the build left out skips, saying which (outside_reason). A
case's needs are what its gate calls: the operator under test and the gate's own cross-checks (a
varlen or paged gate also runs our dense forward on the same inputs). Where a case leaves the tile
configuration or the split count to the automatic choice, which depends on the GPU, it needs every
kernel that choice may take.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..._loader import ONLY_OPS, Restriction, tile_head_dim
from ..cases import Case, parse_case_id
from .paged import PagedCase, paged_cases
from .varlen import VarlenCase, varlen_cases

# (kernel family, dtype, head dim, tile configuration): the configuration is the family's option's
# (config or backward_config), 0 for a family of one kernel per dtype and head dim, None for
# whichever the automatic choice takes.
Need = tuple[str, str, int, int | None]

# The families of the dense forward and of the backward: those the automatic choice picks from.
AUTO_FORWARD = ("fwd", "decode", "fwd_sm90a")
AUTO_BACKWARD = ("bwd", "bwd_sm90a")
FORWARD_FAMILIES = {config: op for op in AUTO_FORWARD for config in ONLY_OPS[op][1]}
BACKWARD_FAMILIES = {config: op for op in AUTO_BACKWARD for config in ONLY_OPS[op][1]}


def forward_needs(
    dtype: str, head_dim: int, config: int, num_splits: int, combine_head_dim: int | None = None
) -> set[Need]:
    """One call of the dense forward (prefill or decode): the kernel of `config` (0: any the
    automatic choice takes), and the split-KV combine unless the splits are forced to 1 or the
    decode kernel, which combines its own, runs. The combine's tile is the output's (v's) width,
    `combine_head_dim` (default: `head_dim`): 128 under q's and k's 192."""
    if config:
        needs = {(FORWARD_FAMILIES[config], dtype, head_dim, config)}
    else:
        needs = {(op, dtype, head_dim, None) for op in AUTO_FORWARD}
    if num_splits != 1 and config != 3:
        needs.add(("combine", dtype, combine_head_dim or head_dim, 0))
    return needs


def backward_needs(dtype: str, head_dim: int, config: int) -> set[Need]:
    """One call of the backward with backward_config `config` (0: automatic)."""
    if config:
        return {(BACKWARD_FAMILIES[config], dtype, head_dim, config)}
    return {(op, dtype, head_dim, None) for op in AUTO_BACKWARD}


def needs(case: Case | VarlenCase | PagedCase) -> set[Need]:
    """The kernels the case's gate runs (forward.check_case, backward.check_case,
    varlen.check_varlen_case, paged.check_paged_case), at the tile that runs its head dims
    (80 and 96 run the 128 tile's kernels, q's and k's 192 with v's 128 the 192 tile's)."""
    dims = (case.head_dim, case.value_head_dim) if isinstance(case, Case) else (case.head_dim,)
    dtype, head_dim = case.dtype, tile_head_dim(*dims) or case.head_dim
    combine = tile_head_dim(dims[-1]) or dims[-1]  # the split-KV combine's: the output's width
    if isinstance(case, VarlenCase):  # the packed call, then our dense forward per sequence
        packed = {("varlen", dtype, head_dim, case.config or None)}
        return packed | forward_needs(dtype, head_dim, 0, 0)
    if isinstance(case, PagedCase):  # the paged decode, then the decode of a contiguous copy
        paged = {("paged", dtype, head_dim, 3)}
        return paged | forward_needs(dtype, head_dim, 0, case.num_splits, combine)
    if case.kind in ("prefill", "decode"):
        return forward_needs(dtype, head_dim, case.config, case.num_splits, combine)
    # backward and train: autograd through flash_attention_forward (its configuration and splits
    # automatic; a backward case's -cfgN is the backward's)
    forward = forward_needs(dtype, head_dim, 0, 0, combine)
    return forward | backward_needs(dtype, head_dim, case.config)


def restriction_for(wanted: Iterable[Need]) -> Restriction:
    """The smallest restriction (one set of values per dimension) that holds every need."""
    wanted = set(wanted)

    def picked(option: str) -> tuple[int, ...] | None:
        configs = {c for op, _, _, c in wanted if ONLY_OPS[op][0] == option}
        return None if not configs or None in configs else tuple(configs)

    return Restriction(
        op=tuple({op for op, _, _, _ in wanted}),
        head_dim=tuple({d for _, _, d, _ in wanted}),
        config=picked("config"),
        backward_config=picked("backward_config"),
        dtype=tuple({dtype for _, dtype, _, _ in wanted}),
    )


def restriction_for_cases(cases: Iterable[Case | VarlenCase | PagedCase]) -> Restriction:
    return restriction_for(need for case in cases for need in needs(case))


def holds(restriction: Restriction, wanted: Iterable[Need]) -> bool:
    """Whether a build restricted so runs every need (the full build runs all)."""
    return all(restriction.holds(*need) for need in wanted)


def outside_reason(case: Case | VarlenCase | PagedCase, restriction: Restriction) -> str | None:
    """Why a build so restricted cannot run the case's gate, in one line naming a kernel it lacks
    and what to do; None where it holds every kernel the case runs (the full build holds all)."""
    missing = sorted(
        (need for need in needs(case) if not restriction.holds(*need)),
        key=lambda need: (need[0], need[1], need[2], need[3] or 0),
    )
    if not missing:
        return None

    def named(need: Need) -> str:
        op, dtype, head_dim, config = need
        return f"{op} ({dtype}, head_dim {head_dim}{f', config {config}' if config else ''})"

    return (
        f"outside this restricted build ({restriction.text()!r}): the case also runs "
        f"{', '.join(map(named, missing))}; unset FLASHMOE_BUILD_ONLY and rebuild for the whole "
        "matrix"
    )


def gate_case(case_id: str) -> Case | VarlenCase | PagedCase:
    """The gate case an id names: a forward, decode or backward id (cases.parse_case_id), or one of
    the varlen and paged gates' own cases (whose ids name a batch those gates draw)."""
    if case_id.startswith(("varlen-", "paged-")):
        found = [
            *(varlen_cases("gpu") + varlen_cases("cpu") if case_id.startswith("varlen-") else ()),
            *(paged_cases("gpu") + paged_cases("cpu") if case_id.startswith("paged-") else ()),
        ]
        for case in found:
            if case.id == case_id:
                return case
        raise ValueError(f"no varlen or paged gate case has the id {case_id!r}")
    return parse_case_id(case_id)
