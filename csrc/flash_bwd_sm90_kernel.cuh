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

template <typename Traits, typename T, bool kAtomicDq>
__device__ __forceinline__ void flash_bwd_sm90_block(const BwdParams& p) {
  constexpr int D = Traits::kHeadDim, BM = Traits::kBlockM, BN = Traits::kBlockN;
  constexpr int MT = BM / 8, DT = D / 8, kThreads = Traits::kNThreads;
  constexpr bool kPadded = Traits::kPadded;

  extern __shared__ __align__(1024) uint4 smem_buf[];
  T* sK = reinterpret_cast<T*>(smem_buf);
  T* sV = sK + BN * D;
  T* sQ = sV + BN * D;                                    // [2][BM x D]
  T* sdO = sQ + 2 * BM * D;                               // [2][BM x D]
  T* sdS = sdO + 2 * BM * D;                              // dS^T: [BN keys][BM queries]
  float* sLse = reinterpret_cast<float*>(sdS + BN * BM);  // [2][BM]
  float* sDelta = sLse + 2 * BM;                          // [2][BM]
  // FLASHMOE_BWD_DQ_TMA: [2 warpgroups][2 boxes of 32 columns][64 rows][32], 128-byte swizzled
  // rows (1024-byte aligned: every region before it is a multiple of 1024 bytes)
  [[maybe_unused]] float* sDq = sDelta + 2 * BM;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, wg = warp / 4;
  const int n0 = blockIdx.x * BN;
  const int b = blockIdx.y / p.heads_kv, hkv = blockIdx.y % p.heads_kv;
  const int offset = p.seqlen_k - p.seqlen_q;  // causal: query i sees keys j <= i + offset
  // The query blocks some row of which sees a key of this block (query i sees keys
  // i + offset - window_left <= j <= i + offset + window_right; causal: window_right 0).
  const int m_begin = p.window_right >= 0 ? max(0, n0 - offset - p.window_right) / BM : 0;
  const int m_end =
      p.window_left >= 0
          ? max(0, min(ceil_div(p.seqlen_q, BM), (n0 + BN - 1 - offset + p.window_left) / BM + 1))
          : ceil_div(p.seqlen_q, BM);

  const T* k_base = static_cast<const T*>(p.k) + b * p.k_batch_stride + hkv * p.k_head_stride;
  const T* v_base = static_cast<const T*>(p.v) + b * p.v_batch_stride + hkv * p.v_head_stride;
  // The tensors' 16-byte chunks a row: the tile's own unless padded, whose columns past a head
  // dim load_kv_tile zero-fills (planted 19: copied at the tile's width, the next row's columns
  // in them).
  const bool tile_wide = !kPadded || planted(19);
  const int qk_chunks = tile_wide ? D / 8 : p.head_dim / 8;
  const int v_chunks = tile_wide ? D / 8 : p.head_dim_v / 8;
  load_kv_tile<D, BN, kThreads, /*kPanels=*/true>(sK, k_base, p.k_row_stride, n0, p.seqlen_k,
                                                  qk_chunks, tid);
  load_kv_tile<D, BN, kThreads, /*kPanels=*/true>(sV, v_base, p.v_row_stride, n0, p.seqlen_k,
                                                  v_chunks, tid);
  cp_async_commit();

  // planted 5: only the group's first query head reaches dK and dV
  const int group = planted(5) ? 1 : p.heads_ratio;
  const int m_count = max(0, m_end - m_begin), steps = group * m_count;
  auto step_head = [&](int step) { return hkv * p.heads_ratio + step / m_count; };
  auto step_m0 = [&](int step) { return (m_begin + step % m_count) * BM; };
  // Step `step`'s Q and dO into buffer step % 2 (cp.async, one commit group), and its rows'
  // base-2 lse and delta (rows past the end: lse +inf, so P = 0).
  auto issue_step = [&](int step) {
    const int buf = step & 1, h = step_head(step), m0 = step_m0(step);
    const T* q_base = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride;
    const T* do_base = static_cast<const T*>(p.dout) + b * p.do_batch_stride + h * p.do_head_stride;
    load_kv_tile<D, BM, kThreads, true>(sQ + buf * BM * D, q_base, p.q_row_stride, m0, p.seqlen_q,
                                        qk_chunks, tid);
    load_kv_tile<D, BM, kThreads, true>(sdO + buf * BM * D, do_base, p.do_row_stride, m0,
                                        p.seqlen_q, v_chunks, tid);
    cp_async_commit();
    if (tid < BM) {
      const int64_t row = (int64_t(b) * p.heads_q + h) * p.seqlen_q + m0 + tid;
      const bool valid = m0 + tid < p.seqlen_q;
      sLse[buf * BM + tid] = valid ? p.lse2[row] : INFINITY;
      sDelta[buf * BM + tid] = valid ? p.delta[row] : 0.f;
    }
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
  const uint64_t kt_desc = sm90::desc_mn_major<BN>(smem_u32(sK + pd * BN * 64));

  const int row_in_wg = 16 * (warp % 4) + lane / 4;  // + 8 * (e / 2): accumulator rows
  const int key_row0 = 64 * wg + row_in_wg;          // this thread's first key in the block

  float acc_dk[DT][4], acc_dv[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      acc_dk[dt][e] = acc_dv[dt][e] = 0.f;

  if (steps > 0) issue_step(0);
  for (int step = 0; step < steps; ++step) {
    const int buf = step & 1, m0 = step_m0(step);
    cp_async_wait<0>();
    sm90::fence_proxy_async();  // this thread's copies, visible to the tensor cores
    __syncthreads();            // the step's tiles have landed; step - 1 is done with buf ^ 1

    // S^T and dP^T, two commit groups: P^T is computed while dP^T is still running.
    float acc_s[MT][4], acc_dp[MT][4];
    sm90::fence_operands(acc_s);
    sm90::fence_operands(acc_dp);
    sm90::fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      sm90::mma_ss<BM, T>(acc_s, k_desc + sm90::k_major_step<BN>(kk),
                          q_desc + buf * kBufStep + sm90::k_major_step<BM>(kk), kk > 0);
    sm90::commit_group();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      sm90::mma_ss<BM, T>(acc_dp, v_desc + sm90::k_major_step<BN>(kk),
                          do_desc + buf * kBufStep + sm90::k_major_step<BM>(kk), kk > 0);
    sm90::commit_group();
    if (step + 1 < steps) issue_step(step + 1);  // lands while this step computes

    // P^T = exp2(S^T * scale_log2 - lse2) with keys past the end and outside the window (causal:
    // its right edge 0) at 0, then dS^T = P^T (dP^T - delta); the unmasked blocks skip the
    // per-element mask.
    const bool need_mask = n0 + BN > p.seqlen_k ||
                           (p.window_right >= 0 && n0 + BN - 1 > m0 + offset + p.window_right) ||
                           (p.window_left >= 0 && n0 < m0 + BM - 1 + offset - p.window_left);
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
    if constexpr (kAtomicDq) {
      // dS^T to shared memory for dQ: row = key, 8-query chunk nt (conflict-free: the 8 rows of
      // one store instruction land in 8 different chunks).
#pragma unroll
      for (int nt = 0; nt < MT; ++nt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
          *reinterpret_cast<uint32_t*>(sdS + swizzle_panels<BN>(key_row0 + 8 * hh, nt) +
                                       (lane & 3) * 2) = ds_frag[nt / 2][(nt & 1) * 2 + hh];
    }

    // dV += P^T dO and dK += dS^T Q, the step's queries as the reduction.
    sm90::fence_operands(acc_dv);
    sm90::fence_operands(acc_dk);
    sm90::fence();
#pragma unroll
    for (int j = 0; j < BM / 16; ++j)
      sm90::mma_rs<D, T>(acc_dv, p_frag[j], do_mn_desc + buf * kBufStep + sm90::mn_major_step(j),
                         1);
#pragma unroll
    for (int j = 0; j < BM / 16; ++j)
      sm90::mma_rs<D, T>(acc_dk, ds_frag[j], q_mn_desc + buf * kBufStep + sm90::mn_major_step(j),
                         1);
    sm90::commit_group();

    if constexpr (kAtomicDq) {
      // planted 6: the last key block never reaches dQ
      const bool add_dq = !planted(6) || int(blockIdx.x) != ceil_div(p.seqlen_k, BN) - 1;
      sm90::fence_proxy_async();  // this thread's dS^T stores, visible to the tensor cores
      __syncthreads();            // dS^T is whole (both warpgroups' keys)
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
        sm90::mma_ss<64, T, /*kMnMajor=*/true>(acc_dq, ds_desc + sm90::mn_major_step(kk),
                                               kt_desc + sm90::mn_major_step(kk), kk > 0);
      sm90::commit_group();
      sm90::wait_group<0>();
      sm90::fence_operands(acc_dq);
      sm90::fence_operands(acc_dv);
      sm90::fence_operands(acc_dk);
#if FLASHMOE_BWD_DQ_TMA
      // This warpgroup's 64 x 64 dQ tile through shared memory (two boxes of 32 columns, rows of
      // 128 bytes whose 16-byte chunks are swizzled by the row, as the map's 128-byte swizzle
      // reads them), then one TMA reduce-add a box into dq_accum: rows past Sq lie outside the
      // map and are left alone. The leader waits until the previous step's reduce has read the
      // tile before anyone writes it again.
      float* stage = sDq + wg * 64 * 64;
      const bool leader = tid % 128 == 0;
      if (leader) sm90::bulk_wait_group_read<0>();
      sm90::warpgroup_sync(1 + wg);
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int row = row_in_wg + hh * 8;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          const int chunk = (nt & 3) * 2 + (lane & 3) / 2;  // 16-byte chunk of the box's row
          float* dst =
              stage + (nt >> 2) * 64 * 32 + row * 32 + (chunk ^ (row & 7)) * 4 + (lane & 1) * 2;
          *reinterpret_cast<float2*>(dst) = make_float2(acc_dq[nt][2 * hh], acc_dq[nt][2 * hh + 1]);
        }
      }
      sm90::fence_proxy_async();  // the tile's stores, visible to the TMA unit
      sm90::warpgroup_sync(1 + wg);
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
  const float dk_scale = planted(4) ? 1.f : p.softmax_scale;     // planted: dS without the scale
  const int64_t kv_row_base = int64_t(blockIdx.y) * p.seqlen_k;  // y = b * heads_kv + hkv
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

}  // namespace flashmoe::cuda
