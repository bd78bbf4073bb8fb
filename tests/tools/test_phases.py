"""`python -m flashmoe_science phases`: the summary of a phase trace, its agreement with the kernel's
slot numbers, and the command's failures. (The trace itself needs an H100: the device run of the
command is the GPU check.)"""

from __future__ import annotations

import re

import pytest
import torch

from flashmoe_science.pipeline import cli, exitcodes, paths
from flashmoe_science.pipeline.cases import parse_case_arg
from flashmoe_science.pipeline.tools import phases

KERNEL = paths.REPO_ROOT / "csrc" / "flash_fwd_sm90_kernel.cuh"
GHZ = 2.0  # cycles per ns in the synthetic traces


def test_the_slot_numbers_are_the_kernels():
    """phases.py reads the buffers by the kernel's constants and mark order: a change on one side
    alone would read phases from the wrong slots."""
    source = KERNEL.read_text()
    constants = re.search(
        r"constexpr int kBlocks = (\d+), kRounds = (\d+), kSlots = (\d+), kPerWarpgroup = (\d+), "
        r"kMaxWarpgroups = (\d+);",
        source,
    )
    assert constants, "phase_trace's constants moved; update this test and phases.py together"
    assert tuple(map(int, constants.groups())) == (
        phases.BLOCKS,
        phases.ROUNDS,
        phases.SLOTS,
        phases.PER_WARPGROUP,
        phases.MAX_WARPGROUPS,
    )
    marks = re.search(r"enum Mark \{([^}]*)\}", source).group(1)
    names = [m.strip() for m in marks.split(",") if m.strip()]
    camel = ["k" + "".join(w.title() for w in m.split("_")) for m in phases.MARKS]
    assert [n.lower() for n in names] == [c.lower() for c in camel]
    assert "kKeyBlocks = kPerWarpgroup * kMaxWarpgroups" in source
    assert "kProducer = kKeyBlocks + kMaxWarpgroups" in source
    # every stamp of the kernel is compiled only with the define
    for line in source.splitlines():
        if re.search(r"phase_trace::(stamp|put|span)\(", line) and "__device__" not in line:
            assert "FLASHMOE_PHASE(" in line or line.strip().startswith("if (tracer)"), line


class Trace:
    """Synthetic buffers: stamps in cycles at GHZ, spans that say so."""

    def __init__(self):
        self.stamps = [0] * (phases.BLOCKS * phases.ROUNDS * phases.SLOTS)
        self.spans = [0] * (phases.BLOCKS * 4)

    def put(self, block, rnd, slot, value):
        self.stamps[(block * phases.ROUNDS + rnd) * phases.SLOTS + slot] = value

    def tile(self, block, rnd, wg, start, durations, key_blocks):
        """Marks from `start`, each phase lasting its duration (cycles); the loop's total is
        per-block duration x (key_blocks - 1)."""
        self.put(block, rnd, phases.KEY_BLOCKS + wg, key_blocks)
        t = start
        for i, mark in enumerate(phases.MARKS):
            if i:
                t += durations[i - 1] * ((key_blocks - 1) if mark == "loop_done" else 1)
            self.put(block, rnd, wg * phases.PER_WARPGROUP + i, t)
        return t

    def span(self, block, start_ns, end_ns):
        self.spans[4 * block : 4 * block + 4] = [
            start_ns,
            1,
            end_ns,
            1 + int((end_ns - start_ns) * GHZ),
        ]


# q_wait, first_k_wait, first_s, first_softmax, per_key_block, last_pv_issue, last_pv, output
# (cycles)
DURATIONS = [200, 40, 100, 160, 300, 25, 90, 400]


def two_blocks(rounds=3, key_blocks=4, gap=120):
    trace = Trace()
    for block in range(2):
        trace.span(block, 1_000, 1_000 + 50_000)
        t = 10
        for rnd in range(rounds):
            end = max(trace.tile(block, rnd, wg, t, DURATIONS, key_blocks) for wg in (0, 1))
            trace.put(block, rnd, phases.PRODUCER + 0, t)
            trace.put(block, rnd, phases.PRODUCER + 1, t + 30)
            trace.put(block, rnd, phases.PRODUCER + 2, t + 80)
            t = end + gap
    return trace


def test_the_summary_gives_each_phase_in_microseconds():
    summary = phases.summarize(two_blocks().stamps, two_blocks().spans)
    assert summary["clock_ghz"] == pytest.approx(GHZ, rel=1e-3)
    assert summary["tiles"] == 6 and summary["warpgroups"] == 2
    assert summary["key_blocks_median"] == 4
    got = {name: fig["median_us"] for name, fig in summary["phases"].items()}
    for (name, *_), cycles in zip(phases.PHASES, DURATIONS, strict=True):
        assert got[name] == pytest.approx(cycles / GHZ / 1000), name
    tile = sum(DURATIONS) + DURATIONS[4] * 2 + 120  # the loop ran 3 key blocks
    assert got["tile"] == pytest.approx(tile / GHZ / 1000)
    assert got["to_next_tile"] == pytest.approx(120 / GHZ / 1000)
    assert summary["phases"]["tile"]["n"] == 8  # 2 blocks x 2 warpgroups x 2 next tiles
    assert got["producer_q_free_wait"] == pytest.approx(30 / GHZ / 1000)
    assert got["producer_q_issue"] == pytest.approx(50 / GHZ / 1000)
    fixed = tile - DURATIONS[4] * 4
    assert phases.fixed_cost_us(summary) == pytest.approx(fixed / GHZ / 1000)
    assert summary["blocks_at_round_limit"] == 0


def test_a_tile_without_its_output_stamp_or_key_blocks_is_left_out():
    trace = two_blocks(rounds=1)
    trace.put(0, 0, 0 * phases.PER_WARPGROUP + phases.MARKS.index("output"), 0)  # still running
    trace.put(1, 0, phases.KEY_BLOCKS + 1, 0)  # no key blocks recorded
    summary = phases.summarize(trace.stamps, trace.spans)
    assert summary["phases"]["q_wait"]["n"] == 2  # of four (tile, warpgroup) pairs
    assert summary["phases"]["tile"]["n"] == 0  # one round: no next tile


def test_a_single_key_block_has_no_loop_rate_and_the_round_limit_is_reported():
    trace = two_blocks(rounds=phases.ROUNDS, key_blocks=1)
    summary = phases.summarize(trace.stamps, trace.spans)
    assert summary["phases"]["per_key_block"]["n"] == 0
    assert summary["phases"]["per_key_block"]["median_us"] is None
    assert phases.fixed_cost_us(summary) is None
    assert summary["blocks_at_round_limit"] == 2
    assert "-" in " ".join(phases.format_table(summary))


def test_buffers_of_another_build_are_refused_in_one_line():
    with pytest.raises(ValueError) as info:
        phases.summarize([0] * 10, [0] * 4)
    assert "the build and phases.py disagree" in str(info.value)
    assert "\n" not in str(info.value)


def test_the_table_names_every_phase():
    table = "\n".join(
        phases.format_table(phases.summarize(two_blocks().stamps, two_blocks().spans))
    )
    for name, *_ in phases.PHASES:
        assert name in table
    assert "producer: issuing Q's copy" in table


def test_a_bad_case_is_a_usage_error(capsys):
    assert phases.main(["fwd-nonsense"]) == exitcodes.USAGE
    assert capsys.readouterr().out.startswith("phases: ")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_without_a_gpu_it_says_so_and_what_to_do(capsys, tmp_path):
    code = phases.main(["fwd-bf16-d128-h16-b32-s512-full", "--output", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == exitcodes.ENV_BROKEN
    assert "no GPU" in out and "nvidia-smi" in out and len(out.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())


def test_the_command_is_registered():
    assert cli.COMMANDS["phases"][0] == "flashmoe_science.pipeline.tools.phases"
    assert "phases" in cli.usage()


def test_a_traced_run_prints_the_table_and_writes_its_record(monkeypatch, tmp_path, capsys):
    """The command around the workload: the traced build, the workload's process and its JSON,
    the summary, the lines printed and phases-CASE.json (the GPU parts stood in for)."""
    import json
    import subprocess
    from pathlib import Path

    from flashmoe_science.pipeline.build import unit as build

    trace = two_blocks()
    calls = []

    def fake_run(command, env):
        calls.append((command, env["FLASHMOE_BUILD_DEFINES"]))
        out = Path(command[command.index("--json") + 1])
        doc = {"ours_ms": 0.2, "sdpa_default_ms": 0.15, "sdpa_missing": None}
        doc |= {"kernels": ["flash_fwd_sm90_kernel"], "stamps": trace.stamps, "spans": trace.spans}
        out.write_text(json.dumps(doc))
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(build, "ensure_built_for", lambda command, defines: tmp_path / "lib.so")
    monkeypatch.setattr(phases, "_workload", fake_run)
    monkeypatch.setattr(phases, "_blocks", lambda summary: 2)
    monkeypatch.setattr(phases, "_gpu_name", lambda: "NVIDIA H100 80GB HBM3")
    case = parse_case_arg("phases", "fwd-bf16-d128-h16-b32-s512-full")
    record = tmp_path / f"phases-{case.id}.json"
    assert phases.run(case, record) == exitcodes.OK
    assert calls and calls[0][1] == phases.DEFINE and "--workload" in calls[0][0]
    out = capsys.readouterr().out
    assert out.count("building with") == 1  # each step said once
    assert "6 tiles, 2 math warpgroups" in out
    assert "(0.750x the traced kernel" in out  # SDPA default over ours, over as many tiles
    assert "`bench` gives the ratio of record" in out  # the trace's stamps slow our kernel
    assert "fixed cost" in out and "per_key_block" in out
    doc = json.loads(record.read_text())
    assert doc["case"] == case.id and doc["tiles"] == 6 and doc["gpu"].startswith("NVIDIA")
    assert doc["fixed_cost_us"] == pytest.approx(phases.fixed_cost_us(doc))


def test_a_run_where_no_wgmma_tile_ran_says_what_to_use_instead(monkeypatch, tmp_path, capsys):
    import json
    import subprocess
    from pathlib import Path

    from flashmoe_science.pipeline.build import unit as build

    empty = Trace()

    def fake_run(command, env):
        doc = {"ours_ms": 0.2, "sdpa_default_ms": None, "sdpa_missing": "x"}
        doc |= {"kernels": ["flash_fwd_kernel"], "stamps": empty.stamps, "spans": empty.spans}
        Path(command[command.index("--json") + 1]).write_text(json.dumps(doc))
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(build, "ensure_built_for", lambda command, defines: tmp_path / "lib.so")
    monkeypatch.setattr(phases, "_workload", fake_run)
    case = parse_case_arg("phases", "fwd-bf16-d64-h32-b32-s512-causal")
    record = tmp_path / "phases.json"
    assert phases.run(case, record) == exitcodes.GATE_FAILED
    out = capsys.readouterr().out
    assert "no wgmma forward tile ran" in out and "flash_fwd_kernel" in out
    assert f"profile {case.id}" in out and not record.exists()
