"""The correctness gates over the sequence-length x head-dim matrix, through the public API.

On a machine with a GPU and the CUDA build, the full matrix runs on CUDA and a subset on the CPU
implementation; elsewhere the CPU subset alone runs.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flashmoe_science import _loader as loader
from flashmoe_science.pipeline.cases import Case, make_inputs
from flashmoe_science.pipeline.gates import forward as gates
from flashmoe_science.pipeline.gates import matrix

GPU_CASES = matrix.gate_cases("gpu")
CPU_CASES = matrix.gate_cases("cpu")


def _run(case: Case, device: str, record_gate) -> None:
    result = gates.check_case(case, device)
    op = "decode" if case.kind == "decode" else "fwd"
    reruns = matrix.rerun_fields(case, device)
    record_gate(case, result, op, reruns, lambda: gates.format_failure(case, result))


@pytest.mark.gate
@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: f"{c.id}-cpu")
def test_gate_cpu(case, record_gate):
    _run(case, "cpu", record_gate)


@pytest.mark.gate
@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"{c.id}-cuda")
def test_gate_cuda(case, record_gate, require_cuda_build):
    require_cuda_build(case.config, head_dim=case.head_dim, head_dim_v=case.head_dim_v, case=case)
    _run(case, "cuda", record_gate)


def test_matrix_covers_the_issue():
    """The GPU matrix holds every sequence length, both head dims, both dtypes, causal and not,
    Sq != Sk both ways, GQA ratios 1/4/8, non-contiguous views and every tile configuration."""
    seqlens = {c.seqlen_q for c in GPU_CASES if c.seqlen_q == c.seqlen_k}
    assert set(matrix.SEQLENS) <= seqlens
    # (the padded wgmma tile's gates add v's 64 under 128, which pads V alone)
    dims = set(matrix.HEAD_DIMS) | set(matrix.WGMMA_PADDED_HEAD_DIMS)
    assert {(c.head_dim, c.value_head_dim) for c in GPU_CASES} == dims
    assert {c.dtype for c in GPU_CASES} == {"fp16", "bf16"}
    assert {c.causal for c in GPU_CASES} == {False, True}
    assert any(c.seqlen_q < c.seqlen_k for c in GPU_CASES) and any(
        c.seqlen_q > c.seqlen_k for c in GPU_CASES
    )
    assert {c.heads_q // c.heads_kv for c in GPU_CASES} == {1, 4, 8}
    assert any(c.layout == "bshd" for c in GPU_CASES) and any(c.batch > 1 for c in GPU_CASES)
    from flashmoe_science.ops import CONFIGS

    assert {c.config for c in GPU_CASES} == {0, *CONFIGS} and set(matrix.FORCED_CONFIGS) == set(
        CONFIGS
    )
    # each forced configuration is also gated through its split-KV path
    assert {c.config for c in GPU_CASES if c.num_splits > 1 and c.config} == set(CONFIGS)


def test_the_issues_head_dims_are_gated():
    """Head dims 64, 96, 128, 192 and 256, q and k of 192 with v of 128 (DeepSeek's multi-head
    latent attention), and for every CUDA tile wider than 64 a head dim that runs padded onto it
    (80 on 128's, 160 on 192's; 96 on 128's and (192, 128) pad too)."""
    named = {(64, 64), (96, 96), (128, 128), (192, 192), (256, 256), (192, 128)}
    padded = set(matrix.HEAD_DIMS) - named
    assert named <= set(matrix.HEAD_DIMS)
    assert all(d == v and loader.tile_head_dim(d) != d for d, v in padded)
    assert {loader.tile_head_dim(d) for d, _ in padded} == {128, 192}
    assert set(matrix.NEW_HEAD_DIMS) == set(matrix.HEAD_DIMS) - {(64, 64), (128, 128)}


@pytest.mark.parametrize("head_dims", matrix.HEAD_DIMS, ids=str)
def test_every_head_dim_meets_the_whole_sequence_matrix_on_cuda(head_dims):
    """Each head dims pair goes through every (Sq, Sk) of the prefill matrix, both dtypes and
    masks, GQA 1/4/8 and strided views, as the automatic choice (config 0), and through every
    cache length of the decode matrix, split and not, mixed cache_seqlens included."""
    mine = [c for c in GPU_CASES if (c.head_dim, c.value_head_dim) == head_dims and not c.config]
    prefill = [c for c in mine if c.kind == "prefill" and c.scores == "normal"]
    expected = [(s, s) for s in matrix.SEQLENS] + list(matrix.UNEQUAL)
    for dtype in ("fp16", "bf16"):
        for causal in (False, True):
            shapes = {
                (c.seqlen_q, c.seqlen_k) for c in prefill if (c.dtype, c.causal) == (dtype, causal)
            }
            assert shapes == set(expected)
    assert {c.heads_q // c.heads_kv for c in prefill} == {1, 4, 8}
    assert {c.layout for c in prefill} == {"bhsd", "bshd"}
    assert {"rising", "falling"} <= {c.scores for c in mine}
    decode = [c for c in mine if c.kind == "decode" and c.seqlen_q <= 16]
    assert {c.seqlen_k for c in decode} == set(matrix.DECODE_SEQLENS_K)
    assert any(c.num_splits > 1 for c in decode) and any(c.cache_seqlens for c in decode)


@pytest.mark.parametrize("head_dims", matrix.NEW_HEAD_DIMS_CPU, ids=str)
def test_the_cpu_tier_runs_a_few_cases_of_each_new_head_dim(head_dims):
    """The CPU tier (CI) runs each new head dims pair through prefill past a 64-key block, Sq < Sk
    on a strided view, Sq > Sk (rows that see no key), split-KV, and decode with mixed cache
    lengths; 96 runs through its whole forward matrix."""
    mine = [c for c in CPU_CASES if (c.head_dim, c.value_head_dim) == head_dims]
    prefill = [c for c in mine if c.kind == "prefill"]
    assert any(c.seqlen_q > 64 and c.seqlen_q == c.seqlen_k for c in prefill)
    assert any(c.seqlen_q < c.seqlen_k and c.layout == "bshd" for c in prefill)
    assert any(c.seqlen_q > c.seqlen_k and c.causal for c in prefill)
    assert any(c.num_splits > 1 for c in prefill)
    assert any(c.kind == "decode" and c.num_splits > 1 and c.cache_seqlens for c in mine)
    assert len(mine) <= 6  # the CPU test stage's time
    assert {c.seqlen_q for c in CPU_CASES if c.head_dim == 96} >= set(matrix.SEQLENS_CPU)


def _whole(case) -> bool:
    """A case at 64 or 128 whole (not the 128 tile run padded)."""
    return case.head_dim in (64, 128) and case.value_head_dim == case.head_dim


def _shapes(config: int, wide: bool = False) -> set[tuple]:
    """The forced prefill shapes of a configuration at 64 and 128 (with `wide`, past 128)."""
    return {
        (c.dtype, c.head_dim, c.causal, c.seqlen_q, c.seqlen_k)
        for c in GPU_CASES
        if c.config == config and c.kind == "prefill" and (c.head_dim > 128 if wide else _whole(c))
    }


def test_the_wgmma_configurations_meet_the_whole_matrix():
    """The sm_90a configurations go through everything the automatic choice does (every length,
    Sq != Sk both ways, both dtypes, head dims and masks, GQA 1/4/8, strided views), and through
    the shapes and split-KV path every forced configuration gets, at the head dims they gate."""
    from flashmoe_science.ops import SM90A_CONFIGS

    assert set(matrix.FULL_MATRIX_CONFIGS) == SM90A_CONFIGS == {5, 6, 7}
    forced = _shapes(1)
    for config in SM90A_CONFIGS:
        mine = [c for c in GPU_CASES if c.config == config and _whole(c)]
        head_dims = matrix.gated_head_dims(config)
        assert _shapes(config) == {s for s in _shapes(0) | forced if s[1] in head_dims}
        assert {c.heads_q // c.heads_kv for c in mine} == {1, 4, 8}
        assert {c.layout for c in mine} == {"bhsd", "bshd"}
        assert any(c.num_splits > 1 for c in mine) and any(c.num_splits == 0 for c in mine)


@pytest.mark.parametrize("config", [5, 6, 7])
def test_decode_with_many_query_rows_reaches_the_wgmma_copy_path(config):
    """Decode of more than 16 query rows with cache_seqlens (chunked prefill, speculative
    decoding) forced onto each wgmma configuration, which copies K and V by cp.async there (the
    host uses no TMA with cache lengths): both dtypes, the head dims it gates and both masks for
    Sq 65 and 257, caches of a few hundred to 2000 keys holding empty, one-token, partial-tile and
    full sequences, split and not, GQA 1/4/8."""
    assert config in matrix.MANY_ROW_DECODE_CONFIGS
    mine = [
        c
        for c in GPU_CASES
        if c.kind == "decode"
        and c.cache_seqlens
        and c.seqlen_q > 16
        and c.config == config
        and _whole(c)
    ]
    assert {(c.dtype, c.head_dim, c.causal, c.seqlen_q) for c in mine} == {
        (t, d, m, q)
        for t in ("fp16", "bf16")
        for d in matrix.gated_head_dims(config)
        for m in (0, 1)
        for q in (65, 257)
    }
    assert len(mine) <= 40  # the GPU test stage's wall time
    assert min(c.seqlen_k for c in mine) <= 300 and max(c.seqlen_k for c in mine) >= 2000
    lengths = [(n, c.seqlen_k) for c in mine for n in c.cache_seqlens]
    assert {0, 1} <= {n for n, _ in lengths} and any(n == k for n, k in lengths)
    assert any(n > 128 and n % 128 for n, _ in lengths)  # a partial last 128-key tile
    assert {c.num_splits for c in mine} == {0, 3}
    assert {c.heads_q // c.heads_kv for c in mine} == {1, 4, 8}


def test_the_wgmma_kernel_past_128_meets_the_whole_matrix():
    """At 192 and 256 configurations 5 to 7 are one kernel: 5 goes through everything the
    automatic choice does (every length, Sq != Sk both ways, dtypes, masks, GQA 1/4/8, strided
    views) and the forced shapes with split-KV, ramped scores, every feature combination and the
    cp.async path (many-row decode); 6 and 7 through the forced shapes, every one of them."""
    wide = set(matrix.WGMMA_WIDE_HEAD_DIMS)
    assert wide == {192, 256} and matrix.WGMMA_WIDE_MATRIX_CONFIG == 5
    forced = {s for s in _shapes(1) if s[1] == 128}
    as_wide = {(t, d, m, q, k) for t, _, m, q, k in forced for d in wide}
    automatic = {s for s in _shapes(0, wide=True) if s[1] in wide}
    assert as_wide <= _shapes(5, wide=True) and automatic <= _shapes(5, wide=True)
    for config in (6, 7):
        assert _shapes(config, wide=True) == as_wide
    mine = [c for c in GPU_CASES if c.config == 5 and c.head_dim in wide]
    assert {c.heads_q // c.heads_kv for c in mine} == {1, 4, 8}
    assert {c.layout for c in mine} == {"bhsd", "bshd"}
    assert any(c.num_splits > 1 for c in mine)
    assert {c.scores for c in mine} == {"normal", "rising", "falling"}
    combos = {(c.window != (-1, -1), c.softcap > 0, c.sinks) for c in mine}
    assert {(True, False, False), (False, True, False), (False, False, True)} <= combos
    assert {(True, True, True)} <= combos
    decode = [c for c in mine if c.kind == "decode"]
    assert {(c.dtype, c.head_dim, c.causal) for c in decode} == {
        (t, d, m) for t in ("fp16", "bf16") for d in wide for m in (False, True)
    }
    assert all(c.cache_seqlens and c.seqlen_q > 16 for c in decode)


def test_the_padded_wgmma_tile_meets_the_whole_matrix():
    """Configuration 5's 128 tile run padded (80, 96, v's 64 under 128): 96 goes through
    everything the automatic choice does (every length, Sq != Sk both ways, dtypes, masks, GQA
    1/4/8, strided views), ramped scores, every feature combination and the cp.async path
    (many-row decode); each padded head dims through the forced shapes with split-KV. 6 and 7 take
    none of them (their kernels run whole tiles only)."""
    padded = set(matrix.WGMMA_PADDED_HEAD_DIMS)
    assert padded == {(96, 96), (80, 80), (128, 64)} and matrix.WGMMA_PADDED_CONFIGS == (5,)
    mine = [c for c in GPU_CASES if c.config and (c.head_dim, c.value_head_dim) in padded]
    assert {c.config for c in mine} == {5}
    forced = {(c.seqlen_q, c.seqlen_k) for c in mine if c.kind == "prefill"}
    for dims in padded:
        at = {(c.seqlen_q, c.seqlen_k) for c in mine if (c.head_dim, c.value_head_dim) == dims}
        assert {(q, k) for q, k, _ in matrix.FORCED_SHAPES} <= at, dims
    assert {(s, s) for s in matrix.SEQLENS} <= forced
    ninety_six = [c for c in mine if c.head_dim == 96]
    assert {c.heads_q // c.heads_kv for c in ninety_six} == {1, 4, 8}
    assert {c.layout for c in ninety_six} == {"bhsd", "bshd"}
    assert any(c.num_splits > 1 for c in mine)
    assert {c.scores for c in ninety_six} == {"normal", "rising", "falling"}
    combos = {(c.window != (-1, -1), c.softcap > 0, c.sinks) for c in ninety_six}
    assert {
        (True, False, False),
        (False, True, False),
        (False, False, True),
        (True, True, True),
    } <= combos
    decode = [c for c in ninety_six if c.kind == "decode"]
    assert {(c.dtype, c.causal) for c in decode} == {
        (t, m) for t in ("fp16", "bf16") for m in (False, True)
    }
    assert all(c.cache_seqlens and c.seqlen_q > 16 for c in decode)


@pytest.mark.parametrize("config, head_dim", [(6, 64), (7, 128)])
def test_configurations_6_and_7_are_gated_at_their_own_head_dim_only(config, head_dim):
    """At head dim 128 configuration 6 runs configuration 5's kernel (the same Sm90FwdTraits), and
    at 64 configuration 7 does, so the forced cases of each, prefill, ramped and many-row decode,
    are all at the head dim where its kernel is its own; every other configuration is gated at both
    head dims."""
    wide = set(matrix.WGMMA_WIDE_HEAD_DIMS)  # one kernel for 5 to 7 there
    assert matrix.gated_head_dims(config) == (head_dim,)
    assert {c.head_dim for c in GPU_CASES if c.config == config} == {head_dim} | wide
    for other in matrix.FORCED_CONFIGS:
        if other not in (6, 7):
            assert matrix.gated_head_dims(other) == (64, 128)
            padded = {d for d, _ in matrix.WGMMA_PADDED_HEAD_DIMS}  # 5 alone runs them
            expected = {64, 128} | (wide | padded if other == 5 else set())
            assert {c.head_dim for c in GPU_CASES if c.config == other} == expected
    mine = [c for c in GPU_CASES if c.config == config]
    assert {c.kind for c in mine} == {"prefill", "decode"}
    assert {"rising", "falling"} <= {c.scores for c in mine}


@pytest.mark.parametrize("causal", [False, True])
def test_the_reference_takes_a_head_dim_of_v_of_its_own(causal):
    """The fp64 reference of a case whose v is narrower than q and k (192 and 128) is PyTorch's
    own attention in fp64 (grouped-query heads repeated), output [B, Hq, Sq, Dv]."""
    case = Case("prefill", "bf16", 2, 4, 2, 33, 33, 192, causal, head_dim_v=128)
    q, k, v, _ = make_inputs(case, "cpu")
    ref, lse = gates.attention_reference(q, k, v, causal, 0.1)
    expected = torch.nn.functional.scaled_dot_product_attention(
        *(t.double().repeat_interleave(4 // t.shape[1], dim=1) for t in (q, k, v)),
        is_causal=causal,
        scale=0.1,
    )
    assert ref.shape == (2, 4, 33, 128) and lse.shape == (2, 4, 33)
    torch.testing.assert_close(ref, expected)
    assert gates.attention_pytorch_lowp(q, k, v, causal, 0.1).shape == (2, 4, 33, 128)


def test_bshd_view_is_used_in_place():
    """A [B, H, S, D] view of a [B, S, H, D] tensor is a non-contiguous input the gates really exercise."""
    case = next(c for c in CPU_CASES if c.layout == "bshd" and c.seqlen_q > 1 and c.heads_q > 1)
    q, _, _, _ = make_inputs(case, "cpu")
    assert not q.is_contiguous() and q.stride(-1) == 1


def test_inputs_are_fresh_and_nonzero():
    a, b = CPU_CASES[3], CPU_CASES[4]
    qa, _, _, _ = make_inputs(a, "cpu")
    qb, _, _, _ = make_inputs(b, "cpu")
    assert a.seed() != b.seed()
    n = min(qa.numel(), qb.numel())
    assert not torch.equal(qa.flatten()[:n], qb.flatten()[:n])  # each case draws its own inputs
    assert qa.count_nonzero() > 0.99 * qa.numel() and torch.isfinite(qa).all()


def test_rerun_commands_require_the_gpu_and_name_the_cpu_twin():
    """A CUDA rerun that skips without a GPU would pass: it demands one (exit 255 without), names
    the same case in the CPU tier when there is one, and says when the case needs sm_90 (or an
    sm_90a build on a 9.0 GPU)."""
    from flashmoe_science.ops import SM90_ONLY_CONFIGS, SM90A_CONFIGS

    cpu_ids = {c.id for c in CPU_CASES}
    twins = [c for c in GPU_CASES if c.id in cpu_ids]
    assert twins, "some CUDA gate cases have a CPU twin"
    twin = matrix.rerun_fields(twins[0], "cuda")
    assert twin == {
        "rerun": f"FLASHMOE_REQUIRE_GPU=1 nox -s test -- -k '{twins[0].id}-cuda'",
        "rerun_cpu": f"nox -s test -- -k '{twins[0].id}-cpu'",
        "rerun_needs": None,
    }
    alone = next(c for c in GPU_CASES if c.id not in cpu_ids and c.config == 0)
    assert matrix.rerun_fields(alone, "cuda")["rerun_cpu"] is None
    sm90 = next(c for c in GPU_CASES if c.config in SM90_ONLY_CONFIGS)
    assert matrix.rerun_fields(sm90, "cuda")["rerun_needs"] == "sm_90"
    sm90a = next(c for c in GPU_CASES if c.config in SM90A_CONFIGS)
    assert matrix.rerun_fields(sm90a, "cuda")["rerun_needs"] == "an sm_90a build on a 9.0 GPU"
    on_cpu = matrix.rerun_fields(CPU_CASES[0], "cpu")
    assert on_cpu["rerun"] == f"nox -s test -- -k '{CPU_CASES[0].id}-cpu'"
    assert on_cpu["rerun_cpu"] is None


def test_each_rerun_selects_exactly_its_own_case():
    """`-k ID-DEVICE` is a substring match: no other gate id may contain a case's selector."""
    names = [f"{c.id}-cpu" for c in CPU_CASES] + [f"{c.id}-cuda" for c in GPU_CASES]
    for name in names:
        assert [n for n in names if name in n] == [name], name


def test_a_failing_cuda_case_reports_the_rerun_its_twin_and_sm90():
    from flashmoe_science.ops import SM90_ONLY_CONFIGS

    def failing(case):
        fields = {f.name: 0 for f in dataclasses.fields(gates.GateResult)}
        fields |= {"worst": (0, 0, 0, 0), "row_profile": [], "deterministic": True}
        return gates.GateResult(
            **{**fields, "case_id": case.id, "device": "cuda", "failures": ["x"]}
        )

    sm90 = next(c for c in GPU_CASES if c.config in SM90_ONLY_CONFIGS)
    report = gates.format_failure(sm90, failing(sm90))
    assert (
        f"rerun: FLASHMOE_REQUIRE_GPU=1 nox -s test -- -k '{sm90.id}-cuda' (needs sm_90)" in report
    )
    cpu_ids = {c.id for c in CPU_CASES}
    twin = next(c for c in GPU_CASES if c.id in cpu_ids)
    report = gates.format_failure(twin, failing(twin))
    assert f"rerun on the CPU (same inputs): nox -s test -- -k '{twin.id}-cpu'" in report


@pytest.mark.parametrize("has_cuda_kernels", [True])  # as on a GPU machine with the CUDA build
@pytest.mark.parametrize("head_dims", [(100, 100), (192, 132), (264, 264)], ids=str)
def test_head_dims_the_cuda_kernels_do_not_take_skip_saying_why(
    require_cuda_build, monkeypatch, head_dims
):
    """A CUDA gate case of head dims the kernels do not take skips (a skip is never counted as a
    pass) with the line the operators raise, which names them and what CUDA takes."""
    from flashmoe_science import ops

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    with pytest.raises(pytest.skip.Exception) as skipped:
        require_cuda_build(head_dim=head_dims[0], head_dim_v=head_dims[1])
    assert str(skipped.value) == ops.head_dims_unsupported_reason(*head_dims)
    assert "supported: multiples of 8 up to 256" in str(skipped.value)
    require_cuda_build(head_dim=128, head_dim_v=128)
    require_cuda_build(head_dim=96)
    require_cuda_build(head_dim=192, head_dim_v=128)
    require_cuda_build(head_dim=64)
    require_cuda_build(head_dim=192)
    require_cuda_build(head_dim=256, head_dim_v=256)


@pytest.mark.parametrize("has_cuda_kernels", [True])  # as on a GPU machine with the CUDA build
@pytest.mark.parametrize(
    ("capability", "archs", "config", "needs"),
    [
        ((8, 9), ("8.9", "9.0a"), 5, "needs an sm_90a build on a compute capability 9.0 GPU"),
        ((9, 0), ("8.9", "9.0"), 5, "needs an sm_90a build on a compute capability 9.0 GPU"),
        ((8, 9), ("8.9", "9.0a"), 6, "needs an sm_90a build on a compute capability 9.0 GPU"),
        ((8, 9), ("8.9",), 4, "is built for sm_90 and newer; this GPU is sm_89"),
    ],
)
def test_a_configuration_the_machine_cannot_run_skips_saying_what_it_needs(
    require_cuda_build, monkeypatch, capability, archs, config, needs
):
    from flashmoe_science import ops

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(ops, "built_archs", lambda: archs)
    with pytest.raises(pytest.skip.Exception) as skipped:
        require_cuda_build(config)
    assert needs in str(skipped.value)
    if config == 5:
        assert "build with --arch 9.0a" in str(skipped.value)
    # what it can run does not skip
    require_cuda_build(1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(ops, "built_archs", lambda: ("8.9", "9.0a"))
    require_cuda_build(config)
