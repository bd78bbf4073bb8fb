"""flashmoe-science: FlashAttention-style attention kernels for PyTorch, and the pipeline that gates them.

The public API is :func:`flash_attention_forward`, :func:`flash_attention_varlen_forward` and
:func:`flash_attention_decode` (contiguous or paged KV cache); `flashmoe_science.integrations`
plugs them into model libraries. Importing the package does not import torch; the operators are
loaded (and built if needed) on first use.
"""

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "flash_attention_decode",
    "flash_attention_forward",
    "flash_attention_varlen_forward",
]


def __getattr__(name: str):
    # Lazy so that `python -m flashmoe_science env` can diagnose a machine whose torch is broken.
    if name in (
        "flash_attention_forward",
        "flash_attention_varlen_forward",
        "flash_attention_decode",
        "split_kv_combine",
    ):
        from . import ops

        return getattr(ops, name)
    raise AttributeError(f"module 'flashmoe_science' has no attribute {name!r}")
