"""`python -m flashmoe_science phases dec-...`: the decode's phase trace read block by block, its
agreement with the kernel's slot numbers, and the command around it. (The trace itself needs a
GPU: the device run of the command is the GPU check.)"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from flashmoe_science.pipeline import exitcodes, paths
from flashmoe_science.pipeline.build import unit as build
from flashmoe_science.pipeline.cases import parse_case_arg
from flashmoe_science.pipeline.tools import decode_phases, phases

KERNEL = paths.REPO_ROOT / "csrc" / "flash_decode_kernel.cuh"
GHZ = 2.0  # cycles per ns in the synthetic traces
CASE = "dec-bf16-d128-h32kv8-b4-q1-k8192"


def test_the_slot_numbers_are_the_kernels():
    """decode_phases.py reads the buffer by the kernel's constants and mark order: a change on one
    side alone would read phases from the wrong slots."""
    source = KERNEL.read_text()
    constants = re.search(r"constexpr int kBlocks = (\d+), kSlots = (\d+);", source)
    assert constants, "decode_trace's constants moved; update this test and decode_phases.py"
    assert tuple(map(int, constants.groups())) == (decode_phases.BLOCKS, decode_phases.SLOTS)
    marks = re.search(r"enum Mark \{([^}]*)\}", source).group(1)
    camel = ["k" + "".join(w.title() for w in m.split("_")) for m in decode_phases.MARKS]
    assert [m.strip() for m in marks.split(",")] == camel
    slots = re.search(
        r"enum Slot \{ kTimerStart = (\d+), kTimerEnd, kSm, kCombiner, kStages \}", source
    )
    assert slots and int(slots.group(1)) == decode_phases.TIMER_START == len(decode_phases.MARKS)
    assert (decode_phases.TIMER_END, decode_phases.SM) == (8, 9)
    assert (decode_phases.COMBINER, decode_phases.STAGES) == (10, 11)
    assert decode_phases.STAGES < decode_phases.SLOTS


def test_every_stamp_of_the_kernel_is_compiled_only_with_the_define():
    """Without FLASHMOE_PHASE_TRACE the decode's SASS must be the untraced one: each use of the
    trace in the kernel sits inside FLASHMOE_PHASE(...)."""
    source = KERNEL.read_text()
    body = source[source.index("struct DecodeTraits") :]
    assert body.count("decode_trace::") >= 7
    outside = without_phase_statements(body)
    assert "decode_trace::" not in outside, [
        line for line in outside.splitlines() if "decode_trace::" in line
    ]


def without_phase_statements(source: str) -> str:
    """The source less every FLASHMOE_PHASE(...) statement (parentheses matched)."""
    out, i = [], 0
    while (start := source.find("FLASHMOE_PHASE(", i)) >= 0:
        out.append(source[i:start])
        depth, j = 0, start + len("FLASHMOE_PHASE")
        while True:
            depth += {"(": 1, ")": -1}.get(source[j], 0)
            j += 1
            if depth == 0:
                break
        i = j
    return "".join(out) + source[i:]


class Trace:
    """A synthetic stamps buffer: marks in cycles at GHZ from each block's clock start, the
    timer in ns."""

    def __init__(self):
        self.stamps = [0] * (decode_phases.BLOCKS * decode_phases.SLOTS)

    def block(self, b, start_ns, durations, stages=4, combiner=None, sm=None):
        """Marks in order from `start_ns`, each `durations[i]` cycles after the one before
        (`per_stage` x (stages - 1) for the main loop); durations stop early for a block that
        returned before the last marks. Returns the end (ns)."""
        row = self.stamps[b * decode_phases.SLOTS : (b + 1) * decode_phases.SLOTS]
        clock = 1_000 + 7 * b
        row[0] = clock
        for i, cycles in enumerate(durations, start=1):
            clock += cycles * ((stages - 1) if decode_phases.MARKS[i] == "last_stage" else 1)
            row[i] = clock
        end_ns = start_ns + (clock - row[0]) / GHZ
        row[decode_phases.TIMER_START] = start_ns
        row[decode_phases.TIMER_END] = int(end_ns)
        row[decode_phases.SM] = b if sm is None else sm
        row[decode_phases.COMBINER] = int(bool(combiner))
        row[decode_phases.STAGES] = stages
        self.stamps[b * decode_phases.SLOTS : (b + 1) * decode_phases.SLOTS] = row
        return end_ns


# prologue, per stage, last stage, reduce, publish, combine (cycles)
SPLIT = [8000, 2000, 1000, 2000, 1000, 4000]


def two_tiles():
    """Two tiles of two splits: blocks 1 and 3 combine (the full marks), 0 and 2 return after
    their arrival; block 3 starts last and ends last."""
    trace = Trace()
    for b, start in enumerate((1_000_000, 1_000_000, 1_000_000, 1_002_000)):
        last = b % 2 == 1
        trace.block(b, start, SPLIT if last else SPLIT[:-1], combiner=last)
    return trace


def test_the_summary_gives_each_phase_and_the_time_line_in_microseconds():
    summary = decode_phases.summarize(two_tiles().stamps)
    assert summary["blocks"] == 4 and summary["combining_blocks"] == 2 and summary["sms"] == 4
    assert summary["clock_ghz"] == pytest.approx(GHZ, rel=1e-3)
    assert summary["stages_median"] == 4
    for (name, *_), cycles in zip(decode_phases.PHASES, SPLIT, strict=True):
        assert summary["phases"][name]["median_us"] == pytest.approx(cycles / GHZ / 1000), name
    assert summary["phases"]["combine"]["n"] == 2  # only the blocks that combined
    assert summary["phases"]["publish"]["n"] == 4
    # the time line, from the first block's start: block 3 started 2 us late
    to_loop_end = (SPLIT[0] + 3 * SPLIT[1] + SPLIT[2]) / GHZ / 1000
    assert summary["timeline"]["loop_done"]["median_us"] == pytest.approx(to_loop_end)
    assert summary["timeline"]["loop_done"]["latest_us"] == pytest.approx(2 + to_loop_end)
    latest = summary["latest_block"]
    assert latest["end"] == pytest.approx(2 + (sum(SPLIT) + 2 * SPLIT[1]) / GHZ / 1000, abs=1e-3)
    tail = (SPLIT[3] + SPLIT[4] + SPLIT[5]) / GHZ / 1000
    assert decode_phases.tail_us(summary) == pytest.approx(tail, abs=1e-3)


def test_a_launch_without_splits_has_no_publish_or_combine():
    trace = Trace()
    for b in range(3):
        trace.block(b, 5_000 + 100 * b, SPLIT[:4], stages=8)  # returns after its own output
    summary = decode_phases.summarize(trace.stamps)
    assert summary["combining_blocks"] == 0 and summary["stages_median"] == 8
    assert summary["phases"]["publish"] == {"median_us": None, "max_us": None, "n": 0}
    assert summary["phases"]["combine"]["n"] == 0
    assert summary["phases"]["reduce"]["median_us"] == pytest.approx(SPLIT[3] / GHZ / 1000)
    table = "\n".join(decode_phases.format_table(summary))
    assert "publish" in table and " - " in table and "time line" in table


def test_a_block_that_read_one_stage_has_no_loop_rate_and_unstamped_blocks_are_left_out():
    trace = Trace()
    trace.block(0, 1_000, SPLIT[:4], stages=1)
    trace.stamps[decode_phases.SLOTS + decode_phases.TIMER_START] = 500  # started, never ended
    summary = decode_phases.summarize(trace.stamps)
    assert summary["blocks"] == 1
    assert summary["phases"]["per_stage"]["n"] == 0


def test_buffers_of_another_build_are_refused_in_one_line():
    with pytest.raises(ValueError) as info:
        decode_phases.summarize([0] * 10)
    assert "the build and decode_phases.py disagree" in str(info.value)
    assert "\n" not in str(info.value)


def test_an_empty_trace_has_no_phases():
    assert decode_phases.summarize(Trace().stamps)["phases"] == {}


@pytest.mark.parametrize(
    "argv",
    [
        ["fwd-bf16-d128-h16-b32-s512-full", "--block-size", "64"],  # not a decode case
        [CASE, "--block-size", "48"],  # not a power of two
        [CASE, "--block-size", "8"],  # below 16
    ],
)
def test_a_block_size_the_paged_decode_cannot_take_is_a_usage_error(argv, capsys):
    assert phases.main(argv) == exitcodes.USAGE
    out = capsys.readouterr().out
    assert out.startswith("phases: --block-size") and "e.g. --block-size 64" in out
    assert len(out.strip().splitlines()) == 1


def traced(monkeypatch, tmp_path, trace, kernels=("flash_decode_paged_kernel",)):
    calls = []

    def fake_run(command, env):
        calls.append((command, env["FLASHMOE_BUILD_DEFINES"]))
        doc = {"ours_ms": 0.06, "sdpa_default_ms": 0.066, "sdpa_missing": None}
        doc |= {"kernels": list(kernels), "stamps": trace.stamps}
        Path(command[command.index("--json") + 1]).write_text(json.dumps(doc))
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(build, "ensure_built_for", lambda command, defines: tmp_path / "lib.so")
    monkeypatch.setattr(phases, "_workload", fake_run)
    monkeypatch.setattr(phases, "_gpu_name", lambda: "NVIDIA H100 80GB HBM3")
    return calls


def test_a_traced_paged_run_prints_the_table_and_writes_its_record(monkeypatch, tmp_path, capsys):
    """The command around the decode's workload: the traced build, --block-size passed on to the
    workload's process, the summary, the lines printed and the record (the GPU stood in for)."""
    calls = traced(monkeypatch, tmp_path, two_tiles())
    case = parse_case_arg("phases", CASE)
    record = tmp_path / f"phases-{case.id}-page64.json"
    assert phases.run_decode(case, record, 64) == exitcodes.OK
    command, defines = calls[0]
    assert defines == phases.DEFINE and "--workload" in command
    assert command[command.index("--block-size") + 1] == "64"
    out = capsys.readouterr().out
    assert "paged in 64-key blocks" in out and "4 blocks on 4 SMs, 2 of them combined" in out
    assert "SDPA default 66.0 us (1.100x" in out and "`bench` gives the ratio of record" in out
    for name, *_ in decode_phases.PHASES:
        assert name in out
    assert "the latest block's tail" in out
    doc = json.loads(record.read_text())
    assert doc["case"] == case.id and doc["block_size"] == 64 and doc["blocks"] == 4
    assert doc["tail_us"] == pytest.approx(decode_phases.tail_us(doc))


def test_a_run_where_no_decode_block_was_traced_says_what_to_use_instead(
    monkeypatch, tmp_path, capsys
):
    traced(monkeypatch, tmp_path, Trace(), kernels=("flash_fwd_kernel",))
    case = parse_case_arg("phases", CASE)
    record = tmp_path / "phases.json"
    assert phases.run_decode(case, record, None) == exitcodes.GATE_FAILED
    out = capsys.readouterr().out
    assert "no decode block" in out and "flash_fwd_kernel" in out
    assert f"profile {case.id}" in out and not record.exists()


def test_main_sends_a_decode_case_to_the_decode_trace(monkeypatch, tmp_path):
    import torch

    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(phases, "run_decode", lambda case, path, size: seen.append((path, size)))
    monkeypatch.setattr(phases, "run", lambda case, path: seen.append((path, "fwd")))
    phases.main([CASE, "--block-size", "128", "--output", str(tmp_path)])
    phases.main([CASE, "--output", str(tmp_path)])
    assert seen == [
        (tmp_path / f"phases-{CASE}-page128.json", 128),
        (tmp_path / f"phases-{CASE}.json", None),
    ]


@pytest.mark.parametrize("block_size", [None, 16])
def test_the_workload_records_one_traced_call_after_a_flush(monkeypatch, tmp_path, block_size):
    """The workload's process (the GPU stood in for by CPU tensors and a fake library): it resets
    the decode's buffer, flushes L2, runs the case once (paged with --block-size), and writes the
    buffer with the untraced timings."""
    import torch

    from flashmoe_science.pipeline import cases
    from flashmoe_science.pipeline.bench import baselines

    events = []

    class Library:
        def decode_trace_reset(self):
            events.append("reset")

        def decode_trace_dump(self):
            events.append("dump")
            return torch.arange(decode_phases.BLOCKS * decode_phases.SLOTS)

    calls = []

    def fake_decode(q, k, v, cache_seqlens=None, causal=True, block_table=None, **options):
        calls.append(block_table)
        events.append("call")
        return q

    monkeypatch.setattr(baselines.ops(), "load_library", lambda: None)
    monkeypatch.setattr(baselines.ops(), "flash_attention_decode", fake_decode)
    monkeypatch.setattr(torch.ops, "flashmoe_science", Library(), raising=False)
    real_inputs = cases.make_inputs
    monkeypatch.setattr(cases, "make_inputs", lambda case, device: real_inputs(case, "cpu"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(phases, "_time_ms", lambda fn: (fn(), 0.05)[1])
    monkeypatch.setattr(phases, "_kernels_of", lambda fn: ["flash_decode_kernel"])
    monkeypatch.setattr(phases, "_flush_l2", lambda: events.append("flush"))
    out = tmp_path / "trace.json"
    case = "dec-bf16-d128-h32kv8-b1-q1-k1024"
    assert phases.run_workload(case, out, block_size) == exitcodes.OK
    assert events[-4:] == ["reset", "flush", "call", "dump"]
    assert (calls[-1] is None) == (block_size is None)
    if block_size:
        assert calls[-1].dtype == torch.int32 and calls[-1].shape == (1, 1024 // block_size)
    doc = json.loads(out.read_text())
    assert doc["stamps"] == list(range(decode_phases.BLOCKS * decode_phases.SLOTS))
    assert doc["ours_ms"] == 0.05 and doc["kernels"] == ["flash_decode_kernel"]
    assert "spans" not in doc
