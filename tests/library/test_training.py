"""A short training run: a small causal attention model on random tokens, 100 Adam steps with our
attention and with PyTorch's SDPA from the same initialisation and data; the final losses must
agree within 1%. It fails if any gradient is wrong enough to change what the model learns."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flashmoe_science.pipeline.gates.plugin import TRAINING

STEPS = 100
VOCAB, DIM, HEADS, KV_HEADS, LAYERS, SEQ, BATCH = 256, 256, 4, 2, 2, 256, 8


class Block(nn.Module):
    def __init__(self, attention):
        super().__init__()
        self.attention = attention
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.head_dim = DIM // HEADS
        self.q = nn.Linear(DIM, DIM, bias=False)
        self.kv = nn.Linear(DIM, 2 * KV_HEADS * self.head_dim, bias=False)
        self.out = nn.Linear(DIM, DIM, bias=False)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x):
        b, s, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, s, HEADS, self.head_dim).transpose(1, 2)
        k, v = self.kv(h).view(b, s, 2, KV_HEADS, self.head_dim).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        a = self.attention(*(t.to(torch.bfloat16) for t in (q, k, v))).float()
        x = x + self.out(a.transpose(1, 2).reshape(b, s, DIM))
        return x + self.mlp(self.norm2(x))


def ours(q, k, v):
    from flashmoe_science import flash_attention_forward

    return flash_attention_forward(q, k, v, causal=True)


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def train(attention, device: str) -> list[float]:
    torch.manual_seed(0)
    embed = nn.Embedding(VOCAB, DIM)
    blocks = nn.Sequential(*(Block(attention) for _ in range(LAYERS)))
    head = nn.Linear(DIM, VOCAB)
    model = nn.ModuleList([embed, blocks, head]).to(device)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    tokens = tokens.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    losses = []
    for _ in range(STEPS):
        logits = head(blocks(embed(tokens[:, :-1])))
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.gpu
def test_training_with_our_attention_matches_sdpa(has_cuda_kernels, record_property):
    if not has_cuda_kernels:
        pytest.fail("a GPU is visible but the build has no CUDA kernels: run `nox -s build`")
    ours_losses = train(ours, "cuda")
    sdpa_losses = train(sdpa, "cuda")
    summary = {
        "ours": [ours_losses[0], ours_losses[-1]],
        "sdpa": [sdpa_losses[0], sdpa_losses[-1]],
    }
    record_property(TRAINING, summary)  # gates.json and the test stage's verdict carry it
    print(f"training losses (first, last): {summary}")
    assert math.isclose(ours_losses[0], sdpa_losses[0], rel_tol=1e-2)
    assert ours_losses[-1] < 0.8 * ours_losses[0], "the model did not learn"
    assert math.isclose(ours_losses[-1], sdpa_losses[-1], rel_tol=1e-2), summary
