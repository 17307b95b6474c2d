// ATMM (adaptive-tiling multi-LoRA matmul) and the in-place switch kernel: templated device code.
//
// Semantics (kernels/reference.py): tokens are sorted into segments, one adapter slot each;
//   y[seg] += s_k * (x[seg] @ A_k) @ B_k,   A_k: (h_in, r_k), B_k: (r_k, h_out), row-major,
// exact per-slot rank r_k (multiple of 8, <= 128), slot < 0 skipped, fp32 accumulation.
//
// Two launches per op, chained with programmatic dependent launch (PDL) so the second one's
// CTAs are resident and have their weights (B tiles) in shared memory before the first ends:
//   shrink: ws[kc][t][j] = sum_{k in chunk kc} x[t][k] * A[k][j]    (split-K partials, fp32)
//   expand: y[t][n] += sum_j (s * sum_kc ws[kc][t][j]) * B[j][n]     (xa split into hi+lo
//           16-bit halves so the intermediate keeps ~fp32 precision: one rounding, into y)
// Small token counts can instead use ONE fused launch (atmm_fused_kernel below): x·A is computed
// per (token tile, column group) by a cluster of CTAs into shared memory and expanded right away.
// Work lists are read from device metadata (AtmmPlan), the grid is persistent (grid-stride),
// so a captured CUDA graph stays correct for any later plan written into the same buffers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cooperative_groups.h>
#include <mma.h>

#include <cstdint>

#include "atmm_api.h"

namespace valora {

namespace wmma = nvcuda::wmma;

__host__ __device__ constexpr int bt_index(int bt) { return bt == 16 ? 0 : bt == 32 ? 1 : bt == 64 ? 2 : 3; }

template <typename T> struct Cvt;
template <> struct Cvt<__nv_bfloat16> {
  static __device__ __forceinline__ __nv_bfloat16 from(float v) { return __float2bfloat16_rn(v); }
  static __device__ __forceinline__ float to(__nv_bfloat16 v) { return __bfloat162float(v); }
};
template <> struct Cvt<__half> {
  static __device__ __forceinline__ __half from(float v) { return __float2half_rn(v); }
  static __device__ __forceinline__ float to(__half v) { return __half2float(v); }
};

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool pred) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  int n = pred ? 16 : 0;  // src-size 0: zero fill
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
// PDL: wait for the preceding grid (and its memory) / let the next grid launch.
__device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void griddep_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// largest s in [0, S) with off[s] <= tile (segments with no tiles are skipped)
__device__ __forceinline__ int find_segment(const int* off, int S, int tile) {
  int lo = 0, hi = S - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    if (off[mid] <= tile) lo = mid; else hi = mid - 1;
  }
  return lo;
}

struct SegCache {
  long long* ptr;
  int* off;
  int* start;
  int* rank;
  float* scale;
  int* xcol;
};

// Copies the plan's segments into shared memory (a few parallel loads, once per CTA) so that
// decoding an item is shared-memory only. Runs before the PDL wait: the plan is written by a copy
// that precedes the whole step, never by the kernel just before this one.
template <bool kUseA>
__device__ __forceinline__ int load_seg_cache(const AtmmArgs& p, int bt_idx, unsigned char* base, SegCache& c) {
  const int cap = p.seg_cap;
  c.ptr = reinterpret_cast<long long*>(base);
  c.off = reinterpret_cast<int*>(c.ptr + cap);
  c.start = c.off + cap + 1;
  c.rank = c.start + cap + 1;
  c.scale = reinterpret_cast<float*>(c.rank + cap);
  c.xcol = reinterpret_cast<int*>(c.scale + cap);
  const int S = p.meta[0];
  const int* seg_starts = p.meta + 1;
  const int* seg_slots = seg_starts + cap + 1;
  const int* tile_off = seg_slots + cap + bt_idx * (cap + 1);
  for (int s = threadIdx.x; s <= S; s += kThreads) {
    c.off[s] = tile_off[s];
    c.start[s] = seg_starts[s];
    if (s < S) {
      const int slot = seg_slots[s];
      int r = 0, xcol = 0;
      float sc = 0.f;
      long long ptr = 0;
      if (slot >= 0) {
        r = p.ranks[slot];
        sc = p.scales[slot];
        ptr = kUseA ? p.a_ptrs[slot] : p.b_ptrs[slot];
        if (!kUseA && p.xa_cols) xcol = p.xa_cols[slot];
      }
      c.rank[s] = r;
      c.scale[s] = sc;
      c.ptr[s] = ptr;
      c.xcol[s] = xcol;
    }
  }
  __syncthreads();
  return S;
}

__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}

// ------------------------------------------------------------------------------------------
// shrink: BT tokens x (16*RB) rank columns per tile, K pipelined through STAGES cp.async stages
// of BK, the 4 warps splitting each stage's K and reducing through shared memory at the end.
template <typename T, int BT, int BK, int STAGES, int RB>
struct ShrinkCfg {
  static constexpr int RP = RB * 16;
  static constexpr int XS_LD = BK + 8;
  static constexpr int AS_LD = RP + 8;
  static constexpr int STAGE_ELEMS = BT * XS_LD + BK * AS_LD;
  static constexpr int PIPE_BYTES = STAGES * STAGE_ELEMS * (int)sizeof(T);
  static constexpr int RED_BYTES = 4 * BT * RP * (int)sizeof(float);
  static constexpr int SMEM = PIPE_BYTES > RED_BYTES ? PIPE_BYTES : RED_BYTES;
  static_assert(BK % 64 == 0, "each of the 4 warps takes 16-wide K steps");
  static_assert((BT / 16) * RB <= 16, "accumulator fragments per warp");
};

// One BT x RP tile of x·A over K in [k0, k1) (X: the tile's first row, nrows valid rows; A: (h_in, r)
// row-major): the cp.async pipeline + WMMA main loop shared by the shrink and the fused kernels.
// The weight stages are issued first, then `before_x()` runs (the PDL wait: x may be written by the
// preceding kernel), then x. Leaves the 4 warps' partial products in `red` ([4][BT][RP] fp32,
// aliasing the pipeline buffers `smem`) and ends with __syncthreads (red complete, every cp.async
// group of the calling thread drained).
template <typename T, int BT, int BK, int STAGES, int RB, typename BeforeX>
__device__ __forceinline__ void shrink_tile(const T* X, long long x_ld, int nrows, const T* A, int r, int k0,
                                            int k1, T* smem, float* red, BeforeX&& before_x) {
  using C = ShrinkCfg<T, BT, BK, STAGES, RB>;
  const int tid = threadIdx.x, warp = tid >> 5;
  const int rb_used = (r + 15) >> 4;
  const int nk = k1 > k0 ? (k1 - k0 + BK - 1) / BK : 0;

  auto load_a = [&](int stage, int kbase) {
    T* as = smem + stage * C::STAGE_ELEMS + BT * C::XS_LD;
#pragma unroll
    for (int c = tid; c < BK * C::RP / 8; c += kThreads) {
      const int kr = c / (C::RP / 8), col = (c % (C::RP / 8)) * 8, k = kbase + kr;
      const bool pred = k < k1 && col < r;
      cp_async16(as + kr * C::AS_LD + col, pred ? A + (long long)k * r + col : A, pred);
    }
  };
  auto load_x = [&](int stage, int kbase) {
    T* xs = smem + stage * C::STAGE_ELEMS;
#pragma unroll
    for (int c = tid; c < BT * BK / 8; c += kThreads) {
      const int row = c / (BK / 8), col = (c % (BK / 8)) * 8, k = kbase + col;
      const bool pred = row < nrows && k < k1;
      cp_async16(xs + row * C::XS_LD + col, pred ? X + (long long)row * x_ld + k : X, pred);
    }
  };

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[BT / 16][RB];
#pragma unroll
  for (int i = 0; i < BT / 16; ++i)
#pragma unroll
    for (int j = 0; j < RB; ++j) wmma::fill_fragment(acc[i][j], 0.f);

  // weights first (they do not depend on the preceding kernel), then the caller's wait, then x
#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st)
    if (st < nk) load_a(st, k0 + st * BK);
  before_x();
#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st) {
    if (st < nk) load_x(st, k0 + st * BK);
    cp_async_commit();
  }
  for (int it = 0; it < nk; ++it) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    const int nxt = it + STAGES - 1;
    if (nxt < nk) {
      load_a(nxt % STAGES, k0 + nxt * BK);
      load_x(nxt % STAGES, k0 + nxt * BK);
    }
    cp_async_commit();
    const T* xs = smem + (it % STAGES) * C::STAGE_ELEMS;
    const T* as = xs + BT * C::XS_LD;
#pragma unroll
    for (int ks = 0; ks < BK / 64; ++ks) {
      const int kk = ks * 64 + warp * 16;
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa[BT / 16];
#pragma unroll
      for (int i = 0; i < BT / 16; ++i) wmma::load_matrix_sync(fa[i], xs + i * 16 * C::XS_LD + kk, C::XS_LD);
#pragma unroll
      for (int j = 0; j < RB; ++j) {
        if (j < rb_used) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> fb;
          wmma::load_matrix_sync(fb, as + kk * C::AS_LD + j * 16, C::AS_LD);
#pragma unroll
          for (int i = 0; i < BT / 16; ++i) wmma::mma_sync(acc[i][j], fa[i], fb, acc[i][j]);
        }
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // pipeline buffers are reused as the reduction buffer
  float* rw = red + warp * BT * C::RP;
#pragma unroll
  for (int i = 0; i < BT / 16; ++i)
#pragma unroll
    for (int j = 0; j < RB; ++j)
      wmma::store_matrix_sync(rw + i * 16 * C::RP + j * 16, acc[i][j], C::RP, wmma::mem_row_major);
  __syncthreads();
}

template <typename T, int BT, int BK, int STAGES, int RB>
__global__ void __launch_bounds__(kThreads) atmm_shrink_kernel(AtmmArgs p) {
  using C = ShrinkCfg<T, BT, BK, STAGES, RB>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  SegCache sc;
  const int S = load_seg_cache<true>(p, bt_index(BT), smem_raw, sc);
  unsigned char* body = smem_raw + seg_cache_bytes(p.seg_cap);
  T* smem = reinterpret_cast<T*>(body);
  float* red = reinterpret_cast<float*>(body);

  const int items = (S > 0 ? sc.off[S] : 0) * p.split_k;
  const int tid = threadIdx.x;
  bool waited = false;

  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const int tile = item / p.split_k, kc = item - tile * p.split_k;
    const int s = find_segment(sc.off, S, tile);
    const int row0 = sc.start[s] + (tile - sc.off[s]) * BT;
    const int nrows = min(BT, sc.start[s + 1] - row0);
    const int r = sc.rank[s];
    const T* A = reinterpret_cast<const T*>(sc.ptr[s]);
    const T* X = reinterpret_cast<const T*>(p.x) + (long long)row0 * p.x_ld;
    const int k0 = kc * p.k_chunk, k1 = min(p.h_in, k0 + p.k_chunk);
    shrink_tile<T, BT, BK, STAGES, RB>(X, p.x_ld, nrows, A, r, k0, k1, smem, red, [&] {
      if (!waited) {
        griddep_wait();    // x and ws may be written/read by the preceding kernel
        griddep_launch();  // our expand may start staging its B tiles
        waited = true;
      }
    });
    float* out = p.ws + ((long long)kc * p.T + row0) * p.rank_stride;
    for (int e = tid; e < BT * C::RP; e += kThreads) {
      const int row = e / C::RP, col = e % C::RP;
      if (row < nrows && col < r) {
        const int q = BT * C::RP;
        out[(long long)row * p.rank_stride + col] = red[e] + red[e + q] + red[e + 2 * q] + red[e + 3 * q];
      }
    }
    __syncthreads();
  }
  if (!waited) {
    griddep_wait();
    griddep_launch();
  }
}

// ------------------------------------------------------------------------------------------
// expand: BT tokens x BN output columns per tile; the 4 warps split BN; y is read into
// registers (16-byte vectors) before the tensor-core work and written back once.
template <typename T, int BT, int BN>
struct ExpandCfg {
  static constexpr int BS_LD = BN + 8;
  static constexpr int CS_LD = BN + 4;
  static constexpr int NF = BN / 64;                   // fragments per warp per row block
  static constexpr int YCH = BT * BN / 8 / kThreads;   // 16-byte y chunks per thread
  static_assert(BN % 64 == 0 && YCH >= 1, "tile");
  static_assert((BT / 16) * NF <= 8, "accumulator fragments per warp");
  static __host__ __device__ size_t smem(int rs) {
    return (size_t)rs * BS_LD * sizeof(T) + 2 * (size_t)BT * (rs + 8) * sizeof(T) +
           (size_t)BT * CS_LD * sizeof(float);
  }
};

// Software-pipelined over a CTA's contiguous run of items: the next item's y tile is loaded into
// a second register set while the current one computes, so each CTA keeps two tiles of y in
// flight. At most ~128 registers for the small tiles so 4 CTAs fit an SM.
template <typename T, int BT, int BN>
__global__ void __launch_bounds__(kThreads, (BT * BN <= 4096 ? 4 : 2)) atmm_expand_kernel(AtmmArgs p) {
  using C = ExpandCfg<T, BT, BN>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  SegCache sc;
  const int S = load_seg_cache<false>(p, bt_index(BT), smem_raw, sc);
  const int rs = p.rank_stride;
  T* bs = reinterpret_cast<T*>(smem_raw + seg_cache_bytes(p.seg_cap));
  T* xh = bs + rs * C::BS_LD;
  T* xl = xh + BT * (rs + 8);
  float* cs = reinterpret_cast<float*>(xl + BT * (rs + 8));

  const int ntn = (p.h_out + BN - 1) / BN;
  const int tiles = S > 0 ? sc.off[S] : 0;
  const int items = tiles * ntn;
  const int tid = threadIdx.x, warp = tid >> 5;
  const T* Y0 = reinterpret_cast<const T*>(p.y);
  T* Yw = reinterpret_cast<T*>(p.y);
  const T* XA = reinterpret_cast<const T*>(p.xa);
  // each CTA takes a contiguous run of items, column-chunk major: consecutive items share the
  // segment's B tile (kept in shared memory) and walk down y
  const int chunk = (items + gridDim.x - 1) / gridDim.x;
  const int it_lo = blockIdx.x * chunk, it_hi = min(items, it_lo + chunk);

  struct Item {
    int row0, nrows, r, n0, xcol;
    float scale;
    const T* B;
  };
  auto decode = [&](int item) {
    Item d;
    const int tn = item / tiles, tile = item - tn * tiles;
    const int s = find_segment(sc.off, S, tile);
    d.row0 = sc.start[s] + (tile - sc.off[s]) * BT;
    d.nrows = min(BT, sc.start[s + 1] - d.row0);
    d.r = sc.rank[s];
    d.xcol = sc.xcol[s];
    d.scale = sc.scale[s];
    d.B = reinterpret_cast<const T*>(sc.ptr[s]);
    d.n0 = tn * BN;
    return d;
  };
  long long b_key = -1;
  auto load_b = [&](const Item& d) {  // cp.async, only when the (segment B, column chunk) changes
    const long long key = (reinterpret_cast<long long>(d.B) << 8) ^ (d.n0 / BN);
    if (key == b_key) return;
    const int r16 = (d.r + 15) & ~15;
    for (int c = tid; c < r16 * (BN / 8); c += kThreads) {
      const int j = c / (BN / 8), col = (c % (BN / 8)) * 8;
      const bool pred = j < d.r && d.n0 + col < p.h_out;
      cp_async16(bs + j * C::BS_LD + col, pred ? d.B + (long long)j * p.h_out + d.n0 + col : d.B, pred);
    }
    b_key = key;
  };
  auto load_y = [&](const Item& d, uint4 (&v)[C::YCH]) {
#pragma unroll
    for (int q = 0; q < C::YCH; ++q) {
      const int c = tid + q * kThreads, row = c / (BN / 8), col = (c % (BN / 8)) * 8;
      if (row < d.nrows && d.n0 + col < p.h_out)
        v[q] = *reinterpret_cast<const uint4*>(Y0 + (long long)(d.row0 + row) * p.y_ld + d.n0 + col);
    }
  };

  Item cur;
  uint4 yv[C::YCH];
  if (it_lo < it_hi) {
    cur = decode(it_lo);
    load_b(cur);  // weights before the wait
    cp_async_commit();
  }
  griddep_wait();  // ws (our shrink) and y (whatever ran before) are ready
  griddep_launch();
  if (it_lo < it_hi) load_y(cur, yv);

  for (int item = it_lo; item < it_hi; ++item) {
    const bool has_next = item + 1 < it_hi;
    Item nxt;
    uint4 yn[C::YCH];
    if (has_next) {
      nxt = decode(item + 1);
      load_y(nxt, yn);  // in flight while this item computes
    }
    const int r16 = (cur.r + 15) & ~15;
    for (int e = tid; e < BT * r16; e += kThreads) {
      const int row = e / r16, col = e - row * r16;
      float v = 0.f;
      if (row < cur.nrows && col < cur.r) {
        if (XA) {
          v = Cvt<T>::to(XA[(long long)(cur.row0 + row) * p.xa_ld + cur.xcol + col]);
        } else {
          const float* w = p.ws + (long long)(cur.row0 + row) * rs + col;
          for (int kc = 0; kc < p.split_k; ++kc) v += w[(long long)kc * p.T * rs];
        }
        v *= cur.scale;
      }
      const T hi = Cvt<T>::from(v);
      xh[row * (rs + 8) + col] = hi;
      xl[row * (rs + 8) + col] = Cvt<T>::from(v - Cvt<T>::to(hi));
    }
    cp_async_wait<0>();
    __syncthreads();

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[BT / 16][C::NF];
#pragma unroll
    for (int i = 0; i < BT / 16; ++i)
#pragma unroll
      for (int f = 0; f < C::NF; ++f) wmma::fill_fragment(acc[i][f], 0.f);
    const int wc = warp * (BN / 4);
    for (int k = 0; k < r16; k += 16) {
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> fb[C::NF];
#pragma unroll
      for (int f = 0; f < C::NF; ++f) wmma::load_matrix_sync(fb[f], bs + k * C::BS_LD + wc + f * 16, C::BS_LD);
#pragma unroll
      for (int i = 0; i < BT / 16; ++i) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fh, fl;
        wmma::load_matrix_sync(fh, xh + i * 16 * (rs + 8) + k, rs + 8);
        wmma::load_matrix_sync(fl, xl + i * 16 * (rs + 8) + k, rs + 8);
#pragma unroll
        for (int f = 0; f < C::NF; ++f) {
          wmma::mma_sync(acc[i][f], fh, fb[f], acc[i][f]);
          wmma::mma_sync(acc[i][f], fl, fb[f], acc[i][f]);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < BT / 16; ++i)
#pragma unroll
      for (int f = 0; f < C::NF; ++f)
        wmma::store_matrix_sync(cs + i * 16 * C::CS_LD + wc + f * 16, acc[i][f], C::CS_LD, wmma::mem_row_major);
    __syncthreads();
#pragma unroll
    for (int q = 0; q < C::YCH; ++q) {
      const int c = tid + q * kThreads, row = c / (BN / 8), col = (c % (BN / 8)) * 8;
      if (row < cur.nrows && cur.n0 + col < p.h_out) {
        T* yh = reinterpret_cast<T*>(&yv[q]);
        const float* d = cs + row * C::CS_LD + col;
#pragma unroll
        for (int e = 0; e < 8; ++e) yh[e] = Cvt<T>::from(Cvt<T>::to(yh[e]) + d[e]);
        *reinterpret_cast<uint4*>(Yw + (long long)(cur.row0 + row) * p.y_ld + cur.n0 + col) = yv[q];
      }
    }
    __syncthreads();  // bs / xh / xl / cs free for the next item
    if (has_next) {
      load_b(nxt);
      cp_async_commit();
      cur = nxt;
#pragma unroll
      for (int q = 0; q < C::YCH; ++q) yv[q] = yn[q];
    }
  }
}

// ------------------------------------------------------------------------------------------
// expand on CUDA cores, for tiles of few rows (decode: a segment is 1-4 tokens). The tensor-core
// expand stages a 16-row tile of B per item and computes mostly zero rows; here each thread owns
// VEC output columns (one 8- or 16-byte vector) of a BN = VEC * kThreads wide column block and
// streams its r B vectors straight from global memory into registers (8 loads in flight per
// thread, no shared-memory staging), so an item costs about one HBM round trip for B and one for
// y. Items are (BT = 16-row tile of a segment, column block), like the tensor-core expand's; the
// tile's x·A rows (scaled, fp32) go through shared memory; rows are done RT at a time, later
// passes re-reading B from L1. fp32 FMA over fp32 x·A: one rounding, into y.
template <int VEC> struct VecOf;
template <> struct VecOf<4> { using type = uint2; };
template <> struct VecOf<8> { using type = uint4; };

template <typename T, int VEC>
struct ExpandFmaCfg {
  static constexpr int BT = 16, RT = 4, BN = VEC * kThreads;
  static __host__ __device__ size_t smem(int rs) { return (size_t)BT * rs * sizeof(float); }
};

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads, 4) atmm_expand_fma_kernel(AtmmArgs p) {
  using C = ExpandFmaCfg<T, VEC>;
  using V = typename VecOf<VEC>::type;
  constexpr int BT = C::BT, RT = C::RT, BN = C::BN;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  SegCache sc;
  const int S = load_seg_cache<false>(p, bt_index(BT), smem_raw, sc);
  const int rs = p.rank_stride;
  float* xs = reinterpret_cast<float*>(smem_raw + seg_cache_bytes(p.seg_cap));  // [BT][rs], scaled x·A

  const int ntn = (p.h_out + BN - 1) / BN;
  const int tiles = S > 0 ? sc.off[S] : 0;
  const int items = tiles * ntn;
  const int tid = threadIdx.x;
  const T* XA = reinterpret_cast<const T*>(p.xa);
  T* Y = reinterpret_cast<T*>(p.y);

  auto segment_of = [&](int item, int& s, int& tile, int& n) {
    const int tn = item / tiles;
    tile = item - tn * tiles;
    s = find_segment(sc.off, S, tile);
    n = tn * BN + tid * VEC;
  };
  if (blockIdx.x < items) {  // B does not depend on the preceding kernel: start pulling it into L2
    int s, tile, n;
    segment_of(blockIdx.x, s, tile, n);
    const T* B = reinterpret_cast<const T*>(sc.ptr[s]);
    if (n < p.h_out)
      for (int j = 0; j < sc.rank[s]; ++j) prefetch_l2(B + (long long)j * p.h_out + n);
  }
  griddep_wait();  // x·A (ws or xa) and y are written by the preceding kernels
  griddep_launch();

  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    int s, tile, n;
    segment_of(item, s, tile, n);
    const int row0 = sc.start[s] + (tile - sc.off[s]) * BT;
    const int nrows = min(BT, sc.start[s + 1] - row0);
    const int r = sc.rank[s];
    const float scale = sc.scale[s];
    const T* B = reinterpret_cast<const T*>(sc.ptr[s]);
    for (int e = tid; e < nrows * r; e += kThreads) {
      const int row = e / r, j = e - row * r;
      float v = 0.f;
      if (XA) {
        v = Cvt<T>::to(XA[(long long)(row0 + row) * p.xa_ld + sc.xcol[s] + j]);
      } else {
        const float* w = p.ws + (long long)(row0 + row) * rs + j;
        for (int kc = 0; kc < p.split_k; ++kc) v += w[(long long)kc * p.T * rs];
      }
      xs[row * rs + j] = v * scale;
    }
    __syncthreads();
    if (n < p.h_out) {
      for (int rb = 0; rb < nrows; rb += RT) {
        float acc[RT][VEC];
#pragma unroll
        for (int i = 0; i < RT; ++i)
#pragma unroll
          for (int c = 0; c < VEC; ++c) acc[i][c] = 0.f;
#pragma unroll 2
        for (int j0 = 0; j0 < r; j0 += 8) {  // ranks are multiples of 8
          V bv[8];
#pragma unroll
          for (int jj = 0; jj < 8; ++jj) bv[jj] = __ldg(reinterpret_cast<const V*>(B + (long long)(j0 + jj) * p.h_out + n));
#pragma unroll
          for (int jj = 0; jj < 8; ++jj) {
            const T* bh = reinterpret_cast<const T*>(&bv[jj]);
#pragma unroll
            for (int i = 0; i < RT; ++i) {
              const float xv = xs[(rb + i < nrows ? rb + i : rb) * rs + j0 + jj];  // rows past the tile: unused
#pragma unroll
              for (int c = 0; c < VEC; ++c) acc[i][c] = fmaf(xv, Cvt<T>::to(bh[c]), acc[i][c]);
            }
          }
        }
#pragma unroll
        for (int i = 0; i < RT; ++i) {
          if (rb + i < nrows) {
            V* yp = reinterpret_cast<V*>(Y + (long long)(row0 + rb + i) * p.y_ld + n);
            V yv = *yp;
            T* yh = reinterpret_cast<T*>(&yv);
#pragma unroll
            for (int c = 0; c < VEC; ++c) yh[c] = Cvt<T>::from(Cvt<T>::to(yh[c]) + acc[i][c]);
            *yp = yv;
          }
        }
      }
    }
    __syncthreads();  // xs is rewritten by the next item
  }
}

// ------------------------------------------------------------------------------------------
// fused (small T): shrink and expand in ONE launch, no x·A round trip through global memory.
// A cluster of CL CTAs owns one work item = (BT-token tile of one segment, column group g); the
// item's CL CTAs split h_in into CL slices, each computes its slice's x·A partial (fp32, the same
// pipeline as the shrink kernel) into its own shared memory; after a cluster barrier each CTA sums
// the CL partials through distributed shared memory (CL = 1: the CTA computes the whole x·A
// itself), scales by s_k, splits into hi + lo 16-bit halves (like the expand kernel) and expands
// its column chunks of the group: chunks g*cpg + rank, + CL, ... (cpg = ceil(ntn / groups), BN
// columns each). B chunks (first two before the shrink, then double-buffered) and the first y tile
// are in flight while x·A is computed. `p.split_k` carries the number of column groups (more
// groups: more CTAs, each recomputing the segment's x·A from L2); `p.ws` is not touched.
// Grid: a multiple of CL, persistent over items (graph-safe like the other kernels).
constexpr size_t align128(size_t v) { return (v + 127) & ~(size_t)127; }

template <typename T, int BT, int BN, int RB, int CL>
struct FusedCfg {
  static constexpr int BK = 64, STAGES = 4;
  using S = ShrinkCfg<T, BT, BK, STAGES, RB>;
  using E = ExpandCfg<T, BT, BN>;
  static constexpr int RP = 16 * RB;
  static constexpr int XLD = RP + 8;  // xh / xl row stride
  static constexpr size_t CS_BYTES = (size_t)BT * E::CS_LD * sizeof(float);
  // region 0: shrink pipeline / 4-warp reduction / expand accumulator staging (never live together)
  static constexpr size_t PART = align128((size_t)S::SMEM > CS_BYTES ? (size_t)S::SMEM : CS_BYTES);
  static constexpr size_t XH = PART + align128((size_t)BT * RP * sizeof(float));  // this CTA's x·A partial
  static constexpr size_t XL = XH + align128((size_t)BT * XLD * sizeof(T));
  static constexpr size_t BS = XL + align128((size_t)BT * XLD * sizeof(T));
  static constexpr size_t BS_BYTES = align128((size_t)RP * E::BS_LD * sizeof(T));  // one B chunk, 2 buffers
  static constexpr size_t SMEM = BS + 2 * BS_BYTES;
  // register budget (launch bounds): as many CTAs per SM as shared memory allows without spills
  static constexpr int MIN_BLOCKS =
      BT == 16 && BN == 128 ? (RB == 1 ? 4 : RB == 2 ? 3 : 2) : BT == 16 && RB == 1 ? 3 : 2;
  static_assert(CL >= 1 && CL <= 8, "portable cluster sizes");
  static_assert(RB <= 4, "fused path: ranks <= 64");
};

// Per-CTA copy of the plan for the fused kernel (fits seg_cache_bytes(cap)): A pointer, tile
// offsets, starts, rank and slot per segment; B pointer and scale are read by slot per item.
struct FusedSegs {
  long long* aptr;
  int* off;
  int* start;
  int* rank;
  int* slot;
};

__device__ __forceinline__ int load_fused_segs(const AtmmArgs& p, int bt_idx, unsigned char* base, FusedSegs& c) {
  const int cap = p.seg_cap;
  c.aptr = reinterpret_cast<long long*>(base);
  c.off = reinterpret_cast<int*>(c.aptr + cap);
  c.start = c.off + cap + 1;
  c.rank = c.start + cap + 1;
  c.slot = c.rank + cap;  // 8 cap + 8 (cap + 1) + 8 cap bytes, as seg_cache_bytes
  const int S = p.meta[0];
  const int* seg_starts = p.meta + 1;
  const int* seg_slots = seg_starts + cap + 1;
  const int* tile_off = seg_slots + cap + bt_idx * (cap + 1);
  for (int s = threadIdx.x; s <= S; s += kThreads) {
    c.off[s] = tile_off[s];
    c.start[s] = seg_starts[s];
    if (s < S) {
      const int slot = seg_slots[s];
      c.slot[s] = slot;
      c.rank[s] = slot >= 0 ? p.ranks[slot] : 0;
      c.aptr[s] = slot >= 0 ? p.a_ptrs[slot] : 0;
    }
  }
  __syncthreads();
  return S;
}

template <int CL>
__device__ __forceinline__ void cluster_or_cta_sync() {
  if constexpr (CL > 1) {
    cooperative_groups::this_cluster().sync();  // release/acquire: peers' shared-memory writes visible
  } else {
    __syncthreads();
  }
}

template <typename T, int BT, int BN, int RB, int CL>
__global__ void __launch_bounds__(kThreads, (FusedCfg<T, BT, BN, RB, CL>::MIN_BLOCKS)) atmm_fused_kernel(AtmmArgs p) {
  using F = FusedCfg<T, BT, BN, RB, CL>;
  using E = typename F::E;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  FusedSegs sc;
  const int S = load_fused_segs(p, bt_index(BT), smem_raw, sc);
  unsigned char* body = smem_raw + seg_cache_bytes(p.seg_cap);
  T* pipe = reinterpret_cast<T*>(body);
  float* red = reinterpret_cast<float*>(body);
  float* cs = reinterpret_cast<float*>(body);
  float* part = reinterpret_cast<float*>(body + F::PART);
  T* xh = reinterpret_cast<T*>(body + F::XH);
  T* xl = reinterpret_cast<T*>(body + F::XL);
  T* bs0 = reinterpret_cast<T*>(body + F::BS);
  T* bs1 = reinterpret_cast<T*>(body + F::BS + F::BS_BYTES);

  int crank = 0;
  if constexpr (CL > 1) crank = (int)cooperative_groups::this_cluster().block_rank();
  const int ncl = gridDim.x / CL, cid = blockIdx.x / CL;
  const int tiles = S > 0 ? sc.off[S] : 0;
  const int groups = p.split_k > 0 ? p.split_k : 1;
  const int items = tiles * groups;
  const int ntn = (p.h_out + BN - 1) / BN;
  const int cpg = (ntn + groups - 1) / groups;
  const int kslice = ((p.h_in + CL - 1) / CL + F::BK - 1) / F::BK * F::BK;
  const int k0 = min(p.h_in, crank * kslice), k1 = min(p.h_in, k0 + kslice);
  const int tid = threadIdx.x, warp = tid >> 5;
  const T* Y0 = reinterpret_cast<const T*>(p.y);
  T* Yw = reinterpret_cast<T*>(p.y);
  bool waited = false;

  // every CTA of a cluster walks the same items (uniform trip count: the cluster barriers match)
  for (int item = cid; item < items; item += ncl) {
    const int tile = item / groups, g = item - tile * groups;
    const int s = find_segment(sc.off, S, tile);
    const int row0 = sc.start[s] + (tile - sc.off[s]) * BT;
    const int nrows = min(BT, sc.start[s + 1] - row0);
    const int r = sc.rank[s], r16 = (r + 15) & ~15;
    const int slot = sc.slot[s];  // >= 0: segments without LoRA have no tiles
    const T* A = reinterpret_cast<const T*>(sc.aptr[s]);
    const T* B = reinterpret_cast<const T*>(__ldg(p.b_ptrs + slot));
    const float scale = __ldg(p.scales + slot);
    const int c_first = g * cpg + crank, c_end = min(ntn, (g + 1) * cpg);
    const int nch = c_first < c_end ? (c_end - c_first + CL - 1) / CL : 0;  // this CTA's chunks

    auto load_b = [&](int chunk, T* dst) {
      const int n0 = chunk * BN;
      for (int c = tid; c < r16 * (BN / 8); c += kThreads) {
        const int j = c / (BN / 8), col = (c % (BN / 8)) * 8;
        const bool pred = j < r && n0 + col < p.h_out;
        cp_async16(dst + j * E::BS_LD + col, pred ? B + (long long)j * p.h_out + n0 + col : B, pred);
      }
    };
    auto load_y = [&](int chunk, uint4 (&v)[E::YCH]) {
      const int n0 = chunk * BN;
#pragma unroll
      for (int q = 0; q < E::YCH; ++q) {
        const int c = tid + q * kThreads, row = c / (BN / 8), col = (c % (BN / 8)) * 8;
        if (row < nrows && n0 + col < p.h_out)
          v[q] = *reinterpret_cast<const uint4*>(Y0 + (long long)(row0 + row) * p.y_ld + n0 + col);
      }
    };

    // B of the first two chunks (weights: before the PDL wait), one cp.async group
    if (nch > 0) load_b(c_first, bs0);
    if (nch > 1) load_b(c_first + CL, bs1);
    cp_async_commit();
    uint4 yv[E::YCH];
    const T* X = reinterpret_cast<const T*>(p.x) + (long long)row0 * p.x_ld;
    shrink_tile<T, BT, F::BK, F::STAGES, RB>(X, p.x_ld, nrows, A, r, k0, k1, pipe, red, [&] {
      if (!waited) {
        griddep_wait();    // x and y may be written by the preceding kernel
        griddep_launch();  // the next kernel may stage its weights
        waited = true;
      }
      if (nch > 0) load_y(c_first, yv);  // in flight during the shrink
    });
    // this CTA's K-slice partial of x·A
    for (int e = tid; e < BT * F::RP; e += kThreads) {
      const int q = BT * F::RP;
      part[e] = red[e] + red[e + q] + red[e + 2 * q] + red[e + 3 * q];
    }
    cluster_or_cta_sync<CL>();
    // x·A of the tile: the cluster's partials summed in rank order (bit-identical in every CTA)
    for (int e = tid; e < BT * F::RP; e += kThreads) {
      float v;
      if constexpr (CL > 1) {
        auto cluster = cooperative_groups::this_cluster();
        v = 0.f;
#pragma unroll
        for (int j = 0; j < CL; ++j) v += cluster.map_shared_rank(part, j)[e];
      } else {
        v = part[e];
      }
      v *= scale;
      const int row = e / F::RP, col = e - row * F::RP;
      const T hi = Cvt<T>::from(v);
      xh[row * F::XLD + col] = hi;
      xl[row * F::XLD + col] = Cvt<T>::from(v - Cvt<T>::to(hi));
    }
    cluster_or_cta_sync<CL>();  // peers are done reading `part`; xh / xl complete

    for (int i = 0; i < nch; ++i) {
      const int chunk = c_first + i * CL, n0 = chunk * BN;
      const bool has_next = i + 1 < nch;
      uint4 yn[E::YCH];
      if (has_next) load_y(chunk + CL, yn);  // in flight while this chunk computes
      cp_async_wait<1>();  // this chunk's B (all but the newest group are complete)
      __syncthreads();
      const T* bs = (i & 1) ? bs1 : bs0;
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[BT / 16][E::NF];
#pragma unroll
      for (int a = 0; a < BT / 16; ++a)
#pragma unroll
        for (int f = 0; f < E::NF; ++f) wmma::fill_fragment(acc[a][f], 0.f);
      const int wc = warp * (BN / 4);
      for (int k = 0; k < r16; k += 16) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> fb[E::NF];
#pragma unroll
        for (int f = 0; f < E::NF; ++f) wmma::load_matrix_sync(fb[f], bs + k * E::BS_LD + wc + f * 16, E::BS_LD);
#pragma unroll
        for (int a = 0; a < BT / 16; ++a) {
          wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fh, fl;
          wmma::load_matrix_sync(fh, xh + a * 16 * F::XLD + k, F::XLD);
          wmma::load_matrix_sync(fl, xl + a * 16 * F::XLD + k, F::XLD);
#pragma unroll
          for (int f = 0; f < E::NF; ++f) {
            wmma::mma_sync(acc[a][f], fh, fb[f], acc[a][f]);
            wmma::mma_sync(acc[a][f], fl, fb[f], acc[a][f]);
          }
        }
      }
#pragma unroll
      for (int a = 0; a < BT / 16; ++a)
#pragma unroll
        for (int f = 0; f < E::NF; ++f)
          wmma::store_matrix_sync(cs + a * 16 * E::CS_LD + wc + f * 16, acc[a][f], E::CS_LD, wmma::mem_row_major);
      __syncthreads();
#pragma unroll
      for (int q = 0; q < E::YCH; ++q) {
        const int c = tid + q * kThreads, row = c / (BN / 8), col = (c % (BN / 8)) * 8;
        if (row < nrows && n0 + col < p.h_out) {
          T* yh = reinterpret_cast<T*>(&yv[q]);
          const float* d = cs + row * E::CS_LD + col;
#pragma unroll
          for (int e = 0; e < 8; ++e) yh[e] = Cvt<T>::from(Cvt<T>::to(yh[e]) + d[e]);
          *reinterpret_cast<uint4*>(Yw + (long long)(row0 + row) * p.y_ld + n0 + col) = yv[q];
        }
      }
      __syncthreads();  // cs and this chunk's B buffer are free
      if (i + 2 < nch) load_b(chunk + 2 * CL, (i & 1) ? bs1 : bs0);
      cp_async_commit();  // (possibly empty: keeps one group per chunk for the wait above)
      if (has_next) {
#pragma unroll
        for (int q = 0; q < E::YCH; ++q) yv[q] = yn[q];
      }
    }
  }
  if (!waited) {
    griddep_wait();
    griddep_launch();
  }
}

// Registry glue of the fused kernel (kept here: the launch needs a cluster dimension, which
// launch_util.cuh's launch_kernel does not set). Registered with kind kShrink, so the binding's
// atmm_shrink launches it: its split_k argument = column groups, its tile count = tiles * CL (so
// the persistent grid covers every CTA of every item once); OpEntry.bm carries CL.
template <typename T, int BT, int BN, int RB, int CL>
struct FusedOp {
  using F = FusedCfg<T, BT, BN, RB, CL>;
  static size_t smem(int) { return F::SMEM; }
  static cudaError_t occ(int* b, size_t s) {
    cudaError_t e = cudaFuncSetAttribute(atmm_fused_kernel<T, BT, BN, RB, CL>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024);
    if (e != cudaSuccess) return e;
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(b, atmm_fused_kernel<T, BT, BN, RB, CL>, kThreads, s);
  }
  static cudaError_t launch(const void* a, int grid, size_t s, cudaStream_t st, bool pdl) {
    static bool configured = false;
    if (!configured) {
      cudaError_t e = cudaFuncSetAttribute(atmm_fused_kernel<T, BT, BN, RB, CL>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024);
      if (e != cudaSuccess) return e;
      configured = true;
    }
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(grid >= CL ? grid / CL * CL : CL);  // whole clusters
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = s;
    cfg.stream = st;
    cudaLaunchAttribute attr[2];
    unsigned n = 0;
    if (CL > 1) {
      attr[n].id = cudaLaunchAttributeClusterDimension;
      attr[n].val.clusterDim.x = CL;
      attr[n].val.clusterDim.y = 1;
      attr[n].val.clusterDim.z = 1;
      ++n;
    }
    if (pdl) {
      attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attr[n].val.programmaticStreamSerializationAllowed = 1;
      ++n;
    }
    cfg.attrs = attr;
    cfg.numAttrs = n;
    return cudaLaunchKernelEx(&cfg, atmm_fused_kernel<T, BT, BN, RB, CL>, *static_cast<const AtmmArgs*>(a));
  }
  static OpEntry entry(const char* name, int dtype) {
    return OpEntry{name, kShrink, dtype, BT, F::BK, F::STAGES, RB, BN, CL, &smem, &occ, &launch};
  }
};

// ------------------------------------------------------------------------------------------
// switch: W (M, N) row-major, in place W += s1*(A1 B1)^T + s2*(A2 B2)^T with A: (N, r),
// B: (r, M) in ATMM layout (i.e. W += s*B_peft*A_peft). One launch over a list of matrices.
// Out of place when the descriptor's src is set (W = src + ...). The bandwidth-oriented
// variants (cp.async ring / register streaming, 256 threads) are in switch.cu.


template <typename T, int BM, int BN>
struct SwitchCfg {
  static constexpr int CS_LD = BN + 4;
  static constexpr int WM = BM / 2, WN = BN / 2;  // 2x2 warps
  static constexpr int FM = WM / 16, FN = WN / 16;
  static constexpr int WCH = BM * BN / 8 / kThreads;
  static_assert(FM * FN <= 8 && WCH >= 1, "tile");
  static __host__ __device__ size_t smem(int R) {  // R = r1_16 + r2_16
    return (size_t)R * (BM + 8) * sizeof(T) + (size_t)BN * (R + 8) * sizeof(T) + (size_t)BM * CS_LD * sizeof(float);
  }
};

template <typename T, int BM, int BN>
__global__ void __launch_bounds__(kThreads, (BM * BN <= 4096 ? 3 : 2))
    switch_kernel(const SwitchDesc* descs, int n, long long total_tiles, int rmax) {
  using C = SwitchCfg<T, BM, BN>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  long long* begins = reinterpret_cast<long long*>(smem_raw);  // first tile of each matrix
  T* bt = reinterpret_cast<T*>(smem_raw + desc_cache_bytes(n));  // B^T tile: [R][BM+8]
  T* at = bt + rmax * (BM + 8);                                  // A tile:   [BN][R+8]
  float* cs = reinterpret_cast<float*>(at + BN * (rmax + 8));
  const int tid = threadIdx.x, warp = tid >> 5, wm = (warp >> 1) * C::WM, wn = (warp & 1) * C::WN;
  for (int i = tid; i < n; i += kThreads) begins[i] = descs[i].tile_begin;
  __syncthreads();
  griddep_wait();
  // contiguous chunk of tiles per CTA: the descriptor changes rarely and W streams in order;
  // the next tile's W is loaded into a second register set while the current one computes
  const long long chunk = (total_tiles + gridDim.x - 1) / gridDim.x;
  const long long t_lo = (long long)blockIdx.x * chunk;
  const long long t_hi = min(total_tiles, t_lo + chunk);

  struct Tile {
    int idx, m0, n0;
  };
  int look = -1;  // descriptor cached in `dl`
  long long look_begin = 0, look_next = 0;
  SwitchDesc dl;
  auto locate = [&](long long tile) {
    if (look < 0 || tile >= look_next || tile < look_begin) {
      int lo = 0, hi = n - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (begins[mid] <= tile) lo = mid; else hi = mid - 1;
      }
      look = lo;
      dl = descs[lo];
      look_begin = begins[lo];
      look_next = lo + 1 < n ? begins[lo + 1] : total_tiles;
    }
    const int ntn = (dl.N + BN - 1) / BN;
    const long long lt = tile - look_begin;
    return Tile{look, (int)(lt / ntn) * BM, (int)(lt % ntn) * BN};
  };
  auto load_w = [&](const SwitchDesc& d, const Tile& t, uint4 (&v)[C::WCH]) {
    const T* W = reinterpret_cast<const T*>(d.src ? d.src : d.w);  // out of place: read src
#pragma unroll
    for (int q = 0; q < C::WCH; ++q) {
      const int c = tid + q * kThreads, row = c / (BN / 8), col = (c % (BN / 8)) * 8;
      if (t.m0 + row < d.M && t.n0 + col < d.N)
        v[q] = *reinterpret_cast<const uint4*>(W + (long long)(t.m0 + row) * d.N + t.n0 + col);
    }
  };

  int bt_desc = -1, bt_m0 = -1;
  uint4 wv[C::WCH];
  Tile cur{0, 0, 0};
  SwitchDesc d;
  if (t_lo < t_hi) {
    cur = locate(t_lo);
    d = dl;
    load_w(d, cur, wv);
  }
  for (long long tile = t_lo; tile < t_hi; ++tile) {
    const bool has_next = tile + 1 < t_hi;
    Tile nxt{0, 0, 0};
    uint4 wnext[C::WCH];
    if (has_next) {
      nxt = locate(tile + 1);
      load_w(dl, nxt, wnext);
    }
    const int m0 = cur.m0, n0 = cur.n0;
    T* W = reinterpret_cast<T*>(d.w);
    const int r1p = (d.r1 + 15) & ~15, r2p = (d.r2 + 15) & ~15, R = r1p + r2p;
    const T* A1 = reinterpret_cast<const T*>(d.a1);
    const T* B1 = reinterpret_cast<const T*>(d.b1);
    const T* A2 = reinterpret_cast<const T*>(d.a2);
    const T* B2 = reinterpret_cast<const T*>(d.b2);
    if (cur.idx != bt_desc || m0 != bt_m0) {  // B^T tile: reused along the row band
      for (int c = tid; c < R * (BM / 8); c += kThreads) {  // B^T rows k, BM contiguous columns
        const int k = c / (BM / 8), col = (c % (BM / 8)) * 8;
        const bool first = k < r1p;
        const int j = first ? k : k - r1p;
        const T* src = first ? B1 : B2;
        const int rr = first ? d.r1 : d.r2;
        const bool pred = j < rr && m0 + col < d.M;
        cp_async16(bt + k * (BM + 8) + col, pred ? src + (long long)j * d.M + m0 + col : B1, pred);
      }
      bt_desc = cur.idx;
      bt_m0 = m0;
    }
    for (int c = tid; c < BN * (R / 8); c += kThreads) {  // A rows n, rank columns contiguous
      const int row = c / (R / 8), k = (c % (R / 8)) * 8;
      const bool first = k < r1p;
      const int j = first ? k : k - r1p;
      const T* src = first ? A1 : A2;
      const int rr = first ? d.r1 : d.r2;
      const bool pred = j < rr && n0 + row < d.N;
      cp_async16(at + row * (R + 8) + k, pred ? src + (long long)(n0 + row) * rr + j : A1, pred);
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[C::FM][C::FN];
#pragma unroll
    for (int i = 0; i < C::FM; ++i)
#pragma unroll
      for (int f = 0; f < C::FN; ++f) wmma::fill_fragment(acc[i][f], 0.f);
    for (int k = 0; k < R; k += 16) {
      if (k == r1p && r1p > 0) {  // fold term 1's scale so one accumulator carries both terms
        const float f1 = d.s1 / d.s2;
#pragma unroll
        for (int i = 0; i < C::FM; ++i)
#pragma unroll
          for (int f = 0; f < C::FN; ++f)
#pragma unroll
            for (int t = 0; t < acc[i][f].num_elements; ++t) acc[i][f].x[t] *= f1;
      }
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::col_major> fa[C::FM];
#pragma unroll
      for (int i = 0; i < C::FM; ++i) wmma::load_matrix_sync(fa[i], bt + k * (BM + 8) + wm + i * 16, BM + 8);
#pragma unroll
      for (int f = 0; f < C::FN; ++f) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> fb;
        wmma::load_matrix_sync(fb, at + (wn + f * 16) * (R + 8) + k, R + 8);
#pragma unroll
        for (int i = 0; i < C::FM; ++i) wmma::mma_sync(acc[i][f], fa[i], fb, acc[i][f]);
      }
    }
    const float fin = r2p > 0 ? d.s2 : d.s1;
#pragma unroll
    for (int i = 0; i < C::FM; ++i)
#pragma unroll
      for (int f = 0; f < C::FN; ++f) {
#pragma unroll
        for (int t = 0; t < acc[i][f].num_elements; ++t) acc[i][f].x[t] *= fin;
        wmma::store_matrix_sync(cs + (wm + i * 16) * C::CS_LD + wn + f * 16, acc[i][f], C::CS_LD, wmma::mem_row_major);
      }
    __syncthreads();
#pragma unroll
    for (int q = 0; q < C::WCH; ++q) {
      const int c = tid + q * kThreads, row = c / (BN / 8), col = (c % (BN / 8)) * 8;
      if (m0 + row < d.M && n0 + col < d.N) {
        T* wh = reinterpret_cast<T*>(&wv[q]);
        const float* dd = cs + row * C::CS_LD + col;
#pragma unroll
        for (int e = 0; e < 8; ++e) wh[e] = Cvt<T>::from(Cvt<T>::to(wh[e]) + dd[e]);
        *reinterpret_cast<uint4*>(W + (long long)(m0 + row) * d.N + n0 + col) = wv[q];
      }
    }
    __syncthreads();
    if (has_next) {
      cur = nxt;
      d = dl;
#pragma unroll
      for (int q = 0; q < C::WCH; ++q) wv[q] = wnext[q];
    }
  }
  griddep_launch();
}


}  // namespace valora
