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
// Work lists are read from device metadata (AtmmPlan), the grid is persistent (grid-stride),
// so a captured CUDA graph stays correct for any later plan written into the same buffers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
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
  const int S = p.meta[0];
  const int* seg_starts = p.meta + 1;
  const int* seg_slots = seg_starts + cap + 1;
  const int* tile_off = seg_slots + cap + bt_idx * (cap + 1);
  for (int s = threadIdx.x; s <= S; s += kThreads) {
    c.off[s] = tile_off[s];
    c.start[s] = seg_starts[s];
    if (s < S) {
      const int slot = seg_slots[s];
      int r = 0;
      float sc = 0.f;
      long long ptr = 0;
      if (slot >= 0) {
        r = p.ranks[slot];
        sc = p.scales[slot];
        ptr = kUseA ? p.a_ptrs[slot] : p.b_ptrs[slot];
      }
      c.rank[s] = r;
      c.scale[s] = sc;
      c.ptr[s] = ptr;
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
  const int tid = threadIdx.x, warp = tid >> 5;
  bool waited = false;

  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const int tile = item / p.split_k, kc = item - tile * p.split_k;
    const int s = find_segment(sc.off, S, tile);
    const int row0 = sc.start[s] + (tile - sc.off[s]) * BT;
    const int nrows = min(BT, sc.start[s + 1] - row0);
    const int r = sc.rank[s];
    const int rb_used = (r + 15) >> 4;
    const T* A = reinterpret_cast<const T*>(sc.ptr[s]);
    const T* X = reinterpret_cast<const T*>(p.x) + (long long)row0 * p.x_ld;
    const int k0 = kc * p.k_chunk, k1 = min(p.h_in, k0 + p.k_chunk);
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
        cp_async16(xs + row * C::XS_LD + col, pred ? X + (long long)row * p.x_ld + k : X, pred);
      }
    };

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[BT / 16][RB];
#pragma unroll
    for (int i = 0; i < BT / 16; ++i)
#pragma unroll
      for (int j = 0; j < RB; ++j) wmma::fill_fragment(acc[i][j], 0.f);

    // weights first (they do not depend on the preceding kernel), then wait, then x
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st)
      if (st < nk) load_a(st, k0 + st * BK);
    if (!waited) {
      griddep_wait();    // x and ws may be written/read by the preceding kernel
      griddep_launch();  // our expand may start staging its B tiles
      waited = true;
    }
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
  // each CTA takes a contiguous run of items, column-chunk major: consecutive items share the
  // segment's B tile (kept in shared memory) and walk down y
  const int chunk = (items + gridDim.x - 1) / gridDim.x;
  const int it_lo = blockIdx.x * chunk, it_hi = min(items, it_lo + chunk);

  struct Item {
    int row0, nrows, r, n0;
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
        const float* w = p.ws + (long long)(cur.row0 + row) * rs + col;
        for (int kc = 0; kc < p.split_k; ++kc) v += w[(long long)kc * p.T * rs];
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
// switch: W (M, N) row-major, in place W += s1*(A1 B1)^T + s2*(A2 B2)^T with A: (N, r),
// B: (r, M) in ATMM layout (i.e. W += s*B_peft*A_peft). One launch over a list of matrices.


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
    const T* W = reinterpret_cast<const T*>(d.w);
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
