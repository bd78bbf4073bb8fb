// Host side of the CUDA operators: checks that only apply on the GPU, tile-configuration choice per
// architecture, the split-count heuristic, and the launches (on the current stream).
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cudaTypedefs.h>  // cuTensorMapEncodeTiled's type, reached through the runtime

#include <cxxabi.h>

#include <array>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <utility>

#include "attention_ops.h"
#include "build_only.cuh"
#include "flash_bwd_kernel.cuh"
#include "flash_bwd_sm90_kernel.cuh"
#include "flash_decode_kernel.cuh"
#include "flash_fwd_kernel.cuh"
#include "flash_fwd_sm90_kernel.cuh"

namespace flashmoe::cuda {

// Tile configurations. Ids are part of the operator's interface (`config=`), so the configuration
// another architecture selects can be forced and gated on the card at hand. The measurements behind
// each choice: benches/notes/prefill-sm80.md (1, 2, 4), decode.md (3), prefill-sm90.md (5 to 7).
//   1: 128 x 64 at d=64, 128 x 32 at d=128, 4 warps (FA2's sm8x non-causal tile at d=128);
//      128 x 64 with 8 warps (16 rows each) at d=192 and 256, FA2's tile there (at d=256 128 KB:
//      sm80 and sm90, not the 99 KB of an sm86/sm89 block).
//   2:  64 x 64, 4 warps. 48 KB at d=128, so two blocks fit one sm86/sm89 SM (100 KB); FA2 picks
//       this square tile on sm86/sm89 ("fastest for causal"). Also used when a head has few rows.
//       96 KB at d=256: the tile that fits an sm86/sm89 block there.
//   3:  the decode kernel (flash_decode_kernel.cuh): 16 rows, 4 warps splitting 64-key stages,
//       3 stages deep: 96 KB at d=128 (one block per sm89 SM, two per sm90 SM), 48 KB at d=64;
//       at d=192 and 256, 2 warps splitting 32-key stages, 4 and 3 deep (96 KB, DecodeConfig).
//       Chosen when a head has at most 16 rows (Sq x the query heads packed per KV head), and
//       for grids too small to fill the GPU with 64-row tiles.
//   4: 128 x 64 at d=128, 128 x 128 at d=64, 4 warps (FA2's sm80/sm90 tiles): 255 registers, no
//      spill on sm_90; ptxas spills them on sm_89, so they are built for sm_90 and newer only.
//      The sm_90 choice without the sm_90a build, where it is faster than config 1, and at the
//      head dims the wgmma kernels do not take. At d=192 and 256 it is configuration 1's kernel.
//   5: 128 x 128 at d=128 (2 math warpgroups), 192 x 128 at d=64 (3), on wgmma, warp-specialized
//      and persistent (flash_fwd_sm90_kernel.cuh). sm_90a only: built with FLASHMOE_SM90A (the
//      loader defines it with arch 9.0a, the default on an H100), run on compute capability 9.0
//      only. The H100's choice.
//   6: the same kernel with 128-row tiles at d=64 too: two math warpgroups in ping-pong, K and V
//      in three buffers, the output written from registers (at d=128 it is configuration 5's
//      kernel). sm_90a only, as 5. The H100's choice at d=64 for causal heads of at most 1024
//      query rows and no more keys than rows: a 192-row tile computes more masked rows x keys
//      there (at S=512, 9 x 192 x 128 against 10 x 128 x 128 per head); elsewhere 5 is faster.
//      No packed-batch variant.
//   7: configuration 5's kernel with 176-key tiles at d=128 (FlashAttention-3's non-causal
//      tile): S by a m64n176k16 wgmma, 37% more work per wgmma, barrier round and rescale, K and V
//      in two buffers (three do not fit: Q 32 KB + 2 x 88 KB = 213 KB), the output written from
//      registers (at d=64 it is configuration 5's kernel). sm_90a only, as 5. The choice at
//      d=128 for non-causal heads of at least 4096 keys; slower than 5 on shorter or causal
//      heads. No packed-batch variant.
//   At d=192 and 256, 5 to 7 are one kernel: 128 x 96 (d=192) or 128 x 64 (d=256), two math
//   warpgroups, K and V in two buffers, the output written from registers (Sm90WideTraits).
//   With v's head dim 128 under q's and k's 192 (DeepSeek-V3's latent attention prefill) 5 to 7
//   are one kernel too: 128 x 112, V and the output 128 wide (Sm90NarrowVTraits).
//   5 to 7 take head dims 64, 128, 192 and 256, v's equal, and 192 with v's 128; 5 also runs
//   its 128 tile at the narrower multiples of 8 it holds (80, 96, v's 64 under 128, ...), their
//   columns zero-filled in shared memory (Sm90PaddedTraits; wgmma_head_dims).
//   Rejected: 8 warps x 128 x 64 at d=128 (one 16-row tile per warp): one block per SM, slower.
constexpr int kNumConfigs = 7;
constexpr int kDecodeConfig = 3;
constexpr int kSm90Config = 4;       // built for sm_90 and newer only
constexpr int kSm90aConfig = 5;      // wgmma: the sm_90a build on a 9.0 GPU only
constexpr int kSm90aM128Config = 6;  // the same, 128-row tiles at d=64 as well
constexpr int kSm90aN176Config = 7;  // the same, 176-key tiles at d=128
constexpr bool is_sm90a_config(int64_t config) {
  return config == kSm90aConfig || config == kSm90aM128Config || config == kSm90aN176Config;
}
// The head dims of the wgmma kernels, forward (configurations 5 to 7) and backward (configuration
// 3); the others run the mma.sync kernels on every GPU. The texts are for the errors.
constexpr int kWgmmaHeadDims[] = {64, 128, 192, 256};
constexpr const char* kWgmmaHeadDimsText =
    "64, 128, 192 and 256 (v's equal), or 192 with v's 128 (config 5 also every multiple of 8 up "
    "to 128, padded)";
constexpr int kWgmmaBwdHeadDims[] = {64, 128, 192, 256};
constexpr const char* kWgmmaBwdHeadDimsText =
    "64, 128, 192 and 256 (v's equal), or 192 with v's 128, or every multiple of 8 up to 128 "
    "padded onto the 128 tile";
template <size_t N>
constexpr bool listed_head_dim(const int (&dims)[N], int head_dim) {
  for (const int d : dims) {
    if (d == head_dim) return true;
  }
  return false;
}
constexpr bool is_wgmma_head_dim(int head_dim) { return listed_head_dim(kWgmmaHeadDims, head_dim); }
constexpr bool is_wgmma_bwd_head_dim(int head_dim) {
  return listed_head_dim(kWgmmaBwdHeadDims, head_dim);
}
// The tile head dim a call's kernels are instantiated at (cuda_tile_head_dim: q's and k's head dim
// and v's, padded onto the narrowest built one that holds both), and whether the call may run the
// wgmma kernels: only unpadded (their TMA boxes and panels copy whole tiles of every row).
template <typename Params>
int tile_head_dim(const Params& p) {
  return int(cuda_tile_head_dim(p.head_dim, p.head_dim_v));
}
// v's 128 under q's and k's 192: the wgmma forward's kernel of narrow V (Sm90NarrowVTraits).
inline bool wgmma_narrow_v(int64_t head_dim, int64_t head_dim_v) {
  return head_dim == 192 && head_dim_v == 128;
}
template <typename Params>
bool wgmma_narrow_v(const Params& p) {
  return wgmma_narrow_v(p.head_dim, p.head_dim_v);
}
// Head dims that the 128 tile holds but not both 128 (80, 96, 112, v's 64 under 128, ...): the
// wgmma forward runs them on configuration 5's 128 tile, padded (Sm90PaddedTraits).
inline bool wgmma_padded(int64_t head_dim, int64_t head_dim_v) {
  return cuda_tile_head_dim(head_dim, head_dim_v) == 128 && (head_dim != 128 || head_dim_v != 128);
}
// Which wgmma forward kernel a call's head dims take, where a configuration 5 to 7 runs it: the
// padded 128 tile's MMAs span 96 columns where every head dim is at most 96 (kPadded96).
enum class Sm90Tile { kWhole, kNarrowV, kPadded, kPadded96 };
inline Sm90Tile sm90_tile(int64_t head_dim, int64_t head_dim_v) {
  return wgmma_narrow_v(head_dim, head_dim_v)   ? Sm90Tile::kNarrowV
         : !wgmma_padded(head_dim, head_dim_v)  ? Sm90Tile::kWhole
         : std::max(head_dim, head_dim_v) <= 96 ? Sm90Tile::kPadded96
                                                : Sm90Tile::kPadded;
}
inline bool is_padded(Sm90Tile tile) {
  return tile == Sm90Tile::kPadded || tile == Sm90Tile::kPadded96;
}
template <typename Params>
Sm90Tile sm90_tile(const Params& p) {
  return sm90_tile(p.head_dim, p.head_dim_v);
}
// The head dims the wgmma forward's tiles run whole (v's equal, or v's 128 under 192).
inline bool wgmma_whole_head_dims(int64_t head_dim, int64_t head_dim_v) {
  return (head_dim == head_dim_v && is_wgmma_head_dim(int(head_dim))) ||
         wgmma_narrow_v(head_dim, head_dim_v);
}
// The head dims configuration `config` (5 to 7) runs on wgmma: 5 the padded ones too.
inline bool wgmma_head_dims(int64_t head_dim, int64_t head_dim_v, int64_t config) {
  return wgmma_whole_head_dims(head_dim, head_dim_v) ||
         (config == kSm90aConfig && wgmma_padded(head_dim, head_dim_v));
}
// The head dims the automatic choice runs on the wgmma forward (choose_config): all it takes, the
// padded ones on configuration 5 (run_forward).
inline bool wgmma_chosen(int64_t head_dim, int64_t head_dim_v) {
  return wgmma_whole_head_dims(head_dim, head_dim_v) || wgmma_padded(head_dim, head_dim_v);
}
// The head dims the wgmma backward (configuration 3) runs: 64, 128, 192 and 256 whole, v's 128
// under 192 (those two Sm90BwdWideTraits), and those the 128 tile holds padded (wgmma_padded:
// Sm90BwdPaddedTraits), as the forward's configuration 5 does.
inline bool wgmma_bwd_head_dims(int64_t head_dim, int64_t head_dim_v) {
  return (head_dim == head_dim_v && is_wgmma_bwd_head_dim(int(head_dim))) ||
         wgmma_narrow_v(head_dim, head_dim_v) || wgmma_padded(head_dim, head_dim_v);
}
// Whether a configuration has a packed-batch (varlen) kernel: not the decode kernel, 6 or 7
// (visit_config compiles none for them; ops.NO_PACKED_CONFIGS is the Python side's copy).
constexpr bool has_packed_variant(int64_t config) {
  return config != kDecodeConfig && config != kSm90aM128Config && config != kSm90aN176Config;
}
// What a packed batch runs where the automatic choice took a configuration without a packed
// kernel: the decode kernel's rows go to 2, configurations 6 and 7 to 5 (same kernel family).
constexpr int64_t packed_variant_of(int64_t config) {
  return has_packed_variant(config) ? config : config == kDecodeConfig ? 2 : kSm90aConfig;
}
#ifdef FLASHMOE_SM90A
constexpr bool kBuiltSm90a = true;
#else
constexpr bool kBuiltSm90a = false;
#endif

// The mma.sync configurations' tiles at head dim D where they differ by head dim (the table
// above); 64 and 128 keep their measured tiles.
template <int D>
using Config1Traits = std::conditional_t<(D <= 128), FwdTraits<D, 128, D == 128 ? 32 : 64, 4>,
                                         FwdTraits<D, 128, 64, 8>>;
template <int D>
using Config4Traits =
    std::conditional_t<(D <= 128), FwdTraits<D, 128, D == 128 ? 64 : 128, 4, /*kSm90Only=*/true>,
                       Config1Traits<D>>;
// The wgmma forward's tiles past d=128, one kernel for configurations 5 to 7: two math warpgroups
// over 128 rows (O alone takes 96 or 128 of a math thread's 224 registers) and two K/V buffers.
// 96 and 64 keys, not FlashAttention-3's 112 and 80 (which fit the shared memory too): those
// spilled here, whose producer keeps 56 registers to FA3's 24 (prefill-sm90.md, v5.1).
template <int D>
using Sm90WideTraits = Sm90FwdTraits<D, D == 192 ? 96 : 64, 2, 2>;
// v's 128 under q's and k's 192: V and O (64 registers a thread, not 96) are narrower, so
// 112-key tiles fit (Q 48 KB + 2 x (K 42 KB + V 28 KB) = 188 KB). 128 keys (208 KB) fit too, but
// their producer spilled at 56 registers and their math warpgroups at 216; at 112 the producer
// keeps 64 (prefill-sm90.md, v5.2).
using Sm90NarrowVTraits = Sm90FwdDvTraits<192, 128, 112, 2, 2>;
template <int D>
using Sm90Config5Traits =
    std::conditional_t<(D > 128), Sm90WideTraits<D>,
                       Sm90FwdTraits<D, 128, D == 64 ? 3 : 2, D == 64 ? 2 : 3>>;
template <int D>
using Sm90Config6Traits =
    std::conditional_t<(D > 128), Sm90WideTraits<D>, Sm90FwdTraits<D, 128, 2, 3>>;
template <int D>
using Sm90Config7Traits =
    std::conditional_t<(D > 128), Sm90WideTraits<D>,
                       Sm90FwdTraits<D, D == 128 ? 176 : 128, D == 64 ? 3 : 2, 2>>;
// The decode kernel's: as many 32-key stages as fit 96 KB beyond d=128.
template <int D>
using DecodeConfig = DecodeTraits<D, D <= 128 ? 3 : 96 * 1024 / (2 * 32 * D * 2)>;

// ------------------------------------------------------------------------------------------------
// Head dims and dtypes as compile-time constants
// ------------------------------------------------------------------------------------------------

// Calls f(HeadDim<D>{}) where D == head_dim, for each D of kCudaHeadDims (attention_ops.h): every
// launch site below goes through it, so a head dim is added to the kernels in that one list.
template <int D>
using HeadDim = std::integral_constant<int, D>;

template <typename F, size_t... I>
void with_head_dim_of(int head_dim, F& f, std::index_sequence<I...>) {
  const bool found =
      ((head_dim == kCudaHeadDims[I] && (f(HeadDim<int(kCudaHeadDims[I])>{}), true)) || ...);
  // The operators refuse other head dims before any launch (check_head_dims_cuda).
  TORCH_CHECK(found, "flashmoe_science: no CUDA kernel for head_dim ", head_dim, " (",
              cuda_head_dims_problem(head_dim, head_dim), ")");
}
template <typename F>
void with_head_dim(int head_dim, F&& f) {
  with_head_dim_of(head_dim, f, std::make_index_sequence<std::size(kCudaHeadDims)>{});
}

// Calls f(Dtype<T>{}) with the kernels' element type for `dtype` (fp16 or bf16, all the checks let
// through).
template <typename T>
struct Dtype {
  using type = T;
};
template <typename F>
void with_dtype(at::ScalarType dtype, F&& f) {
  if (dtype == at::kHalf) {
    f(Dtype<__half>{});
  } else {
    f(Dtype<__nv_bfloat16>{});
  }
}

struct DeviceInfo {
  int major = 0, minor = 0, sm_count = 0, l2_bytes = 0;
  int smem_per_block = 0;  // the most shared memory a block may opt in to
};

// The plant build (-DFLASHMOE_PLANT_BUG=-1, attention_params.h): its kernels read their bug from
// the device (planted), copied there from $FLASHMOE_PLANT_BUG once per device before the first
// launch; every entry point reaches this through device_info, or calls it.
inline void set_planted_bug(int device) {
#if FLASHMOE_PLANT_BUG < 0
  static std::array<bool, 64> done{};
  if (done.at(device)) return;
  const int bug = cpu::planted_bug();
  c10::cuda::CUDAGuard guard(device);
  // Not inside a graph capture, where a synchronous copy is refused: a later call outside one
  // sets it (the kernels read it when they run, replays included).
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(device), &capture));
  if (capture != cudaStreamCaptureStatusNone) return;
  C10_CUDA_CHECK(cudaMemcpyToSymbol(g_planted_bug, &bug, sizeof(bug)));
  done.at(device) = true;
#else
  (void)device;
#endif
}

inline DeviceInfo device_info(int device) {
  static std::array<DeviceInfo, 64> cache{};
  DeviceInfo& info = cache.at(device);
  if (info.sm_count == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.major, cudaDevAttrComputeCapabilityMajor, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.minor, cudaDevAttrComputeCapabilityMinor, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.l2_bytes, cudaDevAttrL2CacheSize, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.smem_per_block,
                                          cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.sm_count, cudaDevAttrMultiProcessorCount, device));
    set_planted_bug(device);
  }
  return info;
}

// Refuses a forced wgmma configuration (`option`=`config`: the forward's config=5 to 7, the
// backward's backward_config=3) where it cannot run: a GPU other than compute capability 9.0, a
// build without sm_90a, or head dims its kernels do not take (`head_dims_ok`; `head_dims` lists
// those they do). `others` names the configurations that can, for the message.
inline void check_wgmma_config(const char* option, int64_t config, const DeviceInfo& dev,
                               const char* others, bool head_dims_ok, const char* head_dims,
                               int64_t head_dim, int64_t head_dim_v) {
  FLASHMOE_CHECK_VALUE(head_dims_ok, option, "=", config,
                       " runs on wgmma, whose kernels take head_dim ", head_dims, " (v's equal); ",
                       "head_dim ", head_dim,
                       head_dim_v != head_dim ? " with v's " + std::to_string(head_dim_v) : "",
                       " runs ", option, " ", others, " (or 0, automatic)");
  FLASHMOE_CHECK_VALUE(dev.major == 9 && dev.minor == 0, option, "=", config,
                       " runs on wgmma, which only compute capability 9.0 has; this GPU is ",
                       dev.major, ".", dev.minor, ": use ", option, " ", others,
                       " (or 0, automatic)");
  FLASHMOE_CHECK_VALUE(kBuiltSm90a, option, "=", config,
                       " needs the sm_90a build, and this one was built without it: rebuild with "
                       "`python -m flashmoe_science build --arch 9.0a` (the default on an H100)");
}

// `features`: the instantiation that takes a window or a softcap (Sm90Rows; sinks run in every
// one).
template <typename Traits, typename T, bool kVarlen>
auto fwd_sm90_kernel(bool features) {
  if constexpr (kVarlen) {
    return features ? &flash_fwd_sm90_varlen_kernel<Traits, T, true>
                    : &flash_fwd_sm90_varlen_kernel<Traits, T, false>;
  } else {
    return features ? &flash_fwd_sm90_kernel<Traits, T, true>
                    : &flash_fwd_sm90_kernel<Traits, T, false>;
  }
}

template <typename Traits, typename T, bool kVarlen>
auto fwd_kernel() {
  if constexpr (kVarlen) {
    return &flash_fwd_varlen_kernel<Traits, T>;
  } else {
    return &flash_fwd_kernel<Traits, T>;
  }
}

// The wgmma forward's kernel of v's 128 under q's and k's 192, one for configurations 5 to 7.
template <typename T, int D, bool kVarlen, int kConfig, typename F>
void visit_narrow_v(F& f, bool features) {
  if constexpr (D == 192) {
    using Traits = Sm90NarrowVTraits;
    FLASHMOE_VISIT(kVarlen ? only::varlen : only::fwd_sm90a, T, D, kConfig, f, Traits,
                   fwd_sm90_kernel<Traits, T, kVarlen>(features));
  } else {  // the host refuses these first (wgmma_head_dims)
    TORCH_CHECK(false, "flashmoe_science: no config=", kConfig, " kernel for head_dim ", D,
                " with v's 128");
  }
}

// The wgmma forward's 128 tile run at narrower head dims (wgmma_padded): configuration 5 only;
// `mma96`: its MMAs over 96 columns (Sm90Tile::kPadded96).
template <typename T, int D, bool kVarlen, typename F>
void visit_padded(F& f, bool features, bool mma96) {
  if constexpr (D == 128) {
    if (mma96) {
      using Traits = Sm90PaddedTraits<Sm90Config5Traits<128>, 96>;
      FLASHMOE_VISIT(kVarlen ? only::varlen : only::fwd_sm90a, T, D, kSm90aConfig, f, Traits,
                     fwd_sm90_kernel<Traits, T, kVarlen>(features));
      return;
    }
    using Traits = Sm90PaddedTraits<Sm90Config5Traits<128>>;
    FLASHMOE_VISIT(kVarlen ? only::varlen : only::fwd_sm90a, T, D, kSm90aConfig, f, Traits,
                   fwd_sm90_kernel<Traits, T, kVarlen>(features));
  } else {  // the host refuses these first (wgmma_padded)
    TORCH_CHECK(false, "flashmoe_science: no padded config=", kSm90aConfig, " kernel at tile ", D);
  }
}

// Calls f(kernel, Traits{}) with the kernel of one (dtype, head_dim, configuration). kVarlen: the
// forward kernel's packed-batch instantiation (configurations 1, 2, 4 and 5; never 3, 6 or 7).
// `features`: a window or a softcap, which the wgmma kernels take in an instantiation of
// their own (the others take them at run time). `narrow_v`: v's 128 under q's and k's 192
// (wgmma_narrow_v), which configurations 5 to 7 run on a kernel of their own (the others on the
// 192 tile, v zero-padded).
template <typename T, int D, bool kVarlen = false, typename F>
void visit_config(int config, F&& f, bool features = false, Sm90Tile tile = Sm90Tile::kWhole) {
  const bool narrow_v = tile == Sm90Tile::kNarrowV;
  // The kVarlen visit compiles no kernel for these (the `!kVarlen` branches below).
  static_assert(!has_packed_variant(kDecodeConfig) && !has_packed_variant(kSm90aM128Config) &&
                !has_packed_variant(kSm90aN176Config));
  constexpr bool kWgmma = is_wgmma_head_dim(D);
  if (config == 1) {
    using Traits = Config1Traits<D>;
    FLASHMOE_VISIT(kVarlen ? only::varlen : only::fwd, T, D, 1, f, Traits,
                   fwd_kernel<Traits, T, kVarlen>());
  } else if (config == 2) {
    using Traits = FwdTraits<D, 64, 64, 4>;
    FLASHMOE_VISIT(kVarlen ? only::varlen : only::fwd, T, D, 2, f, Traits,
                   fwd_kernel<Traits, T, kVarlen>());
  } else if (config == kDecodeConfig && !kVarlen) {
    using Traits = DecodeConfig<D>;
    FLASHMOE_VISIT(only::decode, T, D, kDecodeConfig, f, Traits, &flash_decode_kernel<Traits, T>);
  } else if (is_sm90a_config(config) && !kWgmma) {
    // The host refuses these first (check_wgmma_config); no wgmma kernel is compiled for D.
    TORCH_CHECK(false, "flashmoe_science: no config=", config, " kernel for head_dim ", D);
  } else if (config == kSm90aConfig && narrow_v) {
    visit_narrow_v<T, D, kVarlen, kSm90aConfig>(f, features);
  } else if (config == kSm90aConfig && is_padded(tile)) {
    visit_padded<T, D, kVarlen>(f, features, tile == Sm90Tile::kPadded96);
  } else if (config == kSm90aConfig) {
    if constexpr (kWgmma) {
      // A producer warpgroup, and two math warpgroups at d128 (128-row tiles, ping-pong, K and V
      // in three buffers), three at d64 (192-row tiles in turns, two buffers); past d128
      // Sm90WideTraits.
      using Traits = Sm90Config5Traits<D>;
      FLASHMOE_VISIT(kVarlen ? only::varlen : only::fwd_sm90a, T, D, kSm90aConfig, f, Traits,
                     fwd_sm90_kernel<Traits, T, kVarlen>(features));
    }
  } else if (config == kSm90aM128Config && !kVarlen && narrow_v) {
    visit_narrow_v<T, D, false, kSm90aM128Config>(f, features);
  } else if (config == kSm90aM128Config && !kVarlen) {
    if constexpr (kWgmma) {
      // Two math warpgroups at every head dim (from d=128 up the same type, so the same kernel,
      // as 5). The dense kernel even in the packed-batch visit, which never comes here: no packed
      // variant is compiled.
      using Traits = Sm90Config6Traits<D>;
      FLASHMOE_VISIT(only::fwd_sm90a, T, D, kSm90aM128Config, f, Traits,
                     fwd_sm90_kernel<Traits, T, false>(features));
    }
  } else if (config == kSm90aN176Config && !kVarlen && narrow_v) {
    visit_narrow_v<T, D, false, kSm90aN176Config>(f, features);
  } else if (config == kSm90aN176Config && !kVarlen) {
    if constexpr (kWgmma) {
      // 176-key tiles at d=128, two K/V buffers; at the other head dims configuration 5's type,
      // so its kernel. No packed variant, as 6.
      using Traits = Sm90Config7Traits<D>;
      FLASHMOE_VISIT(only::fwd_sm90a, T, D, kSm90aN176Config, f, Traits,
                     fwd_sm90_kernel<Traits, T, false>(features));
    }
  } else {
    using Traits = Config4Traits<D>;
    FLASHMOE_VISIT(kVarlen ? only::varlen : only::fwd, T, D, kSm90Config, f, Traits,
                   fwd_kernel<Traits, T, kVarlen>());
  }
}

template <typename T, bool kVarlen = false, typename F>
void visit_kernel(int head_dim, int config, F&& f, bool features = false,
                  Sm90Tile tile = Sm90Tile::kWhole) {
  with_head_dim(head_dim, [&](auto d) {
    visit_config<T, decltype(d)::value, kVarlen>(config, f, features, tile);
  });
}

// The decode kernel against a paged cache (p.block_table).
template <typename T, typename F>
void visit_paged_decode(int head_dim, F&& f) {
  with_head_dim(head_dim, [&](auto d) {
    constexpr int D = decltype(d)::value;
    using Traits = DecodeConfig<D>;
    FLASHMOE_VISIT(only::paged, T, D, kDecodeConfig, f, Traits,
                   &flash_decode_paged_kernel<Traits, T>);
  });
}

// The check of a packed batch's offsets that follows its forward kernel (it poisons the outputs
// of offsets that do not describe the batch).
template <typename F>
void visit_varlen_check(at::ScalarType dtype, int head_dim, F&& f) {
  with_dtype(dtype, [&](auto dt) {
    using T = typename decltype(dt)::type;
    with_head_dim(head_dim, [&](auto d) {
      constexpr int D = decltype(d)::value;
      FLASHMOE_KERNEL(only::varlen, T, D, 0, f(&varlen_offsets_check_kernel<T, D>));
    });
  });
}

// Opts in to more than the default 48 KB of shared memory; from 47 KB up, since a kernel's static
// shared memory (the decode kernel's flag) counts against the same limit.
// Once per kernel and device: the attribute sticks, and setting it on every call costs host time.
template <typename Kernel>
void allow_dynamic_smem(Kernel kernel, int smem) {
  if (smem <= 47 * 1024) return;
  static std::mutex mutex;
  static auto* done = new std::set<std::pair<int, const void*>>();  // never destroyed, as above
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const std::pair<int, const void*> key{device, reinterpret_cast<const void*>(kernel)};
  std::lock_guard<std::mutex> lock(mutex);
  if (done->count(key)) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  done->insert(key);
}

// cuTensorMapEncodeTiled through the runtime's driver entry point (no link against libcuda);
// looked up once per process.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                                    cudaEnableDefault, &found));
    return found == cudaDriverEntryPointSuccess
               ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn)
               : nullptr;
  }();
  return encode;
}

// The 5-D map {64 columns, rows, head_dim / 64 panels, heads, batch} of a K or V tensor whose
// boxes {64, box_rows, head_dim / 64, 1, 1} land in shared memory in swizzle_panels' layout
// (128-byte swizzle). `by_panel` (a padded tile, Sm90PaddedTraits): the map {head_dim columns,
// rows, 1, heads, batch} of boxes {64, box_rows, 1, 1, 1}, one a panel of the tile, whose columns
// past head_dim TMA zero-fills (CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE). False if the driver refuses
// it (the caller then copies with cp.async).
inline bool encode_kv_map(unsigned char (&map)[128], const void* base, bool fp16, int64_t rows,
                          int64_t heads, int64_t batch, int64_t row_stride, int64_t head_stride,
                          int64_t batch_stride, int head_dim, int box_rows, bool by_panel = false) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const cuuint64_t dims[5] = {cuuint64_t(by_panel ? head_dim : 64), cuuint64_t(rows),
                              cuuint64_t(by_panel ? 1 : head_dim / 64), cuuint64_t(heads),
                              cuuint64_t(batch)};
  // Bytes; a dimension of extent 1 still needs a valid stride.
  const cuuint64_t strides[4] = {cuuint64_t(row_stride * 2), 128, cuuint64_t(head_stride * 2),
                                 cuuint64_t(std::max<int64_t>(batch_stride, 8) * 2)};
  const cuuint32_t box[5] = {64, cuuint32_t(box_rows), cuuint32_t(by_panel ? 1 : head_dim / 64), 1,
                             1};
  const cuuint32_t element_strides[5] = {1, 1, 1, 1, 1};
  static_assert(sizeof(CUtensorMap) == 128, "AttentionParams holds 128-byte tensor maps");
  const CUresult done =
      encode(reinterpret_cast<CUtensorMap*>(map),
             fp16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 5,
             const_cast<void*>(base), dims, strides, box, element_strides,
             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return done == CUDA_SUCCESS;
}

#if FLASHMOE_BWD_DQ_MAP
// The 3-D map {head_dim columns, rows, heads} of dq_accum (fp32, contiguous) whose boxes {32, 64,
// 1} the wgmma backward reduce-adds from shared memory (128-byte swizzle). False if the driver
// refuses it (the caller then runs the deterministic dQ pass instead).
inline bool encode_dq_map(unsigned char (&map)[128], float* base, int64_t rows, int64_t heads,
                          int head_dim) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const cuuint64_t dims[3] = {cuuint64_t(head_dim), cuuint64_t(rows), cuuint64_t(heads)};
  const cuuint64_t strides[2] = {cuuint64_t(head_dim * 4), cuuint64_t(rows * head_dim * 4)};
  const cuuint32_t box[3] = {32, 64, 1};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUresult done = encode(
      reinterpret_cast<CUtensorMap*>(map), CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 3, base, dims, strides,
      box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return done == CUDA_SUCCESS;
}
#endif

// The row and key tiles of configuration `config` at `head_dim` and the shared memory its kernel
// asks for: its kernel's traits, as visit_config chooses them (the same for both dtypes and for the
// packed-batch kernels), so the grid, the split count and the TMA boxes cannot disagree with the
// kernel they launch.
struct TileShape {
  int block_m, block_n, smem_bytes;
};
inline TileShape tile_shape_of(int config, int head_dim, Sm90Tile tile = Sm90Tile::kWhole) {
  TileShape shape{};
  auto read = FLASHMOE_TRAITS_ONLY([&](auto, auto traits) {
    using Traits = decltype(traits);
    shape = {Traits::kBlockM, Traits::kBlockN, Traits::kSmemBytes};
  });
  visit_kernel<__half>(head_dim, config, read, false, tile);
  return shape;
}

// The automatic choice. `heads` is the grid's (batch, head) count, `rows_per_head` its rows,
// `seqlen_k` its keys. Grids too small to fill the GPU take smaller row tiles (more blocks): the
// 16-row decode tiles when even 64-row tiles leave SMs idle (one sequence of a few hundred
// tokens, say).
// `head_dim` is the tile's (tile_head_dim); `wgmma_ok` whether the call is unpadded at a head dim
// of the wgmma kernels (kWgmmaHeadDims).
inline int choose_config(const DeviceInfo& dev, int head_dim, bool wgmma_ok, int64_t heads,
                         int rows_per_head, bool causal, int seqlen_k) {
  const bool small_smem = dev.major == 8 && dev.minor != 0;  // sm86, sm87, sm89: 100 KB per SM
  if (rows_per_head <= 16 || heads * ceil_div(rows_per_head, 64) < dev.sm_count) {
    return kDecodeConfig;
  }
  if (rows_per_head <= 64 || heads * ceil_div(rows_per_head, 128) < dev.sm_count) return 2;
  // A 9.0 GPU with the sm_90a build: the wgmma kernels, faster than config 4 there.
  if (dev.major == 9 && dev.minor == 0 && kBuiltSm90a && wgmma_ok) {
    // 128-row tiles at d=64 where the causal mask leaves a 192-row tile the most idle work:
    // short heads with no more keys than query rows. Where the keys outnumber the rows the mask
    // covers little, and 192-row tiles win (see configuration 6 above).
    const bool short_causal = causal && rows_per_head <= 1024 && seqlen_k <= rows_per_head;
    if (head_dim == 64 && short_causal) return kSm90aM128Config;
    // 176-key tiles at d=128 where a head's keys are long and unmasked (configuration 7 above).
    if (head_dim == 128 && !causal && seqlen_k >= 4096) return kSm90aN176Config;
    return kSm90aConfig;
  }
  const int config = dev.major >= 9 ? kSm90Config : head_dim == 128 && small_smem ? 2 : 1;
  // A 128-row tile that does not fit this GPU's blocks (d=256 on sm86/sm89): 2's 64 rows do.
  return tile_shape_of(config, head_dim).smem_bytes <= dev.smem_per_block ? config : 2;
}

// Refuses a forced configuration whose kernel needs more shared memory than a block of this GPU
// may have (configurations 1 and 4 at d=256 on an sm86/sm89 GPU); 2 and 3 fit every GPU.
inline void check_config_fits(int64_t config, const DeviceInfo& dev, int64_t head_dim,
                              Sm90Tile tile) {
  const int bytes = tile_shape_of(int(config), int(head_dim), tile).smem_bytes;
  FLASHMOE_CHECK_VALUE(bytes <= dev.smem_per_block, "config=", config, " needs ", bytes,
                       " bytes of shared memory per block at head_dim ", head_dim,
                       "; this GPU allows ", dev.smem_per_block,
                       ": use config 2 (or 0, automatic)");
}

// Refuses a forced configuration this GPU (or this build) cannot run. `others` names the ones it
// can, for the message.
inline void check_config_for_device(int64_t config, const DeviceInfo& dev, const char* others,
                                    int64_t head_dim, int64_t head_dim_v) {
  FLASHMOE_CHECK_VALUE(config != kSm90Config || dev.major >= 9, "config=", config,
                       " is built for compute capability 9.0 and newer; this GPU is ", dev.major,
                       ".", dev.minor, ": use config ", others, " (or 0, automatic)");
  if (is_sm90a_config(config)) {
    check_wgmma_config("config", config, dev, others, wgmma_head_dims(head_dim, head_dim_v, config),
                       kWgmmaHeadDimsText, head_dim, head_dim_v);
  }
  if (config != 0) {
    check_config_fits(config, dev, cuda_tile_head_dim(head_dim, head_dim_v),
                      is_sm90a_config(config) ? sm90_tile(head_dim, head_dim_v) : Sm90Tile::kWhole);
  }
}

// Whether the sm_90a kernel's producer (boxes of its key tile, 80 to 176 rows) copies K and V with
// TMA: it does where the key rows past a sequence's end are other keys or outside the tensor
// (zero-filled), not where they are a cache's unused rows (cache_seqlens), which may hold
// anything. FLASHMOE_SM90_TMA=0 turns it off (the producer then copies with cp.async). The maps
// are encoded on every call (two host calls of a few microseconds), not cached. From d=128 up Q
// goes by TMA as well where K and V do and a tile's rows are one head's consecutive queries
// (`box_rows_q` = the kernel's row tile): its cp.async sat on the producer's path from a tile's
// last S to the next tile's first. At d=64, where Q was never late, TMA was slower
// (benches/notes/prefill-sm90.md, v3.8).
// `by_panel`: a padded tile's maps (encode_kv_map).
template <typename T>
void use_tma_if_it_fits(AttentionParams& p, int box_rows_q, int box_rows_kv, bool by_panel) {
  static const bool allowed = [] {
    const char* env = std::getenv("FLASHMOE_SM90_TMA");
    return env == nullptr || std::strcmp(env, "0") != 0;
  }();
  if (!allowed || p.seqlens_k != nullptr || p.block_table != nullptr) return;
  const bool packed = p.cu_seqlens_q != nullptr;
  const int64_t rows = packed ? p.total_k : p.seqlen_k, batch = packed ? 1 : p.batch;
  const bool fp16 = std::is_same_v<T, __half>;
  p.tma = encode_kv_map(p.tma_k, p.k, fp16, rows, p.heads_kv, batch, p.k_row_stride,
                        p.k_head_stride, p.k_batch_stride, p.head_dim, box_rows_kv, by_panel) &&
          encode_kv_map(p.tma_v, p.v, fp16, rows, p.heads_kv, batch, p.v_row_stride,
                        p.v_head_stride, p.v_batch_stride, p.head_dim_v, box_rows_kv, by_panel);
  p.q_tma = p.tma && p.head_dim >= 128 && !packed && !p.pack_gqa &&
            encode_kv_map(p.tma_q, p.q, fp16, p.seqlen_q, p.heads_q, p.batch, p.q_row_stride,
                          p.q_head_stride, p.q_batch_stride, p.head_dim, box_rows_q, by_panel);
}

// A window (other than causal's) or a softcap: the wgmma forward's kernels take them in an
// instantiation of their own (fwd_sm90_kernel). Sinks touch only the rows' epilogue, which every
// instantiation runs, so sinks alone keep the plain kernel and its automatic configuration.
inline bool has_score_features(const AttentionParams& p) {
  return p.window_left >= 0 || p.window_right > 0 || p.softcap > 0;
}

// The sm_90a kernels, which are persistent (one block per SM walks the tiles).
template <typename Traits>
struct IsSm90Traits : std::false_type {};
template <int D, int BN, int kWarpgroups, int kStages>
struct IsSm90Traits<Sm90FwdTraits<D, BN, kWarpgroups, kStages>> : std::true_type {};
template <int D, int DV, int BN, int kWarpgroups, int kStages>
struct IsSm90Traits<Sm90FwdDvTraits<D, DV, BN, kWarpgroups, kStages>> : std::true_type {};
template <typename Tiles, int kMmaHeadDim>
struct IsSm90Traits<Sm90PaddedTraits<Tiles, kMmaHeadDim>> : std::true_type {};

template <typename T>
void launch_attention(const AttentionParams& params, int config, int grid_x, int m_blocks,
                      cudaStream_t stream) {
  AttentionParams p = params;
  if (kBuiltSm90a && is_sm90a_config(config)) {
    const TileShape tile = tile_shape_of(config, tile_head_dim(p), sm90_tile(p));
    use_tma_if_it_fits<T>(p, tile.block_m, tile.block_n, is_padded(sm90_tile(p)));
  }
  auto launch = [&](auto kernel, auto traits) {
    using Traits = decltype(traits);
    allow_dynamic_smem(kernel, Traits::kSmemBytes);
    // x = (batch, head, row block) in the order p.row_blocks_fastest says (TileCoords); y = split.
    dim3 grid(grid_x * m_blocks, p.num_splits);
    if constexpr (IsSm90Traits<Traits>::value) {  // persistent: one block per SM walks the tiles
      const int64_t tiles = int64_t(grid_x) * m_blocks * p.num_splits;
      grid = dim3(
          unsigned(std::min<int64_t>(tiles, device_info(c10::cuda::current_device()).sm_count)));
    }
    kernel<<<grid, Traits::kNThreads, Traits::kSmemBytes, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  const int tile_d = tile_head_dim(p);
  if (p.cu_seqlens_q != nullptr) {
    visit_kernel<T, /*kVarlen=*/true>(tile_d, config, launch, has_score_features(p), sm90_tile(p));
  } else if (p.block_table != nullptr) {
    visit_paged_decode<T>(tile_d, launch);
  } else {
    visit_kernel<T>(tile_d, config, launch, has_score_features(p), sm90_tile(p));
  }
}

// Blocks of one kernel resident per SM (registers, shared memory and threads), as CUDA computes
// it; the split heuristic's unit of work. Cached per device, dtype, head_dim (and narrow v) and
// configuration.
template <typename T>
int blocks_per_sm(int device, int head_dim, int config, Sm90Tile tile) {
  static std::mutex mutex;
  static std::map<std::tuple<int, int, int, int>, int> cache;
  std::lock_guard<std::mutex> lock(mutex);
  int& blocks = cache[{device, head_dim, config, int(tile)}];
  if (blocks == 0) {
    visit_kernel<T>(
        head_dim, config,
        [&](auto kernel, auto traits) {
          using Traits = decltype(traits);
          allow_dynamic_smem(kernel, Traits::kSmemBytes);
          C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
              &blocks, kernel, Traits::kNThreads, Traits::kSmemBytes));
        },
        false, tile);
    blocks = std::max(blocks, 1);
  }
  return blocks;
}

// Arrival counters for the decode kernel's fused combine: one per row tile, all zero between
// launches (the last block of a tile resets its own). Kept per device and stream, since launches
// on one stream run in order while launches on two streams may overlap. Under graph capture a
// fresh zeroed buffer is allocated instead (its memset becomes part of the graph). Zeroed with
// cudaMemsetAsync rather than a torch fill kernel: compute-sanitizer's initcheck only sees writes
// by instrumented kernels and CUDA API calls, and the sanitize run instruments ours alone.
inline at::Tensor zeroed_ints(const at::Tensor& like, cudaStream_t stream, int64_t n) {
  at::Tensor t = at::empty({n}, like.options().dtype(at::kInt));
  C10_CUDA_CHECK(cudaMemsetAsync(t.data_ptr(), 0, n * sizeof(int), stream));
  return t;
}

inline at::Tensor split_counters(const at::Tensor& like, cudaStream_t stream, bool capturing,
                                 int64_t tiles) {
  if (capturing) return zeroed_ints(like, stream, tiles);
  static std::mutex mutex;
  // Never destroyed: CUDA may be torn down before static destructors run.
  static auto* buffers = new std::map<std::pair<int, cudaStream_t>, at::Tensor>();
  std::lock_guard<std::mutex> lock(mutex);
  at::Tensor& buffer = (*buffers)[{int(like.device().index()), stream}];
  if (!buffer.defined() || buffer.numel() < tiles) {
    buffer = zeroed_ints(like, stream, std::max<int64_t>(tiles, 4096));
  }
  return buffer;
}

// sinks (fp32 [Hq] or null): lse is then [B, Hq, Sq], the rows' layout.
template <typename T, int D>
void launch_combine(const at::Tensor& o_accum, const at::Tensor& lse_accum, at::Tensor& out,
                    at::Tensor& lse, cudaStream_t stream, const float* sinks) {
  const int64_t rows = lse.numel();
  const int blocks = int((rows + 3) / 4);
  const int heads_q = sinks ? int(lse.size(1)) : 1, seqlen_q = sinks ? int(lse.size(2)) : 1;
  FLASHMOE_KERNEL(only::combine, T, D, 0,
                  split_kv_combine_kernel<T, D><<<blocks, 128, 0, stream>>>(
                      o_accum.data_ptr<float>(), lse_accum.data_ptr<float>(),
                      reinterpret_cast<T*>(out.data_ptr()), lse.data_ptr<float>(),
                      int(o_accum.size(0)), rows, int(out.size(-1)), sinks, heads_q, seqlen_q));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

inline void combine_into(const at::Tensor& o_accum, const at::Tensor& lse_accum, at::Tensor& out,
                         at::Tensor& lse, const float* sinks = nullptr) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(out.device().index()).stream();
  with_dtype(out.scalar_type(), [&](auto dt) {
    with_head_dim(int(cuda_tile_head_dim(out.size(-1), out.size(-1))), [&](auto d) {
      launch_combine<typename decltype(dt)::type, decltype(d)::value>(o_accum, lse_accum, out, lse,
                                                                      stream, sinks);
    });
  });
}

// The values inside cache_seqlens, cu_seqlens and block_table are read by the kernels, not by the
// host: a host check costs a copy and a device sync on every call (a serving loop pays it in host
// time). The kernels read nothing outside the tensors whatever the values, and a value that does
// not describe the batch makes the outputs it touches NaN (a packed batch's offsets: all of them).
// FLASHMOE_CHECK_INPUTS=1 adds the host check, which names the bad value in a one-line error.
inline bool host_checks_requested() {
  const char* flag = std::getenv("FLASHMOE_CHECK_INPUTS");
  return flag != nullptr && flag[0] != '\0' && std::strcmp(flag, "0") != 0;
}

// q's and k's head_dim and v's (the output's): what the kernels are built for
// (cuda_head_dims_problem), checked before any launch.
inline void check_head_dims_cuda(int64_t head_dim, int64_t head_dim_v) {
  const std::string problem = cuda_head_dims_problem(head_dim, head_dim_v);
  FLASHMOE_CHECK_VALUE(problem.empty(), problem);
}

// The forward's window, softcap and sinks, which every kernel takes, set on `p` the CUDA way (a
// softcap scales the score before the tanh, and the softcap becomes the softmax's:
// apply_softcap). `sinks_out` keeps the contiguous fp32 sinks alive until the launches are
// enqueued.
inline void set_features_cuda(AttentionParams& p, const at::Tensor& q, bool causal,
                              int64_t window_left, int64_t window_right, double softcap,
                              const std::optional<at::Tensor>& sinks, at::Tensor& sinks_out) {
  if (sinks.has_value()) sinks_out = sinks->contiguous();
  set_features(p, resolve_window(causal, window_left, window_right), softcap,
               sinks.has_value() ? &sinks_out : nullptr);
  if (softcap > 0) {  // the kernels keep tanh(s * scale / softcap) (apply_softcap)
    p.softcap_scale = float(p.softmax_scale / softcap);
    p.softmax_scale = float(softcap);
    p.scale_log2 = float(softcap * M_LOG2E);
  }
}

// The check of the window, softcap and sinks (as on the CPU), before any launch; returns the
// call's causal flag, which a window of (-1, 0) sets.
inline bool check_features_forward(const at::Tensor& q, bool causal, int64_t window_left,
                                   int64_t window_right, double softcap,
                                   const std::optional<at::Tensor>& sinks) {
  check_features(q, window_left, window_right, softcap, sinks);
  return resolve_window(causal, window_left, window_right).causal;
}

// An empty result's log-sum-exp with sinks: with no key at all, each row's is its sink's logit
// alone (as on the CPU).
inline std::tuple<at::Tensor, at::Tensor> with_sinks(std::tuple<at::Tensor, at::Tensor> empty,
                                                     const std::optional<at::Tensor>& sinks) {
  at::Tensor& lse = std::get<1>(empty);
  if (sinks.has_value() && lse.numel() > 0) lse.copy_(sinks->view({1, -1, 1}));
  return empty;
}

// The KV blocks of `block_n` keys a row tile can see at most: all `n_blocks` of the keys, or with
// a window's left edge those its span covers (left + the tile's queries + right, one more for
// the alignment), which sizes the split count (each split then owns a share of the window).
inline int window_blocks(const AttentionParams& p, int block_n, int n_blocks) {
  if (p.window_left < 0) return n_blocks;
  const int64_t span =
      int64_t(p.window_left) + p.seqlen_q + (p.window_right >= 0 ? p.window_right : p.seqlen_k);
  return int(std::min<int64_t>(n_blocks, (span + block_n - 1) / block_n + 1));
}

// cp.async moves 16-byte chunks: base pointers and row/head/batch strides must be multiples of
// 16 bytes. Anything else (an odd storage offset, say) is copied once rather than rejected.
inline at::Tensor aligned_for_cp_async(const at::Tensor& t) {
  const bool ok = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && t.stride(0) % 8 == 0 &&
                  t.stride(1) % 8 == 0 && t.stride(2) % 8 == 0;
  if (ok) return t;
  return at::empty(t.sizes(), t.options().memory_format(at::MemoryFormat::Contiguous)).copy_(t);
}

inline std::tuple<at::Tensor, at::Tensor> split_kv_combine_cuda(const at::Tensor& out_partial,
                                                                const at::Tensor& lse_partial,
                                                                at::ScalarType dtype) {
  check_combine_inputs(out_partial, lse_partial, dtype);
  check_head_dims_cuda(out_partial.size(4), out_partial.size(4));
  c10::cuda::CUDAGuard guard(out_partial.device());
  set_planted_bug(out_partial.device().index());
  auto o_acc = out_partial.contiguous();
  auto l_acc = lse_partial.contiguous();
  auto out = at::empty(o_acc.sizes().slice(1), o_acc.options().dtype(dtype));
  auto lse = at::empty(l_acc.sizes().slice(1), l_acc.options());
  if (lse.numel() > 0) combine_into(o_acc, l_acc, out, lse);
  return {out, lse};
}

// The launch shared by the dense and the paged entry points: GQA packing, the configuration, the
// split count, the outputs ([B, Hq, Sq, Dv] and [B, Hq, Sq]) and the kernel.
inline std::tuple<at::Tensor, at::Tensor> run_forward(const at::Tensor& q, AttentionParams p,
                                                      int64_t config, int64_t num_splits,
                                                      const DeviceInfo& dev, cudaStream_t stream,
                                                      bool capturing) {
  const bool causal = p.causal;
  // Fold the query heads of a GQA group into the rows when the queries are few (decode), so the
  // group's K and V are read once.
  p.pack_gqa = p.heads_ratio > 1 && int64_t(p.seqlen_q) * p.heads_ratio <= 128;
  const int rows_per_head = p.seqlen_q * (p.pack_gqa ? p.heads_ratio : 1);
  const int64_t grid_x = int64_t(p.batch) * (p.pack_gqa ? p.heads_kv : p.heads_q);
  const int tile_d = tile_head_dim(p);
  if (config == 0) {
    const bool wgmma_ok = wgmma_chosen(p.head_dim, p.head_dim_v);
    config = choose_config(dev, tile_d, wgmma_ok, grid_x, rows_per_head, causal, p.seqlen_k);
    // With a window or softcap, the wgmma kernel of two math warpgroups over 128-key tiles:
    // the feature instantiations of the others (three warpgroups, 176 keys) spill
    // (benches/notes/features.md).
    if (is_sm90a_config(config) && has_score_features(p)) config = kSm90aM128Config;
    // A padded tile is configuration 5's alone (its 128 tile, Sm90PaddedTraits).
    if (is_sm90a_config(config) && wgmma_padded(p.head_dim, p.head_dim_v)) config = kSm90aConfig;
  }
  const Sm90Tile sm90 = is_sm90a_config(config) ? sm90_tile(p) : Sm90Tile::kWhole;
  const TileShape tile = tile_shape_of(int(config), tile_d, sm90);
  const int m_blocks = ceil_div(rows_per_head, tile.block_m);
  // Launch order (benches/notes/prefill-sm80.md, v2.5): the row blocks of a head side by
  // side share its K and V in L2, which pays for short and unmasked sequences; long causal ones
  // (32+ row blocks of 1 to 32+ KV blocks each) gain more from all heads' heavy blocks first.
  p.row_blocks_fastest = !(causal && m_blocks >= 32);
  FLASHMOE_CHECK_VALUE(grid_x * m_blocks < (int64_t(1) << 31), "q of shape ", shape_str(q),
                       " exceeds the launch grid (batch x heads x row blocks must be below 2^31)");
  const int n_blocks = window_blocks(p, tile.block_n, ceil_div(p.seqlen_k, tile.block_n));
  int splits = int(num_splits);
  const int tiles = int(std::min<int64_t>(grid_x * m_blocks, 1 << 30));
  if (splits == 0 && config == kDecodeConfig) {
    splits = decode_num_splits(tiles, dev.sm_count, n_blocks);
  } else if (splits == 0) {
    const int resident =
        q.scalar_type() == at::kHalf
            ? blocks_per_sm<__half>(q.device().index(), tile_d, int(config), sm90)
            : blocks_per_sm<__nv_bfloat16>(q.device().index(), tile_d, int(config), sm90);
    splits = num_splits_heuristic(tiles, dev.sm_count * resident, n_blocks, kMaxSplits);
  }
  p.num_splits = splits;
  p.n_blocks_per_split = std::max(1, ceil_div(n_blocks, splits));
  // Decode with one row tile per KV head reads each K and V byte once: it streams them through L2
  // evict-first, so they replace each other rather than what earlier kernels left there (nor force
  // those kernels' dirty lines out to DRAM mid-kernel). Up to 4x the L2 only: longer streams ran
  // slower evict-first (benches/notes/decode.md, v2.6).
  const int64_t kv_bytes = int64_t(p.batch) * p.heads_kv * p.seqlen_k *
                           (p.head_dim + p.head_dim_v) * int64_t(q.element_size());
  p.kv_evict_first =
      config == kDecodeConfig && m_blocks == 1 && kv_bytes <= 4 * int64_t(dev.l2_bytes);

  auto out = at::empty({q.size(0), q.size(1), q.size(2), p.head_dim_v},
                       q.options().memory_format(at::MemoryFormat::Contiguous));
  auto lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  p.o = out.data_ptr();
  p.o_batch_stride = out.stride(0), p.o_head_stride = out.stride(1), p.o_row_stride = out.stride(2);
  p.lse = lse.data_ptr<float>();
  at::Tensor accum, o_accum, lse_accum, counters;  // alive until the launches are enqueued
  const bool fused_combine = config == kDecodeConfig;
  if (splits > 1 && fused_combine) {
    counters = split_counters(q, stream, capturing, grid_x * m_blocks);
    p.split_counters = counters.data_ptr<int>();
  }
  if (splits > 1) {
    // One allocation for the partials and their log-sum-exps (an allocation is host time).
    const int64_t rows = lse.numel(), partial = splits * rows * p.head_dim_v;
    accum = at::empty({partial + splits * rows}, lse.options());
    p.o_accum = accum.data_ptr<float>();
    p.lse_accum = p.o_accum + partial;
    if (!fused_combine) {
      o_accum = accum.narrow(0, 0, partial)
                    .view({splits, q.size(0), q.size(1), q.size(2), int64_t(p.head_dim_v)});
      lse_accum =
          accum.narrow(0, partial, splits * rows).view({splits, q.size(0), q.size(1), q.size(2)});
    }
  }
  if (q.scalar_type() == at::kHalf) {
    launch_attention<__half>(p, int(config), int(grid_x), m_blocks, stream);
  } else {
    launch_attention<__nv_bfloat16>(p, int(config), int(grid_x), m_blocks, stream);
  }
  if (splits > 1 && !fused_combine) combine_into(o_accum, lse_accum, out, lse, p.sinks);
  return {out, lse};
}

inline std::tuple<at::Tensor, at::Tensor> attention_fwd_cuda(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const std::optional<at::Tensor>& seqlens_k, bool causal, double softmax_scale,
    int64_t num_splits, int64_t config, int64_t window_left, int64_t window_right, double softcap,
    const std::optional<at::Tensor>& sinks) {
  check_attention_inputs(q_in, k_in, v_in, seqlens_k, num_splits);
  FLASHMOE_CHECK_VALUE(q_in.is_cuda(), "q is on ", q_in.device(),
                       "; this is the CUDA implementation");
  check_head_dims_cuda(q_in.size(3), v_in.size(3));
  causal = check_features_forward(q_in, causal, window_left, window_right, softcap, sinks);
  FLASHMOE_CHECK_VALUE(config >= 0 && config <= kNumConfigs, "config must be in [0, ", kNumConfigs,
                       "] (0 = automatic), got ", config);
  c10::cuda::CUDAGuard guard(q_in.device());
  const DeviceInfo dev = device_info(q_in.device().index());
  TORCH_CHECK(dev.major >= 8,
              error_text("flashmoe_science needs a GPU of compute capability 8.0 or newer "
                         "(mma.sync bf16/fp16); this one is ",
                         dev.major, ".", dev.minor));
  check_config_for_device(config, dev, "1, 2 or 3", q_in.size(3), v_in.size(3));
  // The values of cache_seqlens are checked by the kernels (see host_checks_requested).
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q_in.device().index()).stream();
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (seqlens_k.has_value() && capture == cudaStreamCaptureStatusNone && host_checks_requested()) {
    check_seqlens_values(seqlens_k->cpu(), k_in.size(2));
  }
  if (auto empty = empty_result(q_in, k_in.size(2), v_in.size(3))) return with_sinks(*empty, sinks);

  const at::Tensor q = aligned_for_cp_async(q_in), k = aligned_for_cp_async(k_in),
                   v = aligned_for_cp_async(v_in);
  AttentionParams p = make_params(q, k, v, causal, softmax_scale);
  at::Tensor sinks_c;
  set_features_cuda(p, q, causal, window_left, window_right, softcap, sinks, sinks_c);
  if (seqlens_k.has_value()) p.seqlens_k = seqlens_k->data_ptr<int>();
  return run_forward(q, p, config, num_splits, dev, stream, capture != cudaStreamCaptureStatusNone);
}

// ------------------------------------------------------------------------------------------------
// Variable-length (packed) batches and paged KV caches
// ------------------------------------------------------------------------------------------------

// The stream's CUDA graph capture state: values a check would copy to the host (a sync capture
// forbids) are left to the kernels while capturing.
inline bool stream_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  return capture != cudaStreamCaptureStatusNone;
}

inline void check_cuda_device(const at::Tensor& q, const DeviceInfo& dev) {
  TORCH_CHECK(dev.major >= 8,
              error_text("flashmoe_science needs a GPU of compute capability 8.0 or newer "
                         "(mma.sync bf16/fp16); this one is ",
                         dev.major, ".", dev.minor));
}

// aligned_for_cp_async for tensors of any rank: every stride but the last's.
inline at::Tensor rows_aligned_for_cp_async(const at::Tensor& t) {
  bool ok = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int64_t d = 0; d + 1 < t.dim(); ++d)
    ok = ok && t.stride(d) % 8 == 0;
  if (ok) return t;
  return at::empty(t.sizes(), t.options().memory_format(at::MemoryFormat::Contiguous)).copy_(t);
}

// The forward kernel over a packed batch: one grid of B x Hq x (row blocks of the longest
// sequence); blocks past their sequence's end return at once (FA2's scheme). One split: the
// grid is sized by the batch's heads and rows, which a ragged batch of any size fills.
inline std::tuple<at::Tensor, at::Tensor> varlen_fwd_cuda(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, bool causal, double softmax_scale, int64_t config, int64_t window_left,
    int64_t window_right, double softcap, const std::optional<at::Tensor>& sinks) {
  check_varlen_inputs(q_in, k_in, v_in, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  FLASHMOE_CHECK_VALUE(q_in.is_cuda(), "q is on ", q_in.device(),
                       "; this is the CUDA implementation");
  check_head_dims_cuda(q_in.size(2), v_in.size(2));
  causal = check_features_forward(q_in, causal, window_left, window_right, softcap, sinks);
  FLASHMOE_CHECK_VALUE(config >= 0 && config <= kNumConfigs && has_packed_variant(config),
                       "config must be 0 (automatic), 1, 2, 4 or 5 for a packed batch, got ",
                       config);
  c10::cuda::CUDAGuard guard(q_in.device());
  const DeviceInfo dev = device_info(q_in.device().index());
  check_cuda_device(q_in, dev);
  check_config_for_device(config, dev, "1 or 2", q_in.size(2), v_in.size(2));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q_in.device().index()).stream();
  const bool capturing = stream_capturing(stream);
  if (!capturing && host_checks_requested()) {
    check_varlen_values(q_in, k_in, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  }
  const int64_t batch = cu_seqlens_q.size(0) - 1;
  if (batch == 0 || q_in.size(0) == 0 || q_in.size(1) == 0 || max_seqlen_q == 0 ||
      k_in.size(0) == 0) {
    auto empty = empty_varlen_result(q_in, v_in.size(2));
    // no key at all: each row's log-sum-exp ([Hq, total_q]) is its sink's logit alone
    if (sinks.has_value() && std::get<1>(empty).numel() > 0) {
      std::get<1>(empty).copy_(sinks->view({-1, 1}));
    }
    return empty;
  }
  const at::Tensor q = rows_aligned_for_cp_async(q_in), k = rows_aligned_for_cp_async(k_in),
                   v = rows_aligned_for_cp_async(v_in);
  const at::Tensor cu_q = cu_seqlens_q.contiguous(), cu_k = cu_seqlens_k.contiguous();
  // [1, H, total, D] views: make_params reads heads and strides from them; the batch and the
  // lengths come from cu_seqlens.
  AttentionParams p = make_params(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                  v.transpose(0, 1).unsqueeze(0), causal, softmax_scale);
  at::Tensor sinks_c;
  set_features_cuda(p, q, causal, window_left, window_right, softcap, sinks, sinks_c);
  p.q_batch_stride = p.k_batch_stride = p.v_batch_stride = 0;
  p.batch = int(batch);
  p.seqlen_q = int(max_seqlen_q);
  p.seqlen_k = int(max_seqlen_k);
  p.cu_seqlens_q = cu_q.data_ptr<int>();
  p.cu_seqlens_k = cu_k.data_ptr<int>();
  p.total_q = int(q.size(0));
  p.total_k = int(k.size(0));
  p.pack_gqa = false;
  const int64_t grid_x = batch * p.heads_q;
  const int tile_d = tile_head_dim(p);
  if (config == 0) {
    const bool wgmma_ok = wgmma_chosen(p.head_dim, p.head_dim_v);
    config = packed_variant_of(
        choose_config(dev, tile_d, wgmma_ok, grid_x, p.seqlen_q, causal, p.seqlen_k));
  }
  const TileShape tile =
      tile_shape_of(int(config), tile_d, is_sm90a_config(config) ? sm90_tile(p) : Sm90Tile::kWhole);
  const int m_blocks = ceil_div(p.seqlen_q, tile.block_m);
  p.row_blocks_fastest = !(causal && m_blocks >= 32);
  FLASHMOE_CHECK_VALUE(grid_x * m_blocks < (int64_t(1) << 31), "batch ", batch, " x heads ",
                       p.heads_q, " x row blocks of max_seqlen_q ", max_seqlen_q,
                       " exceeds the launch grid (must be below 2^31)");
  p.num_splits = 1;
  p.n_blocks_per_split = std::max(1, ceil_div(p.seqlen_k, tile.block_n));

  // Contiguous: with offsets that do not partition the batch, the kernel's blocks fill all of out
  // and lse with NaN, which takes them to be dense.
  auto out = at::empty({q.size(0), q.size(1), v.size(2)},
                       q.options().memory_format(at::MemoryFormat::Contiguous));
  auto lse = at::empty({q.size(1), q.size(0)}, q.options().dtype(at::kFloat));
  p.o = out.data_ptr();
  p.o_batch_stride = 0, p.o_head_stride = out.stride(1), p.o_row_stride = out.stride(0);
  p.lse = lse.data_ptr<float>();
  if (q.scalar_type() == at::kHalf) {
    launch_attention<__half>(p, int(config), int(grid_x), m_blocks, stream);
  } else {
    launch_attention<__nv_bfloat16>(p, int(config), int(grid_x), m_blocks, stream);
  }
  visit_varlen_check(q.scalar_type(), tile_d, [&](auto kernel) {
    kernel<<<1, 256, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {out, lse};
}

// Decode against a paged cache: the decode kernel (configuration 3) with the block-table lookup.
inline std::tuple<at::Tensor, at::Tensor> paged_fwd_cuda(
    const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& block_table, const std::optional<at::Tensor>& seqlens_k, bool causal,
    double softmax_scale, int64_t num_splits, int64_t window_left, int64_t window_right,
    double softcap, const std::optional<at::Tensor>& sinks) {
  check_paged_inputs(q_in, k_cache, v_cache, block_table, seqlens_k, num_splits);
  FLASHMOE_CHECK_VALUE(q_in.is_cuda(), "q is on ", q_in.device(),
                       "; this is the CUDA implementation");
  check_head_dims_cuda(q_in.size(3), v_cache.size(3));
  causal = check_features_forward(q_in, causal, window_left, window_right, softcap, sinks);
  c10::cuda::CUDAGuard guard(q_in.device());
  const DeviceInfo dev = device_info(q_in.device().index());
  check_cuda_device(q_in, dev);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q_in.device().index()).stream();
  const bool capturing = stream_capturing(stream);
  const int64_t page_size = k_cache.size(1), capacity = block_table.size(1) * page_size;
  std::optional<at::Tensor> lens;
  if (seqlens_k.has_value()) lens = seqlens_k->contiguous();
  if (!capturing && host_checks_requested()) {
    std::optional<at::Tensor> lens_cpu;
    if (lens) lens_cpu = lens->cpu();
    if (lens_cpu) check_seqlens_values(*lens_cpu, capacity);
    check_block_table_values(block_table.cpu().contiguous(), lens_cpu, page_size, k_cache.size(0));
  }
  if (auto empty = empty_result(q_in, capacity, v_cache.size(3))) return with_sinks(*empty, sinks);

  const at::Tensor q = aligned_for_cp_async(q_in), k = aligned_for_cp_async(k_cache),
                   v = aligned_for_cp_async(v_cache);
  const at::Tensor table = block_table.stride(1) == 1 ? block_table : block_table.contiguous();
  // The batch stride is the page stride; the heads are dimension 2, a page's rows dimension 1.
  AttentionParams p = make_params(q, k, v, causal, softmax_scale, KvDims{2, 1});
  at::Tensor sinks_c;
  set_features_cuda(p, q, causal, window_left, window_right, softcap, sinks, sinks_c);
  p.seqlen_k = int(capacity);
  if (lens) p.seqlens_k = lens->data_ptr<int>();
  p.block_table = table.data_ptr<int>();
  p.block_table_stride = table.stride(0);
  p.page_shift = 0;
  while ((int64_t(1) << p.page_shift) < page_size)
    ++p.page_shift;
  p.num_pages = int(k.size(0));
  return run_forward(q, p, kDecodeConfig, num_splits, dev, stream, capturing);
}

// ------------------------------------------------------------------------------------------------
// Backward
// ------------------------------------------------------------------------------------------------

// Backward tile configurations (`backward_config=`):
//   1: 64 keys x 64 queries a step, 4 warps; 72.5 KB of shared memory at d=128, so it fits the
//      99 KB a block may have on sm86/sm89 (the L4) as well as sm80 and sm90. At d=192, 32 keys
//      (80.5 KB) and at d=256 16 keys (84.5 KB), the warps of each 16 keys splitting dK's and
//      dV's columns in two and four (BwdTraits::kColSplit), so that it still fits there.
//   2: 128 keys x 64 queries a step, 8 warps (each still owns 16 keys of dK and dV; twice the
//      warps per SM to hide latency); 112.5 KB at d=128: sm80 and sm90 (73.5 KB at d=64: all).
//      At d=192 and 256, 64 keys, two warps a 16 keys splitting the columns (FA2's 64 x 64 tile
//      with 8 warps): 112.5 and 144.5 KB, sm80 and sm90.
//   3: 128 keys x 128 queries (d=64) or 64 queries (d=128) a step on wgmma, 2 warpgroups
//      (flash_bwd_sm90_kernel.cuh): sm_90a only, like the forward's configurations 5 to 7; at
//      192, 256 and v's 128 under 192, 64 keys x 64 queries with dK and dV transposed
//      (Sm90BwdWideTraits).
// The automatic choice takes 3 on a 9.0 GPU with the sm_90a build at the head dims it takes
// (faster than 2 there: benches/notes/backward.md, bwd v4 and v5), else 2 where it fits the card's
// shared memory, else 1. The deterministic dQ pass runs 64 x 64 tiles with 4 warps (64 x 32 at
// d=256, within 99 KB).
constexpr int kSm90aBwdConfig = 3;
template <int D>
using BwdDqConfig = BwdDqTraits<D, 64, D >= 256 ? 32 : 64, 4>;
constexpr int bwd1_keys(int head_dim) { return head_dim <= 128 ? 64 : head_dim <= 192 ? 32 : 16; }
template <int D>
using Bwd1Traits = BwdTraits<D, 64, bwd1_keys(D), 4>;
template <int D>
using Bwd2Traits = BwdTraits<D, 64, D <= 128 ? 128 : 64, 8>;

#if FLASHMOE_BWD_WS
// FLASHMOE_BWD_WS=0 in the environment: the wgmma backward's 128 tile without its warp
// specialization (Sm90BwdTraits, the tile before bwd v6), for the gates that keep it correct
// and for timing one against the other on one build.
inline bool bwd_ws_allowed() {
  static const bool allowed = [] {
    const char* env = std::getenv("FLASHMOE_BWD_WS");
    return env == nullptr || std::strcmp(env, "0") != 0;
  }();
  return allowed;
}
#if FLASHMOE_BWD_CAUSAL_LPT
// FLASHMOE_BWD_LPT_PAIRS=N in the environment: the causal 1-D grid's sections of N (batch, KV
// head) pairs, whatever the L2 budget says (the gates make sections end short of a call's pairs
// with it); unset: 0, the budget's. Read at every call, so that a test can set it.
inline int64_t bwd_lpt_pairs_override() {
  const char* env = std::getenv("FLASHMOE_BWD_LPT_PAIRS");
  if (env == nullptr || *env == '\0') return 0;
  char* end = nullptr;
  const long long value = std::strtoll(env, &end, 10);
  FLASHMOE_CHECK_VALUE(*end == '\0' && value >= 1 && value <= (1 << 20),
                       "FLASHMOE_BWD_LPT_PAIRS is '", env,
                       "'; supported: a whole number of pairs from 1 to 1048576, or unset");
  return value;
}
#endif
#endif

// `padded`: the call's head dims are narrower than the tile D (configuration 3 then runs
// Sm90BwdPaddedTraits at 128, and Sm90BwdWideTraits<192, 128> at 192, v's 128 being the one it
// takes there; the mma.sync kernels take any head dims the tile holds). `ws`: configuration 3's
// 128 tile warp-specialized (Sm90BwdWsTraits, with -DFLASHMOE_BWD_WS=1: whole head dims 64 and
// 128 and padded onto 128, the host's maps encoded: BwdParams::ws; deterministic calls too, their
// dQ added in order by its writer warp rather than by the dQ pass).
template <typename T, int D, bool kAtomicDq, typename F>
void visit_bwd_config(int config, F&& f, bool padded = false, [[maybe_unused]] bool ws = false,
                      [[maybe_unused]] bool mma96 = false) {
  if (config == 1) {
    using Traits = Bwd1Traits<D>;
    FLASHMOE_VISIT(only::bwd, T, D, 1, f, Traits, &flash_bwd_dkdv_kernel<Traits, T, kAtomicDq>);
  } else if (config == kSm90aBwdConfig) {
    if constexpr (D == 128) {
#if FLASHMOE_BWD_WS
#if FLASHMOE_BWD_WS_MMA96
      if (padded && ws && mma96) {  // the head dims all at most 96: products over 96 columns
        using Traits = Sm90BwdPadded96Traits<Sm90BwdWsTraits<D>>;
        FLASHMOE_VISIT(only::bwd_sm90a, T, D, kSm90aBwdConfig, f, Traits,
                       &flash_bwd_sm90_kernel<Traits, T, kAtomicDq>);
        return;
      }
#endif
      if (padded && ws) {
        using Traits = Sm90BwdPaddedTraits<Sm90BwdWsTraits<D>>;
        FLASHMOE_VISIT(only::bwd_sm90a, T, D, kSm90aBwdConfig, f, Traits,
                       &flash_bwd_sm90_kernel<Traits, T, kAtomicDq>);
        return;
      }
#endif
      if (padded) {
        using Traits = Sm90BwdPaddedTraits<Sm90BwdTraits<D>>;
        FLASHMOE_VISIT(only::bwd_sm90a, T, D, kSm90aBwdConfig, f, Traits,
                       &flash_bwd_sm90_kernel<Traits, T, kAtomicDq>);
        return;
      }
    }
    if constexpr (D == 192) {
      if (padded) {  // v's 128 (the host takes no other head dims onto this tile)
        using Traits = Sm90BwdWideTraits<D, 128>;
        FLASHMOE_VISIT(only::bwd_sm90a, T, D, kSm90aBwdConfig, f, Traits,
                       &flash_bwd_sm90_wide_kernel<Traits, T, kAtomicDq>);
        return;
      }
    }
    if constexpr (D == 192 || D == 256) {
      using Traits = Sm90BwdWideTraits<D, D>;
      FLASHMOE_VISIT(only::bwd_sm90a, T, D, kSm90aBwdConfig, f, Traits,
                     &flash_bwd_sm90_wide_kernel<Traits, T, kAtomicDq>);
    } else if constexpr (is_wgmma_bwd_head_dim(D)) {
#if FLASHMOE_BWD_WS
      if (ws && !padded) {
        using Traits = Sm90BwdWsTraits<D>;
        FLASHMOE_VISIT(only::bwd_sm90a, T, D, kSm90aBwdConfig, f, Traits,
                       &flash_bwd_sm90_kernel<Traits, T, kAtomicDq>);
        return;
      }
#endif
      using Traits = Sm90BwdTraits<D>;
      FLASHMOE_VISIT(only::bwd_sm90a, T, D, kSm90aBwdConfig, f, Traits,
                     &flash_bwd_sm90_kernel<Traits, T, kAtomicDq>);
    } else {
      // The host refuses it first (check_wgmma_config); no wgmma kernel is compiled for D.
      TORCH_CHECK(false, "flashmoe_science: no backward_config=", config, " kernel for head_dim ",
                  D);
    }
  } else {
    using Traits = Bwd2Traits<D>;
    FLASHMOE_VISIT(only::bwd, T, D, 2, f, Traits, &flash_bwd_dkdv_kernel<Traits, T, kAtomicDq>);
  }
}

// The shared memory of a backward configuration's dK/dV kernel at `head_dim`, and with
// `deterministic` the dQ pass's if it is more.
inline int bwd_smem_bytes(int config, int head_dim, bool deterministic = false) {
  int bytes = 0;
  auto get = FLASHMOE_TRAITS_ONLY([&](auto, auto traits) { bytes = decltype(traits)::kSmemBytes; });
  with_head_dim(head_dim, [&](auto d) {
    constexpr int D = decltype(d)::value;
    visit_bwd_config<__half, D, true>(config, get);
    if (deterministic) bytes = std::max(bytes, BwdDqConfig<D>::kSmemBytes);
  });
  return bytes;
}

#if FLASHMOE_BWD_WS && FLASHMOE_BWD_CAUSAL_LPT
// Whether a backward traits type has kWs (the sm_90a tiles); the sm_80 tiles do not (C++17).
template <typename Traits, typename = void>
struct HasWsFlag : std::false_type {};
template <typename Traits>
struct HasWsFlag<Traits, std::void_t<decltype(Traits::kWs)>> : std::true_type {};
#endif

template <typename T, int D>
void launch_backward(const BwdParams& p, int config, bool deterministic, cudaStream_t stream) {
  const int64_t rows = int64_t(p.batch) * p.heads_q * p.seqlen_q;
  flash_bwd_preprocess_kernel<T, D>
      <<<int((rows + 3) / 4), 128, 0, stream>>>(p, p.dq_accum != nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  auto launch_dkdv = [&](auto kernel, auto traits) {
    using Traits = decltype(traits);
    allow_dynamic_smem(kernel, Traits::kSmemBytes);
    dim3 grid(ceil_div(p.seqlen_k, Traits::kBlockN), p.batch * p.heads_kv);
#if FLASHMOE_BWD_WS && FLASHMOE_BWD_CAUSAL_LPT
    if constexpr (HasWsFlag<Traits>::value) {
      // (the kernel remaps only where its dQ is not ordered: never deterministic)
      if (Traits::kWs && !deterministic && p.lpt_pairs > 0) grid = dim3(grid.x * grid.y);
    }
#endif
#if FLASHMOE_BWD_WIDE_LPT_ON
    if constexpr (IsSm90BwdWide<Traits>::value) {
      if (!deterministic && p.lpt_pairs > 0) grid = dim3(grid.x * grid.y);
    }
#endif
    kernel<<<grid, Traits::kNThreads, Traits::kSmemBytes, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  const bool padded = p.head_dim != D || p.head_dim_v != D;
#if FLASHMOE_BWD_WS
  const bool ws = p.ws;
#else
  constexpr bool ws = false;
#endif
  // (FLASHMOE_BWD_WS_MMA96: the padded tile's products over 96 columns where they hold the call)
  const bool mma96 = p.head_dim <= 96 && p.head_dim_v <= 96;
  if (deterministic && !ws) {
    visit_bwd_config<T, D, false>(config, launch_dkdv, padded);
    using DqTraits = BwdDqConfig<D>;
    auto kernel = &flash_bwd_dq_kernel<DqTraits, T>;
    allow_dynamic_smem(kernel, DqTraits::kSmemBytes);
    const dim3 grid(ceil_div(p.seqlen_q, DqTraits::kBlockM), p.batch * p.heads_q);
    kernel<<<grid, DqTraits::kNThreads, DqTraits::kSmemBytes, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  } else {
    if (deterministic) {
      // dQ in order (dq_order)
      visit_bwd_config<T, D, false>(config, launch_dkdv, padded, ws, mma96);
    } else {
      visit_bwd_config<T, D, true>(config, launch_dkdv, padded, ws, mma96);
    }
    const int64_t n = rows * D;  // dq_accum is the tile's D wide
    flash_bwd_convert_dq_kernel<T>
        <<<int(ceil_div(int(std::min<int64_t>(n / 4, 1 << 30)), 256)), 256, 0, stream>>>(p, n, D);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// Gradients come back contiguous, in the inputs' dtype, and an empty dsinks (no sinks on CUDA
// yet). grad_output may have any strides (an expanded tensor from .sum(), say): it is made
// contiguous in its last dimension first.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_cuda(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in,
    const at::Tensor& v_in, const at::Tensor& out_in, const at::Tensor& lse_in, bool causal,
    double softmax_scale, bool deterministic, int64_t config, int64_t window_left,
    int64_t window_right, double softcap, const std::optional<at::Tensor>& sinks) {
  check_backward_inputs(dout_in, q_in, k_in, v_in, out_in, lse_in);
  FLASHMOE_CHECK_VALUE(q_in.is_cuda(), "q is on ", q_in.device(),
                       "; this is the CUDA implementation");
  check_head_dims_cuda(q_in.size(3), v_in.size(3));
  causal = check_features_forward(q_in, causal, window_left, window_right, softcap, sinks);
  at::Tensor dsinks = zero_dsinks(q_in, sinks);
  FLASHMOE_CHECK_VALUE(config >= 0 && config <= kNumBwdConfigs, "backward_config must be in [0, ",
                       kNumBwdConfigs, "] (0 = automatic), got ", config);
  c10::cuda::CUDAGuard guard(q_in.device());
  const DeviceInfo dev = device_info(q_in.device().index());
  TORCH_CHECK(dev.major >= 8,
              error_text("flashmoe_science needs a GPU of compute capability 8.0 or newer "
                         "(mma.sync bf16/fp16); this one is ",
                         dev.major, ".", dev.minor));
  // The tile's head dim: q's and k's, or padded onto the next built one (cuda_tile_head_dim).
  const int head_dim = int(cuda_tile_head_dim(q_in.size(3), v_in.size(3)));
  const bool wgmma_ok = wgmma_bwd_head_dims(q_in.size(3), v_in.size(3));
  if (config == kSm90aBwdConfig) {
    check_wgmma_config("backward_config", config, dev, "1 or 2", wgmma_ok, kWgmmaBwdHeadDimsText,
                       q_in.size(3), v_in.size(3));
  }
  const int smem_limit = dev.smem_per_block;
  if (config == 0) {
    config = dev.major == 9 && dev.minor == 0 && kBuiltSm90a && wgmma_ok ? kSm90aBwdConfig
             : bwd_smem_bytes(2, head_dim, deterministic) <= smem_limit  ? 2
                                                                         : 1;
  }
  FLASHMOE_CHECK_VALUE(bwd_smem_bytes(int(config), head_dim, deterministic) <= smem_limit,
                       "backward_config=", config, " needs ",
                       bwd_smem_bytes(int(config), head_dim, deterministic),
                       " bytes of shared memory per block at head_dim ", head_dim,
                       "; this GPU allows ", smem_limit, ": use backward_config=1 (or 0)");
  if (auto empty = empty_gradients(q_in, k_in, v_in)) {
    auto [dq, dk, dv] = *empty;
    return {dq, dk, dv, dsinks};
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q_in.device().index()).stream();
  const at::Tensor dout_c = dout_in.stride(3) == 1 ? dout_in : dout_in.contiguous();
  const at::Tensor q = aligned_for_cp_async(q_in), k = aligned_for_cp_async(k_in),
                   v = aligned_for_cp_async(v_in), out = aligned_for_cp_async(out_in),
                   dout = aligned_for_cp_async(dout_c);
  BwdParams p = make_bwd_params(dout, q, k, v, out, lse_in, causal, softmax_scale);
  auto f32 = q.options().dtype(at::kFloat);
  // The window, softcap and sinks; each row's term of the sinks' gradient, summed below.
  at::Tensor sinks_c, dsinks_rows;
  if (sinks.has_value()) {
    sinks_c = sinks->contiguous();
    dsinks_rows = at::zeros({q.size(0), q.size(1), q.size(2)}, f32);
  }
  set_features(p, resolve_window(causal, window_left, window_right), softcap,
               sinks.has_value() ? &sinks_c : nullptr);
  p.dsinks = sinks.has_value() ? dsinks_rows.data_ptr<float>() : nullptr;
  if (softcap > 0) {  // P from t = tanh(s * scale / softcap) (apply_softcap); dS gains 1 - t^2
    p.softcap_scale = float(softmax_scale / softcap);
    p.scale_log2 = float(softcap * M_LOG2E);
  }
  // delta and the base-2 lse, both written by the pre-pass, in one allocation
  auto row_stats = at::empty({2, q.size(0), q.size(1), q.size(2)}, f32);
  auto dq = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  auto dk = at::empty(k.sizes(), k.options().memory_format(at::MemoryFormat::Contiguous));
  auto dv = at::empty(v.sizes(), v.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor dq_accum;  // the tile's head dim wide (a padded head dim's columns are the kernels')
#if FLASHMOE_BWD_WS
  // The warp-specialized 128 tile (Sm90BwdWsTraits) where its maps encode: head dims 64 and 128,
  // and those padded onto 128 (maps of q's and dout's own widths, a box a panel); deterministic
  // calls too (dQ added in order: dq_order). Elsewhere Sm90BwdTraits runs.
  const bool ws_smem_ok = head_dim == 64 ? Sm90BwdWsTraits<64>::kSmemBytes <= smem_limit
                                         : Sm90BwdWsTraits<128>::kSmemBytes <= smem_limit;
  const bool ws_padded = q.size(3) != head_dim || v.size(3) != head_dim;
  const bool ws_tile = config == kSm90aBwdConfig && (head_dim == 128 || !ws_padded) &&
                       (head_dim == 64 || head_dim == 128) && ws_smem_ok && bwd_ws_allowed();
#else
  constexpr bool ws_tile = false;
#endif
  if (!deterministic || ws_tile) {
    dq_accum = at::empty({q.size(0), q.size(1), q.size(2), head_dim}, f32);
  }
#if FLASHMOE_BWD_DQ_MAP
  // the wgmma backward's dQ by TMA reduce-add: the wide kernel's (past 128), and the 128 tile's
  // under -DFLASHMOE_BWD_DQ_TMA=1
  const bool dq_by_tma = head_dim > 128 ? FLASHMOE_BWD_WIDE_DQ_TMA : FLASHMOE_BWD_DQ_TMA;
  if (!deterministic && config == kSm90aBwdConfig && dq_by_tma &&
      !encode_dq_map(p.dq_map, dq_accum.data_ptr<float>(), q.size(2), q.size(0) * q.size(1),
                     head_dim)) {
    deterministic = true;  // no map: dQ by the deterministic pass, which needs none
  }
#endif
#if FLASHMOE_BWD_WS
  p.ws = false;
  p.dq_order = nullptr;
  at::Tensor dq_order;
  // q's and dout's maps (p.tma_q, p.tma_do) of `q_cols` and `dout_cols` columns in boxes of
  // `box_rows` rows: the warp-specialized tile's, or the wide kernel's (FLASHMOE_BWD_WIDE_TMA)
  auto encode_q_dout_maps = [&](int q_cols, int dout_cols, int box_rows, bool by_panel) {
    const bool fp16 = q.scalar_type() == at::kHalf;
    return encode_kv_map(p.tma_q, q.data_ptr(), fp16, q.size(2), q.size(1), q.size(0),
                         p.q_row_stride, p.q_head_stride, p.q_batch_stride, q_cols, box_rows,
                         by_panel) &&
           encode_kv_map(p.tma_do, dout.data_ptr(), fp16, q.size(2), q.size(1), q.size(0),
                         p.do_row_stride, p.do_head_stride, p.do_batch_stride, dout_cols, box_rows,
                         by_panel);
  };
#if FLASHMOE_BWD_WIDE_QDO_TMA
  // the wide kernel's Q and dO by TMA where the driver encodes their maps (else cp.async)
  p.wide_tma = config == kSm90aBwdConfig && head_dim > 128 && q.size(3) == head_dim &&
               v.size(3) % 64 == 0 && encode_q_dout_maps(head_dim, int(v.size(3)), 64, false);
#endif
  if (ws_tile) {
    // the tile's query rows a step: the boxes of q and dout, and a counter's rows
    const int box_rows = head_dim == 64 ? Sm90BwdTraits<64>::kBlockM : Sm90BwdTraits<128>::kBlockM;
    p.ws = encode_q_dout_maps(ws_padded ? int(q.size(3)) : head_dim,
                              ws_padded ? int(v.size(3)) : head_dim, box_rows, ws_padded) &&
           encode_dq_map(p.dq_map, dq_accum.data_ptr<float>(), q.size(2), q.size(0) * q.size(1),
                         head_dim);
    if (p.ws && deterministic) {  // a counter a query block of the tile's rows
      // zeroed by the pre-pass (a kernel of ours, so that compute-sanitizer's initcheck sees it)
      dq_order = at::empty({q.size(0) * q.size(1) * ((q.size(2) + box_rows - 1) / box_rows)},
                           q.options().dtype(at::kInt));
      p.dq_order = dq_order.data_ptr<int>();
      p.dq_order_rows = box_rows;
    }
  }
#if FLASHMOE_BWD_DET_ROTATE
  p.dq_rotate = p.dq_order != nullptr && p.window_left < 0 && p.window_right < 0 &&
                ceil_div(p.seqlen_k, Sm90BwdTraits<128>::kBlockN) <= dev.sm_count;
#endif
#if FLASHMOE_BWD_CAUSAL_LPT
  // causal (no left edge) and not deterministic (its writer waits on the key blocks after its
  // own, which this order starts later): the longest key blocks first, in sections of the pairs
  // whose q, dout and dq_accum fit in 40 MB of L2 (a power of 2, at least 1), or of
  // FLASHMOE_BWD_LPT_PAIRS; never more than the call's pairs (so that sections x key blocks
  // stays within the grid). Unforced, only past head dim 64 and from 2,048 keys: at 64 it gained
  // nothing, and 512 keys ran 10-12% slower than the 2-D grid (backward.md, bwd v7b measured).
  p.lpt_pairs = 0;
#if FLASHMOE_BWD_WIDE_LPT_ON
  const bool lpt_kernel = p.ws || (config == kSm90aBwdConfig && head_dim > 128);  // or the wide
#else
  const bool lpt_kernel = p.ws;
#endif
  if (lpt_kernel && !deterministic && p.window_right == 0 && p.window_left < 0) {
    int64_t pairs = bwd_lpt_pairs_override();
    if (pairs == 0 && head_dim > 64 && p.seqlen_k >= 2048) {
      const int64_t pair_bytes = int64_t(p.heads_ratio) * q.size(2) *
                                 (q.size(3) * 2 + v.size(3) * 2 + int64_t(head_dim) * 4);
      const int64_t fit =
          std::max<int64_t>(1, (int64_t(40) << 20) / std::max<int64_t>(1, pair_bytes));
      pairs = 1;
      while (pairs * 2 <= fit)
        pairs *= 2;
    }
    if (pairs > 0) p.lpt_pairs = int(std::min<int64_t>(pairs, int64_t(p.batch) * p.heads_kv));
  }
#endif
#endif
  p.delta = row_stats.data_ptr<float>();
  p.lse2 = p.delta + q.size(0) * q.size(1) * q.size(2);
#if FLASHMOE_BWD_WS
  const bool dq_by_writer = p.ws;  // deterministic calls too: in order
#else
  constexpr bool dq_by_writer = false;
#endif
  p.dq_accum = !deterministic || dq_by_writer ? dq_accum.data_ptr<float>() : nullptr;
  p.dq = dq.data_ptr(), p.dk = dk.data_ptr(), p.dv = dv.data_ptr();
  // (the pre-pass, the dQ pass and the dQ conversion serve both backward families)
  with_dtype(q.scalar_type(), [&](auto dt) {
    using T = typename decltype(dt)::type;
    with_head_dim(head_dim, [&](auto d) {
      constexpr int D = decltype(d)::value;
      FLASHMOE_KERNEL(only::bwd | only::bwd_sm90a, T, D, 0,
                      launch_backward<T, D>(p, int(config), deterministic, stream));
    });
  });
  if (sinks.has_value()) dsinks = dsinks_rows.sum(at::IntArrayRef{0, 2});
  return {dq, dk, dv, dsinks};
}

inline std::tuple<at::Tensor, at::Tensor> attention_cuda(const at::Tensor& q, const at::Tensor& k,
                                                         const at::Tensor& v, bool causal,
                                                         double softmax_scale, int64_t num_splits,
                                                         int64_t config, bool /*deterministic*/,
                                                         int64_t bwd_config, int64_t window_left,
                                                         int64_t window_right, double softcap,
                                                         const std::optional<at::Tensor>& sinks) {
  check_backward_options(bwd_config);
  return attention_fwd_cuda(q, k, v, std::nullopt, causal, softmax_scale, num_splits, config,
                            window_left, window_right, softcap, sinks);
}

// The dynamic shared memory each kernel asks for at launch, which ptxas's resource report cannot
// see: one "<kernel as c++filt names it>\t<bytes>" line per instantiation, for the build report
// (flashmoe_science/pipeline/build/unit.py). It walks the configurations through visit_kernel and
// reads the same Traits::kSmemBytes as launch_attention, so the figures are the launches' own.
template <typename Type>
std::string demangled_name() {
  int status = 0;
  char* name = abi::__cxa_demangle(typeid(Type).name(), nullptr, nullptr, &status);
  std::string result = (status == 0 && name != nullptr) ? name : typeid(Type).name();
  std::free(name);
  return result;
}

template <typename Traits>
struct IsSm90BwdTraits : std::false_type {};
template <int D>
struct IsSm90BwdTraits<Sm90BwdTraits<D>> : std::true_type {};
template <typename Tiles>
struct IsSm90BwdTraits<Sm90BwdPaddedTraits<Tiles>> : std::true_type {};
template <typename Tiles>
struct IsSm90BwdTraits<Sm90BwdPadded96Traits<Tiles>> : std::true_type {};
template <int D>
struct IsSm90BwdTraits<Sm90BwdWsTraits<D>> : std::true_type {};
template <typename Traits>
struct IsSm90BwdWideTraits : std::false_type {};
template <int D, int DV>
struct IsSm90BwdWideTraits<Sm90BwdWideTraits<D, DV>> : std::true_type {};

template <typename Traits>
struct IsDecodeTraits : std::false_type {};
template <int D, int kStages>
struct IsDecodeTraits<DecodeTraits<D, kStages>> : std::true_type {};

// The kernel's name in the build report: the forward, decode or sm_90a forward kernel.
template <typename Traits>
const char* forward_kernel_name(bool varlen) {
  if constexpr (IsDecodeTraits<Traits>::value) {
    return "flashmoe::cuda::flash_decode_kernel";
  } else if constexpr (IsSm90Traits<Traits>::value) {
    return varlen ? "flashmoe::cuda::flash_fwd_sm90_varlen_kernel"
                  : "flashmoe::cuda::flash_fwd_sm90_kernel";
  } else {
    return varlen ? "flashmoe::cuda::flash_fwd_varlen_kernel" : "flashmoe::cuda::flash_fwd_kernel";
  }
}

// One line per kernel a forward configuration launches: the sm_90a kernels take the windows,
// softcap and sinks as a template argument (fwd_sm90_kernel), so each is two kernels.
template <typename Traits>
void append_forward_launch(std::string& out, const std::string& dtype, bool varlen) {
  const std::string head = std::string(forward_kernel_name<Traits>(varlen)) + "<" +
                           demangled_name<Traits>() + ", " + dtype;
  const std::string smem = ">\t" + std::to_string(Traits::kSmemBytes) + "\n";
  if constexpr (IsSm90Traits<Traits>::value) {
    out += head + ", false" + smem + head + ", true" + smem;
  } else {
    out += head + smem;
  }
}

template <typename T, int D>
void append_kernel_launches(std::string& out) {
  const std::string dtype = demangled_name<T>();
  for (int config = 1; config <= kNumConfigs; ++config) {
    if (is_sm90a_config(config) && !is_wgmma_head_dim(D)) continue;
    visit_config<T, D>(config, FLASHMOE_TRAITS_ONLY([&](auto, auto traits) {
                         append_forward_launch<decltype(traits)>(out, dtype, false);
                       }));
  }
  // The packed-batch forward (configurations 1, 2, 4, 5) and the paged decode kernel.
  for (int config : {1, 2, kSm90Config, kSm90aConfig}) {
    if (is_sm90a_config(config) && !is_wgmma_head_dim(D)) continue;
    visit_config<T, D, /*kVarlen=*/true>(config, FLASHMOE_TRAITS_ONLY([&](auto, auto traits) {
                                           append_forward_launch<decltype(traits)>(out, dtype,
                                                                                   true);
                                         }));
  }
  // The wgmma forward's tiles of their own, dense and packed: v's 128 under q's and k's 192 (5 to 7
  // one kernel), and configuration 5's 128 tile run padded.
  auto append_tile = [&](Sm90Tile tile) {
    for (const bool varlen : {false, true}) {
      auto append = FLASHMOE_TRAITS_ONLY(
          [&](auto, auto traits) { append_forward_launch<decltype(traits)>(out, dtype, varlen); });
      if (varlen) {
        visit_config<T, D, true>(kSm90aConfig, append, false, tile);
      } else {
        visit_config<T, D>(kSm90aConfig, append, false, tile);
      }
    }
  };
  if constexpr (D == 192) append_tile(Sm90Tile::kNarrowV);
  if constexpr (D == 128) append_tile(Sm90Tile::kPadded);
  if constexpr (D == 128) append_tile(Sm90Tile::kPadded96);  // its MMAs over 96 columns
  visit_paged_decode<T>(D, FLASHMOE_TRAITS_ONLY([&](auto, auto traits) {
                          using Traits = decltype(traits);
                          out += "flashmoe::cuda::flash_decode_paged_kernel<" +
                                 demangled_name<Traits>() + ", " + dtype + ">\t" +
                                 std::to_string(Traits::kSmemBytes) + "\n";
                        }));
  // launch_combine and the packed batch's offset check pass no dynamic shared memory
  out += "flashmoe::cuda::split_kv_combine_kernel<" + dtype + ", " + std::to_string(D) + ">\t0\n";
  out +=
      "flashmoe::cuda::varlen_offsets_check_kernel<" + dtype + ", " + std::to_string(D) + ">\t0\n";
  // The backward: the dK/dV kernel of each configuration with and without dQ atomics, the
  // deterministic dQ pass; the pre-pass and the dQ conversion take none.
  auto dkdv = [&](auto kernel_traits, const char* atomic) {
    using Traits = decltype(kernel_traits);
    const char* name = IsSm90BwdWideTraits<Traits>::value
                           ? "flashmoe::cuda::flash_bwd_sm90_wide_kernel<"
                       : IsSm90BwdTraits<Traits>::value ? "flashmoe::cuda::flash_bwd_sm90_kernel<"
                                                        : "flashmoe::cuda::flash_bwd_dkdv_kernel<";
    out += name + demangled_name<Traits>() + ", " + dtype + ", " + atomic + ">\t" +
           std::to_string(Traits::kSmemBytes) + "\n";
  };
  for (int config = 1; config <= kNumBwdConfigs; ++config) {
    if (config == kSm90aBwdConfig && !is_wgmma_bwd_head_dim(D)) continue;
    visit_bwd_config<T, D, true>(
        config, FLASHMOE_TRAITS_ONLY([&](auto, auto traits) { dkdv(traits, "true"); }));
    visit_bwd_config<T, D, false>(
        config, FLASHMOE_TRAITS_ONLY([&](auto, auto traits) { dkdv(traits, "false"); }));
#if FLASHMOE_BWD_WS
    if (config == kSm90aBwdConfig && (D == 64 || D == 128)) {  // warp-specialized (and padded)
      for (const bool padded : {false, true}) {
        if (padded && D != 128) continue;
        visit_bwd_config<T, D, true>(
            config, FLASHMOE_TRAITS_ONLY([&](auto, auto traits) { dkdv(traits, "true"); }), padded,
            true);
        visit_bwd_config<T, D, false>(
            config, FLASHMOE_TRAITS_ONLY([&](auto, auto traits) { dkdv(traits, "false"); }), padded,
            true);
      }
#if FLASHMOE_BWD_WS_MMA96
      if (D == 128) {  // padded with its products over 96 columns
        visit_bwd_config<T, D, true>(
            config, FLASHMOE_TRAITS_ONLY([&](auto, auto traits) { dkdv(traits, "true"); }), true,
            true, true);
        visit_bwd_config<T, D, false>(
            config, FLASHMOE_TRAITS_ONLY([&](auto, auto traits) { dkdv(traits, "false"); }), true,
            true, true);
      }
#endif
    }
#endif
    if (config == kSm90aBwdConfig && (D == 128 || D == 192)) {  // padded, v's 128 under 192
      visit_bwd_config<T, D, true>(
          config, FLASHMOE_TRAITS_ONLY([&](auto, auto traits) { dkdv(traits, "true"); }), true);
      visit_bwd_config<T, D, false>(
          config, FLASHMOE_TRAITS_ONLY([&](auto, auto traits) { dkdv(traits, "false"); }), true);
    }
  }
  out += "flashmoe::cuda::flash_bwd_dq_kernel<" + demangled_name<BwdDqConfig<D>>() + ", " + dtype +
         ">\t" + std::to_string(BwdDqConfig<D>::kSmemBytes) + "\n";
  out +=
      "flashmoe::cuda::flash_bwd_preprocess_kernel<" + dtype + ", " + std::to_string(D) + ">\t0\n";
}

template <typename T, size_t... I>
void append_kernel_launches(std::string& out, std::index_sequence<I...>) {
  (append_kernel_launches<T, int(kCudaHeadDims[I])>(out), ...);
  out += "flashmoe::cuda::flash_bwd_convert_dq_kernel<" + demangled_name<T>() + ">\t0\n";
}

inline std::string kernel_launches() {
  std::string out;
  constexpr auto head_dims = std::make_index_sequence<std::size(kCudaHeadDims)>{};
  append_kernel_launches<__half>(out, head_dims);
  append_kernel_launches<__nv_bfloat16>(out, head_dims);
  return out;
}

}  // namespace flashmoe::cuda
