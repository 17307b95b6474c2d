// pybind11 binding (through torch's cpp_extension) of the ATMM and switch kernels.
// Thin: checks every input (dtype, device, contiguity, shapes, alignment), picks the menu
// entry the caller named, sizes the persistent grid from the occupancy API and launches on
// the current stream. Errors raise RuntimeError with the CUDA status text.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <stdexcept>
#include <type_traits>
#include <string>
#include <unordered_map>
#include <vector>

#include "atmm_api.h"
#include "layer_ops.h"

namespace valora {
namespace {

// Error messages are assembled without iostreams (std::to_string, c10::toString): formatting
// numbers through an ostringstream inside the extension crashed on the GPU image (a libstdc++
// locale mismatch between the extension and the loaded runtime, seen as a segfault in error paths).
inline void app(std::string& s, const char* v) { s += v; }
inline void app(std::string& s, const std::string& v) { s += v; }
template <typename I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
inline void app(std::string& s, I v) { s += std::to_string(v); }
inline void app(std::string& s, c10::ScalarType t) { s += c10::toString(t); }
inline void app(std::string& s, const c10::Device& d) { s += d.str(); }
template <typename... A>
std::string cat(const A&... a) {
  std::string s;
  (app(s, a), ...);
  return s;
}

}  // namespace
}  // namespace valora

// Input/status checks raise RuntimeError (std::runtime_error through pybind11) with the message.
#define VALORA_CHECK(cond, ...)                                         \
  do {                                                                  \
    if (!(cond)) throw std::runtime_error(::valora::cat(__VA_ARGS__)); \
  } while (0)

namespace valora {
namespace {

const std::vector<OpEntry>& registry() {
  static const std::vector<OpEntry> reg = [] {
    std::vector<OpEntry> r;
    register_atmm_bf16(r);
    register_atmm_fp16(r);
    register_switch(r);
    register_grouped(r);
    return r;
  }();
  return reg;
}

const OpEntry& entry(int64_t id, int kind) {
  const auto& reg = registry();
  VALORA_CHECK(id >= 0 && id < (int64_t)reg.size(), "kernel config id ", id, " out of range [0, ", reg.size(), ")");
  const OpEntry& e = reg[id];
  VALORA_CHECK(e.kind == kind, "kernel config ", e.name, " is not of the requested kind");
  return e;
}

void check_cuda(cudaError_t err, const char* what, const OpEntry& e) {
  VALORA_CHECK(err == cudaSuccess, what, " (", e.name, ") failed: ", cudaGetErrorName(err), ": ", cudaGetErrorString(err));
}

int sm_count(int device) {
  static std::unordered_map<int, int> cache;
  auto it = cache.find(device);
  if (it != cache.end()) return it->second;
  int n = 0;
  cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
  cache[device] = n;
  return n;
}

size_t smem_limit(int device) {
  int v = 0;
  cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  return (size_t)v;
}

// Grid policy: 0 = persistent (resident CTAs per SM from the occupancy API, each looping over
// items), -1 = one item per CTA, k > 0 = at most k CTAs per SM. Benchmarks/tile search set it.
int g_grid_policy = 0;

int persistent_grid(const OpEntry& e, size_t smem, int64_t items, int device) {
  if (items <= 0) return 1;
  if (g_grid_policy < 0) return (int)std::min<int64_t>(items, 1 << 30);
  static std::unordered_map<std::string, int> occ_cache;
  std::string key = std::string(e.name) + "/" + std::to_string(smem);
  int blocks = 0;
  auto it = occ_cache.find(key);
  if (it != occ_cache.end()) {
    blocks = it->second;
  } else {
    check_cuda(e.occupancy(&blocks, smem), "occupancy query", e);
    VALORA_CHECK(blocks > 0, e.name, ": does not fit on this GPU with ", smem, " bytes of shared memory");
    occ_cache[key] = blocks;
  }
  if (g_grid_policy > 0) blocks = g_grid_policy;
  return (int)std::min<int64_t>(items, (int64_t)blocks * sm_count(device));
}

int dtype_code(const torch::Tensor& t) {
  if (t.scalar_type() == torch::kBFloat16) return kBF16;
  if (t.scalar_type() == torch::kHalf) return kFP16;
  VALORA_CHECK(false, "expected a bfloat16 or float16 tensor, got ", t.scalar_type());
  return -1;
}

void check_on(const torch::Tensor& t, const char* name, const torch::Device& dev, torch::ScalarType st) {
  VALORA_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  VALORA_CHECK(t.device() == dev, name, " is on ", t.device(), ", expected ", dev);
  VALORA_CHECK(t.scalar_type() == st, name, " must be ", st, ", got ", t.scalar_type());
  VALORA_CHECK(t.is_contiguous(), name, " must be contiguous");
}

struct Atmm {
  AtmmArgs args;
  int dtype;
  int device;
};

Atmm make_args(const torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& meta, int64_t seg_cap,
               const torch::Tensor& a_ptrs, const torch::Tensor& b_ptrs, const torch::Tensor& ranks,
               const torch::Tensor& scales, const torch::Tensor& ws, int64_t split_k, int64_t rank_stride) {
  VALORA_CHECK(x.is_cuda() && y.is_cuda(), "x and y must be CUDA tensors");
  const auto dev = x.device();
  VALORA_CHECK(y.device() == dev, "y is on ", y.device(), ", x on ", dev);
  VALORA_CHECK(x.dim() == 2 && y.dim() == 2, "x and y must be 2-D (tokens, features), got ", x.dim(), "-D and ", y.dim(), "-D");
  VALORA_CHECK(x.scalar_type() == y.scalar_type(), "x is ", x.scalar_type(), " but y is ", y.scalar_type());
  const int dt = dtype_code(x);
  VALORA_CHECK(x.stride(1) == 1 && y.stride(1) == 1, "x and y need unit stride along features");
  VALORA_CHECK(x.size(0) == y.size(0), "x has ", x.size(0), " tokens, y has ", y.size(0));
  VALORA_CHECK(x.size(1) % 8 == 0 && y.size(1) % 8 == 0, "h_in and h_out must be multiples of 8, got ", x.size(1), ", ", y.size(1));
  VALORA_CHECK(x.stride(0) % 8 == 0 && y.stride(0) % 8 == 0, "row strides must be multiples of 8 elements");
  VALORA_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && reinterpret_cast<uintptr_t>(y.data_ptr()) % 16 == 0,
              "x and y must be 16-byte aligned");
  check_on(meta, "meta", dev, torch::kInt32);
  VALORA_CHECK(seg_cap >= 1 && seg_cap <= 4096, "plan capacity must be 1..4096 segments, got ", seg_cap);
  VALORA_CHECK( meta.numel() >= 1 + (seg_cap + 1) + seg_cap + kNumBt * (seg_cap + 1),
              "meta holds ", meta.numel(), " ints, too few for a plan of ", seg_cap, " segments");
  check_on(a_ptrs, "a_ptrs", dev, torch::kInt64);
  check_on(b_ptrs, "b_ptrs", dev, torch::kInt64);
  check_on(ranks, "ranks", dev, torch::kInt32);
  check_on(scales, "scales", dev, torch::kFloat32);
  const int64_t slots = a_ptrs.numel();
  VALORA_CHECK(b_ptrs.numel() == slots && ranks.numel() == slots && scales.numel() == slots,
              "a_ptrs, b_ptrs, ranks, scales must have one entry per slot (", slots, ", ", b_ptrs.numel(), ", ",
              ranks.numel(), ", ", scales.numel(), ")");
  check_on(ws, "workspace", dev, torch::kFloat32);
  VALORA_CHECK(split_k >= 1, "split_k must be >= 1");
  VALORA_CHECK(rank_stride >= 16 && rank_stride <= 128 && rank_stride % 16 == 0, "rank_stride must be 16..128, a multiple of 16; got ", rank_stride);
  VALORA_CHECK(ws.numel() >= split_k * x.size(0) * rank_stride, "workspace holds ", ws.numel(), " floats, needs ",
              split_k * x.size(0) * rank_stride, " (split_k x tokens x rank_stride)");
  Atmm a;
  a.dtype = dt;
  a.device = dev.index();
  AtmmArgs& p = a.args;
  p.meta = meta.data_ptr<int>();
  p.seg_cap = (int)seg_cap;
  p.a_ptrs = reinterpret_cast<const long long*>(a_ptrs.data_ptr<int64_t>());
  p.b_ptrs = reinterpret_cast<const long long*>(b_ptrs.data_ptr<int64_t>());
  p.ranks = ranks.data_ptr<int>();
  p.scales = scales.data_ptr<float>();
  p.x = x.data_ptr();
  p.y = y.data_ptr();
  p.ws = ws.data_ptr<float>();
  p.T = (int)x.size(0);
  p.h_in = (int)x.size(1);
  p.h_out = (int)y.size(1);
  p.rank_stride = (int)rank_stride;
  p.split_k = (int)split_k;
  p.k_chunk = 0;
  p.x_ld = x.stride(0);
  p.y_ld = y.stride(0);
  p.xa = nullptr;
  p.xa_cols = nullptr;
  p.xa_ld = 0;
  return a;
}

void launch_shrink(Atmm& a, int64_t cfg, int64_t tiles_hint, bool pdl) {
  const OpEntry& e = entry(cfg, kShrink);
  VALORA_CHECK(e.dtype == a.dtype, e.name, " does not match the tensors' dtype");
  VALORA_CHECK(a.args.rank_stride <= 16 * e.rb, e.name, " handles ranks up to ", 16 * e.rb, ", plan needs ", a.args.rank_stride);
  const int per = (a.args.h_in + a.args.split_k - 1) / a.args.split_k;
  a.args.k_chunk = (per + e.bk - 1) / e.bk * e.bk;
  const size_t smem = e.smem(a.args.rank_stride) + seg_cache_bytes(a.args.seg_cap);
  VALORA_CHECK(smem <= smem_limit(a.device), e.name, " needs ", smem, " bytes of shared memory, the GPU allows ", smem_limit(a.device));
  const int grid = persistent_grid(e, smem, tiles_hint * a.args.split_k, a.device);
  check_cuda(e.launch(&a.args, grid, smem, c10::cuda::getCurrentCUDAStream(), pdl), "shrink launch", e);
}

void launch_expand(Atmm& a, int64_t cfg, int64_t tiles_hint, bool pdl) {
  const OpEntry& e = entry(cfg, kExpand);
  VALORA_CHECK(e.dtype == a.dtype, e.name, " does not match the tensors' dtype");
  const size_t smem = e.smem(a.args.rank_stride) + seg_cache_bytes(a.args.seg_cap);
  VALORA_CHECK(smem <= smem_limit(a.device), e.name, " needs ", smem, " bytes of shared memory at rank stride ",
              a.args.rank_stride, ", the GPU allows ", smem_limit(a.device));
  const int64_t ntn = (a.args.h_out + e.bn - 1) / e.bn;
  const int grid = persistent_grid(e, smem, tiles_hint * ntn, a.device);
  check_cuda(e.launch(&a.args, grid, smem, c10::cuda::getCurrentCUDAStream(), pdl), "expand launch", e);
}

// y += s_k (x A_k) B_k over the plan's segments: shrink then expand (see atmm.cuh).
void atmm(torch::Tensor y, torch::Tensor x, torch::Tensor meta, int64_t seg_cap, torch::Tensor a_ptrs,
          torch::Tensor b_ptrs, torch::Tensor ranks, torch::Tensor scales, torch::Tensor ws, int64_t shrink_cfg,
          int64_t expand_cfg, int64_t split_k, int64_t rank_stride, int64_t shrink_tiles, int64_t expand_tiles,
          bool pdl) {
  Atmm a = make_args(y, x, meta, seg_cap, a_ptrs, b_ptrs, ranks, scales, ws, split_k, rank_stride);
  const c10::cuda::CUDAGuard guard(x.device());
  launch_shrink(a, shrink_cfg, shrink_tiles, pdl);
  launch_expand(a, expand_cfg, expand_tiles, pdl);
}

void atmm_shrink(torch::Tensor y, torch::Tensor x, torch::Tensor meta, int64_t seg_cap, torch::Tensor a_ptrs,
                 torch::Tensor b_ptrs, torch::Tensor ranks, torch::Tensor scales, torch::Tensor ws, int64_t cfg,
                 int64_t split_k, int64_t rank_stride, int64_t tiles, bool pdl) {
  Atmm a = make_args(y, x, meta, seg_cap, a_ptrs, b_ptrs, ranks, scales, ws, split_k, rank_stride);
  const c10::cuda::CUDAGuard guard(x.device());
  launch_shrink(a, cfg, tiles, pdl);
}

void atmm_expand(torch::Tensor y, torch::Tensor x, torch::Tensor meta, int64_t seg_cap, torch::Tensor a_ptrs,
                 torch::Tensor b_ptrs, torch::Tensor ranks, torch::Tensor scales, torch::Tensor ws, int64_t cfg,
                 int64_t split_k, int64_t rank_stride, int64_t tiles, bool pdl) {
  Atmm a = make_args(y, x, meta, seg_cap, a_ptrs, b_ptrs, ranks, scales, ws, split_k, rank_stride);
  const c10::cuda::CUDAGuard guard(x.device());
  launch_expand(a, cfg, tiles, pdl);
}

// y += s_k xa[:, cols[k] : cols[k] + r_k] B_k over the plan's segments: the expand alone, on x·A
// that something else computed (a base GEMM over weights extended with the slots' A^T rows).
void atmm_expand_xa(torch::Tensor y, torch::Tensor xa, torch::Tensor xa_cols, torch::Tensor meta, int64_t seg_cap,
                    torch::Tensor b_ptrs, torch::Tensor ranks, torch::Tensor scales, torch::Tensor ws, int64_t cfg,
                    int64_t rank_stride, int64_t tiles, bool pdl) {
  Atmm a = make_args(y, xa, meta, seg_cap, b_ptrs, b_ptrs, ranks, scales, ws, 1, rank_stride);
  check_on(xa_cols, "xa_cols", xa.device(), torch::kInt32);
  VALORA_CHECK(xa_cols.numel() == b_ptrs.numel(), "xa_cols must have one entry per slot (", b_ptrs.numel(), "), got ",
              xa_cols.numel());
  a.args.xa = xa.data_ptr();
  a.args.xa_cols = xa_cols.data_ptr<int>();
  a.args.xa_ld = xa.stride(0);
  const c10::cuda::CUDAGuard guard(xa.device());
  launch_expand(a, cfg, tiles, pdl);
}

void launch_grouped(Atmm& a, const torch::Tensor& aux, int64_t cfg) {
  const OpEntry& e = entry(cfg, kGroupedExpand);
  VALORA_CHECK(e.dtype == a.dtype, e.name, " does not match the tensors' dtype");
  VALORA_CHECK(aux.is_cuda() && aux.scalar_type() == torch::kUInt8 && aux.is_contiguous(), "aux must be a contiguous CUDA uint8 buffer");
  const size_t need = grouped_aux_bytes(a.args.seg_cap, a.args.T, a.args.rank_stride);
  VALORA_CHECK((size_t)aux.numel() >= need, "aux holds ", (int64_t)aux.numel(), " bytes, the grouped path needs ", need);
  GroupedLaunch g{a.args, aux.data_ptr<uint8_t>()};
  const int grid = persistent_grid(e, e.smem(0), (int64_t)1 << 30, a.device);
  check_cuda(e.launch(&g, grid, e.smem(0), c10::cuda::getCurrentCUDAStream(), false), "CUTLASS grouped expand", e);
}

// y += s_k (x A_k) B_k: our split-K shrink, then the CUTLASS grouped-GEMM expand.
void atmm_grouped(torch::Tensor y, torch::Tensor x, torch::Tensor meta, int64_t seg_cap, torch::Tensor a_ptrs,
                  torch::Tensor b_ptrs, torch::Tensor ranks, torch::Tensor scales, torch::Tensor ws, torch::Tensor aux,
                  int64_t shrink_cfg, int64_t grouped_cfg, int64_t split_k, int64_t rank_stride, int64_t shrink_tiles,
                  bool pdl) {
  Atmm a = make_args(y, x, meta, seg_cap, a_ptrs, b_ptrs, ranks, scales, ws, split_k, rank_stride);
  const c10::cuda::CUDAGuard guard(x.device());
  launch_shrink(a, shrink_cfg, shrink_tiles, pdl);
  launch_grouped(a, aux, grouped_cfg);
}

// the grouped expand alone (reads the workspace the shrink wrote); for the tile search
void atmm_grouped_expand(torch::Tensor y, torch::Tensor x, torch::Tensor meta, int64_t seg_cap, torch::Tensor a_ptrs,
                         torch::Tensor b_ptrs, torch::Tensor ranks, torch::Tensor scales, torch::Tensor ws,
                         torch::Tensor aux, int64_t grouped_cfg, int64_t split_k, int64_t rank_stride) {
  Atmm a = make_args(y, x, meta, seg_cap, a_ptrs, b_ptrs, ranks, scales, ws, split_k, rank_stride);
  const c10::cuda::CUDAGuard guard(x.device());
  launch_grouped(a, aux, grouped_cfg);
}

// descs: (n, 8) int64 rows [w, a1, b1, a2, b2, M | N << 32, r1 | r2 << 32, tile_begin];
// scales: (n, 2) float32 [s1, s2]. Packed into SwitchDesc structs in a device workspace.
void switch_(torch::Tensor descs, torch::Tensor scales, torch::Tensor work, int64_t total_tiles, int64_t rmax,
             int64_t cfg, int64_t dtype, bool pdl) {
  const OpEntry& e = entry(cfg, kSwitch);
  VALORA_CHECK(e.dtype == dtype, e.name, " does not match the weights' dtype");
  VALORA_CHECK(descs.is_cuda() && descs.scalar_type() == torch::kInt64 && descs.is_contiguous() && descs.dim() == 2 &&
                  descs.size(1) == 8,
              "descs must be a contiguous CUDA int64 tensor of shape (n, 8)");
  const auto dev = descs.device();
  check_on(scales, "scales", dev, torch::kFloat32);
  check_on(work, "work", dev, torch::kUInt8);
  const int64_t n = descs.size(0);
  VALORA_CHECK(n >= 1 && scales.numel() == 2 * n, "scales must be (n, 2)");
  VALORA_CHECK(work.numel() >= n * (int64_t)sizeof(SwitchDesc), "work buffer too small");
  VALORA_CHECK(rmax >= 16 && rmax <= 256 && rmax % 16 == 0, "padded total rank must be 16..256, got ", rmax);
  const c10::cuda::CUDAGuard guard(dev);
  auto stream = c10::cuda::getCurrentCUDAStream();
  // pack on the host side of the stream: descs/scales -> SwitchDesc[] with one tiny kernel-free copy
  auto hd = descs.cpu();
  auto hs = scales.cpu();
  std::vector<SwitchDesc> packed(n);
  const int64_t* d = hd.data_ptr<int64_t>();
  const float* s = hs.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    SwitchDesc& o = packed[i];
    o.w = d[i * 8 + 0]; o.a1 = d[i * 8 + 1]; o.b1 = d[i * 8 + 2]; o.a2 = d[i * 8 + 3]; o.b2 = d[i * 8 + 4];
    o.M = (int)(d[i * 8 + 5] & 0xffffffff); o.N = (int)(d[i * 8 + 5] >> 32);
    o.r1 = (int)(d[i * 8 + 6] & 0xffffffff); o.r2 = (int)(d[i * 8 + 6] >> 32);
    o.s1 = s[i * 2]; o.s2 = s[i * 2 + 1];
    o.tile_begin = d[i * 8 + 7];
  }
  check_cuda(cudaMemcpyAsync(work.data_ptr(), packed.data(), n * sizeof(SwitchDesc), cudaMemcpyHostToDevice, stream),
             "descriptor copy", e);
  check_cuda(cudaStreamSynchronize(stream), "descriptor copy", e);  // `packed` is pageable and local
  SwitchLaunch l{reinterpret_cast<const SwitchDesc*>(work.data_ptr()), (int)n, total_tiles, (int)rmax};
  const size_t smem = e.smem((int)rmax) + desc_cache_bytes((int)n);
  VALORA_CHECK(smem <= smem_limit(dev.index()), e.name, " needs ", smem, " bytes of shared memory");
  const int grid = persistent_grid(e, smem, total_tiles, dev.index());
  check_cuda(e.launch(&l, grid, smem, stream, pdl), "switch launch", e);
}

// switch kernel on descriptors already packed on the device (graph-capturable; no host sync).
void switch_packed(torch::Tensor work, int64_t n, int64_t total_tiles, int64_t rmax, int64_t cfg, bool pdl) {
  const OpEntry& e = entry(cfg, kSwitch);
  VALORA_CHECK(work.is_cuda() && work.scalar_type() == torch::kUInt8 && work.numel() >= n * (int64_t)sizeof(SwitchDesc),
              "work must be a CUDA uint8 buffer holding n packed descriptors");
  VALORA_CHECK(rmax >= 16 && rmax <= 256 && rmax % 16 == 0, "padded total rank must be 16..256, got ", rmax);
  const c10::cuda::CUDAGuard guard(work.device());
  SwitchLaunch l{reinterpret_cast<const SwitchDesc*>(work.data_ptr()), (int)n, total_tiles, (int)rmax};
  const size_t smem = e.smem((int)rmax) + desc_cache_bytes((int)n);
  VALORA_CHECK(smem <= smem_limit(work.device().index()), e.name, " needs ", smem, " bytes of shared memory");
  const int grid = persistent_grid(e, smem, total_tiles, work.device().index());
  check_cuda(e.launch(&l, grid, smem, c10::cuda::getCurrentCUDAStream(), pdl), "switch launch", e);
}

// ---- decoder-layer elementwise ops (layer_ops.cu) ----

int layer_dtype(const torch::Tensor& t) {
  if (t.scalar_type() == torch::kBFloat16) return kLayerBF16;
  if (t.scalar_type() == torch::kHalf) return kLayerFP16;
  if (t.scalar_type() == torch::kFloat) return kLayerFP32;
  VALORA_CHECK(false, "expected a bfloat16, float16 or float32 tensor, got ", t.scalar_type());
  return -1;
}

// A (rows, features) operand: CUDA, on `dev`, of dtype `st`, unit stride along features.
void check_rows(const torch::Tensor& t, const char* name, const torch::Device& dev, torch::ScalarType st, int64_t rows,
                int64_t features) {
  VALORA_CHECK(t.is_cuda() && t.device() == dev, name, " must be on ", dev, ", is on ", t.device());
  VALORA_CHECK(t.scalar_type() == st, name, " must be ", st, ", got ", t.scalar_type());
  VALORA_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == features, name, " must be (", rows, ", ", features,
              "), got ", t.dim(), "-D with ", t.numel(), " elements");
  VALORA_CHECK(t.stride(1) == 1 || features == 1, name, " needs unit stride along features");
}

void check_layer(cudaError_t err, const char* what) {
  VALORA_CHECK(err == cudaSuccess, what, " launch failed: ", cudaGetErrorName(err), ": ", cudaGetErrorString(err));
}

// out = w * norm(x) (add absent) or sum = x + add, out = w * norm(sum); all (rows, hidden).
void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor w, double eps, c10::optional<torch::Tensor> add,
              c10::optional<torch::Tensor> sum) {
  VALORA_CHECK(x.dim() == 2, "x must be 2-D (rows, hidden), got ", x.dim(), "-D");
  const auto dev = x.device();
  const auto st = x.scalar_type();
  const int64_t rows = x.size(0), hidden = x.size(1);
  check_rows(x, "x", dev, st, rows, hidden);
  check_rows(out, "out", dev, st, rows, hidden);
  VALORA_CHECK(w.is_cuda() && w.device() == dev && w.scalar_type() == st && w.dim() == 1 && w.size(0) == hidden &&
                  w.is_contiguous(),
              "w must be a contiguous (", hidden, ",) ", st, " tensor on ", dev);
  VALORA_CHECK(add.has_value() == sum.has_value(), "add and sum go together");
  RmsNormArgs a{out.data_ptr(), x.data_ptr(), nullptr, nullptr, w.data_ptr(), (int)rows, (int)hidden,
                out.stride(0), x.stride(0), 0, 0, (float)eps};
  if (add.has_value()) {
    check_rows(*add, "add", dev, st, rows, hidden);
    check_rows(*sum, "sum", dev, st, rows, hidden);
    a.add = add->data_ptr();
    a.sum = sum->data_ptr();
    a.add_ld = add->stride(0);
    a.sum_ld = sum->stride(0);
  }
  const c10::cuda::CUDAGuard guard(dev);
  check_layer(launch_rms_norm(layer_dtype(x), a, c10::cuda::getCurrentCUDAStream()), "rms_norm");
}

// In place on q (tokens, q_heads, head_dim) and k (tokens, k_heads, head_dim); cos/sin (tokens, head_dim).
void rotary_(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  VALORA_CHECK(q.dim() == 3 && k.dim() == 3, "q and k must be 3-D (tokens, heads, head_dim)");
  const auto dev = q.device();
  const auto st = q.scalar_type();
  const int64_t tokens = q.size(0), d = q.size(2);
  VALORA_CHECK(d % 2 == 0, "head_dim must be even, got ", d);
  for (const auto* t : {&q, &k}) {
    VALORA_CHECK(t->is_cuda() && t->device() == dev && t->scalar_type() == st, "q and k must share device and dtype");
    VALORA_CHECK(t->size(0) == tokens && t->size(2) == d, "q and k must have the same tokens and head_dim");
    VALORA_CHECK(t->stride(2) == 1 && t->stride(1) == d, "q and k need contiguous heads (strides (*, head_dim, 1))");
  }
  check_rows(cos, "cos", dev, st, tokens, d);
  check_rows(sin, "sin", dev, st, tokens, d);
  VALORA_CHECK(cos.stride(0) == sin.stride(0), "cos and sin must have the same token stride");
  RotaryArgs a{q.data_ptr(), k.data_ptr(), cos.data_ptr(), sin.data_ptr(), (int)tokens, (int)q.size(1),
               (int)k.size(1), (int)d, q.stride(0), k.stride(0), cos.stride(0)};
  const c10::cuda::CUDAGuard guard(dev);
  check_layer(launch_rotary(layer_dtype(q), a, c10::cuda::getCurrentCUDAStream()), "rotary");
}

// out = silu(gate) * up, all (rows, width); out may be gate.
void silu_mul(torch::Tensor out, torch::Tensor gate, torch::Tensor up) {
  VALORA_CHECK(gate.dim() == 2, "gate must be 2-D (rows, width)");
  const auto dev = gate.device();
  const auto st = gate.scalar_type();
  const int64_t rows = gate.size(0), width = gate.size(1);
  check_rows(gate, "gate", dev, st, rows, width);
  check_rows(up, "up", dev, st, rows, width);
  check_rows(out, "out", dev, st, rows, width);
  SiluMulArgs a{out.data_ptr(), gate.data_ptr(), up.data_ptr(), rows, (int)width, out.stride(0), gate.stride(0),
                up.stride(0)};
  const c10::cuda::CUDAGuard guard(dev);
  check_layer(launch_silu_mul(layer_dtype(gate), a, c10::cuda::getCurrentCUDAStream()), "silu_mul");
}

pybind11::list configs() {
  pybind11::list out;
  const auto& reg = registry();
  for (size_t i = 0; i < reg.size(); ++i) {
    const OpEntry& e = reg[i];
    static const char* kinds[] = {"shrink", "expand", "switch", "grouped_shrink", "grouped_expand"};
    pybind11::dict d;
    d["id"] = (int)i;
    d["name"] = e.name;
    d["kind"] = kinds[e.kind];
    d["dtype"] = e.dtype == kBF16 ? "bfloat16" : "float16";
    d["bt"] = e.bt; d["bk"] = e.bk; d["stages"] = e.stages; d["rb"] = e.rb; d["bn"] = e.bn; d["bm"] = e.bm;
    d["smem_r16"] = e.smem(16); d["smem_r128"] = e.smem(128);
    out.append(d);
  }
  return out;
}

}  // namespace
}  // namespace valora

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "valora ATMM (multi-LoRA shrink+expand) and switch kernels; use kernels.atmm, not this module";
  m.def("configs", &valora::configs, "the precompiled kernel menu: list of dicts (id, name, kind, dtype, tiles)");
  m.def("atmm", &valora::atmm, "y += s_k (x A_k) B_k over the plan's segments (shrink + expand)");
  m.def("atmm_shrink", &valora::atmm_shrink, "split-K shrink into the workspace only");
  m.def("atmm_expand", &valora::atmm_expand, "expand from the workspace into y only");
  m.def("atmm_expand_xa", &valora::atmm_expand_xa, "expand from x·A columns of another tensor into y");
  m.def("atmm_grouped", &valora::atmm_grouped, "shrink + CUTLASS grouped-GEMM expand");
  m.def("atmm_grouped_expand", &valora::atmm_grouped_expand, "CUTLASS grouped-GEMM expand only");
  m.def("grouped_aux_bytes", [](int cap, int T, int rs) { return (int64_t)valora::grouped_aux_bytes(cap, T, rs); });
  m.def("switch_", &valora::switch_, "in place W += s1 (A1 B1)^T + s2 (A2 B2)^T over a list of matrices");
  m.def("switch_packed", &valora::switch_packed, "switch over descriptors already packed on the device");
  m.def("set_grid_policy", [](int p) { valora::g_grid_policy = p; },
        "0: persistent grid (default), -1: one item per CTA, k > 0: k CTAs per SM");
  m.def("rms_norm", &valora::rms_norm, "out = w * rmsnorm(x), or sum = x + add and out = w * rmsnorm(sum)",
        pybind11::arg("out"), pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("eps"),
        pybind11::arg("add") = pybind11::none(), pybind11::arg("sum") = pybind11::none());
  m.def("rotary_", &valora::rotary_, "in place q, k = x cos + rotate_half(x) sin");
  m.def("silu_mul", &valora::silu_mul, "out = silu(gate) * up");
  m.def("switch_desc_bytes", [] { return (int)sizeof(valora::SwitchDesc); });
}
