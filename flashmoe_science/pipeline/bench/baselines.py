"""What the benchmark times: our kernels, loaded from this checkout's build, and PyTorch's
F.scaled_dot_product_attention with each backend forced through torch.nn.attention.sdpa_kernel
(FLASH_ATTENTION, CUDNN_ATTENTION, EFFICIENT_ATTENTION) or left to its own choice ("sdpa-default").
A call that refuses a case says why (`first_call`), and that reason goes into the record.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import exitcodes
from ..build import unit as build
from ..cases import Case, Inputs, make_output_grad, make_sinks
from .records import BASELINE_NAMES
from .timing import first_line

# sdpa-default: SDPA's own choice, which differs by GPU and torch version
BASELINES = dict(
    zip(
        BASELINE_NAMES,
        (
            SDPBackend.FLASH_ATTENTION,
            SDPBackend.CUDNN_ATTENTION,
            SDPBackend.EFFICIENT_ATTENTION,
            None,
        ),
        strict=True,
    )
)


class Abort(Exception):
    """Stop with this exit code; the message says what went wrong and what to do."""

    def __init__(self, exit_code: int, message: str):
        super().__init__(message)
        self.exit_code = exit_code


def ops():
    """flashmoe_science.ops, imported late: importing it loads the extension (building it when
    stale), which must happen in build_checkout, where a failed build becomes exit 125."""
    from ... import ops

    return ops


def build_checkout(device: str) -> None:
    """Build (when stale) and load this checkout's extension, exactly as the operator loader does;
    failures become the exit codes `git bisect run` expects (125 skip, 255 abort)."""
    try:
        ops().load_library()  # a no-op when importing ops already loaded it
    except build.BuildError as exc:
        raise Abort(
            exc.exit_code, f"this checkout does not build (exit {exc.exit_code})\n{exc}"
        ) from exc
    except build.ConfigError as exc:
        raise Abort(exc.exit_code, f"cannot configure the build: {exc}") from exc
    if device == "cuda" and not torch._C._dispatch_has_kernel_for_dispatch_key(
        "flashmoe_science::fwd", "CUDA"
    ):
        reason = build.resolve_config("auto").reason
        raise Abort(
            exitcodes.ENV_BROKEN,
            f"a GPU is visible but the extension has no CUDA kernels ({reason}); "
            "fix the CUDA toolchain, then run `python -m flashmoe_science build`",
        )


def gradient_call(
    case: Case,
    x: Inputs,
    forward: Callable[..., torch.Tensor],
    grad: torch.Tensor | None = None,
    params: tuple[torch.Tensor, ...] = (),
) -> Callable[[], object]:
    """What a backward or train case times, given the forward (q, k, v) -> out. backward: the
    gradients of q, k and v alone; the forward runs once, on the first call, which measure() makes
    untimed and inside the backend's context (SDPA picks its backward kernel in the forward), and
    its saved tensors are then outside what peak memory counts. train: forward and backward.
    `grad` is the output's gradient (default: cases.make_output_grad's, [B, H, S, D]); `params`
    are further leaves the forward reads whose gradients count too (learnable sinks)."""
    device = x.q.device.type
    q, k, v = (t.detach().requires_grad_() for t in (x.q, x.k, x.v))
    leaves = (q, k, v, *params)
    grad = make_output_grad(case, device) if grad is None else grad
    if case.kind == "train":
        return lambda: torch.autograd.grad(forward(q, k, v), leaves, grad)
    saved: list[torch.Tensor] = []

    def backward():
        if not saved:
            saved.append(forward(q, k, v))
        return torch.autograd.grad(saved[0], leaves, grad, retain_graph=True)

    return backward


def case_sinks(case: Case, device: str) -> torch.Tensor | None:
    """The case's sink logits (cases.make_sinks), a leaf that takes gradients in the backward
    kinds, as a model's learnable sinks do; None without sinks."""
    sinks = make_sinks(case, device)
    if sinks is not None and case.kind in ("backward", "train"):
        sinks.requires_grad_()
    return sinks


def feature_options(case: Case, sinks: torch.Tensor | None) -> dict:
    """The window_size, softcap and sinks arguments of the case ({} for none of them)."""
    options = {"window_size": case.window} if case.window != (-1, -1) else {}
    options |= {"softcap": case.softcap} if case.softcap else {}
    options |= {"sinks": sinks} if sinks is not None else {}
    return options


def our_call(case: Case, x: Inputs) -> Callable[[], object]:
    """Our operator on the case's inputs, with only the options the case sets."""
    api = ops()
    sinks = case_sinks(case, x.q.device.type)
    features = feature_options(case, sinks)
    if case.kind in ("backward", "train"):
        options = {"backward_config": case.config} if case.config else {}
        options |= {"deterministic": True} if case.deterministic else {}
        options |= features
        return gradient_call(
            case,
            x,
            lambda q, k, v: api.flash_attention_forward(q, k, v, causal=case.causal, **options),
            params=(sinks,) if sinks is not None else (),
        )
    if case.kind == "decode":
        options = {"num_splits": case.num_splits} if case.num_splits else {}
        return lambda: api.flash_attention_decode(
            x.q, x.k, x.v, x.cache_seqlens, causal=case.causal, **options, **features
        )
    options = {"num_splits": case.num_splits} if case.num_splits else {}
    options |= {"config": case.config} if case.config else {}
    return lambda: api.flash_attention_forward(
        x.q, x.k, x.v, causal=case.causal, **options, **features
    )


def has_features(case: Case) -> bool:
    return case.window != (-1, -1) or bool(case.softcap) or case.sinks


def features_text(case: Case) -> str:
    """The case's features as the API names them, e.g. "window_size=(4095, 0) and softcap=50"."""
    parts = [f"window_size={case.window}"] if case.window != (-1, -1) else []
    parts += [f"softcap={case.softcap:g}"] if case.softcap else []
    parts += ["sinks"] if case.sinks else []
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"


_sdpa_has_enable_gqa: bool | None = None


def sdpa_supports_gqa() -> bool:
    """enable_gqa came with torch 2.5; older versions get K and V repeated outside the timing."""
    global _sdpa_has_enable_gqa
    if _sdpa_has_enable_gqa is None:
        tiny = torch.zeros(1, 2, 1, 8)
        try:
            F.scaled_dot_product_attention(tiny, tiny[:, :1], tiny[:, :1], enable_gqa=True)
            _sdpa_has_enable_gqa = True
        except TypeError:
            _sdpa_has_enable_gqa = False
    return _sdpa_has_enable_gqa


def sdpa_call(case: Case, x: Inputs) -> tuple[Callable[[], torch.Tensor] | None, str | None]:
    """(callable, None), or (None, why SDPA cannot express this case)."""
    if has_features(case):
        return None, (
            f"SDPA has no {features_text(case)}: FlexAttention (the flex column) is this case's "
            "baseline"
        )
    if case.cache_seqlens is not None:
        return None, "SDPA has no per-sequence cache lengths (cache_seqlens)"
    if case.causal and case.seqlen_q == case.seqlen_k:
        is_causal = True
    elif not case.causal or case.seqlen_q == 1:
        is_causal = False  # one query at the end of the cache sees every key: no mask
    else:
        return (
            None,
            "SDPA's is_causal is aligned top-left, ours bottom-right: they differ when Sq != Sk",
        )
    k, v, kwargs = x.k, x.v, {}
    if case.heads_q != case.heads_kv:
        if sdpa_supports_gqa():
            kwargs["enable_gqa"] = True
        else:
            group = case.heads_q // case.heads_kv
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if case.kind in ("backward", "train"):
        if not sdpa_supports_gqa() and case.heads_q != case.heads_kv:
            return None, "this torch's SDPA has no enable_gqa: its GQA backward is not comparable"

        def forward(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, **kwargs)

        return gradient_call(case, x, forward), None
    return lambda: F.scaled_dot_product_attention(x.q, k, v, is_causal=is_causal, **kwargs), None


def backend_context(backend):
    return contextlib.nullcontext() if backend is None else sdpa_kernel(backend)


def first_call(fn: Callable[[], object]) -> str | None:
    """Run fn once; None if it worked, else why not (SDPA explains refusals in warnings)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = fn()
            del out
            return None
        except Exception as exc:  # a refusal (RuntimeError) or an argument our op rejects
            reasons = [str(w.message).strip() for w in caught]
            reasons.append(first_line(exc))
            return "; ".join(dict.fromkeys(r for r in reasons if r))[:600]


def is_refusal(reason: str) -> bool:
    return "No available kernel" in reason or "No viable backend" in reason
