// The CPU-only compilation unit: the operator schemas and their CPU implementation. Built when no
// usable CUDA toolchain or target is present; CUDA builds compile flashmoe_science.cu instead.
#include "attention_ops.h"
