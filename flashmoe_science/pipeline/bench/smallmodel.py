"""The small Llama-style model that the transformers tests and the benchmark's model case build,
the wider one whose training step the benchmark times, and the Gemma-2-style one (sliding and
global layers, a softcap) it trains against eager, with the Markov chain it trains on: random
weights from a config, no downloads. transformers is imported on first use; without it the builders raise the
integration's one-line install hint."""

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


def swiglu_width(hidden: int) -> int:
    """Llama's MLP width: 8/3 of the hidden size, rounded up to a multiple of 64."""
    return -(-8 * hidden // 3 // 64) * 64


def training_config(
    layers: int, heads: int, heads_kv: int, head_dim: int, seqlen: int, vocab_size: int = 4096
):
    """A Llama-style config for the training-step case: hidden size heads * head_dim, Llama's
    SwiGLU width (8/3 of it, rounded up to 64), GQA heads:heads_kv. The vocabulary is small, so
    the step is the decoder layers' work rather than the output projection's."""
    hidden = heads * head_dim
    return _transformers().LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=swiglu_width(hidden),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads_kv,
        head_dim=head_dim,
        max_position_embeddings=seqlen,
        pad_token_id=0,
        attention_dropout=0.0,
    )


def training_model(config, implementation: str, state=None, dtype=torch.bfloat16, device="cpu"):
    """The model of `config` with attention `implementation`, in train mode; seeded, so two calls
    give the same weights (or `state`'s, when given)."""
    return _seeded_model("LlamaForCausalLM", config, implementation, state, dtype, device)


def gemma2_config(
    layers: int,
    heads: int,
    heads_kv: int,
    head_dim: int,
    seqlen: int,
    window: int,
    softcap: float,
    vocab_size: int = 256,
):
    """A Gemma-2-style config: layers alternating a sliding window of `window` tokens and global
    attention, attention logits soft-capped at `softcap` (no final-logit cap), hidden size
    heads * head_dim, an MLP twice as wide, no dropout."""
    hidden = heads * head_dim
    return _transformers().Gemma2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads_kv,
        head_dim=head_dim,
        query_pre_attn_scalar=head_dim,
        max_position_embeddings=seqlen,
        sliding_window=window,
        layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(layers)],
        attn_logit_softcapping=softcap,
        final_logit_softcapping=None,
        attention_dropout=0.0,
        pad_token_id=0,
    )


def gemma2_model(config, implementation: str, state=None, dtype=torch.float32, device="cpu"):
    """The Gemma 2 model of `config` with attention `implementation`, in train mode; seeded, so
    two calls give the same weights (or `state`'s, when given)."""
    return _seeded_model("Gemma2ForCausalLM", config, implementation, state, dtype, device)


def _seeded_model(model_class: str, config, implementation, state, dtype, device):
    """transformers' `model_class` of `config`, seeded (or `state`'s weights), in train mode."""
    torch.manual_seed(0)
    m = getattr(_transformers(), model_class)._from_config(
        copy.deepcopy(config), attn_implementation=implementation
    )
    if state is not None:
        m.load_state_dict(state)
    return m.train().to(device=device, dtype=dtype)


MARKOV_SUCCESSORS = 4  # the tokens that may follow each token, equally likely


def markov_batches(steps: int, batch: int, seqlen: int, vocab: int, seed: int) -> torch.Tensor:
    """[steps, batch, seqlen] tokens (1 to vocab - 1) of a random Markov chain drawn from `seed`:
    each token is followed by one of MARKOV_SUCCESSORS tokens of its own. A model learns it
    smoothly, step after step, so two correct runs from one initialisation keep close losses
    (random tokens teach nothing; copying tasks are learnt in a jump whose step varies)."""
    generator = torch.Generator().manual_seed(seed)
    successors = torch.randint(1, vocab, (vocab, MARKOV_SUCCESSORS), generator=generator)
    tokens = torch.empty(steps, batch, seqlen, dtype=torch.long)
    tokens[:, :, 0] = torch.randint(1, vocab, (steps, batch), generator=generator)
    picks = torch.randint(0, MARKOV_SUCCESSORS, (steps, batch, seqlen), generator=generator)
    for t in range(1, seqlen):
        tokens[:, :, t] = successors[tokens[:, :, t - 1], picks[:, :, t]]
    return tokens
