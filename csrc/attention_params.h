// The one plain struct that carries shapes, strides and pointers from the host API into the kernels
// (CPU and CUDA alike), and the split-count heuristic both backends share.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#ifdef __CUDACC__
#define FLASHMOE_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FLASHMOE_HOST_DEVICE inline
#endif

namespace flashmoe {

// Planted bugs, compiled in only when a test asks for them (-DFLASHMOE_PLANT_BUG=N), so the test
// suite can prove that the gates catch the bugs a split-KV implementation typically has.
//   1: off-by-one split boundary (every split but the first skips its first key)
//   2: the combine step counts split 0 twice
//   3: load_kv reads the KV rows past the sequence end out of bounds (compute-sanitizer's memcheck
//      must report it: `python -m flashmoe_science sanitize --tool memcheck --define ...`)
// and the bugs a backward pass typically has:
//   4: dS without the softmax scale (dQ and dK come out scale times too large)
//   5: dK and dV keep the share of the first query head of a GQA group only (not summed)
//   6: dQ skips the last key block of each row
// and the bugs ragged batches and paged caches typically have:
//   7: varlen reads one key past each sequence's end (its offsets run one row long)
//   8: the paged lookup ignores the block table (logical page i is read from physical page i)
// and the sm_90a (wgmma) kernel's own:
//   9: a math warpgroup skips one mbarrier wait for its K tile
//   10: K read with the wrong (64-byte) swizzle
//   11: the last, partial key tile never copied
//   12: the output never rescaled when the online softmax's running max moves (only scores
//       that keep growing along the keys, the gates' -rising / -falling cases, show it)
// and the bug of v's head dim differing from q's and k's (Dv != Dqk):
//   13: the CPU forward finds each KV head's V rows at K's offset (the Q/K width, Dqk), as one
//       offset shared by K and V would (wrapped to stay inside V)
// and the bugs of head dims padded onto a wider CUDA tile (80 and 96 on 128, v's 128 under 192):
//   14: the mma.sync forward copies q and k at the tile's width: the tile's columns past their
//       head dim hold the next row's values instead of zeros, which leak into the scores
//   15: the backward's delta (rowsum dO * O) is summed over q's and k's head dim, not v's: it
//       reads past each row of o and dout where v's head dim is the smaller
// and the wgmma forward's past head dim 128:
//   16: P V issued as m64n128k16 at head dims 192 and 256: O's columns past 128 never accumulate
// and the wgmma forward's of v narrower than q and k:
//   17: P V reads its V from K's buffers where v's head dim is 128 under q's and k's 192
// and the wgmma forward's 128 tile run padded (Sm90PaddedTraits):
//   18: each panel's TMA box copied from the first panel's columns (its column coordinate left
//       at 0): the tile's columns past 64 hold q's and k's first columns, not theirs or zeros
// and the wgmma backward's 128 tile run padded (Sm90BwdPaddedTraits):
//   19: q, k, v and dO copied at the tile's width: the tile's columns past their head dims hold
//       the next row's values instead of zeros, which leak into S, dP and every gradient
// and the wgmma forward's padded 128 tile with its MMAs over 96 columns (Sm90PaddedTraits<...,
// 96>):
//   26: with its MMAs over 96 columns (head dims up to 96), S's last 16-column step reads columns
//       96-111 (zeros) in place of 80-95: a head dim of 96 loses them, one of 80 has none there
// and the bugs of local attention, soft-capping and sinks (the CPU implementation's, and the CUDA
// kernels': 20 in every mma.sync and decode kernel, forward and backward; 21 in the forward and
// decode; 22 in the backward's pre-pass; 23 in the decode kernel, which forgets the left edge):
//   20: the window's left edge off by one (a query sees one key too few: j > p - window_left)
//   21: softcap applied after the mask, so a masked key's -inf score becomes -softcap and the key
//       is attended to (forward)
//   22: the sinks' gradient never accumulated (dsinks comes back 0)
//   23: decode (flash_attention_decode, paged or not) forgets the window
// and the wgmma backward's past head dim 128 (Sm90BwdWideTraits):
//   25: every tile of dK^T reads Q's first 64-column panel: dK's columns past 64 come out wrong
// and the wgmma forward's plain instantiation, which sinks alone run (has_score_features):
//   27: its rows' epilogue leaves the sinks out (one split: their normaliser and lse lack them)
// and the wgmma backward's padded 128 tile with its products over 96 columns
// (Sm90BwdPadded96Traits, FLASHMOE_BWD_WS_MMA96):
//   28: S^T's last 16-column step reads columns 96-111 (zeros) in place of 80-95: a head dim of
//       96 loses them, one of 80 has none there
// and the wgmma backward past head dim 128 with Q and dO copied by TMA (FLASHMOE_BWD_WIDE_TMA):
//   29: a step does not wait for its Q and dO copy, which it issues only after its S and dP
//       products have read the buffers: they read the tiles of two steps before (or nothing)
// -DFLASHMOE_PLANT_BUG=-1 compiles every plant in and picks one at run time, from
// $FLASHMOE_PLANT_BUG: the CPU implementation's (1, 2, 4-8, 13, 20-23) when the library loads, the
// CUDA kernels' (planted in flash_kernel_utils.cuh) before their first launch on a device. One
// build serves all of the plant tests of a device.
#ifndef FLASHMOE_PLANT_BUG
#define FLASHMOE_PLANT_BUG 0
#endif
// The wgmma backward's dQ staged in shared memory and added by TMA reduce-add instead of per-thread
// atomics: off unless built with -DFLASHMOE_BWD_DQ_TMA=1 (benches/notes/backward.md, bwd v4.2).
#ifndef FLASHMOE_BWD_DQ_TMA
#define FLASHMOE_BWD_DQ_TMA 0
#endif
// The wide wgmma backward's (head dims past 128) dQ the same way, staged in the step's Q and dO
// buffers: on, since per-thread atomics made the L2's reductions that kernel's bound (measured in
// benches/notes/backward.md, bwd v5.3 and v5.5); -DFLASHMOE_BWD_WIDE_DQ_TMA=0 for the atomics.
#ifndef FLASHMOE_BWD_WIDE_DQ_TMA
#define FLASHMOE_BWD_WIDE_DQ_TMA 1
#endif
// The wgmma backward's per-row lse and delta copied by cp.async with the step's tiles instead of
// loaded and stored by the first warpgroup: off unless -DFLASHMOE_BWD_STATS_CP_ASYNC=1 (bwd v4.3).
#ifndef FLASHMOE_BWD_STATS_CP_ASYNC
#define FLASHMOE_BWD_STATS_CP_ASYNC 0
#endif
// The wgmma backward's 128 tile warp-specialized (Sm90BwdWsTraits: a producer warpgroup copies Q
// and dO by TMA, loads lse and delta and adds dQ by TMA reduce-add; benches/notes/backward.md,
// bwd v6). FLASHMOE_BWD_WS=0 in the environment runs the tile before it (Sm90BwdTraits);
// -DFLASHMOE_BWD_WS=0 leaves it out of the build.
#ifndef FLASHMOE_BWD_WS
#define FLASHMOE_BWD_WS 1
#endif
// Its dQ tiles staged in one slot a math warpgroup, or two (-DFLASHMOE_BWD_WS_DQ_STAGES=2: the
// math runs a step ahead of the writer, which waits on deterministic=True's order; 32 KB more
// shared memory), until the two are timed against each other on a GPU.
#ifndef FLASHMOE_BWD_WS_DQ_STAGES
#define FLASHMOE_BWD_WS_DQ_STAGES 1
#endif
// The registers its producer warpgroup keeps (32 or 24; the math warpgroups get 232 or 240): with
// 32 no kernel of the tile spills (ptxas, sm_90a), with 24 the deterministic writer spills (68 B
// at d=64) and the 128 tile 8 B.
#ifndef FLASHMOE_BWD_WS_PRODUCER_REGS
#define FLASHMOE_BWD_WS_PRODUCER_REGS 32
#endif
// The dQ tile's stores into shared memory with the odd rows' column tiles swapped in pairs
// (nt ^ 2), so that a half-warp's eight float2 chunks land on distinct banks under the 128-byte
// swizzle (one wavefront a half-warp, not two). With the 32 registers above: 2-8% faster on 24
// bf16 backward cases, H100 (benches/notes/backward.md, bwd v6d); =0 is the plain order.
#ifndef FLASHMOE_BWD_DQ_STORE_SWAP
#define FLASHMOE_BWD_DQ_STORE_SWAP 1
#endif
// The warp-specialized tile's dK product issued after dQ's (FlashAttention-3's order) on the
// 128-column tile: dQ's tile goes to shared memory while dK runs on the tensor cores, and the
// step's Q and dO go back once dK is done (benches/notes/backward.md, bwd v7a: 2-6% at d=128).
// Off until the gate matrix passes with it on a GPU (bwd v7a-v7c measured together).
#ifndef FLASHMOE_BWD_DK_AFTER_DQ
#define FLASHMOE_BWD_DK_AFTER_DQ 0
#endif
// The warp-specialized tile's causal calls on a 1-D grid, longest first, at head dims past 64
// and 2,048 keys or more (where it was measured faster; FLASHMOE_BWD_LPT_PAIRS forces it on any
// causal call): in sections of (batch, KV head) pairs whose q, dout and dq_accum fit in 40 MB of
// L2 (BwdParams::lpt_pairs), each section's key blocks from the first (the longest walk under the
// mask), so that the last blocks to start are short ones (backward.md, bwd v7b); the wide
// kernel's too with -DFLASHMOE_BWD_WIDE_LPT=1. -DFLASHMOE_BWD_CAUSAL_LPT=0 is the 2-D grid on every
// call.
#ifndef FLASHMOE_BWD_CAUSAL_LPT
#define FLASHMOE_BWD_CAUSAL_LPT 1
#endif
// deterministic=True on the warp-specialized tile without a mask (no causal edge, no window):
// each key block starts its walk at its own query block, rotated by its launch position
// (BwdParams::dq_rotate), and dQ is added to a query block in the order the blocks reach it, so
// that in a pair's lockstep no block waits on another's add to the block it is at; the walk from
// query block 0 makes key block n wait for the n blocks launched before it at every query block
// (backward.md, bwd v5.11). Off until timed and gated on a GPU.
#ifndef FLASHMOE_BWD_DET_ROTATE
#define FLASHMOE_BWD_DET_ROTATE 0
#endif
// The warp-specialized tile run padded at head dims up to 96 (q's, k's and v's) with its
// products over the head dim spanning 96 of its 128 columns (Sm90BwdPadded96Traits): S^T's and
// dP^T's reductions and dV's and dK's widths; dQ's stay 64 a warpgroup (backward.md, bwd v7c:
// 8-14% at d=96). -DFLASHMOE_BWD_WS_MMA96=0 runs them over all 128.
#ifndef FLASHMOE_BWD_WS_MMA96
#define FLASHMOE_BWD_WS_MMA96 1
#endif
// The wgmma backward past head dim 128 (Sm90BwdWideTraits) copying each step's Q and dO by TMA
// (one thread, an mbarrier a buffer; the maps of the warp-specialized tile's tma_q and tma_do)
// instead of cp.async by all 256 threads, whose address arithmetic was about a quarter of its main
// loop's instructions (benches/notes/backward.md, bwd v5.9). Off until the gates and a bench pass
// with it on a GPU; it needs FLASHMOE_BWD_WS (the maps).
#ifndef FLASHMOE_BWD_WIDE_TMA
#define FLASHMOE_BWD_WIDE_TMA 0
#endif
#define FLASHMOE_BWD_WIDE_QDO_TMA (FLASHMOE_BWD_WIDE_TMA && FLASHMOE_BWD_WS)
// The wide wgmma backward's next step's S and dP issued under this step's dQ chunks, where its
// accumulators leave room (d=192 and (192, 128)) and Q and dO come by TMA: off unless
// -DFLASHMOE_BWD_WIDE_PIPE=1 (benches/notes/backward.md, bwd v5.12; unmeasured).
#ifndef FLASHMOE_BWD_WIDE_PIPE
#define FLASHMOE_BWD_WIDE_PIPE 0
#endif
#define FLASHMOE_BWD_WIDE_PIPE_ON \
  (FLASHMOE_BWD_WIDE_PIPE && FLASHMOE_BWD_WIDE_QDO_TMA && FLASHMOE_BWD_WIDE_DQ_TMA)
// The wide wgmma backward's causal calls on FLASHMOE_BWD_CAUSAL_LPT's longest-first 1-D grid (from
// 2,048 keys, in L2-sized sections of pairs), as the 128 tile's: off unless
// -DFLASHMOE_BWD_WIDE_LPT=1 (benches/notes/backward.md, bwd v5.13; unmeasured).
#ifndef FLASHMOE_BWD_WIDE_LPT
#define FLASHMOE_BWD_WIDE_LPT 0
#endif
#define FLASHMOE_BWD_WIDE_LPT_ON \
  (FLASHMOE_BWD_WIDE_LPT && FLASHMOE_BWD_CAUSAL_LPT && FLASHMOE_BWD_WS)
#define FLASHMOE_BWD_DQ_MAP (FLASHMOE_BWD_DQ_TMA || FLASHMOE_BWD_WIDE_DQ_TMA || FLASHMOE_BWD_WS)
// The wgmma forward's softmax with a softcap in bf16 subtracting a fixed max of 0 instead of the
// running row max: off unless built with -DFLASHMOE_FWD_SOFTCAP_FIXED_MAX=1 (an experiment:
// benches/notes/features.md, fv4).
#ifndef FLASHMOE_FWD_SOFTCAP_FIXED_MAX
#define FLASHMOE_FWD_SOFTCAP_FIXED_MAX 0
#endif

constexpr int kMaxSplits = 128;
// Backward tile configurations (`backward_config=`): see csrc/flash_api_cuda.cuh.
constexpr int kNumBwdConfigs = 3;

struct AttentionParams {
  // q, k: [B, Hq or Hkv, Sq or Sk(max), D]; v: [B, Hkv, Sk(max), Dv]; only the last dimension must
  // be contiguous.
  const void* q;
  const void* k;
  const void* v;
  void* o;     // [B, Hq, Sq, Dv], written in the input dtype (unsplit path)
  float* lse;  // [B, Hq, Sq], contiguous
  int64_t q_batch_stride, q_head_stride, q_row_stride;
  int64_t k_batch_stride, k_head_stride, k_row_stride;
  int64_t v_batch_stride, v_head_stride, v_row_stride;
  int64_t o_batch_stride, o_head_stride, o_row_stride;

  int batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim;
  int heads_ratio;  // heads_q / heads_kv
  // Fold the query heads that share a KV head into the rows of one tile, so each K and V byte is
  // read once per KV head (the rows of a tile are then (query, head-in-group) pairs).
  bool pack_gqa;
  // Launch order of the row blocks (TileCoords): false = heads fastest, row blocks of all heads
  // heavy-first; true = the row blocks of one head side by side (they share K and V in L2).
  bool row_blocks_fastest;
  const int* seqlens_k;  // [B] valid KV length per sequence, or nullptr (all of seqlen_k)
  // Decode kernel only: each K and V byte is read once (one row tile per KV head), so it streams
  // through L2 evict-first (see the host API for when).
  bool kv_evict_first;

  bool causal;  // bottom-right aligned: query i sees keys j <= i + len_k - seqlen_q
  float softmax_scale;
  float scale_log2;  // softmax_scale * log2(e): exp(x * scale) == exp2(x * scale_log2)

  // Split-KV: each split owns n_blocks_per_split KV blocks and writes a normalised fp32 partial
  // output and its log-sum-exp; split_kv_combine reduces them. num_splits == 1 writes o directly.
  int num_splits;
  int n_blocks_per_split;
  float* o_accum;    // [num_splits, B, Hq, Sq, Dv] contiguous
  float* lse_accum;  // [num_splits, B, Hq, Sq] contiguous
  // Decode kernel only: one arrival counter per row tile, zero between launches; the last split of
  // a tile to arrive combines the partials and resets its counter.
  int* split_counters;

  // Variable length (packed) batches, FlashAttention's layout: q [total_q, Hq, D], k and v
  // [total_k, Hkv, D], o [total_q, Hq, D], lse [Hq, total_q]; sequence b owns rows
  // [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q and o and the same of k and v through cu_seqlens_k.
  // seqlen_q and seqlen_k are then the longest sequence (they size the grid) and the batch strides
  // are 0. Null when the batch is dense.
  const int* cu_seqlens_q;
  const int* cu_seqlens_k;
  int total_q, total_k;  // rows of the packed tensors: the kernels clamp offsets into them

  // Paged KV cache (decode kernel only), FlashAttention's layout: k and v [num_pages, page_size,
  // Hkv, D], the batch stride being the page stride; block_table [B, max_pages_per_seq] maps
  // sequence b's logical page i to a physical page. seqlen_k is then the capacity
  // max_pages_per_seq * page_size. Null when the cache is contiguous.
  const int* block_table;
  int64_t block_table_stride;  // elements between two sequences' rows of block_table
  int page_shift;              // log2(page_size): page sizes are powers of two
  int num_pages;               // the kernel clamps physical pages into [0, num_pages)

  // The sm_90a warp-specialized kernel: with `tma` set, its producer copies K and V tiles with the
  // tensor memory accelerator through these maps (CUtensorMap objects the host encodes); without,
  // with cp.async. With `q_tma` set too, it copies each tile's Q the same way (a dense batch whose
  // tile rows are one head's queries: not packed GQA, not a packed batch). Zero everywhere else.
  alignas(64) unsigned char tma_k[128];
  alignas(64) unsigned char tma_v[128];
  bool tma;
  alignas(64) unsigned char tma_q[128];  // after `tma`: the d=64 kernels' parameter offsets stay
  bool q_tma;

  // v's last dimension, the output's (Dv; head_dim is q's and k's, Dqk). Last, so the fields the
  // kernels read keep their offsets.
  int head_dim_v;

  // Local attention, soft-capping and sinks, FlashAttention's conventions (resolve_window): query
  // i of a sequence of len_k keys sits at p = i + len_k - seqlen_q and sees keys j with
  // p - window_left <= j <= p + window_right, -1 unbounded on that side; causal is
  // window_right = 0 and sets `causal` too. softcap > 0 turns each scaled score s into
  // softcap * tanh(s / softcap) before the mask and the softmax. sinks (fp32 [Hq], or null) adds
  // exp(sinks[h]) to every row's softmax denominator, with no value. After every field the
  // kernels read. Every CUDA kernel takes them (the wgmma forward's in an instantiation of their
  // own: fwd_sm90_kernel); with softcap > 0 the host sets softcap_scale = softmax_scale / softcap
  // and the softmax's scale to softcap (the kernels keep tanh(s * softcap_scale): apply_softcap).
  int window_left, window_right;
  float softcap;
  const float* sinks;
  float softcap_scale;
};

// The backward pass: gradients of out = softmax(q k^T * scale) v with respect to q, k and v, given
// dout and the forward's out and log-sum-exp. Same layouts as the forward; only the last dimension
// of each tensor must be contiguous.
struct BwdParams {
  const void* q;
  const void* k;
  const void* v;
  const void* o;     // the forward's output
  const void* dout;  // [B, Hq, Sq, Dv]
  const float* lse;  // [B, Hq, Sq] at lse_*_stride: the forward's log-sum-exp (-inf: saw no key)
  float* delta;      // [B, Hq, Sq] contiguous: rowsum(dout * o), written by the CUDA pre-pass
  float* lse2;       // [B, Hq, Sq] contiguous: the pre-pass's copy of lse in base 2 (+inf: no key)
  float* dq_accum;   // [B, Hq, Sq, D] contiguous fp32: dS K summed over key blocks, unscaled
  void* dq;          // [B, Hq, Sq, D] contiguous, the input dtype
  void* dk;          // [B, Hkv, Sk, D] contiguous
  void* dv;          // [B, Hkv, Sk, Dv] contiguous
  int64_t q_batch_stride, q_head_stride, q_row_stride;
  int64_t k_batch_stride, k_head_stride, k_row_stride;
  int64_t v_batch_stride, v_head_stride, v_row_stride;
  int64_t o_batch_stride, o_head_stride, o_row_stride;
  int64_t do_batch_stride, do_head_stride, do_row_stride;
  int64_t lse_batch_stride, lse_head_stride, lse_row_stride;

  int batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim;
  int heads_ratio;  // heads_q / heads_kv: dK and dV sum over the query heads of a group
  bool causal;      // bottom-right aligned, as in the forward
  // v's, o's, dout's and dv's last dimension (Dv; head_dim is q's, k's, dq's and dk's), in the
  // padding after `causal`: the struct keeps its size and offsets, and so do the parameters some
  // kernels take after it. Below 2^15 (check_backward_inputs).
  int16_t head_dim_v;
  float softmax_scale;
  float scale_log2;  // softmax_scale * log2(e)

  // The forward's window, softcap and sinks (AttentionParams); dsinks: fp32 [B, Hq], each
  // sequence's share of the sinks' gradient, -sum over its rows i of exp(sinks[h] - lse_i) *
  // delta_i (null without sinks); on CUDA [B, Hq, Sq], each row's term, summed by the host. With
  // softcap > 0 the CUDA host sets softcap_scale = softmax_scale / softcap and scale_log2 to
  // softcap * log2(e) (P from t = tanh(s * softcap_scale): apply_softcap), softmax_scale staying
  // the gradients'. After every field the kernels read.
  int window_left, window_right;
  float softcap;
  const float* sinks;
  float* dsinks;
  float softcap_scale;
#if FLASHMOE_BWD_DQ_MAP
  // The wgmma backward's dQ by TMA reduce-add (FLASHMOE_BWD_WIDE_DQ_TMA, FLASHMOE_BWD_DQ_TMA):
  // the 3-D map {head dim columns, Sq rows, B * Hq} of dq_accum, boxes {32, 64, 1}.
  alignas(64) unsigned char dq_map[128];
#endif
#if FLASHMOE_BWD_WS
  // The warp-specialized 128 tile's 5-D maps of q and dout (encode_kv_map, boxes of the step's
  // rows); ws: the host encoded them and dq_map, so that tile runs. dq_order (deterministic
  // calls on it): one counter a (batch, query head, query block of the tile's rows), zeroed, of
  // the key blocks whose dQ has been added to that block, which the key blocks add in a fixed
  // order (the last first).
  alignas(64) unsigned char tma_q[128];
  alignas(64) unsigned char tma_do[128];
  int* dq_order;
  int dq_order_rows;  // the query rows a counter of dq_order stands for (the tile's)
#if FLASHMOE_BWD_DET_ROTATE
  // dq_order's key blocks walk rotated (every key block sees every query block, and a pair's
  // key blocks fit the GPU at once, so none waits on a block that cannot start)
  bool dq_rotate;
#endif
  bool ws;
#if FLASHMOE_BWD_WIDE_QDO_TMA
  bool wide_tma;  // the wide kernel's q and dout maps (boxes of its 64 query rows) encoded
#endif
#if FLASHMOE_BWD_CAUSAL_LPT
  // non-deterministic causal calls on the tile (and the wide kernel under FLASHMOE_BWD_WIDE_LPT):
  // the (batch, KV head) pairs a section of its 1-D grid (at most the call's pairs); 0: the
  // (key block, batch x KV head) grid
  int lpt_pairs;
#endif
#endif
};

FLASHMOE_HOST_DEVICE int ceil_div(int a, int b) { return (a + b - 1) / b; }

// A call's mask, FlashAttention's way: causal sets the window's right side to 0, and a right side
// of 0 is the causal mask whatever `causal` said. `local` when the window bounds a side beyond
// what causal does (a left edge, or keys to the right of the query's position).
struct Window {
  bool causal;
  int left, right;  // -1: unbounded
  bool local() const { return left >= 0 || right > 0; }
};

inline Window resolve_window(bool causal, int64_t left, int64_t right) {
  if (causal) right = 0;
  return {right == 0, int(left), int(right)};
}

// FlashAttention's wave-efficiency rule: split only when the grid does not fill the machine, and
// then take the smallest split count whose last wave is at least 85% as full as the best one.
inline int num_splits_heuristic(int blocks_without_split, int num_units, int num_n_blocks,
                                int max_splits) {
  if (blocks_without_split >= 0.8f * num_units) return 1;
  max_splits = std::min({max_splits, num_units, num_n_blocks});
  if (max_splits <= 1) return 1;
  auto eligible = [&](int s) {
    return s == 1 || ceil_div(num_n_blocks, s) != ceil_div(num_n_blocks, s - 1);
  };
  std::vector<float> efficiency(max_splits + 1, 0.f);
  float best = 0.f;
  for (int s = 1; s <= max_splits; ++s) {
    if (!eligible(s)) continue;
    const float waves = float(blocks_without_split) * s / num_units;
    efficiency[s] = waves / std::ceil(waves);
    best = std::max(best, efficiency[s]);
  }
  for (int s = 1; s <= max_splits; ++s) {
    if (eligible(s) && efficiency[s] >= 0.85f * best) return s;
  }
  return 1;
}

// Decode's split count for a grid of `tiles` (batch x KV heads) with `n_blocks` key blocks each,
// one block per SM: the count that minimises waves x (key blocks of the longest split +
// kSplitCost), the fewest splits on a tie. The longest split is what the wave waits for, so 256
// blocks in 16 splits of 16 beat 15 of up to 18 (the wave-efficiency rule's pick); kSplitCost is
// the epilogue's fixed cost (partials, arrival, combine: about two blocks' worth at the copy
// rate). Splits keep at least 4 blocks (256 keys): shorter ones lose more to the pipeline's fill
// and the combine than they gain. A grid that already fills the machine is not split, unless it
// runs more than two waves of long streams: those take four splits. The forced split counts
// behind these rules: benches/notes/decode.md (v4.0, v4.7).
inline int decode_num_splits(int tiles, int sm_count, int n_blocks) {
  constexpr int kSplitCost = 2;
  if (tiles > 2 * sm_count && n_blocks >= 64) return 4;
  if (tiles >= 0.8f * sm_count) return 1;
  const int max_splits = std::min({kMaxSplits, sm_count, n_blocks / 4});
  int best = 1;
  int64_t best_cost = -1;
  for (int s = 1; s <= std::max(1, max_splits); ++s) {
    const int64_t waves = (int64_t(tiles) * s + sm_count - 1) / sm_count;
    const int64_t cost = waves * (ceil_div(n_blocks, s) + kSplitCost);
    if (best_cost < 0 || cost < best_cost) best = s, best_cost = cost;
  }
  return best;
}

}  // namespace flashmoe
