// FlashAttention-2-style backward pass on mma.sync tensor cores (sm_80 and newer).
//   1. flash_bwd_preprocess_kernel: delta_i = rowsum(dout_i * o_i) in fp32, the forward's
//      log-sum-exp copied in base 2 (read at any strides), and dq_accum zeroed.
//   2. flash_bwd_dkdv_kernel: each block owns one key block of one (batch, KV head) and walks the
//      query blocks of every query head of its GQA group, recomputing P from the forward's
//      log-sum-exp; dK and dV stay in fp32 registers for the whole walk, so a group's heads are
//      summed without atomics. dQ's share of each step (dS K) is added to dq_accum with fp32
//      atomics, unless the call is deterministic.
//   3. Either flash_bwd_convert_dq_kernel (dq = dq_accum * scale, in the input dtype), or for
//      deterministic calls flash_bwd_dq_kernel: each block owns one query block and walks the key
//      blocks, recomputing S and dP, so dQ is summed in a fixed order (two more matmuls, no
//      atomics: bit-identical over repeated calls).
// dS is kept unscaled; the softmax scale is applied once, to dK and dQ at the end.
#pragma once

#include "attention_params.h"
#include "flash_kernel_utils.cuh"

namespace flashmoe::cuda {

// One key block of kBlockN keys per thread block, walked against query blocks of kBlockM rows.
// Warps split the keys (each owns kKTiles tiles of 16 keys: its rows of dK and dV) for S^T, dP^T,
// dV and dK; for dQ = dS K they split the kBlockM query rows instead. With fewer keys than 16 a
// warp (wide heads, whose dK and dV rows would not fit one warp's registers), kColSplit warps
// share each 16 keys: each owns D / kColSplit columns of their dK and dV, computes S^T and dP^T
// for kBlockM / kColSplit of the queries, and P^T and dS^T meet in shared memory (as FA2
// does at d=256).
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_>
struct BwdTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kColSplit = kBlockN < 16 * kNWarps ? 16 * kNWarps / kBlockN : 1;
  static constexpr int kKTiles = kBlockN / (16 * kNWarps / kColSplit);
  static constexpr int kWarpCols = kHeadDim / kColSplit;    // of dK and dV
  static constexpr int kWarpQueries = kBlockM / kColSplit;  // of S^T and dP^T
  // dQ = dS K: the kBlockM / 16 query tiles go round the warps; with more warps than tiles, the
  // warps of one tile split its columns.
  static constexpr int kQRowTiles = kBlockM / 16;
  static constexpr int kQTiles = kQRowTiles >= kNWarps ? kQRowTiles / kNWarps : 1;
  static constexpr int kWarpsPerQTile = kQRowTiles >= kNWarps ? 1 : kNWarps / kQRowTiles;
  static constexpr int kDqCols = kHeadDim / kWarpsPerQTile;
  // ... 64 (or 48) columns at a time past d=128, so dQ's accumulator fits beside dK's and dV's.
  static constexpr int kDqChunkCols = kHeadDim <= 128 ? kDqCols : kDqCols % 64 == 0 ? 64 : 48;
  // K, V (kBlockN rows), Q, dO (kBlockM rows), dS^T (kBlockN x kBlockM), with kColSplit > 1 P^T
  // too, and the query block's log-sum-exp and delta.
  static constexpr int kSmemBytes = (2 * kBlockN + 2 * kBlockM) * kHeadDim * 2 +
                                    (kColSplit > 1 ? 2 : 1) * kBlockN * kBlockM * 2 +
                                    2 * kBlockM * 4;
  static_assert(kKTiles >= 1 && kBlockN == kKTiles * 16 * (kNWarps / kColSplit),
                "keys: 16 * key groups * k");
  static_assert(kColSplit == 1 || (kKTiles == 1 && kNWarps % kColSplit == 0 &&
                                   kWarpCols % 16 == 0 && kWarpQueries % 16 == 0),
                "a column split shares one 16-key tile among whole 16-column, 16-query parts");
  static_assert(kQRowTiles * kWarpsPerQTile == kQTiles * kNWarps && kDqCols % kDqChunkCols == 0 &&
                    kDqChunkCols % 16 == 0,
                "dQ's query tiles and column parts must cover the warps evenly");
  static_assert(kBlockM % 64 == 0 && kHeadDim % 64 == 0, "tiles must fit the swizzle");
};

// The deterministic dQ pass: kBlockM query rows per block (warps split them), kBlockN keys a step.
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_>
struct BwdDqTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kMTiles = kBlockM / (16 * kNWarps);
  static constexpr int kSmemBytes = (2 * kBlockM + 2 * kBlockN) * kHeadDim * 2;
  static_assert(kMTiles >= 1 && kBlockM == kMTiles * 16 * kNWarps, "rows: 16 * warps * k");
  static_assert(kBlockN % 16 == 0 && kHeadDim % 64 == 0, "tiles must fit the mma and swizzle");
};

// delta_i = sum_c dout[i, c] * o[i, c], one warp per row (b, h, i), and lse2_i, the forward's
// log-sum-exp in base 2 for P = exp2(s * scale_log2 - lse2), +inf for a row that saw no key (lse
// = -inf) so that its P is 0 and nothing flows back through it. With zero_dq, the row of dq_accum
// is zeroed for the atomics that follow.
template <typename T, int D>
__global__ void __launch_bounds__(128)
    flash_bwd_preprocess_kernel(const __grid_constant__ BwdParams p, bool zero_dq) {
  constexpr int kPerLane = D / 32;
  const int lane = threadIdx.x % 32;
  const int64_t rows = int64_t(p.batch) * p.heads_q * p.seqlen_q;
  const int64_t row = int64_t(blockIdx.x) * 4 + threadIdx.x / 32;
  if (row >= rows) return;
  const int i = int(row % p.seqlen_q);
  const int h = int((row / p.seqlen_q) % p.heads_q);
  const int b = int(row / (int64_t(p.seqlen_q) * p.heads_q));
#if FLASHMOE_BWD_WS
  // the warp-specialized tile's dQ order: each query block's counter zeroed by its first row
  if (p.dq_order != nullptr && lane == 0 && i % p.dq_order_rows == 0) {
    p.dq_order[(int64_t(b) * p.heads_q + h) * ceil_div(p.seqlen_q, p.dq_order_rows) +
               i / p.dq_order_rows] = 0;
  }
#endif
  const T* o_row = static_cast<const T*>(p.o) + b * p.o_batch_stride + h * p.o_head_stride +
                   i * p.o_row_stride + lane * kPerLane;
  const T* do_row = static_cast<const T*>(p.dout) + b * p.do_batch_stride + h * p.do_head_stride +
                    i * p.do_row_stride + lane * kPerLane;
  float sum = 0.f;
  // Over v's head dim: on a wider tile the lanes past it read nothing.
  const int width = planted(15) ? p.head_dim : p.head_dim_v;  // planted: over q's and k's width
#pragma unroll
  for (int e = 0; e < kPerLane; ++e)
    if (lane * kPerLane + e < width) sum += float(o_row[e]) * float(do_row[e]);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2)
    sum += __shfl_xor_sync(0xffffffff, sum, offset);
  if (lane == 0) {
    p.delta[row] = sum;
    const float lse = p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + i * p.lse_row_stride];
    p.lse2[row] = lse == -INFINITY ? INFINITY : lse * 1.4426950408889634f;
    // The sink's share of d(loss)/d(sinks[h]): -P_sink * delta_i, P_sink = exp(sink - lse_i); one
    // value a row, summed over the rows on the host (deterministic, the same every call).
    if (p.sinks != nullptr && !planted(22)) {  // planted 22: the sinks' gradient never accumulated
      p.dsinks[row] = lse == -INFINITY ? 0.f : -expf(p.sinks[h] - lse) * sum;
    }
  }
  if (zero_dq) {
    float* dq_row = p.dq_accum + row * D + lane * kPerLane;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e)
      dq_row[e] = 0.f;
  }
}

// The pre-pass's base-2 log-sum-exp of a row; +inf for rows past the sequence end (P = 0).
__device__ __forceinline__ float lse_base2(const BwdParams& p, int64_t row, bool valid) {
  return valid ? p.lse2[row] : INFINITY;
}

template <typename Traits, typename T, bool kAtomicDq>
__device__ __forceinline__ void flash_bwd_dkdv_block(const BwdParams& p) {
  constexpr int D = Traits::kHeadDim, BM = Traits::kBlockM, BN = Traits::kBlockN;
  constexpr int KT = Traits::kKTiles, QT = Traits::kQTiles;
  constexpr int kThreads = Traits::kNThreads, kSplit = Traits::kColSplit;
  // This warp's share of a step: its queries of S^T and dP^T (MN n-tiles), its columns of dK and
  // dV (WDT n-tiles); all of them without a column split.
  constexpr int MN = Traits::kWarpQueries / 8, WDT = Traits::kWarpCols / 8;

  extern __shared__ __align__(256) uint4 smem_buf[];  // swizzle_step needs 256-byte alignment
  T* sK = reinterpret_cast<T*>(smem_buf);
  T* sV = sK + BN * D;
  T* sQ = sV + BN * D;
  T* sdO = sQ + BM * D;
  T* sdS = sdO + BM * D;  // dS^T: [BN keys][BM queries]
  // P^T [BN][BM] (column split only), then the query block's log-sum-exp and delta.
  T* sP = sdS + BN * BM;
  float* sLse = reinterpret_cast<float*>(sdS + (kSplit > 1 ? 2 : 1) * BN * BM);
  float* sDelta = sLse + BM;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int n0 = blockIdx.x * BN;
  const int b = blockIdx.y / p.heads_kv, hkv = blockIdx.y % p.heads_kv;
  const int offset = p.seqlen_k - p.seqlen_q;  // causal: query i sees keys j <= i + offset
  const int2 query_blocks = bwd_query_blocks<BM, BN>(p, n0, offset);
  const int m_begin = query_blocks.x, m_end = query_blocks.y;

  const T* k_base = static_cast<const T*>(p.k) + b * p.k_batch_stride + hkv * p.k_head_stride;
  const T* v_base = static_cast<const T*>(p.v) + b * p.v_batch_stride + hkv * p.v_head_stride;
  load_kv_tile<D, BN, kThreads>(sK, k_base, p.k_row_stride, n0, p.seqlen_k, p.head_dim / 8, tid);
  load_kv_tile<D, BN, kThreads>(sV, v_base, p.v_row_stride, n0, p.seqlen_k, p.head_dim_v / 8, tid);
  cp_async_commit();

  // This warp's keys within the block (dK and dV rows), and with a column split its part: the
  // first of its query tiles (16 rows) and of its column tiles (16 columns).
  const int key_row0 = warp / kSplit * 16 * KT;
  const int part = warp % kSplit;
  const int q_tile0 = part * (MN / 2), d_tile0 = part * (WDT / 2);
  // ldmatrix base addresses (see swizzle_step). K and V as A operands (this warp's keys x d), Q
  // and dO as B operands with d as the reduction (S^T = K Q^T, dP^T = V dO^T), Q and dO
  // transposed as B operands with the queries as the reduction (dV += P^T dO, dK += dS^T Q), dS^T
  // transposed as the A operand of dQ = dS K and K transposed as its B operand.
  const uint32_t k_a = smem_u32(sK + swizzle<D>(key_row0 + (lane & 15), lane >> 4));
  const uint32_t v_a = smem_u32(sV + swizzle<D>(key_row0 + (lane & 15), lane >> 4));
  const int b_row = (lane & 7) + (lane >> 4) * 8, b_chunk = (lane >> 3) & 1;
  const uint32_t q_b = smem_u32(sQ + swizzle<D>(b_row, b_chunk));
  const uint32_t do_b = smem_u32(sdO + swizzle<D>(b_row, b_chunk));
  const int t_row = (lane & 7) + ((lane >> 3) & 1) * 8, t_chunk = lane >> 4;
  const uint32_t q_t = smem_u32(sQ + swizzle<D>(t_row, t_chunk));
  const uint32_t do_t = smem_u32(sdO + swizzle<D>(t_row, t_chunk));

  float acc_dk[KT][WDT][4], acc_dv[KT][WDT][4];
#pragma unroll
  for (int kt = 0; kt < KT; ++kt)
#pragma unroll
    for (int dt = 0; dt < WDT; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        acc_dk[kt][dt][e] = acc_dv[kt][dt][e] = 0.f;

  // planted 5: only the group's first query head reaches dK and dV
  const int group = planted(5) ? 1 : p.heads_ratio;
  // The steps run over (query head of the group, query block) in one sequence, so the next step's
  // Q and dO can be issued while this one computes dQ, whichever head it belongs to.
  const int m_count = max(0, m_end - m_begin), steps = group * m_count;
  // What a step needs beyond the matmuls (its batch, query head and first row, the addresses of
  // its copies, dS^T stores and dQ operands) is derived where it is used from fresh reads of the
  // block and thread index (opaque_*), not hoisted out of the loop and held in registers through
  // the matmuls: at d = 128 the accumulators leave no room for it (it spilled).
  struct StepCoords {
    int b, h, m0;
  };
  auto step_coords = [&](int step) {
    const int y = opaque_block_y();  // b * heads_kv + hkv
    return StepCoords{y / p.heads_kv, y % p.heads_kv * p.heads_ratio + step / m_count,
                      (m_begin + step % m_count) * BM};
  };
  auto issue_step = [&](int step) {
    const int t = opaque_thread_x();
    const StepCoords at = step_coords(step);
    const T* q_base = static_cast<const T*>(p.q) + at.b * p.q_batch_stride + at.h * p.q_head_stride;
    const T* do_base =
        static_cast<const T*>(p.dout) + at.b * p.do_batch_stride + at.h * p.do_head_stride;
    load_kv_tile<D, BM, kThreads>(sQ, q_base, p.q_row_stride, at.m0, p.seqlen_q, p.head_dim / 8, t);
    load_kv_tile<D, BM, kThreads>(sdO, do_base, p.do_row_stride, at.m0, p.seqlen_q,
                                  p.head_dim_v / 8, t);
    cp_async_commit();
    const int64_t row_base = (int64_t(at.b) * p.heads_q + at.h) * p.seqlen_q;
#pragma unroll
    for (int r0 = 0; r0 < BM; r0 += kThreads) {  // a compile-time trip count: t is opaque
      const int r = r0 + t;
      if (r >= BM) break;
      const bool valid = at.m0 + r < p.seqlen_q;
      sLse[r] = lse_base2(p, row_base + at.m0 + r, valid);
      sDelta[r] = valid ? p.delta[row_base + at.m0 + r] : 0.f;
    }
  };
  if (steps > 0) issue_step(0);
  for (int step = 0; step < steps; ++step) {
    {
      const int m0 = (m_begin + step % m_count) * BM;
      cp_async_wait<0>();
      __syncthreads();  // Q, dO, lse and delta of this step have landed (K and V too, at first)
      // Keys past the end or above the causal diagonal: only the tail block and the diagonal
      // blocks need the per-element mask (rows past the end have P = 0 through their lse).
      const bool need_mask = bwd_step_needs_mask<BM, BN>(p, n0, m0, offset);

      // S^T = K Q^T and dP^T = V dO^T: this warp's keys x its queries.
      float acc_s[KT][MN][4], acc_dp[KT][MN][4];
#pragma unroll
      for (int kt = 0; kt < KT; ++kt)
#pragma unroll
        for (int nt = 0; nt < MN; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            acc_s[kt][nt][e] = acc_dp[kt][nt][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t ak[KT][4], av[KT][4];
#pragma unroll
        for (int kt = 0; kt < KT; ++kt) {
          ldmatrix_x4(ak[kt], swizzle_step<D>(k_a, kt, kk));
          ldmatrix_x4(av[kt], swizzle_step<D>(v_a, kt, kk));
        }
#pragma unroll
        for (int np = 0; np < MN / 2; ++np) {
          uint32_t bq[4], bdo[4];
          ldmatrix_x4(bq, swizzle_step<D>(q_b, q_tile0 + np, kk));
          ldmatrix_x4(bdo, swizzle_step<D>(do_b, q_tile0 + np, kk));
#pragma unroll
          for (int kt = 0; kt < KT; ++kt) {
            mma_16816<T>(acc_s[kt][2 * np], ak[kt], bq[0], bq[1]);
            mma_16816<T>(acc_s[kt][2 * np + 1], ak[kt], bq[2], bq[3]);
            mma_16816<T>(acc_dp[kt][2 * np], av[kt], bdo[0], bdo[1]);
            mma_16816<T>(acc_dp[kt][2 * np + 1], av[kt], bdo[2], bdo[3]);
          }
        }
      }

      // P^T = exp2(S^T * scale_log2 - lse2) with keys past the end and the causal mask at 0;
      // dS^T = P^T (dP^T - delta). The masked blocks (tail and diagonal) get their own copy of
      // the loop, and no exp2 sits behind a branch: a branch per element pinned each lse load to
      // its use, one shared-memory round trip per element (the loop's main stall).
      // With a softcap the score is t = tanh(s * softcap_scale) (apply_softcap: scale_log2 holds
      // the softcap) and dS gains the tanh's derivative, 1 - t^2 (the softmax scale comes in at
      // the end, as without): a pass before this one leaves t in S^T and (dP^T - delta) (1 - t^2)
      // in dP^T, so that this loop holds no more than without (kCapped: dS^T = P^T dP^T).
      auto p_and_ds = [&](auto mask, auto capped) {
        constexpr bool kMask = decltype(mask)::value, kCapped = decltype(capped)::value;
#pragma unroll
        for (int kt = 0; kt < KT; ++kt)
#pragma unroll
          for (int nt = 0; nt < MN; ++nt) {
            // this thread's two query columns
            const int col0 = q_tile0 * 16 + nt * 8 + (lane & 3) * 2;
            const float2 lse2 = *reinterpret_cast<const float2*>(sLse + col0);
            const float2 delta = *reinterpret_cast<const float2*>(sDelta + col0);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              float prob = exp2f(fmaf(acc_s[kt][nt][e], p.scale_log2, (e & 1) ? -lse2.y : -lse2.x));
              if constexpr (kMask) {
                const int key = n0 + key_row0 + kt * 16 + lane / 4 + (e >> 1) * 8;
                const int i = m0 + col0 + (e & 1);
                if (key >= window_key_end(p, i, offset, p.seqlen_k) ||
                    key < window_first_key(p, i, offset))
                  prob = 0.f;
              }
              acc_s[kt][nt][e] = prob;
              acc_dp[kt][nt][e] = kCapped
                                      ? prob * acc_dp[kt][nt][e]
                                      : prob * (acc_dp[kt][nt][e] - ((e & 1) ? delta.y : delta.x));
            }
          }
      };
      if (p.softcap > 0.f) {
#pragma unroll
        for (int kt = 0; kt < KT; ++kt)
#pragma unroll
          for (int nt = 0; nt < MN; ++nt) {
            apply_softcap(acc_s[kt][nt], p);
            const float2 delta =
                *reinterpret_cast<const float2*>(sDelta + q_tile0 * 16 + nt * 8 + (lane & 3) * 2);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float t = acc_s[kt][nt][e];
              acc_dp[kt][nt][e] =
                  (acc_dp[kt][nt][e] - ((e & 1) ? delta.y : delta.x)) * (1.f - t * t);
            }
          }
        if (need_mask)
          p_and_ds(BoolConstant<true>{}, BoolConstant<true>{});
        else
          p_and_ds(BoolConstant<false>{}, BoolConstant<true>{});
      } else if (need_mask) {
        p_and_ds(BoolConstant<true>{}, BoolConstant<false>{});
      } else {
        p_and_ds(BoolConstant<false>{}, BoolConstant<false>{});
      }

      if constexpr (kSplit == 1) {
        // Both to registers as 16-bit A operands (P^T for dV, dS^T for dK), and dS^T to shared
        // memory for dQ.
        uint32_t p_frag[KT][BM / 16][4], ds_frag[KT][BM / 16][4];
#pragma unroll
        for (int kt = 0; kt < KT; ++kt) {
#pragma unroll
          for (int j = 0; j < BM / 16; ++j) {
            p_frag[kt][j][0] = pack2<T>(acc_s[kt][2 * j][0], acc_s[kt][2 * j][1]);
            p_frag[kt][j][1] = pack2<T>(acc_s[kt][2 * j][2], acc_s[kt][2 * j][3]);
            p_frag[kt][j][2] = pack2<T>(acc_s[kt][2 * j + 1][0], acc_s[kt][2 * j + 1][1]);
            p_frag[kt][j][3] = pack2<T>(acc_s[kt][2 * j + 1][2], acc_s[kt][2 * j + 1][3]);
            ds_frag[kt][j][0] = pack2<T>(acc_dp[kt][2 * j][0], acc_dp[kt][2 * j][1]);
            ds_frag[kt][j][1] = pack2<T>(acc_dp[kt][2 * j][2], acc_dp[kt][2 * j][3]);
            ds_frag[kt][j][2] = pack2<T>(acc_dp[kt][2 * j + 1][0], acc_dp[kt][2 * j + 1][1]);
            ds_frag[kt][j][3] = pack2<T>(acc_dp[kt][2 * j + 1][2], acc_dp[kt][2 * j + 1][3]);
          }
          if constexpr (kAtomicDq) {
            const int t = opaque_thread_x(), t_lane = t % 32, t_row0 = t / 32 * 16 * KT;
#pragma unroll
            for (int nt = 0; nt < MN; ++nt)
#pragma unroll
              for (int hh = 0; hh < 2; ++hh) {
                const int row = t_row0 + kt * 16 + t_lane / 4 + hh * 8;
                *reinterpret_cast<uint32_t*>(sdS + swizzle<BM>(row, nt) + (t_lane & 3) * 2) =
                    pack2<T>(acc_dp[kt][nt][2 * hh], acc_dp[kt][nt][2 * hh + 1]);
              }
          }
        }

        // dV += P^T dO and dK += dS^T Q, the queries as the reduction.
#pragma unroll
        for (int j = 0; j < BM / 16; ++j) {
#pragma unroll
          for (int dp = 0; dp < D / 16; ++dp) {
            uint32_t bdo[4], bq[4];
            ldmatrix_x4_trans(bdo, swizzle_step<D>(do_t, j, dp));
            ldmatrix_x4_trans(bq, swizzle_step<D>(q_t, j, dp));
#pragma unroll
            for (int kt = 0; kt < KT; ++kt) {
              mma_16816<T>(acc_dv[kt][2 * dp], p_frag[kt][j], bdo[0], bdo[1]);
              mma_16816<T>(acc_dv[kt][2 * dp + 1], p_frag[kt][j], bdo[2], bdo[3]);
              mma_16816<T>(acc_dk[kt][2 * dp], ds_frag[kt][j], bq[0], bq[1]);
              mma_16816<T>(acc_dk[kt][2 * dp + 1], ds_frag[kt][j], bq[2], bq[3]);
            }
          }
        }
      } else {
        // P^T and dS^T of this warp's queries to shared memory, where the warps sharing its keys
        // read all of the block's queries as A operands.
#pragma unroll
        for (int nt = 0; nt < MN; ++nt)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const int row = key_row0 + lane / 4 + hh * 8, chunk = q_tile0 * 2 + nt;
            const int at = swizzle<BM>(row, chunk) + (lane & 3) * 2;
            *reinterpret_cast<uint32_t*>(sP + at) =
                pack2<T>(acc_s[0][nt][2 * hh], acc_s[0][nt][2 * hh + 1]);
            *reinterpret_cast<uint32_t*>(sdS + at) =
                pack2<T>(acc_dp[0][nt][2 * hh], acc_dp[0][nt][2 * hh + 1]);
          }
        __syncthreads();  // P^T and dS^T are whole

        // dV += P^T dO and dK += dS^T Q over this warp's columns, the queries as the reduction.
        const uint32_t p_a = smem_u32(sP + swizzle<BM>(key_row0 + (lane & 15), lane >> 4));
        const uint32_t ds_a = smem_u32(sdS + swizzle<BM>(key_row0 + (lane & 15), lane >> 4));
#pragma unroll
        for (int j = 0; j < BM / 16; ++j) {
          uint32_t ap[4], ads[4];
          ldmatrix_x4(ap, swizzle_step<BM>(p_a, 0, j));
          ldmatrix_x4(ads, swizzle_step<BM>(ds_a, 0, j));
#pragma unroll
          for (int dp = 0; dp < WDT / 2; ++dp) {
            uint32_t bdo[4], bq[4];
            ldmatrix_x4_trans(bdo, swizzle_step<D>(do_t, j, d_tile0 + dp));
            ldmatrix_x4_trans(bq, swizzle_step<D>(q_t, j, d_tile0 + dp));
            mma_16816<T>(acc_dv[0][2 * dp], ap, bdo[0], bdo[1]);
            mma_16816<T>(acc_dv[0][2 * dp + 1], ap, bdo[2], bdo[3]);
            mma_16816<T>(acc_dk[0][2 * dp], ads, bq[0], bq[1]);
            mma_16816<T>(acc_dk[0][2 * dp + 1], ads, bq[2], bq[3]);
          }
        }
      }

      __syncthreads();  // dS^T is whole; every warp is done with Q, dO, lse and delta
      if (step + 1 < steps) issue_step(step + 1);  // lands while dQ is computed
      if constexpr (kAtomicDq) {
        // planted 6: the last key block never reaches dQ
        const bool add_dq = !planted(6) || opaque_block_x() != ceil_div(p.seqlen_k, BN) - 1;
        // dQ += dS K for this warp's query rows (and columns), added to dq_accum kChunk columns
        // at a time. Shared memory holds the next step's Q and dO by now, but dS^T and K stay
        // until the next sync.
        constexpr int kCols = Traits::kDqCols, kChunk = Traits::kDqChunkCols, CT = kChunk / 8;
        const StepCoords at = step_coords(step);
        const int64_t row_base = (int64_t(at.b) * p.heads_q + at.h) * p.seqlen_q;
        const int t = opaque_thread_x(), t_warp = t / 32, t_lane = t % 32;
        const int col0 = (t_warp / Traits::kQRowTiles) * kCols;
        const uint32_t k_t =
            smem_u32(sK + swizzle<D>((t_lane & 7) + ((t_lane >> 3) & 1) * 8, t_lane >> 4));
        const uint32_t ds_t =
            smem_u32(sdS + swizzle<BM>((t_lane >> 4) * 8 + (t_lane & 7), (t_lane >> 3) & 1));
#pragma unroll
        for (int chunk = 0; chunk < kCols / kChunk; ++chunk) {
          const int c0 = col0 + chunk * kChunk;
#pragma unroll
          for (int qt = 0; qt < QT; ++qt) {
            float acc_dq[CT][4];
#pragma unroll
            for (int ct = 0; ct < CT; ++ct)
#pragma unroll
              for (int e = 0; e < 4; ++e)
                acc_dq[ct][e] = 0.f;
            const int q_tile = (t_warp % Traits::kQRowTiles) * QT + qt;
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
              uint32_t a[4];
              ldmatrix_x4_trans(a, swizzle_step<BM>(ds_t, kk, q_tile));
#pragma unroll
              for (int dp = 0; dp < kChunk / 16; ++dp) {
                uint32_t bk[4];
                ldmatrix_x4_trans(bk, swizzle_step<D>(k_t, kk, c0 / 16 + dp));
                mma_16816<T>(acc_dq[2 * dp], a, bk[0], bk[1]);
                mma_16816<T>(acc_dq[2 * dp + 1], a, bk[2], bk[3]);
              }
            }
            if (add_dq) {
#pragma unroll
              for (int hh = 0; hh < 2; ++hh) {
                const int i = at.m0 + q_tile * 16 + t_lane / 4 + hh * 8;
                if (i >= p.seqlen_q) continue;
                float* dq_row = p.dq_accum + (row_base + i) * D + c0 + (t_lane & 3) * 2;
#pragma unroll
                for (int ct = 0; ct < CT; ++ct) {
#if __CUDA_ARCH__ >= 900  // one 8-byte reduction for the thread's two columns
                  atomicAdd(reinterpret_cast<float2*>(dq_row + ct * 8),
                            make_float2(acc_dq[ct][2 * hh], acc_dq[ct][2 * hh + 1]));
#else
                  atomicAdd(dq_row + ct * 8, acc_dq[ct][2 * hh]);
                  atomicAdd(dq_row + ct * 8 + 1, acc_dq[ct][2 * hh + 1]);
#endif
                }
              }
            }
          }
        }
      }
    }
  }
  cp_async_wait<0>();  // no block leaves with copies in flight (no query block saw these keys)

  // dK = scale * sum dS^T Q and dV: contiguous [B, Hkv, Sk, Dqk] and [B, Hkv, Sk, Dv], keys past
  // the end and a padded tile's columns past the head dims not written.
  const float dk_scale = planted(4) ? 1.f : p.softmax_scale;  // planted: dS without the scale
  const int64_t kv_row_base = int64_t(opaque_block_y()) * p.seqlen_k;  // y = b * heads_kv + hkv
  const int warp_col0 = kSplit == 1 ? 0 : opaque_thread_x() / 32 % kSplit * Traits::kWarpCols;
#pragma unroll
  for (int kt = 0; kt < KT; ++kt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int key = n0 + key_row0 + kt * 16 + lane / 4 + hh * 8;
      if (key >= p.seqlen_k) continue;
      const int col0 = warp_col0 + (lane & 3) * 2;
      T* dk_row = static_cast<T*>(p.dk) + (kv_row_base + key) * p.head_dim + col0;
      T* dv_row = static_cast<T*>(p.dv) + (kv_row_base + key) * p.head_dim_v + col0;
#pragma unroll
      for (int dt = 0; dt < WDT; ++dt) {
        if (col0 + dt * 8 < p.head_dim) {
          *reinterpret_cast<uint32_t*>(dk_row + dt * 8) =
              pack2<T>(acc_dk[kt][dt][2 * hh] * dk_scale, acc_dk[kt][dt][2 * hh + 1] * dk_scale);
        }
        if (col0 + dt * 8 < p.head_dim_v) {
          *reinterpret_cast<uint32_t*>(dv_row + dt * 8) =
              pack2<T>(acc_dv[kt][dt][2 * hh], acc_dv[kt][dt][2 * hh + 1]);
        }
      }
    }
}

template <typename Traits, typename T, bool kAtomicDq>
__global__ void __launch_bounds__(Traits::kNThreads)
    flash_bwd_dkdv_kernel(const __grid_constant__ BwdParams p) {
  flash_bwd_dkdv_block<Traits, T, kAtomicDq>(p);
}

// dq = dq_accum * scale in the input dtype, 4 values per thread. dq_accum's rows are the tile's
// `width` wide (a padded head dim's columns past q's are left out).
template <typename T>
__global__ void __launch_bounds__(256)
    flash_bwd_convert_dq_kernel(const __grid_constant__ BwdParams p, int64_t n, int width) {
  const int64_t i = (int64_t(blockIdx.x) * 256 + threadIdx.x) * 4;
  if (i >= n) return;
  const float scale = planted(4) ? 1.f : p.softmax_scale;  // planted: dS without the scale
  const int64_t row = i / width;
  const int col = int(i - row * width);  // 4 | width: the 4 values share the row
  if (col >= p.head_dim) return;
  const float4 x = *reinterpret_cast<const float4*>(p.dq_accum + i);
  T* dst = static_cast<T*>(p.dq) + row * p.head_dim + col;
  *reinterpret_cast<uint32_t*>(dst) = pack2<T>(x.x * scale, x.y * scale);
  *reinterpret_cast<uint32_t*>(dst + 2) = pack2<T>(x.z * scale, x.w * scale);
}

// Deterministic dQ: one block per (query block, batch, head), the key blocks in a fixed order.
// S = Q K^T, P from the log-sum-exp, dP = dO V^T, dS = P (dP - delta), dQ += dS K, as the forward
// kernel walks its keys (same operand layouts).
template <typename Traits, typename T>
__global__ void __launch_bounds__(Traits::kNThreads)
    flash_bwd_dq_kernel(const __grid_constant__ BwdParams p) {
  constexpr int D = Traits::kHeadDim, BM = Traits::kBlockM, BN = Traits::kBlockN;
  constexpr int MT = Traits::kMTiles, NT = BN / 8, DT = D / 8;
  constexpr int kThreads = Traits::kNThreads;

  extern __shared__ __align__(256) uint4 smem_buf[];
  T* sQ = reinterpret_cast<T*>(smem_buf);
  T* sdO = sQ + BM * D;
  T* sK = sdO + BM * D;
  T* sV = sK + BN * D;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int m0 = blockIdx.x * BM;
  const int b = blockIdx.y / p.heads_q, h = blockIdx.y % p.heads_q;
  const int hkv = h / p.heads_ratio;
  const int offset = p.seqlen_k - p.seqlen_q;
  int n_end = ceil_div(p.seqlen_k, BN);
  if (p.window_right >= 0) {  // causal: window_right 0
    const int visible = window_key_end(p, min(m0 + BM, p.seqlen_q) - 1, offset, p.seqlen_k);
    n_end = min(n_end, visible <= 0 ? 0 : ceil_div(visible, BN));
  }
  const int n_begin = window_first_block<BN>(p, m0, offset);
  if (planted(6)) n_end = max(0, n_end - 1);  // planted: the last key block never reaches dQ

  const T* q_base = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride;
  const T* do_base = static_cast<const T*>(p.dout) + b * p.do_batch_stride + h * p.do_head_stride;
  const T* k_base = static_cast<const T*>(p.k) + b * p.k_batch_stride + hkv * p.k_head_stride;
  const T* v_base = static_cast<const T*>(p.v) + b * p.v_batch_stride + hkv * p.v_head_stride;
  load_kv_tile<D, BM, kThreads>(sQ, q_base, p.q_row_stride, m0, p.seqlen_q, p.head_dim / 8, tid);
  load_kv_tile<D, BM, kThreads>(sdO, do_base, p.do_row_stride, m0, p.seqlen_q, p.head_dim_v / 8,
                                tid);
  cp_async_commit();

  const int warp_row0 = warp * 16 * MT;
  const int64_t row_base = (int64_t(b) * p.heads_q + h) * p.seqlen_q;
  float lse2[MT][2], delta[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int i = m0 + warp_row0 + mt * 16 + lane / 4 + hh * 8;
      const bool valid = i < p.seqlen_q;
      lse2[mt][hh] = lse_base2(p, row_base + i, valid);
      delta[mt][hh] = valid ? p.delta[row_base + i] : 0.f;
    }

  const uint32_t q_a = smem_u32(sQ + swizzle<D>(warp_row0 + (lane & 15), lane >> 4));
  const uint32_t do_a = smem_u32(sdO + swizzle<D>(warp_row0 + (lane & 15), lane >> 4));
  const int b_row = (lane & 7) + (lane >> 4) * 8, b_chunk = (lane >> 3) & 1;
  const uint32_t k_b = smem_u32(sK + swizzle<D>(b_row, b_chunk));
  const uint32_t v_b = smem_u32(sV + swizzle<D>(b_row, b_chunk));
  const uint32_t k_t = smem_u32(sK + swizzle<D>((lane & 7) + ((lane >> 3) & 1) * 8, lane >> 4));

  float acc_dq[MT][DT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        acc_dq[mt][dt][e] = 0.f;

  for (int n = n_begin; n < n_end; ++n) {
    load_kv_tile<D, BN, kThreads>(sK, k_base, p.k_row_stride, n * BN, p.seqlen_k, p.head_dim / 8,
                                  tid);
    load_kv_tile<D, BN, kThreads>(sV, v_base, p.v_row_stride, n * BN, p.seqlen_k, p.head_dim_v / 8,
                                  tid);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();  // K(n), V(n) (and Q, dO on the first step) have landed

    float acc_s[MT][NT][4], acc_dp[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          acc_s[mt][nt][e] = acc_dp[mt][nt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t aq[MT][4], ado[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        ldmatrix_x4(aq[mt], swizzle_step<D>(q_a, mt, kk));
        ldmatrix_x4(ado[mt], swizzle_step<D>(do_a, mt, kk));
      }
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t bk[4], bv[4];
        ldmatrix_x4(bk, swizzle_step<D>(k_b, np, kk));
        ldmatrix_x4(bv, swizzle_step<D>(v_b, np, kk));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_16816<T>(acc_s[mt][2 * np], aq[mt], bk[0], bk[1]);
          mma_16816<T>(acc_s[mt][2 * np + 1], aq[mt], bk[2], bk[3]);
          mma_16816<T>(acc_dp[mt][2 * np], ado[mt], bv[0], bv[1]);
          mma_16816<T>(acc_dp[mt][2 * np + 1], ado[mt], bv[2], bv[3]);
        }
      }
    }

    // dS = P (dP - delta), P from the (capped) score; each row's window bounds once per block. A
    // select, not a branch around the exp2 (see the dK/dV kernel's p_and_ds); the capped loop is
    // its own copy, so the plain one is what it was without a softcap.
    auto p_and_ds = [&](auto capped) {
      constexpr bool kCapped = decltype(capped)::value;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int i = m0 + warp_row0 + mt * 16 + lane / 4 + hh * 8;
          const int key_end = window_key_end(p, i, offset, p.seqlen_k);
          const int key_begin = window_first_key(p, i, offset);
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 2 * hh; e < 2 * hh + 2; ++e) {
              const int key = n * BN + nt * 8 + (lane & 3) * 2 + (e & 1);
              float prob = exp2f(fmaf(acc_s[mt][nt][e], p.scale_log2, -lse2[mt][hh]));
              if (key >= key_end || key < key_begin) prob = 0.f;
              // kCapped: the pass before left (dP - delta) (1 - t^2) in dP
              acc_dp[mt][nt][e] =
                  kCapped ? prob * acc_dp[mt][nt][e] : prob * (acc_dp[mt][nt][e] - delta[mt][hh]);
            }
        }
    };
    if (p.softcap > 0.f) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          apply_softcap(acc_s[mt][nt], p);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float t = acc_s[mt][nt][e];
            acc_dp[mt][nt][e] = (acc_dp[mt][nt][e] - delta[mt][e >> 1]) * (1.f - t * t);
          }
        }
      p_and_ds(BoolConstant<true>{});
    } else {
      p_and_ds(BoolConstant<false>{});
    }

    uint32_t ds_frag[MT][BN / 16][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int j = 0; j < BN / 16; ++j) {
        ds_frag[mt][j][0] = pack2<T>(acc_dp[mt][2 * j][0], acc_dp[mt][2 * j][1]);
        ds_frag[mt][j][1] = pack2<T>(acc_dp[mt][2 * j][2], acc_dp[mt][2 * j][3]);
        ds_frag[mt][j][2] = pack2<T>(acc_dp[mt][2 * j + 1][0], acc_dp[mt][2 * j + 1][1]);
        ds_frag[mt][j][3] = pack2<T>(acc_dp[mt][2 * j + 1][2], acc_dp[mt][2 * j + 1][3]);
      }
    }

    // dQ += dS K, the keys as the reduction (K read transposed, as V in the forward).
#pragma unroll
    for (int j = 0; j < BN / 16; ++j)
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t bk[4];
        ldmatrix_x4_trans(bk, swizzle_step<D>(k_t, j, dp));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_16816<T>(acc_dq[mt][2 * dp], ds_frag[mt][j], bk[0], bk[1]);
          mma_16816<T>(acc_dq[mt][2 * dp + 1], ds_frag[mt][j], bk[2], bk[3]);
        }
      }
    __syncthreads();  // every warp is done with K(n) and V(n)
  }
  cp_async_wait<0>();  // no block leaves with copies in flight (n_end == 0)

  const float scale = planted(4) ? 1.f : p.softmax_scale;  // planted: dS without the scale
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int i = m0 + warp_row0 + mt * 16 + lane / 4 + hh * 8;
      if (i >= p.seqlen_q) continue;
      T* dq_row = static_cast<T*>(p.dq) + (row_base + i) * p.head_dim + (lane & 3) * 2;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt)
        if (dt * 8 < p.head_dim) {  // a padded tile's columns past q's head dim stay behind
          *reinterpret_cast<uint32_t*>(dq_row + dt * 8) =
              pack2<T>(acc_dq[mt][dt][2 * hh] * scale, acc_dq[mt][dt][2 * hh + 1] * scale);
        }
    }
}

}  // namespace flashmoe::cuda
