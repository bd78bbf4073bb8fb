"""The decode's phase trace, for `python -m flashmoe_science phases dec-...` (phases.py builds and
runs it; this module reads it).

    python -m flashmoe_science phases dec-bf16-d128-h32-b1-q1-k4096
    python -m flashmoe_science phases dec-bf16-d128-h32kv8-b4-q1-k8192 --block-size 64

The split-KV decode streams K and V at the bandwidth limit; what it pays besides is fixed: the
first stages' latency, the last stage's math with nothing left in flight, the warps' reduction,
and with splits the partial's store, the arrival and the last split's combine. A decode block is
short-lived (one per SM, one wave), so its phases are stamped once per block, not per tile: thread
0 stamps clock64 at each mark and %globaltimer at the block's start and end
(csrc/flash_decode_kernel.cuh, namespace decode_trace; the slot numbers below are its). The timer
puts the blocks on one time line and turns cycles into microseconds; its tick is coarse (a fraction
of a microsecond), so a block's start is known to a tick and a phase's length to a cycle.

The traced call runs after a 256 MiB L2 flush, as the bench times it. With --block-size the same
cache contents are read through a shuffled block table (the paged decode), as bench's paged
targets do.
"""

from __future__ import annotations

from collections.abc import Sequence

from .cudatools import median_or_none, trace_cell

# csrc/flash_decode_kernel.cuh, namespace decode_trace (a test holds the two together)
BLOCKS, SLOTS = 1024, 12
MARKS = ("start", "first_stage", "last_stage", "loop_done", "reduced", "arrived", "combined")
TIMER_START, TIMER_END, SM, COMBINER, STAGES = 7, 8, 9, 10, 11
# (name, from mark, to mark, what it is); "per_stage" divides by the block's stages - 1
PHASES = (
    ("prologue", "start", "first_stage", "Q and the first stages' copies, until they land"),
    ("per_stage", "first_stage", "last_stage", "the main loop, a stage (its loads overlapped)"),
    ("last_stage", "last_stage", "loop_done", "the last stage's math, nothing left in flight"),
    ("reduce", "loop_done", "reduced", "the warps reduced, the log-sum-exp"),
    ("publish", "reduced", "arrived", "the partial stored and the arrival counted (splits)"),
    ("combine", "arrived", "combined", "the last split of a tile combines its splits"),
)
TIMELINE = ("first_stage", "last_stage", "loop_done", "end")


def summarize(stamps: Sequence[int]) -> dict:
    """Per-phase medians and maxima (us), and the time line of the blocks, from the kernel's flat
    buffer stamps[BLOCKS][SLOTS]. A block counts when its start, its end and its first mark are
    stamped; a phase counts in the blocks that stamped both of its marks."""
    if len(stamps) != BLOCKS * SLOTS:
        raise ValueError(
            f"a decode trace holds {BLOCKS * SLOTS} stamps, got {len(stamps)}: the build and "
            "decode_phases.py disagree"
        )
    blocks = []
    for b in range(BLOCKS):
        row = stamps[b * SLOTS : (b + 1) * SLOTS]
        if row[TIMER_START] > 0 and row[TIMER_END] >= row[TIMER_START] and row[0] > 0:
            blocks.append(row)
    rates = []
    for row in blocks:
        last = max(row[i] for i in range(len(MARKS)))
        if row[TIMER_END] > row[TIMER_START] and last > row[0]:
            rates.append((last - row[0]) / (row[TIMER_END] - row[TIMER_START]))
    ghz = median_or_none(rates)
    if not blocks or not ghz:
        return {"blocks": len(blocks), "clock_ghz": ghz, "phases": {}, "timeline": {}}
    t0 = min(row[TIMER_START] for row in blocks)

    def at(row, mark: str) -> float | None:
        """A mark's time (us from the first block's start), None where the block did not stamp it."""
        if mark == "end":
            return (row[TIMER_END] - t0) / 1000
        cycles = row[MARKS.index(mark)]
        return None if cycles <= 0 else (row[TIMER_START] - t0 + (cycles - row[0]) / ghz) / 1000

    samples: dict[str, list[float]] = {name: [] for name, *_ in PHASES}
    for row in blocks:
        for name, start, end, _ in PHASES:
            a, z = at(row, start), at(row, end)
            if a is None or z is None:
                continue
            if name == "per_stage":
                if row[STAGES] > 1:
                    samples[name].append((z - a) / (row[STAGES] - 1))
            else:
                samples[name].append(z - a)
    latest = max(blocks, key=lambda row: row[TIMER_END])
    timeline = {}
    for mark in TIMELINE:
        times = [t for t in (at(row, mark) for row in blocks) if t is not None]
        timeline[mark] = {"median_us": median_or_none(times), "latest_us": max(times, default=None)}
    return {
        "blocks": len(blocks),
        "combining_blocks": sum(1 for row in blocks if row[COMBINER]),
        "sms": len({row[SM] for row in blocks}),
        "stages_median": median_or_none([row[STAGES] for row in blocks]),
        "clock_ghz": ghz,
        "phases": {
            name: {
                "median_us": median_or_none(values),
                "max_us": max(values, default=None),
                "n": len(values),
            }
            for name, values in samples.items()
        },
        "timeline": timeline,
        "latest_block": {mark: at(latest, mark) for mark in (*MARKS, "end")},
    }


def format_table(summary: dict) -> list[str]:
    described = {name: what for name, _, _, what in PHASES}
    lines = [f"  {'phase':<12} {'median us':>10} {'max us':>8} {'blocks':>6}  what"]
    for name, fig in summary["phases"].items():
        cells = f"{trace_cell(fig['median_us']):>10} {trace_cell(fig['max_us']):>8} {fig['n']:>6}"
        lines.append(f"  {name:<12} {cells}  {described[name]}")
    lines.append(
        f"  {'time line':<12} {'median us':>10} {'latest':>8}  (from the first block's start)"
    )
    for mark, fig in summary["timeline"].items():
        lines.append(
            f"  {mark:<12} {trace_cell(fig['median_us']):>10} {trace_cell(fig['latest_us']):>8}"
        )
    return lines


def tail_us(summary: dict) -> float | None:
    """From the latest block's loop end to its end: what the last block pays after its keys."""
    block = summary.get("latest_block") or {}
    if block.get("loop_done") is None or block.get("end") is None:
        return None
    return block["end"] - block["loop_done"]


def decode_call(case, x, block_size: int | None):
    """Our decode on the case's inputs; with block_size, on the same contents in a paged cache
    (phases.run_workload traces it)."""
    from ..bench.baselines import our_call
    from ..bench.target_measure import paged_decode_call

    if block_size is None:
        return our_call(case, x)
    return paged_decode_call(x, block_size, 1, x.cache_seqlens, causal=case.causal)
