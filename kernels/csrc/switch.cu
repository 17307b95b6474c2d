// The switch kernels: W_out = W_src + s1 (A1 B1)^T + s2 (A2 B2)^T over a list of matrices, one launch
// (SwitchDesc in atmm_api.h; src == w or 0: in place). A: (N, r), B: (r, M) row-major (ATMM layout).
//
// Two families share the descriptor list, the tile numbering (BM x BN tiles, row-major per matrix,
// `tile_begin` prefix) and kernels/switch.py's SwitchPlan:
//
//  switch_<dt>_bm*_bn*            the original kernel (atmm.cuh): 128 threads, W in registers with one
//                                 tile prefetched, WMMA, fp32 accumulator staged through shared memory,
//                                 contiguous tile chunks per CTA.
//  switch_<dt>_pipe_bm*_bn*_s4_t256   cp.async ring of up to 4 stages (as many as fit two CTAs per SM);
//                                 each stage holds the W tile (XOR-swizzled, no padding), the A chunk and
//                                 the B^T row-band slot (reloaded only when the stage's band changes).
//                                 mma.sync m16n8k16 from ldmatrix fragments; the epilogue reads W in the
//                                 accumulator layout with ldmatrix, adds in fp32 (one rounding) and writes
//                                 it back in place with stmatrix (no fp32 staging), then every warp stores
//                                 its own rows with 16-byte coalesced stores. One __syncthreads per tile.
//  switch_<dt>_regs_bm*_bn*_t256  W never touches shared memory: the A^T columns are permuted in shared
//                                 memory so that each thread's mma accumulators cover 8 contiguous W columns,
//                                 so W is loaded with 16-byte loads straight into registers (two tiles in
//                                 flight per thread) and stored from them. A chunk + B^T band slot in a
//                                 3-stage cp.async ring.
//
// Both new families: 256 threads (8 warps, 4 x 2), W loads/stores with an L2 evict-first policy
// (streamed once) so the adapter factors stay in L2, and a round-robin schedule of 16-tile runs
// (run r -> CTA r % grid) so the CTAs resident at one time work on the same few matrices (their A
// chunks are shared through L2) while every CTA gets the same number of tiles (+-1 run).
// Ranks: the sum of the two padded ranks must be <= 128 for the new families (SwitchPlan falls back
// to the original kernel above that).
#include "launch_util.cuh"

namespace valora {
namespace {

constexpr int kSwThreads = 256;  // 8 warps: 4 along M x 2 along N
constexpr int kSwRun = 16;       // tiles per run of the round-robin schedule

// ---- PTX helpers ----------------------------------------------------------------------------------
__device__ __forceinline__ unsigned sw_smem(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ unsigned long long sw_evict_first() {
  unsigned long long p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(p));
  return p;
}
__device__ __forceinline__ void sw_cp_async16_ef(void* smem, const void* gmem, bool pred, unsigned long long pol) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(sw_smem(smem)), "l"(gmem),
               "r"(pred ? 16 : 0), "l"(pol));
}
__device__ __forceinline__ uint4 sw_ld_stream(const void* p, unsigned long long pol) {
  uint4 v;
  asm volatile("ld.global.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p), "l"(pol));
  return v;
}
__device__ __forceinline__ void sw_st_stream(void* p, const uint4& v, unsigned long long pol) {
  asm volatile("st.global.L1::no_allocate.L2::cache_hint.v4.u32 [%0], {%1, %2, %3, %4}, %5;\n" ::"l"(p), "r"(v.x),
               "r"(v.y), "r"(v.z), "r"(v.w), "l"(pol)
               : "memory");
}
__device__ __forceinline__ void sw_ldsm_x4(unsigned (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(sw_smem(p)));
}
__device__ __forceinline__ void sw_ldsm_x4_t(unsigned (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(sw_smem(p)));
}
__device__ __forceinline__ void sw_stsm_x4(void* p, const unsigned (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(sw_smem(p)), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}
__device__ __forceinline__ void sw_wait_stages(int st) {  // all but the newest st-2 cp.async groups done
  if (st >= 4) cp_async_wait<2>();
  else if (st == 3) cp_async_wait<1>();
  else cp_async_wait<0>();
}

// D (16x8 f32) += A (16x16, row) * B (16x8, col); fragments in the PTX ISA layout
template <typename T> struct SwMma;
template <> struct SwMma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  // two packed W values + s * (c0, c1), one rounding each
  static __device__ __forceinline__ unsigned fma2(unsigned w, float c0, float c1, float s) {
    const float w0 = __uint_as_float(w << 16), w1 = __uint_as_float(w & 0xffff0000u);
    __nv_bfloat162 r = __floats2bfloat162_rn(fmaf(c0, s, w0), fmaf(c1, s, w1));
    return *reinterpret_cast<unsigned*>(&r);
  }
};
template <> struct SwMma<__half> {
  static __device__ __forceinline__ void run(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ unsigned fma2(unsigned w, float c0, float c1, float s) {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w));
    __half2 r = __floats2half2_rn(fmaf(c0, s, f.x), fmaf(c1, s, f.y));
    return *reinterpret_cast<unsigned*>(&r);
  }
};

// ---- schedule and descriptor lookup ------------------------------------------------------------------
// This CTA's tiles: runs of kSwRun consecutive tiles, run r -> CTA r % grid; j-th tile of the CTA.
struct SwSched {
  long long total;
  int grid, cta;
  __device__ __forceinline__ long long count() const {
    const long long runs = (total + kSwRun - 1) / kSwRun;
    if (cta >= runs) return 0;
    const long long mine = (runs - 1 - cta) / grid + 1;
    const long long last = cta + (mine - 1) * grid;
    return (mine - 1) * kSwRun + min((long long)kSwRun, total - last * kSwRun);
  }
  __device__ __forceinline__ long long tile(long long j) const {
    return ((j / kSwRun) * grid + cta) * kSwRun + j % kSwRun;
  }
};

// descriptor holding a tile: cached range [lo, hi), binary search over the shared tile_begin copy
struct SwCursor {
  int idx = 0;
  long long lo = 1, hi = 0;
  __device__ __forceinline__ void locate(const long long* begins, int n, long long total, long long tile) {
    if (tile >= lo && tile < hi) return;
    int a = 0, b = n - 1;
    while (a < b) {
      const int mid = (a + b + 1) >> 1;
      if (begins[mid] <= tile) a = mid; else b = mid - 1;
    }
    idx = a;
    lo = begins[a];
    hi = a + 1 < n ? begins[a + 1] : total;
  }
};

// the tile's place in its matrix and what every thread needs to load or finish it
struct SwTile {
  int M, N, m0, n0, r1, r2, r1p, R;
  __device__ __forceinline__ SwTile(const SwitchDesc& d, long long tile, long long lo, int BM, int BN) {
    M = d.M;
    N = d.N;
    const int ntn = (N + BN - 1) / BN, lt = (int)(tile - lo);
    m0 = (lt / ntn) * BM;
    n0 = (lt % ntn) * BN;
    r1 = d.r1;
    r2 = d.r2;
    r1p = (r1 + 15) & ~15;
    R = r1p + ((r2 + 15) & ~15);
  }
};

// A chunk (rows n0..n0+BN of [A1 | A2], row stride R+8) into shared memory; row n goes to position
// perm(n) (identity for the pipe kernel; the regs kernel's column permutation)
template <typename T, int BN, int THREADS, typename Perm>
__device__ __forceinline__ void sw_load_a(T* as, const SwitchDesc& d, const SwTile& t, const T* dummy, Perm perm) {
  const T* A1 = reinterpret_cast<const T*>(d.a1);
  const T* A2 = reinterpret_cast<const T*>(d.a2);
  const int kc = t.R >> 3, lda = t.R + 8;
  for (int c = threadIdx.x; c < BN * kc; c += THREADS) {
    const int row = c / kc, k = (c - row * kc) * 8;
    const bool first = k < t.r1p;
    const int kk = first ? k : k - t.r1p, rr = first ? t.r1 : t.r2;
    const bool p = kk < rr && t.n0 + row < t.N;
    cp_async16(as + perm(row) * lda + k, p ? (first ? A1 : A2) + (long long)(t.n0 + row) * rr + kk : dummy, p);
  }
}
// B^T row band (rows k < R, columns m0..m0+BM of [B1; B2], row stride BM+8)
template <typename T, int BM, int THREADS>
__device__ __forceinline__ void sw_load_band(T* bs, const SwitchDesc& d, const SwTile& t, const T* dummy) {
  const T* B1 = reinterpret_cast<const T*>(d.b1);
  const T* B2 = reinterpret_cast<const T*>(d.b2);
  for (int c = threadIdx.x; c < t.R * (BM / 8); c += THREADS) {
    const int k = c / (BM / 8), col = (c % (BM / 8)) * 8;
    const bool first = k < t.r1p;
    const int kk = first ? k : k - t.r1p, rr = first ? t.r1 : t.r2;
    const bool p = kk < rr && t.m0 + col < t.M;
    cp_async16(bs + k * (BM + 8) + col, p ? (first ? B1 : B2) + (long long)kk * t.M + t.m0 + col : dummy, p);
  }
}

// band key of a tile (descriptor, first row): a stage's band slot is reloaded when it changes
__device__ __forceinline__ long long sw_band_key(int idx, int m0) { return ((long long)idx << 32) | (unsigned)m0; }

template <int N>
__device__ __forceinline__ bool sw_take_slot(long long (&keys)[N], int s, long long key) {  // true: reload
  bool reload = false;
#pragma unroll
  for (int i = 0; i < N; ++i)
    if (i == s) {
      reload = keys[i] != key;
      keys[i] = key;
    }
  return reload;
}

// acc[FM][FN] (16x8 tiles) += B^T band (rows wm.., k < R) x A chunk (rows n of the warp); term 1's
// scale is folded in at k == r1p exactly as the original kernel does (acc *= s1/s2, then * s2)
template <typename T, int FM, int FN, int BM>
__device__ __forceinline__ void sw_mma_tile(float (&acc)[FM][FN][4], const T* bs, const T* as, int lda, int wm,
                                            int wn_rows, const SwTile& t, float s1, float s2) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int i = 0; i < FM; ++i)
#pragma unroll
    for (int f = 0; f < FN; ++f)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][f][e] = 0.f;
  for (int k = 0; k < t.R; k += 16) {
    if (k == t.r1p && t.r1p > 0) {
      const float f1 = s1 / s2;
#pragma unroll
      for (int i = 0; i < FM; ++i)
#pragma unroll
        for (int f = 0; f < FN; ++f)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[i][f][e] *= f1;
    }
    unsigned af[FM][4];
#pragma unroll
    for (int i = 0; i < FM; ++i)  // B^T stored [k][m]: transposed 8x8 loads give the row-major A fragment
      sw_ldsm_x4_t(af[i], bs + (k + (lane & 7) + ((lane >> 4) & 1) * 8) * (BM + 8) + wm + i * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
    for (int f = 0; f < FN / 2; ++f) {  // A stored [n][k]: plain 8x8 loads give the col-major B fragment
      unsigned bf[4];
      sw_ldsm_x4(bf, as + (wn_rows + f * 16 + (lane & 7) + ((lane >> 4) & 1) * 8) * lda + k + ((lane >> 3) & 1) * 8);
#pragma unroll
      for (int i = 0; i < FM; ++i) {
        SwMma<T>::run(acc[i][2 * f], af[i], bf[0], bf[1]);
        SwMma<T>::run(acc[i][2 * f + 1], af[i], bf[2], bf[3]);
      }
    }
  }
}

// ---- family "pipe": W through a cp.async ring in shared memory ----------------------------------------
template <typename T, int BM, int BN, int STMAX, int MINB>
struct SwPipeCfg {
  static constexpr int THREADS = kSwThreads, WARPS_N = 2;
  static constexpr int WTM = BM / 4, WTN = BN / WARPS_N;  // warp tile
  static constexpr int FM = WTM / 16, FN = WTN / 8;
  static constexpr size_t W_BYTES = (size_t)BM * BN * sizeof(T);
  static constexpr size_t BUDGET = (size_t)228 * 1024 / MINB - 3 * 1024;  // MINB CTAs per SM (+ descs)
  static_assert(BN % 64 == 0 && BN <= 256, "swizzle needs 8..32 16-byte chunks per W row");
  static_assert(WTM % 16 == 0 && WTN % 16 == 0 && BM * BN / 8 % THREADS == 0, "tile");
  static_assert(STMAX >= 2 && STMAX <= 4, "stages");
  static __host__ __device__ constexpr size_t a_bytes(int R) { return (size_t)BN * (R + 8) * sizeof(T); }
  static __host__ __device__ constexpr size_t band_bytes(int R) { return (size_t)R * (BM + 8) * sizeof(T); }
  static __host__ __device__ constexpr size_t stage_bytes(int R) { return W_BYTES + a_bytes(R) + band_bytes(R); }
  static __host__ __device__ constexpr int stages(int R) {
    return BUDGET / stage_bytes(R) < 2 ? 2 : (BUDGET / stage_bytes(R) > STMAX ? STMAX : (int)(BUDGET / stage_bytes(R)));
  }
  static size_t smem(int R) { return (size_t)stages(R) * stage_bytes(R); }
};

template <typename T, int BM, int BN, int STMAX, int MINB>
__global__ void __launch_bounds__(kSwThreads, MINB)
    switch_pipe_kernel(const SwitchDesc* __restrict__ descs, int n, long long total_tiles, int rmax) {
  using C = SwPipeCfg<T, BM, BN, STMAX, MINB>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  long long* begins = reinterpret_cast<long long*>(smem_raw);
  unsigned char* ring = smem_raw + desc_cache_bytes(n);
  const size_t SB = C::stage_bytes(rmax);
  const int st = C::stages(rmax);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = (warp / C::WARPS_N) * C::WTM, wn = (warp % C::WARPS_N) * C::WTN;
  for (int i = tid; i < n; i += C::THREADS) begins[i] = descs[i].tile_begin;
  __syncthreads();
  griddep_wait();
  const SwSched sch{total_tiles, (int)gridDim.x, (int)blockIdx.x};
  const long long cnt = sch.count();
  const unsigned long long pol = sw_evict_first();
  SwCursor pc, cc;
  long long keys[STMAX];
#pragma unroll
  for (int i = 0; i < STMAX; ++i) keys[i] = -1;

  auto issue = [&](long long j, int s) {  // the CTA's j-th tile into stage s
    const long long tile = sch.tile(j);
    pc.locate(begins, n, total_tiles, tile);
    const SwitchDesc& d = descs[pc.idx];
    const SwTile t(d, tile, pc.lo, BM, BN);
    unsigned char* base = ring + s * SB;
    T* ws = reinterpret_cast<T*>(base);
    const T* S = reinterpret_cast<const T*>(d.src ? d.src : d.w);
#pragma unroll
    for (int q = 0; q < BM * BN / 8 / C::THREADS; ++q) {
      const int c = tid + q * C::THREADS, row = c / (BN / 8), ch = c % (BN / 8);
      const bool p = t.m0 + row < t.M && t.n0 + ch * 8 < t.N;
      sw_cp_async16_ef(ws + row * BN + ((ch ^ (row & 7)) * 8), p ? S + (long long)(t.m0 + row) * t.N + t.n0 + ch * 8 : S,
                       p, pol);
    }
    sw_load_a<T, BN, C::THREADS>(reinterpret_cast<T*>(base + C::W_BYTES), d, t, S, [](int r) { return r; });
    if (sw_take_slot(keys, s, sw_band_key(pc.idx, t.m0)))
      sw_load_band<T, BM, C::THREADS>(reinterpret_cast<T*>(base + C::W_BYTES + C::a_bytes(rmax)), d, t, S);
  };

  for (int s = 0; s < st - 1; ++s) {
    if (s < cnt) issue(s, s);
    cp_async_commit();
  }
  int sc = 0, sp = st - 1;  // consumer / producer stage
  for (long long j = 0; j < cnt; ++j) {
    sw_wait_stages(st);
    __syncthreads();  // stage sc landed for every thread; stage sp (tile j-1) no longer read
    if (j + st - 1 < cnt) issue(j + st - 1, sp);
    cp_async_commit();
    const long long tile = sch.tile(j);
    cc.locate(begins, n, total_tiles, tile);
    const SwitchDesc& d = descs[cc.idx];
    const SwTile t(d, tile, cc.lo, BM, BN);
    const float s1 = d.s1, s2 = d.s2;
    unsigned char* base = ring + sc * SB;
    T* ws = reinterpret_cast<T*>(base);
    float acc[C::FM][C::FN][4];
    sw_mma_tile<T, C::FM, C::FN, BM>(acc, reinterpret_cast<const T*>(base + C::W_BYTES + C::a_bytes(rmax)),
                                     reinterpret_cast<const T*>(base + C::W_BYTES), t.R + 8, wm, wn, t, s1, s2);
    const float fin = t.R > t.r1p ? s2 : s1;
    // W in the accumulator layout: matrices (m lo, n lo), (m hi, n lo), (m lo, n hi), (m hi, n hi)
#pragma unroll
    for (int i = 0; i < C::FM; ++i)
#pragma unroll
      for (int f = 0; f < C::FN / 2; ++f) {
        const int row = wm + i * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        const int ch = (wn + f * 16) / 8 + ((lane >> 4) & 1);
        T* p = ws + row * BN + ((ch ^ (row & 7)) * 8);
        unsigned v[4];
        sw_ldsm_x4(v, p);
        v[0] = SwMma<T>::fma2(v[0], acc[i][2 * f][0], acc[i][2 * f][1], fin);
        v[1] = SwMma<T>::fma2(v[1], acc[i][2 * f][2], acc[i][2 * f][3], fin);
        v[2] = SwMma<T>::fma2(v[2], acc[i][2 * f + 1][0], acc[i][2 * f + 1][1], fin);
        v[3] = SwMma<T>::fma2(v[3], acc[i][2 * f + 1][2], acc[i][2 * f + 1][3], fin);
        sw_stsm_x4(p, v);
      }
    __syncwarp();
    T* W = reinterpret_cast<T*>(d.w);
#pragma unroll
    for (int q = 0; q < C::WTM * C::WTN / 8 / 32; ++q) {  // the warp's own rows, 16 B per lane
      const int c = lane + q * 32, row = wm + c / (C::WTN / 8), ch = wn / 8 + c % (C::WTN / 8);
      if (t.m0 + row < t.M && t.n0 + ch * 8 < t.N)
        sw_st_stream(W + (long long)(t.m0 + row) * t.N + t.n0 + ch * 8,
                     *reinterpret_cast<const uint4*>(ws + row * BN + ((ch ^ (row & 7)) * 8)), pol);
    }
    sc = sc + 1 == st ? 0 : sc + 1;
    sp = sp + 1 == st ? 0 : sp + 1;
  }
  cp_async_wait<0>();
  griddep_launch();
}

// ---- family "regs": W streamed through registers in the accumulator layout ----------------------------
// A chunk row n (chunk-local) is stored at position perm(n): within each 32-column group, n = 8a + 2j + e
// goes to 8j + 2a + e, so n8 tile j's column c (= 2a + e) is W column 8a + 2j + e and the thread that
// owns accumulator columns 2t, 2t+1 of the four tiles j = 0..3 owns W columns 8t .. 8t+7 (one uint4:
// word j = tile j).
__device__ __forceinline__ int sw_perm32(int r) {
  return (r & ~31) | (((r >> 1) & 3) << 3) | (((r >> 3) & 3) << 1) | (r & 1);
}

template <typename T, int BM, int BN, int MINB>
struct SwRegsCfg {
  static constexpr int THREADS = kSwThreads, WARPS_N = 2, ST = 3;
  static constexpr int WTM = BM / 4, WTN = BN / WARPS_N;
  static constexpr int FM = WTM / 16, NG = WTN / 32, FN = NG * 4;
  static_assert(WTM % 16 == 0 && WTN % 32 == 0, "warp tile: 16-row strips x 32-column groups");
  static __host__ __device__ constexpr size_t a_bytes(int R) { return (size_t)BN * (R + 8) * sizeof(T); }
  static __host__ __device__ constexpr size_t stage_bytes(int R) {
    return a_bytes(R) + (size_t)R * (BM + 8) * sizeof(T);
  }
  static size_t smem(int R) { return ST * stage_bytes(R); }
};

template <typename T, int BM, int BN, int MINB>
__global__ void __launch_bounds__(kSwThreads, MINB)
    switch_regs_kernel(const SwitchDesc* __restrict__ descs, int n, long long total_tiles, int rmax) {
  using C = SwRegsCfg<T, BM, BN, MINB>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  long long* begins = reinterpret_cast<long long*>(smem_raw);
  unsigned char* ring = smem_raw + desc_cache_bytes(n);
  const size_t SB = C::stage_bytes(rmax);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tq = lane & 3;
  const int wm = (warp / C::WARPS_N) * C::WTM, wn = (warp % C::WARPS_N) * C::WTN;
  for (int i = tid; i < n; i += C::THREADS) begins[i] = descs[i].tile_begin;
  __syncthreads();
  griddep_wait();
  const SwSched sch{total_tiles, (int)gridDim.x, (int)blockIdx.x};
  const long long cnt = sch.count();
  const unsigned long long pol = sw_evict_first();
  SwCursor pc, cc;
  long long keys[C::ST];
#pragma unroll
  for (int i = 0; i < C::ST; ++i) keys[i] = -1;

  auto issue = [&](long long j, int s) {  // A chunk + band of the CTA's j-th tile into stage s
    const long long tile = sch.tile(j);
    pc.locate(begins, n, total_tiles, tile);
    const SwitchDesc& d = descs[pc.idx];
    const SwTile t(d, tile, pc.lo, BM, BN);
    unsigned char* base = ring + s * SB;
    const T* dummy = reinterpret_cast<const T*>(d.w);
    sw_load_a<T, BN, C::THREADS>(reinterpret_cast<T*>(base), d, t, dummy, [](int r) { return sw_perm32(r); });
    if (sw_take_slot(keys, s, sw_band_key(pc.idx, t.m0)))
      sw_load_band<T, BM, C::THREADS>(reinterpret_cast<T*>(base + C::a_bytes(rmax)), d, t, dummy);
  };
  // W of the CTA's j-th tile into registers: [m16 strip][32-column group][row g / g+8]
  auto load_w = [&](long long j, uint4 (&v)[C::FM][C::NG][2]) {
    const long long tile = sch.tile(j);
    pc.locate(begins, n, total_tiles, tile);
    const SwitchDesc& d = descs[pc.idx];
    const SwTile t(d, tile, pc.lo, BM, BN);
    const T* S = reinterpret_cast<const T*>(d.src ? d.src : d.w);
#pragma unroll
    for (int i = 0; i < C::FM; ++i)
#pragma unroll
      for (int q = 0; q < C::NG; ++q)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = t.m0 + wm + i * 16 + g + h * 8, col = t.n0 + wn + q * 32 + tq * 8;
          if (row < t.M && col < t.N) v[i][q][h] = sw_ld_stream(S + (long long)row * t.N + col, pol);
        }
  };

  uint4 wv[2][C::FM][C::NG][2];
  for (int s = 0; s < 2; ++s) {
    if (s < cnt) issue(s, s);
    cp_async_commit();
  }
  if (cnt > 0) load_w(0, wv[0]);
  if (cnt > 1) load_w(1, wv[1]);
  int sc = 0;
  for (long long jb = 0; jb < cnt; jb += 2) {
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const long long j = jb + u;
      if (j < cnt) {
        cp_async_wait<1>();
        __syncthreads();  // stage sc landed; stage sc+2 (tile j-1) no longer read
        if (j + 2 < cnt) issue(j + 2, sc == 0 ? 2 : sc - 1);
        cp_async_commit();
        const long long tile = sch.tile(j);
        cc.locate(begins, n, total_tiles, tile);
        const SwitchDesc& d = descs[cc.idx];
        const SwTile t(d, tile, cc.lo, BM, BN);
        const float s1 = d.s1, s2 = d.s2;
        const unsigned char* base = ring + sc * SB;
        float acc[C::FM][C::FN][4];
        sw_mma_tile<T, C::FM, C::FN, BM>(acc, reinterpret_cast<const T*>(base + C::a_bytes(rmax)),
                                         reinterpret_cast<const T*>(base), t.R + 8, wm, wn, t, s1, s2);
        const float fin = t.R > t.r1p ? s2 : s1;
        T* W = reinterpret_cast<T*>(d.w);
#pragma unroll
        for (int i = 0; i < C::FM; ++i)
#pragma unroll
          for (int q = 0; q < C::NG; ++q)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int row = t.m0 + wm + i * 16 + g + h * 8, col = t.n0 + wn + q * 32 + tq * 8;
              uint4 v = wv[u][i][q][h];
              v.x = SwMma<T>::fma2(v.x, acc[i][4 * q + 0][2 * h], acc[i][4 * q + 0][2 * h + 1], fin);
              v.y = SwMma<T>::fma2(v.y, acc[i][4 * q + 1][2 * h], acc[i][4 * q + 1][2 * h + 1], fin);
              v.z = SwMma<T>::fma2(v.z, acc[i][4 * q + 2][2 * h], acc[i][4 * q + 2][2 * h + 1], fin);
              v.w = SwMma<T>::fma2(v.w, acc[i][4 * q + 3][2 * h], acc[i][4 * q + 3][2 * h + 1], fin);
              if (row < t.M && col < t.N) sw_st_stream(W + (long long)row * t.N + col, v, pol);
            }
        if (j + 2 < cnt) load_w(j + 2, wv[u]);
        sc = sc == 2 ? 0 : sc + 1;
      }
    }
  }
  cp_async_wait<0>();
  griddep_launch();
}

// ---- registry glue (256-thread launches; launch_util.cuh's helpers assume kThreads) ------------------
template <typename Kernel>
cudaError_t sw_prepare(Kernel k) {
  return cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024);
}

// (every switch kernel has the same type: callers keep the once-per-kernel attribute state)
template <typename Kernel>
cudaError_t sw_launch(Kernel k, const void* a, int grid, size_t smem, cudaStream_t stream, bool pdl) {
  const SwitchLaunch* l = static_cast<const SwitchLaunch*>(a);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(kSwThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, k, l->descs, l->n, l->total_tiles, l->rmax);
}

template <typename Kernel>
cudaError_t sw_occupancy(Kernel k, int* blocks, size_t smem) {
  cudaError_t e = sw_prepare(k);
  if (e != cudaSuccess) return e;
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, k, kSwThreads, smem);
}

template <typename T, int BM, int BN, int STMAX, int MINB>
struct SwitchPipeOp {
  static size_t smem(int R) { return SwPipeCfg<T, BM, BN, STMAX, MINB>::smem(R); }
  static cudaError_t occ(int* b, size_t s) { return sw_occupancy(switch_pipe_kernel<T, BM, BN, STMAX, MINB>, b, s); }
  static cudaError_t launch(const void* a, int grid, size_t s, cudaStream_t st, bool pdl) {
    static const cudaError_t prepared = sw_prepare(switch_pipe_kernel<T, BM, BN, STMAX, MINB>);  // once per instantiation
    if (prepared != cudaSuccess) return prepared;
    return sw_launch(switch_pipe_kernel<T, BM, BN, STMAX, MINB>, a, grid, s, st, pdl);
  }
  static OpEntry entry(const char* name, int dtype) {
    return OpEntry{name, kSwitch, dtype, 0, 0, STMAX, 0, BN, BM, &smem, &occ, &launch};
  }
};

template <typename T, int BM, int BN, int MINB>
struct SwitchRegsOp {
  static size_t smem(int R) { return SwRegsCfg<T, BM, BN, MINB>::smem(R); }
  static cudaError_t occ(int* b, size_t s) { return sw_occupancy(switch_regs_kernel<T, BM, BN, MINB>, b, s); }
  static cudaError_t launch(const void* a, int grid, size_t s, cudaStream_t st, bool pdl) {
    static const cudaError_t prepared = sw_prepare(switch_regs_kernel<T, BM, BN, MINB>);  // once per instantiation
    if (prepared != cudaSuccess) return prepared;
    return sw_launch(switch_regs_kernel<T, BM, BN, MINB>, a, grid, s, st, pdl);
  }
  static OpEntry entry(const char* name, int dtype) {
    return OpEntry{name, kSwitch, dtype, 0, 0, SwRegsCfg<T, BM, BN, MINB>::ST, 0, BN, BM, &smem, &occ, &launch};
  }
};

}  // namespace

void register_switch(std::vector<OpEntry>& out) {
  // original kernel (atmm.cuh)
  out.push_back(SwitchOp<__nv_bfloat16, 64, 128>::entry("switch_bf16_bm64_bn128", kBF16));
  out.push_back(SwitchOp<__nv_bfloat16, 128, 64>::entry("switch_bf16_bm128_bn64", kBF16));
  out.push_back(SwitchOp<__nv_bfloat16, 32, 256>::entry("switch_bf16_bm32_bn256", kBF16));
  out.push_back(SwitchOp<__nv_bfloat16, 64, 64>::entry("switch_bf16_bm64_bn64", kBF16));
  out.push_back(SwitchOp<__half, 64, 128>::entry("switch_fp16_bm64_bn128", kFP16));
  // cp.async ring, ldmatrix/stmatrix epilogue in place in the stage, 2 CTAs/SM
  out.push_back(SwitchPipeOp<__nv_bfloat16, 64, 128, 4, 2>::entry("switch_bf16_pipe_bm64_bn128_s4_t256", kBF16));
  out.push_back(SwitchPipeOp<__nv_bfloat16, 128, 64, 4, 2>::entry("switch_bf16_pipe_bm128_bn64_s4_t256", kBF16));
  // W streamed through registers (permuted accumulator columns), 2 tiles in flight per thread
  out.push_back(SwitchRegsOp<__nv_bfloat16, 128, 64, 2>::entry("switch_bf16_regs_bm128_bn64_t256", kBF16));
  out.push_back(SwitchRegsOp<__nv_bfloat16, 64, 128, 2>::entry("switch_bf16_regs_bm64_bn128_t256", kBF16));
  // fp16 twins of the new families (so DEFAULT_CONFIG can name the same design for both dtypes)
  out.push_back(SwitchPipeOp<__half, 64, 128, 4, 2>::entry("switch_fp16_pipe_bm64_bn128_s4_t256", kFP16));
  out.push_back(SwitchPipeOp<__half, 128, 64, 4, 2>::entry("switch_fp16_pipe_bm128_bn64_s4_t256", kFP16));
  out.push_back(SwitchRegsOp<__half, 128, 64, 2>::entry("switch_fp16_regs_bm128_bn64_t256", kFP16));
  out.push_back(SwitchRegsOp<__half, 64, 128, 2>::entry("switch_fp16_regs_bm64_bn128_t256", kFP16));
}

}  // namespace valora
