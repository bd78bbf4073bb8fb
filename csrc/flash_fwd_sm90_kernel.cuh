// Hopper (sm_90a) forward kernel: the FlashAttention-2 block schedule of flash_fwd_kernel.cuh with
// both GEMMs on warpgroup MMA (wgmma). Each warpgroup (4 warps) owns 64 query rows; S = Q K^T runs
// with Q and K read from shared memory by the tensor cores (no ldmatrix), and O += P V with P
// straight from the S accumulators in registers and V read transposed from shared memory.
// Everything else (masking, the online softmax, split-KV partials, the packed batch, the
// epilogue) is the mma.sync kernel's, since wgmma leaves each warp's accumulators in the mma.sync
// layout (wgmma_utils.cuh).
//
// Tiles live in shared memory in wgmma's 128-byte-swizzled panel layout (swizzle_panels); K and V
// are double-buffered, and each warpgroup overlaps its softmax with the tensor cores (see below).
// Compiled for sm_90a only: in every other device pass the kernel body is a trap, and the host
// refuses the configuration (see the host API).
#pragma once

#include "attention_params.h"
#include "flash_kernel_utils.cuh"
#include "wgmma_utils.cuh"

namespace flashmoe::cuda {

template <int kHeadDim_, int kBlockN_, int kWarpgroups_>
struct Sm90FwdTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 64 * kWarpgroups_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kWarpgroups = kWarpgroups_;
  static constexpr int kNWarps = 4 * kWarpgroups_;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kChunks = kHeadDim / 8;
  // K and V tiles are copied by the first two warpgroups (the copy loop wants rows per pass that
  // divide the tile).
  static constexpr int kLoadThreads = 256;
  static constexpr int kSmemBytes = (kBlockM + 4 * kBlockN) * kHeadDim * 2;  // K, V x 2
  static_assert(kHeadDim % 64 == 0 && (kBlockN == 64 || kBlockN == 128),
                "wgmma tiles: 64-column panels, N of 64 or 128");
  static_assert((kBlockM * kHeadDim * 2) % 1024 == 0 && (kBlockN * kHeadDim * 2) % 1024 == 0,
                "every tile must start on a 1024-byte swizzle atom");
};

template <typename Traits, typename T, bool kVarlen>
__device__ __forceinline__ void flash_fwd_sm90_block(const AttentionParams& p) {
  constexpr int D = Traits::kHeadDim, BM = Traits::kBlockM, BN = Traits::kBlockN;
  constexpr int NT = BN / 8, DT = D / 8, kChunks = Traits::kChunks;
  constexpr int kThreads = Traits::kNThreads;

  extern __shared__ __align__(1024) uint4 smem_buf[];  // wgmma's 128B swizzle: 1024-byte atoms
  T* sQ = reinterpret_cast<T*>(smem_buf);
  T* sK = sQ + BM * D;      // two buffers: K(n) in sK[n % 2]
  T* sV = sK + 2 * BN * D;  // two buffers: V(n) in sV[n % 2]

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const TileCoords t = TileCoords::of_block<BM, kVarlen>(p);
  const int b = t.b, hkv = t.hkv, len_k = t.len_k, split = t.split;
  const int m0 = (t.m_blocks - 1 - t.m_block) * BM;  // heavy (causal) row blocks first
  if constexpr (kVarlen) {
    if (m0 >= t.rows_total) return;
  }
  auto row_query = [&](int r) { return t.query(r); };

  const int i_first = row_query(m0);
  const int n_block_max = t.kv_block_end<BM, BN>(p, m0);
  const int unmasked_end = p.causal ? min(len_k, i_first + len_k - t.len_q + 1) : len_k;
  const int n_lo = split * p.n_blocks_per_split;
  const int n_hi = min(n_block_max, n_lo + p.n_blocks_per_split);
#if FLASHMOE_PLANT_BUG == 1
  const int key_begin = split > 0 ? n_lo * BN + 1 : 0;
#endif

  const T* k_base = static_cast<const T*>(p.k) + b * p.k_batch_stride + t.row0_k * p.k_row_stride +
                    hkv * p.k_head_stride;
  const T* v_base = static_cast<const T*>(p.v) + b * p.v_batch_stride + t.row0_k * p.v_row_stride +
                    hkv * p.v_head_stride;
  constexpr int kLoadThreads = Traits::kLoadThreads;
  auto load_k = [&](int n_block) {
#if FLASHMOE_PLANT_BUG == 11
    if (n_block * BN + BN > len_k) return;  // planted: the last, partial key tile is never copied
#endif
    if (kThreads == kLoadThreads || tid < kLoadThreads) {
      load_kv_tile<D, BN, kLoadThreads, /*kPanels=*/true>(sK + (n_block & 1) * BN * D, k_base,
                                                          p.k_row_stride, n_block * BN, len_k, tid);
    }
  };
  auto load_v = [&](int n_block) {
#if FLASHMOE_PLANT_BUG == 11
    if (n_block * BN + BN > len_k) return;
#endif
    if (kThreads == kLoadThreads || tid < kLoadThreads) {
      load_kv_tile<D, BN, kLoadThreads, /*kPanels=*/true>(sV + (n_block & 1) * BN * D, v_base,
                                                          p.v_row_stride, n_block * BN, len_k, tid);
    }
  };
  // cp.async writes through the generic proxy, wgmma reads through the async one: every thread
  // fences its own copies once they landed, then the barrier makes them everyone's.
  auto landed = [&]() {
#if FLASHMOE_PLANT_BUG == 9
    if (warp / 4 != 1)  // planted: the second warpgroup never waits for its own copies to land
#endif
      cp_async_wait<0>();
    sm90::fence_proxy_async();
    __syncthreads();
  };

  // This warp's 16 rows; its warpgroup's 64 start at 64 * (warp / 4) of the block.
  const int warp_row0 = warp * 16;
  const uint64_t q_desc = sm90::desc_k_major(smem_u32(sQ + (warp / 4) * 64 * 64));
  uint64_t k_desc = sm90::desc_k_major(smem_u32(sK));
#if FLASHMOE_PLANT_BUG == 10
  k_desc = (k_desc & ~(uint64_t(3) << 62)) | (uint64_t(2) << 62);  // planted: K read 64B-swizzled
#endif
  const uint64_t v_desc = sm90::desc_mn_major<BN>(smem_u32(sV));
  constexpr uint64_t kTileStep = uint64_t((BN * D * 2) >> 4);  // the second buffer, in a descriptor

  float acc_o[DT][4];
  float acc_s[NT][4];
  uint32_t p_frag[BN / 16][4];
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
#pragma unroll
  for (int dt = 0; dt < DT; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      acc_o[dt][e] = 0.f;

  // S(n) = Q K(n)^T, one m64n(BN)k16 wgmma per 16 columns of the head dim, as one commit group.
  auto issue_s = [&](int n) {
    sm90::fence_operands(acc_s);
    sm90::fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      sm90::mma_ss<BN, T>(acc_s, q_desc + sm90::k_major_step<BM>(kk),
                          k_desc + (n & 1) * kTileStep + sm90::k_major_step<BN>(kk), kk > 0);
    }
    sm90::commit_group();
  };
  // O += P(n) V(n), one m64n(D)k16 wgmma per 16 keys, P from registers, as one commit group.
  auto issue_pv = [&](int n) {
    sm90::fence_operands(acc_o);
    sm90::fence();
#pragma unroll
    for (int j = 0; j < BN / 16; ++j) {
      sm90::mma_rs<D, T>(acc_o, p_frag[j], v_desc + (n & 1) * kTileStep + sm90::mn_major_step(j),
                         1);
    }
    sm90::commit_group();
  };
  // Mask S(n), fold it into the running max and sum, and leave P(n) in acc_s; returns through
  // `rescale` what the output accumulated so far must be multiplied by.
  auto softmax = [&](int n, float (&rescale)[2]) {
    bool need_mask = (n + 1) * BN > unmasked_end;
#if FLASHMOE_PLANT_BUG == 1
    need_mask = need_mask || n * BN < key_begin;
#endif
    if (need_mask) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int i = row_query(m0 + warp_row0 + lane / 4 + hh * 8);
        const int last_key = p.causal ? min(len_k - 1, i + len_k - t.len_q) : len_k - 1;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 2 * hh; e < 2 * hh + 2; ++e) {
            const int col = n * BN + nt * 8 + (lane & 3) * 2 + (e & 1);
            bool masked = col > last_key;
#if FLASHMOE_PLANT_BUG == 1
            masked = masked || col < key_begin;
#endif
            if (masked) acc_s[nt][e] = -INFINITY;
          }
      }
    }
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float mx = row_max[hh];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        mx = fmaxf(mx, fmaxf(acc_s[nt][2 * hh], acc_s[nt][2 * hh + 1]));
      mx = quad_max(mx);
      const float max_scaled = mx == -INFINITY ? 0.f : mx * p.scale_log2;
      rescale[hh] = exp2f(row_max[hh] * p.scale_log2 - max_scaled);
      row_max[hh] = mx;
      row_sum[hh] *= rescale[hh];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 2 * hh; e < 2 * hh + 2; ++e) {
          const float prob = exp2f(fmaf(acc_s[nt][e], p.scale_log2, -max_scaled));
          acc_s[nt][e] = prob;
          row_sum[hh] += prob;
        }
    }
  };
  auto rescale_o_and_pack_p = [&](const float (&rescale)[2]) {
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        acc_o[dt][e] *= rescale[e >> 1];
#pragma unroll
    for (int j = 0; j < BN / 16; ++j) {
      p_frag[j][0] = pack2<T>(acc_s[2 * j][0], acc_s[2 * j][1]);
      p_frag[j][1] = pack2<T>(acc_s[2 * j][2], acc_s[2 * j][3]);
      p_frag[j][2] = pack2<T>(acc_s[2 * j + 1][0], acc_s[2 * j + 1][1]);
      p_frag[j][3] = pack2<T>(acc_s[2 * j + 1][2], acc_s[2 * j + 1][3]);
    }
  };

  // The key blocks run from the last to the first (only the first ones visited need masks), with
  // FlashAttention-3's overlap inside each warpgroup: S(n) and P(n+1) V(n+1) go to the tensor
  // cores together, and the softmax of S(n) runs while P V does. K(n-1) and V(n) are copied in
  // while block n is computed (double buffers), so one barrier per key block suffices.
  if (n_hi > n_lo) {
    t.load_q<D, BM, kThreads, /*kPanels=*/true>(sQ, p, m0, tid);
    load_k(n_hi - 1);
    cp_async_commit();
    landed();  // Q and K(n_hi - 1)
    if (n_hi - 2 >= n_lo) load_k(n_hi - 2);
    load_v(n_hi - 1);
    cp_async_commit();
    issue_s(n_hi - 1);
    sm90::wait_group<0>();
    sm90::fence_operands(acc_s);
    float rescale[2];
    softmax(n_hi - 1, rescale);
    rescale_o_and_pack_p(rescale);
  }
  for (int n = n_hi - 2; n >= n_lo; --n) {
    landed();  // K(n) and V(n + 1); every warpgroup is done with S(n + 1) and P(n + 2) V(n + 2)
    if (n - 1 >= n_lo) load_k(n - 1);
    load_v(n);
    cp_async_commit();
    issue_s(n);
    issue_pv(n + 1);
    sm90::wait_group<1>();  // S(n) is done; P(n + 1) V(n + 1) may still run
    sm90::fence_operands(acc_s);
    float rescale[2];
    softmax(n, rescale);
    sm90::wait_group<0>();
    sm90::fence_operands(acc_o);
    rescale_o_and_pack_p(rescale);
  }
  if (n_hi > n_lo) {
    landed();  // V(n_lo)
    issue_pv(n_lo);
    sm90::wait_group<0>();
    sm90::fence_operands(acc_o);
  }

  // Epilogue as in the mma.sync kernel. The output is staged in sQ: wait for every warpgroup's
  // last reads of Q first (a warpgroup's wgmma reads all 64 of its rows).
  __syncthreads();
  const TileCoords te = TileCoords::of_block<BM, kVarlen>(p, opaque_block_x());
  const int eb = te.b, em0 = (te.m_blocks - 1 - te.m_block) * BM;
  auto out_query = [&](int r) { return te.query(r); };
  auto out_head = [&](int r) { return te.head(r); };
  const int64_t rows_all = int64_t(p.batch) * p.heads_q * p.seqlen_q;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const float sum = quad_sum(row_sum[hh]);
    const float inv = te.bad_len ? NAN : sum > 0.f ? 1.f / sum : 0.f;
    const float lse = te.bad_len  ? NAN
                      : sum > 0.f ? row_max[hh] * p.softmax_scale + logf(sum)
                                  : -INFINITY;
    const int row = warp_row0 + lane / 4 + hh * 8, r = em0 + row;
    if (p.num_splits == 1) {
#pragma unroll
      for (int dt = 0; dt < DT; ++dt)
        *reinterpret_cast<uint32_t*>(sQ + swizzle<D>(row, dt) + (lane & 3) * 2) =
            pack2<T>(acc_o[dt][2 * hh] * inv, acc_o[dt][2 * hh + 1] * inv);
    }
    if (r >= te.rows_total) continue;
    const int64_t lse_index =
        kVarlen ? int64_t(out_head(r)) * p.total_q + te.row0_q + out_query(r)
                : (int64_t(eb) * p.heads_q + out_head(r)) * p.seqlen_q + out_query(r);
    if (p.num_splits == 1) {
      if ((lane & 3) == 0) p.lse[lse_index] = lse;
    } else {
      float* o_row = p.o_accum + (te.split * rows_all + lse_index) * D;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        *reinterpret_cast<float2*>(o_row + dt * 8 + (lane & 3) * 2) =
            make_float2(acc_o[dt][2 * hh] * inv, acc_o[dt][2 * hh + 1] * inv);
      }
      if ((lane & 3) == 0) p.lse_accum[te.split * rows_all + lse_index] = lse;
    }
  }
  if (p.num_splits == 1) {
    __syncwarp();
#pragma unroll
    for (int c = lane; c < 16 * kChunks; c += 32) {
      const int row = warp_row0 + c / kChunks, ch = c % kChunks, r = em0 + row;
      if (r >= te.rows_total) continue;
      T* o_row = static_cast<T*>(p.o) + eb * p.o_batch_stride + out_head(r) * p.o_head_stride +
                 (te.row0_q + out_query(r)) * p.o_row_stride;
      *reinterpret_cast<uint4*>(o_row + ch * 8) =
          *reinterpret_cast<const uint4*>(sQ + swizzle<D>(row, ch));
    }
  }
}

// One block per SM: the register budget is the SM's over the block's warpgroups.
template <typename Traits, typename T, bool kVarlen>
__device__ __forceinline__ void flash_fwd_sm90_entry(const AttentionParams& p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  flash_fwd_sm90_block<Traits, T, kVarlen>(p);
#elif defined(__CUDA_ARCH__)
  __trap();  // wgmma exists on sm_90a only; the host never launches this elsewhere
#endif
}

template <typename Traits, typename T>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_fwd_sm90_kernel(const __grid_constant__ AttentionParams p) {
  flash_fwd_sm90_entry<Traits, T, /*kVarlen=*/false>(p);
}

template <typename Traits, typename T>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_fwd_sm90_varlen_kernel(const __grid_constant__ AttentionParams p) {
  flash_fwd_sm90_entry<Traits, T, /*kVarlen=*/true>(p);
}

}  // namespace flashmoe::cuda
