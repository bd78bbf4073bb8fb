// Warpgroup MMA (wgmma, sm_90a only) for the Hopper forward and backward kernels: shared-memory
// matrix descriptors for tiles in the 128-byte-swizzled panel layout (swizzle_panels), the fences,
// and m64nNk16 wrappers with fp32 accumulators laid out per warp exactly as mma.sync m16n8 leaves
// them (so the softmax and masking code of the mma.sync kernels applies unchanged):
//   d[n8][e]: row 16 * (warp % 4) + lane / 4 + 8 * (e / 2), column 8 * n8 + 2 * (lane % 4) + e % 2.
// Everything here is a template or is only called from code compiled under
// __CUDA_ARCH_FEAT_SM90_ALL, so the sm_80/sm_89/sm_90 passes of the unit never emit it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "flash_kernel_utils.cuh"

namespace flashmoe::cuda::sm90 {

// Descriptor of a 128B-swizzled operand (PTX ISA "matrix descriptor"): start address, leading and
// stride byte offsets (each >> 4), swizzle mode 1 (128 bytes) in bits 62-63. The start address
// field is 14 bits of (address >> 4): shared memory below 256 KB always fits, so a k-step is an
// add on the whole descriptor.
__device__ __forceinline__ uint64_t make_desc(uint32_t smem_addr, uint32_t lbo, uint32_t sbo) {
  return uint64_t((smem_addr & 0x3FFFF) >> 4) | (uint64_t((lbo & 0x3FFFF) >> 4) << 16) |
         (uint64_t((sbo & 0x3FFFF) >> 4) << 32) | (uint64_t(1) << 62);
}
// K-major operand (Q as A, K as B of S = Q K^T): rows of 128 bytes, 8-row atoms 1024 bytes apart.
// k-step kk (16 elements) sits 32 bytes into the row, the next 64-column panel kRows rows on.
__device__ __forceinline__ uint64_t desc_k_major(uint32_t smem_addr) {
  return make_desc(smem_addr, 16, 1024);
}
template <int kRows>
__device__ __forceinline__ uint64_t k_major_step(int kk) {
  return uint64_t(((kk % 4) * 32 + (kk / 4) * kRows * 128) >> 4);
}
// MN-major operand (V as B of O = P V: the keys are the reduction, the head dim contiguous):
// 64-column panels kRows * 128 bytes apart (the leading offset), 8-row atoms 1024 bytes apart;
// k-step kk (16 keys) is 2048 bytes on.
template <int kRows>
__device__ __forceinline__ uint64_t desc_mn_major(uint32_t smem_addr) {
  return make_desc(smem_addr, kRows * 128, 1024);
}
__device__ __forceinline__ uint64_t mn_major_step(int kk) { return uint64_t((kk * 2048) >> 4); }

template <int N = 0>
__device__ __forceinline__ void fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
template <int N = 0>
__device__ __forceinline__ void commit_group() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wait_group() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Shared memory written through the generic proxy (cp.async, st.shared) becomes visible to the
// async proxy that wgmma reads it through; each writing thread, before the barrier.
template <int N = 0>
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Pins accumulator registers: the compiler may not move their reads or writes across this point
// (around the asynchronous MMAs, whose register use it cannot see).
template <int NT>
__device__ __forceinline__ void fence_operands(float (&d)[NT][4]) {
#pragma unroll
  for (int i = 0; i < NT; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      asm volatile("" : "+f"(d[i][e])::"memory");
}

// mbarriers (shared-memory arrival counters with a phase bit) for the warp-specialized kernel.
// A phase completes when `count` arrivals have been made; waiting on parity p returns once the
// phase of parity p has completed, so a wait on parity 1 passes at once on a fresh barrier (a
// producer's first wait for an empty buffer).
template <int N = 0>
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count));
}
template <int N = 0>
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
template <int N = 0>
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
// Arrives once every cp.async this thread issued so far has landed (the count is not raised:
// the barrier's count includes these arrivals).
template <int N = 0>
__device__ __forceinline__ void mbar_arrive_on_copies(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_u32(bar))
               : "memory");
}
// Arrives and adds `bytes` to the transfers the current phase waits for (the TMA copies that
// complete_tx on this barrier).
template <int N = 0>
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)),
               "r"(bytes)
               : "memory");
}
// One TMA copy of a 5-D box of `map` (a CUtensorMap in parameter space) at the given
// coordinates (innermost first) into shared memory; completes `bytes` of the barrier's phase.
// The whole box is written: elements outside the tensor become zeros.
template <int N = 0>
__device__ __forceinline__ void tma_load_5d(void* smem, const void* map, uint64_t* bar, int c0,
                                            int c1, int c2, int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], "
      "[%1, {%2, %3, %4, %5, %6}], [%7];\n" ::"r"(smem_u32(smem)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4),
      "r"(smem_u32(bar))
      : "memory");
}
// One TMA reduce-add of a 3-D box of fp32 from shared memory (laid out as the map's box and
// swizzle) into the map's tensor, in the issuing thread's bulk group: elements of the box outside
// the tensor are left alone.
template <int N = 0>
__device__ __forceinline__ void tma_reduce_add_3d(const void* map, const void* smem, int c0, int c1,
                                                  int c2) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4}], "
      "[%1];\n" ::"l"(reinterpret_cast<uint64_t>(map)),
      "r"(smem_u32(smem)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
__device__ __forceinline__ void bulk_commit_group() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// Until at most N of this thread's bulk groups are still reading their shared memory.
template <int N>
__device__ __forceinline__ void bulk_wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
// Until at most N of this thread's bulk groups are still in flight (their writes done).
template <int N>
__device__ __forceinline__ void bulk_wait_group() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}
// The 128 threads of one warpgroup at named barrier `id` (0 is __syncthreads'). barrier.sync, not
// bar.sync: each warpgroup reaches its own sites (its own dQ chunks). A kernel whose warpgroups
// meet their barriers a different number of times between two block barriers still confuses
// racecheck, so the wide backward balances the counts (flash_bwd_sm90_wide_block).
__device__ __forceinline__ void warpgroup_sync(int id) {
  asm volatile("barrier.sync %0, 128;\n" ::"r"(id) : "memory");
}
// Every thread of a block whose warpgroups run different copies of one walk (the wide backward
// where v's width differs from q's). __syncthreads() and bar.sync are aligned barriers: every
// thread must reach the same instruction, which the copies break (synccheck: "Divergent thread(s)
// in block", at __syncthreads and at bar.sync alike). barrier.sync without .aligned may be reached
// from different sites; barrier 3 (0 is __syncthreads', 1 and 2 warpgroup_sync's).
constexpr int kBlockBarrier = 3;
template <int kThreads>
__device__ __forceinline__ void block_sync() {
  asm volatile("barrier.sync %0, %1;\n" ::"n"(kBlockBarrier), "n"(kThreads) : "memory");
}
// The ordered dQ of the warp-specialized backward's deterministic calls: a counter read with
// acquire semantics, raised with release semantics (gpu scope), and the async proxy's global
// writes (TMA reduce-adds) ordered against the generic proxy's on either side of them.
__device__ __forceinline__ int load_acquire(const int* counter) {
  int value;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(value) : "l"(counter) : "memory");
  return value;
}
__device__ __forceinline__ void release_add(int* counter, int value) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(counter), "r"(value) : "memory");
}
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}
// `threads` threads at named barrier `id`, every one of them waiting (named_sync) or only counted
// (named_arrive, which returns at once): a producer and its consumers hand a buffer over this
// way, as FlashAttention-3's backward hands over its dQ tiles. Not aligned, so the two sides may
// reach the barrier from different sites; `threads` is a multiple of 32 and every warp arrives
// whole.
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("barrier.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("barrier.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
template <int N = 0>
__device__ __forceinline__ void prefetch_tensor_map(const void* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
template <int N = 0>
__device__ __forceinline__ void mbar_wait(uint64_t* bar, int parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}
// Moves registers between warpgroups (sm_90a): the kernel starts at its launch bound's count,
// then the producer gives registers up and the consumers take them.
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
// kWarpgroups warpgroups taking turns at the tensor cores in a cycle (FlashAttention-3's
// ping-pong with two, its round robin with three): barrier kTurnBarrier + w completes when
// warpgroup w waits on it and the one before w in the cycle has arrived. (Named barrier 0 is
// __syncthreads'; the turns take kTurnBarrier to kTurnBarrier + 2.)
constexpr int kTurnBarrier = 4;
__device__ __forceinline__ void wait_turn(int warpgroup) {
  asm volatile("bar.sync %0, 256;\n" ::"r"(kTurnBarrier + warpgroup) : "memory");
}
template <int kWarpgroups>
__device__ __forceinline__ void pass_turn(int warpgroup) {
  static_assert(kWarpgroups >= 2 && kWarpgroups <= 3, "turns between two or three warpgroups");
  const int next = warpgroup + 1 == kWarpgroups ? 0 : warpgroup + 1;
  asm volatile("bar.arrive %0, 256;\n" ::"r"(kTurnBarrier + next) : "memory");
}

// The asm of one m64nNk16 wgmma for both input types (TYPE: "f16" or "bf16"), over d[N/8][4]:
// the N/2 accumulators are operands %0 to %(N/2 - 1), in FLASHMOE_WGMMA_D_N* order.
// S and dP over a warpgroup's 32 keys: the wgmma backward past head dim 128 (Sm90BwdWideTraits).
#define FLASHMOE_WGMMA_D_N32                                                                    \
  "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),     \
      "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), \
      "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
#define FLASHMOE_WGMMA_REGS_N32 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define FLASHMOE_WGMMA_D_N64                                                                    \
  "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),     \
      "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), \
      "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), \
      "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
      "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), \
      "+f"(d[7][2]), "+f"(d[7][3])
#define FLASHMOE_WGMMA_D_N128                                                                      \
  FLASHMOE_WGMMA_D_N64, "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), \
      "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), \
      "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),              \
      "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]),              \
      "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]),              \
      "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]),              \
      "+f"(d[15][3])
#define FLASHMOE_WGMMA_D_N176                                                            \
  FLASHMOE_WGMMA_D_N128, "+f"(d[16][0]), "+f"(d[16][1]), "+f"(d[16][2]), "+f"(d[16][3]), \
      "+f"(d[17][0]), "+f"(d[17][1]), "+f"(d[17][2]), "+f"(d[17][3]), "+f"(d[18][0]),    \
      "+f"(d[18][1]), "+f"(d[18][2]), "+f"(d[18][3]), "+f"(d[19][0]), "+f"(d[19][1]),    \
      "+f"(d[19][2]), "+f"(d[19][3]), "+f"(d[20][0]), "+f"(d[20][1]), "+f"(d[20][2]),    \
      "+f"(d[20][3]), "+f"(d[21][0]), "+f"(d[21][1]), "+f"(d[21][2]), "+f"(d[21][3])
#define FLASHMOE_WGMMA_REGS_N64                                                                 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define FLASHMOE_WGMMA_REGS_N128                                                                \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "  \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "  \
  "%56, %57, %58, %59, %60, %61, %62, %63}"

#define FLASHMOE_WGMMA_REGS_N176                                                                \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "  \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "  \
  "%56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, "  \
  "%74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87}"

// The shapes of the wgmma forward past head dim 128: S over 96 keys (d=192; 64 at d=256), P V
// over the whole head dim (192 or 256 columns of O); P V over 96 columns of the padded 128 tile
// (Sm90PaddedTraits at head dims up to 96).
#define FLASHMOE_WGMMA_D_N96                                                                       \
  FLASHMOE_WGMMA_D_N64, "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), \
      "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), \
      "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3])
#define FLASHMOE_WGMMA_REGS_N96                                                                 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "  \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47}"
// S over 112 keys: v's 128 under q's and k's 192 (Sm90NarrowVTraits).
#define FLASHMOE_WGMMA_D_N112                                                           \
  FLASHMOE_WGMMA_D_N96, "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), \
      "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3])
#define FLASHMOE_WGMMA_REGS_N112                                                                \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "  \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55}"
#define FLASHMOE_WGMMA_D_N192                                                            \
  FLASHMOE_WGMMA_D_N176, "+f"(d[22][0]), "+f"(d[22][1]), "+f"(d[22][2]), "+f"(d[22][3]), \
      "+f"(d[23][0]), "+f"(d[23][1]), "+f"(d[23][2]), "+f"(d[23][3])
#define FLASHMOE_WGMMA_D_N256                                                            \
  FLASHMOE_WGMMA_D_N192, "+f"(d[24][0]), "+f"(d[24][1]), "+f"(d[24][2]), "+f"(d[24][3]), \
      "+f"(d[25][0]), "+f"(d[25][1]), "+f"(d[25][2]), "+f"(d[25][3]), "+f"(d[26][0]),    \
      "+f"(d[26][1]), "+f"(d[26][2]), "+f"(d[26][3]), "+f"(d[27][0]), "+f"(d[27][1]),    \
      "+f"(d[27][2]), "+f"(d[27][3]), "+f"(d[28][0]), "+f"(d[28][1]), "+f"(d[28][2]),    \
      "+f"(d[28][3]), "+f"(d[29][0]), "+f"(d[29][1]), "+f"(d[29][2]), "+f"(d[29][3]),    \
      "+f"(d[30][0]), "+f"(d[30][1]), "+f"(d[30][2]), "+f"(d[30][3]), "+f"(d[31][0]),    \
      "+f"(d[31][1]), "+f"(d[31][2]), "+f"(d[31][3])
#define FLASHMOE_WGMMA_REGS_N192                                                                \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "  \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "  \
  "%56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, "  \
  "%74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, "  \
  "%92, %93, %94, %95}"
#define FLASHMOE_WGMMA_REGS_N256                                                                   \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "    \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "     \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "     \
  "%56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, "     \
  "%74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, "     \
  "%92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, " \
  "%109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, "     \
  "%124, %125, %126, %127}"
// One K-major m64nNk16 with A and B from shared memory; A, B and SCALE: the operand numbers of
// desc_a, desc_b and scale_d (those after the N / 2 accumulators), as strings.
#define FLASHMOE_WGMMA_SS_K_MAJOR(N, TYPE, A, B, SCALE)                             \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" SCALE                           \
               ", 0;\n"                                                             \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE      \
               " " FLASHMOE_WGMMA_REGS_N##N ", %" A ", %" B ", p, 1, 1, 0, 0;\n}\n" \
               : FLASHMOE_WGMMA_D_N##N                                              \
               : "l"(desc_a), "l"(desc_b), "r"(scale_d))
// One m64nNk16 with A from registers and B MN-major; A: the four A operands' list, B and SCALE as
// above.
#define FLASHMOE_WGMMA_RS_WIDE(N, TYPE, A, B, SCALE)                            \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" SCALE                       \
               ", 0;\n"                                                         \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE  \
               " " FLASHMOE_WGMMA_REGS_N##N ", " A ", %" B ", p, 1, 1, 1;\n}\n" \
               : FLASHMOE_WGMMA_D_N##N                                          \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d))

#define FLASHMOE_WGMMA_SS_N176(TYPE)                                                            \
  asm volatile(                                                                                 \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %90, 0;\n"                                              \
      "wgmma.mma_async.sync.aligned.m64n176k16.f32." TYPE "." TYPE " " FLASHMOE_WGMMA_REGS_N176 \
      ", %88, %89, p, 1, 1, 0, 0;\n}\n"                                                         \
      : FLASHMOE_WGMMA_D_N176                                                                   \
      : "l"(desc_a), "l"(desc_b), "r"(scale_d))

#define FLASHMOE_WGMMA_SS_N64(TYPE, TNSP)                                                     \
  asm volatile(                                                                               \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                            \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " " FLASHMOE_WGMMA_REGS_N64 \
      ", %32, %33, p, 1, 1, " TNSP ";\n}\n"                                                   \
      : FLASHMOE_WGMMA_D_N64                                                                  \
      : "l"(desc_a), "l"(desc_b), "r"(scale_d))

#define FLASHMOE_WGMMA_SS_N128(TYPE, TNSP)                                                      \
  asm volatile(                                                                                 \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                              \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " " FLASHMOE_WGMMA_REGS_N128 \
      ", %64, %65, p, 1, 1, " TNSP ";\n}\n"                                                     \
      : FLASHMOE_WGMMA_D_N128                                                                   \
      : "l"(desc_a), "l"(desc_b), "r"(scale_d))

#define FLASHMOE_WGMMA_RS_N64(TYPE)                                                           \
  asm volatile(                                                                               \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                            \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " " FLASHMOE_WGMMA_REGS_N64 \
      ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"                                         \
      : FLASHMOE_WGMMA_D_N64                                                                  \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d))

#define FLASHMOE_WGMMA_RS_N128(TYPE)                                                            \
  asm volatile(                                                                                 \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                              \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " " FLASHMOE_WGMMA_REGS_N128 \
      ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"                                           \
      : FLASHMOE_WGMMA_D_N128                                                                   \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d))

// d (+)= A B for one m64nNk16 step. mma_ss: A and B from shared memory (descriptors), both
// K-major, or with kMnMajor both MN-major (transposed: the backward's dQ = dS K, dS^T and K as
// stored), or with kMnMajorB alone A K-major and B MN-major (the wide backward's dQ: dS as
// stored, K). mma_rs: A from registers (the mma.sync A fragment of the warp's 16 rows), B MN-major
// (transposed). scale_d = 0 overwrites d instead of adding to it.
template <int N, typename T, bool kMnMajor = false, bool kMnMajorB = kMnMajor>
__device__ __forceinline__ void mma_ss(float (&d)[N / 8][4], uint64_t desc_a, uint64_t desc_b,
                                       int scale_d) {
  static_assert(N == 64 || N == 128 || ((N == 32 || N == 96 || N == 112 || N == 176) && !kMnMajor),
                "wgmma N: 64, 128 (or 32, 96, 112, 176 K-major)");
  static_assert(kMnMajorB == kMnMajor || (N == 64 && !kMnMajor),
                "A K-major with B MN-major: m64n64k16 only");
  constexpr bool kHalf = std::is_same_v<T, __half>;
  if constexpr (N == 32 && kHalf) {
    FLASHMOE_WGMMA_SS_K_MAJOR(32, "f16", "16", "17", "18");
  } else if constexpr (N == 32) {
    FLASHMOE_WGMMA_SS_K_MAJOR(32, "bf16", "16", "17", "18");
  } else if constexpr (N == 64 && kHalf && kMnMajorB && !kMnMajor) {
    FLASHMOE_WGMMA_SS_N64("f16", "0, 1");
  } else if constexpr (N == 64 && kMnMajorB && !kMnMajor) {
    FLASHMOE_WGMMA_SS_N64("bf16", "0, 1");
  } else if constexpr (N == 112 && kHalf) {
    FLASHMOE_WGMMA_SS_K_MAJOR(112, "f16", "56", "57", "58");
  } else if constexpr (N == 112) {
    FLASHMOE_WGMMA_SS_K_MAJOR(112, "bf16", "56", "57", "58");
  } else if constexpr (N == 96 && kHalf) {
    FLASHMOE_WGMMA_SS_K_MAJOR(96, "f16", "48", "49", "50");
  } else if constexpr (N == 96) {
    FLASHMOE_WGMMA_SS_K_MAJOR(96, "bf16", "48", "49", "50");
  } else if constexpr (N == 176 && kHalf) {
    FLASHMOE_WGMMA_SS_N176("f16");
  } else if constexpr (N == 176) {
    FLASHMOE_WGMMA_SS_N176("bf16");
  } else if constexpr (N == 64 && kHalf && kMnMajor) {
    FLASHMOE_WGMMA_SS_N64("f16", "1, 1");
  } else if constexpr (N == 64 && kHalf) {
    FLASHMOE_WGMMA_SS_N64("f16", "0, 0");
  } else if constexpr (N == 64 && kMnMajor) {
    FLASHMOE_WGMMA_SS_N64("bf16", "1, 1");
  } else if constexpr (N == 64) {
    FLASHMOE_WGMMA_SS_N64("bf16", "0, 0");
  } else if constexpr (kHalf && kMnMajor) {
    FLASHMOE_WGMMA_SS_N128("f16", "1, 1");
  } else if constexpr (kHalf) {
    FLASHMOE_WGMMA_SS_N128("f16", "0, 0");
  } else if constexpr (kMnMajor) {
    FLASHMOE_WGMMA_SS_N128("bf16", "1, 1");
  } else {
    FLASHMOE_WGMMA_SS_N128("bf16", "0, 0");
  }
}
template <int N, typename T>
__device__ __forceinline__ void mma_rs(float (&d)[N / 8][4], const uint32_t (&a)[4],
                                       uint64_t desc_b, int scale_d) {
  static_assert(N == 64 || N == 96 || N == 128 || N == 192 || N == 256,
                "wgmma N: 64, 96, 128, 192 or 256");
  constexpr bool kHalf = std::is_same_v<T, __half>;
  if constexpr (N == 96 && kHalf) {
    FLASHMOE_WGMMA_RS_WIDE(96, "f16", "{%48, %49, %50, %51}", "52", "53");
  } else if constexpr (N == 96) {
    FLASHMOE_WGMMA_RS_WIDE(96, "bf16", "{%48, %49, %50, %51}", "52", "53");
  } else if constexpr (N == 192 && kHalf) {
    FLASHMOE_WGMMA_RS_WIDE(192, "f16", "{%96, %97, %98, %99}", "100", "101");
  } else if constexpr (N == 192) {
    FLASHMOE_WGMMA_RS_WIDE(192, "bf16", "{%96, %97, %98, %99}", "100", "101");
  } else if constexpr (N == 256 && kHalf) {
    FLASHMOE_WGMMA_RS_WIDE(256, "f16", "{%128, %129, %130, %131}", "132", "133");
  } else if constexpr (N == 256) {
    FLASHMOE_WGMMA_RS_WIDE(256, "bf16", "{%128, %129, %130, %131}", "132", "133");
  } else if constexpr (N == 64 && kHalf) {
    FLASHMOE_WGMMA_RS_N64("f16");
  } else if constexpr (N == 64) {
    FLASHMOE_WGMMA_RS_N64("bf16");
  } else if constexpr (kHalf) {
    FLASHMOE_WGMMA_RS_N128("f16");
  } else {
    FLASHMOE_WGMMA_RS_N128("bf16");
  }
}

#undef FLASHMOE_WGMMA_SS_K_MAJOR
#undef FLASHMOE_WGMMA_RS_WIDE
#undef FLASHMOE_WGMMA_D_N32
#undef FLASHMOE_WGMMA_REGS_N32
#undef FLASHMOE_WGMMA_D_N96
#undef FLASHMOE_WGMMA_D_N112
#undef FLASHMOE_WGMMA_REGS_N112
#undef FLASHMOE_WGMMA_REGS_N96
#undef FLASHMOE_WGMMA_D_N192
#undef FLASHMOE_WGMMA_REGS_N192
#undef FLASHMOE_WGMMA_D_N256
#undef FLASHMOE_WGMMA_REGS_N256
#undef FLASHMOE_WGMMA_SS_N64
#undef FLASHMOE_WGMMA_SS_N176
#undef FLASHMOE_WGMMA_REGS_N176
#undef FLASHMOE_WGMMA_D_N176
#undef FLASHMOE_WGMMA_SS_N128
#undef FLASHMOE_WGMMA_RS_N64
#undef FLASHMOE_WGMMA_RS_N128
#undef FLASHMOE_WGMMA_REGS_N64
#undef FLASHMOE_WGMMA_REGS_N128
#undef FLASHMOE_WGMMA_D_N64
#undef FLASHMOE_WGMMA_D_N128

}  // namespace flashmoe::cuda::sm90
