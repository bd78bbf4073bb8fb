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
