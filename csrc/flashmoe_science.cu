// The CUDA compilation unit: the whole extension in one translation unit. It holds the operator
// schemas, the CPU implementation (so one build serves CPU and CUDA tensors) and the CUDA kernels.
#include "attention_ops.h"
#include "flash_api_cuda.cuh"

TORCH_LIBRARY_IMPL(flashmoe_science, CUDA, m) {
  m.impl("fwd", &flashmoe::cuda::attention_fwd_cuda);
  m.impl("attention", &flashmoe::cuda::attention_cuda);
  m.impl("attention_backward", &flashmoe::cuda::attention_backward_cuda);
  m.impl("split_kv_combine", &flashmoe::cuda::split_kv_combine_cuda);
  m.impl("varlen_fwd", &flashmoe::cuda::varlen_fwd_cuda);
  m.impl("paged_fwd", &flashmoe::cuda::paged_fwd_cuda);
}

// Defined only where the CUDA kernels are: the CPU-only unit has no launches to report.
TORCH_LIBRARY_FRAGMENT(flashmoe_science, m) {
  m.def("kernel_launches() -> str", &flashmoe::cuda::kernel_launches);
}

#if FLASHMOE_PHASE_TRACE
// The phase traces' buffers (flash_fwd_sm90_kernel.cuh, flash_decode_kernel.cuh), for
// `python -m flashmoe_science phases`.
namespace flashmoe::cuda {
inline int64_t phase_trace_reset() {
  void* stamps = nullptr;
  C10_CUDA_CHECK(cudaGetSymbolAddress(&stamps, phase_trace::stamps));
  C10_CUDA_CHECK(cudaMemset(stamps, 0, sizeof(phase_trace::stamps)));
  return 0;
}
// One int64 tensor on the CPU: the stamps [blocks, rounds, slots], then the spans [blocks, 4].
inline at::Tensor phase_trace_dump() {
  constexpr int64_t kStamps = sizeof(phase_trace::stamps) / sizeof(long long);
  constexpr int64_t kSpans = sizeof(phase_trace::spans) / sizeof(long long);
  at::Tensor out = at::empty({kStamps + kSpans}, at::kLong);
  C10_CUDA_CHECK(
      cudaMemcpyFromSymbol(out.data_ptr(), phase_trace::stamps, sizeof(phase_trace::stamps)));
  C10_CUDA_CHECK(cudaMemcpyFromSymbol(out.data_ptr<int64_t>() + kStamps, phase_trace::spans,
                                      sizeof(phase_trace::spans)));
  return out;
}
// The decode's stamps (flash_decode_kernel.cuh, namespace decode_trace): [blocks, slots].
inline int64_t decode_trace_reset() {
  void* stamps = nullptr;
  C10_CUDA_CHECK(cudaGetSymbolAddress(&stamps, decode_trace::stamps));
  C10_CUDA_CHECK(cudaMemset(stamps, 0, sizeof(decode_trace::stamps)));
  return 0;
}
inline at::Tensor decode_trace_dump() {
  at::Tensor out = at::empty({decode_trace::kBlocks * decode_trace::kSlots}, at::kLong);
  C10_CUDA_CHECK(
      cudaMemcpyFromSymbol(out.data_ptr(), decode_trace::stamps, sizeof(decode_trace::stamps)));
  return out;
}
}  // namespace flashmoe::cuda

TORCH_LIBRARY_FRAGMENT(flashmoe_science, m) {
  m.def("phase_trace_reset() -> int", &flashmoe::cuda::phase_trace_reset);
  m.def("phase_trace_dump() -> Tensor", &flashmoe::cuda::phase_trace_dump);
  m.def("decode_trace_reset() -> int", &flashmoe::cuda::decode_trace_reset);
  m.def("decode_trace_dump() -> Tensor", &flashmoe::cuda::decode_trace_dump);
}
#endif
