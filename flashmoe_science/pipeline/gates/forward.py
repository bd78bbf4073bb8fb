"""Correctness gates: the references, the two gates and the failure report (the cases: matrix.py).

Gate 1 (the user's): max |out - ref| < 0.1.
Gate 2 (FlashAttention's, stricter): max |out - ref| <= 2 * max |out_pt - ref| + floor, where ref is the
attention computed in fp32 (fp64 on the CPU) from the same inputs, out_pt is the same attention done
by PyTorch at the input precision, and floor = 2 * max |(ref + 0.3 - 0.3) - ref| in the input dtype
(the error of doing any arithmetic at all), so the gate cannot fail only because PyTorch's own error
happens to be zero (FlashAttention's hopper tests use the same form).

Every case also checks: no NaN or Inf, every output element written (the call's fresh tensors come
filled with NaN: poisoned_outputs), the log-sum-exp against the reference, and bit-identical
repeated calls.

The references take the features of local attention, each in its definition's own terms: the
window as a mask of positions (query i at p = i + Sk - Sq sees p - left <= j <= p + right),
softcap as softcap * tanh(s / softcap) of the scaled scores before the mask, sinks as one more
column of the softmax (its logit, no value) that is dropped after it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ..cases import DTYPES, Case, make_inputs, make_sinks
from .matrix import rerun_fields

GATE1_MAX_DIFF = 0.1
GATE2_PT_MULTIPLIER = 2.0
GATE2_EPS = 1e-5
LSE_ATOL = 1e-3
LSE_RTOL = 1e-3


# --------------------------------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------------------------------


def _visible_mask(
    case_like: tuple[int, int, bool], seqlens, batch: int, device, window=(-1, -1)
) -> torch.Tensor:
    """[B, 1, Sq, Sk] True where query i may see key j: key j < the sequence's length and, with
    query i at p = i + length - Sq (bottom-right aligned), p - left <= j <= p + right for
    window_size=(left, right) (-1: unbounded), causal being right = 0."""
    seqlen_q, seqlen_k, causal = case_like
    if seqlens is None:
        lens = torch.full((batch,), seqlen_k, device=device, dtype=torch.int64)
    else:
        lens = seqlens.to(device=device, dtype=torch.int64)
    i = torch.arange(seqlen_q, device=device).view(1, 1, -1, 1)
    j = torch.arange(seqlen_k, device=device).view(1, 1, 1, -1)
    lens = lens.view(-1, 1, 1, 1)
    position = i + lens - seqlen_q
    left, right = window
    if causal:
        right = 0
    visible = j < lens
    if left >= 0:
        visible = visible & (j >= position - left)
    if right >= 0:
        visible = visible & (j <= position + right)
    return visible


def _capped(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    """softcap * tanh(scores / softcap), of the scaled scores (softcap 0: unchanged)."""
    return softcap * torch.tanh(scores / softcap) if softcap else scores


def attention_reference(
    q,
    k,
    v,
    causal: bool,
    scale: float,
    seqlens=None,
    compute_dtype=None,
    *,
    window=(-1, -1),
    softcap: float = 0.0,
    sinks=None,
):
    """Attention computed in `compute_dtype` (fp32 on CUDA, fp64 on the CPU by default) from the same
    inputs, with window_size=window, softcap and sinks (fp32 [Hq]) as the API defines them. Rows
    that see no key get output 0 and log-sum-exp -inf (their sink's logit with sinks). Returns
    (out, lse) in compute_dtype."""
    if compute_dtype is None:
        compute_dtype = torch.float64 if q.device.type == "cpu" else torch.float32
    ratio = q.shape[1] // k.shape[1]
    qc = q.to(compute_dtype)
    kc = k.to(compute_dtype).repeat_interleave(ratio, dim=1)
    vc = v.to(compute_dtype).repeat_interleave(ratio, dim=1)
    scores = _capped((qc @ kc.transpose(-1, -2)) * scale, softcap)
    visible = _visible_mask((q.shape[2], k.shape[2], causal), seqlens, q.shape[0], q.device, window)
    scores = scores.masked_fill(~visible, -math.inf)
    if sinks is not None:  # the sink's column: its logit in every row
        column = sinks.to(compute_dtype).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        scores = torch.cat([scores, column], dim=-1)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    probs = torch.where(torch.isinf(lse).unsqueeze(-1), torch.zeros_like(probs), probs)
    if sinks is not None:
        probs = probs[..., :-1]  # the sink has no value
    return probs @ vc, lse


def attention_pytorch_lowp(
    q, k, v, causal: bool, scale: float, seqlens=None, *, window=(-1, -1), softcap=0.0, sinks=None
):
    """The same attention done by plain PyTorch at the input precision, with the scale moved onto k
    (FlashAttention's `reorder_ops`), to measure the error that precision alone causes."""
    ratio = q.shape[1] // k.shape[1]
    kr = k.repeat_interleave(ratio, dim=1)
    vr = v.repeat_interleave(ratio, dim=1)
    scores = _capped(q @ (kr * scale).transpose(-1, -2), softcap)
    visible = _visible_mask((q.shape[2], k.shape[2], causal), seqlens, q.shape[0], q.device, window)
    scores = scores.float().masked_fill(~visible, -math.inf)
    if sinks is not None:
        column = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        scores = torch.cat([scores, column], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    probs = torch.nan_to_num(probs, nan=0.0).to(q.dtype)
    return probs @ vr


# --------------------------------------------------------------------------------------------------
# Gates
# --------------------------------------------------------------------------------------------------


@dataclass
class GateResult:
    case_id: str
    device: str
    seed: int
    max_diff: float
    mean_diff: float
    pt_max_diff: float
    floor: float
    bound: float
    ratio: float  # max_diff / pt_max_diff (how many times PyTorch's own error)
    worst: tuple[int, int, int, int]  # (batch, head, query row, column of D)
    row_profile: list[tuple[int, int, float]]  # (first row, last row, max diff) per row segment
    nonfinite: int
    lse_max_diff: float
    lse_inf_mismatch: int
    deterministic: bool
    failures: list[str] = dataclasses.field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["passed"] = self.passed
        return {
            key: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for key, v in d.items()
        }


def row_profile(err_rows: torch.Tensor, segments: int = 8) -> list[tuple[int, int, float]]:
    """Max error per contiguous segment of query rows: how the error grows along the rows."""
    n = err_rows.numel()
    if n == 0:
        return []
    bounds = sorted({round(i * n / segments) for i in range(segments + 1)})
    return [
        (lo, hi - 1, float(err_rows[lo:hi].max()))
        for lo, hi in itertools.pairwise(bounds)
        if hi > lo
    ]


def evaluate(
    case: Case, device: str, seed: int, out, lse, out_again, lse_again, ref, ref_lse, out_pt
) -> GateResult:
    """Apply every gate to one call's results against the references."""
    dtype = DTYPES[case.dtype]
    outf = out.to(ref.dtype)
    err = (outf - ref).abs()
    nonfinite = int((~torch.isfinite(out)).sum())
    err = torch.nan_to_num(err, nan=math.inf)
    max_diff = float(err.max()) if err.numel() else 0.0
    mean_diff = float(err.mean()) if err.numel() else 0.0
    pt_max = float((out_pt.to(ref.dtype) - ref).abs().max()) if ref.numel() else 0.0
    ref_lowp = ref.to(dtype)
    floor = 2 * float(((ref_lowp + 0.3 - 0.3) - ref_lowp).abs().max()) if ref.numel() else 0.0
    bound = GATE2_PT_MULTIPLIER * pt_max + floor + GATE2_EPS
    worst = (0, 0, 0, 0)
    if err.numel():
        flat = int(err.argmax())
        worst = tuple(int(x) for x in torch.unravel_index(torch.tensor(flat), err.shape))
    err_rows = err.amax(dim=(0, 1, 3)) if err.numel() else err.new_zeros(0)

    lse_max_diff, lse_inf_mismatch = 0.0, 0
    if lse is not None and ref_lse.numel():
        lse32 = lse.to(ref_lse.dtype)
        ref_inf, got_inf = torch.isinf(ref_lse), torch.isinf(lse32)
        lse_inf_mismatch = int((ref_inf != got_inf).sum()) + int(torch.isnan(lse32).sum())
        finite = ~ref_inf & ~got_inf
        if finite.any():
            excess = (lse32[finite] - ref_lse[finite]).abs() - LSE_RTOL * ref_lse[finite].abs()
            lse_max_diff = float(excess.max())
    deterministic = torch.equal(out, out_again) and (lse is None or torch.equal(lse, lse_again))

    result = GateResult(
        case_id=case.id,
        device=device,
        seed=seed,
        max_diff=max_diff,
        mean_diff=mean_diff,
        pt_max_diff=pt_max,
        floor=floor,
        bound=bound,
        ratio=max_diff / pt_max if pt_max > 0 else (0.0 if max_diff == 0 else math.inf),
        worst=worst,
        row_profile=row_profile(err_rows.float().cpu()),
        nonfinite=nonfinite,
        lse_max_diff=lse_max_diff,
        lse_inf_mismatch=lse_inf_mismatch,
        deterministic=deterministic,
    )
    if nonfinite:
        result.failures.append(
            f"{nonfinite} NaN/Inf output elements (unwritten output or a missing NaN guard)"
        )
    if not max_diff < GATE1_MAX_DIFF:
        result.failures.append(f"gate 1: max diff {max_diff:.4g} >= {GATE1_MAX_DIFF}")
    if not max_diff <= bound:
        result.failures.append(
            f"gate 2: max diff {max_diff:.4g} > {GATE2_PT_MULTIPLIER:g} * PyTorch's {pt_max:.4g} + floor {floor:.3g}"
        )
    if lse_inf_mismatch:
        result.failures.append(
            f"log-sum-exp: {lse_inf_mismatch} rows disagree on -inf/NaN (empty rows)"
        )
    if lse_max_diff > LSE_ATOL:
        result.failures.append(
            f"log-sum-exp: max diff {lse_max_diff:.4g} beyond {LSE_ATOL} + {LSE_RTOL} * |lse|"
        )
    if not deterministic:
        result.failures.append("repeated calls on the same inputs are not bit-identical (a race?)")
    return result


def format_failure(case: Case, result: GateResult) -> str:
    """The multi-line report of a failing case: what, how much, where, how it grows, how to rerun."""
    b, h, row, col = result.worst
    profile = ", ".join(f"rows {lo}-{hi}: {mx:.3g}" for lo, hi, mx in result.row_profile)
    lines = [
        f"FAILED {case.id} on {result.device} (seed {result.seed})",
        f"  case: {case.describe()}",
        *(f"  {f}" for f in result.failures),
        f"  max diff {result.max_diff:.4g} (mean {result.mean_diff:.3g}); PyTorch {case.dtype} error "
        f"{result.pt_max_diff:.4g}; error ratio {result.ratio:.3g}x; gate-2 bound {result.bound:.4g}",
        f"  worst element: batch {b}, head {h}, query row {row}, column {col}",
        f"  error along query rows: {profile}",
    ]
    rerun = rerun_fields(case, result.device)
    needs = f" (needs {rerun['rerun_needs']})" if rerun["rerun_needs"] else ""
    lines.append(f"  rerun: {rerun['rerun']}{needs}")
    if rerun["rerun_cpu"]:
        lines.append(f"  rerun on the CPU (same inputs): {rerun['rerun_cpu']}")
    return "\n".join(lines)


AttentionFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def features(case) -> dict:
    """The window and softcap of a case (a Case, VarlenCase or PagedCase) as the references take
    them; its sinks come from its seed (cases.make_sinks, varlen_sinks, paged_sinks)."""
    return {"window": case.window, "softcap": case.softcap}


def call_api(case: Case, q, k, v, seqlens, softmax_scale: float):
    """Call the public API exactly as a user would."""
    from ... import ops

    options = {}
    if case.window != (-1, -1) or case.softcap or case.sinks:  # as a user of none of them calls
        options = {
            "window_size": case.window,
            "softcap": case.softcap,
            "sinks": make_sinks(case, q.device.type),
        }
    if case.kind == "decode":
        return ops.flash_attention_decode(
            q,
            k,
            v,
            seqlens,
            softmax_scale,
            causal=case.causal,
            num_splits=case.num_splits or None,
            return_lse=True,
            config=case.config,
            **options,
        )
    return ops.flash_attention_forward(
        q,
        k,
        v,
        case.causal,
        softmax_scale,
        return_lse=True,
        num_splits=case.num_splits,
        config=case.config,
        **options,
    )


@contextlib.contextmanager
def poisoned_outputs() -> Iterator[None]:
    """Inside, every tensor the call allocates without initialising (torch.empty and its kin, from
    Python or from the extension's C++) comes filled with NaN, on the CPU and on CUDA alike, so
    any element a kernel forgets to write shows up as NaN. This is PyTorch's
    `torch.utils.deterministic.fill_uninitialized_memory`, which acts only while deterministic
    algorithms are on: they are turned on with warn_only (no operator refuses to run) and
    everything is restored on the way out. Poisoning the caching allocator's free blocks instead
    was not enough: a gradient could land on a block a temporary had already overwritten."""
    was_on = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    was_filling = torch.utils.deterministic.fill_uninitialized_memory
    _deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = was_filling
        _deterministic_algorithms(was_on, warn_only=was_warn_only)


def _deterministic_algorithms(mode: bool, warn_only: bool) -> None:
    """torch.use_deterministic_algorithms for eager operators. The public call also sets
    inductor's config, importing torch._inductor and dynamo first: 1.4 s of every process that
    runs a gate (each test worker, each planted-bug process, each bisect step), for compiled code
    the gates never run. Where inductor is loaded already, the public call keeps its config in
    step."""
    flag = getattr(torch._C, "_set_deterministic_algorithms", None)
    if flag is None or "torch._inductor.config" in sys.modules:
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)
    else:
        flag(mode, warn_only=warn_only)


def check_case(case: Case, device: str, attention_fn: AttentionFn | None = None) -> GateResult:
    """Run one case through the API (or `attention_fn`, for planted-error tests) and every gate."""
    fn = attention_fn or call_api
    seed = case.seed()
    q, k, v, seqlens = make_inputs(case, device, seed)
    scale = 1.0 / math.sqrt(case.head_dim)
    with poisoned_outputs():
        out, lse = fn(case, q, k, v, seqlens, scale)
        out_again, lse_again = fn(case, q, k, v, seqlens, scale)
    options = {**features(case), "sinks": make_sinks(case, device)}
    ref, ref_lse = attention_reference(q, k, v, case.causal, scale, seqlens, **options)
    out_pt = attention_pytorch_lowp(q, k, v, case.causal, scale, seqlens, **options)
    return evaluate(case, device, seed, out, lse, out_again, lse_again, ref, ref_lse, out_pt)
