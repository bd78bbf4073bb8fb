"""The values inside index tensors on CUDA: cache_seqlens, cu_seqlens_q/k and block_table are
checked by the kernels, never by the host (a host check costs a copy and a device sync per call).
A value that does not describe the batch poisons the outputs it touches with NaN and nothing
outside the tensors is read (sanitize's memcheck runs these shapes); FLASHMOE_CHECK_INPUTS=1
adds the host check and its one-line error. The CPU implementation always raises (test_api,
test_varlen, test_paged)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from flashmoe_science import flash_attention_decode, flash_attention_varlen_forward

pytestmark = pytest.mark.gpu

HQ, HKV, D = 8, 2, 128


def _randn(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to("cuda", torch.bfloat16)


@contextlib.contextmanager
def no_host_sync():
    """Any device synchronisation inside raises (torch's sync debug mode)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def dense_decode(sq=1, sk=300, batch=3):
    q = _randn(batch, HQ, sq, D, seed=1)
    k = _randn(batch, HKV, sk, D, seed=2)
    v = _randn(batch, HKV, sk, D, seed=3)
    lens = torch.tensor([sk, 100, 7][:batch], dtype=torch.int32, device="cuda")
    return q, k, v, lens


def paged_decode(block_size=64, pages_per_seq=4, batch=3):
    num_pages = batch * pages_per_seq + 2
    q = _randn(batch, HQ, 1, D, seed=1)
    k = _randn(num_pages, block_size, HKV, D, seed=2)
    v = _randn(num_pages, block_size, HKV, D, seed=3)
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(4))
    table = order[: batch * pages_per_seq].view(batch, pages_per_seq).to("cuda", torch.int32)
    cap = block_size * pages_per_seq
    lens = torch.tensor([cap, cap // 2 + 3, 5][:batch], dtype=torch.int32, device="cuda")
    return q, k, v, table, lens


def packed(lengths=(40, 0, 130, 1)):
    total = sum(lengths)
    q = _randn(total, HQ, D, seed=1)
    k = _randn(total, HKV, D, seed=2)
    v = _randn(total, HKV, D, seed=3)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu.cuda(), max(lengths)


def _rows_nan(out, lse, b):
    return bool(out[b].isnan().all()) and bool(lse[b].isnan().all())


@pytest.mark.parametrize("num_splits", [None, 1, 4])
@pytest.mark.parametrize("sq", [1, 40])
def test_decode_with_cache_seqlens_does_not_sync(sq, num_splits):
    q, k, v, lens = dense_decode(sq=sq)
    with no_host_sync():
        out, lse = flash_attention_decode(q, k, v, lens, num_splits=num_splits, return_lse=True)
    assert out.isfinite().all() and not lse.isnan().any()


@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_paged_decode_does_not_sync(num_splits):
    q, k, v, table, lens = paged_decode()
    with no_host_sync():
        out = flash_attention_decode(q, k, v, lens, num_splits=num_splits, block_table=table)
    assert out.isfinite().all()


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_does_not_sync(causal):
    q, k, v, cu, longest = packed()
    with no_host_sync():
        out = flash_attention_varlen_forward(q, k, v, cu, cu, longest, longest, causal)
    assert out.isfinite().all()


@pytest.mark.parametrize("num_splits", [None, 1, 4])
@pytest.mark.parametrize("sq", [1, 40])
@pytest.mark.parametrize("bad", [301, -1, 2**30])
def test_bad_cache_seqlens_poison_their_sequence(sq, num_splits, bad):
    q, k, v, lens = dense_decode(sq=sq)
    good, good_lse = flash_attention_decode(q, k, v, lens, num_splits=num_splits, return_lse=True)
    lens_bad = lens.clone()
    lens_bad[1] = bad
    out, lse = flash_attention_decode(q, k, v, lens_bad, num_splits=num_splits, return_lse=True)
    assert _rows_nan(out, lse, 1), "a length outside [0, Smax] must give NaN, not a clamped answer"
    for b in (0, 2):
        assert torch.equal(out[b], good[b]) and torch.equal(lse[b], good_lse[b])


@pytest.mark.parametrize("num_splits", [None, 1, 4])
@pytest.mark.parametrize("block_size", [16, 64, 256])
@pytest.mark.parametrize("bad", [-1, "num_pages"])
def test_bad_block_table_entry_poisons_its_sequence(block_size, num_splits, bad):
    q, k, v, table, lens = paged_decode(block_size=block_size)
    good = flash_attention_decode(q, k, v, lens, num_splits=num_splits, block_table=table)
    table_bad = table.clone()
    table_bad[1, 1] = k.shape[0] if bad == "num_pages" else bad  # in use: length > 1 page
    table_bad[2, 3] = 10**6  # past sequence 2's length: never read, harmless
    out, lse = flash_attention_decode(
        q, k, v, lens, num_splits=num_splits, block_table=table_bad, return_lse=True
    )
    assert _rows_nan(out, lse, 1)
    for b in (0, 2):
        assert torch.equal(out[b], good[b])


BAD_OFFSETS = {
    "decreasing": lambda cu, n: torch.tensor([0, 40, 30, 170, n]),
    "not from 0": lambda cu, n: torch.tensor([1, 40, 40, 170, n]),
    "short of the rows": lambda cu, n: torch.tensor([0, 40, 40, 170, n - 1]),
    "past the rows": lambda cu, n: torch.tensor([0, 40, 40, 170, n + 64]),
    "longer than max_seqlen": lambda cu, n: torch.tensor([0, 40, 40, 40, n]),
}


@pytest.mark.parametrize("which", ["q", "k"])
@pytest.mark.parametrize("name", list(BAD_OFFSETS))
def test_bad_offsets_poison_the_whole_packed_batch(name, which):
    q, k, v, cu, longest = packed()
    good = flash_attention_varlen_forward(q, k, v, cu, cu, longest, longest)
    bad = BAD_OFFSETS[name](cu, q.shape[0]).to("cuda", torch.int32)
    cu_q, cu_k = (bad, cu) if which == "q" else (cu, bad)
    out, lse = flash_attention_varlen_forward(
        q, k, v, cu_q, cu_k, longest, longest, return_lse=True
    )
    assert good.isfinite().all()
    assert out.isnan().all() and lse.isnan().all(), "offsets that do not partition the batch"


def test_host_check_on_request(monkeypatch):
    """FLASHMOE_CHECK_INPUTS=1: the host check's one-line error names the value."""
    monkeypatch.setenv("FLASHMOE_CHECK_INPUTS", "1")
    q, k, v, lens = dense_decode()
    lens[1] = 301
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 301 is outside \[0, 300\]"):
        flash_attention_decode(q, k, v, lens)
    q, k, v, table, lens = paged_decode()
    table[1, 1] = -1
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] = -1 is outside"):
        flash_attention_decode(q, k, v, lens, block_table=table)
    q, k, v, cu, longest = packed()
    cu[2] = 30
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
        flash_attention_varlen_forward(q, k, v, cu, cu, longest, longest)
    monkeypatch.setenv("FLASHMOE_CHECK_INPUTS", "0")
    assert flash_attention_varlen_forward(q, k, v, cu, cu, longest, longest).isnan().all()
