"""A gate is only real if a planted bug makes it fail. Each test wraps the real operator with a bug
and shows which gate catches it, and that the failure report says what a kernel engineer needs."""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import planted_process_env
from softmax_model import online_softmax

from flashmoe_science.pipeline.cases import parse_case_id
from flashmoe_science.pipeline.gates import forward as gates
from flashmoe_science.pipeline.gates import matrix
from flashmoe_science.pipeline.paths import REPO_ROOT

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
BASE = parse_case_id("fwd-fp16-d64-h8kv2-b2-s129-causal")


def planted(bug):
    def fn(case, q, k, v, seqlens, scale):
        return bug(case, q, k, v, seqlens, scale)

    return fn


def honest(case, q, k, v, seqlens, scale):
    return gates.call_api(case, q, k, v, seqlens, scale)


@pytest.mark.parametrize("device", DEVICES)
def test_honest_operator_passes(device):
    assert gates.check_case(BASE, device).passed


@pytest.mark.parametrize("device", DEVICES)
def test_error_of_0_02_passes_gate1_and_fails_gate2(device):
    def perturb(*args):
        out, lse = honest(*args)
        return out + 0.02, lse

    result = gates.check_case(BASE, device, planted(perturb))
    assert result.max_diff < gates.GATE1_MAX_DIFF  # gate 1 alone would let it through
    assert any(f.startswith("gate 2") for f in result.failures)
    assert not any(f.startswith("gate 1") for f in result.failures)


@pytest.mark.parametrize("device", DEVICES)
def test_large_error_fails_gate1(device):
    def perturb(*args):
        out, lse = honest(*args)
        return out + 0.25, lse

    result = gates.check_case(BASE, device, planted(perturb))
    assert any(f.startswith("gate 1") for f in result.failures)


@pytest.mark.parametrize("device", DEVICES)
def test_dropped_causal_mask_fails(device):
    def no_mask(case, q, k, v, seqlens, scale):
        return honest(dataclasses.replace(case, causal=False), q, k, v, seqlens, scale)

    result = gates.check_case(BASE, device, planted(no_mask))
    assert any(f.startswith("gate 1") for f in result.failures)
    assert any(f.startswith("gate 2") for f in result.failures)


@pytest.mark.parametrize("device", DEVICES)
def test_wrong_scale_fails(device):
    def wrong_scale(case, q, k, v, seqlens, scale):
        return honest(case, q, k, v, seqlens, scale * 1.05)

    result = gates.check_case(BASE, device, planted(wrong_scale))
    assert any(f.startswith("gate 2") for f in result.failures)
    assert any(f.startswith("log-sum-exp") for f in result.failures)


@pytest.mark.parametrize("device", DEVICES)
def test_nan_output_is_caught(device):
    def nan_row(*args):
        out, lse = honest(*args)
        out = out.clone()
        out[0, 0, -1, 0] = float("nan")
        return out, lse

    result = gates.check_case(BASE, device, planted(nan_row))
    assert result.nonfinite == 1 and not result.passed


@pytest.mark.parametrize("device", DEVICES)
def test_unwritten_output_element_is_caught(device):
    """An output a kernel allocates and leaves one element of unwritten fails: inside the gate's
    call every fresh tensor is NaN (gates.poisoned_outputs), whatever the allocator held before."""

    def one_element_unwritten(*args):
        out, lse = honest(*args)
        lazy = torch.empty_like(out)
        lazy.view(-1)[1:] = out.reshape(-1)[1:]
        return lazy, lse

    result = gates.check_case(BASE, device, planted(one_element_unwritten))
    assert result.nonfinite == 1 and not result.passed
    assert any("1 NaN/Inf output elements" in f for f in result.failures)


@pytest.mark.parametrize("was_on", [False, True])
def test_poisoned_outputs_fills_fresh_tensors_and_restores_the_settings(was_on):
    torch.use_deterministic_algorithms(was_on)
    try:
        with gates.poisoned_outputs():
            assert torch.empty(7).isnan().all()
            assert torch.empty(3, dtype=torch.bfloat16).isnan().all()
            assert torch.are_deterministic_algorithms_enabled()
        assert torch.are_deterministic_algorithms_enabled() is was_on
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.utils.deterministic.fill_uninitialized_memory  # PyTorch's default, kept
    finally:
        torch.use_deterministic_algorithms(False)


POISON_WITHOUT_INDUCTOR = """
import sys, torch
from flashmoe_science.pipeline.gates import forward as gates
with gates.poisoned_outputs():
    assert torch.empty(5).isnan().all() and torch.are_deterministic_algorithms_enabled()
assert not torch.are_deterministic_algorithms_enabled()
print(sorted(name for name in sys.modules if name.startswith("torch._inductor")))
"""


def test_poisoned_outputs_imports_no_inductor():
    """A gate's own process (a planted bug's, a bisect step's) poisons its outputs without
    importing torch._inductor, which torch.use_deterministic_algorithms does for its config: 1.4 s
    of each such process, for compiled code no gate runs."""
    done = subprocess.run(
        [sys.executable, "-c", POISON_WITHOUT_INDUCTOR],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[-2] == "[]"


@pytest.mark.parametrize("device", DEVICES)
def test_nondeterminism_is_caught(device):
    calls = []

    def flaky(*args):
        out, lse = honest(*args)
        calls.append(1)
        return (out + 1e-3 * (len(calls) - 1)), lse

    result = gates.check_case(BASE, device, planted(flaky))
    assert not result.deterministic and not result.passed


def test_failure_report_locates_an_error_that_grows_with_the_query_index():
    """The split-K bug the user chased for days: an error that grows along the query rows."""

    def growing(case, q, k, v, seqlens, scale):
        out, lse = honest(case, q, k, v, seqlens, scale)
        rows = torch.arange(case.seqlen_q, dtype=torch.float32).view(1, 1, -1, 1) / case.seqlen_q
        return (out.float() + 0.2 * rows).to(out.dtype), lse

    result = gates.check_case(BASE, "cpu", planted(growing))
    assert not result.passed
    report = gates.format_failure(BASE, result)
    assert BASE.id in report and "seed" in report
    assert "B=2 Hq=8 Hkv=2 Sq=129 Sk=129 D=64 dtype=fp16 causal=True" in report
    assert f"query row {BASE.seqlen_q - 1}" in report  # the worst element sits on the last row
    first, last = result.row_profile[0][2], result.row_profile[-1][2]
    assert last > 5 * first  # the profile shows the growth
    assert f"nox -s test -- -k '{BASE.id}-cpu'" in report


@pytest.mark.parametrize("backwards", [False, True], ids=["forwards", "backwards"])
def test_a_skipped_output_rescale_passes_normal_scores_and_fails_ramped_ones(backwards):
    """With N(0, 1) inputs the running max settles in the first key block a kernel visits, so a
    kernel that never rescales its output passes every normal case: the -rising and -falling
    cases (whichever way the kernel walks) are what catch it."""

    def attention(rescale_output):
        def fn(case, q, k, v, seqlens, scale):
            return online_softmax(
                q, k, v, case.causal, scale, backwards=backwards, rescale_output=rescale_output
            )

        return fn

    normal = parse_case_id("fwd-fp16-d64-h4kv2-b1-s320-full")
    ramped = dataclasses.replace(normal, scores="falling" if backwards else "rising")
    for case in (normal, ramped, dataclasses.replace(ramped, causal=True)):
        assert gates.check_case(case, "cpu", attention(True)).passed, case.id
    assert gates.check_case(normal, "cpu", attention(False)).passed  # the blind spot
    for case in (ramped, dataclasses.replace(ramped, causal=True)):
        result = gates.check_case(case, "cpu", attention(False))
        assert any(f.startswith("gate 1") for f in result.failures), case.id


# ---- v's head dim differing from q's and k's, planted into the CPU implementation ------------

DV_PLANT_SCRIPT = """
import json, sys
from flashmoe_science import ops
from flashmoe_science.pipeline.gates import forward as gates, matrix, paged, varlen
device = sys.argv[1]
results = {}
for c in [*matrix.gate_cases("cpu"), *varlen.varlen_cases("cpu"), *paged.paged_cases("cpu")]:
    if c.head_dim != 192:
        continue
    if isinstance(c, varlen.VarlenCase):
        results[c.id] = varlen.check_varlen_case(c, device).failures
    elif isinstance(c, paged.PagedCase):
        results[c.id] = paged.check_paged_case(c, device).failures
    else:
        results[c.id] = gates.check_case(c, device).failures
print(json.dumps({"planted": ops.planted_bug(), "results": results}))
"""


@pytest.mark.slow
def test_planted_v_read_at_the_qk_width_fails_the_dv_gates_and_only_them(run_planted):
    """Build the unit with -DFLASHMOE_PLANT_BUG=13 (each KV head's V found at K's offset, the Q/K
    width, as one offset shared by K and V would) and run the CPU tier's cases of q and k of head
    dim 192: every case with v of 128 (prefill, split-KV, decode, varlen, paged) fails a gate,
    every case with v of 192 passes (the bug needs Dv != Dqk)."""
    results = run_planted(13, DV_PLANT_SCRIPT, "cpu")["results"]
    split = {case_id: f for case_id, f in results.items() if "-d192v128-" in case_id}
    same = {case_id: f for case_id, f in results.items() if "-d192-" in case_id}
    assert len(split) == len(same) >= 8 and len(split) + len(same) == len(results)
    assert {case_id.split("-")[0] for case_id in split} == {"fwd", "dec", "varlen", "paged"}
    for case_id, failures in split.items():
        assert any("gate 1" in f or "gate 2" in f for f in failures), (case_id, failures)
    assert not any(same.values()), {k: f for k, f in same.items() if f}


# ---- head dims padded onto a wider CUDA tile, planted into the mma.sync kernels -----------------

PADDED_PLANT_SCRIPT = """
import json, sys
from flashmoe_science import ops
from flashmoe_science.pipeline.cases import parse_case_id
from flashmoe_science.pipeline.gates import backward as grad_gates, forward as gates
results = {}
for case_id in sys.argv[2:]:
    case = parse_case_id(case_id)
    check = grad_gates.check_case if case.kind == "backward" else gates.check_case
    results[case_id] = check(case, sys.argv[1]).failures
print(json.dumps({"planted": ops.planted_bug(), "results": results}))
"""
# bug -> (what it plants, cases that must fail a gate, cases that must pass: the same kernels where
# the bug changes nothing). The forward cases force mma.sync configurations (1, 2, 4), which every
# padded head dim runs; 14 needs a head dim below its tile, 15 v's below q's and k's.
PADDED_PLANTS = {
    14: (
        "q and k copied at the tile's width, their tails not zeroed",
        (
            "fwd-bf16-d80-h8kv2-b2-s65-full-cfg4",
            "fwd-fp16-d96-h8kv1-b2-s127-causal-cfg2",
            "fwd-bf16-d96-h8-b2-s128-full-cfg1",
        ),
        ("fwd-bf16-d128-h8kv2-b2-s65-full-cfg4", "fwd-fp16-d192v128-h8kv1-b2-s127-causal-cfg2"),
    ),
    15: (
        "the backward's delta summed over q's and k's width",
        ("bwd-bf16-d192v128-h8kv2-b2-s65-full", "bwd-fp16-d192v128-h8-b2-s128-causal"),
        ("bwd-bf16-d96-h8kv2-b2-s65-full", "bwd-bf16-d192-h8kv2-b2-s65-full"),
    ),
}


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.parametrize(
    "bug", sorted(PADDED_PLANTS), ids=[name for name, _, _ in PADDED_PLANTS.values()]
)
def test_planted_padded_head_dim_bug_fails_its_gates_and_only_them(bug, check_plant_split):
    """Build the unit with a planted padded-tile bug (-DFLASHMOE_PLANT_BUG=14 or 15): every case
    whose head dims the bug touches fails a gate, and the same kernels at head dims it cannot
    touch (the tile's own width; v's equal to q's) pass."""
    name, failing, passing = PADDED_PLANTS[bug]
    check_plant_split(bug, PADDED_PLANT_SCRIPT, "cuda", failing, passing, name)


def test_the_padded_plants_cases_are_padded_where_they_must_fail():
    """Plant 14's failing cases have q's head dim below its tile, its passing ones not; plant 15's
    failing cases have v's head dim below q's, its passing ones not."""
    from flashmoe_science import _loader

    def parsed(case_ids):
        return [parse_case_id(case_id) for case_id in case_ids]

    _, failing, passing = PADDED_PLANTS[14]
    assert all(
        _loader.tile_head_dim(c.head_dim, c.value_head_dim) > c.head_dim for c in parsed(failing)
    )
    assert all(
        _loader.tile_head_dim(c.head_dim, c.value_head_dim) == c.head_dim for c in parsed(passing)
    )
    assert all(c.config in (1, 2, 4) for c in parsed((*failing, *passing)))
    _, failing, passing = PADDED_PLANTS[15]
    assert all(c.value_head_dim < c.head_dim and c.kind == "backward" for c in parsed(failing))
    assert all(c.value_head_dim == c.head_dim for c in parsed(passing))


# ---- the sm_90a (wgmma) kernel's own failure modes, planted into its build ---------------------

SM90A_PLANT_SCRIPT = """
import json, sys
from flashmoe_science import ops
from flashmoe_science.pipeline.gates import forward as gates
from flashmoe_science.pipeline.cases import parse_case_id
cases = [parse_case_id(case_id) for case_id in sys.argv[2:]]
print(json.dumps({"planted": ops.planted_bug(),
                  "results": {c.id: gates.check_case(c, sys.argv[1]).failures for c in cases}}))
"""
# All end in a partial key tile (1000 = 7 x 128 + 104 = 5 x 176 + 120): two math warpgroups with
# ping-pong at D=128, three in a round robin at D=64 (configuration 5), two with ping-pong at D=64
# (configuration 6), and 176-key tiles at D=128 (configuration 7).
SM90A_CASES = (
    "fwd-bf16-d128-h8kv2-b2-s1000-causal-cfg5",
    "fwd-fp16-d64-h8-b2-q257-k1000-full-cfg5",
    "fwd-bf16-d64-h8kv1-b2-s1000-causal-cfg6",
    "fwd-fp16-d128-h8kv2-b2-s1000-full-cfg7",
)
# The kernel walks the keys from the last block to the first: with -falling scores the running
# max keeps moving, by more than the factor its lazy rescale ignores (2^8; configuration 6's two
# warpgroups rescale without the lazy vote), block after block.
SM90A_RAMPED_CASES = (
    "fwd-bf16-d128-h8kv2-b2-s1000-full-cfg5-falling",
    "fwd-fp16-d64-h8-b2-q257-k1000-causal-cfg5-falling",
    "fwd-bf16-d64-h8-b2-s1000-full-cfg6-falling",
    "fwd-fp16-d128-h8-b2-s1000-full-cfg7-falling",
)
# Decode of many query rows with cache_seqlens on the wgmma kernels (matrix.MANY_ROW_DECODE), which
# copy K and V by cp.async there, as the host uses no TMA with cache lengths. Every sequence ends
# inside a 128-key (and a 176-key) tile (101, 299 and 300 keys), unmasked.
SM90A_CP_ASYNC_CASES = (
    "dec-fp16-d128-h48kv6-b3-q65-k300-full-cfg5-lens101_299_300",
    "dec-bf16-d64-h48kv6-b3-q65-k300-full-cfg6-lens101_299_300",
    "dec-bf16-d128-h48kv6-b3-q65-k300-full-cfg7-lens101_299_300",
)
SM90A_PLANTS = {
    9: ("a math warpgroup skips one mbarrier wait for its K tile", SM90A_CASES),
    10: ("K read with the wrong (64-byte) swizzle", SM90A_CASES),
    11: (
        "the last, partial key tile never copied (by TMA or by cp.async)",
        (*SM90A_CASES, *SM90A_CP_ASYNC_CASES),
    ),
    12: ("the output never rescaled when the running max moves", SM90A_RAMPED_CASES),
}


def _runs_config_5() -> bool:
    from flashmoe_science import ops

    return torch.cuda.is_available() and ops.config_supported(5, torch.cuda.get_device_capability())


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(
    not _runs_config_5(), reason="needs an sm_90a build on a compute capability 9.0 GPU"
)
@pytest.mark.parametrize(
    "bug", sorted(SM90A_PLANTS), ids=[name for name, _ in SM90A_PLANTS.values()]
)
def test_planted_sm90a_bug_fails_a_gate(bug, run_planted):
    """Build the unit with a planted wgmma-kernel bug (-DFLASHMOE_PLANT_BUG=9 to 12) and show
    the forward gates catch it on every config-5, config-6 and config-7 case named for it."""
    name, case_ids = SM90A_PLANTS[bug]
    result = run_planted(bug, SM90A_PLANT_SCRIPT, "cuda", *case_ids)
    assert sorted(result["results"]) == sorted(case_ids)
    for case_id, failures in result["results"].items():
        assert failures, f"planted bug {bug} ({name}) passed the gates on {case_id}"


def test_the_partial_tile_plant_meets_both_copy_paths():
    """Plant 11 has a variant per copy path of each wgmma configuration's producer: its case list
    holds prefill cases forced onto configurations 5, 6 and 7 (TMA) and a decode gate case forced
    onto each with cache_seqlens (cp.async), whose sequences end inside a key tile."""
    cases = [parse_case_id(case_id) for case_id in SM90A_PLANTS[11][1]]
    gpu_ids = {c.id for c in matrix.gate_cases("gpu")}
    for config in (5, 6, 7):
        assert any(c.config == config and c.cache_seqlens is None for c in cases)
        cp_async = [c for c in cases if c.cache_seqlens and c.config == config]
        assert cp_async and all(c.kind == "decode" for c in cp_async)
        assert all(n % 128 and n % 176 for c in cp_async for n in c.cache_seqlens)
        assert {c.id for c in cp_async} <= gpu_ids  # honest, it passes its gate


def test_each_sm90a_plant_fails_a_case_of_each_wgmma_configuration():
    """Every wgmma plant (9 to 12) is shown to fail config-5, config-6 and config-7 cases; those of
    6 and 7 are cases of the GPU gate matrix, at the head dim each gates (matrix.gated_head_dims:
    D=64 and D=128)."""
    gpu_ids = {c.id for c in matrix.gate_cases("gpu")}
    for _, case_ids in SM90A_PLANTS.values():
        cases = [parse_case_id(case_id) for case_id in case_ids]
        assert {c.config for c in cases} == {5, 6, 7}
        for config in (6, 7):
            mine = [c for c in cases if c.config == config]
            assert all(c.head_dim in matrix.gated_head_dims(config) for c in mine)
            assert {c.id for c in mine} <= gpu_ids


# The wgmma kernel past head dim 128 (configurations 5 to 7 one kernel there): plant 16 issues P V
# as m64n128k16, so O's columns past 128 stay zero. It must fail every 192 and 256 case, forced
# onto each of 5, 6 and 7, and pass the same configuration at 128, where it changes nothing.
WIDE_SM90A_PLANT = (
    (
        "fwd-bf16-d256-h8kv1-b2-s1000-causal-cfg5",
        "fwd-fp16-d192-h8kv1-b2-s1000-full-cfg5",
        "fwd-fp16-d256-h8-b2-s257-causal-cfg6",
        "fwd-bf16-d192-h8kv2-b2-s1000-full-cfg7",
    ),
    ("fwd-bf16-d128-h8-b2-s1000-causal-cfg5", "fwd-fp16-d128-h8-b2-s1000-full-cfg5"),
)


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(
    not _runs_config_5(), reason="needs an sm_90a build on a compute capability 9.0 GPU"
)
def test_planted_narrow_pv_fails_the_wide_wgmma_gates_and_only_them(check_plant_split):
    """Build the unit with -DFLASHMOE_PLANT_BUG=16 (P V issued with N = 128 at head dims 192 and
    256): every wide case fails a gate, the 128 cases pass."""
    check_plant_split(16, SM90A_PLANT_SCRIPT, "cuda", *WIDE_SM90A_PLANT)


def test_the_wide_plants_cases_are_gate_cases_of_each_wgmma_configuration():
    """Plant 16's cases are GPU gate cases: the failing ones at 192 and 256 on 5, 6 and 7, the
    passing ones at 128."""
    failing, passing = WIDE_SM90A_PLANT
    gpu_ids = {c.id for c in matrix.gate_cases("gpu")}
    assert {*failing, *passing} <= gpu_ids
    wide = [parse_case_id(case_id) for case_id in failing]
    assert {c.config for c in wide} == {5, 6, 7} and {c.head_dim for c in wide} == {192, 256}
    assert all(parse_case_id(case_id).head_dim == 128 for case_id in passing)


# Plant 17 (P V reads K's buffers where v's 128 sits under q's and k's 192): the failing cases are
# (192, 128) on 5, 6 and 7 (one kernel) and its packed-batch and cp.async (many-row decode) paths;
# 192 with v's 192 and 128 run other kernels and pass.
DV_SM90A_PLANT = (
    (
        "fwd-fp16-d192v128-h8kv2-b2-s1000-full-cfg5",
        "fwd-bf16-d192v128-h8kv2-b2-s1000-causal-cfg5",
        "fwd-fp16-d192v128-h8-b2-s1000-causal-cfg6",
        "fwd-bf16-d192v128-h8kv1-b2-s1000-full-cfg7",
        "dec-fp16-d192v128-h48-b3-q65-k300-full-cfg5-lens0_1_101",
    ),
    ("fwd-fp16-d192-h8kv1-b2-s1000-causal-cfg5", "fwd-bf16-d128-h8-b2-s1000-causal-cfg5"),
)


def _check_plant(check_plant_split, bug: int, plant: tuple[tuple[str, ...], tuple[str, ...]]):
    check_plant_split(bug, SM90A_PLANT_SCRIPT, "cuda", *plant)


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(
    not _runs_config_5(), reason="needs an sm_90a build on a compute capability 9.0 GPU"
)
def test_planted_v_from_k_fails_the_narrow_v_wgmma_gates_and_only_them(check_plant_split):
    """Build the unit with -DFLASHMOE_PLANT_BUG=17 (P V reads K's buffers at v's 128 under q's and
    k's 192): every (192, 128) case fails a gate, the others pass."""
    _check_plant(check_plant_split, 17, DV_SM90A_PLANT)


def test_the_narrow_v_plants_cases_are_gate_cases():
    """Plant 17's cases are GPU gate cases, the failing ones (192, 128) on 5, 6 and 7."""
    failing, passing = DV_SM90A_PLANT
    assert {*failing, *passing} <= {c.id for c in matrix.gate_cases("gpu")}
    narrow = [parse_case_id(case_id) for case_id in failing]
    assert {c.config for c in narrow} == {5, 6, 7}
    assert {(c.head_dim, c.value_head_dim) for c in narrow} == {(192, 128)}


# Plant 18 (a padded tile's TMA boxes all at the first panel's columns): K's columns 64 to 127
# then hold its columns 0 to 63, not its own and zeros, which changes the scores of every padded
# case copied by TMA; the many-row decode (cache lengths: cp.async, no TMA) and the whole 128
# tile (one box for both panels) pass.
PADDED_SM90A_PLANT = (
    (
        "fwd-fp16-d96-h8kv2-b2-s1000-full-cfg5",
        "fwd-bf16-d96-h8kv2-b2-s1000-causal-cfg5",
        "fwd-bf16-d80-h8-b2-s1000-full-cfg5",
    ),
    ("dec-fp16-d96-h48-b3-q65-k300-full-cfg5-lens0_1_101", "fwd-bf16-d128-h8-b2-s1000-causal-cfg5"),
)


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(
    not _runs_config_5(), reason="needs an sm_90a build on a compute capability 9.0 GPU"
)
def test_planted_tile_wide_maps_fail_the_padded_wgmma_gates_and_only_them(check_plant_split):
    """With FLASHMOE_PLANT_BUG=18 (a padded tile's panels all copied from its first) every padded
    case copied by TMA fails a gate; the cp.async path and the whole tile pass."""
    _check_plant(check_plant_split, 18, PADDED_SM90A_PLANT)


def test_the_padded_plants_cases_are_gate_cases():
    """Plant 18's and 26's cases are GPU gate cases: the failing ones padded on configuration 5;
    plant 26's at 96, its controls at 80 (columns 80-95 zeros) and on the whole-tile extent."""
    for failing, passing in (PADDED_SM90A_PLANT, MMA96_PLANT):
        assert {*failing, *passing} <= {c.id for c in matrix.gate_cases("gpu")}
        padded = [parse_case_id(case_id) for case_id in failing]
        assert {c.config for c in padded} == {5}
        assert {(c.head_dim, c.value_head_dim) for c in padded} <= set(
            matrix.WGMMA_PADDED_HEAD_DIMS
        )
    failing, passing = MMA96_PLANT
    assert {parse_case_id(c).head_dim for c in failing} == {96}
    assert {(parse_case_id(c).head_dim, parse_case_id(c).value_head_dim) for c in passing} == {
        (80, 80),
        (128, 64),
    }


# Plant 26 (the padded tile's MMAs over 96 columns reading columns 96-111 in place of 80-95 in
# S's last step): every case at 96 on configuration 5 fails (dense, split, features); at 80,
# whose columns 80-95 are zeros, and at v's 64 under 128 (the whole tile's extent) they pass.
MMA96_PLANT = (
    (
        "fwd-bf16-d96-h8kv2-b2-s1000-causal-cfg5",
        "fwd-bf16-d96-h8kv2-b2-q113-k203-full-cfg5-cap5",
    ),
    ("fwd-bf16-d80-h8kv2-b2-s1000-causal-cfg5", "fwd-bf16-d128v64-h8kv1-b2-s1000-full-cfg5"),
)


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(
    not _runs_config_5(), reason="needs an sm_90a build on a compute capability 9.0 GPU"
)
def test_planted_short_reduction_fails_the_96_column_padded_tile_and_only_it(check_plant_split):
    """With FLASHMOE_PLANT_BUG=26 S's last step on the 96-column padded tile reads the wrong
    columns: every case at 96 fails a gate, and those at 80 and on the whole tile pass."""
    _check_plant(check_plant_split, 26, MMA96_PLANT)


# Plant 27 (the wgmma forward's plain instantiation leaves the sinks out of its rows' epilogue):
# sinks alone run that instantiation on configurations 5 to 7 (the padded and past-128 tiles
# too) and fail; with a window or a softcap they run the features instantiation, split KV folds
# them in the combine, and the mma.sync forward folds its own: those pass.
PLAIN_SINKS_SM90A_PLANT = (
    (
        "fwd-fp16-d128-h8kv1-b2-s1000-full-cfg5-sinks",
        "fwd-fp16-d64-h8kv1-b2-s1000-full-cfg6-sinks",
        "fwd-fp16-d128-h8kv1-b2-s1000-full-cfg7-sinks",
        "fwd-fp16-d96-h8-b2-s1000-full-cfg5-splits1-sinks",
        "fwd-fp16-d256-h8-b2-s1000-full-cfg5-splits1-sinks",
        "fwd-fp16-d192v128-h8-b2-s1000-full-cfg5-splits1-sinks",
    ),
    (
        "fwd-fp16-d64-h8kv2-b2-q113-k203-causal-cfg5-win210_0-sinks",
        "fwd-bf16-d128-h8kv1-b2-s1000-causal-cfg7-win16_0-cap50-sinks",
        "fwd-fp16-d256-h8kv1-b2-s1000-full-cfg5-splits3-sinks",
        "fwd-fp16-d128-h8kv1-b2-s1000-full-cfg1-sinks",
    ),
)


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(
    not _runs_config_5(), reason="needs an sm_90a build on a compute capability 9.0 GPU"
)
def test_planted_dropped_sinks_fail_the_plain_wgmma_gates_and_only_them(check_plant_split):
    """With FLASHMOE_PLANT_BUG=27 (the plain wgmma forward leaves the sinks out) every sinks-only
    case on configurations 5 to 7 fails a gate; the features kernel, split KV and mma.sync pass."""
    _check_plant(check_plant_split, 27, PLAIN_SINKS_SM90A_PLANT)


def test_the_plain_sinks_plants_cases_are_gate_cases():
    """Plant 27's cases are GPU gate cases: the failing ones sinks alone, unsplit, on 5 to 7."""
    failing, passing = PLAIN_SINKS_SM90A_PLANT
    assert {*failing, *passing} <= {c.id for c in matrix.gate_cases("gpu")}
    plain = [parse_case_id(case_id) for case_id in failing]
    assert {c.config for c in plain} == {5, 6, 7}
    for case in plain:
        assert case.sinks and case.softcap == 0 and case.window == (-1, -1), case.id
        assert case.num_splits in (0, 1), case.id


# ---- the planted-bug scripts themselves ------------------------------------------------------


@functools.cache
def plant_scripts() -> dict[str, str]:
    """Every module-level `*PLANT_SCRIPT` string of the test modules, by `module.NAME` (read when
    a test asks: parsing every test module cost each collecting process 0.4 s)."""
    scripts = {}
    for path in sorted(Path(__file__).parents[1].rglob("test_*.py")):
        for node in ast.parse(path.read_text()).body:
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
            ):
                for target in node.targets:
                    if isinstance(target, ast.Name) and target.id.endswith("PLANT_SCRIPT"):
                        scripts[f"{path.stem}.{target.id}"] = node.value.value
    return scripts


def test_plant_scripts_are_found():
    # decode, paged, varlen, backward and the sm_90a kernel each have one
    assert len(plant_scripts()) >= 5, sorted(plant_scripts())


# Runs each script's imports (argv[1]: JSON, name -> import lines) and prints what failed.
IMPORT_RUNNER = """
import json, sys
failed = {}
for name, lines in json.loads(sys.argv[1]).items():
    try:
        exec(lines, {})
    except Exception as exc:
        failed[name] = f"{type(exc).__name__}: {exc}"
print(json.dumps(failed))
"""


def test_plant_script_imports_resolve_in_their_process():
    """The imports of every plant script resolve in the process `run_planted` starts (its working
    directory and environment, not pytest's sys.path). Most scripts run only on a GPU, so without
    this a broken import shows up first on the GPU machine. One process tries them all (torch is
    imported once, not once a script), each script's imports on their own, and a planted broken
    one shows that a failure is seen."""
    imports = {
        name: "\n".join(
            ast.unparse(node)
            for node in ast.parse(script).body
            if isinstance(node, (ast.Import, ast.ImportFrom))
        )
        for name, script in plant_scripts().items()
    }
    assert all(imports.values()), [name for name, lines in imports.items() if not lines]
    imports["planted.BROKEN"] = "from flashmoe_science.pipeline.gates import no_such_module"
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_RUNNER, json.dumps(imports)],
        cwd=REPO_ROOT,
        env=planted_process_env(0, "cpu"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    failed = json.loads(done.stdout.strip().splitlines()[-1])
    assert list(failed) == ["planted.BROKEN"], failed


def test_a_plant_process_is_judged_by_its_verdict_and_its_own_errors(run_planted):
    """A gate script's process that aborts in the interpreter's finalization after printing its
    verdict is judged by the verdict (torch's shutdown aborted 2-3 of 20 such processes on an
    H100), while one that raises before it fails with its traceback."""
    aborts_at_exit = (
        "import atexit, json, os, sys\natexit.register(os.abort)\n"
        "print(json.dumps({'planted': 0, 'device': sys.argv[1]}))\n"
    )
    assert run_planted(0, aborts_at_exit, "cpu") == {"planted": 0, "device": "cpu"}
    with pytest.raises(AssertionError, match="ZeroDivisionError"):
        run_planted(0, "print(1 / 0)\n", "cpu")
