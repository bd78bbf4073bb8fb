"""FlashAttention-3 and FlashAttention-4 as optional baselines ("peers") of the prefill and
backward cases: timed in the same interleaved rounds as ours and SDPA's backends when they can be
imported and the card is one they run on; otherwise each case records why not, its reason
starting with records.NOT_INSTALLED when the import fails. Never a hard dependency, never a crash.

    fa3  flash_attn_interface.flash_attn_func: FlashAttention-3, built from the hopper/ folder of
         Dao-AILab/flash-attention (no wheel on the package index); sm_90 only
    fa4  flash_attn.cute.flash_attn_func: FlashAttention-4 in the CuTe DSL, the `flash-attn-4`
         package; sm_90 and newer

Both take q, k, v as [B, S, H, D] (GQA by fewer K/V heads) and align causal masks bottom-right as
ours do; they return the output, or (output, lse). The cases' [B, H, S, D] inputs are copied to
that layout once, outside the timing, as their users hold them.

`python -m flashmoe_science.pipeline.bench.peers` prints one `STATUS|NAME|DETAIL` line per peer (ok
or WARN): what scripts/act/gpu-job.sh --check shows before a run.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Callable

import torch

from ..cases import Case, Inputs, make_output_grad
from .baselines import gradient_call
from .records import NOT_INSTALLED, PEER_LABELS
from .timing import first_line

# The kinds a peer is timed on: the forward, and the backward alone or with the forward
KINDS = ("prefill", "backward", "train")
# Said in their columns of a case with a window, softcap or sinks (FlexAttention is its baseline)
FEATURES_REASON = (
    "not timed: the window, softcap and sinks are not passed to FlashAttention-3/-4 here; "
    "FlexAttention (the flex column) is this case's baseline"
)


@dataclasses.dataclass(frozen=True)
class Peer:
    name: str  # the column in bench.json's baselines
    module: str
    function: str
    install: str  # how to get it, for the not-installed reason
    min_capability: tuple[int, int]
    max_major: int | None = None  # the newest architecture it runs on (None: any newer)

    @property
    def label(self) -> str:
        return PEER_LABELS[self.name]

    @property
    def needs(self) -> str:
        sm = f"sm_{self.min_capability[0]}{self.min_capability[1]}"
        return sm if self.max_major == self.min_capability[0] else f"{sm} or newer"


PEERS = {
    peer.name: peer
    for peer in (
        Peer(
            "fa3",
            "flash_attn_interface",
            "flash_attn_func",
            "build hopper/ of Dao-AILab/flash-attention (python setup.py bdist_wheel)",
            (9, 0),
            max_major=9,
        ),
        Peer("fa4", "flash_attn.cute", "flash_attn_func", "pip install flash-attn-4", (9, 0)),
    )
}


def load(peer: Peer) -> tuple[Callable | None, str | None]:
    """(its flash_attn_func, None), or (None, why not): NOT_INSTALLED and the import's own error.
    Any exception counts: a wheel built for another torch fails with an OSError or a
    RuntimeError, not an ImportError."""
    try:
        module = importlib.import_module(peer.module)
    except Exception as exc:
        return None, f"{NOT_INSTALLED}: {first_line(exc)} ({peer.install})"
    fn = getattr(module, peer.function, None)
    if not callable(fn):
        return None, (
            f"{NOT_INSTALLED}: {peer.module} has no {peer.function} (another package of that "
            f"name?); {peer.install}"
        )
    return fn, None


def capability(device: str) -> tuple[int, int] | None:
    """The card's compute capability; None on the CPU backend."""
    return torch.cuda.get_device_capability() if device == "cuda" else None


def device_problem(peer: Peer, device: str) -> str | None:
    """Why the peer cannot run on this device; None when it can."""
    found = capability(device)
    if found is None:
        return f"{peer.label} needs a CUDA GPU of {peer.needs}; this run is on the CPU"
    too_new = peer.max_major is not None and found[0] > peer.max_major
    if tuple(found) < peer.min_capability or too_new:
        return f"{peer.label} needs {peer.needs}; this card is sm_{found[0]}{found[1]}"
    return None


def availability(device: str) -> dict[str, tuple[Callable | None, str | None]]:
    """Each peer's (function, None) or (None, why not) on this device, asked once per case."""
    found = {}
    for name, peer in PEERS.items():
        fn, problem = load(peer)
        if fn is not None:
            problem = device_problem(peer, device)
        found[name] = (None, problem) if problem else (fn, None)
    return found


def peer_call(fn: Callable, case: Case, x: Inputs) -> Callable[[], object]:
    """What a case times through a peer's flash_attn_func: the forward, or (backward kinds) the
    gradients as baselines.gradient_call times them, on copies of x in the [B, S, H, D] layout."""
    q, k, v = (t.transpose(1, 2).contiguous() for t in (x.q, x.k, x.v))

    def forward(q, k, v):
        out = fn(q, k, v, causal=case.causal)
        return out[0] if isinstance(out, tuple) else out

    if case.kind in ("backward", "train"):
        grad = make_output_grad(case, x.q.device.type).transpose(1, 2).contiguous()
        return gradient_call(case, Inputs(q, k, v, None), forward, grad)
    return lambda: forward(q, k, v)


def status_lines(device: str) -> list[str]:
    """One `ok|NAME|DETAIL` or `WARN|NAME|why not` line per peer, for a machine check."""
    lines = []
    for name, (fn, problem) in availability(device).items():
        peer = PEERS[name]
        if problem:
            lines.append(f"WARN|{name}|{problem}; its bench column says so")
        else:
            lines.append(f"ok|{name}|{peer.label}: {peer.module}.{peer.function} ({fn.__module__})")
    return lines


if __name__ == "__main__":
    print("\n".join(status_lines("cuda" if torch.cuda.is_available() else "cpu")))
    sys.exit(0)
