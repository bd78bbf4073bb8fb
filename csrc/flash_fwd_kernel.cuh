// FlashAttention-2-style forward kernel (prefill and split-KV decode) and the split-KV combine
// kernel. One block owns kBlockM rows of one (batch, head); K and V tiles stream through shared
// memory; S = Q K^T and O += P V run on mma.sync tensor cores with fp32 accumulation; the softmax
// is online (running max and sum per row, in fp32, base 2 with the scale folded in).
#pragma once

#include "attention_params.h"
#include "flash_kernel_utils.cuh"

namespace flashmoe::cuda {

// Tile shape of one configuration. Warps split the kBlockM rows (each warp owns kMTiles tiles of 16
// rows) and every warp sees all of K and V, so warps never exchange partial results (FA2's scheme).
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, bool kSm90Only_ = false>
struct FwdTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32;
  // Built for sm_90 and newer only: below sm_90 the kernel body is a trap (and the host refuses
  // the configuration), because ptxas spills these tiles there.
  static constexpr bool kSm90Only = kSm90Only_;
  static constexpr int kMTiles = kBlockM / (16 * kNWarps);
  static constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row
  static constexpr int kSmemBytes = (kBlockM + 2 * kBlockN) * kHeadDim * 2;
  static_assert(kMTiles >= 1 && kBlockM == kMTiles * 16 * kNWarps,
                "kBlockM must be 16 * warps * k");
  static_assert(kBlockN % 16 == 0 && kHeadDim % 64 == 0,
                "tile shapes must fit the mma and swizzle");
};

// kVarlen: a packed batch (p.cu_seqlens_q/k, FlashAttention's varlen layout): each block finds its
// sequence's offsets in TileCoords, and the row blocks past its sequence's end return at once.
template <typename Traits, typename T, bool kVarlen>
__device__ __forceinline__ void flash_fwd_block(const AttentionParams& p) {
  constexpr int D = Traits::kHeadDim, BM = Traits::kBlockM, BN = Traits::kBlockN;
  constexpr int MT = Traits::kMTiles, NT = BN / 8, DT = D / 8, kChunks = Traits::kChunks;
  constexpr int kThreads = Traits::kNThreads;

  extern __shared__ __align__(256) uint4 smem_buf[];  // swizzle_step needs 256-byte alignment
  T* sQ = reinterpret_cast<T*>(smem_buf);
  T* sK = sQ + BM * D;
  T* sV = sK + BN * D;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const TileCoords t = TileCoords::of_block<BM, kVarlen>(p);
  const int b = t.b, hkv = t.hkv, len_k = t.len_k, split = t.split;
  // Row blocks of a head run last to first: with a causal mask the last ones see the most keys, so
  // the heavy blocks start first and the light ones fill the tail. (Unconditional: without a mask
  // the order does not matter, and a select on p.causal cost config 4 a register spill.)
  const int m0 = (t.m_blocks - 1 - t.m_block) * BM;
  if constexpr (kVarlen) {
    if (m0 >= t.rows_total) return;  // past this sequence's queries: the whole block leaves
  }

  auto row_query = [&](int r) { return t.query(r); };

  // KV blocks this block visits: those of some row's window (causal: the tiles above the diagonal
  // are skipped; a window's left edge skips those below it), and the split owns blocks
  // [n_lo, n_hi) of them.
  const int i_first = row_query(m0);
  const int offset = len_k - t.len_q;
  const int n_block_max = t.kv_block_end<BM, BN>(p, m0);
  // Keys [unmasked_begin, unmasked_end) are visible to every row of the tile: KV blocks inside it
  // need no mask.
  const int unmasked_end = window_key_end(p, i_first, offset, len_k);
  // ... and from the last row's left edge (window_first_key of it), recomputed where a window
  // has one rather than held through the loop (config 4 has no register to spare).
  auto unmasked_begin = [&] {
    return window_first_key(p, row_query(min(m0 + BM, t.rows_total) - 1), offset);
  };
  const int n_lo = window_first_block<BN>(p, i_first, offset) + split * p.n_blocks_per_split;
  const int n_hi = min(n_block_max, n_lo + p.n_blocks_per_split);
  const int key_begin = planted(1) && split > 0 ? n_lo * BN + 1 : 0;  // planted 1

  const T* k_base = static_cast<const T*>(p.k) + b * p.k_batch_stride + t.row0_k * p.k_row_stride +
                    hkv * p.k_head_stride;
  const T* v_base = static_cast<const T*>(p.v) + b * p.v_batch_stride + t.row0_k * p.v_row_stride +
                    hkv * p.v_head_stride;

  // K's chunks and V's: a head dim below the tile's (80 on 96, v's 128 under q's 192) leaves the
  // rest of the tile's columns zero.
  auto load_kv = [&](T* tile, const T* base, int64_t row_stride, int chunks, int n_block) {
    load_kv_tile<D, BN, kThreads>(tile, base, row_stride, n_block * BN, len_k, chunks, tid);
  };

  // This thread's rows: within each 16-row m-tile, lane / 4 and lane / 4 + 8.
  const int warp_row0 = warp * 16 * MT;
  // ldmatrix base addresses (see swizzle_step): Q as the A operand (16 rows x 2 chunks), K as the
  // B operand of S (keys x chunks, two n-tiles per x4), V transposed as the B operand of P V.
  const uint32_t q_addr = smem_u32(sQ + swizzle<D>(warp_row0 + (lane & 15), lane >> 4));
  const uint32_t k_addr = smem_u32(sK + swizzle<D>((lane & 7) + (lane >> 4) * 8, (lane >> 3) & 1));
  const uint32_t v_addr = smem_u32(sV + swizzle<D>((lane & 7) + ((lane >> 3) & 1) * 8, lane >> 4));

  float acc_o[MT][DT][4];
  float row_max[MT][2], row_sum[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        acc_o[mt][dt][e] = 0.f;
    row_max[mt][0] = row_max[mt][1] = -INFINITY;
    row_sum[mt][0] = row_sum[mt][1] = 0.f;
  }

  if (n_hi > n_lo) {
    t.load_q<D, BM, kThreads>(sQ, p, m0, tid);
    // KV blocks run from the last to the first, so only the first one visited (the sequence tail
    // or the diagonal) needs masking, as in FA2. The first V goes out with Q and K: a block with
    // few KV blocks (short sequences) then waits for memory once, not twice, before its first P V.
    // planted 14: k at the tile's width too
    load_kv(sK, k_base, p.k_row_stride, planted(14) ? kChunks : p.head_dim / 8, n_hi - 1);
    cp_async_commit();
    load_kv(sV, v_base, p.v_row_stride, p.head_dim_v / 8, n_hi - 1);
    cp_async_commit();
  }

  // The loop's lower bound (the window's first block) goes through shared memory, not a register
  // held through the loop: in a packed batch it cannot be recomputed cheaply (the sequence's
  // lengths), and held, it spilled configuration 4's packed kernel at d=128.
  __shared__ int loop_lo;
  if (tid == 0) loop_lo = n_lo;
  for (int n = n_hi - 1, more = n_hi > n_lo; more; --n) {
    const bool first = n == n_hi - 1;
    if (first) {
      cp_async_wait<1>();  // Q and K(n) have landed; V(n) may still be in flight
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // K(n) has landed, and every warp is done reading V(n+1)
    if (!first) {
      load_kv(sV, v_base, p.v_row_stride, p.head_dim_v / 8, n);  // arrives during S = Q K^T
      cp_async_commit();
    }

    float acc_s[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          acc_s[mt][nt][e] = 0.f;

#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        ldmatrix_x4(a[mt], swizzle_step<D>(q_addr, mt, kk));
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t bk[4];
        ldmatrix_x4(bk, swizzle_step<D>(k_addr, np, kk));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_16816<T>(acc_s[mt][2 * np], a[mt], bk[0], bk[1]);
          mma_16816<T>(acc_s[mt][2 * np + 1], a[mt], bk[2], bk[3]);
        }
      }
    }

    if (p.softcap > 0.f && !planted(21)) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          apply_softcap(acc_s[mt][nt], p);
    }
    bool need_mask =
        (n + 1) * BN > unmasked_end || (p.window_left >= 0 && n * BN < unmasked_begin());
    need_mask = need_mask || (planted(1) && n * BN < key_begin);
    if (need_mask) {
      // The row-to-query mapping (a division with packed GQA) runs 2 * MT times per masked tile,
      // not once per element; each element then compares its distance from the query's position
      // with the window (outside_window).
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int i = row_query(m0 + warp_row0 + mt * 16 + lane / 4 + hh * 8);
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 2 * hh; e < 2 * hh + 2; ++e) {
              const int col = n * BN + nt * 8 + (lane & 3) * 2 + (e & 1);
              bool masked = outside_window(p, col, i, offset, len_k);
              masked = masked || (planted(1) && col < key_begin);
              if (masked) acc_s[mt][nt][e] = -INFINITY;
            }
        }
    }
    if (p.softcap > 0.f && planted(21)) {  // planted: after the mask, a masked key scores -softcap
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          apply_softcap(acc_s[mt][nt], p);
    }

    // Online softmax: rescale what was accumulated so far by exp2((m_old - m_new) * scale_log2).
    uint32_t p_frag[MT][BN / 16][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        float mx = row_max[mt][hh];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          mx = fmaxf(mx, fmaxf(acc_s[mt][nt][2 * hh], acc_s[mt][nt][2 * hh + 1]));
        mx = quad_max(mx);
        // A row that has seen only masked keys keeps max = -inf; use 0 so exp2(-inf - 0) = 0, not
        // NaN.
        const float max_scaled = mx == -INFINITY ? 0.f : mx * p.scale_log2;
        const float rescale = exp2f(row_max[mt][hh] * p.scale_log2 - max_scaled);
        row_max[mt][hh] = mx;
        row_sum[mt][hh] *= rescale;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
          acc_o[mt][dt][2 * hh] *= rescale;
          acc_o[mt][dt][2 * hh + 1] *= rescale;
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 2 * hh; e < 2 * hh + 2; ++e) {
            const float prob = exp2f(fmaf(acc_s[mt][nt][e], p.scale_log2, -max_scaled));
            acc_s[mt][nt][e] = prob;
            row_sum[mt][hh] += prob;  // per-thread partial; the quad reduction waits for the end
          }
      }
#pragma unroll
      for (int j = 0; j < BN / 16; ++j) {
        p_frag[mt][j][0] = pack2<T>(acc_s[mt][2 * j][0], acc_s[mt][2 * j][1]);
        p_frag[mt][j][1] = pack2<T>(acc_s[mt][2 * j][2], acc_s[mt][2 * j][3]);
        p_frag[mt][j][2] = pack2<T>(acc_s[mt][2 * j + 1][0], acc_s[mt][2 * j + 1][1]);
        p_frag[mt][j][3] = pack2<T>(acc_s[mt][2 * j + 1][2], acc_s[mt][2 * j + 1][3]);
      }
    }

    cp_async_wait<0>();
    __syncthreads();     // V(n) has landed, and every warp is done reading K(n)
    more = n > loop_lo;  // (written before the first iteration's barriers)
    if (more) {
      // arrives during P V (planted 14: at the tile's width)
      load_kv(sK, k_base, p.k_row_stride, planted(14) ? kChunks : p.head_dim / 8, n - 1);
      cp_async_commit();
    }

    // O += P V, with P taken straight from registers as the A operand (never via smem).
#pragma unroll
    for (int j = 0; j < BN / 16; ++j) {
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t bv[4];
        ldmatrix_x4_trans(bv, swizzle_step<D>(v_addr, j, dp));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_16816<T>(acc_o[mt][2 * dp], p_frag[mt][j], bv[0], bv[1]);
          mma_16816<T>(acc_o[mt][2 * dp + 1], p_frag[mt][j], bv[2], bv[3]);
        }
      }
    }
  }

  // Epilogue: normalise by the row sum; rows that saw no key get 0 and a log-sum-exp of -inf. The
  // output goes through this warp's own Q rows in shared memory (no other warp reads them) so that
  // it leaves in 16-byte row chunks; split partials (fp32) are written straight from registers.
  // Only v's head dim leaves (the tile's columns past it are zero).
  // The block's coordinates again, recomputed rather than held in registers through the loop
  // (config 4 at d=128 has none to spare).
  const TileCoords te = TileCoords::of_block<BM, kVarlen>(p, opaque_block_x());
  const int eb = te.b, em0 = (te.m_blocks - 1 - te.m_block) * BM;
  auto out_query = [&](int r) { return te.query(r); };
  auto out_head = [&](int r) { return te.head(r); };
  const int64_t rows_all = int64_t(p.batch) * p.heads_q * p.seqlen_q;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float sum = quad_sum(row_sum[mt][hh]);
      // A bad cache_seqlens value poisons its sequence: NaN out and lse.
      float inv = te.bad_len ? NAN : sum > 0.f ? 1.f / sum : 0.f;
      float lse = te.bad_len  ? NAN
                  : sum > 0.f ? row_max[mt][hh] * p.softmax_scale + logf(sum)
                              : -INFINITY;
      const int row = warp_row0 + mt * 16 + lane / 4 + hh * 8, r = em0 + row;
      if (p.sinks != nullptr && p.num_splits == 1) {  // split partials get theirs when combined
        float factor;
        lse = fold_sink(lse, p.sinks[out_head(r)], factor);
        inv *= factor;
      }
      if (p.num_splits == 1) {
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
          *reinterpret_cast<uint32_t*>(sQ + swizzle<D>(row, dt) + (lane & 3) * 2) =
              pack2<T>(acc_o[mt][dt][2 * hh] * inv, acc_o[mt][dt][2 * hh + 1] * inv);
      }
      if (r >= te.rows_total) continue;
      // Packed batches keep FlashAttention's varlen layout [Hq, total_q] (one split only).
      const int64_t lse_index =
          kVarlen ? int64_t(out_head(r)) * p.total_q + te.row0_q + out_query(r)
                  : (int64_t(eb) * p.heads_q + out_head(r)) * p.seqlen_q + out_query(r);
      if (p.num_splits == 1) {
        if ((lane & 3) == 0) p.lse[lse_index] = lse;
      } else {
        // The partials' rows are v's head dim wide, as the split_kv_combine operator takes them.
        float* o_row = p.o_accum + (te.split * rows_all + lse_index) * p.head_dim_v;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
          if (dt * 8 >= p.head_dim_v) break;
          *reinterpret_cast<float2*>(o_row + dt * 8 + (lane & 3) * 2) =
              make_float2(acc_o[mt][dt][2 * hh] * inv, acc_o[mt][dt][2 * hh + 1] * inv);
        }
        if ((lane & 3) == 0) p.lse_accum[te.split * rows_all + lse_index] = lse;
      }
    }
  if (p.num_splits == 1) {
    __syncwarp();
#pragma unroll
    for (int c = lane; c < 16 * MT * kChunks; c += 32) {
      const int row = warp_row0 + c / kChunks, ch = c % kChunks, r = em0 + row;
      if (r >= te.rows_total || ch * 8 >= p.head_dim_v) continue;
      T* o_row = static_cast<T*>(p.o) + eb * p.o_batch_stride + out_head(r) * p.o_head_stride +
                 (te.row0_q + out_query(r)) * p.o_row_stride;
      *reinterpret_cast<uint4*>(o_row + ch * 8) =
          *reinterpret_cast<const uint4*>(sQ + swizzle<D>(row, ch));
    }
  }
}

template <typename Traits, typename T, bool kVarlen>
__device__ __forceinline__ void flash_fwd_block_for_arch(const AttentionParams& p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  if constexpr (Traits::kSm90Only) {
    __trap();
  } else {
    flash_fwd_block<Traits, T, kVarlen>(p);
  }
#else
  flash_fwd_block<Traits, T, kVarlen>(p);
#endif
}

template <typename Traits, typename T>
__global__ void __launch_bounds__(Traits::kNThreads)
    flash_fwd_kernel(const __grid_constant__ AttentionParams p) {
  flash_fwd_block_for_arch<Traits, T, /*kVarlen=*/false>(p);
}

// The same kernel over a packed (varlen) batch.
template <typename Traits, typename T>
__global__ void __launch_bounds__(Traits::kNThreads)
    flash_fwd_varlen_kernel(const __grid_constant__ AttentionParams p) {
  flash_fwd_block_for_arch<Traits, T, /*kVarlen=*/true>(p);
}

// Split-KV combine for the forward kernel's partials (and the split_kv_combine operator): one warp
// per output row, each lane owning D / 32 columns (the row's split LSEs are one broadcast load).
// Wider rows take their splits 8 at a time, so the loads in flight stay within the registers.
// Rows are `cols` wide (v's head dim, at most D and a multiple of 8). A lane whose columns run past
// `cols` reads the row's last kPerLane columns instead (inside the row) and writes those of its
// own that exist; lanes wholly past it write nothing. (With kPerLane a power of two, 8 | cols keeps
// every lane wholly inside or wholly past; at D = 192, 6 columns a lane, one lane can straddle.)
// With `sinks` (fp32 [Hq], or null), row (b, h, i) of rows laid out [B, heads_q, seqlen_q] gains
// exp(sinks[h]) in its denominator (fold_sink): the splits' partials leave it out.
template <typename T, int D>
__global__ void __launch_bounds__(128)
    split_kv_combine_kernel(const float* __restrict__ o_accum, const float* __restrict__ lse_accum,
                            T* __restrict__ out, float* __restrict__ lse, int num_splits,
                            int64_t rows, int cols, const float* __restrict__ sinks, int heads_q,
                            int seqlen_q) {
  constexpr int kPerLane = D / 32;
  static_assert(D % 64 == 0, "an even number of columns per lane");
  const int lane = threadIdx.x % 32;
  const int64_t row = int64_t(blockIdx.x) * 4 + threadIdx.x / 32;
  if (row >= rows) return;
  const int first = lane * kPerLane;             // this lane's first column
  const int col0 = min(first, cols - kPerLane);  // where it reads (even: float2-aligned)
  float acc[kPerLane];
  float lse_row = combine_splits<kPerLane, kPerLane <= 4 ? 16 : 8>(
      num_splits, [&](int s) { return lse_accum + s * rows + row; },
      [&](int s) { return o_accum + (s * rows + row) * cols + col0; }, acc);
  if (sinks != nullptr) {
    float factor;
    lse_row = fold_sink(lse_row, sinks[row / seqlen_q % heads_q], factor);
#pragma unroll
    for (int e = 0; e < kPerLane; ++e)
      acc[e] *= factor;
  }
  T* dst = out + row * cols;
  if (first + kPerLane <= cols) {
#pragma unroll
    for (int e = 0; e < kPerLane; e += 2)
      *reinterpret_cast<uint32_t*>(dst + first + e) = pack2<T>(acc[e], acc[e + 1]);
  } else if (first < cols) {
    const int shift = first - col0;  // acc[j] holds column col0 + j
#pragma unroll
    for (int e = 0; e < kPerLane; e += 2) {
      float x0 = 0.f, x1 = 0.f;
#pragma unroll
      for (int j = 0; j + 1 < kPerLane; j += 2)
        if (j == e + shift) x0 = acc[j], x1 = acc[j + 1];
      if (first + e < cols) *reinterpret_cast<uint32_t*>(dst + first + e) = pack2<T>(x0, x1);
    }
  }
  if (lane == 0) lse[row] = lse_row;
}

// Runs after the forward kernel over a packed batch. The host does not read cu_seqlens (a sync per
// call); the forward kernel clamps them, so it reads nothing outside q, k and v whatever they
// hold. This kernel (one block) checks that they partition q and k into sequences no longer than
// the maxima the grid was sized for: from 0, non-decreasing, ending at total_q and total_k. If
// not, the whole of out ([total_q, Hq, D], contiguous) and lse ([Hq, total_q]) becomes NaN: no
// row is left unwritten (garbage) or computed from offsets that do not describe the batch. A
// check inside the forward kernel cost its tightest configuration a register spill.
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(256) varlen_offsets_check_kernel(const AttentionParams p) {
  constexpr int kThreads = 256;
  const int tid = threadIdx.x;
  int bad = 0;
  for (int b = tid; b < p.batch; b += kThreads) {
    const int lq = p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b];
    const int lk = p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b];
    bad |= lq < 0 || lq > p.seqlen_q || lk < 0 || lk > p.seqlen_k;
  }
  if (tid == 0) {
    bad |= p.cu_seqlens_q[0] != 0 || p.cu_seqlens_k[0] != 0 ||
           p.cu_seqlens_q[p.batch] != p.total_q || p.cu_seqlens_k[p.batch] != p.total_k;
  }
  if (!__syncthreads_or(bad)) return;
  const uint32_t nan2 = pack2<T>(NAN, NAN);
  uint4* out = static_cast<uint4*>(p.o);
  const int64_t chunks = int64_t(p.total_q) * p.heads_q * (p.head_dim_v / 8);
  for (int64_t c = tid; c < chunks; c += kThreads)
    out[c] = make_uint4(nan2, nan2, nan2, nan2);
  for (int64_t r = tid; r < int64_t(p.total_q) * p.heads_q; r += kThreads)
    p.lse[r] = NAN;
}

}  // namespace flashmoe::cuda
