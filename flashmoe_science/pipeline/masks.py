"""The attention mask as counts, without torch (the report reads them too): which keys a query sees
under the API's bottom-right alignment, and how many (query, key) pairs a mask lets through."""

from __future__ import annotations


def visible_pairs(
    seqlen_q: int, seqlen_k: int, causal: bool, window: tuple[int, int] = (-1, -1)
) -> int:
    """How many (query i, key j) pairs the mask lets through: query i sits at p = i + Sk - Sq
    (bottom-right) and sees keys j with p - left <= j <= p + right, 0 <= j < Sk
    (window_size=(left, right), -1 unbounded; causal sets right to 0). Causal with Sq == Sk gives
    S(S+1)/2; a causal window of left W-1 gives W keys a row once the row is W deep."""
    left, right = window
    if causal:
        right = 0
    total = 0
    for i in range(seqlen_q):
        p = i + seqlen_k - seqlen_q
        low = 0 if left < 0 else max(0, p - left)
        high = seqlen_k - 1 if right < 0 else min(seqlen_k - 1, p + right)
        total += max(0, high - low + 1)
    return total
