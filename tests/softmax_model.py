"""A blockwise model of FlashAttention's forward in fp32, shared by the tests that show which inputs
a skipped output rescale passes (normal scores) and which catch it (ramped scores)."""

from __future__ import annotations

import math

import torch


def online_softmax(q, k, v, causal, scale, *, backwards, rescale_output, block=128, lazy=8.0):
    """FlashAttention's forward in fp32, one key block at a time (from the last block when
    `backwards`, as the wgmma kernel walks), with that kernel's lazy rescale: the running max moves
    only when a block's max exceeds it by more than 2^lazy. `rescale_output=False` plants the bug
    of forgetting to rescale the output when it does."""
    ratio = q.shape[1] // k.shape[1]
    qf = q.float()
    kf = k.float().repeat_interleave(ratio, dim=1)
    vf = v.float().repeat_interleave(ratio, dim=1)
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    log2e = 1.4426950408889634
    rows = torch.arange(seqlen_q).view(-1, 1)
    m = torch.full((*q.shape[:3], 1), -math.inf)
    total, out = torch.zeros_like(m), torch.zeros_like(qf)
    starts = range(0, seqlen_k, block)
    for n0 in reversed(starts) if backwards else starts:
        cols = torch.arange(n0, min(n0 + block, seqlen_k)).view(1, -1)
        s = qf @ kf[:, :, n0 : n0 + block].transpose(-1, -2)
        if causal:
            s = s.masked_fill(cols > rows + seqlen_k - seqlen_q, -math.inf)
        grown = (torch.maximum(m, s.amax(-1, keepdim=True)) - m) * scale * log2e
        move = ~(grown <= lazy)  # NaN (both -inf) moves too
        new_m = torch.where(move, torch.maximum(m, s.amax(-1, keepdim=True)), m)
        shift = torch.where(new_m == -math.inf, 0.0, new_m * scale * log2e)
        alpha = torch.where(move, torch.exp2(m * scale * log2e - shift), 1.0)
        p = torch.exp2(s * scale * log2e - shift)
        total = total * alpha + p.sum(-1, keepdim=True)
        out = (out * alpha if rescale_output else out) + p @ vf[:, :, n0 : n0 + block]
        m = new_m
    empty = total == 0
    out = torch.where(empty, 0.0, out / torch.where(empty, 1.0, total))
    lse = torch.where(empty, -math.inf, m * scale + torch.log(total)).squeeze(-1)
    return out.to(q.dtype), lse
