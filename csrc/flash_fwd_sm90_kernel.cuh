// Hopper (sm_90a) forward kernels: both GEMMs on warpgroup MMA (wgmma). Each math warpgroup (4
// warps) owns 64 query rows; S = Q K^T runs with Q and K read from shared memory by the tensor
// cores (no ldmatrix), and O += P V with P straight from the S accumulators in registers and V
// read transposed from shared memory. Masking, the online softmax, split-KV partials, the packed
// batch and the epilogue are the mma.sync kernel's, since wgmma leaves each warp's accumulators in
// the mma.sync layout (wgmma_utils.cuh). Tiles live in shared memory in wgmma's 128-byte-swizzled
// panel layout (swizzle_panels); K and V are in two buffers (three at D=128 with 128-key tiles;
// two of 96 and 64 keys at D=192 and 256, of 112 with v's 128 under q's and k's 192, where V
// and O are 128 wide);
// S(n) and P(n+1) V(n+1) go out together (FlashAttention-3's intra-warpgroup overlap), though
// ptxas puts the wait for that P V above the softmax of S(n), which then runs after it (moving
// the wait below gained nothing: benches/notes/prefill-sm90.md, v4.5).
//
// Warp-specialized: a producer warpgroup issues every copy and signals each buffer through an
// mbarrier when its copies land; the math warpgroups (three at D=64, else two) wait on those,
// give buffers back through other mbarriers, never meet at a block-wide barrier, and take the
// producer's registers (setmaxnreg). The kernel is persistent (one block per SM walks the tiles),
// copies K and V (from D=128 up each tile's Q too) with TMA where the host could encode their
// tensor maps, and the math warpgroups take turns at the tensor cores (ping-pong with two, a round
// robin with three). The steps live in Sm90Rows, the schedule in flash_fwd_sm90_block. Compiled for
// sm_90a only: in every other device pass the kernel body is a trap, and the host refuses the
// configuration (see the host API).
#pragma once

#include "attention_params.h"
#include "flash_kernel_utils.cuh"
#include "wgmma_utils.cuh"

namespace flashmoe::cuda {

// The phase trace (`python -m flashmoe_science phases CASE`, a build with FLASHMOE_PHASE_TRACE=1;
// without it none of this is compiled, FLASHMOE_PHASE in flash_kernel_utils.cuh, and the kernels
// are unchanged):
// clock64 stamps of each tile's phases, by the first thread of each math warpgroup and the
// producer's thread 0, into stamps[block][walk step][slot]; per block the %globaltimer and clock64
// at its start and its end (spans), which turn cycles into time. Slots
// (flashmoe_science/pipeline/tools/phases.py reads them by these numbers): warpgroup w's at w *
// kPerWarpgroup + a Mark; its key blocks at kKeyBlocks + w; the producer's Q copy at kProducer + 0
// (before the Q-free wait), 1 (after it), 2 (issued). Steps past kRounds and blocks past kBlocks
// are not recorded. kLastPVIssued splits the last P V: its V's wait, the warpgroup's turn and the
// issue, then the rows' finish and the wait for the P V itself.
namespace phase_trace {
constexpr int kBlocks = 256, kRounds = 64, kSlots = 40, kPerWarpgroup = 9, kMaxWarpgroups = 3;
constexpr int kKeyBlocks = kPerWarpgroup * kMaxWarpgroups, kProducer = kKeyBlocks + kMaxWarpgroups;
enum Mark {
  kTileStart,
  kQReady,
  kFirstKReady,
  kFirstS,
  kFirstSoftmax,
  kLoopDone,
  kLastPVIssued,
  kLastPV,
  kOutput
};
static_assert(kProducer + 3 <= kSlots, "the slots fit");
#if FLASHMOE_PHASE_TRACE
__device__ long long stamps[kBlocks * kRounds * kSlots];
__device__ long long spans[kBlocks * 4];
__device__ __forceinline__ void put(int round, int slot, long long value) {
  if (blockIdx.x < kBlocks && round < kRounds)
    stamps[(blockIdx.x * kRounds + round) * kSlots + slot] = value;
}
__device__ __forceinline__ void stamp(int round, int slot) { put(round, slot, clock64()); }
__device__ __forceinline__ void span(int end) {  // end: 0 at the block's start, 1 at its end
  const long long now = global_timer_ns();
  if (blockIdx.x < kBlocks) {
    spans[blockIdx.x * 4 + 2 * end] = now;
    spans[blockIdx.x * 4 + 2 * end + 1] = clock64();
  }
}
#endif
}  // namespace phase_trace

// The tiles of a wgmma forward kernel: q's and k's head dim kHeadDim, v's and the output's
// kHeadDimV (Sm90FwdTraits where they are equal, Sm90FwdDvTraits where v is narrower).
template <int kHeadDim_, int kHeadDimV_, int kBlockN_, int kWarpgroups_, int kStages_>
struct Sm90FwdTiles {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kWarpgroups = kWarpgroups_;  // math warpgroups, plus one that only copies
  // K and V buffers each. With three, or two of 176 keys, or past D=128, the output is written
  // from registers: its staging buffer would not fit beside them (at D=128 Q + 3 x (K + V) of 128
  // keys is 224 KB of the 227 KB, Q + 2 x (K + V) of 176 keys 213 KB; at D=256 Q + 2 x (K + V) of
  // 64 keys 192 KB, and the output's 64 KB more).
  static constexpr int kStages = kStages_;
  static constexpr bool kStagedOutput = kStages_ == 2 && kBlockN_ <= 128 && kHeadDim_ <= 128;
  // Unstaged output from D=128 up leaves in 8-byte stores, one whole 32-byte sector a lane pair.
  // At D=64 (configuration 6) the same stores were slower, so there each thread stores its own 4
  // bytes (benches/notes/prefill-sm90.md, v3.9).
  static constexpr bool kPairedStores = !kStagedOutput && kHeadDim >= 128;
  static constexpr int kBlockM = 64 * kWarpgroups_;
  static constexpr int kMathThreads = 128 * kWarpgroups_;
  static constexpr int kNThreads = kMathThreads + 128;
  static constexpr int kNWarps = kNThreads / 32;
  static constexpr bool kPadded = false;  // Sm90PaddedTraits
  // The head dims the MMAs span (S's reduction, O's columns): the tile's, or fewer on a padded
  // tile whose columns past them are zeros (Sm90PaddedTraits).
  static constexpr int kMmaHeadDim = kHeadDim_, kMmaHeadDimV = kHeadDimV_;
  static constexpr int kChunks = kHeadDimV / 8;  // the output's 16-byte chunks a row
  static constexpr int kLoadThreads = 128;       // the producer warpgroup
  // Q, kStages K and V buffers, the output's staging buffer (two stages only), then the
  // mbarriers (Sm90Barriers).
  static constexpr int kTileBytes =
      (kBlockM * kHeadDim + kStages * kBlockN * (kHeadDim + kHeadDimV) +
       (kStagedOutput ? kBlockM * kHeadDimV : 0)) *
      2;
  static constexpr int kSmemBytes = kTileBytes + 128;
  // setmaxnreg moves registers only inside the block's own allocation, which is fixed at launch:
  // kNThreads x the launch bound's registers (the SM's 64K shared out, a multiple of 8 each).
  // The producer keeps kProducerRegs and the math warpgroups share the rest; asking for more
  // than the launch allocated leaves setmaxnreg.inc waiting forever (a hang, not an error).
  static constexpr int kLaunchRegs =
      65536 / kNThreads / 8 * 8 > 255 ? 255 : 65536 / kNThreads / 8 * 8;
  // 48 leaves the producer unspilled; with three math warpgroups (512 threads, 128 registers
  // each at launch) 32 is what leaves them 160 (the producer then spills a little; 48 / 152
  // moves the spills into the math warpgroups). Past D=128, 56: the math warpgroups' share is
  // 224 either way, and the producer's address arithmetic spilled at 48. With v narrower than q
  // and k, 64: its two copy shapes spilled at 56 (the math warpgroups keep 216).
  static constexpr int kProducerRegs = kWarpgroups_ == 3         ? 32
                                       : kHeadDimV_ != kHeadDim_ ? 64
                                       : kHeadDim_ > 128         ? 56
                                                                 : 48;
  static constexpr int kMathRegs =
      (kLaunchRegs * kNThreads - 128 * kProducerRegs) / kMathThreads / 8 * 8 > 240
          ? 240
          : (kLaunchRegs * kNThreads - 128 * kProducerRegs) / kMathThreads / 8 * 8;
  static_assert(
      128 * kProducerRegs + kMathThreads * kMathRegs <= kLaunchRegs * kNThreads,
      "setmaxnreg: the producer's and the math warpgroups' registers exceed the launch's");
  // (which N a wgmma takes: sm90::mma_ss, mma_rs)
  static_assert(kHeadDim % 64 == 0 && kHeadDimV % 64 == 0 && kBlockN % 16 == 0,
                "wgmma tiles: 64-column panels, keys in P V's 16-key steps");
  static_assert(kHeadDimV <= kHeadDim, "v no wider than q and k");
  static_assert(kSmemBytes <= 227 * 1024, "an sm_90 block has 227 KB of shared memory");
  static_assert(kStages == 2 || kStages == 3, "K and V in two or three buffers");
  static_assert((kBlockM * kHeadDim * 2) % 1024 == 0 && (kBlockN * kHeadDim * 2) % 1024 == 0 &&
                    (kBlockN * kHeadDimV * 2) % 1024 == 0,
                "every tile must start on a 1024-byte swizzle atom");
};
template <int kHeadDim_, int kBlockN_, int kWarpgroups_, int kStages_>
struct Sm90FwdTraits : Sm90FwdTiles<kHeadDim_, kHeadDim_, kBlockN_, kWarpgroups_, kStages_> {};
// A tile run at narrower head dims (q's, k's and v's multiples of 8 below the tile's), their
// columns zero-filled in shared memory: TMA maps of the tensor's real width copied a 64-column
// panel a box (TMA zero-fills past the width), cp.async copies by the tensor's chunks, the output
// and split partials stored at v's head dim. Its own instantiation, so that the tiles run unpadded
// keep their code (every guard below is `if constexpr (Traits::kPadded)`).
// kMmaHeadDim: the columns the MMAs span, 96 where q's, k's and v's head dims are all at most 96
// (80, 88, 96: S's reduction over 6 of the 8 16-column steps and P V over 96 columns of O, a
// quarter of the tile's products left out, all of them zeros), else the tile's.
template <typename Tiles, int kMmaHeadDim_ = Tiles::kHeadDim>
struct Sm90PaddedTraits : Tiles {
  static constexpr bool kPadded = true;
  static constexpr int kMmaHeadDim = kMmaHeadDim_, kMmaHeadDimV = kMmaHeadDim_;
  static_assert(kMmaHeadDim % 32 == 0 && kMmaHeadDim <= Tiles::kHeadDimV,
                "the MMAs span whole 32-column steps of the tile");
};
// v narrower than q and k (DeepSeek-V3's latent attention prefill: 192 and 128): V's buffers, P V
// and the output at kHeadDimV.
template <int kHeadDim_, int kHeadDimV_, int kBlockN_, int kWarpgroups_, int kStages_>
struct Sm90FwdDvTraits : Sm90FwdTiles<kHeadDim_, kHeadDimV_, kBlockN_, kWarpgroups_, kStages_> {};

// One warpgroup's rows of a row block: the accumulators and the online softmax's state, and the
// steps of the main loop. `buf` names which of the two K (V) buffers a step reads. kFeatures: the
// instantiation that takes a window and a softcap (a call without them runs the other, whose main
// loop is what it was before them: the features' code held registers the plain kernels lack).
// Sinks, in the rows' epilogue only (finish_rows), run in both.
template <typename Traits, typename T, bool kVarlen, bool kFeatures>
struct Sm90Rows {
  static constexpr int D = Traits::kHeadDim, DV = Traits::kHeadDimV;
  static constexpr int BM = Traits::kBlockM, BN = Traits::kBlockN;
  static constexpr int NT = BN / 8, DT = DV / 8;  // S's and O's 8-column groups
  // the next K buffer, the next V buffer
  static constexpr uint64_t kTileStep = uint64_t((BN * D * 2) >> 4);
  static constexpr uint64_t kVTileStep = uint64_t((BN * DV * 2) >> 4);
  // Lazy rescale (see softmax) where the softmax is in the math warpgroups' critical path: with
  // three warpgroups (D=64). Under ping-pong (two) the softmax already hides under the other
  // warpgroup's matmuls, and the vote only adds work (benches/notes/prefill-sm90.md, v3.2).
  static constexpr bool kLazy = Traits::kWarpgroups != 2;
  static constexpr float kLazyLog2 = 8.f;  // log2 of the growth the running max may ignore
  // Masked blocks by chunks of columns (softmax_masked) in the two-warpgroup kernels over 128-key
  // blocks. In configurations 5 at d=64 (three warpgroups, 160 registers) and 7 (176 keys) the
  // extra code spilled, so they keep the mask per element (benches/notes/prefill-sm90.md, v4.9).
  static constexpr bool kMaskByChunks = Traits::kWarpgroups == 2 && BN == 128;

  const AttentionParams& p;
  const TileCoords t;  // a copy: a reference to the caller's would give it an address
  // Keys [unmasked_begin(), unmasked_end) are visible to every row of the block: key blocks
  // inside need no mask (the left bound, a window's, recomputed rather than held).
  int m0, warp_row0, lane, unmasked_end, key_begin;
  uint64_t q_desc, k_desc, v_desc;
  float acc_o[DT][4];
  float acc_s[NT][4];
  uint32_t p_frag[BN / 16][4];
  float row_max[2], row_sum[2];
  // A softcap bounds every score: t = tanh(.) lies in [-1, 1], so exp2(t * scale_log2) lies in
  // [2^-c, 2^c], c = softcap * log2(e). Up to kFixedMaxLog2, fp32 sums and bf16's 8-bit exponent
  // hold that whole range, so the exponentials subtract a fixed max of 0: no row max, no rescale
  // (fp16 P would overflow past 2^16: it keeps the running max). FLASHMOE_FWD_SOFTCAP_FIXED_MAX.
  static constexpr bool kMayFixMax =
      kFeatures && FLASHMOE_FWD_SOFTCAP_FIXED_MAX && std::is_same_v<T, __nv_bfloat16>;
  static constexpr float kFixedMaxLog2 = 80.f;  // 2^80 a term: a sum of 2^40 keys stays finite
  bool fixed_max = false;

  __device__ __forceinline__ Sm90Rows(const AttentionParams& p_, const TileCoords& t_, int m0_,
                                      int n_lo, int warp, int lane_, const T* sQ, const T* sK,
                                      const T* sV)
      : p(p_), t(t_), m0(m0_), warp_row0(warp * 16), lane(lane_) {
    if constexpr (kFeatures) {
      unmasked_end = window_key_end(p, t.query(m0), t.len_k - t.len_q, t.len_k);
    } else {
      unmasked_end = p.causal ? min(t.len_k, t.query(m0) + t.len_k - t.len_q + 1) : t.len_k;
    }
    key_begin = planted(1) && t.split > 0 ? n_lo * BN + 1 : 0;  // planted 1
    (void)n_lo;
    // This warp's warpgroup owns rows [64 * (warp / 4), + 64) of the block.
    q_desc = sm90::desc_k_major(smem_u32(sQ + (warp / 4) * 64 * 64));
    k_desc = sm90::desc_k_major(smem_u32(sK));
    if (planted(10)) k_desc = (k_desc & ~(uint64_t(3) << 62)) | (uint64_t(2) << 62);  // K 64B
    v_desc = sm90::desc_mn_major<BN>(smem_u32(sV));
    if constexpr (DV != D) {
      if (planted(17)) v_desc = sm90::desc_mn_major<BN>(smem_u32(sK));  // planted: V from K's
    }
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        acc_o[dt][e] = 0.f;
    row_max[0] = row_max[1] = -INFINITY;
    row_sum[0] = row_sum[1] = 0.f;
    if constexpr (kMayFixMax) {
      fixed_max = p.softcap > 0.f && p.scale_log2 <= kFixedMaxLog2;
      if (fixed_max) row_max[0] = row_max[1] = 0.f;  // finish_rows: lse = log(sum)
    }
  }

  // S = Q K^T, one m64n(BN)k16 wgmma per 16 columns of the head dim, as one commit group.
  __device__ __forceinline__ void issue_s(int buf) {
    sm90::fence_operands(acc_s);
    sm90::fence();
    // planted 26: a 96-column padded tile's last step reads columns 96-111 (zeros) in place of
    // 80-95, so a head dim of 96 loses them and one of 80 does not
    constexpr int kSteps = Traits::kMmaHeadDim / 16;
#pragma unroll
    for (int kk0 = 0; kk0 < kSteps; ++kk0) {
      const int kk = kSteps == 6 && kk0 == kSteps - 1 && planted(26) ? kSteps : kk0;
      sm90::mma_ss<BN, T>(acc_s, q_desc + sm90::k_major_step<BM>(kk),
                          k_desc + buf * kTileStep + sm90::k_major_step<BN>(kk), kk > 0);
    }
    sm90::commit_group();
  }
  // O += P V, one m64n(DV)k16 wgmma per 16 keys with P from registers, as one commit group.
  __device__ __forceinline__ void issue_pv(int buf) {
    sm90::fence_operands(acc_o);
    sm90::fence();
#pragma unroll
    for (int j = 0; j < BN / 16; ++j) {
      if constexpr (DV > 128) {
        if (planted(16)) {  // planted: P V over O's first 128 columns only
          sm90::mma_rs<128, T>(*reinterpret_cast<float (*)[16][4]>(&acc_o), p_frag[j],
                               v_desc + buf * kVTileStep + sm90::mn_major_step(j), 1);
          continue;
        }
      }
      if constexpr (Traits::kMmaHeadDimV != DV) {  // O's columns past it: zeros, never touched
        constexpr int kCols = Traits::kMmaHeadDimV;
        sm90::mma_rs<kCols, T>(*reinterpret_cast<float (*)[kCols / 8][4]>(&acc_o), p_frag[j],
                               v_desc + buf * kVTileStep + sm90::mn_major_step(j), 1);
        continue;
      }
      sm90::mma_rs<DV, T>(acc_o, p_frag[j], v_desc + buf * kVTileStep + sm90::mn_major_step(j), 1);
    }
    sm90::commit_group();
  }
  // Waits until at most N groups are in flight; the accumulators they write are then readable.
  template <int N>
  __device__ __forceinline__ void wait() {
    sm90::wait_group<N>();
    sm90::fence_operands(acc_s);
    sm90::fence_operands(acc_o);
  }

  // Folds a block's row max `mx` (over the quad) into row hh's running max and sum; returns the
  // scaled max the exponentials subtract. Lazy: the running max moves only when the block's max
  // exceeds it by more than a factor of 2^kLazyLog2: below that the probabilities stay under
  // 2^kLazyLog2 (fp16 and bf16 hold that exactly as well as values under 1), the output and the
  // sum need no rescale, and the log-sum-exp uses the same max, so the result is the same. (NaN:
  // both -inf.)
  __device__ __forceinline__ float fold_max(int hh, float mx, float (&rescale)[2]) {
    const float grown = (mx - row_max[hh]) * p.scale_log2;
    if (!kLazy || !(grown <= kLazyLog2)) {
      const float max_scaled = mx == -INFINITY ? 0.f : mx * p.scale_log2;
      rescale[hh] = exp2f(row_max[hh] * p.scale_log2 - max_scaled);
      row_max[hh] = mx;
      row_sum[hh] *= rescale[hh];
      return max_scaled;
    }
    rescale[hh] = 1.f;
    return row_max[hh] * p.scale_log2;
  }
  __device__ __forceinline__ int unmasked_begin() const {
    return window_first_key(p, t.query(min(m0 + BM, t.rows_total) - 1), t.len_k - t.len_q);
  }
  // A softcap's t = tanh(s * softcap_scale) in place of the scores (apply_softcap), before the
  // mask as FlashAttention applies it.
  __device__ __forceinline__ void cap_scores() {
    if (p.softcap > 0.f) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        apply_softcap(acc_s[nt], p);
    }
  }
  // Masks S(n), folds it into the running max and sum and leaves P(n) in acc_s; `rescale` is
  // what the output accumulated so far must be multiplied by.
  __device__ __forceinline__ void softmax(int n, float (&rescale)[2]) {
    const bool cap_after_mask = kFeatures && planted(21);  // planted 21
    if constexpr (kFeatures) {
      if (!cap_after_mask) cap_scores();
    }
    bool need_mask = (n + 1) * BN > unmasked_end;
    if constexpr (kFeatures) {
      need_mask = need_mask || (p.window_left >= 0 && n * BN < unmasked_begin());
    }
    need_mask = need_mask || (planted(1) && n * BN < key_begin);
    if constexpr (kMaskByChunks) {
      // (the chunks bound the right edge only: a window's left one takes the per-element mask)
      if (need_mask && !cap_after_mask && (!kFeatures || p.window_left < 0)) {
        softmax_masked(n, rescale);
        return;
      }
    }
    if (need_mask) {
      const int offset = t.len_k - t.len_q;
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int i = t.query(m0 + warp_row0 + lane / 4 + hh * 8);
        const int last_key = p.causal ? min(t.len_k - 1, i + offset) : t.len_k - 1;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 2 * hh; e < 2 * hh + 2; ++e) {
            const int col = n * BN + nt * 8 + (lane & 3) * 2 + (e & 1);
            bool masked = kFeatures ? outside_window(p, col, i, offset, t.len_k) : col > last_key;
            masked = masked || (planted(1) && col < key_begin);
            if (masked) acc_s[nt][e] = -INFINITY;
          }
      }
    }
    if constexpr (kFeatures) {
      if (cap_after_mask) cap_scores();  // planted: a masked key then scores -softcap
    }
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float max_scaled = 0.f;
      if (kMayFixMax && fixed_max) {
        rescale[hh] = 1.f;
      } else {
        float mx = row_max[hh];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          mx = fmaxf(mx, fmaxf(acc_s[nt][2 * hh], acc_s[nt][2 * hh + 1]));
        max_scaled = fold_max(hh, quad_max(mx), rescale);
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 2 * hh; e < 2 * hh + 2; ++e) {
          const float prob = exp2f(fmaf(acc_s[nt][e], p.scale_log2, -max_scaled));
          acc_s[nt][e] = prob;
          row_sum[hh] += prob;
        }
    }
  }
  // softmax() for a key block that needs a mask, by chunks of kC column groups (8 columns each):
  // a chunk past the last key any of the warp's 16 rows sees is skipped (P = 0: no max, no
  // exponentials), a chunk before the first row's last key needs no test per element, and only
  // the chunks the warp's diagonal crosses are masked element by element. A causal diagonal block
  // of 128 x 128 leaves a warp 2 to 16 of its 16 column groups, 9 on average. The bounds are the
  // same in every lane, so the branches are uniform; the arithmetic (the max, the exponentials,
  // the sum's order) is softmax()'s, so P is the same bit for bit.
  __device__ __forceinline__ void softmax_masked(int n, float (&rescale)[2]) {
    constexpr int kC = 4, kChunks = NT / kC;
    static_assert(NT % kC == 0, "whole chunks of column groups");
    const int base = n * BN;
    auto last_key_of = [&](int r) {  // non-decreasing in r, packed GQA rows included
      if constexpr (kFeatures) return window_key_end(p, t.query(r), t.len_k - t.len_q, t.len_k) - 1;
      return p.causal ? min(t.len_k - 1, t.query(r) + t.len_k - t.len_q) : t.len_k - 1;
    };
    const int r_first = m0 + warp_row0;
    int lo = last_key_of(r_first) - base;             // columns <= lo: visible to all 16 rows
    const int hi = last_key_of(r_first + 15) - base;  // columns > hi: masked for all 16 rows
    if (planted(1)) lo = -1;  // every chunk tested element by element, where the planted test is
    int lk[2];                // this thread's rows' last visible column, less its own first column
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
      lk[hh] = last_key_of(m0 + warp_row0 + lane / 4 + hh * 8) - base - (lane & 3) * 2;
    float mx[2] = {row_max[0], row_max[1]};
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      if (c * kC * 8 > hi) break;  // this chunk and every later one: masked for all rows
      if (c * kC * 8 + kC * 8 - 1 > lo) {
#pragma unroll
        for (int nt = c * kC; nt < c * kC + kC; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            bool masked = nt * 8 + (e & 1) > lk[e >> 1];
            masked = masked || (planted(1) && base + nt * 8 + (lane & 3) * 2 + (e & 1) < key_begin);
            if (masked) acc_s[nt][e] = -INFINITY;
          }
      }
      if (kMayFixMax && fixed_max) continue;
#pragma unroll
      for (int nt = c * kC; nt < c * kC + kC; ++nt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
          mx[hh] = fmaxf(mx[hh], fmaxf(acc_s[nt][2 * hh], acc_s[nt][2 * hh + 1]));
    }
    float max_scaled[2] = {0.f, 0.f};
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      if (kMayFixMax && fixed_max) {
        rescale[hh] = 1.f;
      } else {
        max_scaled[hh] = fold_max(hh, quad_max(mx[hh]), rescale);
      }
    }
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      if (c * kC * 8 > hi) {
#pragma unroll
        for (int nt = c * kC; nt < c * kC + kC; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            acc_s[nt][e] = 0.f;
        continue;
      }
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
#pragma unroll
        for (int nt = c * kC; nt < c * kC + kC; ++nt)
#pragma unroll
          for (int e = 2 * hh; e < 2 * hh + 2; ++e) {
            const float prob = exp2f(fmaf(acc_s[nt][e], p.scale_log2, -max_scaled[hh]));
            acc_s[nt][e] = prob;
            row_sum[hh] += prob;
          }
    }
  }
  // O *= what the latest softmax's max moved it by, before the P V of that softmax's P.
  __device__ __forceinline__ void rescale_o(const float (&rescale)[2]) {
    // Lazy: past the first key blocks the max rarely moves (see softmax), and the warp skips
    // the multiplies when none of its rows did.
    if (kMayFixMax && fixed_max) return;  // the max never moves
    bool any_moved = true;
    if constexpr (kLazy) {
      any_moved = __any_sync(0xffffffffu, rescale[0] != 1.f || rescale[1] != 1.f);
    }
    if (planted(12)) any_moved = false;  // planted: never rescaled when the running max moves
    if (any_moved) {
#pragma unroll
      for (int dt = 0; dt < Traits::kMmaHeadDimV / 8; ++dt)  // (the rest: zeros)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          acc_o[dt][e] *= rescale[e >> 1];
    }
  }
  __device__ __forceinline__ void pack_p() {
#pragma unroll
    for (int j = 0; j < BN / 16; ++j) {
      p_frag[j][0] = pack2<T>(acc_s[2 * j][0], acc_s[2 * j][1]);
      p_frag[j][1] = pack2<T>(acc_s[2 * j][2], acc_s[2 * j][3]);
      p_frag[j][2] = pack2<T>(acc_s[2 * j + 1][0], acc_s[2 * j + 1][1]);
      p_frag[j][3] = pack2<T>(acc_s[2 * j + 1][2], acc_s[2 * j + 1][3]);
    }
  }

  // Normalises and writes this warp's 16 rows of tile (block_x, split): O and the log-sum-exp, or
  // the split's fp32 partials. O is staged through the same rows of `stage` (which only this
  // warp touches now) so that it leaves in 16-byte row chunks, or without a staging buffer
  // (Traits::kStagedOutput false) written from registers: 4 bytes a thread, or 8 bytes a thread
  // and 32 a lane pair (Traits::kPairedStores). `te` is the tile's coordinates, recomputed by
  // the caller rather than held through the loop.
  // The rows' normaliser and log-sum-exp, in place of their sum and max: it needs only the last
  // softmax, so the caller runs it while the last P V is in flight. Before write_out.
  // With sinks (one split), each row's sink joins its normaliser and log-sum-exp (fold_sink); the
  // split partials get theirs when combined.
  __device__ __forceinline__ void finish_rows(const TileCoords& te) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float sum = quad_sum(row_sum[hh]);
      row_sum[hh] = te.bad_len ? NAN : sum > 0.f ? 1.f / sum : 0.f;
      row_max[hh] = te.bad_len  ? NAN
                    : sum > 0.f ? row_max[hh] * p.softmax_scale + logf(sum)
                                : -INFINITY;
      // Every instantiation: sinks alone run the plain kernel (has_score_features).
      const int r = (te.m_blocks - 1 - te.m_block) * BM + warp_row0 + lane / 4 + hh * 8;
      const bool drop_sink = !kFeatures && planted(27);  // planted 27
      if (p.sinks != nullptr && p.num_splits == 1 && r < te.rows_total && !drop_sink) {
        float factor;
        row_max[hh] = fold_sink(row_max[hh], p.sinks[te.head(r)], factor);
        row_sum[hh] *= factor;
      }
    }
  }
  __device__ __forceinline__ void write_out(T* stage, const TileCoords& te) {
    constexpr bool kStaged = Traits::kStagedOutput;
    constexpr int kChunks = Traits::kChunks;
    T* sQ = stage;
    const int eb = te.b, em0 = (te.m_blocks - 1 - te.m_block) * BM;
    const int64_t rows_all = int64_t(p.batch) * p.heads_q * p.seqlen_q;
    auto o_row_of = [&](int r) {  // the output row of tile row r
      return static_cast<T*>(p.o) + eb * p.o_batch_stride + te.head(r) * p.o_head_stride +
             (te.row0_q + te.query(r)) * p.o_row_stride;
    };
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float inv = row_sum[hh], lse = row_max[hh];  // finish_rows
      const int row = warp_row0 + lane / 4 + hh * 8, r = em0 + row;
      if (kStaged && p.num_splits == 1) {
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
          *reinterpret_cast<uint32_t*>(sQ + swizzle<DV>(row, dt) + (lane & 3) * 2) =
              pack2<T>(acc_o[dt][2 * hh] * inv, acc_o[dt][2 * hh + 1] * inv);
      }
      if (!kStaged && !Traits::kPairedStores && p.num_splits == 1 && r < te.rows_total) {
        T* o_row = o_row_of(r) + (lane & 3) * 2;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
          if constexpr (Traits::kPadded) {
            if (dt * 8 >= p.head_dim_v) break;  // the padding's columns stay in the tile
          }
          *reinterpret_cast<uint32_t*>(o_row + dt * 8) =
              pack2<T>(acc_o[dt][2 * hh] * inv, acc_o[dt][2 * hh + 1] * inv);
        }
      }
      if (Traits::kPairedStores && p.num_splits == 1) {
        // 8 bytes a thread, a whole 32-byte sector a lane pair: lanes 2i and 2i + 1 of a quad
        // trade halves (one shuffle a pair of 8-column chunks), the even lane then holds columns
        // 4i..4i+3 of chunk dt, the odd one those of chunk dt + 1. Every lane shuffles (a quad's
        // row may be past the end; another quad's not), then only rows in range store.
        const bool odd = lane & 1;
        uint2 pairs[DT / 2];
#pragma unroll
        for (int dt = 0; dt < DT; dt += 2) {
          const uint32_t lo = pack2<T>(acc_o[dt][2 * hh] * inv, acc_o[dt][2 * hh + 1] * inv);
          const uint32_t hi =
              pack2<T>(acc_o[dt + 1][2 * hh] * inv, acc_o[dt + 1][2 * hh + 1] * inv);
          const uint32_t got = __shfl_xor_sync(0xffffffffu, odd ? lo : hi, 1);
          pairs[dt / 2] = odd ? make_uint2(got, hi) : make_uint2(lo, got);
        }
        if (r < te.rows_total) {  // one branch and one address for the row's stores
          T* o_row = o_row_of(r) + (lane & 2) * 2 + odd * 8;
#pragma unroll
          for (int dt = 0; dt < DT; dt += 2) {
            if constexpr (Traits::kPadded) {
              if ((dt + odd) * 8 >= p.head_dim_v) continue;
            }
            *reinterpret_cast<uint2*>(o_row + dt * 8) = pairs[dt / 2];
          }
        }
      }
      if (r >= te.rows_total) continue;
      const int64_t lse_index =
          kVarlen ? int64_t(te.head(r)) * p.total_q + te.row0_q + te.query(r)
                  : (int64_t(eb) * p.heads_q + te.head(r)) * p.seqlen_q + te.query(r);
      if (p.num_splits == 1) {
        if ((lane & 3) == 0) p.lse[lse_index] = lse;
      } else {
        // the partials' rows are v's head dim wide, as split_kv_combine reads them
        const int width = Traits::kPadded ? p.head_dim_v : DV;
        float* o_row = p.o_accum + (te.split * rows_all + lse_index) * width;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
          if constexpr (Traits::kPadded) {
            if (dt * 8 >= p.head_dim_v) break;
          }
          *reinterpret_cast<float2*>(o_row + dt * 8 + (lane & 3) * 2) =
              make_float2(acc_o[dt][2 * hh] * inv, acc_o[dt][2 * hh + 1] * inv);
        }
        if ((lane & 3) == 0) p.lse_accum[te.split * rows_all + lse_index] = lse;
      }
    }
    if (kStaged && p.num_splits == 1) {
      __syncwarp();
#pragma unroll
      for (int c = lane; c < 16 * kChunks; c += 32) {
        const int row = warp_row0 + c / kChunks, ch = c % kChunks, r = em0 + row;
        if (r >= te.rows_total) continue;
        if constexpr (Traits::kPadded) {
          if (ch * 8 >= p.head_dim_v) continue;
        }
        *reinterpret_cast<uint4*>(o_row_of(r) + ch * 8) =
            *reinterpret_cast<const uint4*>(sQ + swizzle<DV>(row, ch));
      }
    }
  }
};

// The block's place: its tile coordinates, first row and the key blocks [n_lo, n_hi) it visits
// (from the last to the first: without a window only the first ones visited need masks).
template <typename Traits, bool kVarlen, bool kFeatures>
struct Sm90Block {
  TileCoords t;
  int m0, n_lo, n_hi;
  __device__ __forceinline__ Sm90Block(const AttentionParams& p, int block_x, int split)
      : t(TileCoords::of_block<Traits::kBlockM, kVarlen>(p, block_x, split)) {
    m0 = (t.m_blocks - 1 - t.m_block) * Traits::kBlockM;  // heavy (causal) row blocks first
    // the split's share of the key blocks, counted from the window's first (features only)
    n_lo = t.split * p.n_blocks_per_split;
    if constexpr (kFeatures)
      n_lo += window_first_block<Traits::kBlockN>(p, t.query(m0), t.len_k - t.len_q);
    n_hi =
        min(t.kv_block_end<Traits::kBlockM, Traits::kBlockN>(p, m0), n_lo + p.n_blocks_per_split);
  }
  // Copies K(n) or V(n) (kD: k's or v's tile width; `width`: the tensor's, whose 16-byte chunks
  // are copied and those past it zero-filled where the tile is padded) into buffer `buf` of
  // `tiles`, spread over kLoadThreads threads.
  template <int kD, typename T>
  __device__ __forceinline__ void load(T* tiles, const T* base, int64_t row_stride, int width,
                                       int n, int buf, int tid) const {
    constexpr int D = kD, BN = Traits::kBlockN;
    if (planted(11) && n * BN + BN > t.len_k) return;  // planted: the last, partial tile not copied
    // unpadded, every chunk of a row is the tensor's
    const int chunks = Traits::kPadded ? width / 8 : D / 8;
    load_kv_tile<D, BN, Traits::kLoadThreads, /*kPanels=*/true>(
        tiles + buf * BN * D, base, row_stride, n * BN, t.len_k, chunks, tid);
  }
  template <typename T>
  __device__ __forceinline__ const T* k_base(const AttentionParams& p) const {
    return static_cast<const T*>(p.k) + t.b * p.k_batch_stride + t.row0_k * p.k_row_stride +
           t.hkv * p.k_head_stride;
  }
  template <typename T>
  __device__ __forceinline__ const T* v_base(const AttentionParams& p) const {
    return static_cast<const T*>(p.v) + t.b * p.v_batch_stride + t.row0_k * p.v_row_stride +
           t.hkv * p.v_head_stride;
  }
};

// A tile of kRows rows and kCols columns by TMA from row `row` of one head: one box of all its
// 64-column panels, or where the tile is padded (its map the tensor's real width) one box a
// panel, TMA zero-filling the columns past that width. The same bytes land either way.
template <bool kByPanel, int kCols, int kRows, typename T>
__device__ __forceinline__ void tma_tile(T* dst, const void* map, uint64_t* bar, int row, int head,
                                         int batch) {
  if constexpr (kByPanel) {
#pragma unroll
    for (int c = 0; c < kCols / 64; ++c) {
      // planted 18: every panel's box from the first panel's columns
      const int column = planted(18) ? 0 : c * 64;
      sm90::tma_load_5d(dst + c * kRows * 64, map, bar, column, row, 0, head, batch);
    }
  } else {
    sm90::tma_load_5d(dst, map, bar, 0, row, 0, head, batch);
  }
}

// The warp-specialized kernel's mbarriers, after the tiles: Q landed / free again, K and V
// landed in a buffer (the producer's 128 threads arrive as their copies land, or with TMA one
// thread and the copy's bytes), and a buffer free again (each math warp arrives when done).
struct Sm90Barriers {
  static constexpr int kMaxStages = 3;
  uint64_t q_full, q_empty, k_full[kMaxStages], v_full[kMaxStages], k_empty[kMaxStages],
      v_empty[kMaxStages];
};
static_assert(sizeof(Sm90Barriers) <= 128, "the mbarriers get 128 bytes after the tiles");

// Warp-specialized and persistent: one block per SM walks the tiles of
// (batch x head x row block) x split in rounds (tile_of); the last warpgroup copies,
// the others compute. The producer runs ahead across tiles (the next tile's Q and first K/V tiles
// load while the math warps finish this one); with two K/V stages the output is staged in its own
// buffer, with three it is written from registers.
// Buffers are used in turn over the whole walk: key block number `use` (counted over every tile)
// sits in buffer use % kStages for the (use / kStages)-th time, so waits for it to be full are on
// parity (use / kStages) % 2 and waits for it to be empty on the other (a fresh barrier passes
// the first).
template <typename Traits, typename T, bool kVarlen, bool kFeatures>
__device__ __forceinline__ void flash_fwd_sm90_block(const AttentionParams& p) {
  constexpr int D = Traits::kHeadDim, DV = Traits::kHeadDimV;
  constexpr int BM = Traits::kBlockM, BN = Traits::kBlockN;
  constexpr int kMathWarps = Traits::kMathThreads / 32;
  constexpr int kStages = Traits::kStages;
  // Q by TMA where the host encoded its map (p.q_tma), from d=128 up: at d=64 Q was never late and
  // TMA was slower (benches/notes/prefill-sm90.md, v3.8, v4.7), so the d=64 kernels keep only the
  // cp.async copy.
  constexpr bool kQByTma = D >= 128;
  auto stage_of = [](int use) { return use % kStages; };
  auto phase_of = [](int use) { return (use / kStages) & 1; };

  extern __shared__ __align__(1024) uint4 smem_buf[];
  T* sQ = reinterpret_cast<T*>(smem_buf);
  T* sK = sQ + BM * D;
  T* sV = sK + kStages * BN * D;
  T* sO = sV + kStages * BN * DV;  // the output's staging (Traits::kStagedOutput)
  Sm90Barriers& bar =
      *reinterpret_cast<Sm90Barriers*>(reinterpret_cast<char*>(smem_buf) + Traits::kTileBytes);

  // With two math warpgroups the warp index comes through a shuffle from lane 0: the compiler then
  // knows it is the same in every lane, so the role branch and what derives from the warp (the
  // math loop's counters, the wgmma descriptors) live in uniform registers, with no
  // register-to-uniform moves before each wgmma. Three math warpgroups (configuration 5) already
  // kept them uniform; there the shuffled index was slower and added producer spills, so they keep
  // tid / 32 (benches/notes/prefill-sm90.md, v4.4).
  const int tid = threadIdx.x, lane = tid % 32;
  const int warp = Traits::kWarpgroups == 2 ? __shfl_sync(0xffffffffu, tid / 32, 0) : tid / 32;
  const int full_count = p.tma ? 1 : 128;
  FLASHMOE_PHASE(if (tid == 0) phase_trace::span(0);)
  if (tid == 0) {
    sm90::mbar_init(&bar.q_full, kQByTma && p.q_tma ? 1 : 128);
    sm90::mbar_init(&bar.q_empty, kMathWarps);
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      sm90::mbar_init(&bar.k_full[s], full_count);
      sm90::mbar_init(&bar.v_full[s], full_count);
      sm90::mbar_init(&bar.k_empty[s], kMathWarps);
      sm90::mbar_init(&bar.v_empty[s], kMathWarps);
    }
    sm90::mbar_init_fence();
  }
  __syncthreads();

  // The tiles (batch x head x row block, as the non-persistent grid numbers them) per split.
  // Each role counts them after its setmaxnreg: a value live across one goes to local memory.
  auto tiles_per_split = [&]() {
    const int group = p.pack_gqa ? p.heads_ratio : 1;
    return p.batch * (p.pack_gqa ? p.heads_kv : p.heads_q) * ceil_div(p.seqlen_q * group, BM);
  };
  // The tile of walk step `round`: the grid takes the tiles in rounds of gridDim.x, forward on
  // even rounds and backward on odd ones. The tiles come heaviest first (causal), so a block that
  // got a heavier tile in one round gets a lighter one in the next; a plain stride would give
  // block 0 the heaviest tile of every round (12% more work than the last block at S 16k, and
  // with row blocks fastest a fixed row block per block: 4x at S 512).
  auto tile_of = [&](int round) {
    const int g = gridDim.x, bx = blockIdx.x;
    return round * g + ((round & 1) ? g - 1 - bx : bx);
  };
  // A tile with work: rows of its sequence and key blocks to visit (both roles skip the others
  // alike, so their barrier counts stay in step).
  auto has_work = [&](const Sm90Block<Traits, kVarlen, kFeatures>& blk) {
    return !(kVarlen && blk.m0 >= blk.t.rows_total) && blk.n_hi > blk.n_lo;
  };

  if (warp >= kMathWarps) {  // the producer
    sm90::setmaxnreg_dec<Traits::kProducerRegs>();
    const int ptid = tid - Traits::kMathThreads;
    // whole TMA boxes of K and V, zero-filled past the tensor
    constexpr uint32_t kBytes = BN * D * 2, kVBytes = BN * DV * 2;
    if (p.tma && ptid == 0) {
      sm90::prefetch_tensor_map(p.tma_k);
      sm90::prefetch_tensor_map(p.tma_v);
      if (kQByTma && p.q_tma) sm90::prefetch_tensor_map(p.tma_q);
    }
    const int tiles_x = tiles_per_split(), tiles = tiles_x * p.num_splits;
    int q_uses = 0, use = 0;
    for (int round = 0, tile = tile_of(0); tile < tiles; tile = tile_of(++round)) {
      const Sm90Block<Traits, kVarlen, kFeatures> blk(p, tile % tiles_x, tile / tiles_x);
      if (!has_work(blk)) continue;
      FLASHMOE_PHASE(if (ptid == 0) phase_trace::stamp(round, phase_trace::kProducer);)
      // Q by TMA: one thread, one box of one head's queries m0.. (zeros past the end).
      if (kQByTma && p.q_tma) {
        if (ptid == 0) {
          sm90::mbar_wait(&bar.q_empty, (q_uses & 1) ^ 1);
          FLASHMOE_PHASE(phase_trace::stamp(round, phase_trace::kProducer + 1);)
          sm90::mbar_arrive_expect_tx(&bar.q_full, uint32_t(BM) * D * 2);
          tma_tile<Traits::kPadded, D, BM>(sQ, p.tma_q, &bar.q_full, blk.m0, blk.t.head(blk.m0),
                                           blk.t.b);
        }
        ++q_uses;
      } else {
        sm90::mbar_wait(&bar.q_empty, (q_uses++ & 1) ^ 1);
        FLASHMOE_PHASE(if (ptid == 0) phase_trace::stamp(round, phase_trace::kProducer + 1);)
        blk.t.template load_q<D, BM, 128, /*kPanels=*/true, Traits::kPadded>(sQ, p, blk.m0, ptid);
        sm90::mbar_arrive_on_copies(&bar.q_full);
      }
      FLASHMOE_PHASE(if (ptid == 0) phase_trace::stamp(round, phase_trace::kProducer + 2);)
      const T* k_base = blk.template k_base<T>(p);
      const T* v_base = blk.template v_base<T>(p);
      // Coordinates {column in panel, row, panel, head, batch} of the host's 5-D maps (a packed
      // batch is one sequence of total_k rows, this one starting at row0_k).
      const int row0 = blk.t.row0_k, bb = kVarlen ? 0 : blk.t.b, hkv = blk.t.hkv;
      for (int n = blk.n_hi - 1; n >= blk.n_lo; --n, ++use) {
        const int s = stage_of(use), empty_parity = phase_of(use) ^ 1;
        if (p.tma) {
          if (ptid != 0) continue;
          // planted 11: the last, partial box is never copied
          const bool copy = !planted(11) || n * BN + BN <= blk.t.len_k;
          sm90::mbar_wait(&bar.k_empty[s], empty_parity);
          sm90::mbar_arrive_expect_tx(&bar.k_full[s], copy ? kBytes : 0);
          if (copy) {
            tma_tile<Traits::kPadded, D, BN>(sK + s * BN * D, p.tma_k, &bar.k_full[s],
                                             row0 + n * BN, hkv, bb);
          }
          sm90::mbar_wait(&bar.v_empty[s], empty_parity);
          sm90::mbar_arrive_expect_tx(&bar.v_full[s], copy ? kVBytes : 0);
          if (copy) {
            tma_tile<Traits::kPadded, DV, BN>(sV + s * BN * DV, p.tma_v, &bar.v_full[s],
                                              row0 + n * BN, hkv, bb);
          }
        } else {
          sm90::mbar_wait(&bar.k_empty[s], empty_parity);
          blk.template load<D>(sK, k_base, p.k_row_stride, p.head_dim, n, s, ptid);
          sm90::mbar_arrive_on_copies(&bar.k_full[s]);
          sm90::mbar_wait(&bar.v_empty[s], empty_parity);
          blk.template load<DV>(sV, v_base, p.v_row_stride, p.head_dim_v, n, s, ptid);
          sm90::mbar_arrive_on_copies(&bar.v_full[s]);
        }
      }
    }
    cp_async_commit();
    cp_async_wait<0>();  // no thread leaves with copies in flight
    return;
  }

  sm90::setmaxnreg_inc<Traits::kMathRegs>();
  // The math warpgroups take turns issuing their GEMMs, in a cycle (ping-pong with two, round
  // robin with three), so one's softmax runs under the others' matmuls; the last gives the first
  // its first turn. (Every warpgroup issues the same number of batches; the last pass is never
  // waited for, which the block's exit discards.) Three take turns too: faster at d=64
  // (benches/notes/prefill-sm90.md, v4.6).
  constexpr int kWarpgroups = Traits::kWarpgroups;
  const int wg = warp / 4;
  auto my_turn = [&]() { sm90::wait_turn(wg); };
  auto their_turn = [&]() { sm90::pass_turn<kWarpgroups>(wg); };
  if (wg == kWarpgroups - 1) sm90::pass_turn<kWarpgroups>(wg);
  // The output's rescale runs while the tensor cores run this warpgroup's S, between its S and its
  // P V (FlashAttention-3's order above head dim 128), not between the P V's end and the next
  // turn; with three warpgroups it pays only together with the turns
  // (benches/notes/prefill-sm90.md, v4.4, v4.6).
  // Waits until the producer's copies into a buffer landed, then makes them visible to wgmma.
  auto wait_full = [&](uint64_t* full, int use) {
    // planted 9: the first warpgroup skips its wait for the first K tile. (It issues first: the
    // second, skipping it, would still read after the first waited, which hides the bug.)
    if (planted(9) && wg == 0 && use == 0) return;
    sm90::mbar_wait(full, phase_of(use));
    sm90::fence_proxy_async();
  };
  auto release = [&](uint64_t* empty) {
    __syncwarp();
    if (lane == 0) sm90::mbar_arrive(empty);
  };

  const int tiles_x = tiles_per_split(), tiles = tiles_x * p.num_splits;
  int q_uses = 0, use = 0;
  for (int round = 0, tile = tile_of(0); tile < tiles; tile = tile_of(++round)) {
    const int block_x = tile % tiles_x, split = tile / tiles_x;
    const Sm90Block<Traits, kVarlen, kFeatures> blk(p, block_x, split);
    if (kVarlen && blk.m0 >= blk.t.rows_total) continue;  // past its sequence: nothing to write
    const int n_lo = blk.n_lo, n_hi = blk.n_hi;
    // With three math warpgroups (192-row tiles), one whose 64 rows all lie past the tile's last
    // row (a sequence's last row block) has nothing to compute or write. It keeps the block's
    // protocol: the same waits for Q, K and V to land before it gives their buffers back (an
    // arrival before the copy landed would count towards the buffer's previous use), and as many
    // turns as the others take. In the two-warpgroup kernels the branch was slower
    // (benches/notes/prefill-sm90.md, v5.0), so they keep computing such rows.
    // The test goes through __all_sync: a branch on tid / 32 the compiler
    // cannot prove warp-uniform took the key-block loop's descriptors out of uniform registers.
    if (kWarpgroups == 3 && __all_sync(0xffffffffu, blk.m0 + wg * 64 >= blk.t.rows_total)) {
      if (n_hi > n_lo) {
        sm90::mbar_wait(&bar.q_full, q_uses++ & 1);
#pragma unroll 1
        for (int n = n_hi - 1; n >= n_lo; --n, ++use) {
          const int s = stage_of(use);
          my_turn();
          their_turn();
          sm90::mbar_wait(&bar.k_full[s], phase_of(use));
          release(&bar.k_empty[s]);
          if (n == n_lo) release(&bar.q_empty);
          sm90::mbar_wait(&bar.v_full[s], phase_of(use));
          release(&bar.v_empty[s]);
        }
        my_turn();  // the other warpgroups' last P V
        their_turn();
      }
      continue;
    }
    // The phase trace's stamps (FLASHMOE_PHASE_TRACE builds only): one thread per warpgroup.
    FLASHMOE_PHASE(const bool tracer = tid % 128 == 0; auto mark = [&](phase_trace::Mark m) {
      if (tracer) phase_trace::stamp(round, wg * phase_trace::kPerWarpgroup + m);
    };)
    FLASHMOE_PHASE(mark(phase_trace::kTileStart);)
    FLASHMOE_PHASE(if (tracer) phase_trace::put(round, phase_trace::kKeyBlocks + wg, n_hi - n_lo);)
    Sm90Rows<Traits, T, kVarlen, kFeatures> rows(p, blk.t, blk.m0, n_lo, warp, lane, sQ, sK, sV);
    float rescale[2];
    // The output's coordinates: recomputed (not held through the loop, which has no registers to
    // spare), while the last P V runs where there is one, so that their integer divisions do not
    // sit between that P V and the output's stores.
    auto out_coords = [&]() { return TileCoords::of_block<BM, kVarlen>(p, block_x, split); };
    TileCoords out_te;
    if (n_hi > n_lo) {
      sm90::mbar_wait(&bar.q_full, q_uses++ & 1);
      sm90::fence_proxy_async();
      FLASHMOE_PHASE(mark(phase_trace::kQReady);)
      // The first key block: S alone.
      int buf = stage_of(use);
      wait_full(&bar.k_full[buf], use);
      FLASHMOE_PHASE(mark(phase_trace::kFirstKReady);)
      my_turn();
      rows.issue_s(buf);
      their_turn();
      rows.template wait<0>();
      FLASHMOE_PHASE(mark(phase_trace::kFirstS);)
      release(&bar.k_empty[buf]);
      if (n_hi - n_lo == 1) release(&bar.q_empty);  // the tile's last read of Q
      rows.softmax(n_hi - 1, rescale);
      rows.pack_p();
      FLASHMOE_PHASE(mark(phase_trace::kFirstSoftmax);)
      // Then S(n) with P(n + 1) V(n + 1), the previous block's V in the previous buffer.
      for (int n = n_hi - 2; n >= n_lo; --n) {
        const int prev = buf;
        buf = stage_of(++use);
        wait_full(&bar.k_full[buf], use);
        wait_full(&bar.v_full[prev], use - 1);
        my_turn();
        rows.issue_s(buf);
        rows.rescale_o(rescale);  // before P(n + 1) V(n + 1)
        rows.issue_pv(prev);
        their_turn();
        rows.template wait<1>();  // S(n) is done; P(n + 1) V(n + 1) may still run
        release(&bar.k_empty[buf]);
        if (n == n_lo) release(&bar.q_empty);
        rows.softmax(n, rescale);
        rows.template wait<0>();
        release(&bar.v_empty[prev]);
        rows.pack_p();
      }
      FLASHMOE_PHASE(mark(phase_trace::kLoopDone);)
      wait_full(&bar.v_full[buf], use);
      my_turn();
      rows.rescale_o(rescale);
      rows.issue_pv(buf);
      their_turn();
      FLASHMOE_PHASE(mark(phase_trace::kLastPVIssued);)
      out_te = out_coords();
      rows.finish_rows(out_te);
      rows.template wait<0>();
      FLASHMOE_PHASE(mark(phase_trace::kLastPV);)
      release(&bar.v_empty[buf]);
      ++use;
    } else {
      out_te = out_coords();
      rows.finish_rows(out_te);
    }
    rows.write_out(sO, out_te);
    FLASHMOE_PHASE(mark(phase_trace::kOutput);)
  }
  FLASHMOE_PHASE(if (tid == 0) phase_trace::span(1);)
}

template <typename Traits, typename T, bool kVarlen, bool kFeatures>
__device__ __forceinline__ void flash_fwd_sm90_entry(const AttentionParams& p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  flash_fwd_sm90_block<Traits, T, kVarlen, kFeatures>(p);
#elif defined(__CUDA_ARCH__)
  __trap();  // wgmma exists on sm_90a only; the host never launches this elsewhere
#endif
}

// One block per SM: the register budget is the SM's over the block's warpgroups. kFeatures: a
// window or a softcap (Sm90Rows; sinks run in both).
template <typename Traits, typename T, bool kFeatures = false>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_fwd_sm90_kernel(const __grid_constant__ AttentionParams p) {
  flash_fwd_sm90_entry<Traits, T, /*kVarlen=*/false, kFeatures>(p);
}

template <typename Traits, typename T, bool kFeatures = false>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_fwd_sm90_varlen_kernel(const __grid_constant__ AttentionParams p) {
  flash_fwd_sm90_entry<Traits, T, /*kVarlen=*/true, kFeatures>(p);
}

}  // namespace flashmoe::cuda
