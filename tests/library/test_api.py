"""The public API: bad input raises a one-line error naming the argument, what was given and what is
supported; empty inputs return correctly shaped results; the operators work with torch.compile and
torch.library.opcheck; CUDA work runs on the current stream."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from flashmoe_science import flash_attention_decode, flash_attention_forward, ops
from flashmoe_science._dispatch import call
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


def test_any_head_dim_on_cpu():
    q, k, v = qkv(d=40)
    assert flash_attention_forward(q, k, v).shape == q.shape


# ---- head dims: v's (Dv) may differ from q's and k's (D); the output takes v's ------------------

# (D, Dv) pairs the CUDA kernels do not take yet, each refused on CUDA before any launch.
# Not multiples of 8 (the kernels copy 16-byte chunks), or past 256 (the widest tile)
CUDA_REFUSED_HEAD_DIMS = [(100, 100), (4, 4), (264, 264), (192, 132), (120, 264)]
# Run on the narrowest tile that holds q's and k's head dim and v's: 64, 128, 192 or 256
CUDA_PADDED_HEAD_DIMS = [(80, 80), (96, 96), (160, 160), (8, 8), (248, 248), (192, 128), (128, 64)]


def split_qkv(device="cpu", d=192, dv=128, b=2, hq=4, hkv=2, sq=16, sk=64):
    """q and k of head dim d, v of head dim dv (DeepSeek's multi-head latent attention: 192, 128)."""
    q, k, _ = qkv(device, b, hq, hkv, sq, sk, d, torch.bfloat16)
    v = torch.randn(b, hkv, sk, dv, generator=torch.Generator().manual_seed(1))
    return q, k, v.to(device, torch.bfloat16)


def _packed(t: torch.Tensor) -> torch.Tensor:
    """[B, H, S, D] -> the varlen layout [B * S, H, D]."""
    return t.transpose(1, 2).reshape(-1, *t.shape[1:2], t.shape[-1])


def test_every_operator_takes_a_head_dim_of_v_of_its_own():
    """On the CPU, v with a head dim other than q's and k's gives an output of v's head dim, the
    fp64 reference's, through the forward (split and not), decode with cache lengths and split-KV,
    a paged cache and a packed batch; softmax_scale defaults to 1/sqrt(q's head dim)."""
    from flashmoe_science import flash_attention_varlen_forward

    q, k, v = split_qkv(sq=16, sk=64)
    scale = 1 / math.sqrt(192)
    ref, ref_lse = gates.attention_reference(q, k, v, True, scale)
    for splits in (1, 3):
        out, lse = flash_attention_forward(q, k, v, True, return_lse=True, num_splits=splits)
        assert out.shape == (2, 4, 16, 128)
        assert (out.double() - ref).abs().max() < 2e-2
        torch.testing.assert_close(lse.double(), ref_lse, atol=1e-3, rtol=1e-3)
    lengths = torch.tensor([64, 37], dtype=torch.int32)
    ref_decode, _ = gates.attention_reference(q[:, :, -1:], k, v, True, scale, lengths)
    decoded = flash_attention_decode(q[:, :, -1:], k, v, lengths, num_splits=3)
    assert decoded.shape == (2, 4, 1, 128)
    assert (decoded.double() - ref_decode).abs().max() < 2e-2
    # pages of 16 keys, sequence b's in pages 4b to 4b + 3
    k_pages, v_pages = (t.transpose(1, 2).reshape(-1, 16, 2, t.shape[-1]) for t in (k, v))
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    paged = flash_attention_decode(q[:, :, -1:], k_pages, v_pages, lengths, block_table=table)
    assert torch.equal(paged, flash_attention_decode(q[:, :, -1:], k, v, lengths, num_splits=1))
    cu = torch.tensor([0, 16, 32], dtype=torch.int32), torch.tensor([0, 64, 128], dtype=torch.int32)
    packed = flash_attention_varlen_forward(_packed(q), _packed(k), _packed(v), *cu, 16, 64, True)
    assert packed.shape == (32, 4, 128)
    assert (packed.double() - _packed(ref)).abs().max() < 2e-2


def test_gradients_take_the_head_dims_of_their_inputs():
    """dq and dk come back in q's and k's head dim, dv in v's, each the fp64 reference's; a packed
    batch's gradients are the dense ones."""
    from flashmoe_science import flash_attention_varlen_forward
    from flashmoe_science.pipeline.gates.backward import reference_grads

    q, k, v = (t.requires_grad_() for t in split_qkv(sq=16, sk=24))
    dout = torch.randn(2, 4, 16, 128, generator=torch.Generator().manual_seed(2)).bfloat16()
    grads = torch.autograd.grad(flash_attention_forward(q, k, v, True), (q, k, v), dout)
    expected = reference_grads(q.detach(), k.detach(), v.detach(), dout, True, 1 / math.sqrt(192))
    for got, ref, shape in zip(grads, expected, (q.shape, k.shape, v.shape), strict=True):
        assert got.shape == shape and (got.double() - ref).abs().max() < 5e-2
    cu = torch.tensor([0, 16, 32], dtype=torch.int32), torch.tensor([0, 24, 48], dtype=torch.int32)
    packed_inputs = [_packed(t.detach()).requires_grad_() for t in (q, k, v)]
    out = flash_attention_varlen_forward(*packed_inputs, *cu, 16, 24, True)
    packed_grads = torch.autograd.grad(out, packed_inputs, _packed(dout))
    for got, dense in zip(packed_grads, grads, strict=True):
        torch.testing.assert_close(got, _packed(dense), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dims", CUDA_PADDED_HEAD_DIMS, ids=str)
def test_every_cuda_operator_at_a_padded_head_dim(head_dims):
    """On CUDA, head dims below their tile (80 on 128, 8 on 64, 248 on 256, v's 128 under q's 192,
    v's 64 under q's 128): the forward (split and not), decode with cache lengths and split-KV, a
    paged cache, a packed batch and the gradients each match the fp64 reference at v's head dim,
    with no padded column leaking into the scores or the output."""
    from flashmoe_science import flash_attention_varlen_forward
    from flashmoe_science.pipeline.gates.backward import reference_grads

    d, dv = head_dims
    q, k, v = split_qkv("cuda", d, dv, sq=16, sk=64)
    scale = 1 / math.sqrt(d)
    ref, ref_lse = gates.attention_reference(q, k, v, True, scale)
    for splits in (1, 3):
        out, lse = flash_attention_forward(q, k, v, True, return_lse=True, num_splits=splits)
        assert out.shape == (2, 4, 16, dv)
        assert (out.double() - ref).abs().max() < 2e-2, splits
        torch.testing.assert_close(lse.double(), ref_lse.double(), atol=1e-3, rtol=1e-3)
    lengths = torch.tensor([64, 37], dtype=torch.int32, device="cuda")
    ref_decode, _ = gates.attention_reference(q[:, :, -1:], k, v, True, scale, lengths)
    k_pages, v_pages = (t.transpose(1, 2).reshape(-1, 16, 2, t.shape[-1]) for t in (k, v))
    table = torch.arange(8, dtype=torch.int32, device="cuda").view(2, 4)
    for decoded in (
        flash_attention_decode(q[:, :, -1:], k, v, lengths, num_splits=3),
        flash_attention_decode(q[:, :, -1:], k_pages, v_pages, lengths, block_table=table),
    ):
        assert decoded.shape == (2, 4, 1, dv)
        assert (decoded.double() - ref_decode).abs().max() < 2e-2
    cu = (
        torch.tensor([0, 16, 32], dtype=torch.int32, device="cuda"),
        torch.tensor([0, 64, 128], dtype=torch.int32, device="cuda"),
    )
    packed = flash_attention_varlen_forward(_packed(q), _packed(k), _packed(v), *cu, 16, 64, True)
    assert packed.shape == (32, 4, dv)
    assert (packed.double() - _packed(ref)).abs().max() < 2e-2
    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    dout = torch.randn(2, 4, 16, dv, generator=torch.Generator().manual_seed(2))
    dout = dout.to("cuda", torch.bfloat16)
    grads = torch.autograd.grad(flash_attention_forward(*inputs, True), inputs, dout)
    expected = reference_grads(q, k, v, dout, True, scale)
    for got, want, name in zip(grads, expected, "qkv", strict=True):
        assert got.shape == want.shape and (got.double() - want).abs().max() < 5e-2, name


def test_opcheck_with_a_head_dim_of_v_of_its_own():
    """The fake kernels give the output v's head dim, as the CPU kernels do (opcheck compares
    them), for every operator, the backward's included."""
    q, k, v = split_qkv(sq=8, sk=32)
    lib = torch.ops.flashmoe_science
    out, lse = lib.attention(q, k, v, True, 0.1, 0, 0, False, 0)
    lengths = torch.tensor([32, 5], dtype=torch.int32)
    k_pages, v_pages = (t.transpose(1, 2).reshape(-1, 16, 2, t.shape[-1]) for t in (k, v))
    table = torch.arange(4, dtype=torch.int32).view(2, 2)
    cu_q, cu_k = (
        torch.tensor([0, 8, 16], dtype=torch.int32),
        torch.tensor([0, 32, 64], dtype=torch.int32),
    )
    for op, args in (
        (lib.fwd.default, (q, k, v, None, True, 0.1, 2, 0)),
        (lib.attention.default, (q, k, v, True, 0.1, 0, 0, False, 0)),
        (lib.attention_backward.default, (out, q, k, v, out, lse, True, 0.1, False, 0)),
        (lib.paged_fwd.default, (q[:, :, :1], k_pages, v_pages, table, lengths, True, 0.1, 0)),
        (lib.varlen_fwd.default, (*map(_packed, (q, k, v)), cu_q, cu_k, 8, 32, True, 0.1, 0)),
    ):
        torch.library.opcheck(op, args)


@pytest.mark.parametrize(
    "mutate, needles",
    [
        (lambda q, k, v: (q, k[..., :64], v), ("head_dim differs", "k's last dimension")),
        (lambda q, k, v: (q, k, v[:, :, :5]), ("k and v", "but for the last dimension")),
    ],
    ids=["k's head dim", "v's keys"],
)
def test_k_keeps_q_head_dim_and_v_k_shape(mutate, needles):
    q, k, v = split_qkv()
    with pytest.raises(ValueError) as info:
        flash_attention_forward(*mutate(q, k, v))
    one_line_error(info, *needles)


def test_backward_checks_grad_output_against_v_head_dim():
    q, k, v = split_qkv(sq=8, sk=8)
    out, lse = torch.ops.flashmoe_science.attention(q, k, v, False, 0.1, 0, 0, False, 0)
    with pytest.raises(ValueError) as info:
        call(
            torch.ops.flashmoe_science.attention_backward,
            q,
            q,
            k,
            v,
            out,
            lse,
            False,
            0.1,
            False,
            0,
        )
    one_line_error(
        info, "grad_output must have the output's shape [2, 4, 8, 128]", "got [2, 4, 8, 192]"
    )


def test_backward_refuses_a_head_dim_of_v_past_its_params_field():
    """The backward's parameters hold v's head dim in 16 bits (where the struct had padding), so a
    wider v is a one-line error, not a wrapped dimension."""
    q = torch.randn(1, 1, 2, 8, dtype=torch.bfloat16)
    v = torch.randn(1, 1, 2, 1 << 15, dtype=torch.bfloat16)
    out, lse = torch.ops.flashmoe_science.attention(q, q, v, False, 0.1, 0, 0, False, 0)
    with pytest.raises(ValueError) as info:
        call(
            torch.ops.flashmoe_science.attention_backward,
            out,
            q,
            q,
            v,
            out,
            lse,
            False,
            0.1,
            False,
            0,
        )
    one_line_error(info, "v's head_dim must be below 32768", "got 32768")


@pytest.mark.parametrize("head_dims", CUDA_REFUSED_HEAD_DIMS, ids=str)
def test_head_dims_cuda_does_not_take_yet_say_what_it_does(head_dims):
    """What the CUDA operators raise before any launch, in one line: the head dims given, those
    CUDA takes, and that the CPU implementation takes any (v's differing included)."""
    head_dim, head_dim_v = head_dims
    reason = ops.head_dims_unsupported_reason(head_dim, head_dim_v)
    assert not ops.head_dims_supported(head_dim, head_dim_v)
    assert "\n" not in reason and reason.startswith(f"head_dim={head_dim} ")
    assert "is not supported on CUDA; supported: multiples of 8 up to 256" in reason
    assert "the CPU implementation takes any head_dim" in reason
    if head_dim_v != head_dim:
        assert f"with v's head_dim={head_dim_v}" in reason and "v's may differ" in reason


def test_head_dims_cuda_takes():
    """The tiles' head dims, and every multiple of 8 up to 256 padded onto the narrowest tile that
    holds q's and k's and v's (DeepSeek's 192 with v's 128 among them)."""
    for head_dim in (64, 128, 192, 256):
        assert ops.head_dims_unsupported_reason(head_dim) is None
        assert ops.head_dims_supported(head_dim, head_dim)
    for head_dims in CUDA_PADDED_HEAD_DIMS:
        assert ops.head_dims_unsupported_reason(*head_dims) is None, head_dims
    assert [ops.head_dims_supported(d) for d in range(8, 264, 4)] == [
        d % 8 == 0 and d <= 256 for d in range(8, 264, 4)
    ]
    with pytest.raises(ValueError, match="head_dim_v must be an int"):
        ops.head_dims_unsupported_reason(64, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dims", CUDA_REFUSED_HEAD_DIMS, ids=str)
@pytest.mark.parametrize("case", ["forward", "backward", "decode", "paged", "varlen"])
def test_unsupported_head_dims_on_cuda(head_dims, case):
    """Every CUDA operator refuses head dims its kernels do not take, before any launch, with
    ops.head_dims_unsupported_reason's line (the same inputs run on the CPU)."""
    from flashmoe_science import flash_attention_varlen_forward

    q, k, v = split_qkv("cuda", *head_dims, sq=16, sk=64)
    lengths = torch.tensor([64, 37], dtype=torch.int32, device="cuda")
    k_pages, v_pages = (t.transpose(1, 2).reshape(-1, 16, 2, t.shape[-1]) for t in (k, v))
    table = torch.arange(8, dtype=torch.int32, device="cuda").view(2, 4)
    cu_q = torch.tensor([0, 16, 32], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 64, 128], dtype=torch.int32, device="cuda")
    out = torch.zeros(2, 4, 16, head_dims[1], device="cuda", dtype=q.dtype)
    lse = torch.zeros(2, 4, 16, device="cuda")
    calls = {
        "forward": lambda: flash_attention_forward(q, k, v),
        "backward": lambda: call(
            torch.ops.flashmoe_science.attention_backward,
            out,
            q,
            k,
            v,
            out,
            lse,
            False,
            0.1,
            False,
            0,
        ),
        "decode": lambda: flash_attention_decode(q[:, :, :1], k, v, lengths),
        "paged": lambda: flash_attention_decode(
            q[:, :, :1], k_pages, v_pages, lengths, block_table=table
        ),
        "varlen": lambda: flash_attention_varlen_forward(
            _packed(q), _packed(k), _packed(v), cu_q, cu_k, 16, 64
        ),
    }
    with pytest.raises(ValueError) as info:
        calls[case]()
    assert one_line_error(info) == ops.head_dims_unsupported_reason(*head_dims)


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


def test_a_test_that_leaves_tritons_probe_wrong_is_caught_and_the_probe_repaired():
    """tests/conftest.py's guard against a test that breaks torch.compile for the rest of its
    worker, on stand-ins for torch's modules: inductor's scheduler bound to a patched probe, and a
    cached False where a fresh probe says True (a GPU with Triton)."""
    from types import SimpleNamespace

    from conftest import TritonProbeState, triton_probe_left_wrong

    def has_triton():
        return True

    patched = SimpleNamespace(has_triton=lambda: False)
    modules = {
        "torch.utils._triton": SimpleNamespace(has_triton=has_triton),
        "torch._inductor.scheduler": patched,
    }
    why = triton_probe_left_wrong(modules, TritonProbeState())
    assert "inductor was first imported while" in why and patched.has_triton is has_triton

    answers = iter([False, True])  # its first call under a patch, then a fresh one

    @functools.cache
    def cached():
        return next(answers)

    assert cached() is False
    why = triton_probe_left_wrong(
        {"torch.utils._triton": SimpleNamespace(has_triton=cached)}, TritonProbeState()
    )
    assert "cached False" in why and cached.cache_info().currsize == 0
    # right answers, cached or not: nothing to say (a CPU machine's False included)
    for answer in (True, False):
        cached = functools.cache(lambda answer=answer: answer)
        cached()
        assert (
            triton_probe_left_wrong(
                {"torch.utils._triton": SimpleNamespace(has_triton=cached)}, TritonProbeState()
            )
            is None
        )


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
