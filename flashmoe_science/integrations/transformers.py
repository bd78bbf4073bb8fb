"""Our attention as a Hugging Face transformers attention backend.

    from flashmoe_science.integrations.transformers import register
    name = register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name)

register() adds `attention_forward` to transformers' AttentionInterface and, under the same name,
`padding_mask` to its AttentionMaskInterface: a backend registered without a mask function never
sees the padding. That mask function hands the attention the 2-D padding mask [B, Sk] (True = a
real token), or None when nothing is padded and every key is filled. The name holds no "flash":
transformers treats such names as FlashAttention requests and looks for a Hub kernel.

Per call (query and key [B, Hq or Hkv, Sq or Sk, D], value [B, Hkv, Sk, Dv], not expanded for
GQA; the output takes value's head dim, so a model whose value is narrower than its query and key,
DeepSeek-V3's multi-head latent attention with 192 and 128, passes it as it is):
- no mask: the dense kernel (flash_attention_forward), causal aligned bottom-right, which is
  what a KV cache needs (the Sq new queries are the last Sq positions);
- a padding mask: the real tokens are packed (the queries are the last Sq positions of the
  mask, the keys past it unfilled slots of a static cache) and run through
  flash_attention_varlen_forward; padded query rows come back 0. The packing (which syncs the
  device) is computed once per mask tensor, not once per layer;
- packed inputs without padding (cu_seq_lens_q/k and max_length_q/k from transformers'
  DataCollatorWithFlattening): varlen on the flattened batch.
fp16 and bf16 run as they are; an fp32 model's attention runs in bf16 (as transformers' own
FlashAttention backends do) and comes back in fp32. KV caches: the dynamic (default) one, and
fixed-size ones (StaticCache, cache_implementation="static"), whose keys past the filled length
padding_mask masks out. All three paths train (flash_attention_varlen_forward's backward runs the
dense backward per sequence). Head dims: any on the CPU; on CUDA what the kernels take
(ops.head_dims_unsupported_reason says, in the one-line error a call raises otherwise).

What models pass per layer (_features), on every path: a `sliding_window` W (Mistral, Gemma 2
and 3's local layers, gpt-oss's sliding layers: a query sees itself and the W - 1 tokens before
it, or W - 1 on each side without the causal mask) becomes window_size=(W - 1, 0), or
(W - 1, W - 1); `softcap` (Gemma 2's attn_logit_softcapping) is passed as it is; `s_aux`
(gpt-oss's learnable sinks, one logit per query head) becomes sinks, in fp32, and trains. A
sliding layer's cache holds the window's last tokens, bottom-right aligned like the queries, so
the KV-cache path needs nothing more. On CUDA the kernels take them too, forward and backward.
Not supported: attention dropout
while training (it raises).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

NAME = "moe_science"

INSTALL_HINT = (
    "flashmoe_science.integrations.transformers needs Hugging Face transformers: "
    "pip install transformers"
)

_warned_fp32 = False


def register() -> str:
    """Register our attention (and its mask function) with transformers; returns the name to pass
    as `attn_implementation`. Calling it again is harmless."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        raise ImportError(INSTALL_HINT) from None
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, padding_mask)
    return NAME


def padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset=0,
    kv_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """transformers' FlashAttention mask function (the 2-D padding mask, or None), and a mask where
    that one trusts generate() to keep the padding mask: a fixed-size cache (StaticCache) hands a
    causal layer all its kv_length slots, of which only the first q_offset + q_length are filled.
    generate() keeps an all-ones mask only for names with "flash" in them; without this mask, the
    unfilled slots would be attended to. (No causal query sees a key past q_offset + q_length, so
    the mask drops nothing a query may see; cross-attention and bidirectional masks pass through.)"""
    from transformers.masking_utils import causal_mask_function, flash_attention_mask

    mask = flash_attention_mask(
        batch_size,
        q_length,
        kv_length,
        q_offset,
        kv_offset,
        attention_mask=attention_mask,
        **kwargs,
    )
    if mask is not None or attention_mask is not None:
        return mask
    if kwargs.get("mask_function", causal_mask_function) is not causal_mask_function:
        return None
    filled = int(q_offset + q_length - kv_offset)  # q_offset is a tensor for a static cache
    if filled >= kv_length:
        return None
    return torch.ones(batch_size, filled, dtype=torch.bool, device=kwargs.get("device"))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    global _warned_fp32
    if dtype in (torch.float16, torch.bfloat16):
        return dtype
    if not _warned_fp32:
        warnings.warn(
            f"flashmoe_science runs attention in fp16/bf16; this model's {dtype} attention "
            "inputs are computed in torch.bfloat16 (load the model in bf16 to avoid the casts)",
            stacklevel=3,
        )
        _warned_fp32 = True
    return torch.bfloat16


def _features(kwargs: dict, causal: bool) -> dict:
    """The window_size, softcap and sinks of one layer's call, from what transformers passes
    (sliding_window, softcap, s_aux); {} for a layer with none."""
    options = {}
    window = kwargs.get("sliding_window")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"{NAME} attention takes sliding_window >= 1, got {window!r}")
        options["window_size"] = (window - 1, 0 if causal else window - 1)
    if kwargs.get("softcap"):
        options["softcap"] = float(kwargs["softcap"])
    if kwargs.get("s_aux") is not None:
        options["sinks"] = kwargs["s_aux"].float()  # a model's dtype; the cast keeps the gradient
    return options


def _check_supported(module, dropout: float, kwargs: dict) -> None:
    if dropout and getattr(module, "training", False):
        raise NotImplementedError(
            f"{NAME} attention has no dropout (got {dropout}); call model.eval() or set the "
            "model's attention_dropout to 0"
        )


def _cumulative(lengths: torch.Tensor) -> torch.Tensor:
    return F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))


@dataclass(frozen=True)
class _Packing:
    """How a padding mask packs one call's queries and keys: the rows to gather, the sequences'
    offsets, and the longest sequences as host ints."""

    q_index: torch.Tensor
    k_index: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


# (mask, its version counter, Sq, Sk, packing) of the last padded call.
_last_packing: tuple | None = None


def _packing(mask: torch.Tensor, seqlen_q: int, seqlen_k: int) -> _Packing:
    """The packing of a 2-D padding mask for Sq queries and Sk keys. Computing it synchronises the
    device three times (two nonzero, the maxima), and every layer of a forward pass gets the same
    mask tensor: so it is computed once per mask, not once per layer. The cache holds the mask
    itself, so no other mask can take its memory while it is cached, and an in-place change to
    it (its version counter moves) computes the packing again."""
    global _last_packing
    last = _last_packing
    if last is not None and last[0] is mask and last[1:4] == (mask._version, seqlen_q, seqlen_k):
        return last[4]
    packing = _compute_packing(mask, seqlen_q, seqlen_k)
    _last_packing = (mask, mask._version, seqlen_q, seqlen_k, packing)
    return packing


def _compute_packing(mask: torch.Tensor, seqlen_q: int, seqlen_k: int) -> _Packing:
    real = mask.to(torch.bool)
    query_mask = real[:, -seqlen_q:]  # the queries are the last Sq positions the mask covers
    if real.shape[1] < seqlen_k:  # a static cache: keys past the mask are not filled yet
        key_mask = F.pad(real, (0, seqlen_k - real.shape[1]), value=False)
    else:
        key_mask = real[:, -seqlen_k:]
    lengths_q = query_mask.sum(1, dtype=torch.int32)
    lengths_k = key_mask.sum(1, dtype=torch.int32)
    max_q, max_k = (int(x) for x in torch.stack([lengths_q.max(), lengths_k.max()]).tolist())
    return _Packing(
        query_mask.reshape(-1).nonzero().squeeze(1),
        key_mask.reshape(-1).nonzero().squeeze(1),
        _cumulative(lengths_q),
        _cumulative(lengths_k),
        max_q,
        max_k,
    )


def _padded_attention(q, k, v, mask: torch.Tensor, causal: bool, scale, options: dict):
    """q [B, Sq, Hq, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv] and a 2-D padding mask: the real
    tokens of each sequence packed into one varlen call, scattered back into zeros."""
    from ..ops import flash_attention_varlen_forward

    batch, seqlen_q, heads_q, head_dim = q.shape
    head_dim_v = v.shape[-1]
    seqlen_k = k.shape[1]
    pack = _packing(mask, seqlen_q, seqlen_k)
    out = flash_attention_varlen_forward(
        q.reshape(batch * seqlen_q, heads_q, head_dim).index_select(0, pack.q_index),
        k.reshape(batch * seqlen_k, *k.shape[2:]).index_select(0, pack.k_index),
        v.reshape(batch * seqlen_k, *v.shape[2:]).index_select(0, pack.k_index),
        pack.cu_seqlens_q,
        pack.cu_seqlens_k,
        pack.max_seqlen_q,
        pack.max_seqlen_k,
        causal,
        scale,
        **options,
    )
    full = out.new_zeros(batch * seqlen_q, heads_q, head_dim_v)
    full.index_copy_(0, pack.q_index, out)
    return full.view(batch, seqlen_q, heads_q, head_dim_v)


def attention_forward(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
):
    """transformers' attention-function contract: returns (output [B, Sq, Hq, Dv], None), Dv being
    value's head dim."""
    from ..ops import flash_attention_forward, flash_attention_varlen_forward

    _check_supported(module, dropout, kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    options = _features(kwargs, causal)
    dtype = query.dtype
    compute = _compute_dtype(dtype)
    q, k, v = (t.to(compute) for t in (query, key, value))
    batch, heads_q, seqlen_q, head_dim = q.shape
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(
                f"{NAME} attention takes the 2-D padding mask of transformers' FlashAttention mask "
                f"function, got shape {tuple(attention_mask.shape)}; create the model with "
                f"attn_implementation=register() so the matching mask function is used"
            )
        out = _padded_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attention_mask,
            causal,
            scaling,
            options,
        )
    elif cu_q is not None and cu_k is not None:
        # Padding-free packing: the batch is flattened and cu_seq_lens mark the sequences.
        out = flash_attention_varlen_forward(
            q.transpose(1, 2).reshape(-1, heads_q, head_dim),
            k.transpose(1, 2).reshape(-1, *k.shape[1:2], head_dim),
            v.transpose(1, 2).reshape(-1, *v.shape[1:2], v.shape[-1]),
            cu_q.to(torch.int32),
            cu_k.to(torch.int32),
            int(kwargs["max_length_q"]),
            int(kwargs["max_length_k"]),
            causal,
            scaling,
            **options,
        ).view(batch, seqlen_q, heads_q, v.shape[-1])
    else:
        out = flash_attention_forward(q, k, v, causal, scaling, **options).transpose(1, 2)
    return out.to(dtype), None
