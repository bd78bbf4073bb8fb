// Split-KV decode kernel (flash-decoding): a few query rows against a long KV cache, read at the
// memory-bandwidth limit.
//
// The forward kernel gives each warp its own query rows and has every warp read all of K and V.
// With one to sixteen rows that leaves three of four warps computing on padding and a single K/V
// tile in flight per block. Here the block owns one 16-row tile (Sq x the query heads that share a
// KV head, packed), and its warps split the keys instead: warp w takes keys [16w, 16w + 16) of
// every stage (64 keys, 4 warps, up to d=128), keeps its own running max, sum and output, and the
// warps are reduced through shared memory at the end. K and V stream through a kStages-deep
// cp.async pipeline, so (kStages - 1) stages of K and V are in flight while one is computed.
//
// With num_splits > 1 each block writes its fp32 partial and log-sum-exp, and the last block of a
// tile to finish (an atomic counter per tile) combines all splits itself: no second launch.
//
// kPaged: the cache is paged (p.block_table, FlashAttention's [num_pages, page_size, Hkv, D]);
// every row of a K/V stage is found through the block table (load_kv_tiles_paged), the rest of
// the kernel is the same.
#pragma once

#include "attention_params.h"
#include "flash_kernel_utils.cuh"

namespace flashmoe::cuda {

// The decode's phase trace (`python -m flashmoe_science phases dec-...`, a build with
// FLASHMOE_PHASE_TRACE=1; flashmoe_science/pipeline/tools/decode_phases.py reads it by these
// numbers): thread 0 of each block stamps clock64 at each Mark into stamps[block][slot], the block
// being blockIdx.x + gridDim.x * blockIdx.y (the split); %globaltimer at its start and its end
// (which put the blocks on one time line and turn cycles into time), its SM, whether it combined
// the tile's splits, and the stages it read. Blocks past kBlocks are not recorded.
namespace decode_trace {
constexpr int kBlocks = 1024, kSlots = 12;
enum Mark { kStart, kFirstStage, kLastStage, kLoopDone, kReduced, kArrived, kCombined };
enum Slot { kTimerStart = 7, kTimerEnd, kSm, kCombiner, kStages };
#if FLASHMOE_PHASE_TRACE
__device__ long long stamps[kBlocks * kSlots];
__device__ __forceinline__ void put(int slot, long long value) {
  const int block = blockIdx.x + gridDim.x * blockIdx.y;
  if (threadIdx.x == 0 && block < kBlocks) stamps[block * kSlots + slot] = value;
}
__device__ __forceinline__ void stamp(Mark mark) { put(mark, clock64()); }
__device__ __forceinline__ void timer(Slot slot) { put(slot, global_timer_ns()); }
__device__ __forceinline__ void start(int stages) {
  timer(kTimerStart);
  stamp(kStart);
  unsigned sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  put(kSm, sm);
  put(kStages, stages);
}
__device__ __forceinline__ void end() { timer(kTimerEnd); }
#endif
}  // namespace decode_trace

template <int kHeadDim_, int kStages_>
struct DecodeTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kStages = kStages_;
  static constexpr int kBlockM = 16;  // one mma row tile
  // Keys a stage, 16 per warp: 64 (4 warps) up to d=128; wider rows take 32-key stages (2 warps),
  // so that enough of them fit 99 KB, an sm86/sm89 block's shared memory.
  static constexpr int kBlockN = kHeadDim <= 128 ? 64 : 32;
  static constexpr int kNWarps = kBlockN / 16;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kStageElems = 2 * kBlockN * kHeadDim;  // the K tile, then the V tile
  // Shared memory is the stages alone: Q is staged in the last stage's buffer (free until the
  // main loop's first refill), and the cross-warp reduction reuses the stages after the loop.
  static constexpr int kSmemBytes = kStages * kStageElems * 2;
  // fp32 row stride of the reduction scratch, padded by 8 floats so the 8 rows one store
  // instruction touches fall in different banks.
  static constexpr int kScratchStride = kHeadDim + 8;
  static constexpr int kScratchBytes =
      (kNWarps * kBlockM * kScratchStride + 2 * kNWarps * kBlockM) * 4;
  static_assert(kStages >= 2, "a pipeline needs two stages");
  static_assert(kHeadDim % 64 == 0, "head_dim must fit the mma and swizzle");
  static_assert(kBlockM * kHeadDim <= kStageElems, "Q must fit in one stage");
  static_assert(kScratchBytes <= kSmemBytes, "the reduction must fit in the stages");
};

template <typename Traits, typename T, bool kPaged>
__device__ __forceinline__ void flash_decode_block(const AttentionParams& p) {
  constexpr int D = Traits::kHeadDim, BM = Traits::kBlockM, BN = Traits::kBlockN;
  constexpr int kStages = Traits::kStages, kThreads = Traits::kNThreads;
  constexpr int KT = D / 16, DT = D / 8;
  constexpr int kWarpKeys = BN / Traits::kNWarps;
  constexpr int kThreadsPerRow = kThreads / BM, kCols = D / kThreadsPerRow;  // final write-out
  static_assert(kWarpKeys == 16, "each warp owns one 16-key slice of a stage");

  extern __shared__ __align__(256) uint4 smem_buf[];  // swizzle_step needs 256-byte alignment
  T* smem = reinterpret_cast<T*>(smem_buf);
  auto stage_k = [&](int s) { return smem + s * Traits::kStageElems; };
  auto stage_v = [&](int s) { return smem + s * Traits::kStageElems + BN * D; };
  T* sQ = stage_k(kStages - 1);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const TileCoords t = TileCoords::of_block<BM>(p);
  const int b = t.b, hkv = t.hkv, len_k = t.len_k, split = t.split;
  const int m0 = t.m_block * BM;
  auto row_query = [&](int r) { return t.query(r); };
  auto row_head = [&](int r) { return t.head(r); };

  // The stages this split visits: those of some row's window (query row i sees keys
  // j <= i + len_k - seqlen_q when causal; a window's left edge skips the stages below it).
  const int i_first = row_query(m0), i_last = row_query(min(m0 + BM, t.rows_total) - 1);
  const int offset = len_k - p.seqlen_q;
  const int n_block_max = t.kv_block_end<BM, BN>(p, m0);
  // planted 23: decode forgets the window's left edge
  const int n_lo =
      (planted(23) ? 0 : window_first_block<BN>(p, i_first, offset)) + split * p.n_blocks_per_split;
  const int n_iters = max(0, min(n_block_max, n_lo + p.n_blocks_per_split) - n_lo);
  FLASHMOE_PHASE(decode_trace::start(n_iters);)
  const int key_begin = planted(1) && split > 0 ? n_lo * BN + 1 : 0;  // planted 1

  // A paged cache's batch stride is its page stride: the sequence is found through its row of the
  // block table instead.
  const int64_t kv_batch = kPaged ? 0 : b;
  const T* k_base =
      static_cast<const T*>(p.k) + kv_batch * p.k_batch_stride + hkv * p.k_head_stride;
  const T* v_base =
      static_cast<const T*>(p.v) + kv_batch * p.v_batch_stride + hkv * p.v_head_stride;
  const L2Policy l2{p.kv_evict_first ? l2_policy_evict_first() : l2_policy_evict_normal()};
  int bad_page = 0;  // a block-table entry outside the cache was met (the load clamps it)
  auto load_stage = [&](int it) {
    const int s = it % kStages, row0 = (n_lo + it) * BN;
    if constexpr (kPaged) {
      load_kv_tiles_paged<D, BN, kThreads>(stage_k(s), stage_v(s), k_base, v_base, p,
                                           p.block_table + b * p.block_table_stride, row0, len_k,
                                           tid, bad_page, l2);
    } else {
      load_kv_tile<D, BN, kThreads>(stage_k(s), k_base, p.k_row_stride, row0, len_k, p.head_dim / 8,
                                    tid, l2);
      load_kv_tile<D, BN, kThreads>(stage_v(s), v_base, p.v_row_stride, row0, len_k,
                                    p.head_dim_v / 8, tid, l2);
    }
  };

  // Prologue: Q and stages 0 .. kStages-2 in flight; one commit group per stage (empty ones too,
  // so the wait counts below hold however few stages this split has).
  t.load_q<D, BM, kThreads>(sQ, p, m0, tid);
#pragma unroll
  for (int it = 0; it < kStages - 1; ++it) {
    if (it < n_iters) load_stage(it);
    cp_async_commit();
  }
  cp_async_wait<kStages - 2>();
  __syncthreads();
  FLASHMOE_PHASE(decode_trace::stamp(decode_trace::kFirstStage);)
  uint32_t q_frag[KT][4];  // Q stays in registers: every warp multiplies the same 16 rows
  const uint32_t q_addr = smem_u32(sQ + swizzle<D>(lane & 15, lane >> 4));
#pragma unroll
  for (int kk = 0; kk < KT; ++kk)
    ldmatrix_x4(q_frag[kk], swizzle_step<D>(q_addr, 0, kk));
  // ldmatrix base addresses in stage 0 (see swizzle_step): K as the B operand of S, V transposed
  // as the B operand of P V; a stage is kStageElems further.
  const uint32_t k_addr =
      smem_u32(stage_k(0) + swizzle<D>((lane & 7) + (lane >> 4) * 8, (lane >> 3) & 1));
  const uint32_t v_addr =
      smem_u32(stage_v(0) + swizzle<D>((lane & 7) + ((lane >> 3) & 1) * 8, lane >> 4));

  int my_query[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh)
    my_query[hh] = row_query(m0 + lane / 4 + hh * 8);
  float acc_o[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      acc_o[dt][e] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};

  for (int it = 0; it < n_iters; ++it) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // stage `it` has landed, and every warp is done with the buffer refilled next
    FLASHMOE_PHASE(if (it == n_iters - 1) decode_trace::stamp(decode_trace::kLastStage);)
    if (it + kStages - 1 < n_iters) load_stage(it + kStages - 1);
    cp_async_commit();

    const uint32_t stage_bytes = (it % kStages) * Traits::kStageElems * 2;
    const int key0 = (n_lo + it) * BN + warp * kWarpKeys;

    // S = Q K^T for this warp's 16 keys.
    float acc_s[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        acc_s[nt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KT; ++kk) {
      uint32_t bk[4];
      ldmatrix_x4(bk, swizzle_step<D>(k_addr + stage_bytes, warp, kk));
      mma_16816<T>(acc_s[0], q_frag[kk], bk[0], bk[1]);
      mma_16816<T>(acc_s[1], q_frag[kk], bk[2], bk[3]);
    }

    if (p.softcap > 0.f && !planted(21)) {
      apply_softcap(acc_s[0], p);
      apply_softcap(acc_s[1], p);
    }
    bool need_mask = key0 + kWarpKeys > window_key_end(p, i_first, offset, len_k) ||
                     (!planted(23) && key0 < window_first_key(p, i_last, offset));
    need_mask = need_mask || (planted(1) && key0 < key_begin);
    if (need_mask) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = key0 + nt * 8 + (lane & 3) * 2 + (e & 1);
          const int i = my_query[e >> 1];
          bool masked = col >= window_key_end(p, i, offset, len_k) ||
                        (!planted(23) && col < window_first_key(p, i, offset));
          masked = masked || (planted(1) && col < key_begin);
          if (masked) acc_s[nt][e] = -INFINITY;
        }
    }
    if (p.softcap > 0.f && planted(21)) {  // planted: after the mask, a masked key scores -softcap
      apply_softcap(acc_s[0], p);
      apply_softcap(acc_s[1], p);
    }

    // Online softmax over this warp's keys (base 2, scale folded in).
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float mx = row_max[hh];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
        mx = fmaxf(mx, fmaxf(acc_s[nt][2 * hh], acc_s[nt][2 * hh + 1]));
      mx = quad_max(mx);
      const float max_scaled = mx == -INFINITY ? 0.f : mx * p.scale_log2;
      const float rescale = exp2f(row_max[hh] * p.scale_log2 - max_scaled);
      row_max[hh] = mx;
      row_sum[hh] *= rescale;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        acc_o[dt][2 * hh] *= rescale;
        acc_o[dt][2 * hh + 1] *= rescale;
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 2 * hh; e < 2 * hh + 2; ++e) {
          const float prob = exp2f(fmaf(acc_s[nt][e], p.scale_log2, -max_scaled));
          acc_s[nt][e] = prob;
          row_sum[hh] += prob;
        }
    }

    // O += P V with P straight from the accumulators (the A operand of a 16x16 k-step).
    uint32_t a[4];
    a[0] = pack2<T>(acc_s[0][0], acc_s[0][1]);
    a[1] = pack2<T>(acc_s[0][2], acc_s[0][3]);
    a[2] = pack2<T>(acc_s[1][0], acc_s[1][1]);
    a[3] = pack2<T>(acc_s[1][2], acc_s[1][3]);
#pragma unroll
    for (int dp = 0; dp < KT; ++dp) {
      uint32_t bv[4];
      ldmatrix_x4_trans(bv, swizzle_step<D>(v_addr + stage_bytes, warp, dp));
      mma_16816<T>(acc_o[2 * dp], a, bv[0], bv[1]);
      mma_16816<T>(acc_o[2 * dp + 1], a, bv[2], bv[3]);
    }
  }
  // The block's coordinates after the loop: past d=128 recomputed from fresh reads of the block
  // index rather than held through the loop beside the wide accumulator (it spilled one).
  const TileCoords te =
      D > 128 ? TileCoords::of_block<BM>(p, opaque_block_x(), opaque_block_y()) : t;
  const int eb = te.b, em0 = te.m_block * BM, esplit = te.split;
  cp_async_wait<0>();
  // Every warp is done with the stages (they become the reduction scratch), and whether any thread
  // met a page outside the cache is known: a bad page or cache_seqlens value poisons the outputs.
  const bool poison = __syncthreads_or(bad_page) || te.bad_len;
  FLASHMOE_PHASE(decode_trace::stamp(decode_trace::kLoopDone);)

  // Reduce the warps in one exchange: each warp leaves its rows' max (log2 units), sum and
  // unnormalised output in shared memory; after one barrier each writer thread weighs the warps'
  // outputs of its row by exp2(max_w - max) and divides by the common sum. Only the tile's valid
  // rows are exchanged (Sq x the query heads of a KV head: 1 to 4 of the 16 in a typical decode).
  const int valid_rows = min(BM, te.rows_total - em0);
  float* scratch = reinterpret_cast<float*>(smem_buf);  // [warp][row][kScratchStride]
  float* warp_max = scratch + Traits::kNWarps * BM * Traits::kScratchStride;  // [warp][row]
  float* warp_sum = warp_max + Traits::kNWarps * BM;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int r = lane / 4 + hh * 8;
    row_sum[hh] = quad_sum(row_sum[hh]);
    if (r >= valid_rows) continue;
    if ((lane & 3) == 0) {
      warp_max[warp * BM + r] = row_max[hh] == -INFINITY ? -INFINITY : row_max[hh] * p.scale_log2;
      warp_sum[warp * BM + r] = row_sum[hh];
    }
    float* dst = scratch + (warp * BM + r) * Traits::kScratchStride + (lane & 3) * 2;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
      *reinterpret_cast<float2*>(dst + dt * 8) =
          make_float2(acc_o[dt][2 * hh], acc_o[dt][2 * hh + 1]);
  }
  __syncthreads();

  // Write-out: thread t owns columns [c0, c0 + kCols) of tile row t / kThreadsPerRow. The common
  // max and sum of its row over the warps (sum 0: no warp saw a key), and each warp's weight.
  const int r = tid / kThreadsPerRow, c0 = (tid % kThreadsPerRow) * kCols, gr = em0 + r;
  const bool row_valid = r < valid_rows;
  float mx = -INFINITY, sum = 0.f, weight[Traits::kNWarps];
#pragma unroll
  for (int w = 0; w < Traits::kNWarps; ++w)
    mx = row_valid ? fmaxf(mx, warp_max[w * BM + r]) : mx;
#pragma unroll
  for (int w = 0; w < Traits::kNWarps; ++w) {
    const float warp_rows_sum = row_valid ? warp_sum[w * BM + r] : 0.f;
    weight[w] = warp_rows_sum > 0.f ? exp2f(warp_max[w * BM + r] - mx) : 0.f;
    sum += warp_rows_sum * weight[w];
  }
  float out[kCols];
#pragma unroll
  for (int e = 0; e < kCols; ++e)
    out[e] = 0.f;
#pragma unroll
  for (int w = 0; w < Traits::kNWarps && row_valid; ++w) {
    const float* src = scratch + (w * BM + r) * Traits::kScratchStride + c0;
#pragma unroll
    for (int e = 0; e < kCols; e += 4) {
      const float4 x = *reinterpret_cast<const float4*>(src + e);
      out[e] += weight[w] * x.x, out[e + 1] += weight[w] * x.y;
      out[e + 2] += weight[w] * x.z, out[e + 3] += weight[w] * x.w;
    }
  }
  const int i = te.query(gr), h = te.head(gr);
  float inv_sum = sum > 0.f ? 1.f / sum : 0.f;
  float lse = poison ? NAN : sum > 0.f ? mx * float(M_LN2) + logf(sum) : -INFINITY;
  if (p.sinks != nullptr && p.num_splits == 1 && row_valid) {  // split partials: when combined
    float factor;
    lse = fold_sink(lse, p.sinks[h], factor);
    inv_sum *= factor;
  }
#pragma unroll
  for (int e = 0; e < kCols; ++e)
    out[e] *= inv_sum;
  if (poison) {
#pragma unroll
    for (int e = 0; e < kCols; ++e)
      out[e] = NAN;
  }

  const int64_t lse_index = (int64_t(eb) * p.heads_q + h) * p.seqlen_q + i;
  const int64_t rows_all = int64_t(p.batch) * p.heads_q * p.seqlen_q;
  FLASHMOE_PHASE(decode_trace::stamp(decode_trace::kReduced);)
  if (p.num_splits == 1) {
    if (!row_valid) return;
    T* o_row = static_cast<T*>(p.o) + eb * p.o_batch_stride + h * p.o_head_stride +
               i * p.o_row_stride + c0;
#pragma unroll
    for (int e = 0; e < kCols; e += 8) {
      if (c0 + e >= p.head_dim_v) break;  // a padded tile's columns past v's head dim
      *reinterpret_cast<uint4*>(o_row + e) =
          make_uint4(pack2<T>(out[e], out[e + 1]), pack2<T>(out[e + 2], out[e + 3]),
                     pack2<T>(out[e + 4], out[e + 5]), pack2<T>(out[e + 6], out[e + 7]));
    }
    if (c0 == 0) p.lse[lse_index] = lse;
    FLASHMOE_PHASE(decode_trace::end();)  // thread 0's row is always valid
    return;
  }
  if (row_valid) {
    // The partials' rows are v's head dim wide (as the split_kv_combine operator takes them).
    float* o_part = p.o_accum + (esplit * rows_all + lse_index) * p.head_dim_v + c0;
#pragma unroll
    for (int e = 0; e < kCols; e += 4)
      if (c0 + e < p.head_dim_v)
        *reinterpret_cast<float4*>(o_part + e) =
            make_float4(out[e], out[e + 1], out[e + 2], out[e + 3]);
    if (c0 == 0) p.lse_accum[esplit * rows_all + lse_index] = lse;
  }

  // The last split of this tile to finish combines them all. Thread 0 counts the block's arrival
  // with one acquire-release atomic: its release publishes the partial (ordered before it by the
  // barrier), its acquire makes the partials of the splits counted before it visible to the whole
  // block (through the barrier after it). The counter is reset for the next launch.
  __shared__ bool is_last;
  __syncthreads();  // the block's partial stores come before thread 0's release below
  const int tile = blockIdx.x;
  if (tid == 0) {
    const int arrived = atomic_add_acq_rel_gpu(p.split_counters + tile, 1);
    is_last = arrived == p.num_splits - 1;
    if (is_last) p.split_counters[tile] = 0;
  }
  __syncthreads();  // ... and the other splits' partials, acquired by thread 0, before every load
  FLASHMOE_PHASE(decode_trace::stamp(decode_trace::kArrived);)
  FLASHMOE_PHASE(decode_trace::put(decode_trace::kCombiner, is_last);)
  FLASHMOE_PHASE(if (!is_last) decode_trace::end();)
  if (!is_last) return;
  // Work items are (valid row, 4 columns): with the 1 to 4 rows of a typical decode tile every
  // thread gets at most one, and it reads all its splits' LSEs and partials in one go.
  const int col_items = p.head_dim_v / 4;  // v's head dim, 4 columns an item
  for (int item = tid; item < valid_rows * col_items; item += kThreads) {
    const int rr = item / col_items, col = item % col_items * 4, g = em0 + rr;
    const int hg = te.head(g), ig = te.query(g);
    const int64_t index = (int64_t(eb) * p.heads_q + hg) * p.seqlen_q + ig;
    float acc[4];
    float lse_row = combine_splits<4>(
        p.num_splits, [&](int s) { return p.lse_accum + s * rows_all + index; },
        [&](int s) { return p.o_accum + (s * rows_all + index) * p.head_dim_v + col; }, acc);
    if (p.sinks != nullptr) {
      float factor;
      lse_row = fold_sink(lse_row, p.sinks[hg], factor);
#pragma unroll
      for (int e = 0; e < 4; ++e)
        acc[e] *= factor;
    }
    T* o_row =
        static_cast<T*>(p.o) + eb * p.o_batch_stride + hg * p.o_head_stride + ig * p.o_row_stride;
    *reinterpret_cast<uint2*>(o_row + col) =
        make_uint2(pack2<T>(acc[0], acc[1]), pack2<T>(acc[2], acc[3]));
    if (col == 0) p.lse[index] = lse_row;
  }
  FLASHMOE_PHASE(__syncthreads(); decode_trace::stamp(decode_trace::kCombined);
                 decode_trace::end();)
}

template <typename Traits, typename T>
__global__ void __launch_bounds__(Traits::kNThreads)
    flash_decode_kernel(const __grid_constant__ AttentionParams p) {
  flash_decode_block<Traits, T, /*kPaged=*/false>(p);
}

// The same kernel against a paged cache (its own name, so profiles and the build's resource
// table tell the two apart).
template <typename Traits, typename T>
__global__ void __launch_bounds__(Traits::kNThreads)
    flash_decode_paged_kernel(const __grid_constant__ AttentionParams p) {
  flash_decode_block<Traits, T, /*kPaged=*/true>(p);
}

}  // namespace flashmoe::cuda
