// Host side of the operators shared by both compilation units: the operator schemas, input checks
// with one-line errors, output allocation, empty-input handling and the CPU implementation.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cstdio>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>

#include "attention_cpu.h"
#include "attention_params.h"

// Input errors are thrown as plain c10::Error whose message starts with the Python exception type;
// flashmoe_science/ops.py turns the prefix into TypeError / ValueError. The message is assembled
// here with std::to_string rather than by c10::str's ostream: on the GPU machine (torch 2.11, the
// image's GCC 13 wrapper) a unit whose error path streamed a number or a shape into an ostream
// crashed the process with a segmentation fault, while string-only messages were caught fine.
#define FLASHMOE_CHECK_VALUE(cond, ...) \
  TORCH_CHECK(cond, ::flashmoe::error_text("ValueError: ", __VA_ARGS__))
#define FLASHMOE_CHECK_TYPE(cond, ...) \
  TORCH_CHECK(cond, ::flashmoe::error_text("TypeError: ", __VA_ARGS__))

namespace flashmoe {

using at::Tensor;

inline std::string to_text(const std::string& s) { return s; }
inline std::string to_text(const char* s) { return s; }
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
std::string to_text(T value) {
  return std::to_string(value);
}
inline std::string to_text(double value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", value);
  return text;
}
inline std::string to_text(c10::IntArrayRef values) {
  std::string out = "[";
  for (size_t i = 0; i < values.size(); ++i)
    out += (i ? ", " : "") + std::to_string(values[i]);
  return out + "]";
}
inline std::string to_text(const c10::Device& device) {
  std::string out = device.is_cuda() ? "cuda" : device.is_cpu() ? "cpu" : "other";
  return device.has_index() ? out + ":" + std::to_string(device.index()) : out;
}

template <typename... Args>
std::string error_text(const Args&... args) {
  return (std::string() + ... + to_text(args));
}

inline std::string shape_str(const Tensor& t) { return to_text(t.sizes()); }

// Dtype names as Python spells them, so errors read "torch.float32" rather than "Float".
inline std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kHalf:
      return "torch.float16";
    case at::kBFloat16:
      return "torch.bfloat16";
    case at::kFloat:
      return "torch.float32";
    case at::kDouble:
      return "torch.float64";
    case at::kInt:
      return "torch.int32";
    case at::kLong:
      return "torch.int64";
    case at::kBool:
      return "torch.bool";
    default:
      return std::string("torch.") + c10::toString(t);
  }
}

inline bool is_half_type(at::ScalarType t) {
  return t == at::ScalarType::Half || t == at::ScalarType::BFloat16;
}

// The checks of q, k and v that the dense and the packed layouts share: each tensor's rank
// (`layout` names its dimensions), dtype, device and unit-stride last dimension; one dtype, one
// batch (dense only: `batched`), one head_dim for q and k (the last dimension; v's, the output's,
// may differ), k and v of one shape but for it, and heads (dimension 1) of q a multiple of those
// of k and v. Every message names the argument, what was given and what is supported, in one
// line.
inline void check_qkv(const Tensor& q, const Tensor& k, const Tensor& v, int64_t rank,
                      const char* layout, bool batched) {
  const Tensor* named[] = {&q, &k, &v};
  const char* names[] = {"q", "k", "v"};
  const int64_t last = rank - 1;
  for (int t = 0; t < 3; ++t) {
    const Tensor& x = *named[t];
    FLASHMOE_CHECK_VALUE(x.dim() == rank, names[t], " must have ", rank, " dimensions ", layout,
                         ", got ", x.dim(), " (shape ", shape_str(x), ")");
    FLASHMOE_CHECK_TYPE(is_half_type(x.scalar_type()), names[t], " has dtype ",
                        dtype_name(x.scalar_type()), "; supported: torch.float16, torch.bfloat16");
    FLASHMOE_CHECK_VALUE(x.device() == q.device(), names[t], " is on ", x.device(), " but q is on ",
                         q.device(), "; all inputs must be on the same device");
    FLASHMOE_CHECK_VALUE(x.size(last) <= 1 || x.stride(last) == 1, names[t],
                         " must be contiguous in its last dimension (stride 1), got strides ",
                         x.strides(), "; call .contiguous() first");
  }
  FLASHMOE_CHECK_TYPE(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
                      "q, k and v must share one dtype, got ", dtype_name(q.scalar_type()), ", ",
                      dtype_name(k.scalar_type()), ", ", dtype_name(v.scalar_type()));
  if (batched) {
    FLASHMOE_CHECK_VALUE(k.size(0) == q.size(0) && v.size(0) == q.size(0), "batch sizes differ: q ",
                         shape_str(q), ", k ", shape_str(k), ", v ", shape_str(v));
  }
  FLASHMOE_CHECK_VALUE(k.size(last) == q.size(last), "head_dim differs: q ", shape_str(q), ", k ",
                       shape_str(k), "; k's last dimension must be q's (v's may differ)");
  FLASHMOE_CHECK_VALUE(k.sizes().slice(0, last) == v.sizes().slice(0, last),
                       "k and v must have the same shape but for the last dimension (v's head_dim "
                       "may differ), got k ",
                       shape_str(k), ", v ", shape_str(v));
  FLASHMOE_CHECK_VALUE(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "heads of q (", q.size(1),
                       ") must be a multiple of heads of k and v (", k.size(1),
                       ") for grouped-query attention");
}

// Checks shared by the CPU and CUDA implementations of the dense layout.
inline void check_attention_inputs(const Tensor& q, const Tensor& k, const Tensor& v,
                                   const std::optional<Tensor>& seqlens_k, int64_t num_splits) {
  check_qkv(q, k, v, 4, "[batch, heads, seq, head_dim]", /*batched=*/true);
  FLASHMOE_CHECK_VALUE(num_splits >= 0 && num_splits <= kMaxSplits, "num_splits must be in [0, ",
                       kMaxSplits, "] (0 = automatic), got ", num_splits);
  if (seqlens_k.has_value()) {
    const Tensor& s = *seqlens_k;
    FLASHMOE_CHECK_TYPE(s.scalar_type() == at::ScalarType::Int, "cache_seqlens has dtype ",
                        dtype_name(s.scalar_type()), "; supported: torch.int32");
    FLASHMOE_CHECK_VALUE(s.dim() == 1 && s.size(0) == q.size(0),
                         "cache_seqlens must have shape [batch] = [", q.size(0), "], got ",
                         shape_str(s));
    FLASHMOE_CHECK_VALUE(s.device() == q.device(), "cache_seqlens is on ", s.device(),
                         " but q is on ", q.device());
  }
}

// Values are checked on the host, so the caller pays a device sync only when it passes
// cache_seqlens.
inline void check_seqlens_values(const Tensor& seqlens_cpu, int64_t seqlen_k) {
  const int* s = seqlens_cpu.data_ptr<int>();
  for (int64_t b = 0; b < seqlens_cpu.numel(); ++b) {
    FLASHMOE_CHECK_VALUE(s[b] >= 0 && s[b] <= seqlen_k, "cache_seqlens[", b, "] = ", s[b],
                         " is outside [0, ", seqlen_k, "] (the cache length)");
  }
}

// The window, softcap and sinks every operator takes (schema defaults: none of them): a window
// side is -1 (unbounded) or a count of keys, softcap 0 (off) or finite and positive, sinks fp32
// [Hq] on q's device (q's heads are its dimension 1 in the dense and the packed layouts).
inline void check_features(const Tensor& q, int64_t window_left, int64_t window_right,
                           double softcap, const std::optional<Tensor>& sinks) {
  constexpr int64_t kMaxWindow = std::numeric_limits<int>::max();
  FLASHMOE_CHECK_VALUE(
      window_left >= -1 && window_left <= kMaxWindow && window_right >= -1 &&
          window_right <= kMaxWindow,
      "window_size=(", window_left, ", ", window_right,
      ") is not supported: each side must be -1 (unbounded) or a number of keys in [0, 2^31 - 1]");
  FLASHMOE_CHECK_VALUE(std::isfinite(softcap) && softcap >= 0, "softcap=", softcap,
                       " is not supported: it must be 0 (off) or a finite number > 0");
  if (!sinks.has_value()) return;
  const Tensor& t = *sinks;
  FLASHMOE_CHECK_TYPE(t.scalar_type() == at::kFloat, "sinks has dtype ",
                      dtype_name(t.scalar_type()),
                      "; supported: torch.float32 (one sink logit per query head)");
  FLASHMOE_CHECK_VALUE(t.dim() == 1 && t.size(0) == q.size(1),
                       "sinks must have shape [heads_q] = [", q.size(1), "], got ", shape_str(t));
  FLASHMOE_CHECK_VALUE(t.device() == q.device(), "sinks is on ", t.device(), " but q is on ",
                       q.device(), "; all inputs must be on the same device");
}

// Sets the window (resolved against causal, as FlashAttention does), the softcap and the sinks
// (fp32, contiguous: the caller keeps the tensor alive) of a call.
template <typename Params>
void set_features(Params& p, const Window& window, double softcap, const Tensor* sinks) {
  p.causal = window.causal;
  p.window_left = window.left;
  p.window_right = window.right;
  p.softcap = float(softcap);
  p.sinks = sinks ? sinks->data_ptr<float>() : nullptr;
}

// Which of k's and v's dimensions hold the heads and the keys: 1 and 2 for [B, Hkv, S, D], 2 and 1
// for a paged cache's [num_pages, page_size, Hkv, D], read in place (each transposed view is a
// dispatcher call, on a path whose host cost is a target: benches/notes/varlen-paged.md, v4.3).
struct KvDims {
  int heads = 1, keys = 2;
};

inline AttentionParams make_params(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                                   double softmax_scale, KvDims kv = {}) {
  AttentionParams p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.q_batch_stride = q.stride(0), p.q_head_stride = q.stride(1), p.q_row_stride = q.stride(2);
  p.k_batch_stride = k.stride(0), p.k_head_stride = k.stride(kv.heads);
  p.k_row_stride = k.stride(kv.keys);
  p.v_batch_stride = v.stride(0), p.v_head_stride = v.stride(kv.heads);
  p.v_row_stride = v.stride(kv.keys);
  p.batch = int(q.size(0));
  p.heads_q = int(q.size(1));
  p.heads_kv = int(k.size(kv.heads));
  p.seqlen_q = int(q.size(2));
  p.seqlen_k = int(k.size(kv.keys));
  p.head_dim = int(q.size(3));
  p.head_dim_v = int(v.size(3));
  p.heads_ratio = p.heads_q / p.heads_kv;
  p.softmax_scale = float(softmax_scale);
  p.scale_log2 = float(softmax_scale * 1.4426950408889634);
  p.num_splits = 1;
  set_features(p, resolve_window(causal, -1, -1), 0, nullptr);
  return p;
}

// Outputs for inputs with nothing to compute: B, Hq or Sq is 0 (empty results), or there are no
// keys (output 0, log-sum-exp -inf, the limit of an empty softmax). The output is [B, Hq, Sq,
// head_dim_v], v's last dimension.
inline std::optional<std::tuple<Tensor, Tensor>> empty_result(const Tensor& q, int64_t keys,
                                                              int64_t head_dim_v) {
  const bool no_rows = q.numel() == 0 && (q.size(0) == 0 || q.size(1) == 0 || q.size(2) == 0);
  if (!no_rows && keys != 0) return std::nullopt;
  auto out = at::zeros({q.size(0), q.size(1), q.size(2), head_dim_v},
                       q.options().memory_format(at::MemoryFormat::Contiguous));
  auto lse = at::full({q.size(0), q.size(1), q.size(2)}, -std::numeric_limits<float>::infinity(),
                      q.options().dtype(at::kFloat));
  return std::make_tuple(out, lse);
}

// ------------------------------------------------------------------------------------------------
// CPU implementation
// ------------------------------------------------------------------------------------------------

inline void check_combine_inputs(const Tensor& out_partial, const Tensor& lse_partial,
                                 at::ScalarType dtype) {
  FLASHMOE_CHECK_TYPE(
      out_partial.scalar_type() == at::kFloat && lse_partial.scalar_type() == at::kFloat,
      "out_partial and lse_partial must be torch.float32, got ",
      dtype_name(out_partial.scalar_type()), " and ", dtype_name(lse_partial.scalar_type()));
  FLASHMOE_CHECK_VALUE(
      out_partial.dim() == 5 && lse_partial.dim() == 4 &&
          out_partial.sizes().slice(0, 4) == lse_partial.sizes(),
      "out_partial must be [splits, B, H, Sq, D] and lse_partial [splits, B, H, Sq], got ",
      shape_str(out_partial), " and ", shape_str(lse_partial));
  FLASHMOE_CHECK_VALUE(out_partial.size(0) >= 1 && out_partial.size(0) <= kMaxSplits,
                       "the number of splits must be in [1, ", kMaxSplits, "], got ",
                       out_partial.size(0));
  FLASHMOE_CHECK_TYPE(is_half_type(dtype), "dtype ", dtype_name(dtype),
                      " is not supported; supported: torch.float16, torch.bfloat16");
  FLASHMOE_CHECK_VALUE(lse_partial.device() == out_partial.device(), "lse_partial is on ",
                       lse_partial.device(), " but out_partial is on ", out_partial.device());
}

// The reduction of split_kv_combine_cpu; with sinks (fp32 [H]), each row's sum gains its head's
// sink once.
inline std::tuple<Tensor, Tensor> combine_cpu(const Tensor& out_partial, const Tensor& lse_partial,
                                              at::ScalarType dtype,
                                              const std::optional<Tensor>& sinks = std::nullopt) {
  auto o_acc = out_partial.contiguous();
  auto l_acc = lse_partial.contiguous();
  const int64_t rows = l_acc.numel() / l_acc.size(0);
  const int d = int(o_acc.size(4));
  auto out = at::empty(o_acc.sizes().slice(1), o_acc.options());
  auto lse = at::empty(l_acc.sizes().slice(1), l_acc.options());
  if (rows > 0) {
    cpu::split_kv_combine(o_acc.data_ptr<float>(), l_acc.data_ptr<float>(), int(o_acc.size(0)),
                          rows, d, out.data_ptr<float>(), lse.data_ptr<float>(),
                          sinks ? sinks->data_ptr<float>() : nullptr, l_acc.size(3),
                          int(l_acc.size(2)));
  }
  return {out.to(dtype), lse};
}

inline std::tuple<Tensor, Tensor> split_kv_combine_cpu(const Tensor& out_partial,
                                                       const Tensor& lse_partial,
                                                       at::ScalarType dtype) {
  check_combine_inputs(out_partial, lse_partial, dtype);
  return combine_cpu(out_partial, lse_partial, dtype);
}

// The forward of every CPU operator: dense q [B, Hq, Sq, D], k and v [B, Hkv, Sk, D or Dv], with
// cache_seqlens for decode. `decode`: called for flash_attention_decode (planted bug 23 loses the
// window there).
inline std::tuple<Tensor, Tensor> forward_cpu(const Tensor& q, const Tensor& k, const Tensor& v,
                                              const std::optional<Tensor>& seqlens_k, bool causal,
                                              double softmax_scale, int64_t num_splits,
                                              int64_t config, int64_t window_left,
                                              int64_t window_right, double softcap,
                                              const std::optional<Tensor>& sinks, bool decode) {
  check_attention_inputs(q, k, v, seqlens_k, num_splits);
  check_features(q, window_left, window_right, softcap, sinks);
  FLASHMOE_CHECK_VALUE(q.device().is_cpu(), "q is on ", q.device(),
                       "; this is the CPU implementation");
  FLASHMOE_CHECK_VALUE(
      config == 0, "config=", config,
      " selects a CUDA tile configuration, but the inputs are CPU tensors; use config=0 "
      "(automatic) on the CPU");
  if (seqlens_k.has_value()) check_seqlens_values(*seqlens_k, k.size(2));
  std::optional<Tensor> sinks_c;
  if (sinks.has_value()) sinks_c = sinks->contiguous();
  if (auto empty = empty_result(q, k.size(2), v.size(3))) {
    // no key at all: each row's log-sum-exp is its sink's logit alone
    if (sinks_c && q.numel() > 0) std::get<1>(*empty).copy_(sinks_c->view({1, -1, 1}));
    return *empty;
  }

  auto qf = q.to(at::kFloat).contiguous();
  auto kf = k.to(at::kFloat).contiguous();
  auto vf = v.to(at::kFloat).contiguous();
  AttentionParams p = make_params(qf, kf, vf, causal, softmax_scale);
  set_features(p, resolve_window(causal, window_left, window_right), softcap,
               sinks_c ? &*sinks_c : nullptr);
  if (decode && cpu::planted(23)) p.window_left = -1;  // planted: decode forgets the window
  std::optional<Tensor> seqlens_c;
  if (seqlens_k.has_value()) {
    seqlens_c = seqlens_k->contiguous();
    p.seqlens_k = seqlens_c->data_ptr<int>();
  }
  const int n_blocks = ceil_div(p.seqlen_k, cpu::kBlockN);
  const int64_t rows = int64_t(p.batch) * p.heads_q * p.seqlen_q;
  int splits = int(num_splits);
  if (splits == 0) {
    splits = num_splits_heuristic(int(std::min<int64_t>(rows, 1 << 30)), at::get_num_threads(),
                                  n_blocks, kMaxSplits);
  }
  p.num_splits = splits;
  p.n_blocks_per_split = ceil_div(n_blocks, splits);

  auto out = at::empty({q.size(0), q.size(1), q.size(2), v.size(3)}, qf.options());
  auto lse = at::empty({q.size(0), q.size(1), q.size(2)}, qf.options());
  if (splits == 1) {
    p.o = out.data_ptr();
    p.lse = lse.data_ptr<float>();
    cpu::attention_forward(p, qf.data_ptr<float>(), kf.data_ptr<float>(), vf.data_ptr<float>());
    return {out.to(q.scalar_type()), lse};
  }
  auto o_accum = at::empty({splits, q.size(0), q.size(1), q.size(2), v.size(3)}, qf.options());
  auto lse_accum = at::empty({splits, q.size(0), q.size(1), q.size(2)}, qf.options());
  p.o_accum = o_accum.data_ptr<float>();
  p.lse_accum = lse_accum.data_ptr<float>();
  cpu::attention_forward(p, qf.data_ptr<float>(), kf.data_ptr<float>(), vf.data_ptr<float>());
  return combine_cpu(o_accum, lse_accum, q.scalar_type(), sinks_c);
}

// `fwd`, flash_attention_decode's operator (and the inference path of a dense cache).
inline std::tuple<Tensor, Tensor> attention_fwd_cpu(
    const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& seqlens_k,
    bool causal, double softmax_scale, int64_t num_splits, int64_t config, int64_t window_left,
    int64_t window_right, double softcap, const std::optional<Tensor>& sinks) {
  return forward_cpu(q, k, v, seqlens_k, causal, softmax_scale, num_splits, config, window_left,
                     window_right, softcap, sinks, /*decode=*/true);
}

// The differentiable forward (flash_attention_forward): the prefill path of `fwd`, with the
// backward's options carried in the schema so that autograd's saved context holds them.
inline void check_backward_options(int64_t bwd_config) {
  FLASHMOE_CHECK_VALUE(bwd_config >= 0 && bwd_config <= kNumBwdConfigs,
                       "backward_config must be in [0, ", kNumBwdConfigs, "] (0 = automatic), got ",
                       bwd_config);
}

inline std::tuple<Tensor, Tensor> attention_cpu(
    const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double softmax_scale,
    int64_t num_splits, int64_t config, bool /*deterministic*/, int64_t bwd_config,
    int64_t window_left, int64_t window_right, double softcap, const std::optional<Tensor>& sinks) {
  check_backward_options(bwd_config);
  return forward_cpu(q, k, v, std::nullopt, causal, softmax_scale, num_splits, config, window_left,
                     window_right, softcap, sinks, /*decode=*/false);
}

// Checks of the backward's extra inputs: the gradient of the output, and the forward's output and
// log-sum-exp. q, k and v are checked as in the forward; the output is [B, Hq, Sq, Dv].
inline void check_backward_inputs(const Tensor& dout, const Tensor& q, const Tensor& k,
                                  const Tensor& v, const Tensor& out, const Tensor& lse) {
  check_attention_inputs(q, k, v, std::nullopt, 0);
  FLASHMOE_CHECK_VALUE(v.size(3) < (1 << 15),
                       "v's head_dim must be below 32768 for the backward, got ", v.size(3));
  const std::vector<int64_t> out_shape = {q.size(0), q.size(1), q.size(2), v.size(3)};
  FLASHMOE_CHECK_VALUE(dout.sizes() == c10::IntArrayRef(out_shape),
                       "grad_output must have the output's shape ", to_text(out_shape), ", got ",
                       shape_str(dout));
  FLASHMOE_CHECK_TYPE(dout.scalar_type() == q.scalar_type(), "grad_output has dtype ",
                      dtype_name(dout.scalar_type()), "; it must match the output's dtype ",
                      dtype_name(q.scalar_type()));
  FLASHMOE_CHECK_VALUE(dout.device() == q.device(), "grad_output is on ", dout.device(),
                       " but the inputs are on ", q.device());
  FLASHMOE_CHECK_VALUE(out.sizes() == c10::IntArrayRef(out_shape) &&
                           out.scalar_type() == q.scalar_type() && out.device() == q.device(),
                       "out must be the forward's output, ", to_text(out_shape), " ",
                       dtype_name(q.scalar_type()), ", got ", shape_str(out), " ",
                       dtype_name(out.scalar_type()));
  FLASHMOE_CHECK_VALUE(
      lse.dim() == 3 && lse.size(0) == q.size(0) && lse.size(1) == q.size(1) &&
          lse.size(2) == q.size(2) && lse.scalar_type() == at::kFloat && lse.device() == q.device(),
      "lse must be the forward's log-sum-exp, float32 [", q.size(0), ", ", q.size(1), ", ",
      q.size(2), "], got ", shape_str(lse), " ", dtype_name(lse.scalar_type()));
}

// Gradients that are all zero: no rows, or no keys (every row saw no key, so nothing flows back).
inline std::optional<std::tuple<Tensor, Tensor, Tensor>> empty_gradients(const Tensor& q,
                                                                         const Tensor& k,
                                                                         const Tensor& v) {
  if (q.numel() != 0 && k.numel() != 0) return std::nullopt;
  auto contiguous = [](const Tensor& t) {
    return at::zeros(t.sizes(), t.options().memory_format(at::MemoryFormat::Contiguous));
  };
  return std::make_tuple(contiguous(q), contiguous(k), contiguous(v));
}

// lse may have any strides (a packed batch's backward passes one sequence's columns of [Hq,
// total_q] as they are): it is read once, by the pre-pass on CUDA.
inline BwdParams make_bwd_params(const Tensor& dout, const Tensor& q, const Tensor& k,
                                 const Tensor& v, const Tensor& out, const Tensor& lse, bool causal,
                                 double softmax_scale) {
  BwdParams p{};
  p.q = q.data_ptr(), p.k = k.data_ptr(), p.v = v.data_ptr(), p.o = out.data_ptr();
  p.dout = dout.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.lse_batch_stride = lse.stride(0), p.lse_head_stride = lse.stride(1);
  p.lse_row_stride = lse.stride(2);
  p.q_batch_stride = q.stride(0), p.q_head_stride = q.stride(1), p.q_row_stride = q.stride(2);
  p.k_batch_stride = k.stride(0), p.k_head_stride = k.stride(1), p.k_row_stride = k.stride(2);
  p.v_batch_stride = v.stride(0), p.v_head_stride = v.stride(1), p.v_row_stride = v.stride(2);
  p.o_batch_stride = out.stride(0), p.o_head_stride = out.stride(1), p.o_row_stride = out.stride(2);
  p.do_batch_stride = dout.stride(0), p.do_head_stride = dout.stride(1);
  p.do_row_stride = dout.stride(2);
  p.batch = int(q.size(0));
  p.heads_q = int(q.size(1));
  p.heads_kv = int(k.size(1));
  p.seqlen_q = int(q.size(2));
  p.seqlen_k = int(k.size(2));
  p.head_dim = int(q.size(3));
  p.head_dim_v = int16_t(v.size(3));
  p.heads_ratio = p.heads_q / p.heads_kv;
  p.softmax_scale = float(softmax_scale);
  p.scale_log2 = float(softmax_scale * 1.4426950408889634);
  set_features(p, resolve_window(causal, -1, -1), 0, nullptr);
  return p;
}

// The sinks' gradient of a call with `sinks` (fp32 [Hq], zero where nothing flows back); an empty
// fp32 tensor without (the fourth output of attention_backward is a tensor either way).
inline Tensor zero_dsinks(const Tensor& q, const std::optional<Tensor>& sinks) {
  return at::zeros({sinks ? q.size(1) : 0}, q.options().dtype(at::kFloat));
}

// Returns (dq, dk, dv, dsinks): dq, dk and dv contiguous, in the inputs' dtype; dsinks fp32 [Hq]
// with sinks, else empty.
inline std::tuple<Tensor, Tensor, Tensor, Tensor> attention_backward_cpu(
    const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
    const Tensor& lse, bool causal, double softmax_scale, bool /*deterministic*/, int64_t config,
    int64_t window_left, int64_t window_right, double softcap, const std::optional<Tensor>& sinks) {
  check_backward_inputs(dout, q, k, v, out, lse);
  check_features(q, window_left, window_right, softcap, sinks);
  FLASHMOE_CHECK_VALUE(q.device().is_cpu(), "q is on ", q.device(),
                       "; this is the CPU implementation");
  FLASHMOE_CHECK_VALUE(config == 0, "backward_config=", config,
                       " selects a CUDA tile configuration, but the inputs are CPU tensors; use 0 "
                       "(automatic) on the CPU");
  Tensor dsinks = zero_dsinks(q, sinks);
  if (auto empty = empty_gradients(q, k, v)) {
    auto [dq, dk, dv] = *empty;
    return {dq, dk, dv, dsinks};
  }
  auto f32 = [](const Tensor& t) { return t.to(at::kFloat).contiguous(); };
  auto qf = f32(q), kf = f32(k), vf = f32(v), of = f32(out), dof = f32(dout);
  std::optional<Tensor> sinks_c;
  if (sinks.has_value()) sinks_c = sinks->contiguous();
  BwdParams p = make_bwd_params(dof, qf, kf, vf, of, lse, causal, softmax_scale);
  set_features(p, resolve_window(causal, window_left, window_right), softcap,
               sinks_c ? &*sinks_c : nullptr);
  // Each (batch, head)'s share of the sinks' gradient, summed over the batch in order below, so
  // the result does not depend on the threads.
  Tensor dsinks_per_batch;
  if (sinks_c) {
    dsinks_per_batch = at::zeros({q.size(0), q.size(1)}, qf.options());
    p.dsinks = dsinks_per_batch.data_ptr<float>();
  }
  auto dq = at::empty(qf.sizes(), qf.options());
  auto dk = at::empty(kf.sizes(), kf.options());
  auto dv = at::empty(vf.sizes(), vf.options());
  cpu::attention_backward(p, qf.data_ptr<float>(), kf.data_ptr<float>(), vf.data_ptr<float>(),
                          of.data_ptr<float>(), dof.data_ptr<float>(), dq.data_ptr<float>(),
                          dk.data_ptr<float>(), dv.data_ptr<float>());
  if (sinks_c) {
    float* total = dsinks.data_ptr<float>();
    const float* shares = dsinks_per_batch.data_ptr<float>();
    for (int64_t b = 0; b < q.size(0); ++b) {
      for (int64_t h = 0; h < q.size(1); ++h)
        total[h] += shares[b * q.size(1) + h];
    }
  }
  return {dq.to(q.scalar_type()), dk.to(k.scalar_type()), dv.to(v.scalar_type()), dsinks};
}

// ------------------------------------------------------------------------------------------------
// Variable-length (packed) batches and paged KV caches: checks and the CPU implementation
// ------------------------------------------------------------------------------------------------

// Shapes, dtypes and devices of a packed batch: q [total_q, Hq, D], k [total_k, Hkv, D], v
// [total_k, Hkv, Dv], cu_seqlens_q and cu_seqlens_k int32 [B + 1].
inline void check_varlen_inputs(const Tensor& q, const Tensor& k, const Tensor& v,
                                const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                                int64_t max_seqlen_q, int64_t max_seqlen_k) {
  check_qkv(q, k, v, 3, "[total_tokens, heads, head_dim] (the packed varlen layout)",
            /*batched=*/false);
  const Tensor* cus[] = {&cu_seqlens_q, &cu_seqlens_k};
  const char* cu_names[] = {"cu_seqlens_q", "cu_seqlens_k"};
  for (int t = 0; t < 2; ++t) {
    const Tensor& c = *cus[t];
    FLASHMOE_CHECK_TYPE(c.scalar_type() == at::kInt, cu_names[t], " has dtype ",
                        dtype_name(c.scalar_type()), "; supported: torch.int32");
    FLASHMOE_CHECK_VALUE(c.dim() == 1 && c.size(0) >= 1, cu_names[t],
                         " must have shape [batch + 1] (cumulative sequence lengths from 0), got ",
                         shape_str(c));
    FLASHMOE_CHECK_VALUE(c.device() == q.device(), cu_names[t], " is on ", c.device(),
                         " but q is on ", q.device());
  }
  FLASHMOE_CHECK_VALUE(cu_seqlens_q.size(0) == cu_seqlens_k.size(0),
                       "cu_seqlens_q and cu_seqlens_k must both have batch + 1 entries, got ",
                       cu_seqlens_q.size(0), " and ", cu_seqlens_k.size(0));
  FLASHMOE_CHECK_VALUE(max_seqlen_q >= 0 && max_seqlen_q <= (int64_t(1) << 30),
                       "max_seqlen_q must be in [0, 2^30], got ", max_seqlen_q);
  FLASHMOE_CHECK_VALUE(max_seqlen_k >= 0 && max_seqlen_k <= (int64_t(1) << 30),
                       "max_seqlen_k must be in [0, 2^30], got ", max_seqlen_k);
  FLASHMOE_CHECK_VALUE(q.size(0) < (int64_t(1) << 31) && k.size(0) < (int64_t(1) << 31),
                       "the packed tensors must have fewer than 2^31 rows, got q ", shape_str(q),
                       ", k ", shape_str(k));
}

// The values of one cu_seqlens (a host copy): from 0, non-decreasing, ending at the packed rows,
// and no sequence longer than max_seqlen.
inline void check_cu_seqlens_values(const Tensor& cu_cpu, const char* name, int64_t total,
                                    int64_t max_seqlen, const char* max_name, const char* tensor) {
  const int* c = cu_cpu.data_ptr<int>();
  const int64_t n = cu_cpu.numel();
  FLASHMOE_CHECK_VALUE(c[0] == 0, name, "[0] must be 0, got ", c[0]);
  for (int64_t b = 0; b + 1 < n; ++b) {
    FLASHMOE_CHECK_VALUE(c[b + 1] >= c[b], name, " must be non-decreasing, got ", name, "[", b,
                         "] = ", c[b], " > ", name, "[", b + 1, "] = ", c[b + 1]);
    FLASHMOE_CHECK_VALUE(c[b + 1] - c[b] <= max_seqlen, "sequence ", b, " has ", c[b + 1] - c[b],
                         " rows in ", name, " but ", max_name, " = ", max_seqlen,
                         "; pass the longest sequence's length");
  }
  FLASHMOE_CHECK_VALUE(c[n - 1] == total, name, "[-1] = ", c[n - 1], " must equal the rows of ",
                       tensor, " (", total, ")");
}

inline void check_varlen_values(const Tensor& q, const Tensor& k, const Tensor& cu_seqlens_q,
                                const Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                                int64_t max_seqlen_k) {
  check_cu_seqlens_values(cu_seqlens_q.cpu().contiguous(), "cu_seqlens_q", q.size(0), max_seqlen_q,
                          "max_seqlen_q", "q");
  check_cu_seqlens_values(cu_seqlens_k.cpu().contiguous(), "cu_seqlens_k", k.size(0), max_seqlen_k,
                          "max_seqlen_k", "k");
}

// Outputs of a packed batch with nothing to compute: out [total_q, Hq, head_dim_v] zeros and lse
// [Hq, total_q] -inf (no queries, or no keys at all).
inline std::tuple<Tensor, Tensor> empty_varlen_result(const Tensor& q, int64_t head_dim_v) {
  auto out = at::zeros({q.size(0), q.size(1), head_dim_v},
                       q.options().memory_format(at::MemoryFormat::Contiguous));
  auto lse = at::full({q.size(1), q.size(0)}, -std::numeric_limits<float>::infinity(),
                      q.options().dtype(at::kFloat));
  return {out, lse};
}

// Each sequence through the dense CPU path, on [1, H, S, D] views of its rows.
inline std::tuple<Tensor, Tensor> varlen_fwd_cpu(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_seqlens_q,
    const Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
    double softmax_scale, int64_t config, int64_t window_left, int64_t window_right, double softcap,
    const std::optional<Tensor>& sinks) {
  check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  check_features(q, window_left, window_right, softcap, sinks);
  FLASHMOE_CHECK_VALUE(q.device().is_cpu(), "q is on ", q.device(),
                       "; this is the CPU implementation");
  FLASHMOE_CHECK_VALUE(
      config == 0, "config=", config,
      " selects a CUDA tile configuration, but the inputs are CPU tensors; use config=0 "
      "(automatic) on the CPU");
  check_varlen_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  auto [out, lse] = empty_varlen_result(q, v.size(2));
  const Tensor cu_q = cu_seqlens_q.contiguous(), cu_k = cu_seqlens_k.contiguous();
  const int* cq = cu_q.data_ptr<int>();
  const int* ck = cu_k.data_ptr<int>();
  auto as_dense = [](const Tensor& x, int64_t begin, int64_t end) {
    return x.slice(0, begin, end).permute({1, 0, 2}).unsqueeze(0);  // [1, H, S, D]
  };
  for (int64_t b = 0; b + 1 < cu_q.numel(); ++b) {
    if (cq[b + 1] == cq[b]) continue;
    int64_t k_end = ck[b + 1];
    if (cpu::planted(7)) k_end = std::min<int64_t>(k_end + 1, k.size(0));  // one key too many
    auto [o, l] = forward_cpu(as_dense(q, cq[b], cq[b + 1]), as_dense(k, ck[b], k_end),
                              as_dense(v, ck[b], k_end), std::nullopt, causal, softmax_scale, 1, 0,
                              window_left, window_right, softcap, sinks, /*decode=*/false);
    out.slice(0, cq[b], cq[b + 1]).copy_(o[0].permute({1, 0, 2}));
    lse.slice(1, cq[b], cq[b + 1]).copy_(l[0]);
  }
  return {out, lse};
}

// Shapes of a decode against a paged cache: q [B, Hq, Sq, D], k_cache [num_pages, page_size, Hkv,
// D] and v_cache the same but for its last dimension (Dv), block_table int32 [B,
// max_pages_per_seq], page_size a power of two >= 16.
inline void check_paged_inputs(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                               const Tensor& block_table, const std::optional<Tensor>& seqlens_k,
                               int64_t num_splits) {
  FLASHMOE_CHECK_VALUE(q.dim() == 4, "q must have 4 dimensions [batch, heads, seq, head_dim], got ",
                       q.dim(), " (shape ", shape_str(q), ")");
  FLASHMOE_CHECK_VALUE(k_cache.dim() == 4 && v_cache.dim() == 4,
                       "with a block_table, k_cache and v_cache must be paged, [num_blocks, "
                       "block_size, heads_kv, head_dim], got k_cache ",
                       shape_str(k_cache), ", v_cache ", shape_str(v_cache));
  const Tensor* named[] = {&q, &k_cache, &v_cache};
  const char* names[] = {"q", "k_cache", "v_cache"};
  for (int t = 0; t < 3; ++t) {
    const Tensor& x = *named[t];
    FLASHMOE_CHECK_TYPE(is_half_type(x.scalar_type()), names[t], " has dtype ",
                        dtype_name(x.scalar_type()), "; supported: torch.float16, torch.bfloat16");
    FLASHMOE_CHECK_VALUE(x.device() == q.device(), names[t], " is on ", x.device(), " but q is on ",
                         q.device(), "; all inputs must be on the same device");
    FLASHMOE_CHECK_VALUE(x.size(3) <= 1 || x.stride(3) == 1, names[t],
                         " must be contiguous in its last dimension (stride 1), got strides ",
                         x.strides(), "; call .contiguous() first");
  }
  FLASHMOE_CHECK_TYPE(
      k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
      "q, k_cache and v_cache must share one dtype, got ", dtype_name(q.scalar_type()), ", ",
      dtype_name(k_cache.scalar_type()), ", ", dtype_name(v_cache.scalar_type()));
  FLASHMOE_CHECK_VALUE(k_cache.sizes().slice(0, 3) == v_cache.sizes().slice(0, 3),
                       "k_cache and v_cache must have the same shape but for the last dimension "
                       "(v's head_dim may differ), got ",
                       shape_str(k_cache), " and ", shape_str(v_cache));
  FLASHMOE_CHECK_VALUE(k_cache.size(3) == q.size(3), "head_dim differs: q ", shape_str(q),
                       ", k_cache ", shape_str(k_cache));
  FLASHMOE_CHECK_VALUE(k_cache.size(2) > 0 && q.size(1) % k_cache.size(2) == 0, "heads of q (",
                       q.size(1), ") must be a multiple of the heads of k_cache and v_cache (",
                       k_cache.size(2), ", their dimension 2) for grouped-query attention");
  FLASHMOE_CHECK_VALUE(num_splits >= 0 && num_splits <= kMaxSplits, "num_splits must be in [0, ",
                       kMaxSplits, "] (0 = automatic), got ", num_splits);
  if (seqlens_k.has_value()) {
    const Tensor& s = *seqlens_k;
    FLASHMOE_CHECK_TYPE(s.scalar_type() == at::ScalarType::Int, "cache_seqlens has dtype ",
                        dtype_name(s.scalar_type()), "; supported: torch.int32");
    FLASHMOE_CHECK_VALUE(s.dim() == 1 && s.size(0) == q.size(0),
                         "cache_seqlens must have shape [batch] = [", q.size(0), "], got ",
                         shape_str(s));
    FLASHMOE_CHECK_VALUE(s.device() == q.device(), "cache_seqlens is on ", s.device(),
                         " but q is on ", q.device());
  }
  const int64_t page_size = k_cache.size(1);
  FLASHMOE_CHECK_VALUE(
      page_size >= 16 && (page_size & (page_size - 1)) == 0,
      "block size (k_cache.shape[1]) = ", page_size,
      " is not supported; supported: powers of two from 16 (16, 32, ..., 256, ...)");
  FLASHMOE_CHECK_TYPE(block_table.scalar_type() == at::kInt, "block_table has dtype ",
                      dtype_name(block_table.scalar_type()), "; supported: torch.int32");
  FLASHMOE_CHECK_VALUE(
      block_table.dim() == 2 && block_table.size(0) == q.size(0) && block_table.size(1) >= 1,
      "block_table must have shape [batch, max_blocks_per_seq] = [", q.size(0), ", >= 1], got ",
      shape_str(block_table));
  FLASHMOE_CHECK_VALUE(block_table.device() == q.device(), "block_table is on ",
                       block_table.device(), " but q is on ", q.device());
  FLASHMOE_CHECK_VALUE(block_table.size(1) * page_size < (int64_t(1) << 30),
                       "block_table's capacity (max_blocks_per_seq x block size = ",
                       block_table.size(1) * page_size, ") must be below 2^30 keys");
  FLASHMOE_CHECK_VALUE(k_cache.size(0) >= 1 && k_cache.size(0) < (int64_t(1) << 31),
                       "k_cache must hold 1 to 2^31 - 1 blocks, got ", k_cache.size(0));
}

// The block-table entries a sequence reads (those covering its cache_seqlens keys) must name a
// page of the cache. Entries past a sequence's length are never read (vLLM leaves them stale).
inline void check_block_table_values(const Tensor& table_cpu,
                                     const std::optional<Tensor>& seqlens_cpu, int64_t page_size,
                                     int64_t num_pages) {
  const int64_t batch = table_cpu.size(0), max_pages = table_cpu.size(1);
  const int* table = table_cpu.data_ptr<int>();
  const int* lens = seqlens_cpu ? seqlens_cpu->data_ptr<int>() : nullptr;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = lens ? lens[b] : max_pages * page_size;
    const int64_t used = (len + page_size - 1) / page_size;
    for (int64_t i = 0; i < used; ++i) {
      const int page = table[b * max_pages + i];
      FLASHMOE_CHECK_VALUE(page >= 0 && page < num_pages, "block_table[", b, ", ", i, "] = ", page,
                           " is outside [0, ", num_pages, ") (the blocks of k_cache)");
    }
  }
}

inline std::tuple<Tensor, Tensor> paged_fwd_cpu(
    const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& block_table,
    const std::optional<Tensor>& seqlens_k, bool causal, double softmax_scale, int64_t num_splits,
    int64_t window_left, int64_t window_right, double softcap, const std::optional<Tensor>& sinks) {
  check_paged_inputs(q, k_cache, v_cache, block_table, seqlens_k, num_splits);
  check_features(q, window_left, window_right, softcap, sinks);
  FLASHMOE_CHECK_VALUE(q.device().is_cpu(), "q is on ", q.device(),
                       "; this is the CPU implementation");
  const int64_t page_size = k_cache.size(1), num_pages = k_cache.size(0);
  const int64_t capacity = block_table.size(1) * page_size;
  std::optional<Tensor> lens;
  if (seqlens_k.has_value()) {
    lens = seqlens_k->contiguous();
    check_seqlens_values(*lens, capacity);
  }
  const Tensor table = block_table.contiguous();
  check_block_table_values(table, lens, page_size, num_pages);
  // Gather each sequence's pages into a contiguous [B, Hkv, capacity, D] cache. Entries no
  // sequence reads may hold anything: clamped so the gather stays inside the cache.
  Tensor pages = table.to(at::kLong).clamp(0, num_pages - 1);
  if (cpu::planted(8)) {  // planted: logical page i read from physical page i, the table ignored
    pages = at::arange(table.size(1), table.options().dtype(at::kLong))
                .clamp(0, num_pages - 1)
                .expand(table.sizes());
  }
  auto gather = [&](const Tensor& cache) {
    return cache.index_select(0, pages.reshape({-1}))
        .view({q.size(0), capacity, cache.size(2), cache.size(3)})
        .permute({0, 2, 1, 3});
  };
  return forward_cpu(q, gather(k_cache), gather(v_cache), lens, causal, softmax_scale, num_splits,
                     0, window_left, window_right, softcap, sinks, /*decode=*/true);
}

inline int64_t planted_bug() { return cpu::planted_bug(); }

// The head dims the CUDA kernels are built for (their tiles' widths). Every CUDA launch site
// instantiates its kernels from this list (with_head_dim, flash_api_cuda.cuh);
// _loader.CUDA_HEAD_DIMS is its copy. The CPU implementation takes any head dim.
constexpr int64_t kCudaHeadDims[] = {64, 128, 192, 256};

// The tile that runs q's and k's `head_dim` with v's `head_dim_v` on CUDA: the narrowest built head
// dim that holds both. Narrower head dims run on it padded in shared memory and registers (their
// columns past the head dim are zero-filled, never written back): 80 and 96 on 128, 160 on 192,
// and v's 128 under q's and k's 192 (DeepSeek's MLA prefill) on 192. 0: none (a head dim that is
// not a multiple of 8, the 16-byte chunk the kernels copy, or past 256).
inline int64_t cuda_tile_head_dim(int64_t head_dim, int64_t head_dim_v) {
  if (head_dim < 8 || head_dim_v < 8 || head_dim % 8 != 0 || head_dim_v % 8 != 0) return 0;
  for (const int64_t d : kCudaHeadDims) {
    if (d >= head_dim && d >= head_dim_v) return d;
  }
  return 0;
}

// Why the CUDA operators cannot take q's and k's `head_dim` with v's `head_dim_v`, in the one line
// they raise before any launch (ops.head_dims_unsupported_reason returns it); empty when they can.
inline std::string cuda_head_dims_problem(int64_t head_dim, int64_t head_dim_v) {
  if (cuda_tile_head_dim(head_dim, head_dim_v) != 0) return "";
  const int64_t widest = kCudaHeadDims[sizeof(kCudaHeadDims) / sizeof(kCudaHeadDims[0]) - 1];
  const std::string supported = "multiples of 8 up to " + std::to_string(widest) +
                                " (v's may differ from q's and k's; the CPU implementation takes "
                                "any head_dim)";
  if (head_dim_v == head_dim) {
    return error_text("head_dim=", head_dim, " is not supported on CUDA; supported: ", supported);
  }
  return error_text("head_dim=", head_dim, " with v's head_dim=", head_dim_v,
                    " is not supported on CUDA; supported: ", supported);
}

// decode_num_splits (attention_params.h) as an operator, for tests and tools.
inline int64_t decode_num_splits_op(int64_t tiles, int64_t sm_count, int64_t n_blocks) {
  FLASHMOE_CHECK_VALUE(tiles >= 1 && tiles < (1 << 30), "tiles must be in [1, 2^30), got ", tiles);
  FLASHMOE_CHECK_VALUE(sm_count >= 1 && sm_count < (1 << 20), "sm_count must be in [1, 2^20), got ",
                       sm_count);
  FLASHMOE_CHECK_VALUE(n_blocks >= 1 && n_blocks < (1 << 30), "n_blocks must be in [1, 2^30), got ",
                       n_blocks);
  return decode_num_splits(int(tiles), int(sm_count), int(n_blocks));
}

}  // namespace flashmoe

// Schemas, written once. Each backend registers its implementation with TORCH_LIBRARY_IMPL.
//   fwd: attention for prefill (seqlens_k = None) and decode (seqlens_k = per-sequence KV lengths).
//     num_splits: 0 = automatic, else the split-KV count; config: 0 = automatic, else a CUDA tile
//     configuration id (so the configurations another architecture selects can be forced and
//     gated).
//   split_kv_combine: the split-KV reduction on its own, for tests.
//   attention: the differentiable forward (flash_attention_forward): fwd without cache lengths,
//     plus the backward's options (deterministic, bwd_config), which autograd saves with it.
//   attention_backward: (dq, dk, dv) from grad_output and the forward's inputs, output and
//     log-sum-exp; config: 0 = automatic, else a CUDA backward tile configuration.
//   varlen_fwd: attention over a packed batch (FlashAttention's varlen layout; see
//     AttentionParams), lse [Hq, total_q]; config: 0 = automatic, else 1, 2, 4 or 5 (as fwd's).
//   paged_fwd: fwd against a paged KV cache through a block table (decode kernel on CUDA).
//   Every operator takes v (v_cache) with a last dimension of its own, the output's, and the
//   window, softcap and sinks last (FLASHMOE_FEATURES, defaults: none of them; see
//   AttentionParams); attention_backward returns the sinks' gradient fourth (empty without).
//   cuda_head_dims_problem: why CUDA cannot take these head dims ("" when it can), for ops.py.
#define FLASHMOE_FEATURES \
  "int window_left=-1, int window_right=-1, float softcap=0.0, Tensor? sinks=None"
TORCH_LIBRARY(flashmoe_science, m) {
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, Tensor? seqlens_k, bool causal, float softmax_scale, "
      "int num_splits, int config, " FLASHMOE_FEATURES ") -> (Tensor, Tensor)");
  m.def(
      "attention(Tensor q, Tensor k, Tensor v, bool causal, float softmax_scale, int num_splits, "
      "int config, bool deterministic, int bwd_config, " FLASHMOE_FEATURES ") -> (Tensor, Tensor)");
  m.def(
      "attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "bool causal, float softmax_scale, bool deterministic, int config, " FLASHMOE_FEATURES
      ") -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "split_kv_combine(Tensor out_partial, Tensor lse_partial, ScalarType dtype) -> (Tensor, "
      "Tensor)");
  m.def(
      "varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "int max_seqlen_q, int max_seqlen_k, bool causal, float softmax_scale, int "
      "config, " FLASHMOE_FEATURES ") -> (Tensor, Tensor)");
  m.def(
      "paged_fwd(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor? seqlens_k, "
      "bool causal, float softmax_scale, int num_splits, " FLASHMOE_FEATURES
      ") -> (Tensor, Tensor)");
  m.def("planted_bug() -> int", &flashmoe::planted_bug);
  m.def("cuda_head_dims_problem(int head_dim, int head_dim_v) -> str",
        &flashmoe::cuda_head_dims_problem);
  m.def("decode_num_splits(int tiles, int sm_count, int n_blocks) -> int",
        &flashmoe::decode_num_splits_op);
}

TORCH_LIBRARY_IMPL(flashmoe_science, CPU, m) {
  m.impl("fwd", &flashmoe::attention_fwd_cpu);
  m.impl("attention", &flashmoe::attention_cpu);
  m.impl("attention_backward", &flashmoe::attention_backward_cpu);
  m.impl("split_kv_combine", &flashmoe::split_kv_combine_cpu);
  m.impl("varlen_fwd", &flashmoe::varlen_fwd_cpu);
  m.impl("paged_fwd", &flashmoe::paged_fwd_cpu);
}
