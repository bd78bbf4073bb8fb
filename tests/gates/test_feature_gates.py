"""The gates of local attention, soft-capping and sinks: the matrix holds what the issue asks (every
window kind, each feature alone and combined, GQA, Sq != Sk, crossed with the sequence lengths on
the GPU tier, a small subset on the CPU), the closed-form reference gradients agree with
torch.autograd through the fp64 reference forward, and each planted bug fails a gate, in the CPU
implementation and in the CUDA kernels.
The gate cases themselves run in the gate modules (test_gates, test_grad_gates, test_varlen,
test_paged)."""

from __future__ import annotations

import math

import pytest
import torch

from flashmoe_science.pipeline.cases import Case, make_inputs, make_output_grad, make_sinks
from flashmoe_science.pipeline.gates import backward as grad_gates
from flashmoe_science.pipeline.gates import forward as gates
from flashmoe_science.pipeline.gates import matrix, paged, varlen


def has_features(case) -> bool:
    return case.window != (-1, -1) or bool(case.softcap) or case.sinks


def feature_cases(tier: str) -> list:
    every = [
        *matrix.gate_cases(tier),
        *matrix.backward_cases(tier),
        *varlen.varlen_cases(tier),
        *paged.paged_cases(tier),
    ]
    return [c for c in every if has_features(c)]


GPU = feature_cases("gpu")
CPU = feature_cases("cpu")


def combos(cases) -> set[tuple[bool, bool, bool]]:
    return {(c.window != (-1, -1), bool(c.softcap), c.sinks) for c in cases}


@pytest.mark.parametrize("tier", ["gpu", "cpu"], ids=["gpu-tier", "cpu-tier"])
def test_every_window_kind_and_combination_is_gated(tier):
    """Windows of 0, small, a 64-key block, larger than S and asymmetric; each feature alone and
    in every combination; GQA; Sq != Sk both ways; split-KV with sinks; forward, backward
    (deterministic too), decode, varlen and paged."""
    cases = GPU if tier == "gpu" else CPU
    windows = {c.window for c in cases}
    assert (0, 0) in windows and any(0 < w[0] <= 16 for w in windows)
    assert any(w[0] in (63, 64) for w in windows)
    assert any(isinstance(c, Case) and c.window[0] > c.seqlen_k for c in cases)  # larger than S
    assert any(c.window[1] > 0 and c.window[0] != c.window[1] for c in cases)  # asymmetric
    assert any(c.window[0] == -1 and c.window[1] > 0 for c in cases)  # the right side only
    assert combos(cases) == {
        (True, False, False),
        (False, True, False),
        (False, False, True),
        (True, True, False),
        (True, False, True),
        (True, True, True),
    }
    dense = [c for c in cases if isinstance(c, Case)]
    assert {c.heads_q // c.heads_kv for c in dense} >= {1, 4}
    assert any(c.seqlen_q < c.seqlen_k for c in dense) and any(
        c.seqlen_q > c.seqlen_k for c in dense
    )
    assert {c.kind for c in dense} == {"prefill", "decode", "backward"}
    assert any(c.deterministic for c in dense) and any(c.layout == "bshd" for c in dense)
    assert any(c.sinks and c.num_splits > 1 for c in dense)  # the combine adds the sink once
    assert any(isinstance(c, varlen.VarlenCase) for c in cases)
    assert any(isinstance(c, paged.PagedCase) and c.sinks and c.num_splits > 1 for c in cases)
    assert {c.softcap for c in cases if c.softcap} >= {1.0, 5.0}


def test_the_gpu_tier_crosses_the_sequence_lengths():
    """Each (Sq, Sk) of the prefill matrix meets each combination, forward and backward, and each
    cache length of the decode matrix meets the features; with larger-than-S windows."""
    pairs = {(s, s) for s in matrix.SEQLENS} | set(matrix.UNEQUAL)
    for kind in ("prefill", "backward"):
        mine = [c for c in GPU if isinstance(c, Case) and c.kind == kind and not c.config]
        assert {(c.seqlen_q, c.seqlen_k) for c in mine} == pairs
        for combo in combos(mine):
            shapes = {(c.seqlen_q, c.seqlen_k) for c in mine if combos([c]) == {combo}}
            assert shapes == pairs, combo
        assert any(c.window[0] > c.seqlen_k for c in mine)
        assert {c.head_dim for c in mine} == {64, 128} and {c.dtype for c in mine} == {
            "fp16",
            "bf16",
        }
        assert {c.causal for c in mine} == {False, True}
    decode = [c for c in GPU if isinstance(c, Case) and c.kind == "decode"]
    assert {c.seqlen_k for c in decode} == set(matrix.DECODE_SEQLENS_K)


@pytest.mark.parametrize("kind", ["prefill", "backward"])
def test_every_forced_configuration_meets_every_combination(kind):
    """The automatic choice runs one kernel family per card: forced, every configuration (the
    mma.sync ones an L4 runs, the wgmma ones of a Hopper card, the decode kernel) meets each
    combination of the features, on any GPU that can run it."""
    from flashmoe_science.ops import BACKWARD_CONFIGS

    configs = matrix.FORCED_CONFIGS if kind == "prefill" else BACKWARD_CONFIGS
    forced = [c for c in GPU if isinstance(c, Case) and c.kind == kind and c.config]
    for config in configs:
        assert combos(c for c in forced if c.config == config) == combos(GPU), config
    # (the wgmma forward past 128 is one kernel for 5 to 7: forced on 5 there, matrix.wide_wgmma_cases)
    # (and so is the 128 tile run padded: matrix.padded_wgmma_cases)
    wide = {c.head_dim for c in forced if c.head_dim > 128}
    padded = {c.head_dim for c in forced if c.head_dim not in (64, 128) and c.head_dim < 128}
    assert {c.head_dim for c in forced} == {64, 128, *wide, *padded}
    if kind == "prefill":
        assert wide == set(matrix.WGMMA_WIDE_HEAD_DIMS)
        assert padded == {d for d, _ in matrix.WGMMA_PADDED_MATRIX_HEAD_DIMS}
        for dims in (wide, padded):
            assert {c.config for c in forced if c.head_dim in dims} == {5}
            assert combos(c for c in forced if c.head_dim in dims) == combos(GPU)


def test_the_cpu_tier_stays_small():
    """CI's CPU stage runs these (their seconds: benches/notes/harness.md)."""
    assert len(CPU) <= 24
    assert all(max(getattr(c, "seqlen_q", 0), getattr(c, "seqlen_k", 0)) <= 1000 for c in CPU)


@pytest.mark.parametrize(
    "window, softcap, causal",
    [((3, 5), 0.0, False), ((-1, -1), 1.5, True), ((7, 0), 2.0, False), ((0, 0), 0.0, True)],
)
def test_closed_form_gradients_match_autograd_of_the_fp64_reference(window, softcap, causal):
    """reference_grads' closed form (dS through softcap's derivative, d sinks = -sum of P_sink *
    delta over a head's rows) against torch.autograd through attention_reference in fp64, with
    rows that see no key (Sq > Sk) among them."""
    case = Case(
        "backward", "bf16", 2, 4, 2, 23, 17, 32, causal, window=window, softcap=softcap, sinks=True
    )
    q, k, v, _ = make_inputs(case, "cpu")
    dout = make_output_grad(case, "cpu")
    sinks = make_sinks(case, "cpu")
    scale = 1 / math.sqrt(case.head_dim)
    options = {"window": case.window, "softcap": softcap}
    closed = grad_gates.reference_grads(q, k, v, dout, causal, scale, sinks=sinks, **options)
    leaves = [t.double().requires_grad_() for t in (q, k, v, sinks)]
    out, _ = gates.attention_reference(
        *leaves[:3], causal, scale, sinks=leaves[3], compute_dtype=torch.float64, **options
    )
    expected = torch.autograd.grad(out, leaves, dout.double())
    for name, got, want in zip(grad_gates.GRADS, closed, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, msg=name)
    assert float(expected[3].abs().max()) > 0.1  # the sinks' gradient is not trivially 0


# ---- planted bugs ---------------------------------------------------------------------------------

FEATURE_PLANT_SCRIPT = """
import json, sys
from flashmoe_science import ops
from flashmoe_science.pipeline.cases import parse_case_id
from flashmoe_science.pipeline.gates import backward as grad_gates
from flashmoe_science.pipeline.gates import forward as gates
from flashmoe_science.pipeline.gates import paged, varlen
device = sys.argv[1]
ragged = {c.id: c for c in [*varlen.varlen_cases("cpu"), *paged.paged_cases("cpu")]}
results = {}
for case_id in sys.argv[2:]:
    if case_id.startswith("varlen"):
        results[case_id] = varlen.check_varlen_case(ragged[case_id], device).failures
    elif case_id.startswith("paged"):
        results[case_id] = paged.check_paged_case(ragged[case_id], device).failures
    elif case_id.startswith("bwd"):
        results[case_id] = grad_gates.check_case(parse_case_id(case_id), device).failures
    else:
        results[case_id] = gates.check_case(parse_case_id(case_id), device).failures
print(json.dumps({"planted": ops.planted_bug(), "results": results}))
"""
# Each planted bug (csrc/attention_params.h, 20-23), CPU-tier cases that must expose it, and a
# control of the same kind that must pass (the bug needs its feature).
FEATURE_PLANTS = {
    20: (  # the window's left edge off by one
        (
            "fwd-fp16-d64-h4-b2-s65-causal-win16_0",
            "bwd-fp16-d64-h4-b2-s65-causal-win16_0",
            "varlen-bf16-d64-h8kv2-q17_0_100_1_64-k17_0_100_1_64-full-win3_40-cap1",
        ),
        ("fwd-fp16-d64-h4kv1-b2-q17-k129-causal-cap1",),
    ),
    21: (  # softcap applied after the mask
        (
            "fwd-fp16-d64-h4kv1-b2-q17-k129-causal-cap1",
            "fwd-fp16-d64-h4-b2-q65-k130-causal-win64_0-cap5",
        ),
        ("fwd-fp16-d64-h4-b2-s65-causal-win16_0",),
    ),
    22: (  # the sinks' gradient never accumulated
        (
            "bwd-fp16-d64-h4kv2-b2-q129-k17-causal-sinks",
            "bwd-bf16-d64-h4-b2-s129-causal-bshd-det-win64_0-cap5-sinks",
        ),
        ("fwd-bf16-d64-h4kv2-b2-q129-k17-causal-sinks",),
    ),
    23: (  # decode forgets the window
        (
            "dec-fp16-d64-h8-b3-q1-k300-splits3-lens300_0_77-win63_0-sinks",
            "paged-fp16-d64-h8kv2-q1-page16-splits7-lens0_1_17_65_300-win100_0-cap1-sinks",
        ),
        # features without a window (on CUDA a small windowed prefill runs the decode kernel too)
        ("fwd-bf16-d64-h4kv2-b2-q129-k17-causal-sinks",),
    ),
}


def test_feature_plants_name_cpu_tier_cases():
    ids = {c.id for c in CPU} | {c.id for c in matrix.gate_cases("cpu")}
    for caught, controls in FEATURE_PLANTS.values():
        assert set(caught) | set(controls) <= ids


@pytest.mark.slow
@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)], ids=["cpu", "cuda"]
)
@pytest.mark.parametrize("bug", sorted(FEATURE_PLANTS))
def test_planted_feature_bug_fails_its_gates_and_only_those(bug, device, run_planted):
    """The plant build with bug `bug` fails the gates of every case named for it, and passes its
    control (a case without the feature the bug needs): the CPU implementation's plants, and the
    same bugs in the CUDA kernels (a build of the few kernels those cases run). One process:
    import and a few cases."""
    caught, controls = FEATURE_PLANTS[bug]
    results = run_planted(bug, FEATURE_PLANT_SCRIPT, device, *caught, *controls)["results"]
    for case_id in caught:
        assert any("gate" in f for f in results[case_id]), f"bug {bug} passed {case_id}"
    for case_id in controls:
        assert not results[case_id], (case_id, results[case_id])
