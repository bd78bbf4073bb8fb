"""Packed (varlen) batches: the gate matrix (flashmoe_science/pipeline/gates/varlen.py), the input
checks, the log-sum-exp layout, the backward, and a planted bug (a kernel that reads one
key past each sequence's end) that a gate must catch."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flashmoe_science import flash_attention_forward, flash_attention_varlen_forward
from flashmoe_science.pipeline.gates import matrix, ragged
from flashmoe_science.pipeline.gates import varlen as varlen_gates
from flashmoe_science.pipeline.gates.matrix import HEAD_DIMS, NEW_HEAD_DIMS, NEW_HEAD_DIMS_CPU

GPU_CASES = varlen_gates.varlen_cases("gpu")
CPU_CASES = varlen_gates.varlen_cases("cpu")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _run(case, device, record_gate) -> None:
    result = varlen_gates.check_varlen_case(case, device)
    reruns = ragged.rerun_fields(case.id, device, case.config)
    record_gate(case, result, "varlen", reruns, lambda: result.format_failure(case, device))


@pytest.mark.gate
@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: f"{c.id}-cpu")
def test_gate_varlen_cpu(case, record_gate):
    _run(case, "cpu", record_gate)


@pytest.mark.gate
@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"{c.id}-cuda")
def test_gate_varlen_cuda(case, record_gate, require_cuda_build):
    require_cuda_build(case.config, head_dim=case.head_dim, head_dim_v=case.head_dim_v, case=case)
    _run(case, "cuda", record_gate)


def test_matrix_covers_the_issue():
    """Lengths 0, 1, 17, 128, 1000, 4096 mixed in one batch, Sq != Sk both ways, GQA 1/4/8, both
    dtypes, causal and not, every head dims pair (v's differing included) and every forward tile
    configuration."""
    lengths = {n for c in GPU_CASES for n in c.lengths_q + c.lengths_k}
    assert {0, 1, 17, 128, 1000, 4096} <= lengths
    assert any(len(set(c.lengths_q)) >= 5 for c in GPU_CASES)
    pairs = [(q, k) for c in GPU_CASES for q, k in zip(c.lengths_q, c.lengths_k, strict=True)]
    assert any(q < k for q, k in pairs) and any(q > k for q, k in pairs)
    assert {c.heads_q // c.heads_kv for c in GPU_CASES} == {1, 4, 8}
    assert {c.dtype for c in GPU_CASES} == {"fp16", "bf16"}
    assert {c.causal for c in GPU_CASES} == {False, True}
    # (the padded wgmma tile's gates add v's 64 under 128)
    dims = set(HEAD_DIMS) | set(matrix.WGMMA_PADDED_HEAD_DIMS)
    assert {(c.head_dim, c.head_dim_v or c.head_dim) for c in GPU_CASES} == dims
    for head_dims in NEW_HEAD_DIMS:  # every batch of the matrix, both dtypes and masks
        mine = [c for c in GPU_CASES if (c.head_dim, c.head_dim_v or c.head_dim) == head_dims]
        assert {(c.lengths_q, c.lengths_k, c.dtype, c.causal) for c in mine} == {
            (*batch, t, m)
            for batch in varlen_gates.BATCHES
            for t in ("fp16", "bf16")
            for m in (False, True)
        }
    assert {(c.head_dim, c.head_dim_v or c.head_dim) for c in CPU_CASES} >= set(NEW_HEAD_DIMS_CPU)
    # every forward configuration but those without a packed variant: the decode kernel (3), 6 and 7
    from flashmoe_science.ops import CONFIGS, NO_PACKED_CONFIGS

    assert {3, 6, 7} == NO_PACKED_CONFIGS
    assert {c.config for c in GPU_CASES} == {0, *CONFIGS} - NO_PACKED_CONFIGS
    assert set(varlen_gates.VARLEN_CONFIGS) == set(CONFIGS) - NO_PACKED_CONFIGS
    assert len({c.id for c in GPU_CASES + CPU_CASES}) == len(GPU_CASES) + len(CPU_CASES)


def test_ramped_cases_ramp_each_sequence_from_its_own_first_key():
    case = next(c for c in varlen_gates.varlen_cases("cpu") if c.scores == "falling")
    assert case.id.endswith("-falling") and "scores=falling" in case.describe()
    plain = dataclasses.replace(case, scores="normal")
    q, k, v, _, _ = varlen_gates.make_varlen_inputs(case, "cpu", 3)
    q0, k0, v0, _, _ = varlen_gates.make_varlen_inputs(plain, "cpu", 3)
    assert torch.equal(q, q0) and torch.equal(v, v0)
    start = 0
    for length in case.lengths_k:
        if length > 1:  # falling: the sequence's first key scaled 16 times, its last once
            assert torch.allclose(k[start].float(), 16 * k0[start].float(), rtol=1e-2)
            assert torch.equal(k[start + length - 1], k0[start + length - 1])
        start += length
    with pytest.raises(ValueError, match="scores='peaked' is not supported"):
        dataclasses.replace(case, scores="peaked")


def test_a_wrong_output_fails_with_a_report_per_sequence():
    """Scaled outputs fail both gates on every sequence with queries; the report names each
    failing sequence and ends with the command that reruns the case."""
    case = CPU_CASES[0]

    def scaled(case, *args):
        out, lse = varlen_gates.call_varlen(case, *args)
        return out * 1.5, lse

    result = varlen_gates.check_varlen_case(case, "cpu", scaled)
    report = result.format_failure(case, "cuda")
    assert not result.passed and report.startswith(f"FAILED {case.id}\n  case: varlen B=")
    assert f"{case.id}/seq0 (seed " in report and "    gate 1: " in report
    rerun = ragged.rerun_fields(case.id, "cuda")["rerun"]
    assert report.endswith(f"  rerun: {rerun}") and rerun.startswith("FLASHMOE_REQUIRE_GPU=1 ")


def packed(device, lengths_q=(3, 0, 5), lengths_k=(4, 2, 5), heads=(4, 2), dtype=torch.bfloat16):
    case = varlen_gates.VarlenCase("bf16", 64, *heads, lengths_q, lengths_k, causal=True)
    q, k, v, cu_q, cu_k = varlen_gates.make_varlen_inputs(case, device, seed=0)
    return q.to(dtype), k.to(dtype), v.to(dtype), cu_q, cu_k


@pytest.mark.parametrize("device", DEVICES)
def test_lse_layout_and_empty_sequences(device):
    """lse is [Hq, total_q] (FlashAttention's varlen layout); a query with no key gets 0 and -inf."""
    q, k, v, cu_q, cu_k = packed(device, lengths_q=(2, 3, 1), lengths_k=(0, 3, 1))
    out, lse = flash_attention_varlen_forward(q, k, v, cu_q, cu_k, 3, 3, True, return_lse=True)
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    assert torch.all(out[:2] == 0) and torch.all(torch.isinf(lse[:, :2]))
    dense, dense_lse = flash_attention_forward(
        q[2:5].transpose(0, 1)[None],
        k[0:3].transpose(0, 1)[None],
        v[0:3].transpose(0, 1)[None],
        True,
        return_lse=True,
    )
    torch.testing.assert_close(out[2:5], dense[0].transpose(0, 1), atol=2e-2, rtol=0)
    torch.testing.assert_close(lse[:, 2:5], dense_lse[0], atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_views_of_a_packed_qkv_tensor(device):
    """q, k and v as views of one [total, 3, H, D] projection (only the last dimension contiguous)
    give the same result as contiguous copies."""
    q, k, v, cu_q, _ = packed(device, lengths_q=(3, 70, 5), lengths_k=(3, 70, 5), heads=(4, 4))
    qkv = torch.stack([q, k, v], dim=1)
    views = flash_attention_varlen_forward(
        qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_q, cu_q, 70, 70, True
    )
    copies = flash_attention_varlen_forward(q, k, v, cu_q, cu_q, 70, 70, True)
    assert torch.equal(views, copies)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch(device):
    q, k, v, cu_q, cu_k = packed(device, lengths_q=(0, 0), lengths_k=(0, 0))
    out, lse = flash_attention_varlen_forward(q, k, v, cu_q, cu_k, 0, 0, return_lse=True)
    assert out.shape == (0, 4, 64) and lse.shape == (4, 0)


def _cu(args, values):
    return torch.tensor(values, dtype=torch.int32, device=args["q"].device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (
            lambda a: {**a, "cu_seqlens_q": a["cu_seqlens_q"].long()},
            TypeError,
            "cu_seqlens_q has dtype torch.int64",
        ),
        (
            lambda a: {**a, "cu_seqlens_k": a["cu_seqlens_k"].float()},
            TypeError,
            "cu_seqlens_k has dtype torch.float32",
        ),
        (
            lambda a: {**a, "cu_seqlens_q": _cu(a, [0, 5, 3, 8])},
            ValueError,
            "cu_seqlens_q must be non-decreasing, got cu_seqlens_q[1] = 5 > cu_seqlens_q[2] = 3",
        ),
        (
            lambda a: {**a, "cu_seqlens_k": _cu(a, [0, 4, 6, 10])},
            ValueError,
            "cu_seqlens_k[-1] = 10 must equal the rows of k (11)",
        ),
        (
            lambda a: {**a, "cu_seqlens_q": a["cu_seqlens_q"] + 1},
            ValueError,
            "cu_seqlens_q[0] must be 0",
        ),
        (
            lambda a: {**a, "cu_seqlens_k": a["cu_seqlens_k"][:3]},
            ValueError,
            "both have batch + 1 entries",
        ),
        (
            lambda a: {**a, "cu_seqlens_q": a["cu_seqlens_q"].view(2, 2)},
            ValueError,
            "cu_seqlens_q must have shape [batch + 1]",
        ),
        (
            lambda a: {**a, "max_seqlen_q": 4},
            ValueError,
            "sequence 2 has 5 rows in cu_seqlens_q but max_seqlen_q = 4",
        ),
        (lambda a: {**a, "max_seqlen_k": 3}, ValueError, "max_seqlen_k = 3"),
        (lambda a: {**a, "max_seqlen_k": -1}, ValueError, "max_seqlen_k must be an int in"),
        (lambda a: {**a, "q": a["q"][None]}, ValueError, "q must have 3 dimensions"),
        (
            lambda a: {**a, "k": a["k"][:, :1].repeat(1, 3, 1), "v": a["v"][:, :1].repeat(1, 3, 1)},
            ValueError,
            "must be a multiple of heads of k and v",
        ),
        (lambda a: {**a, "q": a["q"].float()}, TypeError, "q has dtype torch.float32"),
        (lambda a: {**a, "config": 3}, ValueError, "config must be 0 (automatic), 1, 2, 4 or 5"),
        (lambda a: {**a, "config": 6}, ValueError, "config must be 0 (automatic), 1, 2, 4 or 5"),
    ],
)
def test_bad_input_raises_one_line(device, monkeypatch, change, error, message):
    # On CUDA the values are checked by the kernels (test_input_checks.py) unless asked for here.
    monkeypatch.setenv("FLASHMOE_CHECK_INPUTS", "1")
    q, k, v, cu_q, cu_k = packed(device)
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5, max_seqlen_k=5)
    with pytest.raises(error) as info:
        flash_attention_varlen_forward(**change(args))
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
def test_backward_matches_the_dense_backward_per_sequence(device, causal):
    """Gradients of a packed call equal those of flash_attention_forward on each sequence alone,
    including sequences without queries or keys (zero gradients), with GQA."""
    lengths_q, lengths_k = (3, 0, 70, 2), (4, 5, 70, 0)
    q, k, v, cu_q, cu_k = packed(device, lengths_q, lengths_k, heads=(4, 2))
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(3)).to(q)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = flash_attention_varlen_forward(*leaves, cu_q, cu_k, 70, 70, causal)
    out.backward(grad)
    expected = [torch.zeros_like(t) for t in (q, k, v)]
    q0 = k0 = 0
    for len_q, len_k in zip(lengths_q, lengths_k, strict=True):
        rows_q, rows_k = slice(q0, q0 + len_q), slice(k0, k0 + len_k)
        q0, k0 = q0 + len_q, k0 + len_k
        if not (len_q and len_k):
            continue
        dense = [
            t[rows].transpose(0, 1)[None].detach().requires_grad_(True)
            for t, rows in ((q, rows_q), (k, rows_k), (v, rows_k))
        ]
        flash_attention_forward(*dense, causal).backward(grad[rows_q].transpose(0, 1)[None])
        for e, d, rows in zip(expected, dense, (rows_q, rows_k, rows_k), strict=True):
            e[rows] = d.grad[0].transpose(0, 1)
    for leaf, e in zip(leaves, expected, strict=True):
        assert leaf.grad.dtype == leaf.dtype and leaf.grad.is_contiguous()
        torch.testing.assert_close(leaf.grad, e, atol=1e-2, rtol=1e-2)
    assert torch.all(leaves[0].grad[3:3] == 0) and torch.all(leaves[1].grad[4:9] == 0)
    assert leaves[0].grad[73:].abs().sum() == 0  # the last sequence has no keys


@pytest.mark.gpu
@pytest.mark.parametrize("config", [3, 6, 7])
def test_the_cuda_operator_refuses_a_configuration_without_a_packed_variant(config):
    """Called past the Python check, the CUDA operator itself refuses the decode kernel (3) and
    configurations 6 and 7 for a packed batch, in one line, on any GPU (before its device
    checks)."""
    from flashmoe_science import ops

    q, k, v, cu_q, cu_k = packed("cuda")
    op = torch.ops.flashmoe_science.varlen_fwd  # ops._call types the C++ error, as the API does
    with pytest.raises(ValueError) as info:
        ops._call(op, q, k, v, cu_q, cu_k, 5, 5, True, 0.125, config)
    message = str(info.value)
    assert f"1, 2, 4 or 5 for a packed batch, got {config}" in message and "\n" not in message


def test_opcheck():
    from flashmoe_science import ops  # noqa: F401  (loads the operators)

    q, k, v, cu_q, cu_k = packed("cpu")
    torch.library.opcheck(
        torch.ops.flashmoe_science.varlen_fwd,
        (q, k, v, cu_q, cu_k, 5, 5, True, 0.125, 0),
        test_utils=("test_schema", "test_faketensor"),
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_capture_checks_on_the_device():
    """A packed call captures into a CUDA graph (no host check of cu_seqlens, so no sync while
    capturing); a replay with new lengths gives the eager result, and offsets out of range, which
    the kernel clamps into the packed tensors rather than read outside them, make the whole output
    NaN; valid offsets again give the eager result again."""
    q, k, v, cu_q, cu_k = packed("cuda", lengths_q=(3, 60, 5), lengths_k=(4, 60, 7))
    flash_attention_varlen_forward(q, k, v, cu_q, cu_k, 64, 64, True)  # warm-up, eager
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attention_varlen_forward(q, k, v, cu_q, cu_k, 64, 64, True)
    cu_q.copy_(torch.tensor([0, 30, 62, 68], dtype=torch.int32))
    cu_k.copy_(torch.tensor([0, 11, 70, 71], dtype=torch.int32))
    graph.replay()
    expected = flash_attention_varlen_forward(q, k, v, cu_q, cu_k, 64, 64, True)
    assert torch.equal(out, expected)
    good_k = cu_k.clone()
    cu_k.copy_(torch.tensor([0, 10**6, -5, 10**7], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    assert out.isnan().all()
    cu_k.copy_(good_k)
    graph.replay()
    assert torch.equal(out, expected)


PLANT_SCRIPT = """
import json, sys
from flashmoe_science import ops
from flashmoe_science.pipeline.gates import varlen as varlen_gates
from flashmoe_science.pipeline.gates.kernels import gate_case
cases = [gate_case(case_id) for case_id in sys.argv[2:]]
print(json.dumps({"planted": ops.planted_bug(), "failures": [
    varlen_gates.check_varlen_case(c, sys.argv[1]).failures for c in cases]}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_planted_one_key_past_the_end_fails_a_gate(device, run_planted):
    """Build the unit with -DFLASHMOE_PLANT_BUG=7 (each sequence reads one key past its end) and
    show the varlen gates catch it."""
    cases = varlen_gates.varlen_cases("cpu" if device == "cpu" else "gpu")[:4]
    for failures in run_planted(7, PLANT_SCRIPT, device, *(c.id for c in cases))["failures"]:
        assert any(("gate 1" in f or "gate 2" in f) for f in failures), failures
