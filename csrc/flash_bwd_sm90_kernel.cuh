// Hopper (sm_90a) dK/dV kernel of the backward pass: flash_bwd_kernel.cuh's schedule (a block
// owns one key block of one (batch, KV head) and walks the query blocks of every query head of its
// GQA group, recomputing P from the forward's log-sum-exp) with its five matmuls on warpgroup MMA.
// Two warpgroups each own 64 of the block's 128 keys, their rows of dK and dV (fp32 registers for
// the whole walk):
//   S^T = K Q^T and dP^T = V dO^T   both operands from shared memory, K-major
//   P^T and dS^T, elementwise        the accumulators hold rows = keys, columns = queries, in the
//                                    mma.sync layout (wgmma_utils.cuh), as the mma.sync kernel's
//   dV += P^T dO and dK += dS^T Q    P^T and dS^T from registers, dO and Q MN-major
//   dQ = dS K                        dS^T (stored by both warpgroups) and K, both MN-major
// Each warpgroup computes one 64 x 64 tile of a step's dQ and adds it to dq_accum with fp32
// atomics: at D = 64 a step takes 128 queries and warpgroup w owns queries [64w, 64w + 64); at
// D = 128 it takes 64 queries and w owns columns [64w, 64w + 64). Q, dO and their rows' lse and
// delta are double-buffered, so the next step's copies land while this one computes; every tile
// sits in wgmma's 128-byte-swizzled panel layout (swizzle_panels), copied by cp.async.
// Compiled for sm_90a only: in every other device pass the body is a trap, and the host refuses
// the configuration (see the host API).
#pragma once

#include "attention_params.h"
#include "flash_kernel_utils.cuh"
#include "wgmma_utils.cuh"

namespace flashmoe::cuda {

template <int kHeadDim_>
struct Sm90BwdTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = 128;                         // keys per block: 64 per warpgroup
  static constexpr int kBlockM = kHeadDim_ == 64 ? 128 : 64;  // queries per step
  static constexpr int kNThreads = 256;
  // K and V, Q and dO (two buffers each), dS^T [kBlockN][kBlockM], then lse and delta (two
  // buffers each).
  static constexpr int kTileBytes =
      (2 * kBlockN + 4 * kBlockM) * kHeadDim * 2 + kBlockN * kBlockM * 2;
  // With FLASHMOE_BWD_DQ_TMA each warpgroup's 64 x 64 fp32 dQ tile, staged for its TMA reduce-add.
  static constexpr int kDqStageBytes = FLASHMOE_BWD_DQ_TMA ? 2 * 64 * 64 * 4 : 0;
  static constexpr int kSmemBytes = kTileBytes + 4 * kBlockM * 4 + kDqStageBytes;
  static_assert(kHeadDim == 64 || kHeadDim == 128, "head_dim 64 or 128");
  static_assert((kBlockM * kHeadDim * 2) % 1024 == 0 && (kBlockN * kBlockM * 2) % 1024 == 0,
                "every tile must start on a 1024-byte swizzle atom");
  static constexpr bool kPadded = false;
  static constexpr bool kWs = false;  // Sm90BwdWsTraits
  // the columns of the head dim its products span (Sm90BwdPadded96Traits: 96)
  static constexpr int kMmaHeadDim = kHeadDim;
};
// The tile run at narrower head dims (80, 96, 112, v's 64 under 128, ...: wgmma_bwd_padded): q's,
// k's, v's and dO's columns past their head dims zero-filled in shared memory (cp.async copies the
// tensors' chunks), so every product over them adds zeros; dK and dV stored at their own widths,
// dQ's atomics only for q's columns. Every guard is `if constexpr (kPadded)`: the kernels run whole
// keep their code.
template <typename Tiles>
struct Sm90BwdPaddedTraits : Tiles {
  static constexpr bool kPadded = true;
};
// The padded 128 tile at head dims up to 96 (FLASHMOE_BWD_WS_MMA96): S^T and dP^T reduce over 96
// columns, dV and dK are 96 wide (their columns past it, K's and V's zeros, never computed);
// dQ's products stay 64 columns a warpgroup (the second's past 96 are K's zeros, never added).
template <typename Tiles>
struct Sm90BwdPadded96Traits : Sm90BwdPaddedTraits<Tiles> {
  static constexpr int kMmaHeadDim = 96;
  static_assert(Tiles::kHeadDim == 128, "96 of the 128 tile's columns");
};

// The tile warp-specialized (FLASHMOE_BWD_WS, FlashAttention-3's backward): warpgroups 0 and 1
// compute as above with 240 registers each (setmaxnreg), warpgroup 2 keeps 24 and feeds them: its
// warp 0 copies each step's Q and dO by TMA, warp 1 loads the rows' lse and delta, warp 2 adds
// the math warpgroups' staged dQ tiles by TMA reduce-add (deterministic calls: in the key
// blocks' order, flash_bwd_sm90_ws_producer). Q, dO, lse and delta sit in two stages, filled
// under the stage's full mbarrier (the TMA bytes and warp 1's 32 arrivals); Q and dO go back by
// its empty mbarrier (one arrival a math warp), lse and delta by a named barrier
// (kWsStatsEmpty); each warpgroup's dQ tiles by named barriers. dS^T has two buffers, so the one
// barrier of the math warpgroups a step (dS^T whole before dQ's product) also proves the other
// buffer free. Head dims 64 and 128, and padded onto 128 (Sm90BwdPaddedTraits over it: Q and dO a
// TMA box a 64-column panel from maps of their own widths, which zero-fill the columns past
// them); the host falls back to Sm90BwdTraits wherever the maps cannot be encoded.
template <int kHeadDim_>
struct Sm90BwdWsTraits : Sm90BwdTraits<kHeadDim_> {
  using Base = Sm90BwdTraits<kHeadDim_>;
  static constexpr bool kWs = true;
  static constexpr int kNThreads = 384;
  // K and V, Q and dO (two stages each), dS^T (two buffers), lse and delta (two stages each),
  // each math warpgroup's 64 x 64 fp32 dQ tile in each dQ stage (1024-byte aligned: everything
  // before it is a multiple of 1 KB), then the stages' full and empty mbarriers.
  static constexpr int kStatsOffset = (2 * Base::kBlockN + 4 * Base::kBlockM) * kHeadDim_ * 2 +
                                      2 * Base::kBlockN * Base::kBlockM * 2;
  static constexpr int kDqOffset = kStatsOffset + 4 * Base::kBlockM * 4;
  static constexpr int kDqStages = FLASHMOE_BWD_WS_DQ_STAGES;  // [slot][warpgroup] tiles
  static_assert(kDqStages == 1 || kDqStages == 2, "one or two dQ stages");
  static constexpr int kBarOffset = kDqOffset + kDqStages * 2 * 64 * 64 * 4;
  static constexpr int kSmemBytes = kBarOffset + 4 * 8;
  // The launch gives each of the 384 threads 168 registers; the producer gives up all but
  // kProducerRegs, and the math warpgroups take what that frees (24: 240, as 128 x 24 + 256 x 240
  // = 168 x 384; 32: 232).
  static constexpr int kProducerRegs = FLASHMOE_BWD_WS_PRODUCER_REGS;
  static constexpr int kMathRegs =
      (65536 / kNThreads / 8 * 8 * kNThreads - 128 * kProducerRegs) / 256 / 8 * 8;
  // (kMathRegs fits the launch by construction; what setmaxnreg itself takes is checked here)
  static_assert(kProducerRegs % 8 == 0 && 24 <= kProducerRegs && kProducerRegs <= kMathRegs &&
                    kMathRegs <= 256,
                "setmaxnreg: register counts are multiples of 8 from 24 to 256");
  static_assert(kDqOffset % 1024 == 0, "the dQ tiles start on a 1024-byte swizzle atom");
};
// Named barriers of the warp-specialized tile: its math warpgroups' (256 threads); per math
// warpgroup w and dQ slot s its tile's full (kWsDqFull + 2s + w) and empty (kWsDqEmpty + 2s + w)
// with the writer warp (160 threads); per stage s its lse and delta read (kWsStatsEmpty + s: the
// math warpgroups arrive, the stats warp waits; 288 threads). A named barrier, not the stage's
// empty mbarrier, hands lse and delta back: racecheck orders shared-memory accesses across
// barriers, not across mbarriers.
constexpr int kWsMathBarrier = 1, kWsDqFull = 2, kWsDqEmpty = 6, kWsStatsEmpty = 10;

#if FLASHMOE_BWD_DQ_MAP
// A warpgroup's 64 x 64 fp32 dQ chunk (wgmma's m64n64 accumulators) into `stage` as the dQ map's
// two boxes of 32 columns (rows of 128 bytes whose 16-byte chunks are swizzled by the row, as the
// map's 128-byte swizzle reads them). A 64-bit store is served a half-warp (rows R = 0..3 or 4..7)
// at a time; in column tile nt its lanes' chunks are (2 (nt & 3) + h) ^ R (h: the lane's half of
// the tile), which rows R and R ^ 1 share, so each half takes two wavefronts. With
// FLASHMOE_BWD_DQ_STORE_SWAP the odd rows write column tile nt ^ 2 when the even rows write nt:
// their chunks move by 4, and the half-warp's eight are distinct (one wavefront each).
__device__ __forceinline__ void store_dq_chunk(float* stage, const float (&acc_dq)[8][4],
                                               int row_in_wg, int lane) {
  const bool swap = FLASHMOE_BWD_DQ_STORE_SWAP && (row_in_wg & 1);
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int row = row_in_wg + hh * 8;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      // 16-byte chunk of the box's row (column tile nt ^ 2's for a swapped row: chunk ^ 4)
      const int chunk = ((nt & 3) * 2 + (lane & 3) / 2) ^ (swap ? 4 : 0);
      float* dst =
          stage + (nt >> 2) * 64 * 32 + row * 32 + (chunk ^ (row & 7)) * 4 + (lane & 1) * 2;
      const float2 even = make_float2(acc_dq[nt][2 * hh], acc_dq[nt][2 * hh + 1]);
      const float2 odd = make_float2(acc_dq[nt ^ 2][2 * hh], acc_dq[nt ^ 2][2 * hh + 1]);
      *reinterpret_cast<float2*>(dst) = swap ? odd : even;
    }
  }
}
// store_dq_chunk made visible to the TMA unit, by a warpgroup that issues its own reduces: its
// leader first waits until its previous reduce has read the stage; the caller's leader then
// issues the reduces (sm90::tma_reduce_add_3d a box) and commits them. Named barrier 1 + wg.
__device__ __forceinline__ void stage_dq_chunk(float* stage, const float (&acc_dq)[8][4], int wg,
                                               bool leader, int row_in_wg, int lane) {
  if (leader) sm90::bulk_wait_group_read<0>();
  sm90::warpgroup_sync(1 + wg);
  store_dq_chunk(stage, acc_dq, row_in_wg, lane);
  sm90::fence_proxy_async();  // the chunk's stores, visible to the TMA unit
  sm90::warpgroup_sync(1 + wg);
}
#endif

#if FLASHMOE_BWD_DET_ROTATE
// The rotated walk of deterministic=True (BwdParams::dq_rotate): the key block launched
// `launched`-th of `n_blocks` starts at query block launched * m_count / n_blocks of the m_count
// that every key block walks, and reaches query block m at its step (m - start) mod m_count.
__device__ __forceinline__ int dq_rotation(int launched, int m_count, int n_blocks) {
  return launched * m_count / n_blocks;
}
// How many key blocks add to the query block that key block `launched` reaches at `step` (of
// its head's walk) before it: those that reach it at an earlier step, and those that reach it at
// the same step (the same start) launched before it. A total order a query block; in a pair's
// lockstep the block just before reached it a step earlier. The starts are nondecreasing in the
// launch position, so the earlier ones are those whose start lies in the `step` query blocks
// after this one's, cyclically, counted in closed form (one lane, no loop).
__device__ __forceinline__ int dq_adds_before(int launched, int step, int m_count, int n_blocks) {
  // the key blocks whose start is at most x >= 0: r * m_count < (x + 1) * n_blocks
  auto starts_to = [&](int x) { return min(n_blocks, ceil_div((x + 1) * n_blocks, m_count)); };
  const int start = dq_rotation(launched, m_count, n_blocks), end = start + step;
  const int earlier = end < m_count ? starts_to(end) - starts_to(start)
                                    : n_blocks - starts_to(start) + starts_to(end - m_count);
  return earlier + launched - ceil_div(start * n_blocks, m_count);
}
#endif

#if FLASHMOE_BWD_WS
// The warp-specialized tile's mbarriers (Sm90BwdWsTraits): full[2], then empty[2].
template <typename Traits>
__device__ __forceinline__ uint64_t* ws_barriers(uint4* smem) {
  return reinterpret_cast<uint64_t*>(reinterpret_cast<char*>(smem) + Traits::kBarOffset);
}

// The warp-specialized tile's producer warpgroup, after its setmaxnreg. Step `step` uses stage
// step % 2 for the (step / 2)-th time: its full barrier completes phase (step / 2) % 2, and the
// producer waits for the empty one's previous phase (a fresh barrier passes the first wait).
// kOrdered (deterministic calls): the writer adds a query block's dQ only after every key block
// that adds to it before this one (those after it: the grid runs the key blocks from the last,
// so it waits only on blocks started before it), then counts this one in (BwdParams::dq_order).
template <typename Traits, bool kOrdered, typename T, typename StepHead, typename StepM0>
__device__ __forceinline__ void flash_bwd_sm90_ws_producer(const BwdParams& p, T* sQ, T* sdO,
                                                           float* sLse, float* sDelta, float* sDq,
                                                           uint64_t* bars, int b, int key_block,
                                                           int steps, StepHead step_head,
                                                           StepM0 step_m0) {
  constexpr int D = Traits::kHeadDim, BM = Traits::kBlockM, BN = Traits::kBlockN;
  uint64_t* full = bars;
  uint64_t* empty = bars + 2;
  const int pwarp = threadIdx.x / 32 - 8, lane = threadIdx.x % 32;
  if (pwarp == 0) {  // Q and dO by TMA (rows past Sq, padded columns: zero-filled)
    if (lane != 0) return;
    sm90::prefetch_tensor_map(p.tma_q);
    sm90::prefetch_tensor_map(p.tma_do);
#pragma unroll 1
    for (int step = 0; step < steps; ++step) {
      const int s = step & 1, h = step_head(step), m0 = step_m0(step);
      sm90::mbar_wait(&empty[s], ((step >> 1) & 1) ^ 1);
      sm90::mbar_arrive_expect_tx(&full[s], 2u * BM * D * 2);  // whole boxes, zeros included
      if constexpr (Traits::kPadded) {  // a box a panel, from maps of the tensors' own widths
#pragma unroll
        for (int c = 0; c < D / 64; ++c) {
          sm90::tma_load_5d(sQ + s * BM * D + c * BM * 64, p.tma_q, &full[s], c * 64, m0, 0, h, b);
          sm90::tma_load_5d(sdO + s * BM * D + c * BM * 64, p.tma_do, &full[s], c * 64, m0, 0, h,
                            b);
        }
      } else {
        sm90::tma_load_5d(sQ + s * BM * D, p.tma_q, &full[s], 0, m0, 0, h, b);
        sm90::tma_load_5d(sdO + s * BM * D, p.tma_do, &full[s], 0, m0, 0, h, b);
      }
    }
  } else if (pwarp == 1) {  // the rows' base-2 lse and delta (rows past Sq: lse +inf, so P = 0)
#pragma unroll 1
    for (int step = 0; step < steps; ++step) {
      const int s = step & 1, h = step_head(step), m0 = step_m0(step);
      if (step >= 2) sm90::named_sync(kWsStatsEmpty + s, 288);  // step - 2 has read them
      const int64_t row0 = (int64_t(b) * p.heads_q + h) * p.seqlen_q + m0;
#pragma unroll
      for (int r = lane; r < BM; r += 32) {
        const bool valid = m0 + r < p.seqlen_q;
        sLse[s * BM + r] = valid ? p.lse2[row0 + r] : INFINITY;
        sDelta[s * BM + r] = valid ? p.delta[row0 + r] : 0.f;
      }
      sm90::mbar_arrive(&full[s]);
    }
  } else if (pwarp == 2) {  // dQ: each math warpgroup's staged tile, by TMA reduce-add
    const int n_blocks = ceil_div(p.seqlen_k, BN);
    // planted 6: the last key block never reaches dQ
    const bool add_dq = !planted(6) || key_block != n_blocks - 1;
#pragma unroll 1
    for (int step = 0; step < steps; ++step) {
      const int bh = b * p.heads_q + step_head(step), m0 = step_m0(step);
      [[maybe_unused]] int* counter = nullptr;
      if constexpr (kOrdered) {
        // the key blocks after this one whose query range (bwd_query_blocks) holds this block
        const int m = m0 / BM, offset = p.seqlen_k - p.seqlen_q;
        int before = 0;
#if FLASHMOE_BWD_DET_ROTATE
        if (p.dq_rotate) {  // every key block's walk holds m: those that reach it first
          const int m_count = ceil_div(p.seqlen_q, BM);
          if (lane == 0)
            before = dq_adds_before(n_blocks - 1 - key_block, step % m_count, m_count, n_blocks);
        } else
#endif
        {
          for (int n = key_block + 1 + lane; n < n_blocks; n += 32) {
            const int2 range = bwd_query_blocks<BM, BN>(p, n * BN, offset);
            before += range.x <= m && m < range.y;
          }
        }
        before = __reduce_add_sync(0xffffffffu, before);
        counter = p.dq_order + int64_t(bh) * ceil_div(p.seqlen_q, BM) + m;
        if (lane == 0) {
          while (sm90::load_acquire(counter) < before)
            __nanosleep(32);
          sm90::fence_proxy_async_global();  // this block's reduce-adds after theirs
        }
      }
      const int slot = Traits::kDqStages == 2 ? step & 1 : 0;
#pragma unroll
      for (int w = 0; w < 2; ++w) {
        // warpgroup w's tile: queries [64w, 64w + 64) at d=64, columns [64w, 64w + 64) at 128
        const int pq = D == 64 ? w : 0, pd = D == 64 ? 0 : w, tile = 2 * slot + w;
        sm90::named_sync(kWsDqFull + tile, 160);
        if (lane == 0) {
          if (add_dq) {
#pragma unroll
            for (int box = 0; box < 2; ++box) {
              if constexpr (Traits::kPadded) {  // dQ's columns past q's head dim: never read
                if (pd * 64 + box * 32 >= p.head_dim) continue;
              }
              sm90::tma_reduce_add_3d(p.dq_map, sDq + tile * 64 * 64 + box * 64 * 32,
                                      pd * 64 + box * 32, m0 + pq * 64, bh);
            }
            sm90::bulk_commit_group();
          }
          sm90::bulk_wait_group_read<0>();
        }
        __syncwarp();
        // the tile is free again (the warpgroup's own first arrivals stood for the first steps)
        if (step + Traits::kDqStages < steps) sm90::named_arrive(kWsDqEmpty + tile, 160);
      }
      if constexpr (kOrdered) {
        if (lane == 0) {  // both tiles' adds written before the next key block's may start
          sm90::bulk_wait_group<0>();
          sm90::fence_proxy_async_global();
          sm90::release_add(counter, 1);
        }
      }
    }
    if (lane == 0) sm90::bulk_wait_group<0>();  // the adds done before the block ends
  }
}
#endif

template <typename Traits, typename T, bool kAtomicDq>
__device__ __forceinline__ void flash_bwd_sm90_block(const BwdParams& p) {
  constexpr int D = Traits::kHeadDim, BM = Traits::kBlockM, BN = Traits::kBlockN;
  constexpr int MT = BM / 8, DT = Traits::kMmaHeadDim / 8;  // DT: dK's and dV's 8-column groups
  constexpr int kMmaD = Traits::kMmaHeadDim;  // the head dim's columns the products span
  constexpr bool kPadded = Traits::kPadded, kWs = Traits::kWs;
  // dQ in this kernel: by atomics (the 256-thread tile), or by the writer warp (the
  // warp-specialized one), in a fixed order where the call is deterministic (kOrderedDq)
  constexpr bool kDq = kAtomicDq || kWs, kOrderedDq = kWs && !kAtomicDq;
  // the warp-specialized tile's dK product after dQ's (FLASHMOE_BWD_DK_AFTER_DQ): on the 128
  // tile (at 64 it measured 0.4-2.7% slower)
  constexpr bool kDkAfterDq = kWs && FLASHMOE_BWD_DK_AFTER_DQ && D == 128;
  // the threads that copy K and V and compute: every thread of the 256-thread tile, the math
  // warpgroups of the warp-specialized one
  constexpr int kMathThreads = 256;

  extern __shared__ __align__(1024) uint4 smem_buf[];
  T* sK = reinterpret_cast<T*>(smem_buf);
  T* sV = sK + BN * D;
  T* sQ = sV + BN * D;        // [2][BM x D]
  T* sdO = sQ + 2 * BM * D;   // [2][BM x D]
  T* sdS = sdO + 2 * BM * D;  // dS^T: [BN keys][BM queries] (two buffers: kWs)
  float* sLse = reinterpret_cast<float*>(sdS + (kWs ? 2 : 1) * BN * BM);  // [2][BM]
  float* sDelta = sLse + 2 * BM;                                          // [2][BM]
  // FLASHMOE_BWD_DQ_TMA and kWs: [2 warpgroups][2 boxes of 32 columns][64 rows][32], 128-byte
  // swizzled rows (1024-byte aligned: every region before it is a multiple of 1024 bytes)
  [[maybe_unused]] float* sDq = sDelta + 2 * BM;

  // kWs: the warp index through a shuffle from lane 0, so that the compiler knows it uniform and
  // keeps the role branch and the wgmma descriptors in uniform registers (as the forward does)
  const int tid = threadIdx.x;
  int lane = tid % 32;  // kWs: read again past setmaxnreg (kept across it, it spilled)
  const int warp = kWs ? __shfl_sync(0xffffffffu, tid / 32, 0) : tid / 32, wg = warp / 4;
  // The block's key block and (batch, KV head) pair: the grid's x and y, or on the 1-D grid of
  // FLASHMOE_BWD_CAUSAL_LPT (p.lpt_pairs) section blockIdx.x / (lpt_pairs x key blocks), in which
  // key block i / count of pair first + i % count (count: the section's pairs).
  unsigned grid_n = blockIdx.x, grid_pair = blockIdx.y;  // (unsigned, as the grid's indices)
#if FLASHMOE_BWD_WS && FLASHMOE_BWD_CAUSAL_LPT
  if constexpr (kWs && kAtomicDq) {
    if (p.lpt_pairs > 0) {
      const int n_blocks = ceil_div(p.seqlen_k, BN), pairs = p.batch * p.heads_kv;
      const int first = int(blockIdx.x) / (p.lpt_pairs * n_blocks) * p.lpt_pairs;
      const int count = min(p.lpt_pairs, pairs - first), i = int(blockIdx.x) - first * n_blocks;
      grid_n = i / count;
      grid_pair = first + i % count;
    }
  }
#endif
  // kOrderedDq: the key blocks from the last (the order of their dQ adds)
  const int n0 = (kOrderedDq ? gridDim.x - 1 - grid_n : grid_n) * BN;
  const int b = grid_pair / p.heads_kv, hkv = grid_pair % p.heads_kv;
  const int offset = p.seqlen_k - p.seqlen_q;  // causal: query i sees keys j <= i + offset
  const int2 query_blocks = bwd_query_blocks<BM, BN>(p, n0, offset);
  const int m_begin = query_blocks.x, m_end = query_blocks.y;

  const T* k_base = static_cast<const T*>(p.k) + b * p.k_batch_stride + hkv * p.k_head_stride;
  const T* v_base = static_cast<const T*>(p.v) + b * p.v_batch_stride + hkv * p.v_head_stride;
  // The tensors' 16-byte chunks a row: the tile's own unless padded, whose columns past a head
  // dim load_kv_tile zero-fills (planted 19: copied at the tile's width, the next row's columns
  // in them).
  const bool tile_wide = !kPadded || planted(19);
  const int qk_chunks = tile_wide ? D / 8 : p.head_dim / 8;
  const int v_chunks = tile_wide ? D / 8 : p.head_dim_v / 8;
  if (!kWs || warp < 8) {
    load_kv_tile<D, BN, kMathThreads, /*kPanels=*/true>(sK, k_base, p.k_row_stride, n0, p.seqlen_k,
                                                        qk_chunks, tid);
    load_kv_tile<D, BN, kMathThreads, /*kPanels=*/true>(sV, v_base, p.v_row_stride, n0, p.seqlen_k,
                                                        v_chunks, tid);
  }
  cp_async_commit();

  // planted 5: only the group's first query head reaches dK and dV
  const int group = planted(5) ? 1 : p.heads_ratio;
  const int m_count = max(0, m_end - m_begin), steps = group * m_count;
  auto step_head = [&](int step) { return hkv * p.heads_ratio + step / m_count; };
#if FLASHMOE_BWD_DET_ROTATE
  // deterministic=True without a mask (p.dq_rotate): the walk starts at query block
  // dq_rotation(launch position) and wraps (dq_adds_before gives the order of the adds)
  const int rotation =
      kOrderedDq && p.dq_rotate ? dq_rotation(int(grid_n), m_count, int(gridDim.x)) : 0;
#endif
  auto step_m0 = [&](int step) {
    int i = step % m_count;
#if FLASHMOE_BWD_DET_ROTATE
    if constexpr (kOrderedDq) {
      i += rotation;
      if (i >= m_count) i -= m_count;
    }
#endif
    return (m_begin + i) * BM;
  };
  [[maybe_unused]] uint64_t* ws_bars = nullptr;  // kWs: full[2], empty[2]
#if FLASHMOE_BWD_WS
  if constexpr (kWs) {
    ws_bars = ws_barriers<Traits>(smem_buf);
    if (tid == 0) {
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        sm90::mbar_init(&ws_bars[s], 1 + 32);  // the TMA thread's expect_tx, the stats warp
        sm90::mbar_init(&ws_bars[2 + s], 8);   // one arrival a math warp
      }
      sm90::mbar_init_fence();
    }
    __syncthreads();
    if (warp >= 8) {
      sm90::setmaxnreg_dec<Traits::kProducerRegs>();
      flash_bwd_sm90_ws_producer<Traits, kOrderedDq>(p, sQ, sdO, sLse, sDelta, sDq, ws_bars, b,
                                                     n0 / BN, steps, step_head, step_m0);
      return;
    }
    sm90::setmaxnreg_inc<Traits::kMathRegs>();
    asm volatile("mov.u32 %0, %%laneid;\n" : "=r"(lane));
    // each warpgroup's dQ tiles start empty: its first warp's arrivals stand for the writer's
    if (warp % 4 == 0) {
      for (int slot = 0; slot < Traits::kDqStages && slot < steps; ++slot)
        sm90::named_arrive(kWsDqEmpty + 2 * slot + wg, 160);
    }
    cp_async_wait<0>();
    sm90::fence_proxy_async();              // K and V, visible to the tensor cores
    sm90::named_sync(kWsMathBarrier, 256);  // both warpgroups' copies of them
  }
#endif
  // Step `step`'s Q and dO into buffer step % 2 (cp.async, one commit group), and its rows'
  // base-2 lse and delta (rows past the end: lse +inf, so P = 0).
  auto issue_step = [&](int step) {
    const int buf = step & 1, h = step_head(step), m0 = step_m0(step);
    const T* q_base = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride;
    const T* do_base = static_cast<const T*>(p.dout) + b * p.do_batch_stride + h * p.do_head_stride;
    load_kv_tile<D, BM, kMathThreads, true>(sQ + buf * BM * D, q_base, p.q_row_stride, m0,
                                            p.seqlen_q, qk_chunks, tid);
    load_kv_tile<D, BM, kMathThreads, true>(sdO + buf * BM * D, do_base, p.do_row_stride, m0,
                                            p.seqlen_q, v_chunks, tid);
#if FLASHMOE_BWD_STATS_CP_ASYNC
    // The rows' lse and delta by cp.async in the tiles' group: the first warpgroup no longer
    // waits a global load's latency here every step (rows past the end still stored directly).
    if (tid < BM) {
      const int64_t row = (int64_t(b) * p.heads_q + h) * p.seqlen_q + m0 + tid;
      if (m0 + tid < p.seqlen_q) {
        cp_async_4(sLse + buf * BM + tid, p.lse2 + row);
        cp_async_4(sDelta + buf * BM + tid, p.delta + row);
      } else {
        sLse[buf * BM + tid] = INFINITY;
        sDelta[buf * BM + tid] = 0.f;
      }
    }
    cp_async_commit();
#else
    cp_async_commit();
    if (tid < BM) {
      const int64_t row = (int64_t(b) * p.heads_q + h) * p.seqlen_q + m0 + tid;
      const bool valid = m0 + tid < p.seqlen_q;
      sLse[buf * BM + tid] = valid ? p.lse2[row] : INFINITY;
      sDelta[buf * BM + tid] = valid ? p.delta[row] : 0.f;
    }
#endif
  };

  // Descriptors. S^T: this warpgroup's 64 keys of K (V) as A, the step's Q (dO) as B, K-major.
  // dV and dK: dO and Q as B, MN-major (the queries are the reduction). dQ: dS^T's query panel
  // pq as A and K's column panel pd as B, both MN-major (the keys are the reduction).
  const uint64_t k_desc = sm90::desc_k_major(smem_u32(sK + wg * 64 * 64));
  const uint64_t v_desc = sm90::desc_k_major(smem_u32(sV + wg * 64 * 64));
  const uint64_t q_desc = sm90::desc_k_major(smem_u32(sQ));
  const uint64_t do_desc = sm90::desc_k_major(smem_u32(sdO));
  const uint64_t q_mn_desc = sm90::desc_mn_major<BM>(smem_u32(sQ));
  const uint64_t do_mn_desc = sm90::desc_mn_major<BM>(smem_u32(sdO));
  constexpr uint64_t kBufStep = uint64_t((BM * D * 2) >> 4);  // the other Q (dO) buffer
  const int pq = D == 64 ? wg : 0, pd = D == 64 ? 0 : wg;
  const uint64_t ds_desc = sm90::desc_mn_major<BN>(smem_u32(sdS + pq * BN * 64));
  constexpr uint64_t kDsBufStep = uint64_t((BN * BM * 2) >> 4);  // kWs: the other dS^T buffer
  const uint64_t kt_desc = sm90::desc_mn_major<BN>(smem_u32(sK + pd * BN * 64));

  const int row_in_wg = 16 * (warp % 4) + lane / 4;  // + 8 * (e / 2): accumulator rows
  const int key_row0 = 64 * wg + row_in_wg;          // this thread's first key in the block

  float acc_dk[DT][4], acc_dv[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      acc_dk[dt][e] = acc_dv[dt][e] = 0.f;

  if (!kWs && steps > 0) issue_step(0);
  for (int step = 0; step < steps; ++step) {
    const int buf = step & 1, m0 = step_m0(step);
    if constexpr (kWs) {
      sm90::mbar_wait(&ws_bars[buf], (step >> 1) & 1);  // the step's Q, dO, lse and delta
    } else {
      cp_async_wait<0>();
      sm90::fence_proxy_async();  // this thread's copies, visible to the tensor cores
      __syncthreads();            // the step's tiles have landed; step - 1 is done with buf ^ 1
    }

    // S^T and dP^T, two commit groups: P^T is computed while dP^T is still running.
    float acc_s[MT][4], acc_dp[MT][4];
    sm90::fence_operands(acc_s);
    sm90::fence_operands(acc_dp);
    sm90::fence();
#pragma unroll
    for (int kk0 = 0; kk0 < kMmaD / 16; ++kk0) {
      // planted 28: the 96-column products' last step of S^T reads columns 96-111 (zeros) in
      // place of 80-95, so a head dim of 96 loses them and one of 80 does not
      const int kk = kMmaD == 96 && kk0 == kMmaD / 16 - 1 && planted(28) ? kMmaD / 16 : kk0;
      sm90::mma_ss<BM, T>(acc_s, k_desc + sm90::k_major_step<BN>(kk),
                          q_desc + buf * kBufStep + sm90::k_major_step<BM>(kk), kk > 0);
    }
    sm90::commit_group();
#pragma unroll
    for (int kk = 0; kk < kMmaD / 16; ++kk)
      sm90::mma_ss<BM, T>(acc_dp, v_desc + sm90::k_major_step<BN>(kk),
                          do_desc + buf * kBufStep + sm90::k_major_step<BM>(kk), kk > 0);
    sm90::commit_group();
    if (!kWs && step + 1 < steps) issue_step(step + 1);  // lands while this step computes

    // P^T = exp2(S^T * scale_log2 - lse2) with keys past the end and outside the window (causal:
    // its right edge 0) at 0, then dS^T = P^T (dP^T - delta); the unmasked blocks skip the
    // per-element mask.
    const bool need_mask = bwd_step_needs_mask<BM, BN>(p, n0, m0, offset);
    const float* lse_buf = sLse + buf * BM;
    const float* delta_buf = sDelta + buf * BM;
    // kCapped: a pass before left t = tanh(s * softcap_scale) in S^T (apply_softcap: scale_log2
    // holds the softcap) and (dP^T - delta) (1 - t^2) in dP^T, so dS^T = P^T dP^T here.
    auto probs = [&](auto mask, auto capped) {
      constexpr bool kMask = decltype(mask)::value, kCapped = decltype(capped)::value;
#pragma unroll
      for (int nt = 0; nt < MT; ++nt) {
        const int col0 = nt * 8 + (lane & 3) * 2;
        const float2 lse2 = *reinterpret_cast<const float2*>(lse_buf + col0);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float prob = exp2f(fmaf(acc_s[nt][e], p.scale_log2, (e & 1) ? -lse2.y : -lse2.x));
          if constexpr (kMask) {
            const int key = n0 + key_row0 + (e >> 1) * 8, i = m0 + col0 + (e & 1);
            if (key >= window_key_end(p, i, offset, p.seqlen_k) ||
                key < window_first_key(p, i, offset))
              prob = 0.f;
          }
          acc_s[nt][e] = prob;
          if constexpr (kCapped) acc_dp[nt][e] *= prob;
        }
      }
    };
    if (p.softcap > 0.f) {  // both products first: dS needs t, which P replaces
      sm90::wait_group<0>();
      sm90::fence_operands(acc_s);
      sm90::fence_operands(acc_dp);
#pragma unroll
      for (int nt = 0; nt < MT; ++nt) {
        apply_softcap(acc_s[nt], p);
        const float2 delta = *reinterpret_cast<const float2*>(delta_buf + nt * 8 + (lane & 3) * 2);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float t = acc_s[nt][e];
          acc_dp[nt][e] = (acc_dp[nt][e] - ((e & 1) ? delta.y : delta.x)) * (1.f - t * t);
        }
      }
      if (need_mask)
        probs(BoolConstant<true>{}, BoolConstant<true>{});
      else
        probs(BoolConstant<false>{}, BoolConstant<true>{});
    } else {  // P^T while dP^T is still running
      sm90::wait_group<1>();
      sm90::fence_operands(acc_s);
      if (need_mask)
        probs(BoolConstant<true>{}, BoolConstant<false>{});
      else
        probs(BoolConstant<false>{}, BoolConstant<false>{});
      sm90::wait_group<0>();
      sm90::fence_operands(acc_dp);
#pragma unroll
      for (int nt = 0; nt < MT; ++nt) {
        const int col0 = nt * 8 + (lane & 3) * 2;
        const float2 delta = *reinterpret_cast<const float2*>(delta_buf + col0);
#pragma unroll
        for (int e = 0; e < 4; ++e)
          acc_dp[nt][e] = acc_s[nt][e] * (acc_dp[nt][e] - ((e & 1) ? delta.y : delta.x));
      }
    }
    if constexpr (kWs) {  // this step's lse and delta read: the stats warp refills their stage
      if (step + 2 < steps) sm90::named_arrive(kWsStatsEmpty + buf, 288);
    }
    // Both to registers as 16-bit A operands (the fp32 P^T and dS^T die here).
    uint32_t p_frag[BM / 16][4], ds_frag[BM / 16][4];
#pragma unroll
    for (int j = 0; j < BM / 16; ++j) {
      p_frag[j][0] = pack2<T>(acc_s[2 * j][0], acc_s[2 * j][1]);
      p_frag[j][1] = pack2<T>(acc_s[2 * j][2], acc_s[2 * j][3]);
      p_frag[j][2] = pack2<T>(acc_s[2 * j + 1][0], acc_s[2 * j + 1][1]);
      p_frag[j][3] = pack2<T>(acc_s[2 * j + 1][2], acc_s[2 * j + 1][3]);
      ds_frag[j][0] = pack2<T>(acc_dp[2 * j][0], acc_dp[2 * j][1]);
      ds_frag[j][1] = pack2<T>(acc_dp[2 * j][2], acc_dp[2 * j][3]);
      ds_frag[j][2] = pack2<T>(acc_dp[2 * j + 1][0], acc_dp[2 * j + 1][1]);
      ds_frag[j][3] = pack2<T>(acc_dp[2 * j + 1][2], acc_dp[2 * j + 1][3]);
    }
    if constexpr (kDq) {
      // dS^T to shared memory for dQ: row = key, 8-query chunk nt (conflict-free: the 8 rows of
      // one store instruction land in 8 different chunks).
      T* ds_buf = kWs ? sdS + buf * BN * BM : sdS;
#pragma unroll
      for (int nt = 0; nt < MT; ++nt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
          *reinterpret_cast<uint32_t*>(ds_buf + swizzle_panels<BN>(key_row0 + 8 * hh, nt) +
                                       (lane & 3) * 2) = ds_frag[nt / 2][(nt & 1) * 2 + hh];
    }

    // dV += P^T dO and dK += dS^T Q, the step's queries as the reduction (kDkAfterDq: dK after
    // dQ's product, below).
    auto dk_product = [&] {
#pragma unroll
      for (int j = 0; j < BM / 16; ++j)
        sm90::mma_rs<kMmaD, T>(acc_dk, ds_frag[j],
                               q_mn_desc + buf * kBufStep + sm90::mn_major_step(j), 1);
    };
    sm90::fence_operands(acc_dv);
    sm90::fence_operands(acc_dk);
    sm90::fence();
#pragma unroll
    for (int j = 0; j < BM / 16; ++j)
      sm90::mma_rs<kMmaD, T>(acc_dv, p_frag[j],
                             do_mn_desc + buf * kBufStep + sm90::mn_major_step(j), 1);
    if constexpr (!kDkAfterDq) dk_product();
    sm90::commit_group();

    if constexpr (kDq) {
      // planted 6: the last key block never reaches dQ (kWs: the writer's)
      [[maybe_unused]] const bool add_dq =
          !planted(6) || int(grid_n) != ceil_div(p.seqlen_k, BN) - 1;
      sm90::fence_proxy_async();  // this thread's dS^T stores, visible to the tensor cores
      // dS^T is whole (both warpgroups' keys); kWs: both are past step - 1's dQ product, which
      // read the buffer step + 1 writes
      if constexpr (kWs)
        sm90::named_sync(kWsMathBarrier, 256);
      else
        __syncthreads();
      float acc_dq[8][4];
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          acc_dq[nt][e] = 0.f;
      sm90::fence_operands(acc_dq);
      sm90::fence();
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk)
        sm90::mma_ss<64, T, /*kMnMajor=*/true>(
            acc_dq, ds_desc + (kWs ? buf * kDsBufStep : 0) + sm90::mn_major_step(kk),
            kt_desc + sm90::mn_major_step(kk), kk > 0);
      sm90::commit_group();
      if constexpr (kDkAfterDq) {  // dV's and dQ's products done, dK's still running
        sm90::fence();
        dk_product();
        sm90::commit_group();
        sm90::wait_group<1>();
      } else {
        sm90::wait_group<0>();
        sm90::fence_operands(acc_dk);
      }
      sm90::fence_operands(acc_dq);
      sm90::fence_operands(acc_dv);
#if FLASHMOE_BWD_WS
      if constexpr (kWs) {
        // this warpgroup's dQ tile to the writer warp once the writer has read the last one, and
        // the step's stage back to the producer once every product of the step is done
        auto release_stage = [&] {
          __syncwarp();
          if (lane == 0) sm90::mbar_arrive(&ws_bars[2 + buf]);
        };
        if constexpr (!kDkAfterDq) release_stage();
        const int tile = 2 * (Traits::kDqStages == 2 ? step & 1 : 0) + wg;
        sm90::named_sync(kWsDqEmpty + tile, 160);
        // the tile's addresses computed here, not hoisted out of the loop (where they spilled)
        int row = row_in_wg, col_lane = lane;
        asm volatile("" : "+r"(row), "+r"(col_lane));
        store_dq_chunk(sDq + tile * 64 * 64, acc_dq, row, col_lane);
        sm90::fence_proxy_async();  // the tile's stores, visible to the TMA unit
        sm90::named_arrive(kWsDqFull + tile, 160);
        if constexpr (kDkAfterDq) {  // dK's product has read Q: the stage goes back
          sm90::wait_group<0>();
          sm90::fence_operands(acc_dk);
          release_stage();
        }
        continue;
      }
#endif
#if FLASHMOE_BWD_DQ_TMA
      // This warpgroup's 64 x 64 dQ tile through shared memory (stage_dq_chunk), then one TMA
      // reduce-add a box into dq_accum: rows past Sq lie outside the map and are left alone.
      float* stage = sDq + wg * 64 * 64;
      const bool leader = tid % 128 == 0;
      stage_dq_chunk(stage, acc_dq, wg, leader, row_in_wg, lane);
      if (leader && add_dq) {
        const int bh = b * p.heads_q + step_head(step);
#pragma unroll
        for (int box = 0; box < 2; ++box) {
          if constexpr (kPadded) {  // dQ's columns past q's head dim: K's zeros, never read
            if (pd * 64 + box * 32 >= p.head_dim) continue;
          }
          sm90::tma_reduce_add_3d(p.dq_map, stage + box * 64 * 32, pd * 64 + box * 32, m0 + pq * 64,
                                  bh);
        }
        sm90::bulk_commit_group();
      }
#else
      if (add_dq) {
        const int64_t row_base = (int64_t(b) * p.heads_q + step_head(step)) * p.seqlen_q;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int i = m0 + pq * 64 + row_in_wg + hh * 8;
          if (i >= p.seqlen_q) continue;
          float* dq_row = p.dq_accum + (row_base + i) * D + pd * 64 + (lane & 3) * 2;
#pragma unroll
          for (int nt = 0; nt < 8; ++nt) {
            if constexpr (kPadded) {  // dQ's columns past q's head dim: K's zeros, never read
              if (pd * 64 + nt * 8 >= p.head_dim) continue;
            }
            atomicAdd(reinterpret_cast<float2*>(dq_row + nt * 8),
                      make_float2(acc_dq[nt][2 * hh], acc_dq[nt][2 * hh + 1]));
          }
        }
      }
#endif
    } else {
      sm90::wait_group<0>();
      sm90::fence_operands(acc_dv);
      sm90::fence_operands(acc_dk);
    }
  }
  cp_async_wait<0>();  // no block leaves with copies in flight (no query block saw these keys)
#if FLASHMOE_BWD_DQ_TMA
  if constexpr (kAtomicDq) {
    if (tid % 128 == 0) sm90::bulk_wait_group<0>();  // its dQ reduces done before the block ends
  }
#endif

  // dK = scale * sum dS^T Q and dV: contiguous [B, Hkv, Sk, head dim], keys past the end not
  // written (padded: nor the tile's columns past each head dim).
  const float dk_scale = planted(4) ? 1.f : p.softmax_scale;    // planted: dS without the scale
  const int64_t kv_row_base = int64_t(grid_pair) * p.seqlen_k;  // b * heads_kv + hkv
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int key = n0 + key_row0 + hh * 8;
    if (key >= p.seqlen_k) continue;
    const int dk_width = kPadded ? p.head_dim : D, dv_width = kPadded ? p.head_dim_v : D;
    T* dk_row = static_cast<T*>(p.dk) + (kv_row_base + key) * dk_width + (lane & 3) * 2;
    T* dv_row = static_cast<T*>(p.dv) + (kv_row_base + key) * dv_width + (lane & 3) * 2;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
      if (!kPadded || dt * 8 < dk_width) {
        *reinterpret_cast<uint32_t*>(dk_row + dt * 8) =
            pack2<T>(acc_dk[dt][2 * hh] * dk_scale, acc_dk[dt][2 * hh + 1] * dk_scale);
      }
      if (!kPadded || dt * 8 < dv_width) {
        *reinterpret_cast<uint32_t*>(dv_row + dt * 8) =
            pack2<T>(acc_dv[dt][2 * hh], acc_dv[dt][2 * hh + 1]);
      }
    }
  }
}

// One block per SM (the whole register file for two warpgroups' accumulators).
template <typename Traits, typename T, bool kAtomicDq>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_bwd_sm90_kernel(const __grid_constant__ BwdParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  flash_bwd_sm90_block<Traits, T, kAtomicDq>(p);
#elif defined(__CUDA_ARCH__)
  __trap();  // wgmma exists on sm_90a only; the host never launches this elsewhere
#endif
}

// ---- Past head dim 128: the roles turned around (Sm90BwdWideTraits) --------------------------
// Keys in wgmma's M (above) would keep D registers of dK and dV per thread for the whole walk,
// 192 or 256: more than a thread has. So here the step's 64 queries are M, as in the forward, and
// dK and dV are computed transposed, the head dim in M (FlashAttention-3's layout past 128):
//   S = Q K_w^T and dP = dO V_w^T   warpgroup w's 32 of the block's 64 keys, K-major
//   P and dS, elementwise           rows = queries, in the mma.sync layout; both stored to shared
//                                   memory as [query][key] (fp32 P and dS die there)
//   dV^T += dO^T P                  warpgroup 0: v's head dim in 64-row tiles, dO and P MN-major
//   dK^T += Q^T dS                  warpgroup 1: q's head dim likewise, Q and dS MN-major
//   dQ = dS K                       dS K-major, K MN-major, 64 columns of dQ a chunk: the chunks
//                                   shared out so that both warpgroups issue as many MMAs a step
// A thread holds 64 x 64 / 128 = 32 accumulators a tile of dV^T (dK^T) for the whole walk: 128 at
// d=256, 96 at 192, 64 at v's 128 (warpgroup 0 then takes two chunks of dQ to warpgroup 1's one).
// dK and dV leave through shared memory, transposed back to rows of keys.
template <int kHeadDim_, int kHeadDimV_>
struct Sm90BwdWideTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr int kBlockN = 64;  // keys per block: 32 per warpgroup in S and dP
  static constexpr int kBlockM = 64;  // queries per step
  static constexpr int kNThreads = 256;
  // K, V, Q and dO (two buffers each), P and dS [kBlockM][kBlockN], lse and delta (two buffers
  // each). dK and dV are staged in Q's and dO's buffers at the end.
  static constexpr int kTileBytes =
      (kBlockN + 2 * kBlockM) * (kHeadDim + kHeadDimV) * 2 + 2 * kBlockM * kBlockN * 2;
  // + two mbarriers where Q and dO come by TMA (FLASHMOE_BWD_WIDE_TMA), after lse and delta
  static constexpr int kSmemBytes = kTileBytes + 4 * kBlockM * 4 + 16 * FLASHMOE_BWD_WIDE_QDO_TMA;
  // Rows of the staged dK (dV): padded by 8 elements, so the transposing stores hit 32 banks.
  static constexpr int kStagePitch = kHeadDim + 8, kStagePitchV = kHeadDimV + 8;
  static_assert((kHeadDim == 192 || kHeadDim == 256) &&
                    (kHeadDimV == kHeadDim || (kHeadDim == 192 && kHeadDimV == 128)),
                "head dims 192 and 256 (v's equal), or 192 with v's 128");
  static_assert(kBlockN * (kStagePitch + kStagePitchV) <= 2 * kBlockM * (kHeadDim + kHeadDimV),
                "dK and dV must fit Q's and dO's buffers");
  static constexpr bool kPadded = false;
};

// kRole: the warpgroup's (0: dV^T, 1: dK^T) where the two hold different numbers of tiles (v's
// 128 under 192: each warpgroup runs its own copy of the walk, so no wgmma sits in a branch that
// splits a warpgroup's accumulators); -1 where they are equal (one copy, the role read at run
// time).
template <typename Traits, typename T, bool kAtomicDq, int kRole>
__device__ __forceinline__ void flash_bwd_sm90_wide_block(const BwdParams& p) {
  constexpr int D = Traits::kHeadDim, DV = Traits::kHeadDimV;
  constexpr int BM = Traits::kBlockM, BN = Traits::kBlockN, kThreads = Traits::kNThreads;
  constexpr int kTilesK = D / 64, kTilesV = DV / 64;
  static_assert(kRole >= 0 || kTilesK == kTilesV, "a role per warpgroup where the tiles differ");
  constexpr int kTiles = kRole == 0 ? kTilesV : kTilesK;  // this warpgroup's
  // dQ's 64-column chunks [0, kDqSplit) are warpgroup 0's (dV^T's), the rest warpgroup 1's (dK^T's)
  constexpr int kDqSplit = (2 * kTilesK - kTilesV) / 2;

  extern __shared__ __align__(1024) uint4 smem_buf[];
  T* sK = reinterpret_cast<T*>(smem_buf);
  T* sV = sK + BN * D;
  T* sQ = sV + BN * DV;                                   // [2][BM x D]
  T* sdO = sQ + 2 * BM * D;                               // [2][BM x DV]
  T* sP = sdO + 2 * BM * DV;                              // [BM queries][BN keys]
  T* sdS = sP + BM * BN;                                  // [BM queries][BN keys]
  float* sLse = reinterpret_cast<float*>(sdS + BM * BN);  // [2][BM]
  float* sDelta = sLse + 2 * BM;                          // [2][BM]
#if FLASHMOE_BWD_WIDE_QDO_TMA
  // Q and dO by TMA (p.wide_tma): buffer s's copies complete its mbarrier, whose k-th phase is
  // the buffer's k-th step (steps s, s + 2, ...)
  uint64_t* qdo_full = reinterpret_cast<uint64_t*>(sDelta + 2 * BM);  // [2]
  const bool qdo_tma = p.wide_tma;
#endif

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int wg = kRole >= 0 ? kRole : warp / 4;
  // the block's barrier: named where each warpgroup runs its own copy (sm90::block_sync)
  auto sync_block = [] {
    if constexpr (kRole >= 0)
      sm90::block_sync<kThreads>();
    else
      __syncthreads();
  };
  // The block's key block and (batch, KV head) pair: the grid's x and y, or as the 128 tile takes
  // them on the longest-first 1-D grid (FLASHMOE_BWD_WIDE_LPT: p.lpt_pairs).
  unsigned grid_n = blockIdx.x, grid_pair = blockIdx.y;  // (unsigned, as the grid's indices)
#if FLASHMOE_BWD_WIDE_LPT_ON
  if constexpr (kAtomicDq) {
    if (p.lpt_pairs > 0) {
      const int n_blocks = ceil_div(p.seqlen_k, BN), pairs = p.batch * p.heads_kv;
      const int first = int(blockIdx.x) / (p.lpt_pairs * n_blocks) * p.lpt_pairs;
      const int count = min(p.lpt_pairs, pairs - first), i = int(blockIdx.x) - first * n_blocks;
      grid_n = i / count;
      grid_pair = first + i % count;
    }
  }
#endif
  const int n0 = grid_n * BN;
  const int b = grid_pair / p.heads_kv, hkv = grid_pair % p.heads_kv;
  const int offset = p.seqlen_k - p.seqlen_q;
  const int2 query_blocks = bwd_query_blocks<BM, BN>(p, n0, offset);
  const int m_begin = query_blocks.x, m_end = query_blocks.y;

  const T* k_base = static_cast<const T*>(p.k) + b * p.k_batch_stride + hkv * p.k_head_stride;
  const T* v_base = static_cast<const T*>(p.v) + b * p.v_batch_stride + hkv * p.v_head_stride;
  load_kv_tile<D, BN, kThreads, /*kPanels=*/true>(sK, k_base, p.k_row_stride, n0, p.seqlen_k, D / 8,
                                                  tid);
  load_kv_tile<DV, BN, kThreads, /*kPanels=*/true>(sV, v_base, p.v_row_stride, n0, p.seqlen_k,
                                                   DV / 8, tid);
  cp_async_commit();

  const int group = planted(5) ? 1 : p.heads_ratio;
  const int m_count = max(0, m_end - m_begin), steps = group * m_count;
  auto step_head = [&](int step) { return hkv * p.heads_ratio + step / m_count; };
  auto step_m0 = [&](int step) { return (m_begin + step % m_count) * BM; };
#if FLASHMOE_BWD_WIDE_QDO_TMA
  // a step's Q and dO by TMA: whole boxes, rows past Sq zero-filled; the panels as load_kv_tile
  // lays them
  auto copy_step = [&](int step) {
    const int buf = step & 1, h = step_head(step), m0 = step_m0(step);
    if (tid == 0) {
      sm90::mbar_arrive_expect_tx(&qdo_full[buf], uint32_t(BM * (D + DV) * 2));
      sm90::tma_load_5d(sQ + buf * BM * D, p.tma_q, &qdo_full[buf], 0, m0, 0, h, b);
      sm90::tma_load_5d(sdO + buf * BM * DV, p.tma_do, &qdo_full[buf], 0, m0, 0, h, b);
    }
  };
  // planted 29, a read before the copy lands: no wait, and the step's copies issued only once its
  // S and dP products have read the buffers (so the read is early every time, not by chance). The
  // copy still completes its phase at the step's end, before the buffer is armed again and before
  // the block ends: a barrier armed again mid-phase, or a copy landing in the next block's shared
  // memory, would hang a later wait instead of failing the gates.
  const bool late_copy = qdo_tma && planted(29);
#endif
  auto issue_step = [&](int step) {
    const int buf = step & 1, h = step_head(step), m0 = step_m0(step);
#if FLASHMOE_BWD_WIDE_QDO_TMA
    if (qdo_tma) {
      if (!late_copy) copy_step(step);
    } else
#endif
    {
      const T* q_base = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride;
      const T* do_base =
          static_cast<const T*>(p.dout) + b * p.do_batch_stride + h * p.do_head_stride;
      load_kv_tile<D, BM, kThreads, true>(sQ + buf * BM * D, q_base, p.q_row_stride, m0, p.seqlen_q,
                                          D / 8, tid);
      load_kv_tile<DV, BM, kThreads, true>(sdO + buf * BM * DV, do_base, p.do_row_stride, m0,
                                           p.seqlen_q, DV / 8, tid);
      cp_async_commit();
    }
    if (tid < BM) {
      const int64_t row = (int64_t(b) * p.heads_q + h) * p.seqlen_q + m0 + tid;
      const bool valid = m0 + tid < p.seqlen_q;
      sLse[buf * BM + tid] = valid ? p.lse2[row] : INFINITY;
      sDelta[buf * BM + tid] = valid ? p.delta[row] : 0.f;
    }
  };

  // Descriptors. S and dP: the step's Q (dO) as A, this warpgroup's 32 keys of K (V) as B, both
  // K-major. dV^T (dK^T): dO^T's (Q^T's) 64-column panel t as A and P (dS) as B, both MN-major (the
  // queries are the reduction). dQ: dS as A, K-major, and K's panel c as B, MN-major.
  const uint64_t q_desc = sm90::desc_k_major(smem_u32(sQ));
  const uint64_t do_desc = sm90::desc_k_major(smem_u32(sdO));
  const uint64_t k_desc = sm90::desc_k_major(smem_u32(sK + wg * 32 * 64));
  const uint64_t v_desc = sm90::desc_k_major(smem_u32(sV + wg * 32 * 64));
  constexpr uint64_t kQBufStep = uint64_t((BM * D * 2) >> 4),
                     kDoBufStep = uint64_t((BM * DV * 2) >> 4);
  // Warpgroup 0 accumulates dV^T from dO and P, warpgroup 1 dK^T from Q and dS.
  const uint64_t kv_a_desc =
      wg == 0 ? sm90::desc_mn_major<BM>(smem_u32(sdO)) : sm90::desc_mn_major<BM>(smem_u32(sQ));
  const uint64_t kv_a_buf_step = wg == 0 ? kDoBufStep : kQBufStep;
  constexpr uint64_t kPanelStep = uint64_t((BM * 64 * 2) >> 4);  // the next 64-column panel
  const uint64_t kv_b_desc = sm90::desc_mn_major<BM>(smem_u32(wg == 0 ? sP : sdS));
  const uint64_t ds_desc = sm90::desc_k_major(smem_u32(sdS));
  const uint64_t kt_desc = sm90::desc_mn_major<BN>(smem_u32(sK));
  constexpr uint64_t kKPanelStep = uint64_t((BN * 64 * 2) >> 4);
  const int dq_first = wg == 0 ? 0 : kDqSplit, dq_last = wg == 0 ? kDqSplit : kTilesK;

  const int row_in_wg = 16 * (warp % 4) + lane / 4;  // + 8 * (e / 2): accumulator rows
  const int key_col0 = 32 * wg + (lane & 3) * 2;     // + 8 * nt + e % 2: S's and dP's columns

  float acc[kTiles][8][4];  // dV^T (warpgroup 0) or dK^T (1): tile t is head-dim rows [64t, 64t+64)
#pragma unroll
  for (int t = 0; t < kTiles; ++t)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        acc[t][nt][e] = 0.f;

#if FLASHMOE_BWD_WIDE_QDO_TMA
  if (qdo_tma) {
    if (tid == 0) {
      sm90::prefetch_tensor_map(p.tma_q);
      sm90::prefetch_tensor_map(p.tma_do);
      sm90::mbar_init(&qdo_full[0], 1);  // the copying thread's expect_tx
      sm90::mbar_init(&qdo_full[1], 1);
      sm90::mbar_init_fence();
    }
    sync_block();
  }
#endif
#if FLASHMOE_BWD_WIDE_PIPE_ON
  // bwd v5.12 (FLASHMOE_BWD_WIDE_PIPE): step + 1's S and dP issued under this step's dQ, so that
  // the tensor cores run them while the warpgroup stages its dQ chunks and meets the step's
  // barrier. Where the accumulators leave room (d=192 and (192, 128): dK^T's three tiles, S, dP
  // and a dQ chunk live at once) and Q and dO come by TMA; elsewhere the loop below.
  // S = Q K^T and dP = dO V^T of `step`, this warpgroup's 32 keys: two wgmma groups
  auto issue_products = [&](int step, float (&acc_s)[4][4], float (&acc_dp)[4][4]) {
    const int buf = step & 1;
    sm90::fence_operands(acc_s);
    sm90::fence_operands(acc_dp);
    sm90::fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      sm90::mma_ss<32, T>(acc_s, q_desc + buf * kQBufStep + sm90::k_major_step<BM>(kk),
                          k_desc + sm90::k_major_step<BN>(kk), kk > 0);
    sm90::commit_group();
#pragma unroll
    for (int kk = 0; kk < DV / 16; ++kk)
      sm90::mma_ss<32, T>(acc_dp, do_desc + buf * kDoBufStep + sm90::k_major_step<BM>(kk),
                          v_desc + sm90::k_major_step<BN>(kk), kk > 0);
    sm90::commit_group();
  };
  // P and dS of `step` from its S and dP (waiting for both groups), in acc_s and acc_dp
  auto softmax_step = [&](int step, float (&acc_s)[4][4], float (&acc_dp)[4][4]) {
    const int buf = step & 1, m0 = step_m0(step);
    // P = exp2(S * scale_log2 - lse2) with keys past the end and outside the window at 0, then
    // dS = P (dP - delta); this thread's rows are queries row_in_wg and row_in_wg + 8.
    const bool need_mask = bwd_step_needs_mask<BM, BN>(p, n0, m0, offset);
    const float lse[2] = {sLse[buf * BM + row_in_wg], sLse[buf * BM + row_in_wg + 8]};
    const float delta[2] = {sDelta[buf * BM + row_in_wg], sDelta[buf * BM + row_in_wg + 8]};
    auto probs = [&](auto mask, auto capped) {
      constexpr bool kMask = decltype(mask)::value, kCapped = decltype(capped)::value;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float prob = exp2f(fmaf(acc_s[nt][e], p.scale_log2, -lse[e >> 1]));
          if constexpr (kMask) {
            const int key = n0 + key_col0 + nt * 8 + (e & 1);
            const int i = m0 + row_in_wg + (e >> 1) * 8;
            if (key >= window_key_end(p, i, offset, p.seqlen_k) ||
                key < window_first_key(p, i, offset))
              prob = 0.f;
          }
          acc_s[nt][e] = prob;
          if constexpr (kCapped) acc_dp[nt][e] *= prob;
        }
    };
    if (p.softcap > 0.f) {  // both products first: dS needs t, which P replaces
      sm90::wait_group<0>();
      sm90::fence_operands(acc_s);
      sm90::fence_operands(acc_dp);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        apply_softcap(acc_s[nt], p);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float t = acc_s[nt][e];
          acc_dp[nt][e] = (acc_dp[nt][e] - delta[e >> 1]) * (1.f - t * t);
        }
      }
      if (need_mask)
        probs(BoolConstant<true>{}, BoolConstant<true>{});
      else
        probs(BoolConstant<false>{}, BoolConstant<true>{});
    } else {  // P while dP is still running
      sm90::wait_group<1>();
      sm90::fence_operands(acc_s);
      if (need_mask)
        probs(BoolConstant<true>{}, BoolConstant<false>{});
      else
        probs(BoolConstant<false>{}, BoolConstant<false>{});
      sm90::wait_group<0>();
      sm90::fence_operands(acc_dp);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          acc_dp[nt][e] = acc_s[nt][e] * (acc_dp[nt][e] - delta[e >> 1]);
    }
  };
  // P and dS to shared memory as [query][key] (conflict-free: the 8 rows of one store
  // instruction land in 8 different chunks).
  auto store_p_ds = [&](const float (&acc_s)[4][4], const float (&acc_dp)[4][4]) {
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int at = swizzle_panels<BM>(row_in_wg + 8 * hh, 4 * wg + nt) + (lane & 3) * 2;
        *reinterpret_cast<uint32_t*>(sP + at) = pack2<T>(acc_s[nt][2 * hh], acc_s[nt][2 * hh + 1]);
        *reinterpret_cast<uint32_t*>(sdS + at) =
            pack2<T>(acc_dp[nt][2 * hh], acc_dp[nt][2 * hh + 1]);
      }
    sm90::fence_proxy_async();  // this thread's P and dS stores, visible to the tensor cores
  };
  // dV^T += dO^T P (warpgroup 0), dK^T += Q^T dS (1): the step's queries as the reduction.
  // planted 25: dK^T's every tile reads Q's first panel (the columns of dK past 64 wrong)
  auto issue_dkv = [&](int buf) {
#pragma unroll
    for (int t = 0; t < kTiles; ++t)
      sm90::fence_operands(acc[t]);
    sm90::fence();
#pragma unroll
    for (int t = 0; t < kTiles; ++t) {
      const int panel = wg == 1 && planted(25) ? 0 : t;
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk)
        sm90::mma_ss<64, T, /*kMnMajor=*/true>(
            acc[t], kv_a_desc + buf * kv_a_buf_step + panel * kPanelStep + sm90::mn_major_step(kk),
            kv_b_desc + sm90::mn_major_step(kk), 1);
    }
    sm90::commit_group();
  };
  constexpr bool kPipe = kAtomicDq && kTilesK <= 3;
  static_assert(!kPipe || (kDqSplit >= 1 && kTilesK - kDqSplit >= 1),
                "each warpgroup has a dQ chunk: the last one's product goes before step + 1's");
  if (kPipe && qdo_tma && steps > 0) {
    float acc_s[4][4], acc_dp[4][4];  // issued a step ahead
    // Waited for where no wgmma runs: a spin loop among in-flight groups serializes them (ptxas).
    auto wait_landed = [&](int step) {
      if (!late_copy) sm90::mbar_wait(&qdo_full[step & 1], (step >> 1) & 1);
    };
    // Planted 29 (no wait): the step's copies issued once its products have read the buffers.
    auto products = [&](int step) {
      issue_products(step, acc_s, acc_dp);
      if (late_copy) {
        sm90::wait_group<0>();
        sm90::fence_operands(acc_s);
        sm90::fence_operands(acc_dp);
        copy_step(step);
        sm90::mbar_wait(&qdo_full[step & 1], (step >> 1) & 1);
      }
    };
    constexpr int kMostChunks = kDqSplit > kTilesK - kDqSplit ? kDqSplit : kTilesK - kDqSplit;
    const bool leader = tid % 128 == 0;
    // planted 6: the last key block never reaches dQ
    const bool add_dq = !planted(6) || int(grid_n) != ceil_div(p.seqlen_k, BN) - 1;
    issue_step(0);
    if (steps > 1) issue_step(1);
    cp_async_wait<0>();
    sm90::fence_proxy_async();
    sync_block();  // K and V have landed; steps 0 and 1's lse and delta are written
    wait_landed(0);
    products(0);
    // dQ chunk c's product, then (dq_out) its stage and TMA reduce-add, as in the loop below
    auto dq_product = [&](int c, float (&acc_dq)[8][4]) {
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          acc_dq[nt][e] = 0.f;
      sm90::fence_operands(acc_dq);
      sm90::fence();
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk)
        sm90::mma_ss<64, T, /*kMnMajor=*/false, /*kMnMajorB=*/true>(
            acc_dq, ds_desc + sm90::k_major_step<BM>(kk),
            kt_desc + c * kKPanelStep + sm90::mn_major_step(kk), kk > 0);
      sm90::commit_group();
    };
    auto dq_out = [&](int c, int step, float (&acc_dq)[8][4]) {
      sm90::fence_operands(acc_dq);
      const int buf = step & 1;
      float* stage = reinterpret_cast<float*>(wg == 0 ? sdO + buf * BM * DV : sQ + buf * BM * D);
      stage_dq_chunk(stage, acc_dq, wg, leader, row_in_wg, lane);
      if (leader && add_dq) {
        const int bh = b * p.heads_q + step_head(step);
#pragma unroll
        for (int box = 0; box < 2; ++box)
          sm90::tma_reduce_add_3d(p.dq_map, stage + box * 64 * 32, c * 64 + box * 32, step_m0(step),
                                  bh);
        sm90::bulk_commit_group();
      }
    };
    // One step; kAhead: a step follows, whose products go in under this one's last dQ chunk.
    // Compile-time, as is the last chunk's place: a wgmma on a path the compiler cannot prove
    // uniform, or a register of an accumulator written while one runs, serializes them (ptxas).
    auto run_step = [&](int step, auto ahead) {
      constexpr bool kAhead = decltype(ahead)::value;
      softmax_step(step, acc_s, acc_dp);
      store_p_ds(acc_s, acc_dp);
      sync_block();  // A: P and dS are whole (step - 1's readers of them passed barrier B)
      if constexpr (kAhead)
        wait_landed(step + 1);  // issued after step - 1's barrier B (or before step 0)
      issue_dkv(step & 1);
#pragma unroll 1
      for (int c = dq_first; c < dq_last - 1; ++c) {  // all but the last of this warpgroup's
        float acc_dq[8][4];
        dq_product(c, acc_dq);
        sm90::wait_group<0>();
        dq_out(c, step, acc_dq);
      }
      {
        float acc_dq[8][4];
        dq_product(dq_last - 1, acc_dq);
        if constexpr (kAhead) {
          products(step + 1);
          sm90::wait_group<2>();  // dV^T (dK^T) and the chunk; step + 1's S and dP run on
        } else {
          sm90::wait_group<0>();
        }
        dq_out(dq_last - 1, step, acc_dq);
      }
      // as many named barriers as the other warpgroup (the loop below says why)
      for (int c = dq_last - dq_first; c < kMostChunks; ++c) {
        sm90::warpgroup_sync(1 + wg);
        sm90::warpgroup_sync(1 + wg);
      }
      if (leader) sm90::bulk_wait_group_read<0>();  // the stages read before step + 2's copies
#pragma unroll
      for (int t = 0; t < kTiles; ++t)
        sm90::fence_operands(acc[t]);
      sync_block();  // B: every warpgroup is done with P, dS and the step's Q and dO buffers
      if (step + 2 < steps) issue_step(step + 2);
    };
    for (int step = 0; step + 1 < steps; ++step)
      run_step(step, BoolConstant<true>{});
    run_step(steps - 1, BoolConstant<false>{});
  } else {
#endif
    if (steps > 0) issue_step(0);
    for (int step = 0; step < steps; ++step) {
      const int buf = step & 1, m0 = step_m0(step);
      cp_async_wait<0>();
      sm90::fence_proxy_async();
#if FLASHMOE_BWD_WIDE_QDO_TMA
      if (qdo_tma && !late_copy) sm90::mbar_wait(&qdo_full[buf], (step >> 1) & 1);
#endif
      sync_block();  // the step's tiles have landed; step - 1 is done with buf ^ 1, P and dS

      float acc_s[4][4], acc_dp[4][4];
      sm90::fence_operands(acc_s);
      sm90::fence_operands(acc_dp);
      sm90::fence();
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)
        sm90::mma_ss<32, T>(acc_s, q_desc + buf * kQBufStep + sm90::k_major_step<BM>(kk),
                            k_desc + sm90::k_major_step<BN>(kk), kk > 0);
      sm90::commit_group();
#pragma unroll
      for (int kk = 0; kk < DV / 16; ++kk)
        sm90::mma_ss<32, T>(acc_dp, do_desc + buf * kDoBufStep + sm90::k_major_step<BM>(kk),
                            v_desc + sm90::k_major_step<BN>(kk), kk > 0);
      sm90::commit_group();
      if (step + 1 < steps) issue_step(step + 1);

      // P = exp2(S * scale_log2 - lse2) with keys past the end and outside the window at 0, then
      // dS = P (dP - delta); this thread's rows are queries row_in_wg and row_in_wg + 8.
      const bool need_mask = bwd_step_needs_mask<BM, BN>(p, n0, m0, offset);
      const float lse[2] = {sLse[buf * BM + row_in_wg], sLse[buf * BM + row_in_wg + 8]};
      const float delta[2] = {sDelta[buf * BM + row_in_wg], sDelta[buf * BM + row_in_wg + 8]};
      auto probs = [&](auto mask, auto capped) {
        constexpr bool kMask = decltype(mask)::value, kCapped = decltype(capped)::value;
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float prob = exp2f(fmaf(acc_s[nt][e], p.scale_log2, -lse[e >> 1]));
            if constexpr (kMask) {
              const int key = n0 + key_col0 + nt * 8 + (e & 1);
              const int i = m0 + row_in_wg + (e >> 1) * 8;
              if (key >= window_key_end(p, i, offset, p.seqlen_k) ||
                  key < window_first_key(p, i, offset))
                prob = 0.f;
            }
            acc_s[nt][e] = prob;
            if constexpr (kCapped) acc_dp[nt][e] *= prob;
          }
      };
      if (p.softcap > 0.f) {  // both products first: dS needs t, which P replaces
        sm90::wait_group<0>();
        sm90::fence_operands(acc_s);
        sm90::fence_operands(acc_dp);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          apply_softcap(acc_s[nt], p);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float t = acc_s[nt][e];
            acc_dp[nt][e] = (acc_dp[nt][e] - delta[e >> 1]) * (1.f - t * t);
          }
        }
        if (need_mask)
          probs(BoolConstant<true>{}, BoolConstant<true>{});
        else
          probs(BoolConstant<false>{}, BoolConstant<true>{});
      } else {  // P while dP is still running
        sm90::wait_group<1>();
        sm90::fence_operands(acc_s);
        if (need_mask)
          probs(BoolConstant<true>{}, BoolConstant<false>{});
        else
          probs(BoolConstant<false>{}, BoolConstant<false>{});
        sm90::wait_group<0>();
        sm90::fence_operands(acc_dp);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            acc_dp[nt][e] = acc_s[nt][e] * (acc_dp[nt][e] - delta[e >> 1]);
      }
#if FLASHMOE_BWD_WIDE_QDO_TMA
      if (late_copy) copy_step(step);  // planted 29: after the products that should have waited
#endif
      // P and dS to shared memory as [query][key] (conflict-free: the 8 rows of one store
      // instruction land in 8 different chunks).
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int at = swizzle_panels<BM>(row_in_wg + 8 * hh, 4 * wg + nt) + (lane & 3) * 2;
          *reinterpret_cast<uint32_t*>(sP + at) =
              pack2<T>(acc_s[nt][2 * hh], acc_s[nt][2 * hh + 1]);
          *reinterpret_cast<uint32_t*>(sdS + at) =
              pack2<T>(acc_dp[nt][2 * hh], acc_dp[nt][2 * hh + 1]);
        }
      sm90::fence_proxy_async();  // this thread's P and dS stores, visible to the tensor cores
      sync_block();               // P and dS are whole (both warpgroups' keys)

      // dV^T += dO^T P (warpgroup 0), dK^T += Q^T dS (1): the step's queries as the reduction.
      // planted 25: dK^T's every tile reads Q's first panel (the columns of dK past 64 wrong)
#pragma unroll
      for (int t = 0; t < kTiles; ++t)
        sm90::fence_operands(acc[t]);
      sm90::fence();
#pragma unroll
      for (int t = 0; t < kTiles; ++t) {
        const int panel = wg == 1 && planted(25) ? 0 : t;
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk)
          sm90::mma_ss<64, T, /*kMnMajor=*/true>(
              acc[t],
              kv_a_desc + buf * kv_a_buf_step + panel * kPanelStep + sm90::mn_major_step(kk),
              kv_b_desc + sm90::mn_major_step(kk), 1);
      }
      sm90::commit_group();

      if constexpr (kAtomicDq) {
        // planted 6: the last key block never reaches dQ
        const bool add_dq = !planted(6) || int(grid_n) != ceil_div(p.seqlen_k, BN) - 1;
#if !FLASHMOE_BWD_WIDE_DQ_TMA
        const int64_t row_base = (int64_t(b) * p.heads_q + step_head(step)) * p.seqlen_q;
#endif
#pragma unroll
        for (int c = 0; c < kTilesK; ++c) {
          if (c < dq_first || c >= dq_last) continue;
          float acc_dq[8][4];
#pragma unroll
          for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
              acc_dq[nt][e] = 0.f;
          sm90::fence_operands(acc_dq);
          sm90::fence();
#pragma unroll
          for (int kk = 0; kk < BN / 16; ++kk)
            sm90::mma_ss<64, T, /*kMnMajor=*/false, /*kMnMajorB=*/true>(
                acc_dq, ds_desc + sm90::k_major_step<BM>(kk),
                kt_desc + c * kKPanelStep + sm90::mn_major_step(kk), kk > 0);
          sm90::commit_group();
          sm90::wait_group<0>();
          sm90::fence_operands(acc_dq);
#if FLASHMOE_BWD_WIDE_DQ_TMA
          // The 64 x 64 chunk through shared memory (stage_dq_chunk), then one TMA reduce-add a
          // box into dq_accum (rows past Sq lie outside the map). The stage is this step's dO
          // buffer (warpgroup 0) or Q buffer (1): their last reader, the warpgroup's own dV^T
          // (dK^T), is done (wait_group above), and step + 2's copies into them wait for the reads
          // (bulk_wait_group_read at the end of the step, before the next barrier).
          float* stage =
              reinterpret_cast<float*>(wg == 0 ? sdO + buf * BM * DV : sQ + buf * BM * D);
          const bool leader = tid % 128 == 0;
          stage_dq_chunk(stage, acc_dq, wg, leader, row_in_wg, lane);
          if (leader && add_dq) {
            const int bh = b * p.heads_q + step_head(step);
#pragma unroll
            for (int box = 0; box < 2; ++box)
              sm90::tma_reduce_add_3d(p.dq_map, stage + box * 64 * 32, c * 64 + box * 32, m0, bh);
            sm90::bulk_commit_group();
          }
#else
        if (add_dq) {
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const int i = m0 + row_in_wg + hh * 8;
            if (i >= p.seqlen_q) continue;
            float* dq_row = p.dq_accum + (row_base + i) * D + c * 64 + (lane & 3) * 2;
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
              atomicAdd(reinterpret_cast<float2*>(dq_row + nt * 8),
                        make_float2(acc_dq[nt][2 * hh], acc_dq[nt][2 * hh + 1]));
          }
        }
#endif
        }
#if FLASHMOE_BWD_WIDE_DQ_TMA
        // The warpgroup with fewer chunks (d=192: 1 and 2) meets its named barrier as often as the
        // other: where the counts differ, racecheck reports dK's staging against its copy out
        // across the __syncthreads that orders them.
        constexpr int kMostChunks = kDqSplit > kTilesK - kDqSplit ? kDqSplit : kTilesK - kDqSplit;
        for (int c = dq_last - dq_first; c < kMostChunks; ++c) {
          sm90::warpgroup_sync(1 + wg);
          sm90::warpgroup_sync(1 + wg);
        }
        // this step's reduces have read their stages before step + 2's copies may land there (the
        // next step's barrier orders every warpgroup's wait before any copy is issued)
        if (tid % 128 == 0) sm90::bulk_wait_group_read<0>();
#endif
      }
      sm90::wait_group<0>();
#pragma unroll
      for (int t = 0; t < kTiles; ++t)
        sm90::fence_operands(acc[t]);
#if FLASHMOE_BWD_WIDE_QDO_TMA
      if (late_copy) sm90::mbar_wait(&qdo_full[buf], (step >> 1) & 1);  // planted 29's copy landed
#endif
    }
#if FLASHMOE_BWD_WIDE_PIPE_ON
  }
#endif
  cp_async_wait<0>();  // no block leaves with copies in flight (no query block saw these keys)
#if FLASHMOE_BWD_WIDE_DQ_TMA
  if constexpr (kAtomicDq) {
    if (tid % 128 == 0) sm90::bulk_wait_group<0>();  // its dQ reduces done before the block ends
  }
#endif
  sync_block();  // every warpgroup is done with Q's and dO's buffers

  // dK^T (dV^T) transposed into shared memory as rows of keys, then copied out in 16-byte
  // chunks: contiguous [B, Hkv, Sk, head dim], keys past the end not written.
  const float dk_scale = planted(4) ? 1.f : p.softmax_scale;
  T* sdK = sQ;
  T* sdV = sdK + BN * Traits::kStagePitch;
  T* stage = wg == 0 ? sdV : sdK;
  const int pitch = wg == 0 ? Traits::kStagePitchV : Traits::kStagePitch;
  const float scale = wg == 0 ? 1.f : dk_scale;
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {  // keys `key` and key + 1 of head-dim row d
        const int d = 64 * t + row_in_wg + 8 * hh, key = nt * 8 + (lane & 3) * 2;
        const uint32_t two = pack2<T>(acc[t][nt][2 * hh] * scale, acc[t][nt][2 * hh + 1] * scale);
        auto* rows = reinterpret_cast<uint16_t*>(stage);
        rows[key * pitch + d] = uint16_t(two & 0xFFFFu);
        rows[(key + 1) * pitch + d] = uint16_t(two >> 16);
      }
  }
  sync_block();
  const int64_t kv_row_base = int64_t(grid_pair) * p.seqlen_k;  // b * heads_kv + hkv
  auto copy_out = [&](const T* from, int from_pitch, void* to, int width) {
    const int chunks = width / 8;
    for (int c = tid; c < BN * chunks; c += kThreads) {
      const int key = c / chunks, chunk = c % chunks;
      if (n0 + key >= p.seqlen_k) continue;
      *reinterpret_cast<uint4*>(static_cast<T*>(to) + (kv_row_base + n0 + key) * width +
                                chunk * 8) =
          *reinterpret_cast<const uint4*>(from + key * from_pitch + chunk * 8);
    }
  };
  copy_out(sdK, Traits::kStagePitch, p.dk, D);
  copy_out(sdV, Traits::kStagePitchV, p.dv, DV);
}

// Whether a backward traits type is the wide kernel's (the launch's longest-first grid).
template <typename Traits>
struct IsSm90BwdWide : std::false_type {};
template <int D, int Dv>
struct IsSm90BwdWide<Sm90BwdWideTraits<D, Dv>> : std::true_type {};

template <typename Traits, typename T, bool kAtomicDq>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_bwd_sm90_wide_kernel(const __grid_constant__ BwdParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if constexpr (Traits::kHeadDim == Traits::kHeadDimV) {
    flash_bwd_sm90_wide_block<Traits, T, kAtomicDq, -1>(p);
  } else if (threadIdx.x < 128) {
    flash_bwd_sm90_wide_block<Traits, T, kAtomicDq, 0>(p);
  } else {
    flash_bwd_sm90_wide_block<Traits, T, kAtomicDq, 1>(p);
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // wgmma exists on sm_90a only; the host never launches this elsewhere
#endif
}

}  // namespace flashmoe::cuda
