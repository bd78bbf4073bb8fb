"""The gradient gates: dq, dk and dv of flash_attention_forward against the closed-form backward,
over the forward's sequence-length matrix (CUDA) or a subset (CPU); planted backward bugs that the
gates must catch; the autograd contract (opcheck, torch.compile, decode refuses, bad input)."""

from __future__ import annotations

import math
import os

import pytest
import torch

from flashmoe_science import _loader as loader
from flashmoe_science.pipeline.cases import (
    Case,
    make_inputs,
    make_output_grad,
    make_sinks,
    parse_case_id,
)
from flashmoe_science.pipeline.gates import backward as grad_gates
from flashmoe_science.pipeline.gates import matrix
from flashmoe_science.pipeline.gates.forward import features

GPU_CASES = list(matrix.backward_cases("gpu"))
CPU_CASES = list(matrix.backward_cases("cpu"))


def _run(case: Case, device: str, record_gate) -> None:
    from flashmoe_science.pipeline.gates.matrix import rerun_fields

    result = grad_gates.check_case(case, device)
    reruns = rerun_fields(case, device)
    record_gate(case, result, "bwd", reruns, lambda: grad_gates.format_failure(case, result))


@pytest.mark.gate
@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: f"{c.id}-cpu")
def test_grad_gate_cpu(case, record_gate):
    _run(case, "cpu", record_gate)


@pytest.mark.gate
@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"{c.id}-cuda")
def test_grad_gate_cuda(case, record_gate, require_cuda_build):
    require_cuda_build(
        backward_config=case.config,
        head_dim=case.head_dim,
        head_dim_v=case.head_dim_v,
        case=case,
    )
    _run(case, "cuda", record_gate)


def test_matrix_covers_the_issue():
    """Every S of the forward's matrix, Sq != Sk both ways, GQA 1/4/8, causal both, both dtypes,
    every head dims pair (v's differing included), strided views, every backward configuration
    forced, deterministic calls."""
    from flashmoe_science.ops import BACKWARD_CONFIGS

    assert set(matrix.SEQLENS) <= {c.seqlen_q for c in GPU_CASES if c.seqlen_q == c.seqlen_k}
    # (v's 64 under 128 only forced, with the padded tiles)
    head_dims = {*matrix.HEAD_DIMS, *matrix.PADDED_FORCED_BACKWARD}
    assert {(c.head_dim, c.value_head_dim, c.dtype, c.causal) for c in GPU_CASES} == {
        (*d, t, m) for d in head_dims for t in ("fp16", "bf16") for m in (False, True)
    }
    expected = {(s, s) for s in matrix.SEQLENS} | set(matrix.UNEQUAL)
    for head_dims in matrix.HEAD_DIMS:  # the whole sequence matrix, and deterministic calls
        mine = [c for c in GPU_CASES if (c.head_dim, c.value_head_dim) == head_dims]
        assert {(c.seqlen_q, c.seqlen_k) for c in mine if not c.deterministic} >= expected
        assert any(c.deterministic for c in mine)
    for head_dims in matrix.NEW_HEAD_DIMS_CPU:  # and a few of each on the CPU
        assert 2 <= sum((c.head_dim, c.value_head_dim) == head_dims for c in CPU_CASES) <= 4
    assert any(c.seqlen_q < c.seqlen_k for c in GPU_CASES)
    assert any(c.seqlen_q > c.seqlen_k for c in GPU_CASES)
    assert {c.heads_q // c.heads_kv for c in GPU_CASES} == {1, 4, 8}
    assert any(c.layout == "bshd" for c in GPU_CASES)
    assert {c.config for c in GPU_CASES} == {0, *BACKWARD_CONFIGS}
    # past 128, configuration 1 (warps sharing keys) forced, on the forced configurations' shapes
    for head_dim, config in matrix.WIDE_FORCED_BACKWARD:
        forced = [c for c in GPU_CASES if c.head_dim == head_dim and c.config == config]
        assert {(c.seqlen_q, c.seqlen_k) for c in forced} == set(matrix.FORCED_PAIRS)
        assert {(c.dtype, c.causal) for c in forced} == {
            (t, m) for t in ("fp16", "bf16") for m in (False, True)
        }
    # the padded tiles on every backward configuration (3: the wgmma tile padded), both dtypes
    # and masks, one deterministic call of 3 each
    for dims in matrix.PADDED_FORCED_BACKWARD:
        forced = [c for c in GPU_CASES if c.config and (c.head_dim, c.value_head_dim) == dims]
        assert {c.config for c in forced} == set(matrix.PADDED_BACKWARD_CONFIGS)
        assert {(c.dtype, c.causal) for c in forced if c.config == 3} == {
            (t, m) for t in ("fp16", "bf16") for m in (False, True)
        }
        assert any(c.deterministic for c in forced if c.config == 3)
    # the wgmma backward past 128, forced on every forced shape, both dtypes and masks, with a
    # deterministic call and windows, softcap and sinks of each
    for dims in matrix.WGMMA_WIDE_FORCED_BACKWARD:
        forced = [c for c in GPU_CASES if c.config == 3 and (c.head_dim, c.value_head_dim) == dims]
        plain = [c for c in forced if not c.softcap]
        assert {(c.dtype, c.causal, c.seqlen_q, c.seqlen_k) for c in plain} == {
            (t, m, *pair)
            for t in ("fp16", "bf16")
            for m in (False, True)
            for pair in matrix.FORCED_PAIRS
        }
        assert any(c.deterministic for c in plain)
        featured = [c for c in forced if c.softcap]
        assert {c.causal for c in featured} == {False, True}
        assert all(c.sinks and c.window != (-1, -1) for c in featured)
        # configuration 2, which a Hopper card's automatic choice no longer runs there, forced
        mma_sync = [
            c for c in GPU_CASES if c.config == 2 and (c.head_dim, c.value_head_dim) == dims
        ]
        assert {(c.dtype, c.causal) for c in mma_sync} == {
            (t, m) for t in ("fp16", "bf16") for m in (False, True)
        }
    assert {c.head_dim for c in GPU_CASES if c.config} == {64, 80, 96, 128, 192, 256}
    assert any(c.deterministic for c in GPU_CASES) and any(c.deterministic for c in CPU_CASES)
    assert len({c.id for c in GPU_CASES}) == len(GPU_CASES)


@pytest.mark.parametrize("head_dim_v", [16, 24], ids=["Dv=D", "Dv!=D"])
def test_reference_is_autograd_of_the_attention(head_dim_v):
    """The closed-form reference equals PyTorch's autograd through the fp64 attention (rows that
    see no key included: Sq > Sk with a causal mask), v's head dim differing from q's and k's
    too."""
    from flashmoe_science.pipeline.gates.forward import attention_reference

    case = Case("backward", "bf16", 2, 4, 2, 23, 11, 16, True, head_dim_v=head_dim_v)
    q, k, v, _ = make_inputs(case, "cpu")
    dout = torch.randn((*q.shape[:-1], head_dim_v), dtype=torch.float64)
    qq, kk, vv = (t.double().requires_grad_() for t in (q, k, v))
    out, _ = attention_reference(qq, kk, vv, True, 0.25, compute_dtype=torch.float64)
    expected = torch.autograd.grad(out, (qq, kk, vv), dout)
    got = grad_gates.reference_grads(q, k, v, dout, True, 0.25)
    for g, e in zip(got, expected, strict=True):
        assert torch.allclose(g, e.nan_to_num(0), atol=1e-10)
    assert got[0][:, :, :12].abs().max() == 0  # the first 12 rows see no key: no gradient


def test_a_wrong_gradient_fails_a_gate():
    """Each gradient is gated on its own: doubling dv alone fails gate 1 and gate 2 on dv."""
    case = next(c for c in CPU_CASES if c.seqlen_q == 129 and not c.deterministic)

    def wrong(case, q, k, v, dout, scale):
        dq, dk, dv = grad_gates.call_api(case, q, k, v, dout, scale)
        return dq, dk, dv * 2

    result = grad_gates.check_case(case, "cpu", wrong)
    assert not result.passed
    assert all("dv" in f for f in result.failures), result.failures
    assert any(f.startswith("gate 1: dv") for f in result.failures)


def test_the_sink_gradients_floor_is_what_the_stored_output_costs():
    """dsinks sums every row's -P_sink * delta, and a backward that reads the forward's stored
    output takes delta from it rounded to the input dtype. On this case that rounding alone moves
    dsinks past 2x PyTorch's error (PyTorch takes delta from fp32 probabilities): the reference
    computed from the rounded output fails gate 2 without the stored output's floor and passes with
    it, and a sink gradient three bounds off still fails."""
    case = parse_case_id("bwd-bf16-d128-h2kv1-b1-s1000-causal-win4_0-cap1-sinks")
    seed = case.seed()
    q, k, v, _ = make_inputs(case, "cpu", seed)
    dout = make_output_grad(case, "cpu")
    scale = 1 / math.sqrt(case.head_dim)
    options = {**features(case), "sinks": make_sinks(case, "cpu")}
    ref = grad_gates.reference_grads(q, k, v, dout, True, scale, **options)
    stored = grad_gates.reference_grads(
        q, k, v, dout, True, scale, stored_dtype=torch.bfloat16, **options
    )
    pt = grad_gates.pytorch_lowp_grads(q, k, v, dout, True, scale, **options)

    def gate(dsinks, floor_from=stored):
        got = (*stored[:3], dsinks)
        result = grad_gates.evaluate(case, "cpu", seed, got, ref, pt, [], floor_from)
        return result.grads["dsinks"]

    without = gate(stored[3], floor_from=None)
    assert without.max_diff > without.bound  # the bound before the stored output's term
    assert gate(stored[3]).max_diff <= gate(stored[3]).bound
    off = gate(ref[3] + 3 * gate(ref[3]).bound)
    assert off.max_diff > off.bound


def test_nondeterminism_fails_a_deterministic_case():
    case = next(c for c in CPU_CASES if c.deterministic)
    calls = []

    def jitter(case, q, k, v, dout, scale):
        dq, dk, dv = grad_gates.call_api(case, q, k, v, dout, scale)
        calls.append(1)
        return dq, dk, dv + (len(calls) % 2) * 1e-3

    result = grad_gates.check_case(case, "cpu", jitter)
    assert result.deterministic is False and not result.passed
    assert "gradients differ over 3 calls" in " ".join(result.failures)
    # the CPU twin has no shared accumulator (3 calls); a GPU's atomics get 10
    assert len(calls) == grad_gates.determinism_repeats("cpu") == 3
    assert grad_gates.determinism_repeats("cuda") == 10


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_unwritten_gradient_element_is_caught(device, request):
    """A backward whose dv leaves one element unwritten fails the gate: inside the gate's call
    every fresh tensor is NaN (gates.poisoned_outputs), whatever the allocator held before. (The
    previous way, filling the caching allocator's free blocks with NaN, missed exactly this: dv
    landed on a block a temporary of the backward had already written.)"""
    if device == "cuda":
        request.getfixturevalue("require_cuda_build")()
    case = Case("backward", "bf16", 1, 8, 2, 65, 65, 64, False)

    def one_element_unwritten(case, q, k, v, dout, scale):
        dq, dk, dv = grad_gates.call_api(case, q, k, v, dout, scale)
        lazy = torch.empty_like(dv)
        lazy.view(-1)[1:] = dv.reshape(-1)[1:]
        return dq, dk, lazy

    result = grad_gates.check_case(case, device, one_element_unwritten)
    assert result.grads["dv"].nonfinite == 1
    assert any("dv: 1 NaN/Inf elements" in f for f in result.failures)
    assert grad_gates.check_case(case, device).passed  # the real backward writes every element


PLANT_SCRIPT = """
import json, sys
from flashmoe_science import ops
from flashmoe_science.pipeline.gates import backward as grad_gates
from flashmoe_science.pipeline.cases import parse_case_id
results = {}
for case_id in sys.argv[2:]:
    result = grad_gates.check_case(parse_case_id(case_id), sys.argv[1])
    results[case_id] = result.failures
print(json.dumps({"planted": ops.planted_bug(), "results": results}))
"""

# Each planted backward bug (csrc/attention_params.h) and cases that must expose it: dS without the
# softmax scale (dq and dk off); dK and dV of a GQA group from its first head only; dQ without the
# last key block (more than one block of keys).
PLANTS = {
    4: ("bwd-bf16-d64-h8-b2-s129-full",),
    5: ("bwd-bf16-d64-h8kv2-b2-s129-full",),
    6: ("bwd-fp16-d64-h8-b2-q17-k250-full",),
}
# Each bug is planted in every dK/dV kernel. On CUDA the automatic choice may be the wgmma kernel
# (an H100), so the mma.sync kernel is shown catching it too, forced (CUDA tile configurations are
# refused on CPU tensors, so these run on CUDA only).
CUDA_PLANT_CASES = {
    4: ("bwd-bf16-d128-h8-b2-s129-full-cfg2", "bwd-bf16-d192v128-h8-b2-s1000-causal-cfg3"),
    5: ("bwd-bf16-d128-h8kv2-b2-s129-full-cfg2", "bwd-bf16-d256-h8kv2-b2-s65-full-cfg3"),
    6: ("bwd-fp16-d128-h8-b2-q17-k250-full-cfg2", "bwd-fp16-d256-h8-b2-s1000-full-cfg3"),
}


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("bug", sorted(PLANTS))
def test_planted_backward_bug_fails_a_gate(device, bug, run_planted):
    """Build the unit with a planted backward bug (-DFLASHMOE_PLANT_BUG=N) and show the gradient
    gates catch it on every case named for it."""
    case_ids = PLANTS[bug] + (CUDA_PLANT_CASES[bug] if device == "cuda" else ())
    result = run_planted(bug, PLANT_SCRIPT, device, *case_ids)
    assert sorted(result["results"]) == sorted(case_ids)
    for case_id, failures in result["results"].items():
        assert failures, f"planted bug {bug} passed the gates on {case_id}"


# Plant 19 (the wgmma backward's padded tile copying q, k, v and dO at the tile's width): every
# padded case forced onto configuration 3 fails, deterministic (its dK/dV kernel without dQ's
# atomics) included; the whole tile on 3 and the padded head dims on the mma.sync configuration 2
# pass.
PADDED_SM90A_BACKWARD_PLANT = (
    (
        "bwd-fp16-d96-h8kv1-b2-s257-full-cfg3",
        "bwd-bf16-d96-h8kv1-b1-q2048-k2047-causal-cfg3-det",
        "bwd-bf16-d80-h8kv2-b2-q113-k203-full-cfg3",
        "bwd-fp16-d128v64-h8-b2-s1000-causal-cfg3",
    ),
    ("bwd-bf16-d128-h8-b2-s1000-full-cfg3", "bwd-bf16-d96-h8kv2-b2-s65-causal-cfg2"),
)


@pytest.mark.slow
@pytest.mark.gpu
def test_planted_tile_wide_copies_fail_the_padded_wgmma_backward_and_only_it(
    check_plant_split, monkeypatch
):
    """With FLASHMOE_PLANT_BUG=19 every padded case on configuration 3 fails a gradient gate; the
    whole 128 tile and the mma.sync path at the same head dims pass. The copies it plants are
    Sm90BwdTraits' (FLASHMOE_BWD_WS=0 where the warp-specialized tile is built: that tile copies
    Q and dO by TMA from maps of their own widths, and its K and V columns past the head dim meet
    only Q's and dO's zeros)."""
    monkeypatch.setenv("FLASHMOE_BWD_WS", "0")
    _check_wgmma_backward_plant(check_plant_split, 19, PADDED_SM90A_BACKWARD_PLANT)


def _check_wgmma_backward_plant(check_plant_split, bug: int, plant) -> None:
    """Plant `bug` fails a gradient gate on every case of plant[0] and on none of plant[1] (the
    wgmma backward, configuration 3: an sm_90a build on a 9.0 GPU, else a skip)."""
    from flashmoe_science import ops

    if not ops.backward_config_supported(3, torch.cuda.get_device_capability()):
        pytest.skip("needs an sm_90a build on a compute capability 9.0 GPU")
    check_plant_split(bug, PLANT_SCRIPT, "cuda", *plant)


def test_the_padded_backward_plants_cases_are_gate_cases():
    """Plant 19's cases are GPU gate cases: the failing ones padded on configuration 3."""
    from flashmoe_science.pipeline.cases import parse_case_id

    failing, passing = PADDED_SM90A_BACKWARD_PLANT
    ids = {c.id for c in matrix.backward_cases("gpu")}
    assert {*failing, *passing} <= ids
    padded = [parse_case_id(case_id) for case_id in failing]
    assert {c.config for c in padded} == {3} and any(c.deterministic for c in padded)
    assert all((c.head_dim, c.value_head_dim) != (128, 128) for c in padded)


# Plant 25 (the wgmma backward past 128 reading Q's first panel for every tile of dK^T): every case
# forced onto configuration 3 at 192, 256 and v's 128 under 192 fails, deterministic included; the
# same head dims on the mma.sync configuration 2 (forced: a Hopper card's automatic choice there is
# 3) and the 128 tile on 3 pass.
WIDE_SM90A_BACKWARD_PLANT = (
    (
        "bwd-fp16-d192-h8-b2-s1000-full-cfg3",
        "bwd-bf16-d256-h8kv2-b2-q113-k203-causal-cfg3-det",
        "bwd-bf16-d192v128-h8kv1-b1-q2048-k2047-causal-cfg3",
    ),
    ("bwd-bf16-d128-h8-b2-s1000-full-cfg3", "bwd-bf16-d192-h8-b2-s1000-causal-cfg2"),
)


@pytest.mark.slow
@pytest.mark.gpu
def test_planted_first_panel_fails_the_wide_wgmma_backward_and_only_it(check_plant_split):
    """With FLASHMOE_PLANT_BUG=25 every wide case on configuration 3 fails a gradient gate; the
    128 tile on 3 and configuration 2 at 192 pass."""
    _check_wgmma_backward_plant(check_plant_split, 25, WIDE_SM90A_BACKWARD_PLANT)


@pytest.mark.slow
@pytest.mark.gpu
def test_planted_early_read_fails_the_wide_backward_by_tma_and_only_it(check_plant_split):
    """With FLASHMOE_PLANT_BUG=29 the wide kernel's steps (bwd v5.9, FLASHMOE_BWD_WIDE_TMA) read
    their Q and dO buffers before the copies land, every step (no wait, the copies issued after the
    products): every wide case on configuration 3 fails a gradient gate; the 128 tile on 3 and
    configuration 2 at 192 pass. The plant's copies still complete before their buffers are armed
    again: its first form waited on the other phase, re-armed barriers mid-phase and let blocks end
    with copies in flight, a hang rather than a failure (benches/notes/backward.md, "bwd v5.9's
    landing call")."""
    if not (loader.switch_on("FLASHMOE_BWD_WIDE_TMA") and loader.switch_on("FLASHMOE_BWD_WS")):
        pytest.skip(
            "the stage's build has FLASHMOE_BWD_WIDE_TMA (or FLASHMOE_BWD_WS, whose maps it uses) "
            "off: the wide kernel's copies are cp.async"
        )
    _check_wgmma_backward_plant(check_plant_split, 29, WIDE_SM90A_BACKWARD_PLANT)


def test_the_backward_plants_cases_are_gate_cases():
    """Plant 25's cases are GPU gate cases, its failing ones forced onto configuration 3 past 128
    (each wide kernel: 192, 256, v's 128 under 192), a deterministic one among them; plants 4 to 6
    reach the wide kernel too, on gate cases of its own."""
    from flashmoe_science.pipeline.cases import parse_case_id

    failing, passing = WIDE_SM90A_BACKWARD_PLANT
    ids = {c.id for c in matrix.backward_cases("gpu")}
    cuda_cases = {c for cases in CUDA_PLANT_CASES.values() for c in cases if c.endswith("cfg3")}
    assert len(cuda_cases) == 3 and {*failing, *passing, *cuda_cases} <= ids
    wide = [parse_case_id(case_id) for case_id in failing]
    assert {c.config for c in wide} == {3} and any(c.deterministic for c in wide)
    assert {(c.head_dim, c.value_head_dim) for c in wide} == set(matrix.WGMMA_WIDE_FORCED_BACKWARD)
    for cases in CUDA_PLANT_CASES.values():
        assert any(parse_case_id(c).config == 3 and parse_case_id(c).head_dim > 128 for c in cases)


# bwd v6 (configuration 3's 128 tile warp-specialized, deterministic=True's dQ added in order by
# its writer warp) is the default; the tile before it (Sm90BwdTraits) runs under FLASHMOE_BWD_WS=0
# in the environment, and these gates keep it correct on every GPU run, on the stage's own build.
# Every case forced onto configuration 3 at 64, 128 and the head dims padded onto 128,
# deterministic ones included (bit-identical over repeated calls), and one in eight of the
# automatic ones there (windows, softcap, sinks, GQA, odd lengths among them).
def _warp_specialized_cases() -> tuple[str, ...]:
    tile = [c for c in GPU_CASES if c.config in (0, 3) and max(c.head_dim, c.value_head_dim) <= 128]
    forced = [c.id for c in tile if c.config == 3]
    automatic = [c.id for c in tile if c.config == 0]
    return (*forced, *automatic[::8])


WS_CASES = _warp_specialized_cases()


def _assert_every_case_passed(out: dict, cases: tuple[str, ...]) -> None:
    """WS_SCRIPT's results hold exactly `cases`, and none failed a gate."""
    assert sorted(out["results"]) == sorted(cases)
    failed = {case_id: failures for case_id, failures in out["results"].items() if failures}
    assert not failed, failed


WS_SCRIPT = """
import json, os, sys
os.environ["FLASHMOE_BWD_WS"] = os.environ.get("WS_UNDER_TEST", "1")
import torch
from torch.profiler import ProfilerActivity, profile
from flashmoe_science import flash_attention_forward, ops
from flashmoe_science.pipeline.cases import parse_case_id
from flashmoe_science.pipeline.gates import backward as grad_gates
kernels = {}
for d in (64, 96, 128):
    q, k, v = (torch.randn(1, 2, 200, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        flash_attention_forward(q, k, v, True).sum().backward()
        torch.cuda.synchronize()
    kernels[d] = sorted({e.name for e in prof.events() if "flash_bwd_sm90_kernel" in e.name})
results = {}
for case_id in sys.argv[2:]:
    results[case_id] = grad_gates.check_case(parse_case_id(case_id), sys.argv[1]).failures
print(json.dumps({"planted": ops.planted_bug(), "kernels": kernels, "results": results}))
"""
# Plant 6 (dQ without the last key block: the writer warp's reduce-adds, ordered or not) must fail
# them too.
WS_PLANT_CASES = (
    "bwd-fp16-d64-h8-b2-s1000-full-cfg3",
    "bwd-bf16-d128-h8-b2-s1000-full-cfg3",
    "bwd-bf16-d64-h8kv2-b2-s1000-causal-det",
    "bwd-bf16-d96-h8kv1-b1-q2048-k2047-causal-cfg3-det",
)


@pytest.mark.slow
@pytest.mark.gpu
def test_the_tile_before_the_warp_specialized_one_passes_its_gradient_gates(
    run_planted, check_plant_split, monkeypatch
):
    """FLASHMOE_BWD_WS=0 in the environment runs Sm90BwdTraits, the tile before bwd v6, at 64, 96
    (padded) and 128 on the stage's own build: it passes WS_CASES' gradient gates; without it the
    same build runs the warp-specialized kernels there. Plant 6 fails WS_PLANT_CASES' on either
    tile. About 130 gates and one plant process a tile: the price of a fallback that cannot rot."""
    from flashmoe_science import ops

    if not ops.backward_config_supported(3, torch.cuda.get_device_capability()):
        pytest.skip("needs an sm_90a build on a compute capability 9.0 GPU")
    if "FLASHMOE_BWD_WS=0" in os.environ.get(loader.DEFINES_VAR, ""):
        pytest.skip("this build leaves the warp-specialized tile out (-DFLASHMOE_BWD_WS=0)")
    monkeypatch.setenv("WS_UNDER_TEST", "1")
    on = run_planted(0, WS_SCRIPT, "cuda")["kernels"]
    assert all(any("Sm90BwdWsTraits" in name for name in names) for names in on.values()), on
    check_plant_split(6, WS_SCRIPT, "cuda", WS_PLANT_CASES, (), "dQ without the last key block")
    monkeypatch.setenv("WS_UNDER_TEST", "0")
    out = run_planted(0, WS_SCRIPT, "cuda", *WS_CASES)
    for head_dim, names in out["kernels"].items():
        assert names and not any("Sm90BwdWsTraits" in name for name in names), (head_dim, names)
    _assert_every_case_passed(out, WS_CASES)
    check_plant_split(6, WS_SCRIPT, "cuda", WS_PLANT_CASES, (), "dQ without the last key block")


# bwd v7c (FLASHMOE_BWD_WS_MMA96): the padded warp-specialized tile's
# products over 96 columns where q's, k's and v's head dims are at most 96. Plant 28 (S^T's last
# step reads columns 96-111 in place of 80-95) fails the gates at 96, default and deterministic;
# at 80 (columns 80-95 zeros) and on the whole 128 tile they pass.
MMA96_BACKWARD_PLANT = (
    ("bwd-bf16-d96-h8kv1-b2-s255-causal", "bwd-fp16-d96-h8kv2-b2-s1000-causal-det"),
    (
        "bwd-bf16-d80-h8kv1-b2-s255-causal",
        "bwd-fp16-d80-h8-b2-s129-full-det",
        "bwd-bf16-d128-h8-b2-s1000-full-cfg3",
    ),
)


def test_the_96_column_backward_plants_cases_are_gate_cases():
    """Plant 28's cases are GPU gate cases of the warp-specialized tile: its failing ones at 96
    (one deterministic), its passing ones at 80 and 128."""
    failing, passing = MMA96_BACKWARD_PLANT
    assert {*failing, *passing} <= set(WS_CASES)
    assert {parse_case_id(c).head_dim for c in failing} == {96}
    assert any(parse_case_id(c).deterministic for c in failing)
    assert {parse_case_id(c).head_dim for c in passing} == {80, 128}


@pytest.mark.slow
@pytest.mark.gpu
def test_planted_short_reduction_fails_the_96_column_backward_and_only_it(check_plant_split):
    """With FLASHMOE_PLANT_BUG=28 S^T's last step on the 96-column products reads the wrong
    columns: the cases at 96 fail a gradient gate, those at 80 and 128 pass."""
    if not loader.switch_on("FLASHMOE_BWD_WS_MMA96"):
        pytest.skip("the stage's build has FLASHMOE_BWD_WS_MMA96 off: no 96-column backward")
    _check_wgmma_backward_plant(check_plant_split, 28, MMA96_BACKWARD_PLANT)


# bwd v7b (FLASHMOE_BWD_CAUSAL_LPT): the tile's causal calls on a 1-D grid,
# key blocks longest first in sections of (batch, KV head) pairs. The gate cases' pairs (4 to 16)
# all fit one section of the L2 budget's, so FLASHMOE_BWD_LPT_PAIRS=3 makes sections end short
# of them: full sections, then a short last one.
LPT_CASES = tuple(
    case_id
    for case_id in WS_CASES
    if (c := parse_case_id(case_id)).causal
    and not c.deterministic
    and c.window == (-1, -1)
    and c.batch * c.heads_kv > 3
)


@pytest.mark.slow
@pytest.mark.gpu
def test_causal_longest_first_sections_pass_the_gradient_gates(run_planted, monkeypatch):
    """With the longest-first grid built in, the causal gate cases on the warp-specialized tile
    pass with sections of 3 pairs (a short last section on each), as they do on one."""
    from flashmoe_science import ops

    if not ops.backward_config_supported(3, torch.cuda.get_device_capability()):
        pytest.skip("needs an sm_90a build on a compute capability 9.0 GPU")
    if not loader.switch_on("FLASHMOE_BWD_CAUSAL_LPT"):
        pytest.skip("the stage's build has FLASHMOE_BWD_CAUSAL_LPT off: no longest-first grid")
    assert len(LPT_CASES) >= 8
    monkeypatch.setenv("FLASHMOE_BWD_LPT_PAIRS", "3")
    out = run_planted(0, WS_SCRIPT, "cuda", *LPT_CASES)
    _assert_every_case_passed(out, LPT_CASES)


def test_the_longest_first_cases_end_their_sections_short():
    """LPT_CASES are causal gate cases of the tile at 64, 128 and padded, whose pairs (4, 8, 16)
    are no multiple of the 3 a section forced: each grid ends on a short section; some walk many
    key blocks (the order within a section)."""
    cases = [parse_case_id(case_id) for case_id in LPT_CASES]
    assert len(cases) >= 8 and all(c.causal and not c.deterministic for c in cases)
    assert {c.batch * c.heads_kv for c in cases} == {4, 8, 16}
    assert {c.head_dim for c in cases} >= {64, 80, 96, 128}
    assert max(math.ceil(c.seqlen_k / 128) for c in cases) >= 8


# bwd v5.13 (FLASHMOE_BWD_WIDE_LPT): the wide kernel's causal calls on the same longest-first grid
# (64-key blocks). Its automatic causal gate cases (192, 256, v's 128 under 192) whose pairs (4, 8,
# 16) are no multiple of 3 and that walk at least 4 key blocks, one dtype a head dim in turn.
def _wide_longest_first_cases() -> tuple[str, ...]:
    wide = [
        c
        for c in GPU_CASES
        if c.config == 0
        and (c.head_dim, c.value_head_dim) in matrix.WGMMA_WIDE_FORCED_BACKWARD
        and c.causal
        and not c.deterministic
        and c.window == (-1, -1)
        and not c.softcap
        and c.batch * c.heads_kv > 3
        and c.batch * c.heads_kv % 3
        and math.ceil(c.seqlen_k / 64) >= 4
    ]
    dims = sorted({(c.head_dim, c.value_head_dim) for c in wide})
    return tuple(
        c.id
        for c in wide
        if c.dtype == ("bf16", "fp16")[dims.index((c.head_dim, c.value_head_dim)) % 2]
    )


WIDE_LPT_CASES = _wide_longest_first_cases()


@pytest.mark.slow
@pytest.mark.gpu
def test_the_wide_kernels_longest_first_sections_pass_the_gradient_gates(run_planted, monkeypatch):
    """With the wide kernel's longest-first grid built in, WIDE_LPT_CASES pass their gradient gates
    with sections of 3 pairs (a short last section on each): a wrong key block or pair from the
    1-D grid's index leaves some dK, dV or dQ rows unwritten or written twice."""
    from flashmoe_science import ops

    if not ops.backward_config_supported(3, torch.cuda.get_device_capability()):
        pytest.skip("needs an sm_90a build on a compute capability 9.0 GPU")
    switches = ("FLASHMOE_BWD_WIDE_LPT", "FLASHMOE_BWD_CAUSAL_LPT", "FLASHMOE_BWD_WS")
    if not all(loader.switch_on(name) for name in switches):
        pytest.skip(
            f"the stage's build lacks one of {', '.join(switches)}: the wide kernel's 2-D grid"
        )
    monkeypatch.setenv("FLASHMOE_BWD_LPT_PAIRS", "3")
    out = run_planted(0, WS_SCRIPT, "cuda", *WIDE_LPT_CASES)
    _assert_every_case_passed(out, WIDE_LPT_CASES)


def test_the_wide_longest_first_cases_end_their_sections_short():
    """WIDE_LPT_CASES reach each wide kernel (192, 256, v's 128 under 192) in one dtype or the
    other, with pairs that 3 does not divide (each grid ends on a short section), Sq != Sk, and
    walks of many key blocks (the order within a section)."""
    cases = [parse_case_id(case_id) for case_id in WIDE_LPT_CASES]
    assert 12 <= len(cases) <= 40 and all(c.causal and not c.deterministic for c in cases)
    assert {(c.head_dim, c.value_head_dim) for c in cases} == set(matrix.WGMMA_WIDE_FORCED_BACKWARD)
    assert {c.batch * c.heads_kv for c in cases} == {4, 8, 16}
    assert any(c.seqlen_q != c.seqlen_k for c in cases)
    assert max(math.ceil(c.seqlen_k / 64) for c in cases) >= 16


# bwd v5.11 (FLASHMOE_BWD_DET_ROTATE): deterministic=True without a mask walks each key block's
# query blocks from its own start (its launch position's share of them) and adds dQ in the order
# the blocks reach a query block. The gate matrix's unmasked deterministic cases have at most two
# key blocks; these add many, more key blocks than query blocks (blocks that share a start: the
# ties of the order), fewer, a walk that wraps, GQA, both dtypes and the tile's head dims.
ROTATED_CASES = (
    "bwd-bf16-d64-h8-b2-s2048-full-det",
    "bwd-bf16-d64-h4kv1-b1-q333-k4096-full-det",
    "bwd-fp16-d128-h4kv2-b2-q1000-k1900-full-det",
    "bwd-bf16-d128-h2-b1-q3000-k700-full-det",
    "bwd-fp16-d96-h4-b1-q700-k3001-full-det",
)


@pytest.mark.slow
@pytest.mark.gpu
def test_the_rotated_deterministic_walk_passes_the_gradient_gates(run_planted):
    """With the rotated walk built in, ROTATED_CASES pass their gradient gates, each one's
    deterministic calls bit-identical: a wrong place in the order races (calls differ) or waits
    for a count that never comes (the stage's time limit names the test)."""
    from flashmoe_science import ops

    if not ops.backward_config_supported(3, torch.cuda.get_device_capability()):
        pytest.skip("needs an sm_90a build on a compute capability 9.0 GPU")
    if not loader.switch_on("FLASHMOE_BWD_DET_ROTATE"):
        pytest.skip("the stage's build has FLASHMOE_BWD_DET_ROTATE off: no rotated walk")
    out = run_planted(0, WS_SCRIPT, "cuda", *ROTATED_CASES)
    _assert_every_case_passed(out, ROTATED_CASES)


def test_the_rotated_cases_reach_the_orders_ties_and_wraps():
    """ROTATED_CASES run the warp-specialized tile deterministic without a mask, with several key
    blocks (128 keys each) against several query blocks (128 rows at d=64, 64 above): more key
    blocks than query blocks (shared starts), fewer (a wrapping walk), equal, GQA, both dtypes,
    and no more key blocks than an H100 or H200 runs at once (the rotation's condition)."""
    cases = [parse_case_id(case_id) for case_id in ROTATED_CASES]
    assert all(c.deterministic and not c.causal and c.window == (-1, -1) for c in cases)
    shape = [
        (math.ceil(c.seqlen_k / 128), math.ceil(c.seqlen_q / (128 if c.head_dim == 64 else 64)))
        for c in cases
    ]
    assert all(2 <= n <= 132 for n, _ in shape)
    assert any(n > m for n, m in shape) and any(n < m for n, m in shape)
    assert any(n == m for n, m in shape) and max(n for n, _ in shape) >= 16
    assert any(c.heads_kv < c.heads_q for c in cases) and {c.dtype for c in cases} == {
        "fp16",
        "bf16",
    }
    assert {c.head_dim for c in cases} >= {64, 96, 128}
    assert not set(ROTATED_CASES) & set(WS_CASES)


def test_the_warp_specialized_cases_cover_its_tiles_and_features():
    """WS_CASES reach each kernel of the warp-specialized tile (64, 128, padded onto 128, v's 64
    under 128; the default and deterministic=True), both dtypes, causal both, GQA, windows,
    softcap and sinks, lengths past one tile."""
    cases = [parse_case_id(case_id) for case_id in WS_CASES]
    assert 100 <= len(cases) <= 200
    assert {(c.head_dim, c.value_head_dim) for c in cases} >= {
        (64, 64),
        (128, 128),
        (80, 80),
        (96, 96),
        (128, 64),
    }
    assert {c.dtype for c in cases} == {"fp16", "bf16"} and {c.causal for c in cases} == {
        True,
        False,
    }
    assert any(c.heads_kv < c.heads_q for c in cases) and any(c.seqlen_k > 128 for c in cases)
    assert any(c.window != (-1, -1) for c in cases) and any(c.softcap > 0 for c in cases)
    assert any(c.sinks for c in cases)
    for deterministic in (False, True):
        assert {c.head_dim for c in cases if c.deterministic == deterministic} >= {64, 96, 128}
    assert set(WS_PLANT_CASES) <= set(WS_CASES)
    assert all(parse_case_id(c).seqlen_k > 128 for c in WS_PLANT_CASES)  # more than one key block


# ---- the autograd contract --------------------------------------------------------------------


def _small(device="cpu", dtype=torch.bfloat16, requires_grad=True):
    g = torch.Generator().manual_seed(0)
    shapes = ((1, 4, 9, 64), (1, 2, 11, 64), (1, 2, 11, 64))
    return [
        torch.randn(s, generator=g).to(device, dtype).requires_grad_(requires_grad) for s in shapes
    ]


def test_gradients_reach_every_input():
    from flashmoe_science import flash_attention_forward

    q, k, v = _small()
    flash_attention_forward(q, k, v, causal=True).float().sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and t.grad.shape == t.shape and t.grad.abs().sum() > 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_opcheck_and_compile_of_forward_and_backward(device, request):
    """opcheck (schema, fake, autograd registration, AOT dispatch) of the differentiable forward and
    of the backward operator itself, and torch.compile(fullgraph=True) of forward plus backward
    giving eager's gradients bit for bit (deterministic, so dQ's atomics cannot differ)."""
    from flashmoe_science import flash_attention_forward

    if device == "cuda":
        request.getfixturevalue("require_cuda_build")()
    q, k, v = (t.detach().to(device).requires_grad_() for t in _small(dtype=torch.float16))
    torch.library.opcheck(
        torch.ops.flashmoe_science.attention.default, (q, k, v, True, 0.125, 0, 0, True, 0)
    )
    plain = [t.detach() for t in (q, k, v)]
    out, lse = torch.ops.flashmoe_science.attention(*plain, True, 0.125, 0, 0, True, 0)
    dout = torch.randn_like(out)
    torch.library.opcheck(
        torch.ops.flashmoe_science.attention_backward.default,
        (dout, *plain, out, lse, True, 0.125, True, 0),
    )
    compiled = torch.compile(
        lambda q, k, v: (
            flash_attention_forward(q, k, v, causal=True, deterministic=True).float().sum()
        ),
        fullgraph=True,
    )
    compiled(q, k, v).backward()
    eager = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    flash_attention_forward(q, k, v, causal=True, deterministic=True).float().sum().backward()
    for t, e in zip((q, k, v), eager, strict=True):
        assert torch.equal(t.grad, e)


def test_decode_refuses_backward_in_one_line():
    from flashmoe_science import flash_attention_decode

    q, k, v = _small()
    out = flash_attention_decode(q, k, v)
    with pytest.raises(RuntimeError, match="flash_attention_decode is inference-only") as info:
        out.float().sum().backward()
    assert "\n" not in str(info.value)


def test_inputs_modified_in_place_after_the_forward_raise():
    from flashmoe_science import flash_attention_forward

    q, k, v = _small()
    x = q * 1
    out = flash_attention_forward(x, k, v)
    x.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.float().sum().backward()


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda d: d[..., :-1], ValueError, "grad_output must have the output's shape"),
        (lambda d: d.float(), TypeError, "grad_output has dtype torch.float32"),
        pytest.param(
            lambda d: d.cpu(), ValueError, "grad_output is on cpu", marks=pytest.mark.gpu, id="cpu"
        ),
    ],
)
def test_bad_grad_output_names_it(change, error, match):
    """The backward operator itself checks grad_output (autograd checks it before we see it).
    The device case runs the inputs on CUDA, grad_output on the CPU."""
    from flashmoe_science import flash_attention_forward, ops

    device = "cuda" if "is on cpu" in match else "cpu"
    q, k, v = (t.detach() for t in _small(device))
    out, lse = flash_attention_forward(q, k, v, return_lse=True)
    dout = torch.randn_like(out)
    with pytest.raises(error, match=match):
        ops._call(
            torch.ops.flashmoe_science.attention_backward,
            change(dout),
            q,
            k,
            v,
            out,
            lse,
            False,
            0.125,
            False,
            0,
        )


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_backward_reads_lse_at_any_strides(device):
    """The packed batch's backward hands one sequence's columns of lse ([Hq, total_q]) to the
    dense backward as a view; the gradients must equal those from the same lse contiguous, and a
    wrong row of lse must change them (the strides are really used)."""
    from flashmoe_science import flash_attention_forward, ops

    q, k, v = (t.detach() for t in _small(device))
    out, lse = flash_attention_forward(q, k, v, causal=True, return_lse=True)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out)
    wide = torch.randn(lse.shape[1], 3 * lse.shape[2] + 5, device=device)
    wide[:, 4 : 4 + lse.shape[2]] = lse[0]
    view = wide[:, 4 : 4 + lse.shape[2]].unsqueeze(0)
    assert not view.is_contiguous()

    def grads(lse_in):
        op = torch.ops.flashmoe_science.attention_backward
        return ops._call(op, dout, q, k, v, out, lse_in, True, 0.125, False, 0)

    for got, want in zip(grads(view), grads(lse.contiguous()), strict=True):
        assert torch.equal(got, want)
    shifted = wide[:, 5 : 5 + lse.shape[2]].unsqueeze(0)
    assert not torch.equal(grads(shifted)[0], grads(view)[0])


def test_backward_options_are_checked():
    from flashmoe_science import flash_attention_forward

    q, k, v = _small()
    with pytest.raises(ValueError, match="backward_config must be an int in"):
        flash_attention_forward(q, k, v, backward_config=9)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        flash_attention_forward(q, k, v, deterministic=1)
