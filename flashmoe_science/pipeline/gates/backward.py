"""Gradient gates: the backward of flash_attention_forward (dq, dk, dv) against a reference.

The reference is the attention's backward in closed form, computed in fp32 (fp64 on the CPU) from
the same inputs and grad_output: P = softmax(q k^T * scale) (rows that see no key: 0),
dV = P^T dO, dP = dO V^T, delta = rowsum(dO * O), dS = P * (dP - delta), dQ = scale * dS K,
dK = scale * dS^T Q, dK and dV summed over the query heads of a GQA group. With softcap, the scores
t = softcap * tanh(s / softcap) of the scaled scores s give dS = P * (dP - delta) * (1 - (t /
softcap)^2); with a window, masked scores have P = 0; with sinks, P's row includes the sink's
column (no value, so delta and dS are unchanged) and d sinks[h] = -sum over the rows of head h of
P_sink * delta (tests/gates/test_grad_gates.py checks this closed form against torch.autograd on
the fp64 forward). For each of dq, dk, dv (and dsinks):

Gate 1: max |g - g_ref| < 0.1 * max(1, max |g_ref|).
Gate 2 (FlashAttention's rule for gradients, tests/test_flash_attn.py): max |g - g_ref| <=
2 * max |g_pt - g_ref| + floor, where g_pt is PyTorch's own autograd through the same attention at
the input precision and floor = 2 * max |(g_ref + 0.3 - 0.3) - g_ref| in the input dtype. dsinks'
floor adds twice what storing the output at the input precision alone moves it (the reference's
dsinks with delta from its output rounded to the input dtype): a backward that reads the forward's
output, as FlashAttention's does, takes delta from that rounded output, and a sum over every row
of a head carries its rounding (with bf16 at Sq = 1023 it exceeded PyTorch's whole error, which
takes delta from fp32 probabilities: benches/notes/features.md, fv2).

Every case also checks: no NaN or Inf, every gradient element written (the call's fresh tensors
come filled with NaN: forward.poisoned_outputs), and for deterministic=True cases, bit-identical
gradients over 10 calls.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from ..cases import DTYPES, Case, make_inputs, make_output_grad, make_sinks
from .forward import (
    GATE2_EPS,
    GATE2_PT_MULTIPLIER,
    _visible_mask,
    features,
    poisoned_outputs,
)
from .matrix import rerun_fields

GATE1_REL = 0.1
# Calls whose gradients must be bit-identical for a deterministic=True case. On a GPU the default
# backward adds dQ with atomics, and 10 calls give the scheduler room to order them differently.
# The CPU twin splits its backward by (batch, kv head) with no shared accumulator
# (csrc/attention_cpu.h): 3 calls check it, at a third of the CPU tier's cost (its 17 deterministic
# cases took 9 s of the 2-core test stage).
DETERMINISM_REPEATS = {"cuda": 10, "cpu": 3}
GRADS = ("dq", "dk", "dv", "dsinks")  # dsinks: cases with sinks

Grads = tuple[torch.Tensor, ...]  # dq, dk, dv (and dsinks)
GradFn = Callable[[Case, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], Grads]


# --------------------------------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------------------------------


def reference_grads(
    q,
    k,
    v,
    dout,
    causal: bool,
    scale: float,
    compute_dtype=None,
    *,
    window=(-1, -1),
    softcap: float = 0.0,
    sinks=None,
    stored_dtype=None,
) -> Grads:
    """The backward in closed form, in `compute_dtype` (fp32 on CUDA, fp64 on the CPU): dq, dk, dv,
    and dsinks (fp32 [Hq] in compute_dtype) when sinks are given. `stored_dtype`: delta from the
    output rounded to it, as a backward that reads a stored output computes it."""
    if compute_dtype is None:
        compute_dtype = torch.float64 if q.device.type == "cpu" else torch.float32
    batch, heads_q, seqlen_q, _ = q.shape
    heads_kv, seqlen_k = k.shape[1], k.shape[2]
    ratio = heads_q // heads_kv
    qc, doc = q.to(compute_dtype), dout.to(compute_dtype)
    kc = k.to(compute_dtype).repeat_interleave(ratio, dim=1)
    vc = v.to(compute_dtype).repeat_interleave(ratio, dim=1)
    scores = (qc @ kc.transpose(-1, -2)) * scale
    if softcap:
        capped = torch.tanh(scores / softcap)
        scores, slope = softcap * capped, 1 - capped * capped
    visible = _visible_mask((seqlen_q, seqlen_k, causal), None, batch, q.device, window)
    scores = scores.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    if sinks is not None:
        sink = sinks.to(compute_dtype).view(1, -1, 1, 1)
        lse = torch.logaddexp(lse, sink.expand_as(lse))
    empty = torch.isinf(lse)
    probs = torch.where(empty, torch.zeros_like(scores), torch.exp(scores - lse.nan_to_num(0)))
    out = probs @ vc
    dv = probs.transpose(-1, -2) @ doc
    dprobs = doc @ vc.transpose(-1, -2)
    stored = out if stored_dtype is None else out.to(stored_dtype).to(compute_dtype)
    delta = (doc * stored).sum(dim=-1, keepdim=True)
    dscores = probs * (dprobs - delta)
    if softcap:
        dscores = dscores * slope
    dq = (dscores @ kc) * scale
    dk = (dscores.transpose(-1, -2) @ qc) * scale

    def group_sum(g: torch.Tensor) -> torch.Tensor:
        return g.view(batch, heads_kv, ratio, seqlen_k, -1).sum(dim=2)

    grads = (dq, group_sum(dk), group_sum(dv))
    if sinks is None:
        return grads
    sink_probs = torch.where(empty, torch.zeros_like(lse), torch.exp(sink - lse.nan_to_num(0)))
    return (*grads, -(sink_probs * delta).sum(dim=(0, 2, 3)))


def pytorch_lowp_grads(
    q, k, v, dout, causal: bool, scale: float, *, window=(-1, -1), softcap=0.0, sinks=None
) -> Grads:
    """PyTorch's autograd through the same attention at the input precision (the scale on k, as
    gates.attention_pytorch_lowp does; sinks fp32): the error that precision alone causes. Rows
    that see no key are zeroed by a mask, not by nan_to_num, so no NaN reaches their gradients."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    inputs = (q, k, v)
    ratio = q.shape[1] // k.shape[1]
    kr = k.repeat_interleave(ratio, dim=1)
    vr = v.repeat_interleave(ratio, dim=1)
    scores = q @ (kr * scale).transpose(-1, -2)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    visible = _visible_mask((q.shape[2], k.shape[2], causal), None, q.shape[0], q.device, window)
    has_key = visible.any(dim=-1, keepdim=True)
    scores = torch.where(has_key, scores.masked_fill(~visible, -math.inf), torch.zeros_like(scores))
    scores = scores.float()
    if sinks is not None:
        sinks = sinks.detach().float().requires_grad_()
        inputs = (*inputs, sinks)
        column = sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    probs = (probs * has_key).to(q.dtype)
    out = probs @ vr
    return torch.autograd.grad(out, inputs, dout)


# --------------------------------------------------------------------------------------------------
# Gates
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class GradGate:
    """One gradient's figures."""

    max_diff: float
    ref_max: float
    pt_max_diff: float
    floor: float
    bound: float
    nonfinite: int
    worst: tuple[int, int, int, int]  # (batch, head, row, column)


@dataclasses.dataclass
class GradResult:
    case_id: str
    device: str
    seed: int
    grads: dict[str, GradGate]
    deterministic: bool | None  # None: not checked (the default backward adds dQ with atomics)
    failures: list[str] = dataclasses.field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    def _worst(self) -> tuple[str, GradGate]:
        return max(self.grads.items(), key=lambda kv: kv[1].max_diff / max(kv[1].bound, 1e-30))

    def to_json(self) -> dict:
        """The row gates.json keeps, in the forward gates' shape (the worst gradient's figures, as
        a share of its own bound, at the top level) plus every gradient's own."""
        name, worst = self._worst()
        row = {
            "case_id": self.case_id,
            "device": self.device,
            "seed": self.seed,
            "max_diff": worst.max_diff,
            "pt_max_diff": worst.pt_max_diff,
            "floor": worst.floor,
            "bound": worst.bound,
            "ratio": worst.max_diff / worst.pt_max_diff if worst.pt_max_diff > 0 else None,
            "worst": list(worst.worst),
            "worst_grad": name,
            "nonfinite": sum(g.nonfinite for g in self.grads.values()),
            "deterministic": self.deterministic,
            "grads": {k: dataclasses.asdict(g) for k, g in self.grads.items()},
            "failures": list(self.failures),
            "passed": self.passed,
        }
        return _finite(row)


def _finite(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _as_4d(grad: torch.Tensor) -> torch.Tensor:
    """dsinks [Hq] as [1, Hq, 1, 1], so its worst element reads (batch, head, row, column)."""
    return grad.view(1, -1, 1, 1) if grad.dim() == 1 else grad


def evaluate_grad(
    got: torch.Tensor,
    ref: torch.Tensor,
    pt: torch.Tensor,
    dtype,
    stored: torch.Tensor | None = None,
) -> GradGate:
    """One gradient's figures; `stored`, the reference computed from the output rounded to `dtype`
    (dsinks), adds twice its distance from `ref` to the floor."""
    nonfinite = int((~torch.isfinite(got)).sum())
    err = torch.nan_to_num((got.to(ref.dtype) - ref).abs(), nan=math.inf)
    max_diff = float(err.max()) if err.numel() else 0.0
    ref_max = float(ref.abs().max()) if ref.numel() else 0.0
    pt_max = float((pt.to(ref.dtype) - ref).abs().max()) if ref.numel() else 0.0
    ref_lowp = ref.to(dtype)
    floor = 2 * float(((ref_lowp + 0.3 - 0.3) - ref_lowp).abs().max()) if ref.numel() else 0.0
    if stored is not None and ref.numel():
        floor += 2 * float((stored.to(ref.dtype) - ref).abs().max())
    worst = (0, 0, 0, 0)
    if err.numel():
        index = torch.unravel_index(torch.tensor(int(err.argmax())), err.shape)
        worst = tuple(int(x) for x in index)
    return GradGate(
        max_diff=max_diff,
        ref_max=ref_max,
        pt_max_diff=pt_max,
        floor=floor,
        bound=GATE2_PT_MULTIPLIER * pt_max + floor + GATE2_EPS,
        nonfinite=nonfinite,
        worst=worst,
    )


def evaluate(
    case: Case,
    device: str,
    seed: int,
    got: Grads,
    ref: Grads,
    pt: Grads,
    repeats: list[Grads],
    stored: Grads | None = None,
) -> GradResult:
    """Apply every gate to one backward's gradients against the references (`stored`: the
    reference from the output rounded to the input dtype, whose dsinks widens dsinks' floor)."""
    dtype = DTYPES[case.dtype]
    grads = {
        name: evaluate_grad(
            _as_4d(g),
            _as_4d(r),
            _as_4d(p),
            dtype,
            _as_4d(stored[3]) if stored is not None and name == "dsinks" else None,
        )
        for name, g, r, p in zip(GRADS[: len(got)], got, ref, pt, strict=True)
    }
    deterministic = None
    if repeats:
        deterministic = all(
            torch.equal(a, b) for again in repeats for a, b in zip(got, again, strict=True)
        )
    result = GradResult(case.id, device, seed, grads, deterministic)
    for name, g in grads.items():
        limit = GATE1_REL * max(1.0, g.ref_max)
        if g.nonfinite:
            result.failures.append(
                f"{name}: {g.nonfinite} NaN/Inf elements (unwritten gradient or a missing guard)"
            )
        if not g.max_diff < limit:
            result.failures.append(
                f"gate 1: {name} max diff {g.max_diff:.4g} >= 0.1 * max(1, max |{name}_ref| "
                f"= {g.ref_max:.4g})"
            )
        if not g.max_diff <= g.bound:
            result.failures.append(
                f"gate 2: {name} max diff {g.max_diff:.4g} > {GATE2_PT_MULTIPLIER:g} * PyTorch's "
                f"{g.pt_max_diff:.4g} + floor {g.floor:.3g}"
            )
    if deterministic is False:
        result.failures.append(
            f"deterministic=True: gradients differ over {determinism_repeats(device)} calls"
        )
    return result


def format_failure(case: Case, result: GradResult) -> str:
    """The multi-line report of a failing case: which gradient, how much, where, how to rerun."""
    lines = [
        f"FAILED {case.id} on {result.device} (seed {result.seed})",
        f"  case: {case.describe()}",
        *(f"  {f}" for f in result.failures),
    ]
    for name, g in result.grads.items():
        b, h, row, col = g.worst
        lines.append(
            f"  {name}: max diff {g.max_diff:.4g} (max |ref| {g.ref_max:.4g}); PyTorch "
            f"{case.dtype} error {g.pt_max_diff:.4g}; bound {g.bound:.4g}; worst at batch {b}, "
            f"head {h}, row {row}, column {col}"
        )
    rerun = rerun_fields(case, result.device)
    lines.append(f"  rerun: {rerun['rerun']}")
    if rerun["rerun_cpu"]:
        lines.append(f"  rerun on the CPU (same inputs): {rerun['rerun_cpu']}")
    return "\n".join(lines)


def call_api(case: Case, q, k, v, dout, softmax_scale: float) -> Grads:
    """The gradients as a user gets them: autograd through flash_attention_forward (and the sinks'
    with sinks)."""
    from ... import ops

    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    inputs = (q, k, v)
    options = {}
    if case.window != (-1, -1) or case.softcap or case.sinks:
        sinks = make_sinks(case, q.device.type)
        if sinks is not None:
            inputs = (*inputs, sinks.requires_grad_())
        options = {"window_size": case.window, "softcap": case.softcap, "sinks": sinks}
    out = ops.flash_attention_forward(
        q,
        k,
        v,
        case.causal,
        softmax_scale,
        backward_config=case.config,
        deterministic=case.deterministic,
        **options,
    )
    return torch.autograd.grad(out, inputs, dout)


def determinism_repeats(device: str) -> int:
    return DETERMINISM_REPEATS["cpu" if device == "cpu" else "cuda"]


def check_case(case: Case, device: str, grad_fn: GradFn | None = None) -> GradResult:
    """Run one backward case through the API (or `grad_fn`, for planted-error tests) and every
    gate."""
    fn = grad_fn or call_api
    seed = case.seed()
    q, k, v, _ = make_inputs(case, device, seed)
    dout = make_output_grad(case, device)
    scale = 1.0 / math.sqrt(case.head_dim)
    with poisoned_outputs():
        got = fn(case, q, k, v, dout, scale)
        repeats = []
        if case.deterministic:
            again = determinism_repeats(device) - 1
            repeats = [fn(case, q, k, v, dout, scale) for _ in range(again)]
    options = {**features(case), "sinks": make_sinks(case, device)}
    ref = reference_grads(q, k, v, dout, case.causal, scale, **options)
    pt = pytorch_lowp_grads(q, k, v, dout, case.causal, scale, **options)
    stored = None
    if options["sinks"] is not None:
        stored = reference_grads(
            q, k, v, dout, case.causal, scale, stored_dtype=DTYPES[case.dtype], **options
        )
    return evaluate(case, device, seed, got, ref, pt, repeats, stored)
