"""The public API: bad input raises a one-line error naming the argument, what was given and what is
supported; empty inputs return correctly shaped results; the operators work with torch.compile and
torch.library.opcheck; CUDA work runs on the current stream."""

from __future__ import annotations

import math

import pytest
import torch

from flashmoe_science import flash_attention_decode, flash_attention_forward, ops
from flashmoe_science.pipeline.gates import forward as gates

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def qkv(device="cpu", b=2, hq=4, hkv=2, sq=16, sk=24, d=64, dtype=torch.float16):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, hq, sq, d, generator=g).to(device, dtype)
    k = torch.randn(b, hkv, sk, d, generator=g).to(device, dtype)
    v = torch.randn(b, hkv, sk, d, generator=g).to(device, dtype)
    return q, k, v


def one_line_error(exc_info, *needles: str) -> str:
    msg = str(exc_info.value)
    first = msg.strip().splitlines()[0]
    for needle in needles:
        assert needle in first, f"{needle!r} not in the error's first line: {first!r}"
    assert len(msg.strip().splitlines()) <= 2, msg
    return first


@pytest.mark.parametrize("call", ["forward", "decode"])
def test_heads_in_the_sequence_dimension_get_the_transpose_hint(call):
    # [B, S, H, D] tensors of 4 queries and 16 keys over 32 and 8 heads, passed as they are
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4 if call == "forward" else 1, 32, 64, generator=g).half()
    k = torch.randn(2, 16, 8, 64, generator=g).half()
    op = flash_attention_forward if call == "forward" else flash_attention_decode
    with pytest.raises(ValueError) as excinfo:
        op(q, k, k)
    first = one_line_error(excinfo, "heads of q", "must be a multiple of heads of k and v")
    assert "look like [B, S, H, D]: pass q.transpose(1, 2), k.transpose(1, 2)" in first
    out = op(q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2))  # the hint works
    assert out.shape == (2, 32, q.shape[1], 64)
    # heads that no layout explains get no hint
    with pytest.raises(ValueError) as excinfo:
        op(q[:, :, :3].transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2))
    assert "transpose" not in one_line_error(excinfo, "multiple of heads")


BAD_INPUTS = [
    (
        "float32 dtype",
        lambda q, k, v: (q.float(), k.float(), v.float()),
        {},
        TypeError,
        ("q", "torch.float32", "torch.float16, torch.bfloat16"),
    ),
    (
        "mismatched dtypes",
        lambda q, k, v: (q, k.bfloat16(), v.bfloat16()),
        {},
        TypeError,
        ("share one dtype",),
    ),
    ("rank 3", lambda q, k, v: (q[0], k, v), {}, ValueError, ("q", "4 dimensions", "got 3")),
    ("batch mismatch", lambda q, k, v: (q, k[:1], v[:1]), {}, ValueError, ("batch sizes differ",)),
    (
        "head_dim mismatch",
        lambda q, k, v: (q, k[..., :32], v[..., :32]),
        {},
        ValueError,
        ("head_dim differs",),
    ),
    ("k v shape mismatch", lambda q, k, v: (q, k, v[:, :, :5]), {}, ValueError, ("k and v",)),
    (
        "Hq not a multiple of Hkv",
        lambda q, k, v: (q[:, :3], k, v),
        {},
        ValueError,
        ("multiple of heads",),
    ),
    (
        "non-contiguous last dim",
        lambda q, k, v: (q.transpose(-1, -2), k, v),
        {},
        ValueError,
        ("q", "last dimension", "stride"),
    ),
    (
        "CUDA-only config on CPU",
        lambda q, k, v: (q, k, v),
        {"config": 1},
        ValueError,
        ("config=1", "CUDA"),
    ),
    (
        "the wgmma config on CPU",
        lambda q, k, v: (q, k, v),
        {"config": 5},
        ValueError,
        ("config=5", "CUDA"),
    ),
    (
        "the 128-row wgmma config on CPU",
        lambda q, k, v: (q, k, v),
        {"config": 6},
        ValueError,
        ("config=6", "CUDA"),
    ),
    (
        "config out of range",
        lambda q, k, v: (q, k, v),
        {"config": 8},
        ValueError,
        ("config", "[0, 7]", "got 8"),
    ),
    (
        "num_splits out of range",
        lambda q, k, v: (q, k, v),
        {"num_splits": 500},
        ValueError,
        ("num_splits", "500"),
    ),
    (
        "negative scale",
        lambda q, k, v: (q, k, v),
        {"softmax_scale": -1.0},
        ValueError,
        ("softmax_scale", "-1.0"),
    ),
    (
        "causal not bool",
        lambda q, k, v: (q, k, v),
        {"causal": "yes"},
        TypeError,
        ("causal", "bool"),
    ),
    (
        "q not a tensor",
        lambda q, k, v: (q.numpy(), k, v),
        {},
        TypeError,
        ("q", "torch.Tensor", "ndarray"),
    ),
]


@pytest.mark.parametrize(
    "name,mutate,kwargs,exc,needles", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS]
)
def test_bad_input_gives_one_line_error(name, mutate, kwargs, exc, needles):
    q, k, v = qkv()
    if name == "q not a tensor":
        q = q.float()
    with pytest.raises(exc) as info:
        flash_attention_forward(*mutate(q, k, v), **kwargs)
    one_line_error(info, *needles)


def test_each_configuration_says_what_it_needs():
    """4 needs compute capability 9.0 or newer; 5, 6 and 7 (wgmma) an sm_90a build on a 9.0 GPU,
    by default the loaded build's targets."""
    assert all(ops.config_supported(c, (8, 0), ()) for c in (0, 1, 2, 3))
    assert ops.config_supported(4, (9, 0), ()) and not ops.config_supported(4, (8, 9), ())
    assert {5, 6, 7} == ops.SM90A_CONFIGS
    for config in ops.SM90A_CONFIGS:
        assert ops.config_supported(config, (9, 0), ("8.9", "9.0a"))
        assert ops.config_supported(config, [9, 0], ("9.0a+PTX",))
        for capability, archs in (
            ((9, 0), ("8.9", "9.0")),
            ((8, 9), ("9.0a",)),
            ((10, 0), ("9.0a",)),
        ):
            assert not ops.config_supported(config, capability, archs)
        assert ops.config_needs(config) == "an sm_90a build on a 9.0 GPU"
    assert ops.config_unsupported_reason(6, (8, 9), ("8.9",)) == (
        "config=6 needs an sm_90a build on a compute capability 9.0 GPU: build with --arch 9.0a "
        "(this GPU is sm_89, the build targets sm_89)"
    )
    reason = ops.config_unsupported_reason(5, (9, 0), ("8.9", "9.0"))
    assert reason == (
        "config=5 needs an sm_90a build on a compute capability 9.0 GPU: build with --arch 9.0a "
        "(this GPU is sm_90, the build targets sm_89, sm_90)"
    )
    assert ops.config_unsupported_reason(4, (8, 9)) == (
        "config=4 is built for sm_90 and newer; this GPU is sm_89"
    )
    assert ops.config_unsupported_reason(5, (9, 0), ("9.0a",)) is None
    assert ops.config_supported(5, (9, 0)) == ("9.0a" in ops.built_archs())
    if not torch.cuda.is_available():
        assert ops.built_archs() == ()  # the CPU-only build
        assert "the build is CPU-only" in ops.config_unsupported_reason(5, (9, 0))


def test_each_backward_configuration_says_what_it_needs():
    """Backward configurations 1 and 2 run on any supported GPU; 3 (wgmma) needs an sm_90a build
    on a 9.0 GPU, and says so in the words the forward's configuration 5 uses."""
    for capability in ((8, 0), (8, 9), (9, 0), (10, 0)):
        assert all(ops.backward_config_supported(c, capability, ()) for c in (0, 1, 2))
    assert ops.backward_config_supported(3, (9, 0), ("8.9", "9.0a"))
    for capability, archs in (((9, 0), ("8.9", "9.0")), ((8, 9), ("9.0a",)), ((10, 0), ("9.0a",))):
        assert not ops.backward_config_supported(3, capability, archs)
    assert ops.backward_config_unsupported_reason(3, (8, 9), ("8.9",)) == (
        "backward_config=3 needs an sm_90a build on a compute capability 9.0 GPU: build with "
        "--arch 9.0a (this GPU is sm_89, the build targets sm_89)"
    )
    assert set(ops.BACKWARD_CONFIGS) >= ops.SM90A_BACKWARD_CONFIGS
    assert ops.config_needs(3, "backward") == "an sm_90a build on a 9.0 GPU"
    assert ops.config_needs(3, "decode") is None and ops.config_needs(2, "backward") is None


@pytest.mark.gpu
def test_backward_config_3_refused_where_it_cannot_run():
    """Forced where it cannot run (not an H100, or a build without sm_90a), the wgmma backward is
    a one-line error that says what to use instead, not a launch of a trapping kernel."""
    if ops.backward_config_supported(3, torch.cuda.get_device_capability()):
        pytest.skip("this GPU and build run backward_config=3")
    q, k, v = (t.cuda().requires_grad_() for t in qkv())
    out = flash_attention_forward(q, k, v, backward_config=3)
    with pytest.raises(ValueError) as info:
        out.float().sum().backward()
    one_line_error(info, "backward_config=3", "backward_config 1 or 2")


def _sm90_traits_launched(call) -> str:
    """The Sm90FwdTraits<...> of the sm90 forward kernel a call launches, from the profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if "Sm90FwdTraits" in e.name]
    assert names, "no sm90 forward kernel ran"
    return names[0][names[0].index("Sm90FwdTraits") :].split(">")[0] + ">"


@pytest.mark.gpu
@pytest.mark.parametrize(
    "seqlen_q, seqlen_k, causal, head_dim, traits",
    [
        (512, 512, True, 64, "Sm90FwdTraits<64, 128, 2, 3>"),  # 6: 128-row tiles
        (1000, 1000, True, 64, "Sm90FwdTraits<64, 128, 2, 3>"),
        (1024, 512, True, 64, "Sm90FwdTraits<64, 128, 2, 3>"),
        (512, 512, False, 64, "Sm90FwdTraits<64, 128, 3, 2>"),  # 5: 192-row tiles
        (2048, 2048, True, 64, "Sm90FwdTraits<64, 128, 3, 2>"),
        (512, 4096, True, 64, "Sm90FwdTraits<64, 128, 3, 2>"),
        (512, 512, True, 128, "Sm90FwdTraits<128, 128, 2, 3>"),
    ],
)
def test_the_h100_picks_128_row_tiles_at_d64_for_short_causal_heads(
    seqlen_q, seqlen_k, causal, head_dim, traits
):
    """On a 9.0 GPU with the sm_90a build, the automatic choice takes configuration 6 (128-row
    tiles) at D=64 for causal heads of at most 1024 rows with no more keys than rows, and 5
    everywhere else (benches/notes/prefill-sm90.md, v3.8, measured both sides of each bound)."""
    if not ops.config_supported(6, torch.cuda.get_device_capability()):
        pytest.skip("configuration 6 needs an sm_90a build on a 9.0 GPU")
    heads = 32 if head_dim == 64 else 16
    batch = max(1, 16384 // seqlen_q)
    q, k, v = (
        torch.randn(batch, heads, s, head_dim, device="cuda", dtype=torch.bfloat16)
        for s in (seqlen_q, seqlen_k, seqlen_k)
    )
    got = _sm90_traits_launched(lambda: flash_attention_forward(q, k, v, causal))
    assert got == traits


@pytest.mark.gpu
def test_mismatched_devices():
    q, k, v = qkv()
    with pytest.raises(ValueError) as info:
        flash_attention_forward(q, k.cuda(), v.cuda())
    one_line_error(info, "same device")


@pytest.mark.gpu
def test_unsupported_head_dim_on_cuda():
    q, k, v = qkv("cuda", d=96)
    with pytest.raises(ValueError) as info:
        flash_attention_forward(q, k, v)
    one_line_error(info, "head_dim=96", "64, 128")


def test_any_head_dim_on_cpu():
    q, k, v = qkv(d=40)
    assert flash_attention_forward(q, k, v).shape == q.shape


DECODE_BAD = [
    (
        "int64 seqlens",
        lambda s: s.long(),
        {},
        TypeError,
        ("cache_seqlens", "torch.int64", "torch.int32"),
    ),
    ("wrong shape seqlens", lambda s: s[:1], {}, ValueError, ("cache_seqlens", "[batch]")),
    (
        "seqlen above Smax",
        lambda s: s + 100,
        {},
        ValueError,
        ("cache_seqlens[0]", "outside [0, 24]"),
    ),
    ("negative seqlen", lambda s: s - 100, {}, ValueError, ("cache_seqlens[0]", "outside")),
    (
        "num_splits zero",
        lambda s: s,
        {"num_splits": 0},
        ValueError,
        ("num_splits", "None", "got 0"),
    ),
    ("num_splits too many", lambda s: s, {"num_splits": 129}, ValueError, ("num_splits", "129")),
    ("config out of range", lambda s: s, {"config": 8}, ValueError, ("config", "got 8", "0 =")),
]


def test_decode_config_is_forced_or_refused_in_one_line():
    """config= forces a tile configuration on a decode call as on the forward: on CPU tensors a
    CUDA configuration is refused, and a paged cache (one kernel) refuses any but 0."""
    q, k, v = qkv(sq=1)
    seqlens = torch.tensor([20, 7], dtype=torch.int32)
    assert torch.equal(
        flash_attention_decode(q, k, v, seqlens, config=0), flash_attention_decode(q, k, v, seqlens)
    )
    with pytest.raises(ValueError) as info:
        flash_attention_decode(q, k, v, seqlens, config=5)
    one_line_error(info, "config=5", "CPU tensors", "config=0")
    pages = k.transpose(1, 2).reshape(-1, 16, k.shape[1], k.shape[-1])[:2].contiguous()
    table = torch.tensor([[0], [1]], dtype=torch.int32)
    with pytest.raises(ValueError) as info:
        flash_attention_decode(
            q, pages, pages, torch.tensor([5, 7], dtype=torch.int32), block_table=table, config=3
        )
    one_line_error(info, "config=3", "block_table", "config=0")


@pytest.mark.parametrize(
    "name,mutate,kwargs,exc,needles", DECODE_BAD, ids=[b[0] for b in DECODE_BAD]
)
@pytest.mark.parametrize("device", DEVICES)
def test_decode_bad_input(device, monkeypatch, name, mutate, kwargs, exc, needles):
    # On CUDA the values are checked by the kernels (test_input_checks.py) unless asked for here.
    monkeypatch.setenv("FLASHMOE_CHECK_INPUTS", "1")
    q, k, v = qkv(device, sq=1)
    seqlens = torch.tensor([20, 7], dtype=torch.int32, device=device)
    with pytest.raises(exc) as info:
        flash_attention_decode(q, k, v, mutate(seqlens), **kwargs)
    one_line_error(info, *needles)


@pytest.mark.gpu
def test_decode_seqlens_on_wrong_device():
    q, k, v = qkv("cuda", sq=1)
    with pytest.raises(ValueError) as info:
        flash_attention_decode(q, k, v, torch.tensor([3, 4], dtype=torch.int32))
    one_line_error(info, "cache_seqlens", "cpu")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "shape", [(0, 4, 16, 16), (2, 4, 0, 16), (2, 4, 16, 0)], ids=["B=0", "Sq=0", "Sk=0"]
)
def test_empty_inputs(device, shape):
    b, h, sq, sk = shape
    q, k, v = qkv(device, b=b, hq=h, hkv=h, sq=sq, sk=sk)
    out, lse = flash_attention_forward(q, k, v, return_lse=True)
    assert out.shape == (b, h, sq, 64) and lse.shape == (b, h, sq)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    if sk == 0 and out.numel():
        assert (out == 0).all() and torch.isinf(lse).all() and (lse < 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_default_scale_and_causal_alignment(device):
    """softmax_scale defaults to 1/sqrt(D); with Sq < Sk the causal mask is bottom-right aligned."""
    q, k, v = qkv(device, sq=5, sk=9)
    out = flash_attention_forward(q, k, v, causal=True)
    ref, _ = gates.attention_reference(q, k, v, True, 1 / math.sqrt(64))
    assert (out.double() - ref.double()).abs().max() < 1e-2
    # The last query sees every key: the same as the non-causal result for that row.
    full = flash_attention_forward(q, k, v, causal=False)
    torch.testing.assert_close(out[:, :, -1], full[:, :, -1])


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    q, k, v = qkv(device)
    ops.load_library()
    torch.library.opcheck(
        torch.ops.flashmoe_science.fwd.default, (q, k, v, None, True, 0.125, 0, 0)
    )
    seqlens = torch.tensor([20, 7], dtype=torch.int32, device=device)
    torch.library.opcheck(
        torch.ops.flashmoe_science.fwd.default, (q[:, :, :1], k, v, seqlens, True, 0.125, 3, 0)
    )


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile(device):
    q, k, v = qkv(device)
    compiled = torch.compile(
        lambda q, k, v: flash_attention_forward(q, k, v, causal=True) * 2, fullgraph=True
    )
    torch.testing.assert_close(compiled(q, k, v), flash_attention_forward(q, k, v, causal=True) * 2)


@pytest.mark.gpu
def test_runs_on_the_current_stream():
    q, k, v = qkv("cuda", sq=512, sk=512)
    expected = flash_attention_forward(q, k, v)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        q2 = q * 1  # produced on the side stream: a launch on the default stream would race with it
        out = flash_attention_forward(q2, k, v)
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
