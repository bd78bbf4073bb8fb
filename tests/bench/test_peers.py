"""FlashAttention-3 and -4 as optional baselines (pipeline.bench.peers): not installed, on a card
they do not run on, and (through test doubles put in sys.modules in their place, computing
attention with torch ops in their [B, S, H, D] layout) timed in the same rounds as ours with their
columns, ratios and geomeans in bench.json and bench.md. The real packages are not needed."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from flashmoe_science.pipeline.bench import measure, peers, targets, timing
from flashmoe_science.pipeline.bench import records as benchrecords
from flashmoe_science.pipeline.bench import summary as benchmd
from flashmoe_science.pipeline.bench.baselines import our_call
from flashmoe_science.pipeline.bench.records import NOT_INSTALLED, Measured, NotMeasured
from flashmoe_science.pipeline.cases import make_inputs, parse_case_id
from flashmoe_science.pipeline.paths import REPO_ROOT

MODULES = ("flash_attn_interface", "flash_attn", "flash_attn.cute")


def flash_attn_func(returns_lse: bool, calls: list):
    """A stand-in for a peer's flash_attn_func: q [B, Sq, H, D], k and v [B, Sk, Hkv, D], causal
    aligned bottom-right; the output (FA3) or (output, lse) (FA4)."""

    def attention(q, k, v, softmax_scale=None, causal=False, **kwargs):
        assert q.stride(-1) == 1 and not kwargs, "their layout, no options but causal"
        calls.append(tuple(q.shape))
        group = q.shape[2] // k.shape[2]
        qt, kt, vt = (t.transpose(1, 2).float() for t in (q, k, v))
        kt, vt = kt.repeat_interleave(group, 1), vt.repeat_interleave(group, 1)
        sq, sk = q.shape[1], k.shape[1]
        mask = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq) if causal else None
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=softmax_scale)
        out = out.to(q.dtype).transpose(1, 2)
        return (out, None) if returns_lse else out

    return attention


@pytest.fixture
def no_peers(monkeypatch):
    """Neither peer can be imported, whatever this machine has installed."""
    for name in MODULES:
        monkeypatch.setitem(sys.modules, name, None)


@pytest.fixture
def fake_peers(monkeypatch):
    """Test doubles importable as flash_attn_interface and flash_attn.cute, on an sm_90 card;
    returns the shapes each was called with."""
    calls = {"fa3": [], "fa4": []}
    fa3 = types.ModuleType("flash_attn_interface")
    fa3.flash_attn_func = flash_attn_func(False, calls["fa3"])
    package = types.ModuleType("flash_attn")
    package.__path__ = []
    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_func = flash_attn_func(True, calls["fa4"])
    package.cute = cute
    for name, module in zip(MODULES, (fa3, package, cute), strict=True):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(peers, "capability", lambda device: (9, 0))
    return calls


def test_the_peers_are_the_records_columns():
    assert tuple(peers.PEERS) == benchrecords.PEER_NAMES
    assert {name: p.module for name, p in peers.PEERS.items()} == {
        "fa3": "flash_attn_interface",
        "fa4": "flash_attn.cute",
    }


def test_a_peer_that_does_not_import_is_not_installed_with_the_import_error(no_peers, monkeypatch):
    found = peers.availability("cpu")
    assert [fn for fn, _ in found.values()] == [None, None]
    fa3, fa4 = (reason for _, reason in found.values())
    assert fa3.startswith(f"{NOT_INSTALLED}: ModuleNotFoundError: import of flash_attn_interface")
    assert fa4.startswith(f"{NOT_INSTALLED}: ModuleNotFoundError") and "flash-attn-4" in fa4

    def broken(name):  # a wheel built against another CUDA or torch
        raise OSError("libcudart.so.12: cannot open shared object file")

    monkeypatch.setattr(peers.importlib, "import_module", broken)
    _, reason = peers.availability("cuda")["fa4"]
    assert reason.startswith(f"{NOT_INSTALLED}: OSError: libcudart.so.12: cannot open shared")
    # a module of that name without the function is not the peer
    monkeypatch.setattr(peers.importlib, "import_module", lambda name: types.ModuleType(name))
    _, reason = peers.availability("cuda")["fa3"]
    assert reason.startswith(f"{NOT_INSTALLED}: flash_attn_interface has no flash_attn_func")


@pytest.mark.parametrize(
    ("found", "fa3", "fa4"),
    [
        (None, "a CUDA GPU of sm_90; this run is on the CPU", "a CUDA GPU of sm_90 or newer"),
        ((8, 9), "sm_90; this card is sm_89", "sm_90 or newer; this card is sm_89"),
        ((9, 0), None, None),
        ((10, 0), "sm_90; this card is sm_100", None),
    ],
)
def test_a_peer_runs_only_on_the_cards_it_supports(fake_peers, monkeypatch, found, fa3, fa4):
    monkeypatch.setattr(peers, "capability", lambda device: found)
    got = peers.availability("cuda")
    for name, label, needs in (("fa3", "FlashAttention-3", fa3), ("fa4", "FlashAttention-4", fa4)):
        fn, reason = got[name]
        if needs is None:
            assert callable(fn) and reason is None
        else:
            assert fn is None and reason.startswith(f"{label} needs {needs}")
    lines = peers.status_lines("cuda")
    assert [line.split("|")[:2] for line in lines] == [
        ["WARN" if fa3 else "ok", "fa3"],
        ["WARN" if fa4 else "ok", "fa4"],
    ]


@pytest.mark.parametrize(
    "case_id", ["fwd-bf16-d64-h4kv2-b2-q48-k80-causal", "bwd-bf16-d64-h4kv2-b2-s64-causal"]
)
def test_a_peer_call_computes_our_attention_in_its_layout(fake_peers, case_id):
    """The copies to [B, S, H, D], GQA, the bottom-right causal mask and (backward) the output's
    gradient in that layout: the peer's forward and gradients match ours."""
    case = parse_case_id(case_id)
    x = make_inputs(case, "cpu")
    for name in ("fa3", "fa4"):
        fn, _ = peers.availability("cpu")[name]
        theirs, ours = peers.peer_call(fn, case, x)(), our_call(case, x)()
        if case.kind == "prefill":
            theirs, ours = [theirs], [ours]
        for a, b in zip(theirs, ours, strict=True):
            assert a.shape == b.transpose(1, 2).shape
            torch.testing.assert_close(a.transpose(1, 2).float(), b.float(), atol=3e-2, rtol=3e-2)
    assert fake_peers["fa3"] and fake_peers["fa4"]


class FlatTimer:
    """Times nothing: every call 1 ms; counts the calls timed per callable."""

    method, flush_bytes = "fake", 0

    def __init__(self):
        self.timed: dict = {}

    def warm(self, fn, count):
        pass

    def time(self, fn, count, flush=True):
        self.timed[fn] = self.timed.get(fn, 0) + 1
        return [1.0] * count


def run(case_id: str):
    config = timing.TimingConfig.for_device("cpu", retakes=0)
    timer = FlatTimer()
    return measure.run_case(parse_case_id(case_id), "cpu", timer, config, {}, True), timer


def test_peers_are_timed_in_the_rounds_of_ours_and_shown_with_their_ratios(fake_peers, monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    prefill, timer = run("fwd-bf16-d64-h2-b2-s512-causal")
    # ours, SDPA flash and default (cuDNN and efficient refuse the CPU), FA3, FA4: each timed in
    # every round (an estimate and a timing a round)
    assert sorted(timer.timed.values()) == [2 * measure.ROUNDS] * 5
    for name in ("fa3", "fa4"):
        assert isinstance(prefill.baselines[name], Measured)
        assert prefill.baselines[name].ratio == 1.0 and prefill.baselines[name].samples_ms is None
    backward, _ = run("bwd-bf16-d64-h2-b2-s512-causal")
    decode, _ = run("dec-bf16-d64-h4kv2-b2-q1-k512")
    assert set(backward.baselines) >= {"fa3", "fa4"} and "fa3" not in decode.baselines
    doc = benchrecords.to_json(prefill)
    assert benchrecords.case_from_json(doc) == prefill
    record = benchrecords.load(REPO_ROOT / "tests/fixtures/report/passing/bench.json")
    record.cases = [prefill, backward, decode]
    assert benchrecords.schema_errors(benchrecords.to_json(record)) == []
    text = benchmd.render_markdown(record)
    assert "| vs flash | vs cudnn | vs efficient | vs default | vs fa3 | vs fa4 |" in text
    geomeans = {(p.peer, p.group): p for p in targets.peer_geomeans(record)}
    assert set(geomeans) == {(p, g) for p in ("fa3", "fa4") for g in ("prefill", "backward")}
    assert geomeans["fa4", "backward"].ratio == 1.0 and geomeans["fa4", "backward"].measured == 1
    assert "| FlashAttention-4 | backward | 1 of 1 | 1.00x | - |" in text


def test_a_peer_not_installed_is_a_column_that_says_so(no_peers, monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    case, timer = run("fwd-bf16-d64-h2-b2-s512-causal")
    assert len(timer.timed) == 3, "ours and SDPA's two CPU kernels: nothing of the peers"
    for name in ("fa3", "fa4"):
        result = case.baselines[name]
        assert isinstance(result, NotMeasured) and result.status == "unsupported"
        assert result.reason.startswith(NOT_INSTALLED)
    record = benchrecords.load(REPO_ROOT / "tests/fixtures/report/passing/bench.json")
    record.cases = [case]
    text = benchmd.render_markdown(record)
    row = next(line for line in text.splitlines() if line.startswith(f"| {case.id} |"))
    assert row.count(f"| {NOT_INSTALLED} |") == 1 and row.count(NOT_INSTALLED) == 2
    assert f"fa3 unsupported: {NOT_INSTALLED}: ModuleNotFoundError" in text
    fa3, _ = targets.peer_geomeans(record)
    assert fa3.ratio is None and fa3.reason.startswith(f"{NOT_INSTALLED}: ModuleNotFoundError")
    assert f"| FlashAttention-3 | prefill | 0 of 1 | - | {NOT_INSTALLED}: ModuleNotFound" in text
    # an older record, without the columns, shows neither
    for c in record.cases:
        del c.baselines["fa3"], c.baselines["fa4"]
    assert "vs fa3" not in benchmd.render_markdown(record) and not targets.peer_geomeans(record)
