"""One Case and one id format for the gates, the benchmark, the sanitizer and the profiler."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from flashmoe_science.pipeline import cases
from flashmoe_science.pipeline.bench import matrix as benchmatrix
from flashmoe_science.pipeline.cases import Case, make_inputs, parse_case_id
from flashmoe_science.pipeline.gates import matrix
from flashmoe_science.pipeline.tools import sanitize

EVERY_MATRIX = {
    "gates-gpu": matrix.gate_cases("gpu"),
    "gates-cpu": matrix.gate_cases("cpu"),
    "bench-gpu": benchmatrix.gpu_matrix(),
    "bench-cpu": benchmatrix.cpu_matrix(),
    # the packed and paged calls carry their gates' own case types (varlen_gates, paged_gates)
    "sanitize": [c for c in sanitize.workload_cases() if isinstance(c, Case)],
}


@pytest.mark.parametrize("name", EVERY_MATRIX)
def test_every_id_of_every_matrix_parses_back_to_its_case(name):
    matrix = EVERY_MATRIX[name]
    assert len({c.id for c in matrix}) == len(matrix), "ids must be unique within a matrix"
    for case in matrix:
        parsed = parse_case_id(case.id)
        assert parsed.id == case.id
        assert dataclasses.replace(parsed, group=case.group) == case
        # the worker protocol: a case crosses processes as JSON
        assert Case.from_dict(json.loads(json.dumps(case.to_dict()))) == case


def test_ids_stored_by_earlier_benchmark_runs_still_read():
    stored = {
        "fwd-bf16-d128-h16-b4-s4096-causal": ("prefill", 4, 16, 16, 4096, 4096, True),
        "fwd-fp16-d64-h4-b1-q16-k64-causal": ("prefill", 1, 4, 4, 16, 64, True),
        "dec-bf16-d128-h32kv8-b4-q1-k8192": ("decode", 4, 32, 8, 1, 8192, True),
    }
    for case_id, (kind, b, hq, hkv, sq, sk, causal) in stored.items():
        case = parse_case_id(case_id)
        got = (case.kind, case.batch, case.heads_q, case.heads_kv, case.seqlen_q, case.seqlen_k)
        assert (*got, case.causal) == (kind, b, hq, hkv, sq, sk, causal)
        assert (case.layout, case.config, case.num_splits, case.cache_seqlens) == (
            "bhsd",
            0,
            0,
            None,
        )
        assert case.id == case_id


def test_gate_fields_become_suffixes():
    case = Case(
        "decode",
        "fp16",
        3,
        8,
        2,
        4,
        257,
        64,
        False,
        layout="bshd",
        config=2,
        num_splits=3,
        cache_seqlens=(0, 1, 257),
    )
    assert case.id == "dec-fp16-d64-h8kv2-b3-q4-k257-full-bshd-cfg2-splits3-lens0_1_257"
    assert parse_case_id(case.id) == case
    ramped = dataclasses.replace(case, scores="falling")
    assert ramped.id == case.id + "-falling" and parse_case_id(ramped.id) == ramped
    assert "scores=falling" in ramped.describe()


def test_a_head_dim_of_v_of_its_own_reads_in_the_id_and_shapes_v():
    """v's head dim, where it differs from q's and k's, follows d in the id (d192v128); equal to
    q's it is the plain case. v, the output gradient, FLOPs and bytes take it."""
    case = Case("backward", "bf16", 2, 4, 2, 16, 24, 192, True, layout="bshd", head_dim_v=128)
    assert case.id == "bwd-bf16-d192v128-h4kv2-b2-q16-k24-causal-bshd"
    assert parse_case_id(case.id) == case and "D=192 Dv=128" in case.describe()
    assert Case.from_dict(json.loads(json.dumps(case.to_dict()))) == case
    same = dataclasses.replace(case, head_dim=128)
    assert "head_dim_v" not in same.to_dict()  # the worker protocol's dict, as it always was
    assert same.head_dim_v == 0 and same.id == "bwd-bf16-d128-h4kv2-b2-q16-k24-causal-bshd"
    q, k, v, _ = make_inputs(case, "cpu")
    assert (q.shape[-1], k.shape[-1], v.shape[-1]) == (192, 192, 128) and v.stride(-1) == 1
    assert cases.make_output_grad(case, "cpu").shape == (2, 4, 16, 128)
    plain = dataclasses.replace(case, head_dim_v=0)
    assert case.flops == plain.flops * (192 + 128) // (2 * 192)
    assert case.kv_bytes == 2 * 2 * 24 * (192 + 128) * cases.ELEMENT_BYTES
    assert same.kv_bytes == 2 * 2 * 2 * 24 * 128 * cases.ELEMENT_BYTES


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_ramped_scores_spread_sixteenfold_along_the_keys_in_the_layout_asked(layout):
    normal = parse_case_id(f"fwd-fp16-d64-h4kv2-b2-s1000-full-{layout}".replace("-bhsd", ""))
    spread = {}
    for scores in ("rising", "falling"):
        case = dataclasses.replace(normal, scores=scores)
        q, k, v, _ = make_inputs(case, "cpu")
        plain = make_inputs(dataclasses.replace(case, scores="normal"), "cpu", seed=case.seed())
        assert torch.equal(q, plain.q) and torch.equal(v, plain.v)  # only k is ramped
        assert k.stride() == plain.k.stride()  # the layout is kept
        spread[scores] = (k[..., :100, :].float().std(), k[..., -100:, :].float().std())
    assert spread["rising"][1] > 8 * spread["rising"][0]
    assert spread["falling"][0] > 8 * spread["falling"][1]
    with pytest.raises(ValueError, match="scores='peaked'"):
        dataclasses.replace(normal, scores="peaked")


def test_an_older_workers_case_dict_still_reads():
    """What a head from before the gate fields existed sends to a worker."""
    old = {
        "kind": "decode",
        "dtype": "bf16",
        "batch": 4,
        "heads_q": 8,
        "heads_kv": 2,
        "seqlen_q": 1,
        "seqlen_k": 1024,
        "head_dim": 128,
        "causal": True,
        "group": "decode",
    }
    assert Case.from_dict({**old, "unknown": 1}).id == "dec-bf16-d128-h8kv2-b4-q1-k1024"


@pytest.mark.parametrize(
    ("case_id", "message"),
    [
        ("fwd-fp32-d64-h1-b1-s1-full", "dtype 'fp32'"),
        ("fwd-fp16-d64-h1-b1-s1", "-causal or -full"),
        ("dec-fp16-d64-h1-b1-q1-k9-causal", "decode is causal unless"),
        ("dec-fp16-d64-h1-b2-q1-k9-lens3", "1 lengths for batch 2"),
        ("fwd-fp16-d64-b2-h8x2-sq65-sk257-causal", "expected e.g."),
    ],
)
def test_bad_ids_say_what_is_wrong(case_id, message):
    with pytest.raises(ValueError, match="bad case id") as err:
        parse_case_id(case_id)
    assert message in str(err.value)


def test_bad_fields_name_the_argument():
    with pytest.raises(ValueError, match=r"Case kind='fwd' is not supported: use one of"):
        Case("fwd", "fp16", 1, 1, 1, 1, 1, 64, False)
    with pytest.raises(ValueError, match="layout='sbhd'"):
        Case("prefill", "fp16", 1, 1, 1, 1, 1, 64, False, layout="sbhd")
    with pytest.raises(ValueError, match="group='tiny'"):
        Case("prefill", "fp16", 1, 1, 1, 1, 1, 64, False, group="tiny")


def test_inputs_are_seeded_per_case_fresh_nonzero_and_the_same_on_every_device(monkeypatch):
    case = parse_case_id("fwd-bf16-d64-h4kv2-b2-q17-k33-causal-bshd")
    x = make_inputs(case, "cpu")
    assert x.q.shape == (2, 4, 17, 64) and x.k.shape == (2, 2, 33, 64)
    assert not x.q.is_contiguous() and x.q.stride(-1) == 1  # a view of [B, S, H, D]
    assert x.q.dtype == torch.bfloat16 and x.q.count_nonzero() > 0.99 * x.q.numel()
    assert not torch.equal(x.k, x.v)
    again = make_inputs(case, "cpu")
    assert torch.equal(x.q, again.q)  # the seed is the case's
    monkeypatch.setenv(cases.SEED_VAR, "1")
    assert not torch.equal(x.q, make_inputs(case, "cpu").q)
    lengths = make_inputs(parse_case_id("dec-fp16-d64-h2-b2-q1-k9-lens9_0"), "cpu").cache_seqlens
    assert lengths.dtype == torch.int32 and lengths.tolist() == [9, 0]


def test_large_inputs_are_drawn_on_the_device(monkeypatch):
    """Benchmark caches of GBs are drawn where they live; small ones on the CPU, so a case has the
    same numbers on every device."""
    where = []
    real_randn = torch.randn

    def spy(*args, **kwargs):
        where.append(kwargs.get("device", "cpu-then-moved"))
        return real_randn(*args, **kwargs)

    monkeypatch.setattr(cases.torch, "randn", spy)
    case = parse_case_id("fwd-fp16-d64-h1-b1-s4-full")
    assert cases.input_bytes(case) == 3 * 4 * 64 * 2
    monkeypatch.setattr(cases, "DRAW_ON_CPU_MAX_BYTES", 3 * 4 * 64 * 2)
    make_inputs(case, "cpu")
    monkeypatch.setattr(cases, "DRAW_ON_CPU_MAX_BYTES", 100)
    make_inputs(case, "cpu")
    assert where == ["cpu-then-moved"] * 3 + ["cpu"] * 3


def test_window_softcap_and_sinks_read_in_the_id_and_leave_older_dicts_alone():
    case = Case(
        "decode", "bf16", 2, 8, 2, 1, 300, 64, True, window=(63, 5), softcap=2.5, sinks=True
    )
    assert case.window == (63, 0)  # causal's right side
    assert case.id == "dec-bf16-d64-h8kv2-b2-q1-k300-win63_0-cap2.5-sinks"
    assert "window_size=(63, 0) softcap=2.5 sinks" in case.describe()
    assert parse_case_id(case.id) == case
    assert Case.from_dict(json.loads(json.dumps(case.to_dict()))) == case
    plain = dataclasses.replace(case, window=(-1, -1), softcap=0.0, sinks=False)
    assert not {"window", "softcap", "sinks"} & set(plain.to_dict())  # the worker protocol's dict
    full = dataclasses.replace(case, causal=False, window=(-1, 7))
    assert full.id.endswith("-full-wininf_7-cap2.5-sinks") and parse_case_id(full.id) == full
    assert dataclasses.replace(case, window=(-1, 4)).window == (-1, -1)  # causal itself
    with pytest.raises(ValueError, match="window=\\(-2, 0\\) is not supported"):
        dataclasses.replace(case, window=(-2, 0))
    sinks = cases.make_sinks(case, "cpu")
    assert sinks.dtype == torch.float32 and sinks.shape == (8,)
    assert torch.equal(sinks, cases.make_sinks(case, "cpu"))
    assert cases.make_sinks(plain, "cpu") is None
