"""Autograd for the operators: flash_attention_forward and flash_attention_varlen_forward train,
flash_attention_decode refuses to.

The forward is `torch.ops.flashmoe_science.attention`; its backward is the operator
`attention_backward` (csrc/flash_bwd_kernel.cuh on CUDA, csrc/attention_cpu.h on the CPU), so
`torch.compile(fullgraph=True)` traces forward and backward alike and `torch.library.opcheck`
checks the registration. The context saves q, k, v, the output and the forward's log-sum-exp (never
a recomputed one), and the sinks where given. Gradients come back contiguous, in the inputs'
dtype, the sinks' (attention_backward's fourth output) in fp32.

`varlen_fwd` (flash_attention_varlen_forward) trains too: its backward runs `attention_backward`
on each sequence of the packed batch (dense views of its rows, the saved log-sum-exp sliced from
the [Hq, total_q] layout), one call per non-empty sequence.

`fwd` and `paged_fwd`, the operators behind flash_attention_decode (and the inference path), are
inference-only: backward through them raises instead of leaving q.grad silently None.
"""

from __future__ import annotations

from itertools import pairwise

import torch

from ._dispatch import call as _call

DECODE_IS_INFERENCE_ONLY = (
    "flash_attention_decode is inference-only: it has no backward. For gradients, call "
    "flash_attention_forward (causal=True gives the same attention over the cache)."
)


def _fake_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    causal,
    softmax_scale,
    deterministic,
    config,
    window_left=-1,
    window_right=-1,
    softcap=0.0,
    sinks=None,
):
    return (
        torch.empty(q.shape, dtype=q.dtype, device=q.device),
        torch.empty(k.shape, dtype=k.dtype, device=k.device),
        torch.empty(v.shape, dtype=v.dtype, device=v.device),
        torch.empty((0 if sinks is None else q.shape[1],), dtype=torch.float32, device=q.device),
    )


def _fake_attention(
    q, k, v, causal, softmax_scale, num_splits, config, deterministic, bwd_config, *features
):
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))  # v's head dim, the output's
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    return out, lse


# The operators' last four inputs (window_left, window_right, softcap, sinks): the backward's too.
FEATURES = 4


def _setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale, _num_splits, _config, deterministic, bwd_config = inputs[
        :-FEATURES
    ]
    *window_and_softcap, sinks = inputs[-FEATURES:]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, sinks)
    ctx.causal = causal
    ctx.softmax_scale = softmax_scale
    ctx.deterministic = deterministic
    ctx.bwd_config = bwd_config
    ctx.window_and_softcap = window_and_softcap
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, _grad_lse):
    # saved_tensors raises PyTorch's own error when an input was modified in place after the
    # forward (its version counter moved): "one of the variables needed for gradient computation
    # has been modified by an inplace operation".
    q, k, v, out, lse, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = _call(
        torch.ops.flashmoe_science.attention_backward,
        grad_out,
        q,
        k,
        v,
        out,
        lse,
        ctx.causal,
        ctx.softmax_scale,
        ctx.deterministic,
        ctx.bwd_config,
        *ctx.window_and_softcap,
        sinks,
    )
    dsinks = dsinks if ctx.needs_input_grad[-1] else None
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, dsinks


def _setup_decode(ctx, inputs, output):
    pass


def _refuse_backward(ctx, *grads):
    raise RuntimeError(DECODE_IS_INFERENCE_ONLY)


def _setup_varlen(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, _max_q, _max_k, causal, softmax_scale, _config = inputs[
        :-FEATURES
    ]
    *window_and_softcap, sinks = inputs[-FEATURES:]
    out, lse = output
    ctx.save_for_backward(q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, sinks)
    ctx.causal = causal
    ctx.softmax_scale = softmax_scale
    ctx.window_and_softcap = window_and_softcap
    ctx.mark_non_differentiable(lse)


def _dense_rows(t: torch.Tensor, begin: int, end: int) -> torch.Tensor:
    """Rows [begin, end) of a packed [total, H, D] tensor as the dense layout [1, H, S, D]."""
    return t[begin:end].transpose(0, 1).unsqueeze(0)


def _varlen_backward(ctx, grad_out, _grad_lse):
    q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, sinks = ctx.saved_tensors
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dsinks = None if sinks is None else torch.zeros_like(sinks)
    # The sequence bounds on the host (one copy); sequences without queries or keys have zero
    # gradients, which the zeros above already hold.
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for (q0, q1), (k0, k1) in zip(pairwise(bounds_q), pairwise(bounds_k), strict=True):
        if q1 == q0 or k1 == k0:
            continue
        dq_b, dk_b, dv_b, dsinks_b = _call(
            torch.ops.flashmoe_science.attention_backward,
            _dense_rows(grad_out, q0, q1),
            _dense_rows(q, q0, q1),
            _dense_rows(k, k0, k1),
            _dense_rows(v, k0, k1),
            _dense_rows(out, q0, q1),
            lse[:, q0:q1].unsqueeze(0),  # a view: the backward reads lse at any strides
            ctx.causal,
            ctx.softmax_scale,
            False,
            0,
            *ctx.window_and_softcap,
            sinks,
        )
        dq[q0:q1] = dq_b[0].transpose(0, 1)
        dk[k0:k1] = dk_b[0].transpose(0, 1)
        dv[k0:k1] = dv_b[0].transpose(0, 1)
        if dsinks is not None:
            dsinks += dsinks_b  # the sequences in order: the same sum every call
    if not ctx.needs_input_grad[-1]:
        dsinks = None
    return dq, dk, dv, *(None,) * 10, dsinks


def register() -> None:
    """Fake kernels and autograd formulas; called once, after the library is loaded."""
    torch.library.register_fake("flashmoe_science::attention")(_fake_attention)
    torch.library.register_fake("flashmoe_science::attention_backward")(_fake_backward)
    torch.library.register_autograd(
        "flashmoe_science::attention", _backward, setup_context=_setup_context
    )
    torch.library.register_autograd(
        "flashmoe_science::fwd", _refuse_backward, setup_context=_setup_decode
    )
    torch.library.register_autograd(
        "flashmoe_science::paged_fwd", _refuse_backward, setup_context=_setup_decode
    )
    torch.library.register_autograd(
        "flashmoe_science::varlen_fwd", _varlen_backward, setup_context=_setup_varlen
    )
