"""The speed targets the benchmark judges, and their verdicts from a bench record: what bench.md and
the report both show, defined once. Importing this module does not import torch.

Every ratio is a speed over another speed, so above the target is good:
- varlen: the dense kernel's time over the varlen kernel's on the same sequences, >= 0.95;
- paged decode: contiguous decode's time over paged decode's on the same cache contents, >= 0.95
  for block sizes of 64 and more (smaller blocks are shown, not judged);
- decode against the read floor: the floor's time over the decode's, >= 0.90 for every decode case
  whose K+V is at least 64 MiB, contiguous (the matrix's decode cases and each paged case's
  contiguous twin) and paged;
- host cost: SDPA's time per call over ours in the back-to-back loop, >= 1.0.

The matrix's own targets (automatic configuration) and the training step's are set per card
(CARD_TARGETS, keyed by gpukinds label) and judged only on a card of that kind, identified by the
record's GPU name and compute capability (gpukinds.GpuKind.device_problem):
- H200, the card of record: prefill S 512 to 16k, backward and forward+backward against cuDNN,
  each >= 1.0 as a geomean; prefill and backward >= 0.85 in every case; at head dims 96, 256 and
  (192, 128) a geomean of each alone (MatrixTarget.head_dims), prefill >= 0.95 and the backward
  >= 0.90; D=256, S >= 4096, non-causal at least 550 TFLOP/s; deterministic=True at most
  1.15x the default's time in every backward case (ours / deterministic >= 1/1.15); the training
  step's tokens/s >= 1.0x SDPA's; the features' cases (feature_verdicts) and the Gemma-2-style
  training run (loss_verdict);
- H100, where they were first set: prefill against cuDNN >= 1.05 geomean and >= 0.90 each; D=128,
  S >= 4096, non-causal at least 600 TFLOP/s; the small cases' latency at most SDPA default's;
  the backward against SDPA flash (FlashAttention-2) >= 1.0 geomean and >= 0.85 each.
On another card or the CPU the card of record's geomeans show, not judged; so does the geomean of
a group the run holds only some of the matrix's cases of (BenchRecord.partial_groups: `bench --pr`,
`--quick`, a `--case` selection), while each of its cases is judged.
FlashAttention-3's and -4's time over ours (peer_geomeans) is reported beside them, never judged.

The features' targets (the H200's), each case against its twin of the same shape in the same run
(matrix.feature_cases): a sliding window's forward and backward at least 1.3x FlexAttention's
speed, and at most 1.15x the causal twin's time scaled by the window's visible share (the
(query, key) pairs the window lets through over those the causal mask does, masks.visible_pairs:
with the bottom-right alignment, a causal window of W keys over S of them lets through
S*W - W*(W-1)/2 pairs against S*(S+1)/2, about 2W/S - (W/S)^2, not W/S, which would ask the window
for twice the causal kernel's speed per pair); a softcap at most 1.10x, and sinks at most 1.05x,
the time without. Where our kernels refuse a feature (CUDA, until they take it) its ratios have no
time of ours: "not judged", with the operators' reason. The training run: the final losses of our
attention and eager's within 1% of eager's.
The small model's prefill and decode ratios have no target: they are shown beside the verdicts.

Timings of the CPU backend check the plumbing only: their verdicts are "not judged". So is a
ratio whose timing (ours, the other's, the read floor) stayed unstable after its retakes
(stats.unstable), or whose host cost's loops spread as far: its tables mark that timing with
UNSTABLE_MARK.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

from .. import gpukinds
from ..masks import visible_pairs
from . import stats
from .records import (
    FLEX_NAME,
    PEER_NAMES,
    SUBSET_LABELS,
    BenchRecord,
    CaseRecord,
    Gpu,
    HostCost,
    HostRecord,
    LossRecord,
    Measured,
    NotMeasured,
    PagedRecord,
    ReadFloor,
    StepRecord,
    VarlenRecord,
)

VARLEN_TARGET = 0.95
PAGED_TARGET = 0.95
PAGED_MIN_BLOCK = 64
READ_FLOOR_TARGET = 0.90
READ_FLOOR_MIN_BYTES = 64 * 2**20
HOST_TARGET = 1.0
PREFILL_MIN_SEQLEN = 512
TFLOPS_MIN_SEQLEN = 4096  # S >= this, non-causal: the TFLOP/s target's cases
# The H100's targets
PREFILL_GEOMEAN_TARGET = 1.05
PREFILL_CASE_TARGET = 0.90
TFLOPS_TARGET = 600.0
SMALL_TARGET = 1.0
BACKWARD_GEOMEAN_TARGET = 1.0
BACKWARD_CASE_TARGET = 0.85
# The H200's
H200_GEOMEAN_TARGET = 1.0
H200_CASE_TARGET = 0.85
# The H200's per head dim past 64 and 128 (the models people run: Phi-3's 96, Gemma's 256,
# DeepSeek's 192 with v's 128), each a geomean over that head dim's cases alone
H200_WIDE_PREFILL_TARGET = 0.95
H200_WIDE_BACKWARD_TARGET = 0.90
H200_WIDE_HEAD_DIMS = ((96, 96), (256, 256), (192, 128))
H200_TFLOPS_TARGET = 550.0  # d=256, S >= 4096, non-causal
H200_TFLOPS_HEAD_DIM = 256
DETERMINISTIC_MAX_SLOWDOWN = 1.15  # deterministic=True's time over the default's, at most
STEP_TARGET = 1.0
# The features' (feature_verdicts) and the training run's (loss_verdict)
FLEX_TARGET = 1.3  # FlexAttention's time over a window's
WINDOW_MAX_SLOWDOWN = 1.15  # a window's time over the causal twin's scaled by its visible share
SOFTCAP_MAX_SLOWDOWN = 1.10
SINKS_MAX_SLOWDOWN = 1.05
LOSS_MAX_DIFFERENCE = 0.01  # |our final loss / eager's - 1|, at most

MET, MISSED, NOT_JUDGED = "met", "missed", "not judged"
CPU_REASON = "CPU backend: plumbing numbers, not a card's speed"

# what each verdict's ratio compares, as the tables label it
VARLEN_VS_DENSE = "varlen / dense"
PAGED_VS_CONTIGUOUS = "paged / contiguous"
DECODE_VS_FLOOR = "decode / read floor"
PAGED_VS_FLOOR = "paged / read floor"
CONTIGUOUS_VS_FLOOR = "contiguous / read floor"
OURS_VS_SDPA_HOST = "ours / SDPA per call"
PREFILL_GEOMEAN = "geomean cuDNN / ours"
PREFILL_VS_CUDNN = "cuDNN / ours"


def tflops_target_label(tflops: float) -> str:
    return f"TFLOP/s / {tflops:.0f}"


TFLOPS_VS_TARGET = tflops_target_label(TFLOPS_TARGET)
SMALL_VS_DEFAULT = "SDPA default / ours"
BACKWARD_GEOMEAN = "geomean SDPA flash / ours"
BACKWARD_VS_FLASH = "SDPA flash / ours"
DETERMINISTIC_VS_OURS = "ours / deterministic"
STEP_VS_SDPA = "tokens/s ours / SDPA"
FLEX_VS_OURS = "FlexAttention / ours"
WINDOW_VS_CAUSAL = "causal x visible share / window"
SOFTCAP_VS_PLAIN = "without softcap / with"
SINKS_VS_PLAIN = "without sinks / with"
FEATURE_LABELS = (FLEX_VS_OURS, WINDOW_VS_CAUSAL, SOFTCAP_VS_PLAIN, SINKS_VS_PLAIN)
LOSS_AGREEMENT = "1 - |final loss ours / eager - 1|"
# The matrix's groups of automatic cases a target covers (matrix_members)
MATRIX_GROUPS = ("prefill", "small", "backward", "forward+backward", "deterministic")
# The column of CaseRecord.ours_deterministic among a target's columns (the others: baselines)
DETERMINISTIC = "deterministic"


@dataclasses.dataclass(frozen=True)
class MatrixTarget:
    """One of a card's targets over a group of the matrix's automatic cases (only those of
    `head_dims`, (q's and k's, v's), where set): each case's ratio of `column` (a baseline: its
    time over ours; DETERMINISTIC: our time over the deterministic one's), >= `geomean` as a
    geomean over the group and >= `each` in every case (None: no such verdict)."""

    group: str  # one of MATRIX_GROUPS
    column: str
    shown: str  # the column as a verdict's reason names it
    label: str  # the ratio as the tables name it
    geomean: float | None
    each: float | None
    head_dims: tuple[int, int] | None = None

    @property
    def geomean_label(self) -> str:
        return f"geomean {self.label}"

    @property
    def key(self) -> str:
        """The group, or the group at its head dims as case ids write them ("prefill d256",
        "prefill d192v128"): what a verdict and BenchRecord.partial_groups name."""
        if self.head_dims is None:
            return self.group
        head_dim, head_dim_v = self.head_dims
        return f"{self.group} d{head_dim}" + (f"v{head_dim_v}" if head_dim_v != head_dim else "")


@dataclasses.dataclass(frozen=True)
class CardTargets:
    """The targets set for one GPU kind (its CARD_TARGETS key, a gpukinds.KINDS label), judged on
    a card of that kind alone: the matrix's, the TFLOP/s of long non-causal prefill at
    `tflops_head_dim`, the training step's, the features' (feature_verdicts) and the training
    run's final losses (the largest relative difference allowed)."""

    matrix: tuple[MatrixTarget, ...]
    summary: str  # what they are, for the tables' headings
    tflops: float | None = None
    tflops_head_dim: int = 128  # the head dim (q's, k's and v's) of the TFLOP/s target's cases
    step: float | None = None
    features: bool = False
    loss: float | None = None

    @property
    def tflops_label(self) -> str:
        return tflops_target_label(self.tflops or 0.0)


CARD_TARGETS = {
    "h200": CardTargets(
        (
            MatrixTarget(
                "prefill",
                "sdpa-cudnn",
                "cuDNN",
                PREFILL_VS_CUDNN,
                H200_GEOMEAN_TARGET,
                H200_CASE_TARGET,
            ),
            MatrixTarget(
                "backward",
                "sdpa-cudnn",
                "cuDNN",
                PREFILL_VS_CUDNN,
                H200_GEOMEAN_TARGET,
                H200_CASE_TARGET,
            ),
            MatrixTarget(
                "forward+backward",
                "sdpa-cudnn",
                "cuDNN",
                PREFILL_VS_CUDNN,
                H200_GEOMEAN_TARGET,
                None,
            ),
            MatrixTarget(
                "deterministic",
                DETERMINISTIC,
                "deterministic",
                DETERMINISTIC_VS_OURS,
                1 / DETERMINISTIC_MAX_SLOWDOWN,
                1 / DETERMINISTIC_MAX_SLOWDOWN,
            ),
            *(
                MatrixTarget(
                    group, "sdpa-cudnn", "cuDNN", PREFILL_VS_CUDNN, target, None, head_dims
                )
                for group, target in (
                    ("prefill", H200_WIDE_PREFILL_TARGET),
                    ("backward", H200_WIDE_BACKWARD_TARGET),
                )
                for head_dims in H200_WIDE_HEAD_DIMS
            ),
        ),
        f"prefill S >= {PREFILL_MIN_SEQLEN}, the backward and forward+backward against cuDNN, "
        f"a geomean of at least {H200_GEOMEAN_TARGET:.2f}x each, prefill and backward at least "
        f"{H200_CASE_TARGET:.2f}x in every case; at head dims 96, 256 and (192, 128) a geomean "
        f"of their own, prefill at least {H200_WIDE_PREFILL_TARGET:.2f}x, the backward "
        f"{H200_WIDE_BACKWARD_TARGET:.2f}x; D={H200_TFLOPS_HEAD_DIM} at S >= "
        f"{TFLOPS_MIN_SEQLEN} non-causal against {H200_TFLOPS_TARGET:.0f} TFLOP/s; "
        f"deterministic=True at most {DETERMINISTIC_MAX_SLOWDOWN:.2f}x the default's time in "
        f"every backward case; the training step at least {STEP_TARGET:.2f}x SDPA's tokens/s",
        tflops=H200_TFLOPS_TARGET,
        tflops_head_dim=H200_TFLOPS_HEAD_DIM,
        step=STEP_TARGET,
        features=True,
        loss=LOSS_MAX_DIFFERENCE,
    ),
    "h100": CardTargets(
        (
            MatrixTarget(
                "prefill",
                "sdpa-cudnn",
                "cuDNN",
                PREFILL_VS_CUDNN,
                PREFILL_GEOMEAN_TARGET,
                PREFILL_CASE_TARGET,
            ),
            MatrixTarget(
                "small", "sdpa-default", "SDPA default", SMALL_VS_DEFAULT, None, SMALL_TARGET
            ),
            MatrixTarget(
                "backward",
                "sdpa-flash",
                "SDPA flash",
                BACKWARD_VS_FLASH,
                BACKWARD_GEOMEAN_TARGET,
                BACKWARD_CASE_TARGET,
            ),
        ),
        f"prefill S >= {PREFILL_MIN_SEQLEN} against cuDNN, a geomean and each case; D=128 at S "
        f">= {TFLOPS_MIN_SEQLEN} non-causal against {TFLOPS_TARGET:.0f} TFLOP/s; the small cases "
        "against SDPA default; the backward against SDPA flash, a geomean and each case",
        tflops=TFLOPS_TARGET,
    ),
}
# The card of record: elsewhere (another card, the CPU) its geomeans are shown, not judged
RECORD_CARD = "h200"
MATRIX_CASE_LABELS = tuple(
    dict.fromkeys(
        [t.label for card in CARD_TARGETS.values() for t in card.matrix if t.each is not None]
        + [card.tflops_label for card in CARD_TARGETS.values() if card.tflops]
    )
)
# What BenchRecord.partial_groups may name: the groups, then the head dims' targets
TARGET_KEYS = tuple(
    dict.fromkeys([*MATRIX_GROUPS, *(t.key for card in CARD_TARGETS.values() for t in card.matrix)])
)
MATRIX_LABELS = tuple(
    dict.fromkeys(
        [t.geomean_label for card in CARD_TARGETS.values() for t in card.matrix if t.geomean]
        + list(MATRIX_CASE_LABELS)
    )
)
UNSTABLE_MARK = "‡"  # beside a timing whose spread stayed over stats.UNSTABLE_SPREAD
TIMINGS = (Measured, ReadFloor, HostCost)  # what can be unstable: each has spread(), is_unstable()


def unstable_mark(result) -> str:
    """UNSTABLE_MARK for a measured result whose spread shows a disturbance, else ""."""
    unstable = isinstance(result, TIMINGS) and result.is_unstable()
    return UNSTABLE_MARK if unstable else ""


def unstable_note(unstable: int, total: int, retaken: int) -> str:
    """The footnote of UNSTABLE_MARK: how many of `total` cases stayed unstable, how many were
    retaken; "" when neither happened."""
    if not unstable and not retaken:
        return ""
    again = f", {retaken} retaken" if retaken else ""
    return (
        f"{UNSTABLE_MARK} IQR over {100 * stats.UNSTABLE_SPREAD:.0f}% of the median, a disturbed "
        f"timing: {unstable} of {total} cases unstable{again}; their ratios are not judged, rerun "
        "the bench."
    )


def timings(record) -> list:
    """The timings a matrix case's or a target record's ratios are taken from."""
    if isinstance(record, CaseRecord):
        return [
            record.ours,
            *record.baselines.values(),
            record.read_floor,
            record.ours_deterministic,
        ]
    names = ("ours", "dense", "contiguous", "sdpa", "read_floor")
    return [getattr(record, name, None) for name in names]


def records_note(records: list) -> str:
    """unstable_note for matrix cases or target records."""
    unstable = sum(any(map(unstable_mark, timings(r))) for r in records)
    retaken = sum(any(getattr(t, "retakes", None) for t in timings(r)) for r in records)
    return unstable_note(unstable, len(records), retaken)


@dataclasses.dataclass(frozen=True)
class Verdict:
    id: str  # the case
    what: str  # which ratio (the labels above)
    ratio: float | None
    target: float
    status: str  # MET, MISSED or NOT_JUDGED
    reason: str = ""  # why not judged

    def text(self) -> str:
        ratio = "-" if self.ratio is None else f"{self.ratio:.2f}x"
        if self.status == NOT_JUDGED:
            return f"{self.id}: {self.what} {ratio}, not judged ({self.reason})"
        sign = ">=" if self.status == MET else "<"
        return f"{self.id}: {self.what} {ratio} {sign} {self.target:.2f}x ({self.status})"


@dataclasses.dataclass(frozen=True)
class CellStyle:
    """How a table cell writes a ratio and its verdict: bench.md in plain text, the PR report with
    its own marks. `met` and `missed` are formats of the target (a float)."""

    times: str  # after a ratio
    dash: str  # a missing ratio
    met: str
    missed: str

    def ratio(self, ratio: float | None) -> str:
        return self.dash if ratio is None else f"{ratio:.2f}{self.times}"

    def verdict(self, verdict: Verdict | None) -> str:
        if verdict is None:
            return "no target"
        if verdict.status == MET:
            return self.met.format(verdict.target)
        if verdict.status == MISSED:
            return self.missed.format(verdict.target)
        return "not judged"

    def judged(self, ratio: float | None, verdict: Verdict | None) -> str:
        """The ratio and its verdict in one cell; the verdict alone when there is no ratio."""
        if ratio is None:
            return self.dash if verdict is None else self.verdict(verdict)
        return f"{self.ratio(ratio)} {self.verdict(verdict)}"


PLAIN = CellStyle("x", "-", "met (>= {:.2f}x)", "**MISSED** (< {:.2f}x)")


def _why_not(*sides) -> str:
    for name, side in sides:
        if isinstance(side, NotMeasured):
            return f"{name} {side.status}: {side.reason[:120]}"
        if side is None:
            return f"no {name}"
    return "no ratio"


def unstable_reason(*sides) -> str:
    """Why a ratio of these (name, result) sides says nothing: the first one whose spread still
    shows a disturbance after its retakes (stats.unstable); "" when none does."""
    for name, side in sides:
        if isinstance(side, TIMINGS) and side.is_unstable():
            retakes = getattr(side, "retakes", None)  # a host cost is not retaken
            plural = "" if retakes == 1 else "s"
            after = "" if retakes is None else f" after {retakes} retake{plural}"
            spread = side.spread()
            return (
                f"{name.split(' (')[0]} unstable: IQR {100 * spread:.0f}% of the median{after}; "
                "rerun the bench"
            )
    return ""


def judge(
    case_id: str, what: str, ratio: float | None, target: float, cpu: bool, sides=()
) -> Verdict:
    """MET or MISSED by the ratio; NOT_JUDGED without a ratio, on the CPU, or when a side's
    timing was disturbed (a disturbed time turns any ratio into noise)."""
    if ratio is None:
        return Verdict(case_id, what, None, target, NOT_JUDGED, _why_not(*sides))
    if cpu:
        return Verdict(case_id, what, ratio, target, NOT_JUDGED, CPU_REASON)
    unstable = unstable_reason(*sides)
    if unstable:
        return Verdict(case_id, what, ratio, target, NOT_JUDGED, unstable)
    return Verdict(case_id, what, ratio, target, MET if ratio >= target else MISSED)


def case_kv_bytes(case: CaseRecord) -> int:
    return 2 * case.batch * case.heads_kv * case.seqlen_k * case.head_dim * 2


def _floor_ratio(floor) -> float | None:
    return floor.ratio if isinstance(floor, ReadFloor) else None


def decode_floor_verdicts(record: BenchRecord) -> list[Verdict]:
    """The read-floor verdict of every matrix decode case whose K+V is at least 64 MiB."""
    cpu = record.backend == "cpu"
    return [
        judge(
            case.id,
            DECODE_VS_FLOOR,
            _floor_ratio(case.read_floor),
            READ_FLOOR_TARGET,
            cpu,
            (("ours", case.ours), ("read floor (CUDA only)", case.read_floor)),
        )
        for case in record.cases
        if case.kind == "decode" and case_kv_bytes(case) >= READ_FLOOR_MIN_BYTES
    ]


def _baseline_ratio(case: CaseRecord, name: str) -> float | None:
    result = case.baselines.get(name)
    return result.ratio if isinstance(result, Measured) else None


def _geomean(ratios: list[float | None]) -> float | None:
    found = [r for r in ratios if r]
    return math.exp(sum(map(math.log, found)) / len(found)) if found else None


def _tflops_case(case: CaseRecord, head_dim: int) -> bool:
    """A prefill case the TFLOP/s target covers: at its head dim (v's too), long, non-causal."""
    return (
        case.head_dim == head_dim
        and not case.head_dim_v
        and case.seqlen_q >= TFLOPS_MIN_SEQLEN
        and not case.causal
    )


def card_kind(gpu: Gpu | None, cpu: bool = False) -> str | None:
    """The key of CARD_TARGETS whose kind this record's card is (its name and compute capability:
    gpukinds.GpuKind.device_problem); None on the CPU or on a card without targets."""
    if cpu or gpu is None:
        return None
    for kind in CARD_TARGETS:
        if gpukinds.kind_of(kind).device_problem(gpu.name, gpu.capability) is None:
            return kind
    return None


def card_targets(gpu: Gpu | None, cpu: bool = False) -> CardTargets | None:
    """The targets set for this record's card; None where none are (card_kind)."""
    kind = card_kind(gpu, cpu)
    return CARD_TARGETS[kind] if kind else None


def shown_targets(gpu: Gpu | None, cpu: bool = False) -> tuple[str, CardTargets]:
    """(the card, its targets) that a run's tables show: its own card's, else the card of
    record's (shown, not judged)."""
    kind = card_kind(gpu, cpu) or RECORD_CARD
    return gpukinds.kind_of(kind).card, CARD_TARGETS[kind]


def _cards(kinds) -> str:
    return " and the ".join(gpukinds.kind_of(kind).card for kind in kinds)


def step_cards() -> str:
    """The cards whose targets judge the training step."""
    return _cards(kind for kind, card in CARD_TARGETS.items() if card.step)


def _elsewhere(gpu: Gpu | None, cards: str, verdict: Verdict | None = None) -> str:
    """Why a card's target is not judged here, and on another GPU what the ratio is against the card
    of record's target (`verdict`, judged by it before it was set aside: a run on the card at hand
    reads the card of record's verdicts without redoing them by hand). The CPU's timings say
    nothing of a GPU's, so they get none."""
    why = f"set for the {cards}; this card is {gpu.name if gpu else 'the CPU'}"
    if gpu is not None and verdict is not None and verdict.status in (MET, MISSED):
        why += f"; against the {gpukinds.kind_of(RECORD_CARD).card}'s: {verdict.status}"
    return why


def matrix_members(group: str, cases: list[CaseRecord]) -> list[CaseRecord]:
    """The automatic cases of one of MATRIX_GROUPS, in the matrix's order (the features' cases
    have targets of their own: feature_verdicts)."""
    auto = [c for c in cases if not c.config and c.group != "features"]
    if group == "prefill":
        return [c for c in auto if c.group == "prefill" and c.seqlen_q >= PREFILL_MIN_SEQLEN]
    if group == "small":
        return [c for c in auto if c.group == "small"]
    if group in ("backward", "deterministic"):
        return [c for c in auto if c.kind == "backward" and not c.deterministic]
    return [c for c in auto if c.kind == "train"]


def target_members(target: MatrixTarget, cases: Sequence) -> list:
    """The automatic cases a target covers: its group's (matrix_members), at its head dims only
    where it names them."""
    members = matrix_members(target.group, cases)
    if target.head_dims is None:
        return members
    return [c for c in members if (c.head_dim, c.head_dim_v or c.head_dim) == target.head_dims]


# One target of each key, for partial_groups (the cards' targets of one key cover the same cases)
_TARGET_OF_KEY = {
    **{group: MatrixTarget(group, "", "", "", None, None) for group in MATRIX_GROUPS},
    **{t.key: t for card in CARD_TARGETS.values() for t in card.matrix if t.head_dims},
}


def partial_groups(cases: Sequence, matrix: Sequence) -> list[str]:
    """TARGET_KEYS (the groups, and a group at a target's head dims) of which `cases` hold some
    of `matrix`'s members but not all (cases and matrix: CaseRecords or the Cases they are timed
    from)."""
    return [
        key
        for key in TARGET_KEYS
        if (timed := {c.id for c in target_members(_TARGET_OF_KEY[key], cases)})
        and timed != {c.id for c in target_members(_TARGET_OF_KEY[key], matrix)}
    ]


def column_result(case: CaseRecord, column: str):
    if column == DETERMINISTIC:
        return case.ours_deterministic
    return case.baselines.get(column)


def column_ratio(case: CaseRecord, column: str) -> float | None:
    """A target's ratio in one case: the baseline's time over ours, or (DETERMINISTIC) our time
    over the deterministic one's."""
    result = column_result(case, column)
    if not isinstance(result, Measured) or not result.ratio:
        return None
    return 1 / result.ratio if column == DETERMINISTIC else result.ratio


def matrix_verdicts(record: BenchRecord) -> list[Verdict]:
    """The matrix's targets over its automatic cases: on a card with targets, a geomean and a
    verdict per case as that card's targets say; elsewhere only the card of record's geomeans,
    not judged."""
    cpu = record.backend == "cpu"
    here = card_targets(record.gpu, cpu)
    card = here or CARD_TARGETS[RECORD_CARD]
    found = []
    for target in card.matrix:
        cases = target_members(target, record.cases)
        if target.geomean is None or not cases:
            continue
        ratios = [column_ratio(c, target.column) for c in cases]
        measured = sum(r is not None for r in ratios)
        unstable = sum(
            bool(
                unstable_reason(("ours", c.ours), (target.column, column_result(c, target.column)))
            )
            for c in cases
        )
        verdict = judge(
            f"{target.key}: {measured} of {len(cases)} cases",
            target.geomean_label,
            _geomean(ratios),
            target.geomean,
            cpu,
        )
        why_not = ""
        if here is None:
            why_not = _elsewhere(record.gpu, _cards(CARD_TARGETS), verdict)
        elif target.key in (record.partial_groups or ()):  # a few cases' geomean: not the matrix's
            timed = SUBSET_LABELS.get(record.subset or "", "a subset of the matrix")
            why_not = f"{timed}: the geomean is judged over all of the matrix's {target.key} cases"
        elif measured < len(cases):  # a geomean without its hardest cases could pass
            why_not = f"{len(cases) - measured} of {len(cases)} cases have no {target.column} ratio"
        elif unstable:  # a disturbed ratio moves the geomean as much as a missing one
            why_not = (
                f"{unstable} of {len(cases)} cases unstable (IQR over "
                f"{100 * stats.UNSTABLE_SPREAD:.0f}% of the median); rerun the bench"
            )
        if why_not and verdict.status != NOT_JUDGED:
            verdict = dataclasses.replace(verdict, status=NOT_JUDGED, reason=why_not)
        found.append(verdict)
    if here is None:
        return found
    for target in card.matrix:
        if target.each is None:
            continue
        for case in target_members(target, record.cases):
            result = column_result(case, target.column)
            sides = (("ours", case.ours), (target.shown, result))
            ratio = column_ratio(case, target.column)
            found.append(judge(case.id, target.label, ratio, target.each, cpu, sides))
            if (
                target.group == "prefill"
                and card.tflops
                and _tflops_case(case, card.tflops_head_dim)
            ):
                tflops = case.ours.tflops if isinstance(case.ours, Measured) else None
                ratio = tflops / card.tflops if tflops else None
                sides = (("ours", case.ours),)
                found.append(judge(case.id, card.tflops_label, ratio, 1.0, cpu, sides))
    return found


@dataclasses.dataclass(frozen=True)
class PeerGeomean:
    """A peer's (FlashAttention-3 or -4) time over ours, a geomean over one group of the matrix's
    automatic cases: reported beside the targets, never judged."""

    peer: str  # records.PEER_NAMES
    group: str  # PEER_GROUPS
    measured: int
    total: int
    ratio: float | None
    reason: str = ""  # why there is no ratio (the first case's): not installed, another card


PEER_GROUPS = ("prefill", "backward", "forward+backward")


def peer_geomeans(record: BenchRecord) -> list[PeerGeomean]:
    """Each peer's geomean over each of PEER_GROUPS whose cases have its column (none for a
    record from before the peers)."""
    found = []
    for peer in PEER_NAMES:
        for group in PEER_GROUPS:
            cases = [c for c in matrix_members(group, record.cases) if peer in c.baselines]
            if not cases:
                continue
            ratios = [_baseline_ratio(c, peer) for c in cases]
            missing = [
                c.baselines[peer] for c in cases if isinstance(c.baselines[peer], NotMeasured)
            ]
            reason = "" if any(ratios) else missing[0].reason if missing else "no ratio"
            measured = sum(r is not None for r in ratios)
            found.append(PeerGeomean(peer, group, measured, len(cases), _geomean(ratios), reason))
    return found


# A case id's window, softcap and sinks suffixes (cases.feature_suffix)
_FEATURE_SUFFIX = re.compile(r"(-win(?:\d+|inf)_(?:\d+|inf))?(-cap[0-9.]+)?(-sinks)?$")


def twin_id(case_id: str) -> str:
    """The id of the case without its window, softcap and sinks: its plain twin."""
    return _FEATURE_SUFFIX.sub("", case_id)


def visible_share(case: CaseRecord) -> float:
    """The (query, key) pairs the case's window lets through over those its twin's mask does."""
    window = tuple(case.window or (-1, -1))
    seqlens = (case.seqlen_q, case.seqlen_k, case.causal)
    return visible_pairs(*seqlens, window) / max(1, visible_pairs(*seqlens))


def _time_ratio(theirs, ours) -> float | None:
    if isinstance(theirs, Measured) and isinstance(ours, Measured) and ours.median_ms:
        return theirs.median_ms / ours.median_ms
    return None


def feature_cards() -> str:
    """The cards whose targets judge the features and the training run."""
    return _cards(kind for kind, card in CARD_TARGETS.items() if card.features)


def feature_ratios(case: CaseRecord, twin: CaseRecord | None) -> list[tuple]:
    """(label, ratio, target, sides) of each of a case's feature targets: a case with one of a
    window, a softcap or sinks, against `twin` (its plain twin, None where the run lacks it)."""
    window, softcap, sinks = bool(case.window), bool(case.softcap), bool(case.sinks)
    if window + softcap + sinks != 1:
        return []  # a case of several features has no twin that isolates one
    ours = ("ours", case.ours)
    plain = (f"twin {twin_id(case.id)}", twin.ours if twin else None)
    if softcap or sinks:
        label, slowdown = (SOFTCAP_VS_PLAIN, SOFTCAP_MAX_SLOWDOWN)
        if sinks:
            label, slowdown = (SINKS_VS_PLAIN, SINKS_MAX_SLOWDOWN)
        return [(label, _time_ratio(plain[1], case.ours), 1 / slowdown, (ours, plain))]
    flex = case.baselines.get(FLEX_NAME)
    flex_ratio = flex.ratio if isinstance(flex, Measured) else None
    scaled = _time_ratio(plain[1], case.ours)
    return [
        (FLEX_VS_OURS, flex_ratio, FLEX_TARGET, (ours, ("FlexAttention", flex))),
        (
            WINDOW_VS_CAUSAL,
            None if scaled is None else scaled * visible_share(case),
            1 / WINDOW_MAX_SLOWDOWN,
            (ours, plain),
        ),
    ]


def feature_verdicts(record: BenchRecord) -> list[Verdict]:
    """Every case with a window, softcap or sinks against its twin and FlexAttention, judged on a
    card whose targets set them; elsewhere shown, not judged."""
    cpu = record.backend == "cpu"
    card = card_targets(record.gpu, cpu)
    by_id = {c.id: c for c in record.cases}
    found = []
    for case in record.cases:
        if not case.features:
            continue
        for label, ratio, goal, sides in feature_ratios(case, by_id.get(twin_id(case.id))):
            verdict = judge(case.id, label, ratio, goal, cpu, sides)
            if (card is None or not card.features) and verdict.status != NOT_JUDGED:
                reason = _elsewhere(record.gpu, feature_cards(), verdict)
                verdict = dataclasses.replace(verdict, status=NOT_JUDGED, reason=reason)
            found.append(verdict)
    return found


def loss_verdict(target: LossRecord, cpu: bool, gpu: Gpu | None) -> Verdict:
    """The training run's final losses, 1 - |ours / eager - 1| against 1 - the largest relative
    difference allowed, judged on a card whose targets set one (a difference of losses, not a
    speed: the CPU's is shown beside it like another card's)."""
    card = card_targets(gpu, cpu)
    allowed = (card and card.loss) or LOSS_MAX_DIFFERENCE
    agreement = None if target.ratio is None else 1 - abs(target.ratio - 1)
    sides = (("ours", target.ours), ("eager", target.eager))
    verdict = judge(target.id, LOSS_AGREEMENT, agreement, 1 - allowed, False, sides)
    if (card is None or card.loss is None) and verdict.status != NOT_JUDGED:
        reason = _elsewhere(gpu, feature_cards(), verdict)
        verdict = dataclasses.replace(verdict, status=NOT_JUDGED, reason=reason)
    return verdict


def step_verdict(target: StepRecord, cpu: bool, gpu: Gpu | None) -> Verdict:
    """The training step's tokens/s over SDPA's, judged on a card whose targets set one."""
    card = card_targets(gpu, cpu)
    sides = (("ours", target.ours), ("SDPA", target.sdpa))
    goal = (card and card.step) or STEP_TARGET  # off the cards that set one: shown beside it
    verdict = judge(target.id, STEP_VS_SDPA, target.ratio, goal, cpu, sides)
    if (card is None or card.step is None) and verdict.status != NOT_JUDGED:
        reason = _elsewhere(gpu, step_cards(), verdict)
        verdict = dataclasses.replace(verdict, status=NOT_JUDGED, reason=reason)
    return verdict


def target_verdicts(target, cpu: bool, gpu: Gpu | None = None) -> list[Verdict]:
    """The verdicts of one target record (none for the model, which has no target); `gpu` is the
    run's card (the training step's target is set per card)."""
    if isinstance(target, StepRecord):
        return [step_verdict(target, cpu, gpu)]
    if isinstance(target, LossRecord):
        return [loss_verdict(target, cpu, gpu)]
    if isinstance(target, VarlenRecord):
        sides = (("varlen", target.ours), ("dense", target.dense))
        return [judge(target.id, VARLEN_VS_DENSE, target.ratio, VARLEN_TARGET, cpu, sides)]
    if isinstance(target, PagedRecord):
        verdicts = []
        if target.block_size >= PAGED_MIN_BLOCK:
            sides = (("paged", target.ours), ("contiguous", target.contiguous))
            verdicts.append(
                judge(target.id, PAGED_VS_CONTIGUOUS, target.ratio, PAGED_TARGET, cpu, sides)
            )
        if target.kv_bytes >= READ_FLOOR_MIN_BYTES:
            floor = ("read floor (CUDA only)", target.read_floor)
            verdicts += [
                judge(
                    target.id,
                    PAGED_VS_FLOOR,
                    target.floor_ratio,
                    READ_FLOOR_TARGET,
                    cpu,
                    (("paged", target.ours), floor),
                ),
                judge(
                    target.id,
                    CONTIGUOUS_VS_FLOOR,
                    target.contiguous_floor_ratio,
                    READ_FLOOR_TARGET,
                    cpu,
                    (("contiguous", target.contiguous), floor),
                ),
            ]
        return verdicts
    if isinstance(target, HostRecord):
        sides = (("ours", target.ours), ("SDPA", target.sdpa))
        return [judge(target.id, OURS_VS_SDPA_HOST, target.ratio, HOST_TARGET, cpu, sides)]
    return []


def verdicts(record: BenchRecord) -> list[Verdict]:
    """Every verdict of the run: the matrix's decode cases, its prefill, small and backward
    cases, the features' cases, then the target cases in order."""
    cpu = record.backend == "cpu"
    found = decode_floor_verdicts(record) + matrix_verdicts(record) + feature_verdicts(record)
    for target in record.targets or []:
        found += target_verdicts(target, cpu, record.gpu)
    return found


def judged_here(verdict: Verdict) -> bool:
    """Whether a verdict is about this run's card: all but the matrix's geomeans off a card with
    targets (shown where there is a section for other verdicts, never a section of their own)."""
    return not (verdict.what in MATRIX_LABELS and verdict.status == NOT_JUDGED)


def counts(found: list[Verdict]) -> dict[str, int]:
    return {status: sum(v.status == status for v in found) for status in (MET, MISSED, NOT_JUDGED)}
