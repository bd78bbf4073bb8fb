"""The tile configuration the CUDA operator picks by itself for a dense call on an H100 (132 SMs)
with the sm_90a build: the GQA packing of run_forward and choose_config in
csrc/flash_api_cuda.cuh, restated for the tests of cases that count on that choice. Keep the two
in step."""

from __future__ import annotations

from flashmoe_science.pipeline.cases import Case

H100_SMS = 132
DECODE_CONFIG, WGMMA_CONFIG = 3, 5


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def h100_automatic_config(case: Case) -> int:
    """config=0's choice for this prefill or decode case on an H100 with the sm_90a build."""
    ratio = case.heads_q // case.heads_kv
    pack_gqa = ratio > 1 and case.seqlen_q * ratio <= 128
    rows_per_head = case.seqlen_q * (ratio if pack_gqa else 1)
    heads = case.batch * (case.heads_kv if pack_gqa else case.heads_q)
    if rows_per_head <= 16 or heads * _ceil_div(rows_per_head, 64) < H100_SMS:
        return DECODE_CONFIG
    if rows_per_head <= 64 or heads * _ceil_div(rows_per_head, 128) < H100_SMS:
        return 2
    return WGMMA_CONFIG
