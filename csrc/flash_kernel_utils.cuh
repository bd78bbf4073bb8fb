// Thin wrappers over the sm_80+ instructions the attention kernels are built from: cp.async
// (16-byte global->shared copies with zero-fill), ldmatrix (shared->register fragments, transposed
// for V) and mma.sync m16n8k16 with fp32 accumulation. Available on sm_80, sm_86, sm_89 and sm_90.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "attention_params.h"

// The phase traces (`python -m flashmoe_science phases CASE`): a build with FLASHMOE_PHASE_TRACE=1
// stamps the sm_90a forward's and the decode's phases. A statement of a trace goes inside
// FLASHMOE_PHASE(...), which compiles it only then, so that without the define the kernels' SASS
// is exactly the untraced one.
#ifndef FLASHMOE_PHASE_TRACE
#define FLASHMOE_PHASE_TRACE 0
#endif
#if FLASHMOE_PHASE_TRACE
#define FLASHMOE_PHASE(...) __VA_ARGS__
#else
#define FLASHMOE_PHASE(...)
#endif

namespace flashmoe::cuda {

// Whether this build's kernels carry planted bug `bug` (attention_params.h): a constant, so an
// unplanted build compiles the planted branches away, except in the plant build (-1), whose kernels
// read the bug the host copied into g_planted_bug (set_planted_bug) from $FLASHMOE_PLANT_BUG.
#if FLASHMOE_PLANT_BUG < 0
__device__ int g_planted_bug;
__device__ __forceinline__ bool planted(int bug) { return g_planted_bug == bug; }
#else
__host__ __device__ constexpr bool planted(int bug) { return FLASHMOE_PLANT_BUG == bug; }
#endif

#if FLASHMOE_PHASE_TRACE
// The GPU's nanosecond timer, one for all SMs: the traces' time line (its tick is coarse;
// clock64 times a phase within a block).
__device__ __forceinline__ long long global_timer_ns() {
  long long now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  return now;
}
#endif

// A compile-time bool as a value, to pick a generic lambda's specialization (if constexpr).
template <bool kValue>
struct BoolConstant {
  static constexpr bool value = kValue;
};

__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// Copies 16 bytes, or writes 16 zero bytes when `valid` is false (rows past the sequence end), so
// out-of-range rows are never read and never leave garbage (0 * NaN) in the tile.
// One 4-byte asynchronous copy (cp.async.ca: the sizes under 16 go through L1).
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_u32(smem)), "l"(gmem));
}
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  const int src_size = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem),
               "r"(src_size));
}
// The same copy with an L2 cache policy (createpolicy below) for the lines it brings in.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid,
                                            uint64_t l2_policy) {
  const int src_size = valid ? 16 : 0;
  asm volatile(
      "cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(smem_u32(smem)),
      "l"(gmem), "r"(src_size), "l"(l2_policy));
}
// L2 eviction priorities for cp.async. Evict-first lines are the first to go when their set needs
// room, so data read exactly once (a decode step's K and V) replaces itself instead of what other
// kernels left in L2; in particular it does not force their dirty lines out to DRAM mid-kernel.
__device__ __forceinline__ uint64_t l2_policy_evict_first() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}
__device__ __forceinline__ uint64_t l2_policy_evict_normal() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}
// How load_kv_tile issues its copies: with the default policy, or with a given one.
struct L2Default {
  __device__ __forceinline__ void copy(void* smem, const void* gmem, bool valid) const {
    cp_async_16(smem, gmem, valid);
  }
};
struct L2Policy {
  uint64_t policy;
  __device__ __forceinline__ void copy(void* smem, const void* gmem, bool valid) const {
    cp_async_16(smem, gmem, valid, policy);
  }
};
// atomicAdd with acquire-release semantics at GPU scope (returns the old value): one instruction
// that publishes what the barrier before it ordered and acquires what earlier arrivals published.
__device__ __forceinline__ int atomic_add_acq_rel_gpu(int* address, int value) {
  int old;
  asm volatile("atom.add.acq_rel.gpu.s32 %0, [%1], %2;\n"
               : "=r"(old)
               : "l"(address), "r"(value)
               : "memory");
  return old;
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// `addr` is a shared-memory address (smem_u32), so callers can form it with swizzle_step.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// D = A * B + D for one m16n8k16 tile; A row-major 16x16, B "col" 16x8, D fp32 16x8.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1);

template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4],
                                                  uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two fp32 values packed into one register of two 16-bit values (low half first).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// Reductions over the 4 lanes of a quad, which together hold one row of an mma accumulator.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// Element offset of 16-byte chunk `chunk` of row `row` in a [rows][kHeadDim] shared tile. The chunk
// index is XOR-swizzled with the row, so the 8 rows that one ldmatrix reads hit 8 different bank
// groups (without it every ldmatrix is an 8-way bank conflict).
template <int kHeadDim>
__device__ __forceinline__ int swizzle(int row, int chunk) {
  return row * kHeadDim + ((chunk ^ (row & 7)) << 3);
}

// The layout wgmma reads with its 128-byte swizzle (the sm_90a kernel's tiles): 64-column panels
// ([kHeadDim / 64][kRows][64]), rows 128 bytes apart, the chunk XOR-swizzled with row % 8 inside
// each 8-row, 1024-byte atom (the tile starts 1024-byte aligned). At kHeadDim = 64 this is
// swizzle<64>.
template <int kRows>
__device__ __forceinline__ int swizzle_panels(int row, int chunk) {
  return (chunk >> 3) * kRows * 64 + row * 64 + (((chunk & 7) ^ (row & 7)) << 3);
}
// Element offset of (row, chunk) in a tile of either layout, and the distance between rows.
template <int kHeadDim, int kRows, bool kPanels>
__device__ __forceinline__ int tile_offset(int row, int chunk) {
  if constexpr (kPanels) {
    return swizzle_panels<kRows>(row, chunk);
  } else {
    return swizzle<kHeadDim>(row, chunk);
  }
}

// Where a block sits in the launch grid. grid.x runs over (batch, head, row block), with the row
// block fastest (FA2's order: a head's blocks share its K and V in L2) or, for long causal
// sequences, the head fastest (every head's heavy row blocks first); see the host API. grid.y is
// the split. Tile row r is query r, or with packed GQA query r / group of head hkv * group +
// r % group.
struct TileCoords {
  int b, head_grid, hkv, group, rows_total, m_block, m_blocks, split, len_k;
  // cache_seqlens[b] outside [0, seqlen_k]: the host does not read the values (that would cost a
  // sync per call), so the kernel finds them and poisons this sequence's outputs with NaN.
  bool bad_len;
  // This sequence's query count (seqlen_q unless the batch is packed), and with a packed (varlen)
  // batch the packed rows of its first query and first key (0 otherwise).
  int len_q, row0_q, row0_k;
  // r / group == (r * group_mul) >> 20 for every r * group < 2^20; packed tiles have at most 128
  // rows and groups, so the row mapping needs no integer division (tens of instructions each).
  unsigned group_mul;
  bool pack_gqa;

  __device__ __forceinline__ int query(int r) const {
    return pack_gqa ? int((unsigned(r) * group_mul) >> 20) : r;
  }
  __device__ __forceinline__ int head(int r) const {
    return pack_gqa ? hkv * group + (r - query(r) * group) : head_grid;
  }

  // One past the last KV block of kBlockN keys that tile rows [m0, m0 + kBlockM) see: with a
  // causal mask (bottom-right aligned: query i sees keys j <= i + len_k - seqlen_q), or a window's
  // right edge, the blocks past it are skipped.
  template <int kBlockM, int kBlockN>
  __device__ __forceinline__ int kv_block_end(const AttentionParams& p, int m0) const {
    int end = ceil_div(len_k, kBlockN);
    if (p.window_right >= 0) {  // causal: window_right 0
      const int visible =
          query(min(m0 + kBlockM, rows_total) - 1) + len_k - len_q + p.window_right + 1;
      end = min(end, visible <= 0 ? 0 : ceil_div(visible, kBlockN));
    }
    return end;
  }

  // Issues the cp.async copies of the tile's Q rows [m0, m0 + kRows) into a swizzled shared tile;
  // rows past the end, and the columns past q's head dim on a wider tile, are zero-filled.
  // kPanels: the wgmma forward's panel layout, whose tiles are whole unless kPadded.
  template <int kHeadDim, int kRows, int kThreads, bool kPanels = false, bool kPadded = !kPanels,
            typename T>
  __device__ __forceinline__ void load_q(T* sQ, const AttentionParams& p, int m0, int tid) const {
    constexpr int kChunks = kHeadDim / 8;
    // planted 14: q copied at the tile's width (its tail not zeroed)
    const int q_chunks = planted(14) ? kChunks : p.head_dim / 8;
    const T* q_base = static_cast<const T*>(p.q) + b * p.q_batch_stride + row0_q * p.q_row_stride;
    auto copy = [&](int c) {
      const int r = c / kChunks, ch = c % kChunks, gr = m0 + r;
      const bool valid = gr < rows_total && (!kPadded || ch < q_chunks);
      const T* src = valid
                         ? q_base + head(gr) * p.q_head_stride + query(gr) * p.q_row_stride + ch * 8
                         : q_base;
      cp_async_16(sQ + tile_offset<kHeadDim, kRows, kPanels>(r, ch), src, valid);
    };
    // Past 128 columns (the wgmma forward's producer, whose Q goes by TMA where it can) a loop
    // kept rolled: the unrolled one's addresses spilled the producer's registers.
    if constexpr (kPanels && kHeadDim > 128) {
#pragma unroll 1
      for (int c = tid; c < kRows * kChunks; c += kThreads)
        copy(c);
    } else {
#pragma unroll
      for (int c = tid; c < kRows * kChunks; c += kThreads)
        copy(c);
    }
  }

  // kVarlen: the batch is packed (p.cu_seqlens_q/k); the grid's row blocks cover the longest
  // sequence, and a block past its own sequence's end finds m0 >= rows_total.
  template <int kBlockM, bool kVarlen = false>
  __device__ __forceinline__ static TileCoords of_block(const AttentionParams& p,
                                                        int block_x = blockIdx.x,
                                                        int split = blockIdx.y) {
    // Packed tiles are one row block (at most 128 rows), so r < kBlockM and group <= 128.
    static_assert(kBlockM <= 256, "the row mapping assumes rows * group < 2^20");
    TileCoords t;
    t.pack_gqa = p.pack_gqa;
    t.group = p.pack_gqa ? p.heads_ratio : 1;
    t.group_mul = ((1u << 20) + t.group - 1) / t.group;
    t.rows_total = p.seqlen_q * t.group;
    t.m_blocks = ceil_div(t.rows_total, kBlockM);
    const int heads_grid = p.pack_gqa ? p.heads_kv : p.heads_q;
    const int bh_count = p.batch * heads_grid;
    int bh;
    if (p.row_blocks_fastest) {
      bh = block_x / t.m_blocks;
      t.m_block = block_x - bh * t.m_blocks;
    } else {
      t.m_block = block_x / bh_count;
      bh = block_x - t.m_block * bh_count;
    }
    t.b = bh / heads_grid;
    t.head_grid = bh - t.b * heads_grid;
    t.hkv = p.pack_gqa ? t.head_grid : t.head_grid / p.heads_ratio;
    t.split = split;
    // Clamped, so a bad value reads nothing out of bounds; bad_len poisons the outputs.
    const int len_raw = p.seqlens_k && !kVarlen ? p.seqlens_k[t.b] : p.seqlen_k;
    t.bad_len = !kVarlen && (len_raw < 0 || len_raw > p.seqlen_k);
    t.len_k = min(max(len_raw, 0), p.seqlen_k);
    t.len_q = p.seqlen_q;
    t.row0_q = 0;
    t.row0_k = 0;
    if constexpr (kVarlen) {
      // Offsets clamped into the packed tensors and lengths to the maxima the grid was sized for,
      // so offsets the host did not check read nothing out of bounds (varlen_offsets_valid
      // decides whether the outputs are poisoned instead).
      const int q0 = min(max(p.cu_seqlens_q[t.b], 0), p.total_q);
      const int q1 = min(max(p.cu_seqlens_q[t.b + 1], q0), p.total_q);
      const int k0 = min(max(p.cu_seqlens_k[t.b], 0), p.total_k);
      const int k1 = min(max(p.cu_seqlens_k[t.b + 1], k0), p.total_k);
      t.row0_q = q0;
      t.row0_k = k0;
      t.len_q = min(q1 - q0, p.seqlen_q);
      t.len_k = planted(7) ? min(min(k1 - k0 + 1, p.total_k - k0), p.seqlen_k + 1)  // one key long
                           : min(k1 - k0, p.seqlen_k);
      t.rows_total = t.len_q * t.group;
    }
    return t;
  }
};

// blockIdx.x (blockIdx.y, threadIdx.x) through a volatile read the compiler cannot merge with an
// earlier one or hoist out of a loop: a kernel that recomputes its coordinates or addresses from
// these where it needs them (after its main loop, or once a step) does not hold them in registers
// through the loop.
__device__ __forceinline__ int opaque_block_x() {
  int x;
  asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(x));
  return x;
}
__device__ __forceinline__ int opaque_block_y() {
  int y;
  asm volatile("mov.u32 %0, %%ctaid.y;\n" : "=r"(y));
  return y;
}
__device__ __forceinline__ int opaque_thread_x() {
  int x;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(x));
  return x;
}

// Shared-memory address of the ldmatrix row (rows + 16 * block, chunk 2 * step + c) of a swizzled
// tile, given `base` = the address of (rows, c) with rows < 16 and c < 2. The swizzle XORs the
// chunk bits only and a row is a multiple of 128 bytes, so every k-step of every 16-row block is
// one add and one XOR away from a single per-thread base address (the tile must start 256-byte
// aligned). Without this the compiler keeps one address per (block, step) in registers: at
// d = 128 that is what pushed 128 x 64 tiles into spilling. Past 128 columns the XOR would reach
// bits that neither the row (384 bytes at d=192) nor the tile's alignment leaves clear, so the
// step's 128-byte atom is added and only its place inside the atom XORed.
template <int kHeadDim>
__device__ __forceinline__ uint32_t swizzle_step(uint32_t base, int block, int step) {
  if constexpr (kHeadDim <= 128) {
    return (base + block * 16 * kHeadDim * 2) ^ (step << 5);
  } else {
    return (base + block * 16 * kHeadDim * 2 + (step >> 2) * 128) ^ ((step & 3) << 5);
  }
}

// The 16-byte chunks of a row that one pass of kThreads threads copies: the whole row where the
// threads then cover a multiple of 8 rows, else the widest multiple of 8 chunks (whole 128-byte
// swizzle atoms, which the XOR never leaves) that does; a wider row takes several column passes
// (192 and 256 columns over 128 threads, say). 0: no such split.
template <int kChunks, int kThreads>
constexpr int pass_chunks() {
  for (int c = kChunks; c >= 8; c -= 8) {
    if (kChunks % c == 0 && kThreads % c == 0 && (kThreads / c) % 8 == 0) return c;
  }
  return 0;
}

// Issues the cp.async copies of rows [row0, row0 + kRows) of a K or V tile ([len][kHeadDim], rows
// `row_stride` elements apart) into a swizzled shared tile, spread over kThreads threads. Rows at
// or past `len` are zero-filled and never read. Each thread copies the same chunk of every
// kThreads / kPassChunks-th row (of each column pass), so its addresses are one base plus a
// constant per pass (the swizzle depends on row % 8 and a chunk's low 3 bits only): the loop holds
// no per-pass addresses across the main loop.
// `chunks`: the 16-byte chunks of a row of the tensor (its head dim / 8); on a wider tile
// (kHeadDim > 8 * chunks: a head dim padded onto the next tile) the chunks past it are zero-filled,
// so they add nothing to a product over the head dim.
// kPanels: into the sm_90a kernel's wgmma layout (swizzle_panels) instead of swizzle<kHeadDim>.
// kWhole: the caller knows every row is below `len` (no per-row check, no zero fill of rows).
template <int kHeadDim, int kRows, int kThreads, bool kPanels = false, bool kWhole = false,
          typename T, typename L2 = L2Default>
__device__ __forceinline__ void load_kv_tile(T* tile, const T* base, int64_t row_stride, int row0,
                                             int len, int chunks, int tid, L2 l2 = {}) {
  constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row
  constexpr int kPassChunks = pass_chunks<kChunks, kThreads>();
  static_assert(kPassChunks > 0, "each pass must cover whole swizzle atoms of 8n rows");
  constexpr int kRowsPerPass = kThreads / kPassChunks;
  constexpr int kPitch = kPanels ? 64 : kHeadDim;  // elements between rows
  // Elements between a chunk and the same chunk kPassChunks further (the next column pass).
  constexpr int kColumnStep = kPanels ? kPassChunks / 8 * kRows * 64 : kPassChunks * 8;
  static_assert(kRows % kRowsPerPass == 0, "each pass must cover whole rows, a multiple of 8");
  const int r = tid / kPassChunks, ch = tid % kPassChunks;
  T* dst = tile + tile_offset<kHeadDim, kRows, kPanels>(r, ch);
  const T* src = base + (row0 + r) * row_stride + ch * 8;
#pragma unroll
  for (int column = 0; column < kChunks / kPassChunks; ++column) {
    // (folds away where the caller passes the tile's own width, as the wgmma kernels do)
    const bool column_valid = ch + column * kPassChunks < chunks;
#pragma unroll
    for (int pass = 0; pass < kRows / kRowsPerPass; ++pass) {
      const bool row_valid = kWhole || row0 + r + pass * kRowsPerPass < len;
      const bool valid = row_valid && column_valid;
      const T* from = src + pass * kRowsPerPass * row_stride + column * kPassChunks * 8;
      T* to = dst + pass * kRowsPerPass * kPitch + column * kColumnStep;
      // Planted 3: rows past the sequence end are read, 4 GiB past where they would lie (outside
      // any allocation), instead of zero-filled: a plain 16-byte load, so memcheck must report it.
      if (planted(3) && !row_valid) {
        *reinterpret_cast<uint4*>(to) = *reinterpret_cast<const uint4*>(
            reinterpret_cast<const char*>(from) + (int64_t(1) << 32));
        continue;
      }
      l2.copy(to, valid ? from : base, valid);
    }
  }
}

// load_kv_tile for a paged cache (p.block_table): the K and V rows [row0, row0 + kRows) of one
// sequence, whose logical row j lies in physical page table_row[j / page_size] at row
// j % page_size. Pages of kRows rows or more hold a whole tile (row0 is a multiple of kRows), so
// one table entry serves it; smaller pages (16, 32) split a tile and are looked up per row. K and
// V share the lookups. Pages are clamped into [0, num_pages) (so a table entry outside the cache,
// which the host does not read, still reads inside the cache; `bad_page` is set for the caller to
// poison its outputs) and rows at or past `len` are zero-filled without touching the table.
template <int kHeadDim, int kRows, int kThreads, typename T, typename L2 = L2Default>
__device__ __forceinline__ void load_kv_tiles_paged(T* k_tile, T* v_tile, const T* k_base,
                                                    const T* v_base, const AttentionParams& p,
                                                    const int* table_row, int row0, int len,
                                                    int tid, int& bad_page, L2 l2 = {}) {
  constexpr int kChunks = kHeadDim / 8;
  constexpr int kPassChunks = pass_chunks<kChunks, kThreads>();  // as load_kv_tile's passes
  static_assert(kPassChunks > 0, "each pass must cover whole swizzle atoms of 8n rows");
  constexpr int kRowsPerPass = kThreads / kPassChunks;
  static_assert(kRows % kRowsPerPass == 0, "each pass must cover whole rows, a multiple of 8");
  static_assert((kRows & (kRows - 1)) == 0, "a tile of a power-of-two rows");
  const int r = tid / kPassChunks, ch = tid % kPassChunks;
  const int in_page_mask = (1 << p.page_shift) - 1;
  auto page_of = [&](int row) {
    // planted 8: the logical page, the block table ignored
    const int page = planted(8) ? row >> p.page_shift : table_row[row >> p.page_shift];
    bad_page |= unsigned(page) >= unsigned(p.num_pages);
    return min(max(page, 0), p.num_pages - 1);
  };
  if ((1 << p.page_shift) >= kRows) {
    // One page holds the whole tile: its rows are consecutive rows of that page, copied as a
    // contiguous tile's are. A branch of its own (uniform: the page size is a launch parameter),
    // so this common case does not run the per-row lookups' predicated code too (it had made the
    // main loop much longer: benches/notes/varlen-paged.md, v4.3).
    const int page = row0 < len ? page_of(row0) : 0;
    const int64_t in_page = row0 & in_page_mask;
    const T* k_rows = k_base + page * p.k_batch_stride + in_page * p.k_row_stride;
    const T* v_rows = v_base + page * p.v_batch_stride + in_page * p.v_row_stride;
    if (row0 + kRows <= len) {  // every tile but a sequence's last: no row to check or zero-fill
      load_kv_tile<kHeadDim, kRows, kThreads, false, true>(k_tile, k_rows, p.k_row_stride, 0, 0,
                                                           p.head_dim / 8, tid, l2);
      load_kv_tile<kHeadDim, kRows, kThreads, false, true>(v_tile, v_rows, p.v_row_stride, 0, 0,
                                                           p.head_dim_v / 8, tid, l2);
    } else {
      load_kv_tile<kHeadDim, kRows, kThreads>(k_tile, k_rows, p.k_row_stride, 0, len - row0,
                                              p.head_dim / 8, tid, l2);
      load_kv_tile<kHeadDim, kRows, kThreads>(v_tile, v_rows, p.v_row_stride, 0, len - row0,
                                              p.head_dim_v / 8, tid, l2);
    }
    return;
  }
  T* k_dst = k_tile + swizzle<kHeadDim>(r, ch);
  T* v_dst = v_tile + swizzle<kHeadDim>(r, ch);
  // The chunks past k's and v's head dims on a wider tile are zero-filled (see load_kv_tile).
  const int k_chunks = p.head_dim / 8, v_chunks = p.head_dim_v / 8;
#pragma unroll
  for (int pass = 0; pass < kRows / kRowsPerPass; ++pass) {
    const int row = row0 + r + pass * kRowsPerPass;
    const bool valid = row < len;
    const int page = valid ? page_of(row) : 0;
    const int in_page = row & in_page_mask;
    const T* k_from = k_base + page * p.k_batch_stride + in_page * p.k_row_stride + ch * 8;
    const T* v_from = v_base + page * p.v_batch_stride + in_page * p.v_row_stride + ch * 8;
    // A row's column passes share its page lookup (kPassChunks * 8 elements apart).
#pragma unroll
    for (int column = 0; column < kChunks / kPassChunks; ++column) {
      const int step = column * kPassChunks * 8, c = ch + column * kPassChunks;
      const bool k_valid = valid && c < k_chunks, v_valid = valid && c < v_chunks;
      l2.copy(k_dst + pass * kRowsPerPass * kHeadDim + step, k_valid ? k_from + step : k_base,
              k_valid);
      l2.copy(v_dst + pass * kRowsPerPass * kHeadDim + step, v_valid ? v_from + step : v_base,
              v_valid);
    }
  }
}

// Loads kCols (an even number of) consecutive floats through L2 (__ldcg: other blocks of the same
// launch may have written them, so L1 must not serve a stale line): 16 bytes a load where kCols is
// a multiple of 4 (src then 16-byte aligned), else 8.
template <int kCols>
__device__ __forceinline__ void load_cols_cg(const float* src, float (&x)[kCols]) {
  static_assert(kCols % 2 == 0, "an even number of columns");
  if constexpr (kCols % 4 == 0) {
#pragma unroll
    for (int e = 0; e < kCols; e += 4) {
      const float4 v = __ldcg(reinterpret_cast<const float4*>(src + e));
      x[e] = v.x, x[e + 1] = v.y, x[e + 2] = v.z, x[e + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int e = 0; e < kCols; e += 2) {
      const float2 v = __ldcg(reinterpret_cast<const float2*>(src + e));
      x[e] = v.x, x[e + 1] = v.y;
    }
  }
}

// The split-KV combine of one output row over kCols columns: with m = max_s lse_s,
// lse = m + log sum_s exp(lse_s - m) and out = sum_s exp(lse_s - m) * out_s / sum_s exp(lse_s - m).
// Returns lse (-inf when no split saw a key; out is then 0). Splits with lse = -inf are skipped by
// a select, so whatever their partial holds (NaN included) cannot leak in; a split with lse = NaN
// (a poisoned one) makes out and lse NaN. The splits are taken
// kChunk at a time with every load of a chunk issued before any is used, and the running max
// rescales what came before (online softmax): one L2 round trip per chunk. Loads behind a
// per-split branch cost one round trip per split, on the critical path of every split launch
// (benches/notes/decode.md, v2.6). lse_at(s) and
// partial_at(s) point at split s's log-sum-exp and at the row's partial output, first column.
template <int kCols, int kChunk = 16, typename LseAt, typename PartialAt>
__device__ __forceinline__ float combine_splits(int num_splits, LseAt lse_at, PartialAt partial_at,
                                                float (&out)[kCols]) {
  float m = -INFINITY, sum = 0.f, acc[kCols];
  bool poisoned = false;  // a split wrote lse = NaN (bad cache_seqlens or block table): out is NaN
#pragma unroll
  for (int e = 0; e < kCols; ++e)
    acc[e] = 0.f;
  for (int s0 = 0; s0 < num_splits; s0 += kChunk) {
    float lse[kChunk], x[kChunk][kCols];
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      const bool in_range = s0 + j < num_splits;
      lse[j] = in_range ? __ldcg(lse_at(s0 + j)) : -INFINITY;
      if (in_range) load_cols_cg<kCols>(partial_at(s0 + j), x[j]);
      poisoned |= lse[j] != lse[j];
    }
    float m_new = m;
#pragma unroll
    for (int j = 0; j < kChunk; ++j)
      m_new = fmaxf(m_new, lse[j]);
    if (m_new == -INFINITY) continue;       // no key in any split so far
    const float rescale = expf(m - m_new);  // 0 while m is -inf (sum and acc are 0 then)
    sum *= rescale;
#pragma unroll
    for (int e = 0; e < kCols; ++e)
      acc[e] *= rescale;
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      if (lse[j] == -INFINITY) continue;  // also the splits past num_splits
      const float w = expf(lse[j] - m_new);
      sum += w;
#pragma unroll
      for (int e = 0; e < kCols; ++e)
        acc[e] += w * x[j][e];
      if (planted(2) && s0 + j == 0) {  // planted: split 0 is counted twice in the output
#pragma unroll
        for (int e = 0; e < kCols; ++e)
          acc[e] += w * x[j][e];
      }
    }
    m = m_new;
  }
  const float inv = poisoned ? NAN : sum > 0.f ? 1.f / sum : 0.f;
#pragma unroll
  for (int e = 0; e < kCols; ++e)
    out[e] = acc[e] * inv;
  return poisoned ? NAN : sum > 0.f ? m + logf(sum) : -INFINITY;
}

// ---- Local attention, soft-capping and sinks (the fields of AttentionParams and BwdParams) ----

// The first key query i sees, i sitting at key position i + offset (offset = len_k - len_q):
// i + offset - window_left, or 0 without a left edge (may be negative or past the keys: the row
// then sees fewer keys, or none).
template <typename Params>
__device__ __forceinline__ int window_first_key(const Params& p, int i, int offset) {
  // planted 20: the left edge one key too far right (a query sees one key too few)
  return p.window_left >= 0 ? i + offset - p.window_left + (planted(20) ? 1 : 0) : 0;
}

// One past the last key query i sees: i + offset + window_right + 1 (causal: window_right 0),
// capped at len_k; len_k without a right edge.
template <typename Params>
__device__ __forceinline__ int window_key_end(const Params& p, int i, int offset, int len_k) {
  return p.window_right >= 0 ? min(len_k, i + offset + p.window_right + 1) : len_k;
}

// Whether query i does not see key `key` (past len_k, or outside its window): one distance and
// compares, for the per-element masks whose registers are tight.
template <typename Params>
__device__ __forceinline__ bool outside_window(const Params& p, int key, int i, int offset,
                                               int len_k) {
  const int d = key - i - offset;  // how far right of the query's position the key sits
  const bool left_out = p.window_left >= 0 && d < (planted(20) ? 1 : 0) - p.window_left;
  return key >= len_k || (p.window_right >= 0 && d > p.window_right) || left_out;
}

// The first KV block of kBlockN keys that query i sees (0 without a left edge).
template <int kBlockN, typename Params>
__device__ __forceinline__ int window_first_block(const Params& p, int i, int offset) {
  return p.window_left >= 0 ? max(0, window_first_key(p, i, offset)) / kBlockN : 0;
}

// The backward's walk over the queries of the key block [n0, n0 + kBlockN): the query blocks of
// kBlockM rows some row of which sees one of its keys (query i sees keys i + offset - window_left
// <= j <= i + offset + window_right; causal: window_right 0), as [x, y).
template <int kBlockM, int kBlockN, typename Params>
__device__ __forceinline__ int2 bwd_query_blocks(const Params& p, int n0, int offset) {
  const int begin = p.window_right >= 0 ? max(0, n0 - offset - p.window_right) / kBlockM : 0;
  const int end = p.window_left >= 0
                      ? max(0, min(ceil_div(p.seqlen_q, kBlockM),
                                   (n0 + kBlockN - 1 - offset + p.window_left) / kBlockM + 1))
                      : ceil_div(p.seqlen_q, kBlockM);
  return make_int2(begin, end);
}

// Whether a backward step (the query block at m0, the key block at n0) needs the per-element
// mask: keys past the end, or a key outside some row's window.
template <int kBlockM, int kBlockN, typename Params>
__device__ __forceinline__ bool bwd_step_needs_mask(const Params& p, int n0, int m0, int offset) {
  return n0 + kBlockN > p.seqlen_k ||
         (p.window_right >= 0 && n0 + kBlockN - 1 > m0 + offset + p.window_right) ||
         (p.window_left >= 0 && n0 < m0 + kBlockM - 1 + offset - p.window_left);
}

__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Soft-capping (Gemma 2's attn_logit_softcapping): a raw score x = q.k becomes
// softcap * tanh(x * scale / softcap). The kernels keep t = tanh(x * softcap_scale) in place of
// the score and the host folds softcap into the softmax's scale (softmax_scale = softcap,
// scale_log2 = softcap * log2(e); softcap_scale = scale / softcap), so the softmax, the
// log-sum-exp and the backward's P read t as they read a raw score, and the backward's
// d tanh = 1 - t^2 needs t alone. Applied before the mask, as FlashAttention does.
template <int N, typename Params>
__device__ __forceinline__ void apply_softcap(float (&scores)[N], const Params& p) {
#pragma unroll
  for (int e = 0; e < N; ++e)
    scores[e] = tanh_approx(scores[e] * p.softcap_scale);
}

// A learnable sink (gpt-oss): exp(sink) joins a row's softmax denominator with no value. Given the
// row's log-sum-exp without it (-inf: the row saw no key; NaN: poisoned), returns the one with it
// and sets `factor`, by which the row's normalised output is multiplied.
__device__ __forceinline__ float fold_sink(float lse, float sink, float& factor) {
  if (lse != lse) {
    factor = NAN;
    return NAN;
  }
  const float m = fmaxf(lse, sink);
  const float total = m + logf(expf(lse - m) + expf(sink - m));
  factor = expf(lse - total);
  return total;
}

}  // namespace flashmoe::cuda
