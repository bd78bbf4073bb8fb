"""The kernels a gate case runs (flashmoe_science.pipeline.gates.kernels) and the restricted builds
that hold them (a sanitizer run over a few kernels, `build --only`)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from flashmoe_science import _loader
from flashmoe_science.pipeline.cases import parse_case_id
from flashmoe_science.pipeline.gates import backward as grad_gates
from flashmoe_science.pipeline.gates import forward as gates
from flashmoe_science.pipeline.gates import kernels, matrix
from flashmoe_science.pipeline.gates import paged as paged_gates
from flashmoe_science.pipeline.gates import varlen as varlen_gates

ALL_GATE_CASES = [
    *matrix.gate_cases("gpu"),
    *matrix.backward_cases("gpu"),
    *varlen_gates.varlen_cases("gpu"),
    *paged_gates.paged_cases("gpu"),
]
# The wgmma plants' cases (tests/gates/test_gate_plants.py): each forced onto configuration 5, 6
# or 7, split automatically.
SM90A_PLANT_CASES = (
    "fwd-bf16-d128-h8kv2-b2-s1000-causal-cfg5",
    "fwd-bf16-d64-h8kv1-b2-s1000-causal-cfg6",
    "fwd-fp16-d128-h8kv2-b2-s1000-full-cfg7",
    "dec-bf16-d64-h48kv6-b3-q65-k300-full-cfg6-lens101_299_300",
)


@pytest.mark.parametrize(
    "case_id, needs",
    [
        ("fwd-bf16-d128-h8-b2-s129-full-cfg5", {("fwd_sm90a", 5), ("combine", 0)}),
        ("fwd-bf16-d128-h8-b2-s129-full-cfg2-splits1", {("fwd", 2)}),
        ("dec-fp16-d64-h8kv2-b2-q1-k1000-cfg3-splits7", {("decode", 3)}),  # combines its own
        (
            "dec-fp16-d64-h8kv2-b2-q1-k1000-splits7",
            {("fwd", None), ("decode", None), ("fwd_sm90a", None), ("combine", 0)},
        ),
        (
            "bwd-fp16-d64-h8-b2-s129-full-cfg3",
            {("fwd", None), ("decode", None), ("fwd_sm90a", None), ("combine", 0)}
            | {("bwd_sm90a", 3)},
        ),
        (
            "fwdbwd-fp16-d64-h8-b2-s129-full",
            {("fwd", None), ("decode", None), ("fwd_sm90a", None), ("combine", 0)}
            | {("bwd", None), ("bwd_sm90a", None)},
        ),
    ],
)
def test_a_case_needs_the_kernel_of_its_configuration_and_splits(case_id, needs):
    case = parse_case_id(case_id)
    assert kernels.needs(case) == {(op, case.dtype, case.head_dim, c) for op, c in needs}


def test_the_combine_of_a_narrower_v_is_the_outputs_width():
    """Under q's and k's 192 with v's 128 the split-KV combine runs at 128 (the output's width): a
    build restricted to 192 lacks it, so its gates and sanitize calls with splits are not run there
    (they failed with "not the combine kernel for bf16, head_dim 128" on an H100)."""
    split = parse_case_id("fwd-bf16-d192v128-h8kv2-b2-q113-k203-causal-cfg5")
    assert kernels.needs(split) == {("fwd_sm90a", "bf16", 192, 5), ("combine", "bf16", 128, 0)}
    backward = parse_case_id("bwd-bf16-d192v128-h8-b2-s1000-causal-cfg2")
    assert ("combine", "bf16", 128, 0) in kernels.needs(backward)
    only_192 = _loader.Restriction(head_dim=(192,))
    assert not kernels.holds(only_192, kernels.needs(split))
    assert kernels.holds(_loader.Restriction(head_dim=(128, 192)), kernels.needs(split))
    unsplit = parse_case_id("fwd-bf16-d192v128-h8-b2-s512-causal-cfg5-splits1")
    assert kernels.holds(only_192, kernels.needs(unsplit))


def test_varlen_and_paged_cases_need_their_kernel_and_the_dense_cross_check():
    varlen = dataclasses.replace(varlen_gates.varlen_cases("gpu")[0], config=4)
    assert ("varlen", varlen.dtype, varlen.head_dim, 4) in kernels.needs(varlen)
    paged = paged_gates.paged_cases("gpu")[0]
    assert ("paged", paged.dtype, paged.head_dim, 3) in kernels.needs(paged)
    for case in (varlen, paged):  # the gate's own call of our dense forward, automatic
        assert ("fwd", case.dtype, case.head_dim, None) in kernels.needs(case)


def _calls_needs(calls) -> set:
    """What each recorded call of the public API runs, as kernels.Need rows."""
    needs = set()
    for name, q, kwargs in calls:
        dtype, head_dim = (
            {"torch.float16": "fp16", "torch.bfloat16": "bf16"}[str(q.dtype)],
            q.size(-1),
        )
        config, splits = kwargs.get("config", 0), kwargs.get("num_splits") or 0
        if name == "flash_attention_varlen_forward":
            needs.add(("varlen", dtype, head_dim, config or None))
        elif kwargs.get("block_table") is not None:
            needs.add(("paged", dtype, head_dim, 3))
        else:
            needs |= kernels.forward_needs(dtype, head_dim, config, splits)
        if q.requires_grad:
            needs |= kernels.backward_needs(dtype, head_dim, kwargs.get("backward_config", 0))
    return needs


@pytest.fixture
def recorded_calls(monkeypatch):
    """Every call of the public API the gates make, recorded (the CPU operators run it)."""
    from flashmoe_science import ops

    calls = []
    for name in (
        "flash_attention_forward",
        "flash_attention_decode",
        "flash_attention_varlen_forward",
    ):
        real = getattr(ops, name)
        signature = inspect.signature(real)

        def record(*args, _real=real, _name=name, _signature=signature, **kwargs):
            bound = _signature.bind(*args, **kwargs)
            calls.append((_name, bound.arguments["q"], bound.arguments))
            return _real(*args, **kwargs)

        monkeypatch.setattr(ops, name, record)
    return calls


@pytest.mark.parametrize(
    "check, case",
    [
        (gates.check_case, matrix.gate_cases("cpu")[0]),
        (gates.check_case, parse_case_id("dec-bf16-d64-h8kv2-b2-q1-k100-splits3-lens100_33")),
        (grad_gates.check_case, next(matrix.backward_cases("cpu"))),
        (varlen_gates.check_varlen_case, varlen_gates.varlen_cases("cpu")[0]),
        (paged_gates.check_paged_case, paged_gates.paged_cases("cpu")[0]),
    ],
    ids=lambda value: getattr(value, "id", getattr(value, "__module__", "")).split(".")[-1],
)
def test_a_case_needs_every_kernel_its_gate_calls(recorded_calls, check, case):
    """Each gate run on the CPU, with the public API's calls recorded: what those calls run on
    CUDA is among the case's needs (the restricted build of a plant holds it)."""
    check(case, "cpu")
    assert recorded_calls
    assert _calls_needs(recorded_calls) <= kernels.needs(case)


def test_the_restriction_of_some_cases_holds_them_and_no_less():
    """restriction_for holds every need it is given, and each value it keeps is some need's."""
    for chosen in (ALL_GATE_CASES[:40:7], ALL_GATE_CASES[-60::11], SM90A_PLANT_CASES):
        cases = [kernels.gate_case(c) if isinstance(c, str) else c for c in chosen]
        wanted = {need for case in cases for need in kernels.needs(case)}
        restriction = kernels.restriction_for(wanted)
        assert kernels.holds(restriction, wanted)
        for key in _loader.ONLY_KEYS:
            for value in getattr(restriction, key) or ():
                narrower = dataclasses.replace(
                    restriction, **{key: tuple(v for v in getattr(restriction, key) if v != value)}
                )
                assert not kernels.holds(narrower, wanted), (key, value)


def test_the_sm90a_plants_build_the_wgmma_forward_and_the_combine_only():
    restriction = kernels.restriction_for_cases(map(kernels.gate_case, SM90A_PLANT_CASES))
    assert restriction.text() == "op=fwd_sm90a,combine head_dim=64,128 config=5,6,7"
    assert not restriction.holds("fwd", "bf16", 128, 2)
    assert not restriction.holds("bwd_sm90a", "bf16", 128, 3)


def test_every_gate_case_is_found_by_its_id():
    cases = ALL_GATE_CASES + varlen_gates.varlen_cases("cpu") + paged_gates.paged_cases("cpu")
    for case in cases[::5]:
        assert kernels.gate_case(case.id) == case
    with pytest.raises(ValueError, match="no varlen or paged gate case has the id 'varlen-x'"):
        kernels.gate_case("varlen-x")


def test_a_restricted_build_runs_the_gates_it_holds_and_skips_the_rest_saying_why(monkeypatch):
    """A CUDA gate on a restricted build (FLASHMOE_BUILD_ONLY, or FLASHMOE_ONLY_* defines) skips,
    naming a kernel the build left out, where its case runs one (a backward gate's automatic
    forward may take the mma.sync or the decode kernel); the full build skips none of the matrix."""
    full = _loader.Restriction()
    assert not [case.id for case in ALL_GATE_CASES if kernels.outside_reason(case, full)]

    wide = parse_case_id("bwd-bf16-d256-h8-b2-s129-full")
    narrow = parse_case_id("bwd-bf16-d64-h8-b2-s129-full")
    by_op = _loader.Restriction.parse("op=fwd_sm90a,bwd_sm90a head_dim=192,256")
    assert kernels.outside_reason(wide, by_op) == (
        "outside this restricted build ('op=fwd_sm90a,bwd_sm90a head_dim=192,256'): the case "
        "also runs bwd (bf16, head_dim 256), combine (bf16, head_dim 256), decode (bf16, "
        "head_dim 256), fwd (bf16, head_dim 256); unset FLASHMOE_BUILD_ONLY and rebuild for the "
        "whole matrix"
    )
    by_dim = _loader.Restriction.parse("head_dim=192,256")
    assert kernels.outside_reason(wide, by_dim) is None
    assert "bwd (bf16, head_dim 64)" in kernels.outside_reason(narrow, by_dim)
    forced = parse_case_id("bwd-bf16-d256-h8-b2-s129-full-cfg3")
    assert "also runs combine (bf16, head_dim 256), decode" in kernels.outside_reason(forced, by_op)
    split_v = parse_case_id("bwd-bf16-d192v128-h8-b2-s129-full")  # its combine is v's width
    assert "also runs combine (bf16, head_dim 128);" in kernels.outside_reason(split_v, by_dim)

    monkeypatch.setenv(_loader.ONLY_VAR, "head_dim=192,256 dtype=bf16")
    assert _loader.build_restriction().text() == "head_dim=192,256 dtype=bf16"
    monkeypatch.delenv(_loader.ONLY_VAR)
    monkeypatch.setenv(_loader.DEFINES_VAR, "FLASHMOE_ONLY_HEAD_DIMS=64")
    assert _loader.build_restriction().text() == "head_dim=64"
    assert _loader.build_restriction(()).text() == ""
