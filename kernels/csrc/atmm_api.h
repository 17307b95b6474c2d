// Host interface between the CUDA translation units (explicit instantiations, no torch) and the
// pybind11 binding (binding.cpp). Every kernel configuration of the menu registers one OpEntry.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <vector>

namespace valora {

constexpr int kThreads = 128;  // 4 warps per CTA for every kernel here
constexpr int kNumBt = 4;      // token-tile menu {16, 32, 64, 128}: one tile-offset array each

// Device metadata layout of an AtmmPlan (int32):
//   [0] S, [1 .. cap+1] seg_starts, [cap+2 .. 2cap+1] seg_slots,
//   then kNumBt arrays of cap+1 tile offsets (prefix count of BT-token tiles per segment; 0 for
//   slot < 0 segments).
struct AtmmArgs {
  const int* meta;
  int seg_cap;
  const long long* a_ptrs;  // per slot: A (h_in, r) row-major
  const long long* b_ptrs;  // per slot: B (r, h_out) row-major
  const int* ranks;         // per slot
  const float* scales;      // per slot
  const void* x;
  void* y;
  float* ws;  // split-K partials [split_k][T][rank_stride]
  int T, h_in, h_out, rank_stride, split_k, k_chunk;
  long long x_ld, y_ld;
  // Expand only: x·A read from `xa` (T-typed, row stride xa_ld; slot k's r_k values start at
  // column xa_cols[k]) instead of the workspace, e.g. the extra output columns of a base GEMM
  // whose weight carries the slots' A^T as extra rows. nullptr: the workspace.
  const void* xa;
  const int* xa_cols;
  long long xa_ld;
};


// One matrix of a switch: w_out (M, N) = src + s1 (A1 B1)^T + s2 (A2 B2)^T, A: (N, r), B: (r, M)
// row-major (ATMM layout). src == w or src == 0: in place. r = 0: no such term. 80 bytes
// (kernels/switch.py packs the same layout with numpy).
struct SwitchDesc {
  long long w, a1, b1, a2, b2;
  int M, N, r1, r2;
  float s1, s2;
  long long tile_begin;
  long long src;  // read W from here (0: from w)
};

// Per-CTA shared-memory copy of the plan's segments (ATMM kernels), placed at the start of the
// dynamic shared memory: ptr[cap] (A or B pointer per segment), off[cap+1] (tile offsets for the
// kernel's BT), start[cap+1], rank[cap] (0 = no LoRA), scale[cap], xcol[cap] (x·A column, xa only).
constexpr size_t seg_cache_bytes(int cap) {
  return ((size_t)cap * 8 + (size_t)(cap + 1) * 8 + (size_t)cap * 12 + 127) & ~(size_t)127;
}
// Switch kernels keep the descriptors' first tiles in shared memory the same way.
constexpr size_t desc_cache_bytes(int n) { return ((size_t)n * 8 + 127) & ~(size_t)127; }

enum OpKind { kShrink = 0, kExpand = 1, kSwitch = 2, kGroupedShrink = 3, kGroupedExpand = 4 };
enum DType { kBF16 = 0, kFP16 = 1 };

struct OpEntry {
  const char* name;
  int kind, dtype;
  int bt, bk, stages, rb, bn, bm;  // tile parameters (unused ones 0)
  // dynamic shared memory for a given rank stride (ATMM) / total padded rank (switch)
  size_t (*smem)(int rank);
  // resident CTAs per SM at that shared memory (cudaOccupancyMaxActiveBlocksPerMultiprocessor)
  cudaError_t (*occupancy)(int* blocks, size_t smem);
  // ATMM kinds: args = const AtmmArgs*;  switch: args = const SwitchLaunch*
  cudaError_t (*launch)(const void* args, int grid, size_t smem, cudaStream_t stream, bool pdl);
};

struct SwitchLaunch {
  const SwitchDesc* descs;
  int n;
  long long total_tiles;
  int rmax;  // max over descs of r1_16 + r2_16
};

// CUTLASS grouped-GEMM expand (grouped.cu): args = const GroupedLaunch*
struct GroupedLaunch {
  AtmmArgs args;
  unsigned char* aux;  // grouped_aux_bytes(seg_cap, T, rank_stride) bytes of device memory
};
size_t grouped_aux_bytes(int cap, int T, int rank_stride);

void register_atmm_bf16(std::vector<OpEntry>& out);
void register_atmm_fp16(std::vector<OpEntry>& out);
void register_switch(std::vector<OpEntry>& out);
void register_grouped(std::vector<OpEntry>& out);

}  // namespace valora
