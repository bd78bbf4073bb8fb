"""The correctness gates over the sequence-length x head-dim matrix, through the public API.

On a machine with a GPU and the CUDA build, the full matrix runs on CUDA and a subset on the CPU
implementation; elsewhere the CPU subset alone runs.
"""

from __future__ import annotations

import pytest
import torch

from flashmoe_science.pipeline import gates

GPU_CASES = gates.gate_cases("gpu")
CPU_CASES = gates.gate_cases("cpu")


def _run(case: gates.Case, device: str, record_property) -> None:
    result = gates.check_case(case, device)
    record_property(
        "gate", {**result.to_json(), "op": case.op, "dtype": case.dtype, "head_dim": case.head_dim}
    )
    if not result.passed:
        pytest.fail(gates.format_failure(case, result), pytrace=False)


@pytest.mark.gate
@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: f"{c.id}-cpu")
def test_gate_cpu(case, record_property):
    _run(case, "cpu", record_property)


@pytest.mark.gate
@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"{c.id}-cuda")
def test_gate_cuda(case, record_property, has_cuda_kernels):
    if not has_cuda_kernels:
        pytest.fail(
            "a GPU is visible but the loaded build has no CUDA kernels: run `nox -s build`",
            pytrace=False,
        )
    from flashmoe_science.ops import config_supported

    capability = torch.cuda.get_device_capability()
    if not config_supported(case.config, capability):
        pytest.skip(f"config={case.config} is built for sm_90 and newer; this GPU is {capability}")
    _run(case, "cuda", record_property)


def test_matrix_covers_the_issue():
    """The GPU matrix holds every sequence length, both head dims, both dtypes, causal and not,
    Sq != Sk both ways, GQA ratios 1/4/8, non-contiguous views and every tile configuration."""
    seqlens = {c.seqlen_q for c in GPU_CASES if c.seqlen_q == c.seqlen_k}
    assert set(gates.SEQLENS) <= seqlens
    assert {c.head_dim for c in GPU_CASES} == {64, 128}
    assert {c.dtype for c in GPU_CASES} == {"fp16", "bf16"}
    assert {c.causal for c in GPU_CASES} == {False, True}
    assert any(c.seqlen_q < c.seqlen_k for c in GPU_CASES) and any(
        c.seqlen_q > c.seqlen_k for c in GPU_CASES
    )
    assert {c.heads_q // c.heads_kv for c in GPU_CASES} == {1, 4, 8}
    assert any(c.layout == "bshd" for c in GPU_CASES) and any(c.batch > 1 for c in GPU_CASES)
    from flashmoe_science.ops import CONFIGS

    assert {c.config for c in GPU_CASES} == {0, *CONFIGS}
    # each forced configuration is also gated through its split-KV path
    assert {c.config for c in GPU_CASES if c.num_splits > 1 and c.config} == set(CONFIGS)


def test_bshd_view_is_used_in_place():
    """A [B, H, S, D] view of a [B, S, H, D] tensor is a non-contiguous input the gates really exercise."""
    case = next(c for c in CPU_CASES if c.layout == "bshd" and c.seqlen_q > 1 and c.heads_q > 1)
    q, _, _, _ = gates.make_inputs(case, "cpu")
    assert not q.is_contiguous() and q.stride(-1) == 1


def test_inputs_are_fresh_and_nonzero():
    a, b = CPU_CASES[3], CPU_CASES[4]
    qa, _, _, _ = gates.make_inputs(a, "cpu")
    qb, _, _, _ = gates.make_inputs(b, "cpu")
    assert a.seed() != b.seed()
    n = min(qa.numel(), qb.numel())
    assert not torch.equal(qa.flatten()[:n], qb.flatten()[:n])  # each case draws its own inputs
    assert qa.count_nonzero() > 0.99 * qa.numel() and torch.isfinite(qa).all()
