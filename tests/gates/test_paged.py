"""Decode against a paged KV cache: the gate matrix (flashmoe_science/pipeline/gates/paged.py),
its ramped caches, the input checks, CUDA graph capture, and planted bugs (a lookup that ignores
the block table; an output never rescaled) that a gate must catch."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from softmax_model import online_softmax

from flashmoe_science import flash_attention_decode
from flashmoe_science.pipeline.gates import paged as paged_gates
from flashmoe_science.pipeline.gates import ragged
from flashmoe_science.pipeline.gates.matrix import HEAD_DIMS, NEW_HEAD_DIMS, NEW_HEAD_DIMS_CPU

GPU_CASES = paged_gates.paged_cases("gpu")
CPU_CASES = paged_gates.paged_cases("cpu")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _run(case, device, record_gate) -> None:
    result = paged_gates.check_paged_case(case, device)
    reruns = ragged.rerun_fields(case.id, device)
    record_gate(case, result, "paged", reruns, lambda: result.format_failure(case, device))


@pytest.mark.gate
@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: f"{c.id}-cpu")
def test_gate_paged_cpu(case, record_gate):
    _run(case, "cpu", record_gate)


@pytest.mark.gate
@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"{c.id}-cuda")
def test_gate_paged_cuda(case, record_gate, require_cuda_build):
    require_cuda_build(head_dim=case.head_dim, head_dim_v=case.head_dim_v, case=case)
    _run(case, "cuda", record_gate)


def test_matrix_covers_the_issue():
    """Block sizes 16 to 1024 (the API takes any power of two from 16: those above 256 are gated
    too, on the CPU as well), lengths ending inside a page and a tile, empty and one-token caches,
    GQA 1/4/8, both dtypes, every head dims pair (v_cache's differing included), split-KV
    automatic/off/forced, causal and not."""
    assert {c.page_size for c in GPU_CASES} == {16, 32, 64, 128, 256, 512, 1024}
    assert {16, 256, 1024} <= {c.page_size for c in CPU_CASES}
    lengths = {n for c in GPU_CASES for n in c.lengths}
    assert {0, 1, 63, 65, 1000, 4096, 32768} <= lengths
    assert {c.heads_q // c.heads_kv for c in GPU_CASES} >= {1, 4, 8}
    assert {c.dtype for c in GPU_CASES} == {"fp16", "bf16"}
    assert {(c.head_dim, c.head_dim_v or c.head_dim) for c in GPU_CASES} == set(HEAD_DIMS)
    for head_dims in NEW_HEAD_DIMS:  # every block size, both dtypes
        mine = [c for c in GPU_CASES if (c.head_dim, c.head_dim_v or c.head_dim) == head_dims]
        assert {(c.page_size, c.dtype) for c in mine} == {
            (p, t) for p in paged_gates.PAGE_SIZES for t in ("fp16", "bf16")
        }
    assert {(c.head_dim, c.head_dim_v or c.head_dim) for c in CPU_CASES} >= set(NEW_HEAD_DIMS_CPU)
    assert {c.num_splits for c in GPU_CASES} == {0, 1, 7}
    assert {c.causal for c in GPU_CASES} == {False, True}
    assert len({c.id for c in GPU_CASES + CPU_CASES}) == len(GPU_CASES) + len(CPU_CASES)


@pytest.mark.parametrize("cases", [GPU_CASES, CPU_CASES], ids=["gpu", "cpu"])
def test_ramped_cases_cover_both_directions_block_sizes_and_splits(cases):
    ramped = [c for c in cases if c.scores != "normal"]
    assert {c.scores for c in ramped} == {"rising", "falling"}
    assert {c.head_dim for c in ramped} == {64, 128}
    assert min(c.page_size for c in ramped) <= 64 and max(c.page_size for c in ramped) >= 128
    assert any(c.num_splits > 1 for c in ramped) and any(c.num_splits == 0 for c in ramped)
    assert all(max(c.lengths) >= 1000 for c in ramped)  # several 64-key blocks in every split
    assert any(c.heads_q > c.heads_kv for c in ramped)


def test_ramped_cache_ramps_each_sequence_in_logical_order_through_the_table():
    """The keys of a ramped case ramp along each sequence's own positions 0..cache_seqlen-1 as
    the block table reads them (not along the shuffled physical pages): the contiguous decode and
    the reference see the same logical cache."""
    case = next(c for c in CPU_CASES if c.scores == "rising")
    assert case.id.endswith("-rising") and case.describe().endswith("scores=rising")
    plain = dataclasses.replace(case, scores="normal")
    assert "rising" not in plain.id and "scores" not in plain.describe()
    q, k_cache, v_cache, table, _ = paged_gates.make_paged_inputs(case, "cpu", 3)
    q0, k_cache0, v_cache0, table0, _ = paged_gates.make_paged_inputs(plain, "cpu", 3)
    assert torch.equal(q, q0) and torch.equal(v_cache, v_cache0) and torch.equal(table, table0)
    assert not torch.equal(table.flatten().sort().values, table.flatten())  # pages shuffled
    k, k0 = (
        paged_gates.contiguous_cache(k_cache, table),
        paged_gates.contiguous_cache(k_cache0, table),
    )
    for b, length in enumerate(case.lengths):
        if length < 2:
            continue
        # rising: the sequence's first key as drawn, its last scaled 16 times, its norm growing
        assert torch.equal(k[b, :, 0], k0[b, :, 0])
        torch.testing.assert_close(k[b, :, length - 1].float(), 16 * k0[b, :, length - 1].float())
        norms = k[b, :, :length].float().norm(dim=-1).mean(0)  # per position
        quarter = length // 4
        assert norms[-quarter:].mean() > 4 * norms[:quarter].mean()
        assert torch.equal(k[b, :, length:], k0[b, :, length:])  # past the length: as drawn
    unused = torch.ones(k_cache.shape[0], dtype=torch.bool)
    unused[table.long().flatten()] = False
    assert torch.equal(k_cache[unused], k_cache0[unused])  # pages outside the table untouched


def test_ramped_case_rejects_unknown_scores():
    case = next(c for c in CPU_CASES if c.scores == "falling")
    with pytest.raises(ValueError, match="PagedCase scores='peaked' is not supported") as info:
        dataclasses.replace(case, scores="peaked")
    assert "'normal', 'rising', 'falling'" in str(info.value) and "\n" not in str(info.value)


def _split_decode(q, k, v, lengths, causal, scale, num_splits, *, backwards, rescale_output):
    """Split-KV decode modelled in fp32 over contiguous k, v [B, Hkv, S, D]: each query row's
    visible keys cut into `num_splits` runs of whole 64-key blocks, each run through the online
    softmax of test_gate_plants (its lazy rescale; `rescale_output=False` plants the skipped output
    rescale), the runs combined through their log-sum-exps."""
    batch, heads, seqlen_q, _ = q.shape
    out = torch.zeros(q.shape)
    lse = torch.full((batch, heads, seqlen_q), -math.inf)
    for b in range(batch):
        for row in range(seqlen_q):
            visible = int(lengths[b]) - (seqlen_q - 1 - row if causal else 0)
            per_split = math.ceil(math.ceil(max(visible, 0) / 64) / num_splits) * 64
            partial = [
                online_softmax(
                    q[b : b + 1, :, row : row + 1].float(),
                    k[b : b + 1, :, start : min(start + per_split, visible)],
                    v[b : b + 1, :, start : min(start + per_split, visible)],
                    False,
                    scale,
                    backwards=backwards,
                    rescale_output=rescale_output,
                    block=64,
                )
                for start in range(0, visible, per_split or 1)
            ]
            if not partial:
                continue
            outs = torch.stack([o[0, :, 0] for o, _ in partial])  # [splits, H, D]
            lses = torch.stack([s[0, :, 0] for _, s in partial])  # [splits, H]
            lse[b, :, row] = torch.logsumexp(lses, dim=0)
            out[b, :, row] = (torch.exp(lses - lse[b, :, row]).unsqueeze(-1) * outs).sum(0)
    return out.to(q.dtype), lse


@pytest.mark.parametrize("backwards", [False, True], ids=["forwards", "backwards"])
def test_a_skipped_output_rescale_passes_normal_caches_and_fails_ramped_ones(
    backwards, monkeypatch
):
    """With N(0, 1) caches the running max settles in the first key block each split visits, so a
    split-KV decode that never rescales its output passes the normal paged gates; the ramped
    cases (rising for a kernel that walks the keys forwards, falling for one that walks them
    backwards) are what catch it."""
    from flashmoe_science import ops

    def model(rescale_output):
        def contiguous(q, k, v, lengths, scale, *, causal, num_splits, return_lse):
            splits = num_splits or 1
            return _split_decode(
                q,
                k,
                v,
                lengths,
                causal,
                scale,
                splits,
                backwards=backwards,
                rescale_output=rescale_output,
            )

        def paged(case, q, k_cache, v_cache, table, lengths, scale):
            k = paged_gates.contiguous_cache(k_cache, table)
            v = paged_gates.contiguous_cache(v_cache, table)
            num_splits = case.num_splits or None
            return contiguous(
                q, k, v, lengths, scale, causal=case.causal, num_splits=num_splits, return_lse=True
            )

        # the contiguous decode the paged one is compared with runs the same model
        monkeypatch.setattr(ops, "flash_attention_decode", contiguous)
        return paged

    scores = "falling" if backwards else "rising"
    ramped = [c for c in CPU_CASES if c.scores == scores]
    assert any(c.num_splits > 1 for c in ramped) and any(c.num_splits == 0 for c in ramped)
    for case in ramped:
        normal = dataclasses.replace(case, scores="normal")
        for honest in (normal, case):
            assert paged_gates.check_paged_case(honest, "cpu", model(True)).passed, honest.id
        assert paged_gates.check_paged_case(normal, "cpu", model(False)).passed  # the blind spot
        failures = paged_gates.check_paged_case(case, "cpu", model(False)).failures
        assert any("gate 1" in f for f in failures), (case.id, failures)


def test_ramped_splits_have_maxima_a_combine_must_weigh():
    """On a ramped cache the splits' maxima of the scores (log2 units, as the kernels keep them)
    differ by more than 2^8, so a split-KV combine that ignored the partial log-sum-exps' maxima
    would be wrong; on the normal cache of the same shape they do not."""
    case = next(c for c in CPU_CASES if c.scores == "rising" and c.num_splits > 1)
    spread = {}
    for scores in ("normal", "rising"):
        q, k_cache, _, table, _ = paged_gates.make_paged_inputs(
            dataclasses.replace(case, scores=scores), "cpu", 3
        )
        k = paged_gates.contiguous_cache(k_cache, table).float()
        ratio = case.heads_q // case.heads_kv
        length = case.lengths[0]
        s = q[:1].float() @ k[:1, :, :length].repeat_interleave(ratio, 1).transpose(-1, -2)
        s = s * (math.log2(math.e) / math.sqrt(case.head_dim))
        per_split = math.ceil(math.ceil(length / 64) / case.num_splits) * 64
        maxima = torch.stack([c.amax(-1) for c in s.split(per_split, dim=-1)])
        spread[scores] = float((maxima.amax(0) - maxima.amin(0)).amax())
    assert spread["rising"] > 8 > spread["normal"], spread


def paged(device, page_size=16, lengths=(5, 40)):
    case = paged_gates.PagedCase("bf16", 64, 4, 2, 1, lengths, page_size)
    return paged_gates.make_paged_inputs(case, device, seed=0)


def _ints(args, values):
    return torch.tensor(values, dtype=torch.int32, device=args["q"].device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (
            lambda a: {**a, "block_table": a["block_table"].long()},
            TypeError,
            "block_table has dtype torch.int64; supported: torch.int32",
        ),
        (
            lambda a: {**a, "block_table": a["block_table"][:1]},
            ValueError,
            "block_table must have shape [batch, max_blocks_per_seq] = [2, >= 1], got [1, 4]",
        ),
        (
            lambda a: {**a, "block_table": a["block_table"][0]},
            ValueError,
            "block_table must have shape",
        ),
        (
            lambda a: {**a, "block_table": a["block_table"] + 1000},
            ValueError,
            "is outside [0, 24) (the blocks of k_cache)",
        ),
        (
            lambda a: {**a, "block_table": a["block_table"] - 1000},
            ValueError,
            "block_table[0, 0] = ",
        ),
        (
            lambda a: {**a, "cache_seqlens": _ints(a, [5, 65])},
            ValueError,
            "cache_seqlens[1] = 65 is outside [0, 64]",
        ),
        (
            lambda a: {**a, "k_cache": a["k_cache"][:, :12], "v_cache": a["v_cache"][:, :12]},
            ValueError,
            "block size (k_cache.shape[1]) = 12 is not supported; supported: powers of two from 16",
        ),
        (
            lambda a: {**a, "k_cache": a["k_cache"][:, :8], "v_cache": a["v_cache"][:, :8]},
            ValueError,
            "block size (k_cache.shape[1]) = 8 is not supported",
        ),
        (
            lambda a: {**a, "k_cache": a["k_cache"][0], "v_cache": a["v_cache"][0]},
            ValueError,
            "k_cache and v_cache must be paged, [num_blocks, block_size, heads_kv, head_dim]",
        ),
        (
            lambda a: {**a, "v_cache": a["v_cache"][:3]},
            ValueError,
            "k_cache and v_cache must have the same shape",
        ),
        (
            lambda a: {**a, "k_cache": a["k_cache"].half()},
            TypeError,
            "q, k_cache and v_cache must share one dtype",
        ),
        (
            lambda a: {**a, "k_cache": a["k_cache"][..., :32], "v_cache": a["v_cache"][..., :32]},
            ValueError,
            "head_dim differs",
        ),
        (
            lambda a: {**a, "block_table": a["block_table"].tolist()},
            TypeError,
            "block_table must be a torch.Tensor",
        ),
    ],
)
def test_bad_input_raises_one_line(device, monkeypatch, change, error, message):
    # On CUDA the values are checked by the kernels (test_input_checks.py) unless asked for here.
    monkeypatch.setenv("FLASHMOE_CHECK_INPUTS", "1")
    q, k_cache, v_cache, table, lengths = paged(device)
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=lengths, block_table=table)
    with pytest.raises(error) as info:
        flash_attention_decode(**change(args))
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("device", DEVICES)
def test_unused_table_entries_are_never_read(device):
    """Entries past a sequence's length may hold anything (vLLM leaves them stale)."""
    q, k_cache, v_cache, table, lengths = paged(device)
    out = flash_attention_decode(q, k_cache, v_cache, lengths, block_table=table)
    stale = table.clone()
    stale[0, 1:] = -7  # sequence 0 has 5 keys: only its first page is read
    stale[1, 3:] = 10**6  # sequence 1 has 40 keys: pages 0 to 2
    assert torch.equal(flash_attention_decode(q, k_cache, v_cache, lengths, block_table=stale), out)


def test_backward_raises_instead_of_a_silent_none():
    q, k_cache, v_cache, table, lengths = paged("cpu")
    q.requires_grad_(True)
    out = flash_attention_decode(q, k_cache, v_cache, lengths, block_table=table)
    with pytest.raises(RuntimeError, match="flash_attention_decode is inference-only"):
        out.float().sum().backward()


def test_opcheck():
    from flashmoe_science import ops  # noqa: F401  (loads the operators)

    q, k_cache, v_cache, table, lengths = paged("cpu")
    torch.library.opcheck(
        torch.ops.flashmoe_science.paged_fwd,
        (q, k_cache, v_cache, table, lengths, True, 0.125, 0),
        test_utils=("test_schema", "test_faketensor"),
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_capture_checks_on_the_device():
    """A paged decode captures into a CUDA graph (no host check, so no sync while capturing); a
    replay with new cache lengths and a new table gives the eager result, and a table entry out of
    range, which the kernel clamps into the cache rather than read outside it, makes that
    sequence's output NaN and leaves the other's as it was."""
    q, k_cache, v_cache, table, lengths = paged("cuda", page_size=32, lengths=(5, 100))
    flash_attention_decode(q, k_cache, v_cache, lengths, block_table=table)  # warm-up, eager
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attention_decode(q, k_cache, v_cache, lengths, block_table=table)
    lengths.copy_(torch.tensor([64, 7], dtype=torch.int32))
    table.copy_(table.flip(1))
    graph.replay()
    expected = flash_attention_decode(q, k_cache, v_cache, lengths, block_table=table)
    assert torch.equal(out, expected)
    table[0, 0] = 10**6
    graph.replay()
    torch.cuda.synchronize()
    assert out[0].isnan().all() and torch.equal(out[1], expected[1])


PLANT_SCRIPT = """
import json, sys
from flashmoe_science import ops
from flashmoe_science.pipeline.gates import paged as paged_gates
from flashmoe_science.pipeline.gates.kernels import gate_case
cases = [gate_case(case_id) for case_id in sys.argv[2:]]
print(json.dumps({"planted": ops.planted_bug(), "failures": [
    paged_gates.check_paged_case(c, sys.argv[1]).failures for c in cases]}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_planted_wrong_page_fails_a_gate(device, run_planted):
    """Build the unit with -DFLASHMOE_PLANT_BUG=8 (logical page i read from physical page i, the
    table ignored) and show the paged gates catch it."""
    cases = paged_gates.paged_cases("cpu" if device == "cpu" else "gpu")[:4]
    for failures in run_planted(8, PLANT_SCRIPT, device, *(c.id for c in cases))["failures"]:
        assert any(("gate 1" in f or "gate 2" in f) for f in failures), failures
