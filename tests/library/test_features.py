"""window_size, softcap and sinks on every operator (FlashAttention's conventions): what they mean
at the edges (causal is a right side of 0, rows that see no key, a window larger than the
sequence), that a window's work grows with the window, that split-KV adds a sink once, bad values'
one-line errors, CUDA's refusal before any launch, opcheck and torch.compile. Their accuracy over
the sequence-length matrix is the gates' (tests/gates/test_feature_gates.py)."""

from __future__ import annotations

import math
import time

import pytest
import torch

from flashmoe_science import (
    flash_attention_decode,
    flash_attention_forward,
    flash_attention_varlen_forward,
)
from flashmoe_science.pipeline.gates import forward as gates


def qkv(b=2, hq=4, hkv=2, sq=16, sk=24, d=64, dv=None, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, sk, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, sk, dv or d, generator=g).to(dtype)
    return q, k, v


def sinks_for(hq: int, seed=1) -> torch.Tensor:
    return torch.randn(hq, generator=torch.Generator().manual_seed(seed)) + 2.0


def packed(t: torch.Tensor) -> torch.Tensor:
    """[1, H, S, D] as the packed layout [S, H, D]."""
    return t[0].transpose(0, 1).contiguous()


def test_causal_is_a_right_side_of_0():
    """causal=True sets the window's right side to 0 whatever it says, and (-1, 0) is the causal
    mask: the same results, bit for bit."""
    q, k, v = qkv(sq=40, sk=70)
    causal = flash_attention_forward(q, k, v, causal=True)
    assert torch.equal(flash_attention_forward(q, k, v, window_size=(-1, 0)), causal)
    assert torch.equal(flash_attention_forward(q, k, v, causal=True, window_size=(-1, 9)), causal)
    local = flash_attention_forward(q, k, v, causal=True, window_size=(5, 0))
    assert torch.equal(flash_attention_forward(q, k, v, causal=True, window_size=(5, 30)), local)
    assert not torch.equal(local, causal)


def test_a_window_larger_than_the_sequence_is_no_window():
    q, k, v = qkv(sq=33, sk=50)
    for causal in (False, True):
        plain = flash_attention_forward(q, k, v, causal=causal)
        wide = flash_attention_forward(q, k, v, causal=causal, window_size=(50, 1000))
        assert torch.equal(plain, wide)


@pytest.mark.parametrize("with_sinks", [False, True], ids=["no-sink", "sink"])
def test_a_row_that_sees_no_key_returns_0(with_sinks):
    """Window (0, 0) with Sq > Sk: the first Sq - Sk rows sit before the first key and see none.
    They return 0, with log-sum-exp -inf, or their sink's logit (the sink alone in the
    denominator). The other rows see their one key: its value, shrunk by the sink's share."""
    q, k, v = qkv(sq=20, sk=8)
    sinks = sinks_for(4) if with_sinks else None
    out, lse = flash_attention_forward(q, k, v, window_size=(0, 0), sinks=sinks, return_lse=True)
    blind = slice(0, 12)
    assert (out[:, :, blind] == 0).all()
    if with_sinks:
        assert torch.equal(lse[:, :, blind], sinks.view(1, 4, 1).expand(2, 4, 12))
    else:
        assert torch.isinf(lse[:, :, blind]).all() and (lse[:, :, blind] < 0).all()
    seen = v.repeat_interleave(2, dim=1).float()  # row 12 + j sees key j alone
    if with_sinks:
        score = (q[:, :, 12:].float() * k.repeat_interleave(2, dim=1).float()).sum(-1) / 8
        share = torch.sigmoid(score - sinks.view(1, 4, 1)).unsqueeze(-1)
        seen = seen * share
    torch.testing.assert_close(out[:, :, 12:].float(), seen, atol=2e-2, rtol=2e-2)
    # the same rows through decode and the packed layout
    dec_out, dec_lse = flash_attention_decode(
        q, k, v, causal=False, window_size=(0, 0), sinks=sinks, return_lse=True
    )
    assert torch.equal(dec_out, out) and torch.equal(dec_lse, lse)
    cu_q = torch.tensor([0, 20], dtype=torch.int32)
    cu_k = torch.tensor([0, 8], dtype=torch.int32)
    var_out, var_lse = flash_attention_varlen_forward(
        packed(q[:1]), packed(k[:1]), packed(v[:1]), cu_q, cu_k, 20, 8,
        window_size=(0, 0), sinks=sinks, return_lse=True,
    )  # fmt: skip
    assert torch.equal(var_out, packed(out[:1])) and torch.equal(var_lse, lse[0])


def test_sinks_without_keys_at_all():
    """No key anywhere (Sk = 0): every row's output is 0 and its log-sum-exp its sink's logit."""
    q, k, v = qkv(sk=0)
    sinks = sinks_for(4)
    out, lse = flash_attention_forward(q, k, v, sinks=sinks, return_lse=True)
    assert (out == 0).all() and torch.equal(lse, sinks.view(1, 4, 1).expand_as(lse))


def test_split_kv_adds_each_sink_once():
    """Decode split seven ways gives the unsplit result: each split's partial holds its keys only
    and the combine adds the sink's exp once (once per split would shrink every row)."""
    q, k, v = qkv(b=3, hq=8, hkv=2, sq=2, sk=900)
    lens = torch.tensor([900, 0, 333], dtype=torch.int32)
    sinks = sinks_for(8)
    options = {"window_size": (300, 0), "softcap": 4.0, "sinks": sinks, "return_lse": True}
    one, lse_one = flash_attention_decode(q, k, v, lens, num_splits=1, **options)
    seven, lse_seven = flash_attention_decode(q, k, v, lens, num_splits=7, **options)
    torch.testing.assert_close(lse_seven, lse_one, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(seven.float(), one.float(), atol=1e-2, rtol=0)
    ref, ref_lse = gates.attention_reference(
        q, k, v, True, 1 / 8, lens, window=(300, 0), softcap=4.0, sinks=sinks
    )
    torch.testing.assert_close(lse_seven.double(), ref_lse, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(seven.double(), ref, atol=1e-2, rtol=0)


def _seconds(fn, repeats=3) -> float:
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def test_a_windows_work_grows_with_the_window_not_the_sequence():
    """A 32-key window over 1024 keys reads 1/16 of the causal keys, and takes a small share of the
    causal time, forward and backward (a window applied as a mask over every key would take as
    long as causal). Timed, so the margin is wide: at most a quarter."""
    q, k, v = (t.requires_grad_() for t in qkv(b=1, hq=2, hkv=2, sq=1024, sk=1024))

    def run(window):
        out = flash_attention_forward(q, k, v, causal=True, window_size=window)
        out.backward(torch.ones_like(out))

    # one thread: the work, not how many threads the machine's other processes leave it (with 16
    # threads under a loaded GPU test run the fixed costs took the window's share past a half)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run((-1, -1))  # warm
        full, local = _seconds(lambda: run((-1, -1))), _seconds(lambda: run((31, 0)))
    finally:
        torch.set_num_threads(threads)
    assert local < full / 4, (local, full)


BAD_VALUES = [
    ({"window_size": (-2, 0)}, ValueError, ("window_size=(-2, 0)", "-1 (unbounded)")),
    ({"window_size": (4, 2**31)}, ValueError, ("window_size=(4, 2147483648)", "2^31 - 1")),
    ({"window_size": 16}, TypeError, ("window_size", "pair of ints", "16")),
    ({"window_size": (1.5, 0)}, TypeError, ("window_size", "pair of ints")),
    ({"softcap": -1.0}, ValueError, ("softcap=-1", "finite number > 0")),
    ({"softcap": float("nan")}, ValueError, ("softcap=nan", "finite")),
    ({"softcap": "30"}, TypeError, ("softcap", "float", "str")),
    (
        {"sinks": torch.zeros(4, dtype=torch.bfloat16)},
        TypeError,
        ("sinks", "torch.bfloat16", "torch.float32"),
    ),
    ({"sinks": torch.zeros(3)}, ValueError, ("sinks", "[heads_q] = [4]", "[3]")),
    ({"sinks": torch.zeros(1, 4)}, ValueError, ("sinks", "[heads_q] = [4]", "[1, 4]")),
    ({"sinks": [0.0] * 4}, TypeError, ("sinks", "torch.Tensor", "list")),
]


def _call(name: str, q, k, v, **options):
    if name == "forward":
        return flash_attention_forward(q, k, v, **options)
    if name == "decode":
        return flash_attention_decode(q, k, v, **options)
    if name == "paged":
        pages = k.transpose(1, 2).reshape(-1, 16, k.shape[1], k.shape[3])  # [B * Sk / 16, 16, ...]
        table = torch.arange(pages.shape[0], dtype=torch.int32, device=q.device)
        return flash_attention_decode(
            q, pages, pages, block_table=table.view(q.shape[0], -1), **options
        )
    cu = torch.tensor([0, q.shape[2]], dtype=torch.int32, device=q.device)
    cu_k = torch.tensor([0, k.shape[2]], dtype=torch.int32, device=q.device)
    return flash_attention_varlen_forward(
        packed(q), packed(k), packed(v), cu, cu_k, q.shape[2], k.shape[2], **options
    )


@pytest.mark.parametrize("op", ["forward", "decode", "paged", "varlen"])
@pytest.mark.parametrize(
    "options, error, needles", BAD_VALUES, ids=[str(i) for i in range(len(BAD_VALUES))]
)
def test_bad_values_get_one_line_errors(op, options, error, needles):
    q, k, v = qkv(b=1, sk=32)
    with pytest.raises(error) as info:
        _call(op, q, k, v, **options)
    text = str(info.value)
    assert len(text.splitlines()) == 1, text
    for needle in needles:
        assert needle in text, (needle, text)


@pytest.mark.gpu
def test_sinks_on_another_device_say_so():
    q, k, v = (t.cuda() for t in qkv())
    with pytest.raises(ValueError, match="sinks is on cpu but q is on cuda:0"):
        flash_attention_forward(q, k, v, sinks=sinks_for(4))


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["forward", "decode", "paged", "varlen"])
def test_cuda_operators_take_the_features_as_the_cpu_does(op, require_cuda_build):
    """Each forward operator on CUDA with a window, a softcap, sinks and all three matches the CPU
    implementation on the same inputs, and so do the gradients (the sinks' too)."""
    require_cuda_build()
    q, k, v = qkv(b=1, sk=32)
    sinks = sinks_for(4)
    for options in (
        {"window_size": (8, 0)},
        {"window_size": (3, 5)},
        {"softcap": 5.0},
        {"sinks": sinks},
        {"window_size": (6, 0), "softcap": 2.0, "sinks": sinks},
    ):
        on_cuda = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in options.items()}
        got = _call(op, q.cuda(), k.cuda(), v.cuda(), **on_cuda)
        want = _call(op, q, k, v, **options)
        torch.testing.assert_close(got.cpu().float(), want.float(), atol=2e-2, rtol=2e-2)
    if op != "forward":
        return
    grads = []
    for device in ("cpu", "cuda"):
        leaves = [t.detach().to(device).requires_grad_() for t in (q, k, v, sinks)]
        out = flash_attention_forward(*leaves[:3], window_size=(6, 0), softcap=2.0, sinks=leaves[3])
        out.float().square().sum().backward()
        grads.append([t.grad.cpu().float() for t in leaves])
    for got, want, name in zip(grads[1], grads[0], ("dq", "dk", "dv", "dsinks"), strict=True):
        torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2, msg=name)


@pytest.mark.gpu
def test_a_large_softcap_keeps_the_running_max_on_the_wgmma_forward(require_cuda_build):
    """bf16 with softcap 200 (c = 200 * log2(e) = 288, past the fixed max's bound of 80 in
    Sm90Rows) and scores near 150: exp2(t * c) against a fixed max of 0 would overflow fp32, so
    the wgmma forward (configurations 5 to 7) keeps the running max and matches the CPU. (A build
    without FLASHMOE_FWD_SOFTCAP_FIXED_MAX runs the running max for every softcap.)"""
    require_cuda_build()
    from flashmoe_science import ops

    if not ops.config_supported(5, torch.cuda.get_device_capability()):
        pytest.skip("needs an sm_90a build on a compute capability 9.0 GPU")
    torch.manual_seed(0)
    q, k, v = qkv(b=1, sk=256, d=128, dtype=torch.bfloat16)
    k = k * 40.0  # scores q . k / sqrt(128) of spread 40, up to ~150: t up to ~0.6
    want = flash_attention_forward(q, k, v, softcap=200.0)
    assert want.isfinite().all()
    for config in (5, 6, 7):
        got = flash_attention_forward(q.cuda(), k.cuda(), v.cuda(), softcap=200.0, config=config)
        torch.testing.assert_close(got.cpu().float(), want.float(), atol=3e-2, rtol=3e-2)


def test_opcheck_with_window_softcap_and_sinks():
    """Schemas, fakes, autograd registration and dispatch of every operator with the features."""
    lib = torch.ops.flashmoe_science
    q, k, v = qkv(b=2, hq=4, hkv=2, sq=9, sk=70, dv=32, dtype=torch.float16)
    sinks = sinks_for(4)
    features = (8, 3, 2.5, sinks)
    lens = torch.tensor([70, 5], dtype=torch.int32)
    torch.library.opcheck(lib.fwd.default, (q, k, v, lens, False, 0.125, 3, 0, *features))
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    torch.library.opcheck(
        lib.attention.default, (*leaves[:3], True, 0.125, 0, 0, True, 0, 8, -1, 2.5, leaves[3])
    )
    out, lse = lib.attention(q, k, v, True, 0.125, 0, 0, True, 0, *features)
    dout = torch.randn_like(out)
    torch.library.opcheck(
        lib.attention_backward.default,
        (dout, q, k, v, out, lse, True, 0.125, True, 0, *features),
    )
    cu_q = torch.tensor([0, 4, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 30, 70], dtype=torch.int32)
    torch.library.opcheck(
        lib.varlen_fwd.default,
        (packed(q[:1]), packed(k[:1]), packed(v[:1]), cu_q, cu_k, 5, 40, True, 0.125, 0, *features),
    )
    g = torch.Generator().manual_seed(2)
    k_cache = torch.randn(8, 16, 2, 64, generator=g).half()
    v_cache = torch.randn(8, 16, 2, 32, generator=g).half()  # v of a head dim of its own
    table = torch.tensor([[3, 1, 7, 5], [0, 2, 4, 6]], dtype=torch.int32)
    lens = torch.tensor([64, 20], dtype=torch.int32)
    torch.library.opcheck(
        lib.paged_fwd.default,
        (q[:, :, :2], k_cache, v_cache, table, lens, True, 0.125, 2, *features),
    )


@pytest.mark.slow
@pytest.mark.cpu
def test_torch_compile_trains_with_the_features():
    """torch.compile(fullgraph=True) of forward and backward with a window, softcap and sinks gives
    eager's gradients, the sinks' included, bit for bit (deterministic)."""
    q, k, v = (t.requires_grad_() for t in qkv(sq=33, sk=40))
    sinks = sinks_for(4).requires_grad_()
    leaves = (q, k, v, sinks)

    def loss(q, k, v, sinks):
        out = flash_attention_forward(
            q, k, v, causal=True, window_size=(7, 0), softcap=3.0, sinks=sinks, deterministic=True
        )
        return out.float().square().sum()

    torch.compile(loss, fullgraph=True)(*leaves).backward()
    compiled = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    loss(*leaves).backward()
    for got, want in zip(compiled, (t.grad for t in leaves), strict=True):
        assert torch.equal(got, want)
    assert compiled[3].abs().sum() > 0


def test_varlen_trains_the_sinks_over_every_sequence():
    """The packed batch's sinks gradient is the sum of its sequences' (each sequence's window
    aligned to its own bottom-right corner), and dq, dk, dv are each sequence's."""
    lengths_q, lengths_k = (5, 0, 12), (9, 4, 12)
    shapes = enumerate(zip(lengths_q, lengths_k, strict=True))
    qs, ks, vs = zip(*(qkv(b=1, sq=n, sk=m, seed=i) for i, (n, m) in shapes), strict=True)
    options = {"causal": True, "window_size": (3, 0), "softcap": 2.0}
    sinks = sinks_for(4).requires_grad_()
    q, k, v = (torch.cat([packed(t) for t in ts]).requires_grad_() for ts in (qs, ks, vs))
    cu_q = torch.tensor([0, 5, 5, 17], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 13, 25], dtype=torch.int32)
    out = flash_attention_varlen_forward(q, k, v, cu_q, cu_k, 12, 12, sinks=sinks, **options)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, sinks), dout)
    expected = torch.zeros(4)
    rows_q, rows_k = 0, 0
    for qb, kb, vb, n, m in zip(qs, ks, vs, lengths_q, lengths_k, strict=True):
        leaf = sinks.detach().clone().requires_grad_()
        dense = [t.clone().requires_grad_() for t in (qb, kb, vb)]
        o = flash_attention_forward(*dense, sinks=leaf, **options)
        part = packed(dout[rows_q : rows_q + n].transpose(0, 1).unsqueeze(0))
        g = torch.autograd.grad(o, (*dense, leaf), part.transpose(0, 1).unsqueeze(0))
        expected += g[3]
        assert torch.equal(grads[0][rows_q : rows_q + n], packed(g[0]))
        assert torch.equal(grads[1][rows_k : rows_k + m], packed(g[1]))
        rows_q, rows_k = rows_q + n, rows_k + m
    torch.testing.assert_close(grads[3], expected, atol=1e-6, rtol=1e-6)
