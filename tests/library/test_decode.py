"""Split-KV decode beyond the gate matrix: split against unsplit, the combine step on its own, and
planted split bugs (an off-by-one split boundary, a combine that double-counts a split) that a gate
must catch."""

from __future__ import annotations

import math

import pytest
import torch

from flashmoe_science import flash_attention_decode, split_kv_combine

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def decode_inputs(
    device, seqlen_k=3000, batch=2, heads_q=16, heads_kv=4, seqlen_q=1, dtype=torch.bfloat16
):
    g = torch.Generator().manual_seed(seqlen_k)
    q = torch.randn(batch, heads_q, seqlen_q, 128, generator=g).to(device, dtype)
    k = torch.randn(batch, heads_kv, seqlen_k, 128, generator=g).to(device, dtype)
    v = torch.randn(batch, heads_kv, seqlen_k, 128, generator=g).to(device, dtype)
    lens = torch.tensor([seqlen_k, seqlen_k // 3 + 5][:batch], dtype=torch.int32, device=device)
    return q, k, v, lens


# The CUDA decode's automatic split count on a 132-SM card for grids measured on the H100 and the
# H200 (benches/notes/decode.md, v4.0, v4.7): tiles = batch x KV heads, n_blocks = keys / 64.
@pytest.mark.parametrize(
    ("tiles", "n_blocks", "splits"),
    [
        (8, 256, 16),  # B=1, Hkv=8, 16k keys: 16 splits of 16 blocks (15 would leave up to 18)
        (8, 512, 16),  # 32k keys: 16 splits in one wave, not 32 in two
        (8, 1024, 16),  # 64k
        (32, 64, 4),  # B=1, Hkv=32, 4k keys: one wave
        (32, 256, 4),
        (32, 16, 4),  # 1k keys: no split shorter than 4 blocks
        (1, 1024, 128),  # one head: as many splits as allowed
        (106, 4096, 1),  # a grid that fills 80% of the machine is not split
        (128, 256, 1),  # B=16, Hkv=8, 16k keys (one wave): unsplit (0.985x of the read floor)
        (264, 512, 1),  # two waves: unsplit
        # More than two waves of long streams (B=16, Hkv=32, on the H200, decode.md v4.7):
        (512, 64, 4),  # 4k keys: 0.906x of the read floor unsplit, 0.927x in four
        (512, 128, 4),  # 8k: 0.88x, 0.93x
        (512, 512, 4),  # 32k: 0.90x, 0.92x
        (512, 16, 1),  # 1k keys: 0.943x unsplit, 0.893x in four
    ],
)
def test_decode_split_count(tiles, n_blocks, splits):
    from flashmoe_science import ops

    assert ops.decode_num_splits(tiles, 132, n_blocks) == splits


def test_decode_split_count_keeps_splits_whole_and_in_one_wave():
    """Over a sweep of small grids the pick never leaves a split shorter than 4 blocks, and never
    takes a second wave whose splits are no shorter than one wave's."""
    from flashmoe_science import ops

    for tiles in (1, 2, 3, 5, 8, 16, 24, 32, 64, 100):
        for n_blocks in (1, 3, 4, 16, 63, 64, 65, 255, 256, 1000, 4096):
            s = ops.decode_num_splits(tiles, 132, n_blocks)
            assert 1 <= s <= 128 and (s == 1 or n_blocks // s >= 4), (tiles, n_blocks, s)
            one_wave = max(x for x in range(1, s + 1) if tiles * x <= 132 or x == 1)
            if tiles * s > 132 and tiles <= 132:
                assert math.ceil(n_blocks / s) < math.ceil(n_blocks / one_wave), (tiles, n_blocks)


@pytest.mark.parametrize(
    ("args", "name"),
    [((0, 132, 10), "tiles"), ((8, 0, 10), "sm_count"), ((8, 132, -1), "n_blocks")],
)
def test_decode_split_count_rejects_bad_counts(args, name):
    from flashmoe_science import ops

    with pytest.raises(ValueError, match=name):
        ops.decode_num_splits(*args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", [2, 3, 7, 16])
def test_split_matches_unsplit(device, splits):
    """FlashAttention's split-KV benchmark flags max > 2e-3 or mean > 1e-4 in bf16."""
    q, k, v, lens = decode_inputs(device)
    one = flash_attention_decode(q, k, v, lens, num_splits=1)
    split = flash_attention_decode(q, k, v, lens, num_splits=splits)
    diff = (one.float() - split.float()).abs()
    assert diff.max() <= 2e-3 and diff.mean() <= 1e-4, (float(diff.max()), float(diff.mean()))


@pytest.mark.parametrize("device", DEVICES)
def test_one_split_is_the_unsplit_path(device):
    """num_splits=1 is bit-identical to the forward (unsplit) path."""
    q, k, v, _ = decode_inputs(device, seqlen_k=1500, batch=1)
    from flashmoe_science import flash_attention_forward

    a = flash_attention_decode(q, k, v, None, num_splits=1)
    b = flash_attention_forward(q, k, v, causal=True, num_splits=1)
    assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("splits", [5, 37])
def test_combine_alone(device, dtype, splits):
    """Synthetic partials: splits of very different magnitude, and splits with no valid key (-inf).
    With 37 splits the CUDA combine reads them in three chunks (16 at a time): a row whose first
    chunk is all empty, and a row whose largest split comes in the last chunk, so every earlier
    chunk must be rescaled."""
    g = torch.Generator().manual_seed(7)
    b, h, sq, d = 2, 3, 4, 64
    out_p = torch.randn(splits, b, h, sq, d, generator=g)
    lse_p = torch.randn(splits, b, h, sq, generator=g) * 30  # magnitudes e^-90 .. e^90 apart
    lse_p[1] = -math.inf  # an empty split
    lse_p[:, 0, 0, 0] = -math.inf  # a row where every split is empty
    out_p[1] = float("nan")  # an empty split's output must not leak in, even as NaN * 0
    if splits > 32:
        lse_p[:16, 1, 0, 0] = -math.inf  # the first chunk holds no key
        out_p[:16, 1, 0, 0] = float("nan")
        lse_p[-1, 1, 1, 1] = lse_p[:, 1, 1, 1].max() + 20  # the last chunk dominates
    out, lse = split_kv_combine(out_p.to(device), lse_p.to(device), dtype)
    ref_lse = torch.logsumexp(lse_p, dim=0)
    weights = torch.exp(lse_p - ref_lse).nan_to_num(0.0)
    ref = (weights.unsqueeze(-1) * out_p.nan_to_num(0.0)).sum(0)
    ref[0, 0, 0] = 0
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float().cpu(), ref, atol=1e-2, rtol=1e-2)
    finite = torch.isfinite(ref_lse)
    assert torch.isinf(lse.cpu()[~finite]).all()
    torch.testing.assert_close(lse.cpu()[finite], ref_lse[finite], atol=1e-4, rtol=1e-5)


PLANT_SCRIPT = """
import json, sys
from flashmoe_science import ops
from flashmoe_science.pipeline.gates import forward as gates
from flashmoe_science.pipeline.cases import parse_case_id
cases = [parse_case_id(case_id) for case_id in sys.argv[2:]]
print(json.dumps({"planted": ops.planted_bug(),
                  "failures": [gates.check_case(c, sys.argv[1]).failures for c in cases]}))
"""
# 7 splits: the off-by-one drops 6 of 1000 keys, beyond bf16's error floor whatever the seed
# (with 3 splits, 2 dropped keys stayed under gate 2's bound for some seeds)
SPLIT_PLANT_CASES = (
    "dec-bf16-d64-h8kv2-b2-q1-k1000-splits7-lens1000_333",
    "dec-fp16-d128-h8-b1-q4-k4096-splits7",
)
# the decode kernel runs the cases above; on CUDA the forward kernel's split path too
CUDA_SPLIT_PLANT_CASES = ("fwd-bf16-d128-h4-b1-q16-k2000-causal-cfg2-splits5",)


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bug", [1, 2], ids=["split-boundary-off-by-one", "combine-double-counts"])
def test_planted_split_bug_fails_a_gate(device, bug, run_planted):
    """Build the unit with a planted split bug (-DFLASHMOE_PLANT_BUG=N) and show the gates catch it."""
    case_ids = SPLIT_PLANT_CASES + (CUDA_SPLIT_PLANT_CASES if device == "cuda" else ())
    for failures in run_planted(bug, PLANT_SCRIPT, device, *case_ids)["failures"]:
        assert any(f.startswith(("gate 1", "gate 2")) for f in failures), failures


def test_honest_build_has_no_planted_bug():
    from flashmoe_science import ops

    assert ops.planted_bug() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_combine_counters_across_calls_streams_and_graphs():
    """The decode kernel's last split combines the partials, found through per-tile arrival
    counters that must be zero before every launch: back-to-back calls, a second stream and a
    CUDA graph replay (cache_seqlens included: its values cannot be checked on the host while
    capturing) must all give the bit-identical result of the first call."""
    q, k, v, lens = decode_inputs("cuda", seqlen_k=9000, batch=2, heads_q=32, heads_kv=8)
    first = flash_attention_decode(q, k, v, lens, num_splits=7)
    for _ in range(3):
        assert torch.equal(flash_attention_decode(q, k, v, lens, num_splits=7), first)
    assert torch.equal(flash_attention_decode(q, k, v, lens), flash_attention_decode(q, k, v, lens))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = flash_attention_decode(q, k, v, lens, num_splits=7)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(on_side, first)

    graph = torch.cuda.CUDAGraph()
    capture = torch.cuda.Stream()
    capture.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(capture):
        flash_attention_decode(q, k, v, lens, num_splits=7)  # warm-up outside the graph
        with torch.cuda.graph(graph, stream=capture):
            captured = flash_attention_decode(q, k, v, lens, num_splits=7)
    torch.cuda.current_stream().wait_stream(capture)
    for _ in range(3):
        captured.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, first)
