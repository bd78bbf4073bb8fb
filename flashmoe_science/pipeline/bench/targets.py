"""The speed targets the benchmark judges, and their verdicts from a bench record: what bench.md and
the report both show, defined once. Importing this module does not import torch.

Every ratio is a speed over another speed, so above the target is good:
- varlen: the dense kernel's time over the varlen kernel's on the same sequences, >= 0.95;
- paged decode: contiguous decode's time over paged decode's on the same cache contents, >= 0.95
  for block sizes of 64 and more (smaller blocks are shown, not judged);
- decode against the read floor: the floor's time over the decode's, >= 0.90 for every decode case
  whose K+V is at least 64 MiB, contiguous (the matrix's decode cases and each paged case's
  contiguous twin) and paged;
- host cost: SDPA's time per call over ours in the back-to-back loop, >= 1.0;
and on an H100, where they were set, the matrix's (automatic configuration):
- prefill, S 512 to 16k: cuDNN's time over ours, >= 1.05 as a geomean and >= 0.90 in every case;
  D=128, S >= 4096, non-causal: at least 600 TFLOP/s;
- the small cases: SDPA default's time over ours, >= 1.0 (latency at most SDPA's);
- backward: SDPA flash's (FlashAttention-2's) time over ours, >= 1.0 as a geomean and >= 0.85 in
  every case.
On another card or the CPU these show as their geomeans, not judged.
The small model's prefill and decode ratios have no target: they are shown beside the verdicts.

Timings of the CPU backend check the plumbing only: their verdicts are "not judged". So is a
ratio whose timing (ours, the other's, the read floor) stayed unstable after its retakes
(stats.unstable), or whose host cost's loops spread as far: its tables mark that timing with
UNSTABLE_MARK.
"""

from __future__ import annotations

import dataclasses
import math

from .. import gpukinds
from . import stats
from .records import (
    BenchRecord,
    CaseRecord,
    HostCost,
    HostRecord,
    Measured,
    NotMeasured,
    PagedRecord,
    ReadFloor,
    VarlenRecord,
)

VARLEN_TARGET = 0.95
PAGED_TARGET = 0.95
PAGED_MIN_BLOCK = 64
READ_FLOOR_TARGET = 0.90
READ_FLOOR_MIN_BYTES = 64 * 2**20
HOST_TARGET = 1.0
# The matrix's targets, set for this card
MATRIX_CARD = gpukinds.kind_of("h100")
PREFILL_MIN_SEQLEN = 512
PREFILL_GEOMEAN_TARGET = 1.05
PREFILL_CASE_TARGET = 0.90
TFLOPS_TARGET = 600.0  # D=128, S >= TFLOPS_MIN_SEQLEN, non-causal
TFLOPS_MIN_SEQLEN = 4096
SMALL_TARGET = 1.0
BACKWARD_GEOMEAN_TARGET = 1.0
BACKWARD_CASE_TARGET = 0.85

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
TFLOPS_VS_TARGET = "TFLOP/s / 600"
SMALL_VS_DEFAULT = "SDPA default / ours"
BACKWARD_GEOMEAN = "geomean SDPA flash / ours"
BACKWARD_VS_FLASH = "SDPA flash / ours"
MATRIX_CASE_LABELS = (PREFILL_VS_CUDNN, TFLOPS_VS_TARGET, SMALL_VS_DEFAULT, BACKWARD_VS_FLASH)
MATRIX_LABELS = (PREFILL_GEOMEAN, BACKWARD_GEOMEAN, *MATRIX_CASE_LABELS)
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
        return [record.ours, *record.baselines.values(), record.read_floor]
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


def _tflops_case(case: CaseRecord) -> bool:
    """A prefill case the TFLOP/s target covers: D=128, long, non-causal."""
    return case.head_dim == 128 and case.seqlen_q >= TFLOPS_MIN_SEQLEN and not case.causal


def matrix_verdicts(record: BenchRecord) -> list[Verdict]:
    """The prefill, small and backward targets over the matrix's automatic cases: a geomean and
    a verdict per case on an H100; elsewhere only the geomeans, not judged (set for that card)."""
    cpu = record.backend == "cpu"
    gpu_name = record.gpu.name if record.gpu else None
    on_card = not cpu and MATRIX_CARD.matches(gpu_name)
    auto = [c for c in record.cases if not c.config]
    prefill = [c for c in auto if c.group == "prefill" and c.seqlen_q >= PREFILL_MIN_SEQLEN]
    backward = [c for c in auto if c.kind == "backward"]
    found = []
    for cases, baseline, label, target, what in (
        (prefill, "sdpa-cudnn", PREFILL_GEOMEAN, PREFILL_GEOMEAN_TARGET, "prefill"),
        (backward, "sdpa-flash", BACKWARD_GEOMEAN, BACKWARD_GEOMEAN_TARGET, "backward"),
    ):
        if not cases:
            continue
        ratios = [_baseline_ratio(c, baseline) for c in cases]
        measured = sum(r is not None for r in ratios)
        unstable = sum(
            bool(unstable_reason(("ours", c.ours), (baseline, c.baselines.get(baseline))))
            for c in cases
        )
        verdict = judge(
            f"{what}: {measured} of {len(cases)} cases", label, _geomean(ratios), target, cpu
        )
        why_not = ""
        if not on_card:
            why_not = f"set for the {MATRIX_CARD.card}; this card is {gpu_name or 'the CPU'}"
        elif measured < len(cases):  # a geomean without its hardest cases could pass
            why_not = f"{len(cases) - measured} of {len(cases)} cases have no {baseline} ratio"
        elif unstable:  # a disturbed ratio moves the geomean as much as a missing one
            why_not = (
                f"{unstable} of {len(cases)} cases unstable (IQR over "
                f"{100 * stats.UNSTABLE_SPREAD:.0f}% of the median); rerun the bench"
            )
        if why_not and verdict.status != NOT_JUDGED:
            verdict = dataclasses.replace(verdict, status=NOT_JUDGED, reason=why_not)
        found.append(verdict)
    if not on_card:
        return found
    small = [c for c in auto if c.group == "small"]
    for cases, baseline, shown, label, target in (
        (prefill, "sdpa-cudnn", "cuDNN", PREFILL_VS_CUDNN, PREFILL_CASE_TARGET),
        (small, "sdpa-default", "SDPA default", SMALL_VS_DEFAULT, SMALL_TARGET),
        (backward, "sdpa-flash", "SDPA flash", BACKWARD_VS_FLASH, BACKWARD_CASE_TARGET),
    ):
        for case in cases:
            sides = (("ours", case.ours), (shown, case.baselines.get(baseline)))
            ratio = _baseline_ratio(case, baseline)
            found.append(judge(case.id, label, ratio, target, cpu, sides))
            if cases is prefill and _tflops_case(case):  # after its cuDNN verdict
                tflops = case.ours.tflops if isinstance(case.ours, Measured) else None
                ratio = tflops / TFLOPS_TARGET if tflops else None
                sides = (("ours", case.ours),)
                found.append(judge(case.id, TFLOPS_VS_TARGET, ratio, 1.0, cpu, sides))
    return found


def target_verdicts(target, cpu: bool) -> list[Verdict]:
    """The verdicts of one target record (none for the model, which has no target)."""
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
    cases, then the target cases in order."""
    cpu = record.backend == "cpu"
    found = decode_floor_verdicts(record) + matrix_verdicts(record)
    for target in record.targets or []:
        found += target_verdicts(target, cpu)
    return found


def judged_here(verdict: Verdict) -> bool:
    """Whether a verdict is about this run's card: all but the matrix's geomeans off the H100
    (shown where there is a section for other verdicts, never a section of their own)."""
    return not (verdict.what in MATRIX_LABELS and verdict.status == NOT_JUDGED)


def counts(found: list[Verdict]) -> dict[str, int]:
    return {status: sum(v.status == status for v in found) for status in (MET, MISSED, NOT_JUDGED)}
