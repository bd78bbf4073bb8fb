"""Calling an operator of the extension: below the Autograd key when no input needs a gradient,
with the C++ checks' input errors re-raised as their Python types. ops and autograd both call
operators this way."""

from __future__ import annotations

import torch

_ERROR_TYPES = {"TypeError: ": TypeError, "ValueError: ": ValueError}


def _needs_autograd(args) -> bool:
    if torch.compiler.is_compiling():
        return True  # Dynamo traces the registered autograd kernel itself
    if not torch.is_grad_enabled():
        return False
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


def call(op, *args):
    """Call an operator, re-raising its input errors with their Python type.

    When no input needs a gradient the call goes straight below the Autograd key, as the autograd
    kernel torch.library registers (autograd.py) would send it, minus that kernel's Python, whose
    host time was a large part of a decode step's (benches/notes/varlen-paged.md, v2.8).

    The C++ checks throw c10::Error with the type as a message prefix (see FLASHMOE_CHECK_VALUE in
    csrc/attention_ops.h for why), and this is where the prefix becomes the exception's type."""
    try:
        if _needs_autograd(args):
            return op(*args)
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args)
    except RuntimeError as exc:
        message = str(exc).strip()
        for prefix, error_type in _ERROR_TYPES.items():
            if message.startswith(prefix):
                line = message[len(prefix) :].splitlines()[0]
                raise error_type(line + _layout_hint(op, line, args)) from None
        raise


# The dense operators, whose q, k and v are all [B, H, S, D]
_DENSE_OPS = ("flashmoe_science::attention", "flashmoe_science::fwd")


def _layout_hint(op, message: str, args) -> str:
    """For the heads check of a dense operator: when dimension 2 of q and k would make valid
    heads, the tensors are likely [B, S, H, D], and the hint says how to pass them."""
    q, k = args[0], args[1]
    if (
        not message.startswith("heads of q")
        or getattr(op, "_qualified_op_name", None) not in _DENSE_OPS
        or q.dim() != 4
        or k.dim() != 4
        or k.size(2) == 0
        or q.size(2) % k.size(2)
    ):
        return ""
    return (
        f"; q {list(q.shape)} and k {list(k.shape)} look like [B, S, H, D]: pass q.transpose(1, 2), "
        "k.transpose(1, 2) and v.transpose(1, 2) (the views are used in place, no copy)"
    )
