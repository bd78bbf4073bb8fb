"""Public attention API. One tensor's path: flash_attention_forward -> torch.ops.flashmoe_science.fwd
-> csrc/flash_api_cuda.cuh (attention_fwd_cuda) -> flash_fwd_kernel (csrc/flash_fwd_kernel.cuh), or
csrc/attention_cpu.h on CPU tensors.

Tensor checks (dtype, shapes, devices, strides) live once, in C++, so direct `torch.ops` callers get
them too; this module checks only the Python-level arguments and adds the fake (meta) kernels that
torch.compile and torch.library.opcheck need.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import torch

from . import _loader
from ._dispatch import call as _call

_lock = threading.Lock()
_loaded = False
_built_archs: tuple[str, ...] = ()  # the CUDA targets of the loaded build (empty: CPU-only)


def build_defines() -> tuple[str, ...]:
    """Extra -D defines for the build this process loads (FLASHMOE_BUILD_DEFINES: _loader.env_defines)."""
    return _loader.env_defines()


def load_library() -> None:
    """Build the extension if it is missing or stale, load it, and register the fake kernels.

    Runs when this module is imported, so torch.compile never traces it (Dynamo cannot enter a lock)."""
    global _loaded, _built_archs
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        so_path = _loader.ensure_built(defines=build_defines())
        torch.ops.load_library(str(so_path))
        _built_archs = _loader.library_arch_list(so_path)
        _register_fakes()
        from . import autograd

        autograd.register()
        _loaded = True


def _register_fakes() -> None:
    # The output takes v's last dimension (Dv), which may differ from q's and k's. Every operator
    # ends with the window, softcap and sinks (defaults: none), which leave the shapes alone.
    @torch.library.register_fake("flashmoe_science::fwd")
    def _fwd_fake(q, k, v, seqlens_k, causal, softmax_scale, num_splits, config, *features):
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        return out, lse

    @torch.library.register_fake("flashmoe_science::varlen_fwd")
    def _varlen_fake(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, config, *features):
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
        return out, lse

    @torch.library.register_fake("flashmoe_science::paged_fwd")
    def _paged_fake(
        q, k_cache, v_cache, block_table, seqlens_k, causal, softmax_scale, splits, *features
    ):
        out = q.new_empty((*q.shape[:-1], v_cache.shape[-1]))
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        return out, lse

    @torch.library.register_fake("flashmoe_science::split_kv_combine")
    def _combine_fake(out_partial, lse_partial, dtype):
        out = torch.empty(out_partial.shape[1:], dtype=dtype, device=out_partial.device)
        lse = torch.empty(lse_partial.shape[1:], dtype=torch.float32, device=lse_partial.device)
        return out, lse


load_library()


def _check_tensor(name: str, value) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def _resolve_scale(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(
            f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}"
        )
    if not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be a finite positive number, got {softmax_scale}")
    return float(softmax_scale)


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} ({value!r})")


def _check_int(name: str, value, low: int, high: int, meaning: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an int in [{low}, {high}] ({meaning}), got {value!r}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _features(window_size, softcap, sinks) -> tuple[int, int, float, torch.Tensor | None]:
    """window_size, softcap and sinks as the operators take them (window_left, window_right,
    softcap, sinks). Their types are checked here; their values (a window side below -1, a
    negative softcap, sinks of the wrong shape, dtype or device) by the operators, in C++."""
    if (
        not isinstance(window_size, tuple | list)
        or len(window_size) != 2
        or not all(_is_int(side) for side in window_size)
    ):
        raise TypeError(
            "window_size must be a pair of ints (left, right), -1 for unbounded, got "
            f"{window_size!r}"
        )
    if isinstance(softcap, bool) or not isinstance(softcap, int | float):
        raise TypeError(f"softcap must be a float (0.0 = off), got {type(softcap).__name__}")
    if sinks is not None:
        _check_tensor("sinks", sinks)
    left, right = (
        max(-(2**62), min(2**62, side)) for side in window_size
    )  # the C++ check names it
    return left, right, float(softcap), sinks


# CUDA kernel configurations that `config=` forces (ids as in csrc/flash_api_cuda.cuh).
CONFIGS = {
    1: "128x64 tiles (128x32 at d128), 4 warps",
    2: "64x64 tiles, 4 warps",
    3: "decode kernel: 16 rows, 4 warps splitting the keys",
    4: "128x64 tiles at d128, 128x128 at d64, 4 warps (sm_90 and newer)",
    5: "128x128 tiles (192x128 at d64, 128x96 at d192, 128x64 at d256, 128x112 at d192 with v's "
    "128), 2 (3 at d64) warpgroups, wgmma (sm_90a build on a 9.0 GPU)",
    6: "128x128 tiles at d64 and d128 (d128 and up: config 5's kernel), 2 warpgroups, wgmma "
    "(sm_90a build on a 9.0 GPU)",
    7: "128x176 tiles at d128 (other head dims: config 5's kernel), 2 warpgroups, wgmma (sm_90a "
    "build on a 9.0 GPU)",
}
_CONFIG_TEXT = ", ".join(f"{i} = {text}" for i, text in CONFIGS.items())
# Backward tile configurations that `backward_config=` forces (csrc/flash_api_cuda.cuh).
BACKWARD_CONFIGS = {
    1: "64 keys x 64 queries a step, 4 warps (72.5 KB at d128: fits sm_86/sm_89)",
    2: "128 keys x 64 queries a step, 8 warps (112.5 KB at d128: sm_80, sm_90)",
    3: "128 keys x 128 (d64) or 64 (d128) queries a step, 2 warpgroups, wgmma (sm_90a build on a "
    "9.0 GPU); 64 x 64 at d192 and d256, dK and dV transposed",
}
_BACKWARD_CONFIG_TEXT = ", ".join(f"{i} = {text}" for i, text in BACKWARD_CONFIGS.items())
# Built for compute capability 9.0 and newer only (ptxas spills these tiles on sm_80/sm_89); the
# operator refuses them below that, and the gates skip them there.
SM90_ONLY_CONFIGS = frozenset({4})
# The wgmma kernels: only a build that targets sm_90a carries them (wgmma has no sm_90 or PTX
# form), and sm_90a code runs only on compute capability 9.0; the operator refuses them elsewhere.
SM90A_CONFIGS = frozenset({5, 6, 7})
# The same for the backward's wgmma configuration.
SM90A_BACKWARD_CONFIGS = frozenset({3})
# The configurations without a packed-batch (varlen) variant: the decode kernel, 6 and 7.
NO_PACKED_CONFIGS = frozenset({3, 6, 7})


def built_archs() -> tuple[str, ...]:
    """The CUDA targets of the loaded build, e.g. ('8.9', '9.0a'); empty for the CPU-only build."""
    return _built_archs


def config_unsupported_reason(
    config: int, capability: tuple[int, int], arch_list: Sequence[str] | None = None
) -> str | None:
    """Why `config=` cannot run on a GPU of this compute capability with the build for these
    targets (default: the loaded build's), with what to do; None when it can (0 always can)."""
    capability = tuple(capability)
    gpu = "sm_" + "".join(str(part) for part in capability)
    if config in SM90_ONLY_CONFIGS and capability < (9, 0):
        return f"config={config} is built for sm_90 and newer; this GPU is {gpu}"
    if config in SM90A_CONFIGS:
        return _sm90a_reason(f"config={config}", capability, arch_list)
    return None


def _sm90a_reason(
    option: str, capability: tuple[int, ...], arch_list: Sequence[str] | None
) -> str | None:
    """Why a wgmma configuration (`option`, as the user gave it) cannot run here, or None."""
    archs = built_archs() if arch_list is None else tuple(arch_list)
    if tuple(capability) == (9, 0) and _loader.targets_sm90a(archs):
        return None
    gpu = "sm_" + "".join(str(part) for part in capability)
    build = (
        "the build targets " + ", ".join(_loader.arch_label(a) for a in archs)
        if archs
        else "the build is CPU-only"
    )
    return (
        f"{option} needs an sm_90a build on a compute capability 9.0 GPU: build with --arch 9.0a "
        f"(this GPU is {gpu}, {build})"
    )


def backward_config_unsupported_reason(
    config: int, capability: tuple[int, int], arch_list: Sequence[str] | None = None
) -> str | None:
    """Why `backward_config=` cannot run on a GPU of this compute capability with the build for
    these targets (default: the loaded build's), with what to do; None when it can."""
    if config in SM90A_BACKWARD_CONFIGS:
        return _sm90a_reason(f"backward_config={config}", capability, arch_list)
    return None


def backward_config_supported(
    config: int, capability: tuple[int, int], arch_list: Sequence[str] | None = None
) -> bool:
    """Whether `backward_config=` can run here (0, automatic, always can)."""
    return backward_config_unsupported_reason(config, capability, arch_list) is None


def config_supported(
    config: int, capability: tuple[int, int], arch_list: Sequence[str] | None = None
) -> bool:
    """Whether `config=` can run on a GPU of this compute capability with the build for these
    targets (default: the loaded build's); 0, automatic, always can."""
    return config_unsupported_reason(config, capability, arch_list) is None


def head_dims_unsupported_reason(head_dim: int, head_dim_v: int | None = None) -> str | None:
    """Why the CUDA operators cannot take q's and k's `head_dim` with v's `head_dim_v` (default:
    the same), in the one line they raise before any kernel launch; None when they can. The CPU
    implementation takes any head dims, v's differing from q's and k's included."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    for name, value in (("head_dim", head_dim), ("head_dim_v", head_dim_v)):
        _check_int(name, value, 1, 1 << 20, "a head dim")
    reason = torch.ops.flashmoe_science.cuda_head_dims_problem(head_dim, head_dim_v)
    return reason or None


def head_dims_supported(head_dim: int, head_dim_v: int | None = None) -> bool:
    """Whether the CUDA operators take these head dims (the CPU implementation takes any)."""
    return head_dims_unsupported_reason(head_dim, head_dim_v) is None


def config_needs(config: int, kind: str = "prefill") -> str | None:
    """What a forced configuration of a case of this kind needs beyond a GPU, in a few words (a
    gate's rerun_needs); backward cases force backward configurations."""
    if kind == "backward":
        return "an sm_90a build on a 9.0 GPU" if config in SM90A_BACKWARD_CONFIGS else None
    if config in SM90A_CONFIGS:
        return "an sm_90a build on a 9.0 GPU"
    if config in SM90_ONLY_CONFIGS:
        return "sm_90"
    return None


def flash_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    softmax_scale: float | None = None,
    *,
    return_lse: bool = False,
    num_splits: int = 0,
    config: int = 0,
    deterministic: bool = False,
    backward_config: int = 0,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
):
    """Attention softmax(q k^T * scale) v, computed FlashAttention-style; differentiable in q, k, v
    (and sinks).

    q: [B, Hq, Sq, D]; k: [B, Hkv, Sk, D]; v: [B, Hkv, Sk, Dv], with Hq a multiple of Hkv
    (grouped-query and multi-query attention) and Dv, the output's head dim, free to differ from D
    (DeepSeek's multi-head latent attention: D 192, Dv 128). fp16 or bf16. Head dims: on CUDA, D
    and Dv any multiples of 8 up to 256, run on the narrowest of the 64, 128, 192 and 256 tiles
    that holds both (anything else raises a one-line error before any launch:
    head_dims_unsupported_reason); on the CPU, any D and Dv. Only the last dimension must be
    contiguous: a [B, H, S, D] view of a [B, S, H, D] tensor is used in place.

    causal: query i sees keys j <= i + Sk - Sq, i.e. the mask is aligned to the bottom-right corner
    as in FlashAttention-2 (with Sq == Sk this is the usual lower triangle; with Sq < Sk the queries
    are the last Sq positions). A query that sees no key gets output 0 and log-sum-exp -inf.
    softmax_scale defaults to 1/sqrt(D). num_splits: 0 chooses the split-KV count from the SM count
    and the work, 1 disables splitting. config: 0 picks the kernel and tile configuration for the GPU;
    1 to 7 force one (see CONFIGS and csrc/flash_api_cuda.cuh), which is how every configuration any
    architecture selects is gated on one card.

    Local attention, soft-capping and sinks (FlashAttention's conventions; every operator, forward
    and backward, on the CPU and on CUDA, where the mma.sync and decode kernels take them and a
    forced wgmma configuration refuses them in one line):
    - window_size=(left, right): query i, at position p = i + Sk - Sq (the bottom-right alignment
      of causal), sees keys j with p - left <= j <= p + right; -1 leaves that side unbounded.
      causal=True sets right to 0 (as FlashAttention does), and (-1, 0) is causal. Mistral's and
      Gemma's sliding window W (a query sees itself and W - 1 keys before it) is (W - 1, 0). Key
      blocks wholly outside the window are skipped: the work grows with the window, not with Sk.
    - softcap: when > 0, each scaled score s = q.k * scale becomes softcap * tanh(s / softcap)
      before the mask and the softmax (Gemma 2's attn_logit_softcapping); the backward applies its
      derivative.
    - sinks: fp32 [Hq], learnable sink logits (gpt-oss): every row's softmax denominator gains
      exp(sinks[h]) (the sink has no value), the log-sum-exp includes it, and the backward returns
      a gradient for sinks.
    A query that sees no key gets output 0 and log-sum-exp -inf, or sinks[h] with a sink.

    Backward (autograd, flashmoe_science.autograd): FlashAttention-2's, from the saved output and
    log-sum-exp (on wgmma on an H100 with the sm_90a build); gradients come back contiguous, in
    the inputs' dtype, dq and dk D wide, dv Dv wide (the sinks' fp32). deterministic=True gives
    bit-identical gradients over repeated calls (dQ summed in a fixed order, without atomics; a
    little slower). backward_config: 0 picks the backward tile configuration, 1 to
    len(BACKWARD_CONFIGS) force one.

    Returns the output [B, Hq, Sq, Dv] in the input dtype, and with return_lse=True also the
    log-sum-exp of each row as fp32 [B, Hq, Sq].
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
    _check_bool("causal", causal)
    _check_bool("return_lse", return_lse)
    _check_bool("deterministic", deterministic)
    _check_int("num_splits", num_splits, 0, 128, "0 = automatic")
    _check_int("config", config, 0, len(CONFIGS), "0 = automatic, " + _CONFIG_TEXT)
    _check_int(
        "backward_config",
        backward_config,
        0,
        len(BACKWARD_CONFIGS),
        "0 = automatic, " + _BACKWARD_CONFIG_TEXT,
    )
    features = _features(window_size, softcap, sinks)
    scale = _resolve_scale(softmax_scale, q.shape[-1] if q.dim() else 0)
    out, lse = _call(
        torch.ops.flashmoe_science.attention,
        q,
        k,
        v,
        causal,
        scale,
        num_splits,
        config,
        deterministic,
        backward_config,
        *features,
    )
    return (out, lse) if return_lse else out


def flash_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    *,
    causal: bool = True,
    num_splits: int | None = None,
    return_lse: bool = False,
    block_table: torch.Tensor | None = None,
    config: int = 0,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
):
    """Decoding attention of a few new queries against a KV cache, split along the cache (flash-decoding).

    q: [B, Hq, Sq, D] with small Sq (1 to 16 typically); k_cache: [B, Hkv, Smax, D], v_cache:
    [B, Hkv, Smax, Dv] (the output's head dim; head dims as flash_attention_forward);
    cache_seqlens: int32 [B], the valid length of each sequence's cache (all of Smax when None).
    The Sq queries are the last Sq positions of each sequence, so with causal=True query i of batch b
    sees keys j <= i + cache_seqlens[b] - Sq. Grouped-query heads that share a KV head are folded
    into one tile so each K and V byte is read once. num_splits: None chooses from the SM count and
    the work; 1 gives results bit-identical to the unsplit path; at most 128.

    Paged cache (FlashAttention's layout): with block_table int32 [B, max_blocks_per_seq],
    k_cache and v_cache are [num_blocks, block_size, Hkv, D] and [..., Dv], and sequence b's keys j
    lie in block block_table[b, j // block_size] at row j % block_size; Smax is then
    max_blocks_per_seq x block_size. Block sizes: powers of two from 16. Only the entries covering a sequence's
    cache_seqlens are read (the rest may hold anything).

    No host synchronisation, and CUDA graphs can capture the call: on CUDA the values of
    cache_seqlens and of the block_table entries in use are checked by the kernel, not the host.
    Nothing outside the cache is read whatever they hold, and a sequence with a length outside
    [0, Smax] or a block outside the cache gets NaN output and log-sum-exp. Set
    FLASHMOE_CHECK_INPUTS=1 to have them checked on the host as well (one copy and sync per call),
    which raises a one-line error naming the value. The CPU implementation always checks them.

    config: 0 picks the CUDA tile configuration (the decode kernel for a few queries; many query
    rows, chunked prefill say, may take a prefill configuration), 1 to len(CONFIGS) force one as
    flash_attention_forward's config does. A paged cache has one kernel: config must be 0 there.

    window_size, softcap and sinks as flash_attention_forward's, each query's position counted
    from its own sequence's cache length (query i sits at i + cache_seqlens[b] - Sq): a sliding
    window W reads only the last W keys of each cache. Split-KV adds each row's sink once, in the
    combine.
    """
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(name, t)
    if cache_seqlens is not None:
        _check_tensor("cache_seqlens", cache_seqlens)
    _check_bool("causal", causal)
    _check_bool("return_lse", return_lse)
    if num_splits is not None:
        _check_int("num_splits", num_splits, 1, 128, "None = automatic")
    _check_int("config", config, 0, len(CONFIGS), "0 = automatic, " + _CONFIG_TEXT)
    features = _features(window_size, softcap, sinks)
    scale = _resolve_scale(softmax_scale, q.shape[-1] if q.dim() else 0)
    if block_table is not None:
        _check_tensor("block_table", block_table)
        if config != 0:
            raise ValueError(
                f"config={config} cannot be forced with block_table: a paged cache runs the decode "
                "kernel only; use config=0"
            )
        out, lse = _call(
            torch.ops.flashmoe_science.paged_fwd,
            q,
            k_cache,
            v_cache,
            block_table,
            cache_seqlens,
            causal,
            scale,
            num_splits or 0,
            *features,
        )
        return (out, lse) if return_lse else out
    out, lse = _call(
        torch.ops.flashmoe_science.fwd,
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        causal,
        scale,
        num_splits or 0,
        config,
        *features,
    )
    return (out, lse) if return_lse else out


def flash_attention_varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = False,
    softmax_scale: float | None = None,
    *,
    return_lse: bool = False,
    config: int = 0,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
):
    """Attention over a packed batch of sequences of different lengths (FlashAttention's varlen API).

    q: [total_q, Hq, D]; k: [total_k, Hkv, D]; v: [total_k, Hkv, Dv]: the rows of all sequences one
    after another, no padding; cu_seqlens_q, cu_seqlens_k: int32 [B + 1], from 0, so sequence b
    owns rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q and cu_seqlens_k[b]:cu_seqlens_k[b + 1] of k
    and v.
    max_seqlen_q, max_seqlen_k: the longest sequence (they size the launch grid). Sequences of
    length 0 are allowed. causal: bottom-right aligned per sequence (query i of a sequence with
    sq queries and sk keys sees keys j <= i + sk - sq), as in FlashAttention 2.1+; a query that
    sees no key gets output 0 and log-sum-exp -inf. GQA, dtypes and head dims as
    flash_attention_forward. config: 0 picks the tile configuration; 1, 2, 4 or 5 force one of the
    forward kernels' (CONFIGS; the decode kernel, 3, and 6 and 7 have no packed variant).

    No host synchronisation (CUDA graphs can capture the call): on CUDA the kernel checks the
    cu_seqlens values itself. Nothing outside the packed tensors is read whatever they hold, and
    offsets that do not partition q and k (not from 0, decreasing, not ending at the rows, or a
    sequence longer than max_seqlen) make the whole output and log-sum-exp NaN. Set
    FLASHMOE_CHECK_INPUTS=1 to have them checked on the host as well (one copy and sync per call),
    which raises a one-line error naming the value. The CPU implementation always checks them.
    Differentiable in q, k and v (and sinks): the backward runs flash_attention_forward's backward
    on each sequence (one launch sequence per sequence; gradients contiguous, in the inputs'
    dtype). window_size, softcap and sinks as flash_attention_forward's, the window aligned per
    sequence as causal is.

    Returns the output [total_q, Hq, Dv] in the input dtype, and with return_lse=True also the
    log-sum-exp as fp32 [Hq, total_q] (FlashAttention's varlen layout).
    """
    for name, t in (
        ("q", q),
        ("k", k),
        ("v", v),
        ("cu_seqlens_q", cu_seqlens_q),
        ("cu_seqlens_k", cu_seqlens_k),
    ):
        _check_tensor(name, t)
    _check_int("max_seqlen_q", max_seqlen_q, 0, 1 << 30, "the longest query sequence")
    _check_int("max_seqlen_k", max_seqlen_k, 0, 1 << 30, "the longest key sequence")
    _check_bool("causal", causal)
    _check_bool("return_lse", return_lse)
    if isinstance(config, bool) or not isinstance(config, int) or config in NO_PACKED_CONFIGS:
        raise ValueError(
            f"config must be 0 (automatic), 1, 2, 4 or 5 for a packed batch, got {config!r}"
        )
    _check_int("config", config, 0, len(CONFIGS), "0 = automatic, " + _CONFIG_TEXT)
    features = _features(window_size, softcap, sinks)
    scale = _resolve_scale(softmax_scale, q.shape[-1] if q.dim() else 0)
    out, lse = _call(
        torch.ops.flashmoe_science.varlen_fwd,
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        causal,
        scale,
        config,
        *features,
    )
    return (out, lse) if return_lse else out


def split_kv_combine(out_partial: torch.Tensor, lse_partial: torch.Tensor, dtype: torch.dtype):
    """Combine per-split partial attention: out_partial fp32 [S, B, H, Sq, D] (each split normalised
    on its own) and lse_partial fp32 [S, B, H, Sq] -> (out [B, H, Sq, D] in dtype, lse [B, H, Sq]).
    Splits with lse = -inf (no valid key) contribute nothing."""
    _check_tensor("out_partial", out_partial)
    _check_tensor("lse_partial", lse_partial)
    return _call(torch.ops.flashmoe_science.split_kv_combine, out_partial, lse_partial, dtype)


def decode_num_splits(tiles: int, sm_count: int, n_blocks: int) -> int:
    """The split-KV count the CUDA decode kernel picks when num_splits is automatic, for `tiles`
    (batch x KV heads) with `n_blocks` blocks of 64 keys each on a card of `sm_count` SMs (rule in
    csrc/attention_params.h)."""
    for name, value, high in (
        ("tiles", tiles, 30),
        ("sm_count", sm_count, 20),
        ("n_blocks", n_blocks, 30),
    ):
        _check_int(name, value, 1, (1 << high) - 1, "a count")
    return int(_call(torch.ops.flashmoe_science.decode_num_splits, tiles, sm_count, n_blocks))


def planted_bug() -> int:
    """Which planted bug the loaded build carries (0: none). Tests use it to prove a gate catches it."""
    return int(torch.ops.flashmoe_science.planted_bug())
