"""One attention case, as the gates, the benchmark, the sanitizer and the profiler all name it.

A case id reads left to right as the call it stands for:

    fwd-bf16-d128-h16-b4-s4096-causal        prefill, Hq = Hkv = 16, Sq = Sk = 4096, causal
    fwd-fp16-d64-h8kv2-b2-q113-k203-full     GQA 8:2, Sq != Sk, no mask
    fwd-bf16-d192v128-h16-b1-s4096-causal    q and k of head dim 192, v (and the output) 128
    dec-bf16-d128-h32kv8-b4-q1-k8192         decode (always causal unless it ends in -full)
    bwd-bf16-d128-h16-b4-s4096-causal        the backward of that prefill alone (gradients of q,
                                             k and v from the saved forward)
    fwdbwd-bf16-d128-h16-b4-s4096-causal     forward and backward, as a training step runs them

then, only where they differ from the default, the gates' extra fields: `-bshd` (q, k, v are
[B, H, S, D] views of [B, S, H, D] tensors), `-cfg2` (a forced tile configuration: ops.CONFIGS for
prefill and decode, ops.BACKWARD_CONFIGS for the backward kinds), `-splits3` (a forced split
count), `-lens5_0_257` (per-sequence cache lengths), `-rising` or `-falling` (scores whose spread
grows sixteenfold along the keys, or shrinks: see SCORES), `-det` (deterministic=True), and the
features of local attention: `-win16_0` (window_size=(16, 0); `inf` for -1), `-cap30` (softcap=30)
and `-sinks` (learnable sink logits, drawn with the inputs: make_sinks).
`parse_case_id` reads every id `Case.id` writes, including those stored by earlier benchmark runs.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import zlib
from typing import NamedTuple

import torch

from .masks import visible_pairs

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
ELEMENT_BYTES = 2
KINDS = ("prefill", "decode", "backward", "train")
LAYOUTS = ("bhsd", "bshd")
# How the scores q.k spread along the keys. "normal": k is N(0, 1) throughout, so the row max of a
# softmax is nearly settled after the first key block a kernel visits. "rising" / "falling": key j
# is scaled by 1 + 15 * j / (Sk - 1) (or the mirror image), so the max keeps growing, by large
# factors, block after block for a kernel that walks the keys forwards (rising) or backwards
# (falling): the online softmax's rescaling of the output and the sum is then exercised, which
# normal inputs leave untested.
SCORES = ("normal", "rising", "falling")
SCORE_RAMP = 15.0
# "features": the benchmark's sliding-window, softcap and sinks cases and their plain twins, kept
# out of the matrix's own targets (their twins' ratios judge them: pipeline.bench.targets). A worker
# of an older version refuses the group instead of timing such a case without its features.
GROUPS = ("prefill", "decode", "small", "backward", "train", "features")
# The id prefix of each kind; backward and train cases are prefill shapes (a mask suffix).
PREFIXES = {"prefill": "fwd", "decode": "dec", "backward": "bwd", "train": "fwdbwd"}
# FLOPs of a kind over the forward's: the backward's five matmuls against the forward's two
# (FlashAttention-2 paper, section 4.1), plus the forward for a training step.
FLOP_FACTORS = {"prefill": 1.0, "decode": 1.0, "backward": 2.5, "train": 3.5}
SEED_VAR = "FLASHMOE_SEED"
# Inputs up to this size are drawn on the CPU, so a case has the same numbers on every device (a
# CUDA failure reproduces on its CPU twin); larger ones (benchmark caches of GBs) are drawn on the
# device, where drawing 1 GB takes milliseconds instead of seconds.
DRAW_ON_CPU_MAX_BYTES = 64 * 2**20

_ID_RE = re.compile(
    r"^(?P<kind>fwdbwd|fwd|dec|bwd)-(?P<dtype>[a-z0-9]+)-d(?P<d>\d+)(?:v(?P<dv>\d+))?"
    r"-h(?P<hq>\d+)(?:kv(?P<hkv>\d+))?"
    r"-b(?P<b>\d+)-(?:s(?P<s>\d+)|q(?P<sq>\d+)-k(?P<sk>\d+))(?:-(?P<mask>causal|full))?"
    r"(?:-(?P<layout>bshd))?(?:-cfg(?P<cfg>\d+))?(?:-splits(?P<splits>\d+))?"
    r"(?:-lens(?P<lens>\d+(?:_\d+)*))?(?:-(?P<scores>rising|falling))?(?P<det>-det)?"
    r"(?:-win(?P<wl>\d+|inf)_(?P<wr>\d+|inf))?(?:-cap(?P<cap>\d+(?:\.\d+)?))?(?P<sinks>-sinks)?$"
)
ID_EXAMPLES = "fwd-bf16-d128-h16-b4-s4096-causal or dec-bf16-d128-h32kv8-b4-q1-k8192"


@dataclasses.dataclass(frozen=True)
class Case:
    """One attention shape and how it is called: prefill runs flash_attention_forward, decode
    flash_attention_decode, backward the gradients of a prefill (autograd through
    flash_attention_forward), train forward and backward together. The field names are also the benchmark worker protocol's (a head sends
    `to_dict()`; workers of any version keep the fields they know)."""

    kind: str  # one of KINDS
    dtype: str  # a key of DTYPES
    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool
    group: str = ""  # the benchmark's "prefill", "decode" or "small"; default: the kind
    layout: str = "bhsd"
    config: int = 0  # forced tile configuration (0: automatic)
    num_splits: int = 0  # forced split-KV count (0: automatic)
    cache_seqlens: tuple[int, ...] | None = None  # decode: valid cache length per sequence
    deterministic: bool = False  # backward kinds: deterministic=True (bit-identical gradients)
    scores: str = "normal"  # one of SCORES: how make_inputs spreads the scores along the keys
    head_dim_v: int = 0  # v's and the output's head dim where it differs from head_dim (q's, k's)
    # window_size=(left, right) ((-1, -1): none; a causal case's right side is 0), softcap (0: off)
    # and learnable sinks (their values: make_sinks), as the API takes them
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    sinks: bool = False

    def __post_init__(self):
        for name, allowed in (
            ("kind", KINDS),
            ("dtype", tuple(DTYPES)),
            ("layout", LAYOUTS),
            ("scores", SCORES),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"Case {name}={getattr(self, name)!r} is not supported: use one of {allowed}"
                )
        if self.head_dim_v == self.head_dim:
            object.__setattr__(self, "head_dim_v", 0)  # one case, one id
        if not self.group:
            object.__setattr__(self, "group", self.kind)
        if self.group not in GROUPS:
            raise ValueError(f"Case group={self.group!r} is not supported: use one of {GROUPS}")
        if self.cache_seqlens is not None:
            lengths = tuple(int(n) for n in self.cache_seqlens)
            if len(lengths) != self.batch:
                raise ValueError(
                    f"Case cache_seqlens has {len(lengths)} lengths for batch {self.batch}: "
                    "give one length per sequence"
                )
            object.__setattr__(self, "cache_seqlens", lengths)
        object.__setattr__(self, "window", normal_window(self.window, self.causal))
        if not (isinstance(self.softcap, int | float) and 0 <= self.softcap < float("inf")):
            raise ValueError(f"Case softcap={self.softcap!r} is not supported: use 0 (off) or > 0")

    @property
    def id(self) -> str:
        heads = f"h{self.heads_q}" + (f"kv{self.heads_kv}" if self.heads_kv != self.heads_q else "")
        dims = f"d{self.head_dim}" + (f"v{self.head_dim_v}" if self.head_dim_v else "")
        parts = [PREFIXES[self.kind], self.dtype, dims, heads, f"b{self.batch}"]
        if self.kind != "decode" and self.seqlen_q == self.seqlen_k:
            parts.append(f"s{self.seqlen_q}")
        else:
            parts.append(f"q{self.seqlen_q}-k{self.seqlen_k}")
        if self.kind != "decode":
            parts.append("causal" if self.causal else "full")
        elif not self.causal:  # decode is causal unless the id says otherwise
            parts.append("full")
        if self.layout != "bhsd":
            parts.append(self.layout)
        if self.config:
            parts.append(f"cfg{self.config}")
        if self.num_splits:
            parts.append(f"splits{self.num_splits}")
        if self.cache_seqlens is not None:
            parts.append("lens" + "_".join(map(str, self.cache_seqlens)))
        if self.scores != "normal":
            parts.append(self.scores)
        if self.deterministic:
            parts.append("det")
        return "-".join(parts) + feature_suffix(self.window, self.softcap, self.sinks)

    def describe(self) -> str:
        return (
            f"{self.kind} B={self.batch} Hq={self.heads_q} Hkv={self.heads_kv} Sq={self.seqlen_q} "
            f"Sk={self.seqlen_k} D={self.head_dim}"
            + (f" Dv={self.head_dim_v}" if self.head_dim_v else "")
            + f" dtype={self.dtype} causal={self.causal} "
            f"layout={self.layout} config={self.config} num_splits={self.num_splits or 'auto'}"
            + (f" cache_seqlens={list(self.cache_seqlens)}" if self.cache_seqlens else "")
            + (" deterministic=True" if self.deterministic else "")
            + (f" scores={self.scores}" if self.scores != "normal" else "")
            + describe_features(self.window, self.softcap, self.sinks)
        )

    def seed(self) -> int:
        """The case's own seed (FLASHMOE_SEED shifts every case's), so each draws fresh inputs."""
        base = int(os.environ.get(SEED_VAR, "0"))
        return (zlib.crc32(self.id.encode()) + base) % (2**31)

    def rerun_command(self, device: str) -> str:
        """The command that runs this gate case alone. CUDA cases require the GPU, so on a machine
        without one the command exits 255 instead of skipping the case and passing."""
        select = f"nox -s test -- -k '{self.id}-{device}'"
        return f"FLASHMOE_REQUIRE_GPU=1 {select}" if device == "cuda" else select

    @property
    def value_head_dim(self) -> int:
        """v's and the output's head dim (Dv): head_dim_v where set, else head_dim."""
        return self.head_dim_v or self.head_dim

    @property
    def flops(self) -> int:
        """2*B*H*Sq*Sk*(D + Dv), i.e. 4*B*H*Sq*Sk*D (FA2 paper accounting) when Dv = D, halved
        for causal only when Sq == Sk; with a window, Sq*Sk is the pairs a query sees
        (visible_pairs). The backward counts 2.5 times that and a training step (forward and
        backward) 3.5 times."""
        if self.window != (-1, -1):
            pairs = visible_pairs(self.seqlen_q, self.seqlen_k, self.causal, self.window)
            flops = 2 * self.batch * self.heads_q * pairs * (self.head_dim + self.value_head_dim)
            return int(flops * FLOP_FACTORS[self.kind])
        rows_keys = self.batch * self.heads_q * self.seqlen_q * self.seqlen_k
        flops = 2 * rows_keys * (self.head_dim + self.value_head_dim)
        flops = flops // 2 if self.causal and self.seqlen_q == self.seqlen_k else flops
        return int(flops * FLOP_FACTORS[self.kind])

    @property
    def kv_bytes(self) -> int:
        dims = self.head_dim + self.value_head_dim
        return self.batch * self.heads_kv * self.seqlen_k * dims * ELEMENT_BYTES

    @property
    def bytes_moved(self) -> int:
        """Bytes that must cross HBM at least once: K and V, plus q read and out written."""
        dims = self.head_dim + self.value_head_dim
        q_and_out = self.batch * self.heads_q * self.seqlen_q * dims * ELEMENT_BYTES
        return self.kv_bytes + q_and_out

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        if self.cache_seqlens is not None:
            data["cache_seqlens"] = list(self.cache_seqlens)
        if not self.head_dim_v:  # where v's head dim is q's, the dict is what it always was
            del data["head_dim_v"]
        # likewise without a window, softcap or sinks
        for name, default in (("window", (-1, -1)), ("softcap", 0.0), ("sinks", False)):
            if data[name] == default:
                del data[name]
            elif name == "window":
                data[name] = list(self.window)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> Case:
        """A case from `to_dict()` output of this or an older version (unknown keys are ignored)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in fields})


def parse_case_arg(command: str, case_id: str) -> Case | None:
    """parse_case_id for a command's CASE argument: None after one line `command: why`."""
    try:
        return parse_case_id(case_id)
    except ValueError as exc:
        print(f"{command}: {exc}", flush=True)
        return None


def parse_case_id(case_id: str) -> Case:
    """The case an id names (the inverse of Case.id); ValueError says what is wrong with a bad one."""
    match = _ID_RE.match(case_id)
    if not match:
        raise ValueError(
            f"bad case id {case_id!r}: expected e.g. {ID_EXAMPLES}, optionally followed by "
            "-bshd, -cfgN, -splitsN, -lensA_B, -rising or -falling, -det, -winL_R, -capC, -sinks "
            "(`bench --list` prints the benchmark matrix)"
        )
    g = match.groupdict()
    kind = {prefix: kind for kind, prefix in PREFIXES.items()}[g["kind"]]
    if g["dtype"] not in DTYPES:
        raise ValueError(f"bad case id {case_id!r}: dtype {g['dtype']!r} is not one of {DTYPES}")
    if kind != "decode" and g["mask"] is None:
        raise ValueError(f"bad case id {case_id!r}: a {kind} id says -causal or -full")
    if kind == "decode" and g["mask"] == "causal":
        raise ValueError(f"bad case id {case_id!r}: decode is causal unless it says -full")
    heads_q = int(g["hq"])
    try:
        return Case(
            kind=kind,
            dtype=g["dtype"],
            batch=int(g["b"]),
            heads_q=heads_q,
            heads_kv=int(g["hkv"] or heads_q),
            seqlen_q=int(g["s"] or g["sq"]),
            seqlen_k=int(g["s"] or g["sk"]),
            head_dim=int(g["d"]),
            head_dim_v=int(g["dv"] or 0),
            causal=g["mask"] != "full",
            layout=g["layout"] or "bhsd",
            config=int(g["cfg"] or 0),
            num_splits=int(g["splits"] or 0),
            cache_seqlens=tuple(map(int, g["lens"].split("_"))) if g["lens"] else None,
            deterministic=bool(g["det"]),
            scores=g["scores"] or "normal",
            window=parse_window(g["wl"], g["wr"]),
            softcap=float(g["cap"] or 0),
            sinks=bool(g["sinks"]),
        )
    except ValueError as exc:
        raise ValueError(f"bad case id {case_id!r}: {exc}") from None


def normal_window(window, causal: bool) -> tuple[int, int]:
    """A case's window_size as one value per mask: (left, right) ints >= -1, the right side 0
    under causal (as the API reads it), and (-1, -1) for causal's own (-1, 0)."""
    if (
        not isinstance(window, tuple | list)
        or len(window) != 2
        or not all(isinstance(side, int) and not isinstance(side, bool) for side in window)
        or min(window) < -1
    ):
        raise ValueError(
            f"window={window!r} is not supported: use (left, right), each -1 (unbounded) or >= 0"
        )
    left, right = window
    if causal:
        right = 0
    return (-1, -1) if causal and left == -1 else (left, right)


def _side(value: int) -> str:
    return "inf" if value < 0 else str(value)


def feature_suffix(window: tuple[int, int], softcap: float, sinks: bool) -> str:
    """The id suffix of a window, softcap and sinks ("" for none): -win16_0, -cap30, -sinks."""
    parts = []
    if window != (-1, -1):
        parts.append(f"win{_side(window[0])}_{_side(window[1])}")
    if softcap:
        parts.append(f"cap{softcap:g}")
    if sinks:
        parts.append("sinks")
    return "".join(f"-{part}" for part in parts)


def parse_window(left: str | None, right: str | None) -> tuple[int, int]:
    if left is None:
        return (-1, -1)
    return tuple(-1 if side == "inf" else int(side) for side in (left, right))


def describe_features(window: tuple[int, int], softcap: float, sinks: bool) -> str:
    return (
        (f" window_size={tuple(window)}" if window != (-1, -1) else "")
        + (f" softcap={softcap:g}" if softcap else "")
        + (" sinks" if sinks else "")
    )


def draw_sinks(heads_q: int, keys: int, seed: int, device: str) -> torch.Tensor:
    """fp32 [heads_q] sink logits from `seed`, around log(keys): with `keys` the keys a row sees,
    the sink then takes a share of each row's softmax comparable to its keys'."""
    generator = torch.Generator().manual_seed(seed % (2**31))
    sinks = torch.randn(heads_q, generator=generator) * 1.5 + math.log(max(keys, 2))
    return sinks.to(device)


def make_sinks(case: Case, device: str) -> torch.Tensor | None:
    """A case's sink logits (None without sinks), from its seed (shifted, so the inputs are those
    of the same case without sinks)."""
    if not case.sinks:
        return None
    left = case.window[0]
    keys = case.seqlen_k if left < 0 else min(case.seqlen_k, left + 1)
    return draw_sinks(case.heads_q, keys, case.seed() + 2, device)


class Inputs(NamedTuple):
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cache_seqlens: torch.Tensor | None


def input_bytes(case: Case) -> int:
    """q, k and v (the output is not drawn)."""
    return case.kv_bytes + case.batch * case.heads_q * case.seqlen_q * case.head_dim * ELEMENT_BYTES


def make_inputs(case: Case, device: str, seed: int | None = None) -> Inputs:
    """Fresh random (never zero) q, k, v for `case` from its own seed, as [B, H, S, D] tensors (views
    of [B, S, H, D] ones for layout "bshd"; v's D is case.value_head_dim), and for decode its
    cache_seqlens (int32), if any."""
    seed = case.seed() if seed is None else seed
    dtype = DTYPES[case.dtype]
    on_cpu = input_bytes(case) <= DRAW_ON_CPU_MAX_BYTES
    generator = torch.Generator(device="cpu" if on_cpu else device).manual_seed(seed)

    def randn(heads: int, seqlen: int, head_dim: int = case.head_dim) -> torch.Tensor:
        if case.layout == "bshd":
            shape = (case.batch, seqlen, heads, head_dim)
        else:
            shape = (case.batch, heads, seqlen, head_dim)
        if on_cpu:
            t = torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
        else:
            t = torch.randn(shape, generator=generator, device=device, dtype=dtype)
        return t.transpose(1, 2) if case.layout == "bshd" else t

    q = randn(case.heads_q, case.seqlen_q)
    k = randn(case.heads_kv, case.seqlen_k)
    if case.scores != "normal":
        k = ramp_keys(k, case.scores)
    v = randn(case.heads_kv, case.seqlen_k, case.value_head_dim)
    lengths = None
    if case.cache_seqlens is not None:
        lengths = torch.tensor(case.cache_seqlens, dtype=torch.int32, device=device)
    return Inputs(q, k, v, lengths)


def ramp_keys(k: torch.Tensor, scores: str) -> torch.Tensor:
    """k ([B, H, S, D], any strides) with key j scaled as SCORES says; the strides are kept."""
    seqlen = k.shape[2]
    ramp = torch.linspace(0.0, 1.0, seqlen, device=k.device) if seqlen > 1 else k.new_zeros(1)
    ramp = 1.0 + SCORE_RAMP * (ramp if scores == "rising" else 1.0 - ramp)
    ramped = torch.empty_strided(k.shape, k.stride(), dtype=k.dtype, device=k.device)
    return ramped.copy_(k.float() * ramp.view(1, 1, -1, 1))


def make_output_grad(case: Case, device: str) -> torch.Tensor:
    """The gradient of the output that a backward case feeds back: random (never zero), [B, Hq, Sq,
    Dv] contiguous, from a seed of its own (the case's, shifted), drawn where make_inputs draws."""
    dtype = DTYPES[case.dtype]
    shape = (case.batch, case.heads_q, case.seqlen_q, case.value_head_dim)
    on_cpu = input_bytes(case) <= DRAW_ON_CPU_MAX_BYTES
    generator = torch.Generator(device="cpu" if on_cpu else device)
    generator.manual_seed((case.seed() + 1) % (2**31))
    if on_cpu:
        return torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
    return torch.randn(shape, generator=generator, device=device, dtype=dtype)
