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

// Keys [*lo, *hi) of the len_k a query row `i` of seqlen_q sees through the window (bottom-right
// aligned: the row sits at p = i + len_k - seqlen_q and sees p - left <= j <= p + right, -1
// unbounded); empty (lo == hi) when it sees none. The backward walks the same range, so work
// grows with the window, not with the sequence.
inline void window_keys(int i, int seqlen_q, int len_k, int left, int right, int* lo, int* hi) {
  const int64_t pos = int64_t(i) + len_k - seqlen_q;
  int64_t begin = 0, end = len_k;
  if (left >= 0) begin = pos - left + (planted(20) ? 1 : 0);  // planted bug 20: one key short
  if (right >= 0) end = pos + right + 1;
  begin = std::clamp<int64_t>(begin, 0, len_k);
  *lo = int(begin);
  *hi = int(std::clamp<int64_t>(end, begin, len_k));
}

// Keys [begin, end) of the KV cache that query row `i` of batch `b` attends to within split
// `split`.
inline void split_key_range(const AttentionParams& p, int b, int i, int split, int* begin,
                            int* end) {
  const int len_k = p.seqlens_k ? p.seqlens_k[b] : p.seqlen_k;
  int lo, hi;
  window_keys(i, p.seqlen_q, len_k, p.window_left, p.window_right, &lo, &hi);
  const int keys_per_split = p.n_blocks_per_split * kBlockN;
  int first = split * keys_per_split;
  if (planted(1) && split > 0) first += 1;
  *begin = std::max(lo, first);
  *end = std::min(hi, (split + 1) * keys_per_split);
}

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// log(exp(lse) + exp(sink)): a row's log-sum-exp with its sink's logit added to the denominator.
inline float add_sink(float lse, float sink) {
  const float m = std::max(lse, sink);
  if (m == kNegInf) return kNegInf;
  return m + std::log(std::exp(lse - m) + std::exp(sink - m));
}

// A row's score in base-2 logits: q.k * scale, soft-capped (softcap * tanh(. / softcap)) when
// softcap > 0, times log2(e), so exp(logit) == exp2(score).
inline float score_log2(const AttentionParams& p, float dot) {
  if (p.softcap > 0.f) return p.softcap * std::tanh(dot * p.softmax_scale / p.softcap) * kLog2e;
  return dot * p.scale_log2;
}

// One query row over keys [begin, end): writes the normalised output (Dv floats) and the
// log-sum-exp. q, k, v are fp32 and contiguous ([B, H, S, D], v's rows Dv wide). Keys outside
// [mask_lo, mask_hi) are masked (-inf; only planted bug 21 walks over such keys). With `sink`,
// the row's denominator gains exp(*sink): the output shrinks by exp(lse - lse with the sink),
// and the log-sum-exp includes it (a row that sees no key then keeps output 0 and lse = *sink).
inline void attend_row(const AttentionParams& p, const float* q_row, const float* k_head,
                       const float* v_head, int begin, int end, float* out, float* lse,
                       std::vector<float>& scores, const float* sink = nullptr, int mask_lo = 0,
                       int mask_hi = std::numeric_limits<int>::max()) {
  const int d = p.head_dim, dv = p.head_dim_v;
  std::fill(out, out + dv, 0.f);
  float row_max = kNegInf, row_sum = 0.f;  // row_max in base-2 logits
  for (int n0 = begin; n0 < end; n0 += kBlockN) {
    const int n1 = std::min(end, n0 + kBlockN);
    float block_max = kNegInf;
    for (int j = n0; j < n1; ++j) {
      float score = kNegInf;
      if (j >= mask_lo && j < mask_hi) {
        const float* k_row = k_head + int64_t(j) * d;
        float s = 0.f;
        for (int c = 0; c < d; ++c)
          s += q_row[c] * k_row[c];
        score = score_log2(p, s);
      } else if (p.softcap > 0.f) {
        score = -p.softcap * kLog2e;  // planted bug 21: softcap * tanh(-inf / softcap), masked
      }
      scores[j - n0] = score;
      block_max = std::max(block_max, score);
    }
    const float new_max = std::max(row_max, block_max);
    // A row that has seen only masked keys keeps max = -inf; use 0 so exp2(-inf - 0) = 0, not NaN.
    const float max_used = new_max == kNegInf ? 0.f : new_max;
    const float rescale = std::exp2(row_max - max_used);
    row_sum *= rescale;
    for (int c = 0; c < dv; ++c)
      out[c] *= rescale;
    for (int j = n0; j < n1; ++j) {
      const float prob = std::exp2(scores[j - n0] - max_used);
      row_sum += prob;
      const float* v_row = v_head + int64_t(j) * dv;
      for (int c = 0; c < dv; ++c)
        out[c] += prob * v_row[c];
    }
    row_max = new_max;
  }
  float row_lse = kNegInf;
  if (row_sum == 0.f) {  // no visible key: output 0, log-sum-exp -inf
    std::fill(out, out + dv, 0.f);
  } else {
    const float inv = 1.f / row_sum;
    for (int c = 0; c < dv; ++c)
      out[c] *= inv;
    row_lse = row_max * kLn2 + std::log(row_sum);
  }
  if (sink != nullptr) {
    const float with_sink = add_sink(row_lse, *sink);
    if (row_lse != kNegInf) {
      const float w = std::exp(row_lse - with_sink);
      for (int c = 0; c < dv; ++c)
        out[c] *= w;
    }
    row_lse = with_sink;
  }
  *lse = row_lse;
}

// Reduce per-split partial outputs: lse = log sum_s exp(lse_s); out = sum_s exp(lse_s - lse) *
// out_s. o_accum: [splits, rows, D], lse_accum: [splits, rows]; out: [rows, D]; lse: [rows].
// With sinks (fp32 [heads]; row r's head is (r / rows_per_head) % heads), each row's sum gains
// its head's exp(sink) once, here, never once per split: the splits' partials hold keys only.
inline void split_kv_combine(const float* o_accum, const float* lse_accum, int num_splits,
                             int64_t rows, int d, float* out, float* lse,
                             const float* sinks = nullptr, int64_t rows_per_head = 1,
                             int heads = 1) {
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* sink = sinks ? sinks + (r / rows_per_head) % heads : nullptr;
      float lse_max = kNegInf;
      for (int s = 0; s < num_splits; ++s)
        lse_max = std::max(lse_max, lse_accum[s * rows + r]);
      float* o = out + r * d;
      std::fill(o, o + d, 0.f);
      if (lse_max == kNegInf) {  // every split was empty
        lse[r] = sink ? *sink : kNegInf;
        continue;
      }
      float sum = 0.f;
      for (int s = 0; s < num_splits; ++s)
        sum += std::exp(lse_accum[s * rows + r] - lse_max);
      float lse_row = lse_max + std::log(sum);
      if (sink) lse_row = add_sink(lse_row, *sink);
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
      int mask_lo = begin, mask_hi = end;
      if (planted(21) && p.softcap > 0.f) {
        // planted: the key blocks the window touches are walked whole, and their masked keys
        // soft-capped after the mask (-inf becomes -softcap)
        const int len_k = p.seqlens_k ? p.seqlens_k[b] : p.seqlen_k;
        const int split_begin = split * p.n_blocks_per_split * kBlockN;
        const int split_end = std::min(len_k, split_begin + p.n_blocks_per_split * kBlockN);
        if (begin < end) {
          begin = std::max(split_begin, begin / kBlockN * kBlockN);
          end = std::min(split_end, ceil_div(end, kBlockN) * kBlockN);
        }
      }
      float* out = p.num_splits == 1 ? static_cast<float*>(p.o) + row * dv
                                     : p.o_accum + (int64_t(split) * rows + row) * dv;
      float* lse = p.num_splits == 1 ? p.lse + row : p.lse_accum + int64_t(split) * rows + row;
      // Split partials hold keys only: split_kv_combine adds the sink, once.
      const float* sink = p.sinks != nullptr && p.num_splits == 1 ? p.sinks + h : nullptr;
      attend_row(p, q + row * d, k + k_offset, v + v_offset, begin, end, out, lse, scores, sink,
                 mask_lo, mask_hi);
    }
  });
}

// Gradients of one (batch, KV head): the query heads of its group and all their rows, so dK and dV
// of a group are summed here without races. fp32 contiguous tensors (q, k, dq, dk D wide; v, o,
// dout, dv Dv wide); p.lse is the forward's log-sum-exp (its sink included). dq, dk and dv are
// written whole (every element, zero where nothing flows back). Each row walks the keys of its
// window only. P is recomputed from the log-sum-exp: P_ij = exp(t_ij - lse_i), t_ij the scaled
// (and soft-capped) score; with delta_i = rowsum(dout_i * o_i): dV_j += P_ij dout_i,
// dT_ij = P_ij (dout_i . v_j - delta_i) (a sink has no value, so it adds no term), dS_ij = dT_ij
// (1 - tanh^2) under softcap, dQ_i += scale dS_ij k_j, dK_j += scale dS_ij q_i. A sink's gradient:
// o_i = sum_j P_ij v_j moves by -P_sink o_i as its logit grows (P_sink = exp(sink - lse_i)), so
// dsink = -sum_i P_sink delta_i, one sum per (batch, head) in p.dsinks.
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
        float dsink = 0.f;
        for (int i = 0; i < p.seqlen_q; ++i) {
          const int64_t row = (int64_t(b) * p.heads_q + h) * p.seqlen_q + i;
          float* dq_row = dq + row * d;
          std::fill(dq_row, dq_row + d, 0.f);
          const float lse =
              p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + i * p.lse_row_stride];
          if (lse == kNegInf) continue;  // the row saw no key: nothing flows back through it
          int lo, hi;
          window_keys(i, p.seqlen_q, p.seqlen_k, p.window_left, p.window_right, &lo, &hi);
          const float* q_row = q + row * d;
          const float* do_row = dout + row * d_v;
          const float* o_row = o + row * d_v;
          float delta = 0.f;
          for (int c = 0; c < d_v; ++c)
            delta += do_row[c] * o_row[c];
          if (p.sinks != nullptr) dsink -= std::exp(p.sinks[h] - lse) * delta;
          int dq_end = hi;
          if (planted(6))  // planted: the last key block lost
            dq_end = hi > 0 ? (hi - 1) / kBlockN * kBlockN : 0;
          for (int j = lo; j < hi; ++j) {
            const float* k_row = k + k_offset + int64_t(j) * d;
            const float* v_row = v + v_offset + int64_t(j) * d_v;
            float s = 0.f, dp = 0.f;
            for (int c = 0; c < d; ++c)
              s += q_row[c] * k_row[c];
            for (int c = 0; c < d_v; ++c)
              dp += do_row[c] * v_row[c];
            float score = s * p.softmax_scale, capped_slope = 1.f;
            if (p.softcap > 0.f) {
              const float t = std::tanh(score / p.softcap);
              score = p.softcap * t;
              capped_slope = 1.f - t * t;  // d(softcap tanh(x / softcap)) / dx
            }
            const float prob = std::exp(score - lse);
            float ds = prob * (dp - delta) * capped_slope;
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
        // planted bug 22: the sink's gradient never accumulated
        if (p.dsinks != nullptr) p.dsinks[int64_t(b) * p.heads_q + h] = planted(22) ? 0.f : dsink;
      }
    }
  });
}

}  // namespace flashmoe::cpu
