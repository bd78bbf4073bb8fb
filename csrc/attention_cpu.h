// CPU implementation of the attention operators: the same online-softmax and split-KV algorithm as
// the CUDA kernels, accumulating in fp32, so the whole pipeline (gates, bisect, benchmarks) runs on
// machines without a GPU. Correct first; it is not meant to be fast.
#pragma once

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <vector>

#include "attention_params.h"

namespace flashmoe::cpu {

// Keys per online-softmax step; also the unit in which KV is divided among splits.
constexpr int kBlockN = 64;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The planted bug of this build (see FLASHMOE_PLANT_BUG in attention_params.h): a constant, so an
// unplanted build compiles the planted branches away, except in the CPU plant build (-1), which
// reads its bug once from the environment.
inline int planted_bug() {
#if FLASHMOE_PLANT_BUG < 0
  static const int chosen = [] {
    const char* value = std::getenv("FLASHMOE_PLANT_BUG");
    return value ? std::atoi(value) : 0;
  }();
  return chosen;
#else
  return FLASHMOE_PLANT_BUG;
#endif
}

inline bool planted(int bug) { return planted_bug() == bug; }

// Keys [begin, end) of the KV cache that query row `i` of batch `b` attends to within split
// `split`.
inline void split_key_range(const AttentionParams& p, int b, int i, int split, int* begin,
                            int* end) {
  const int len_k = p.seqlens_k ? p.seqlens_k[b] : p.seqlen_k;
  int visible = len_k;
  if (p.causal) visible = std::min(len_k, i + len_k - p.seqlen_q + 1);
  visible = std::max(visible, 0);
  const int keys_per_split = p.n_blocks_per_split * kBlockN;
  *begin = split * keys_per_split;
  *end = std::min(visible, (split + 1) * keys_per_split);
  if (planted(1) && split > 0) *begin += 1;
}

// One query row over keys [begin, end): writes the normalised output (Dv floats) and the
// log-sum-exp. q, k, v are fp32 and contiguous ([B, H, S, D], v's rows Dv wide).
inline void attend_row(const AttentionParams& p, const float* q_row, const float* k_head,
                       const float* v_head, int begin, int end, float* out, float* lse,
                       std::vector<float>& scores) {
  const int d = p.head_dim, dv = p.head_dim_v;
  std::fill(out, out + dv, 0.f);
  float row_max = kNegInf, row_sum = 0.f;
  for (int n0 = begin; n0 < end; n0 += kBlockN) {
    const int n1 = std::min(end, n0 + kBlockN);
    float block_max = kNegInf;
    for (int j = n0; j < n1; ++j) {
      const float* k_row = k_head + int64_t(j) * d;
      float s = 0.f;
      for (int c = 0; c < d; ++c)
        s += q_row[c] * k_row[c];
      scores[j - n0] = s;
      block_max = std::max(block_max, s);
    }
    const float new_max = std::max(row_max, block_max);
    // A row that has seen only masked keys keeps max = -inf; use 0 so exp2(-inf - 0) = 0, not NaN.
    const float max_scaled = new_max == kNegInf ? 0.f : new_max * p.scale_log2;
    const float rescale = std::exp2(row_max * p.scale_log2 - max_scaled);
    row_sum *= rescale;
    for (int c = 0; c < dv; ++c)
      out[c] *= rescale;
    for (int j = n0; j < n1; ++j) {
      const float prob = std::exp2(scores[j - n0] * p.scale_log2 - max_scaled);
      row_sum += prob;
      const float* v_row = v_head + int64_t(j) * dv;
      for (int c = 0; c < dv; ++c)
        out[c] += prob * v_row[c];
    }
    row_max = new_max;
  }
  if (row_sum == 0.f) {  // no visible key: output 0, log-sum-exp -inf
    std::fill(out, out + dv, 0.f);
    *lse = kNegInf;
    return;
  }
  const float inv = 1.f / row_sum;
  for (int c = 0; c < dv; ++c)
    out[c] *= inv;
  *lse = row_max * p.softmax_scale + std::log(row_sum);
}

// Reduce per-split partial outputs: lse = log sum_s exp(lse_s); out = sum_s exp(lse_s - lse) *
// out_s. o_accum: [splits, rows, D], lse_accum: [splits, rows]; out: [rows, D]; lse: [rows].
inline void split_kv_combine(const float* o_accum, const float* lse_accum, int num_splits,
                             int64_t rows, int d, float* out, float* lse) {
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float lse_max = kNegInf;
      for (int s = 0; s < num_splits; ++s)
        lse_max = std::max(lse_max, lse_accum[s * rows + r]);
      float* o = out + r * d;
      std::fill(o, o + d, 0.f);
      if (lse_max == kNegInf) {  // every split was empty
        lse[r] = kNegInf;
        continue;
      }
      float sum = 0.f;
      for (int s = 0; s < num_splits; ++s)
        sum += std::exp(lse_accum[s * rows + r] - lse_max);
      const float lse_row = lse_max + std::log(sum);
      lse[r] = lse_row;
      for (int s = 0; s < num_splits; ++s) {
        // An empty split weighs 0; skip it rather than multiply, so whatever it holds cannot leak
        // in.
        if (lse_accum[s * rows + r] == kNegInf) continue;
        const float w = std::exp(lse_accum[s * rows + r] - lse_row);
        const float* os = o_accum + (int64_t(s) * rows + r) * d;
        for (int c = 0; c < d; ++c)
          o[c] += w * os[c];
      }
      if (planted(2)) {
        const float w0 = std::exp(lse_accum[r] - lse_row);
        for (int c = 0; c < d; ++c)
          o[c] += w0 * o_accum[r * d + c];
      }
    }
  });
}

// Attention over fp32 contiguous q [B, Hq, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv]. With
// one split it writes p.o (fp32 [B, Hq, Sq, Dv]) and p.lse directly; with more, p.o_accum /
// p.lse_accum, which the caller combines. Rows are (b, hq, i); GQA maps query head hq to KV head
// hq / heads_ratio.
inline void attention_forward(const AttentionParams& p, const float* q, const float* k,
                              const float* v) {
  const int d = p.head_dim, dv = p.head_dim_v;
  const int64_t rows = int64_t(p.batch) * p.heads_q * p.seqlen_q;
  const int64_t work = rows * p.num_splits;
  at::parallel_for(0, work, 16, [&](int64_t w0, int64_t w1) {
    std::vector<float> scores(kBlockN);
    for (int64_t w = w0; w < w1; ++w) {
      const int split = int(w / rows);
      const int64_t row = w % rows;
      const int i = int(row % p.seqlen_q);
      const int h = int((row / p.seqlen_q) % p.heads_q);
      const int b = int(row / (int64_t(p.seqlen_q) * p.heads_q));
      const int hkv = h / p.heads_ratio;
      const int64_t kv_head = int64_t(b) * p.heads_kv + hkv;
      const int64_t k_offset = kv_head * p.seqlen_k * d;
      int64_t v_offset = kv_head * p.seqlen_k * dv;
      if (planted(13))  // planted: V's head found at K's offset (the Q/K width), kept inside V
        v_offset = k_offset % ((int64_t(p.batch) * p.heads_kv - 1) * p.seqlen_k * dv + 1);
      int begin, end;
      split_key_range(p, b, i, split, &begin, &end);
      float* out = p.num_splits == 1 ? static_cast<float*>(p.o) + row * dv
                                     : p.o_accum + (int64_t(split) * rows + row) * dv;
      float* lse = p.num_splits == 1 ? p.lse + row : p.lse_accum + int64_t(split) * rows + row;
      attend_row(p, q + row * d, k + k_offset, v + v_offset, begin, end, out, lse, scores);
    }
  });
}

// Gradients of one (batch, KV head): the query heads of its group and all their rows, so dK and dV
// of a group are summed here without races. fp32 contiguous tensors (q, k, dq, dk D wide; v, o,
// dout, dv Dv wide); p.lse is the forward's
// log-sum-exp. dq, dk and dv are written whole (every element, zero where nothing flows back).
// P is recomputed from the log-sum-exp: P_ij = exp(s_ij * scale - lse_i); with
// delta_i = rowsum(dout_i * o_i): dV_j += P_ij dout_i, dS_ij = P_ij (dout_i . v_j - delta_i),
// dQ_i += scale dS_ij k_j, dK_j += scale dS_ij q_i.
inline void attention_backward(const BwdParams& p, const float* q, const float* k, const float* v,
                               const float* o, const float* dout, float* dq, float* dk, float* dv) {
  const int d = p.head_dim, d_v = p.head_dim_v;
  at::parallel_for(0, int64_t(p.batch) * p.heads_kv, 1, [&](int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w) {
      const int b = int(w / p.heads_kv), hkv = int(w % p.heads_kv);
      const int64_t k_offset = (int64_t(b) * p.heads_kv + hkv) * p.seqlen_k * d;
      const int64_t v_offset = (int64_t(b) * p.heads_kv + hkv) * p.seqlen_k * d_v;
      float* dk_head = dk + k_offset;
      float* dv_head = dv + v_offset;
      std::fill(dk_head, dk_head + int64_t(p.seqlen_k) * d, 0.f);
      std::fill(dv_head, dv_head + int64_t(p.seqlen_k) * d_v, 0.f);
      // planted bug 5: only the group's first query head reaches dK and dV
      const int group = planted(5) ? 1 : p.heads_ratio;
      for (int g = 0; g < p.heads_ratio; ++g) {
        const int h = hkv * p.heads_ratio + g;
        for (int i = 0; i < p.seqlen_q; ++i) {
          const int64_t row = (int64_t(b) * p.heads_q + h) * p.seqlen_q + i;
          float* dq_row = dq + row * d;
          std::fill(dq_row, dq_row + d, 0.f);
          const float lse =
              p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + i * p.lse_row_stride];
          if (lse == kNegInf) continue;  // the row saw no key: nothing flows back through it
          int visible = p.seqlen_k;
          if (p.causal) visible = std::min(visible, i + p.seqlen_k - p.seqlen_q + 1);
          const float* q_row = q + row * d;
          const float* do_row = dout + row * d_v;
          const float* o_row = o + row * d_v;
          float delta = 0.f;
          for (int c = 0; c < d_v; ++c)
            delta += do_row[c] * o_row[c];
          int dq_end = visible;
          if (planted(6))  // planted: the last key block lost
            dq_end = visible > 0 ? (visible - 1) / kBlockN * kBlockN : 0;
          for (int j = 0; j < visible; ++j) {
            const float* k_row = k + k_offset + int64_t(j) * d;
            const float* v_row = v + v_offset + int64_t(j) * d_v;
            float s = 0.f, dp = 0.f;
            for (int c = 0; c < d; ++c)
              s += q_row[c] * k_row[c];
            for (int c = 0; c < d_v; ++c)
              dp += do_row[c] * v_row[c];
            const float prob = std::exp(s * p.softmax_scale - lse);
            float ds = prob * (dp - delta);
            if (!planted(4)) ds *= p.softmax_scale;  // planted bug 4 leaves the scale out
            if (g >= group) {  // planted bug 5: this head's share of dK and dV is dropped
              if (j < dq_end) {
                for (int c = 0; c < d; ++c)
                  dq_row[c] += ds * k_row[c];
              }
              continue;
            }
            float* dk_row = dk_head + int64_t(j) * d;
            float* dv_row = dv_head + int64_t(j) * d_v;
            for (int c = 0; c < d_v; ++c)
              dv_row[c] += prob * do_row[c];
            for (int c = 0; c < d; ++c)
              dk_row[c] += ds * q_row[c];
            if (j < dq_end) {
              for (int c = 0; c < d; ++c)
                dq_row[c] += ds * k_row[c];
            }
          }
        }
      }
    }
  });
}

}  // namespace flashmoe::cpu
