// CUTLASS grouped-GEMM expand path (large token counts): after our split-K shrink, a small prep
// kernel turns the fp32 partials into s_k * (x A_k) rows in 16-bit (one rounding) and writes one
// GEMM problem per segment (M = segment length, N = h_out, K = r_k; slot -1 / unused = M 0) into
// device arrays; CUTLASS's GemmGrouped (device-side schedule, no host precompute, so CUDA-graph
// safe) then computes y_seg = xa_seg B_k + y_seg with beta = 1 (fp32 accumulate, one rounding).
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/device/gemm_grouped.h"
#include "cutlass/gemm/gemm.h"
#include "cutlass/gemm/kernel/default_gemm_grouped.h"
#include "launch_util.cuh"

namespace valora {

// aux layout (bytes): sizes[cap] GemmCoord | ptr A, B, C [cap] each | ld A, B, C [cap] each | xa [T][rs]
struct AuxLayout {
  size_t sizes, pa, pb, pc, lda, ldb, ldc, xa, total;
  __host__ __device__ AuxLayout(int cap, int T, int rs) {
    auto al = [](size_t v) { return (v + 255) & ~(size_t)255; };
    sizes = 0;
    pa = al(sizes + (size_t)cap * sizeof(cutlass::gemm::GemmCoord));
    pb = al(pa + (size_t)cap * 8);
    pc = al(pb + (size_t)cap * 8);
    lda = al(pc + (size_t)cap * 8);
    ldb = al(lda + (size_t)cap * 8);
    ldc = al(ldb + (size_t)cap * 8);
    xa = al(ldc + (size_t)cap * 8);
    total = al(xa + (size_t)T * rs * 2);
  }
};

template <typename T>
__global__ void __launch_bounds__(256) grouped_prep_kernel(AtmmArgs p, unsigned char* aux) {
  const AuxLayout L(p.seg_cap, p.T, p.rank_stride);
  auto* sizes = reinterpret_cast<cutlass::gemm::GemmCoord*>(aux + L.sizes);
  auto** pa = reinterpret_cast<T**>(aux + L.pa);
  auto** pb = reinterpret_cast<T**>(aux + L.pb);
  auto** pc = reinterpret_cast<T**>(aux + L.pc);
  auto* lda = reinterpret_cast<int64_t*>(aux + L.lda);
  auto* ldb = reinterpret_cast<int64_t*>(aux + L.ldb);
  auto* ldc = reinterpret_cast<int64_t*>(aux + L.ldc);
  T* xa = reinterpret_cast<T*>(aux + L.xa);
  const int cap = p.seg_cap, rs = p.rank_stride;
  const int S = p.meta[0];
  const int* seg_starts = p.meta + 1;
  const int* seg_slots = seg_starts + cap + 1;
  const long long gtid = (long long)blockIdx.x * blockDim.x + threadIdx.x, nthr = (long long)gridDim.x * blockDim.x;
  T* Y = reinterpret_cast<T*>(p.y);
  for (long long s = gtid; s < cap; s += nthr) {
    int M = 0, K = 8;
    T* A = xa;
    T* B = xa;
    T* C = Y;
    if (s < S) {
      const int slot = seg_slots[s], lo = seg_starts[s], hi = seg_starts[s + 1];
      if (slot >= 0 && hi > lo) {
        M = hi - lo;
        K = p.ranks[slot];
        A = xa + (long long)lo * rs;
        B = reinterpret_cast<T*>(p.b_ptrs[slot]);
        C = Y + (long long)lo * p.y_ld;
      }
    }
    sizes[s] = cutlass::gemm::GemmCoord(M, p.h_out, K);
    pa[s] = A;
    pb[s] = B;
    pc[s] = C;
    lda[s] = rs;
    ldb[s] = p.h_out;
    ldc[s] = p.y_ld;
  }
  const long long n = (long long)p.T * rs;
  for (long long e = gtid; e < n; e += nthr) {
    const int t = (int)(e / rs), j = (int)(e - (long long)t * rs);
    int lo = 0, hi = S - 1;  // segment holding token t: largest s with start <= t
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (seg_starts[mid] <= t) lo = mid; else hi = mid - 1;
    }
    float v = 0.f;
    const int slot = S > 0 ? seg_slots[lo] : -1;
    if (slot >= 0 && t < seg_starts[S] && j < p.ranks[slot]) {
      const float* w = p.ws + (long long)t * rs + j;
      for (int kc = 0; kc < p.split_k; ++kc) v += w[(long long)kc * p.T * rs];
      v *= p.scales[slot];
    }
    xa[e] = Cvt<T>::from(v);
  }
}

template <typename T, typename CT, int TBM, int TBN, int WM, int WN, int STAGES>
struct GroupedOp {
  using GemmKernel = typename cutlass::gemm::kernel::DefaultGemmGrouped<
      CT, cutlass::layout::RowMajor, cutlass::ComplexTransform::kNone, 8,
      CT, cutlass::layout::RowMajor, cutlass::ComplexTransform::kNone, 8,
      CT, cutlass::layout::RowMajor, float, cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80,
      cutlass::gemm::GemmShape<TBM, TBN, 32>, cutlass::gemm::GemmShape<WM, WN, 32>, cutlass::gemm::GemmShape<16, 8, 16>,
      cutlass::epilogue::thread::LinearCombination<CT, 8, float, float>,
      cutlass::gemm::threadblock::GemmBatchedIdentityThreadblockSwizzle, STAGES,
      cutlass::gemm::kernel::GroupScheduleMode::kDeviceOnly>::GemmKernel;
  using Gemm = cutlass::gemm::device::GemmGrouped<GemmKernel>;

  static size_t smem(int) { return sizeof(typename GemmKernel::SharedStorage); }
  static cudaError_t occ(int* b, size_t) {
    *b = Gemm::maximum_active_blocks();
    return *b > 0 ? cudaSuccess : cudaErrorInvalidConfiguration;
  }
  static cudaError_t launch(const void* a, int grid, size_t, cudaStream_t st, bool) {
    const GroupedLaunch& g = *static_cast<const GroupedLaunch*>(a);
    const AtmmArgs& p = g.args;
    const AuxLayout L(p.seg_cap, p.T, p.rank_stride);
    const long long work = (long long)p.T * p.rank_stride;
    const int pgrid = (int)std::min<long long>(1024, std::max<long long>(1, (work + 255) / 256));
    grouped_prep_kernel<T><<<pgrid, 256, 0, st>>>(p, g.aux);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
    typename Gemm::EpilogueOutputOp::Params epi(1.0f, 1.0f);
    typename Gemm::Arguments args(reinterpret_cast<cutlass::gemm::GemmCoord*>(g.aux + L.sizes), p.seg_cap, grid, epi,
                                  reinterpret_cast<CT**>(g.aux + L.pa), reinterpret_cast<CT**>(g.aux + L.pb),
                                  reinterpret_cast<CT**>(g.aux + L.pc), reinterpret_cast<CT**>(g.aux + L.pc),
                                  reinterpret_cast<int64_t*>(g.aux + L.lda), reinterpret_cast<int64_t*>(g.aux + L.ldb),
                                  reinterpret_cast<int64_t*>(g.aux + L.ldc), reinterpret_cast<int64_t*>(g.aux + L.ldc));
    Gemm gemm;
    cutlass::Status s = gemm.initialize(args, nullptr, st);
    if (s != cutlass::Status::kSuccess) return cudaErrorInvalidValue;
    s = gemm.run(st);
    if (s != cutlass::Status::kSuccess) return cudaErrorLaunchFailure;
    return cudaGetLastError();
  }
  static OpEntry entry(const char* name, int dtype) {
    return OpEntry{name, kGroupedExpand, dtype, TBM, 32, STAGES, 0, TBN, 0, &smem, &occ, &launch};
  }
};

size_t grouped_aux_bytes(int cap, int T, int rank_stride) { return AuxLayout(cap, T, rank_stride).total; }

void register_grouped(std::vector<OpEntry>& out) {
  out.push_back(GroupedOp<__nv_bfloat16, cutlass::bfloat16_t, 64, 128, 32, 64, 3>::entry("grouped_bf16_m64n128", kBF16));
  out.push_back(GroupedOp<__nv_bfloat16, cutlass::bfloat16_t, 128, 128, 64, 64, 3>::entry("grouped_bf16_m128n128", kBF16));
  out.push_back(GroupedOp<__half, cutlass::half_t, 64, 128, 32, 64, 3>::entry("grouped_fp16_m64n128", kFP16));
}

}  // namespace valora
