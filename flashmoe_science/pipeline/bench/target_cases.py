"""The benchmark's speed-target cases: calls judged against a target ratio rather than against SDPA
alone (flashmoe_science.pipeline.bench.targets holds the targets). Their ids are selected with `--case`
like the matrix's:

    varlen-bf16-d128-h16-t16384-len128_4096-causal   a packed batch of 16384 tokens, lengths drawn
                                                    (seeded) from 128 to 4096, against our dense
                                                    kernel run once per distinct length
    paged-bf16-d128-h32kv8-b4-k8192-page64          decode against a paged cache (block size 64,
                                                    a shuffled block table) and against the same
                                                    contents contiguous
    host-bf16-d128-h32kv8-b1-k1024-decode-lens      the per-call cost of 2,000 back-to-back calls
                                                    (decode, decode-lens, paged64 or varlen)
    model-llama-bf16-b8-s512-new32                  the small Llama-style model: prefill and
                                                    greedy decoding, our attention against SDPA
    step-llama-bf16-l4-d128-h8kv2-b8-s2048          a training step (forward, backward, AdamW)
                                                    of a 4-layer Llama-style model, our attention
                                                    against SDPA from the same initialisation
    loss-gemma2-fp32-l4-d32-h4kv2-b8-s128-win32-cap0.5-n60
                                                    a Gemma-2-style model (sliding and global
                                                    layers, a softcap) trained 60 steps with our
                                                    attention and with eager, from one
                                                    initialisation on the same batches
"""

from __future__ import annotations

import dataclasses
import random

from ..cases import ELEMENT_BYTES, FLOP_FACTORS, Case, feature_suffix, normal_window
from ..masks import visible_pairs
from .smallmodel import swiglu_width

HOST_CALLS = ("decode", "decode-lens", "paged64", "varlen")
# The packed batch of the varlen host-cost case: small, so the loop measures the host, not the GPU.
HOST_VARLEN_LENGTHS = (17, 64, 33, 50)


def mixed_lengths(total: int, shortest: int, longest: int) -> tuple[int, ...]:
    """Sequence lengths in [shortest, longest] adding up to `total`, drawn from a fixed seed (the
    same mix for every dtype, head dim and mask, so their cases compare)."""
    if not shortest <= longest or total < shortest:
        raise ValueError(
            f"no mix of lengths {shortest} to {longest} adds up to {total} tokens: "
            "give shortest <= longest <= total"
        )
    rng = random.Random(total * 1_000_003 + shortest * 1_009 + longest)
    lengths, remaining = [], total
    while remaining > longest:  # each draw leaves at least `shortest` for the last sequence
        n = rng.randint(shortest, min(longest, remaining - shortest))
        lengths.append(n)
        remaining -= n
    lengths.append(remaining)
    return tuple(lengths)


def _heads(heads_q: int, heads_kv: int) -> str:
    return f"h{heads_q}" + (f"kv{heads_kv}" if heads_kv != heads_q else "")


@dataclasses.dataclass(frozen=True)
class VarlenTarget:
    """flash_attention_varlen_forward on a packed batch against flash_attention_forward on the same
    sequences, one dense call per distinct length; both with `window` (window_size) where given,
    so that the packed features kernels are timed against the dense ones."""

    dtype: str
    head_dim: int
    heads_q: int
    heads_kv: int
    total: int  # tokens in the packed batch (Sq == Sk per sequence)
    shortest: int
    longest: int
    causal: bool
    kind: str = "varlen"
    window: tuple[int, int] = (-1, -1)

    def __post_init__(self):
        object.__setattr__(self, "window", normal_window(self.window, self.causal))

    @property
    def id(self) -> str:
        mask = "causal" if self.causal else "full"
        return (
            f"varlen-{self.dtype}-d{self.head_dim}-{_heads(self.heads_q, self.heads_kv)}"
            f"-t{self.total}-len{self.shortest}_{self.longest}-{mask}"
            + feature_suffix(self.window, 0.0, False)
        )

    @property
    def lengths(self) -> tuple[int, ...]:
        return mixed_lengths(self.total, self.shortest, self.longest)

    @property
    def flops(self) -> int:
        """The dense cases' accounting summed over the sequences (halved for causal, Sq == Sk;
        with a window, the (query, key) pairs it lets through)."""
        if self.window != (-1, -1):
            pairs = sum(visible_pairs(n, n, self.causal, self.window) for n in self.lengths)
            return 4 * self.heads_q * pairs * self.head_dim
        per = [4 * self.heads_q * n * n * self.head_dim for n in self.lengths]
        return sum(f // 2 if self.causal else f for f in per)

    @property
    def bytes_moved(self) -> int:
        return 2 * self.total * (self.heads_q + self.heads_kv) * self.head_dim * ELEMENT_BYTES


@dataclasses.dataclass(frozen=True)
class PagedTarget:
    """Decode against a paged cache of `block_size` (a shuffled block table) and against the same
    contents contiguous (the decode case `contiguous`), with the read floor of those contents."""

    dtype: str
    head_dim: int
    heads_q: int
    heads_kv: int
    batch: int
    seqlen_k: int
    block_size: int
    kind: str = "paged"

    def __post_init__(self):
        if self.seqlen_k % self.block_size:
            raise ValueError(
                f"PagedTarget seqlen_k={self.seqlen_k} is not a multiple of block_size="
                f"{self.block_size}: the paged and contiguous caches must hold the same keys"
            )

    @property
    def id(self) -> str:
        return (
            f"paged-{self.dtype}-d{self.head_dim}-{_heads(self.heads_q, self.heads_kv)}"
            f"-b{self.batch}-k{self.seqlen_k}-page{self.block_size}"
        )

    @property
    def contiguous(self) -> Case:
        return Case(
            "decode",
            self.dtype,
            self.batch,
            self.heads_q,
            self.heads_kv,
            1,
            self.seqlen_k,
            self.head_dim,
            True,
        )

    @property
    def flops(self) -> int:
        return self.contiguous.flops

    @property
    def bytes_moved(self) -> int:
        return self.contiguous.bytes_moved

    @property
    def kv_bytes(self) -> int:
        return self.contiguous.kv_bytes


@dataclasses.dataclass(frozen=True)
class HostTarget:
    """The per-call cost of `calls` back-to-back calls without a synchronisation in the loop, ours
    beside SDPA's equivalent call. call: decode (no cache_seqlens), decode-lens (with them), paged64
    (a block table of block size 64, and cache_seqlens as a server passes them), varlen (a small
    packed batch, HOST_VARLEN_LENGTHS)."""

    call: str
    dtype: str = "bf16"
    head_dim: int = 128
    heads_q: int = 32
    heads_kv: int = 8
    batch: int = 1
    seqlen_k: int = 1024
    calls: int = 2000
    kind: str = "host"

    def __post_init__(self):
        if self.call not in HOST_CALLS:
            raise ValueError(f"HostTarget call={self.call!r} is not one of {HOST_CALLS}")

    @property
    def id(self) -> str:
        return (
            f"host-{self.dtype}-d{self.head_dim}-{_heads(self.heads_q, self.heads_kv)}"
            f"-b{self.batch}-k{self.seqlen_k}-{self.call}"
        )


@dataclasses.dataclass(frozen=True)
class ModelTarget:
    """The small Llama-style model (pipeline.bench.smallmodel): prefill of `batch` x `prompt` tokens, and
    greedy generation of `new_tokens` with the KV cache; our attention against SDPA."""

    dtype: str = "bf16"
    batch: int = 8
    prompt: int = 512
    new_tokens: int = 32
    kind: str = "model"

    @property
    def id(self) -> str:
        return f"model-llama-{self.dtype}-b{self.batch}-s{self.prompt}-new{self.new_tokens}"


STEP_VOCAB = 4096  # smallmodel.training_config's default vocabulary


@dataclasses.dataclass(frozen=True)
class StepTarget:
    """A training step of a `layers`-layer Llama-style model (smallmodel.training_config: hidden
    size heads_q * head_dim) on `batch` x `seqlen` random tokens: forward, backward (a causal-LM
    loss) and an AdamW step, through our transformers backend against the same model on SDPA,
    both from the same initialisation."""

    head_dim: int
    heads_q: int
    heads_kv: int
    batch: int
    seqlen: int
    layers: int = 4
    dtype: str = "bf16"
    vocab: int = STEP_VOCAB
    kind: str = "step"

    @property
    def id(self) -> str:
        vocab = f"-v{self.vocab}" if self.vocab != STEP_VOCAB else ""
        return (
            f"step-llama-{self.dtype}-l{self.layers}-d{self.head_dim}"
            f"-{_heads(self.heads_q, self.heads_kv)}-b{self.batch}-s{self.seqlen}{vocab}"
        )

    @property
    def tokens(self) -> int:
        return self.batch * self.seqlen

    @property
    def matmul_params(self) -> int:
        """The weights every token multiplies: the layers' projections and the output head (the
        embedding is a lookup)."""
        hidden = self.heads_q * self.head_dim
        kv = self.heads_kv * self.head_dim
        layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * swiglu_width(hidden)
        return self.layers * layer + self.vocab * hidden

    @property
    def flops(self) -> int:
        """6 per weight and token (forward and backward), plus each layer's causal attention as
        the matrix counts a training step's (cases.FLOP_FACTORS["train"] times its forward)."""
        attention = 4 * self.batch * self.heads_q * self.seqlen**2 * self.head_dim // 2
        per_layer = int(attention * FLOP_FACTORS["train"])
        return 6 * self.matmul_params * self.tokens + self.layers * per_layer

    @property
    def bytes_moved(self) -> int:
        return 0  # no bandwidth figure: a step is many kernels


@dataclasses.dataclass(frozen=True)
class LossTarget:
    """A Gemma-2-style model (smallmodel.gemma2_config: layers alternating sliding_window `window`
    and global, attn_logit_softcapping `softcap`, hidden size heads_q * head_dim) trained `steps`
    AdamW steps from one initialisation on the same batches (smallmodel.markov_batches: tokens of a
    fixed random Markov chain, so the loss falls smoothly), with our attention and with
    transformers' eager attention; the final losses are compared. The softcap is set low enough to
    bite: a run without it parts from eager's by more than the target allows."""

    layers: int = 4
    heads_q: int = 4
    heads_kv: int = 2
    head_dim: int = 32
    batch: int = 8
    seqlen: int = 128
    window: int = 32
    softcap: float = 0.5
    steps: int = 60
    dtype: str = "fp32"
    vocab: int = 256
    kind: str = "loss"

    @property
    def id(self) -> str:
        vocab = f"-v{self.vocab}" if self.vocab != 256 else ""
        return (
            f"loss-gemma2-{self.dtype}-l{self.layers}-d{self.head_dim}"
            f"-{_heads(self.heads_q, self.heads_kv)}-b{self.batch}-s{self.seqlen}"
            f"-win{self.window}-cap{self.softcap:g}-n{self.steps}{vocab}"
        )


Target = VarlenTarget | PagedTarget | HostTarget | ModelTarget | StepTarget | LossTarget
