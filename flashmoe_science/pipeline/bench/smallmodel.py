"""The small Llama-style model that the transformers tests and the benchmark's model case build:
random weights from a config, no downloads. transformers is imported on first use; without it the
builders raise the integration's one-line install hint."""

from __future__ import annotations

import copy

import torch


def _transformers():
    try:
        import transformers
    except ImportError:
        from ...integrations.transformers import INSTALL_HINT

        raise ImportError(INSTALL_HINT) from None
    return transformers


def llama_config(initializer_range: float = 0.2, head_dim: int = 64):
    # GQA 4:2, two layers, head_dim 64 by default (a head dim every build takes). A wide initialiser
    # keeps greedy decoding away from near-ties, so the token comparisons mean something; the
    # gradient comparison takes the usual 0.02, where attention is not near one-hot and bf16
    # rounding is not amplified layer over layer.
    return _transformers().LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        pad_token_id=0,
        initializer_range=initializer_range,
    )


def llama_model(
    implementation: str,
    state=None,
    dtype=torch.float32,
    device="cpu",
    initializer_range=0.2,
    head_dim: int = 64,
):
    """The model with attention `implementation` ("eager", "sdpa", or a registered name), in eval
    mode; seeded, so two calls give the same weights (or `state`'s, when given)."""
    torch.manual_seed(0)
    m = _transformers().LlamaForCausalLM._from_config(
        copy.deepcopy(llama_config(initializer_range, head_dim)), attn_implementation=implementation
    )
    if state is not None:
        m.load_state_dict(state)
    return m.eval().to(device=device, dtype=dtype)
