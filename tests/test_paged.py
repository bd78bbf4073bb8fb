"""Decode against a paged KV cache: the gate matrix (flashmoe_science/pipeline/paged_gates.py),
the input checks, CUDA graph capture, and a planted bug (a lookup that ignores the block table)
that a gate must catch."""

from __future__ import annotations

import pytest
import torch

from flashmoe_science import flash_attention_decode
from flashmoe_science.pipeline import paged_gates, ragged

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
    require_cuda_build()
    _run(case, "cuda", record_gate)


def test_matrix_covers_the_issue():
    """Block sizes 16 to 256, lengths ending inside a page and a tile, empty and one-token caches,
    GQA 1/4/8, both dtypes and head dims, split-KV automatic/off/forced, causal and not."""
    assert {c.page_size for c in GPU_CASES} == {16, 32, 64, 128, 256}
    lengths = {n for c in GPU_CASES for n in c.lengths}
    assert {0, 1, 63, 65, 1000, 4096, 32768} <= lengths
    assert {c.heads_q // c.heads_kv for c in GPU_CASES} >= {1, 4, 8}
    assert {c.dtype for c in GPU_CASES} == {"fp16", "bf16"}
    assert {c.head_dim for c in GPU_CASES} == {64, 128}
    assert {c.num_splits for c in GPU_CASES} == {0, 1, 7}
    assert {c.causal for c in GPU_CASES} == {False, True}
    assert len({c.id for c in GPU_CASES + CPU_CASES}) == len(GPU_CASES) + len(CPU_CASES)


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
from flashmoe_science.pipeline import paged_gates
device = sys.argv[1]
cases = paged_gates.paged_cases("cpu" if device == "cpu" else "gpu")[:4]
print(json.dumps({"planted": ops.planted_bug(),
                  "failures": [paged_gates.check_paged_case(c, device).failures for c in cases]}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_planted_wrong_page_fails_a_gate(device, run_planted):
    """Build the unit with -DFLASHMOE_PLANT_BUG=8 (logical page i read from physical page i, the
    table ignored) and show the paged gates catch it."""
    for failures in run_planted(8, PLANT_SCRIPT, device)["failures"]:
        assert any(("gate 1" in f or "gate 2" in f) for f in failures), failures
