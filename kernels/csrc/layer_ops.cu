// Decoder-layer elementwise kernels (see layer_ops.h). In a 16-row decode step of a 7B model each
// of these replaces 5-10 launches of tiny torch kernels per use (RMSNorm: upcast, pow, mean, add,
// rsqrt, mul, downcast, mul), i.e. ~25 graph nodes of ~2 us per decoder layer; in prefill they save
// the fp32 intermediates' memory traffic. Arithmetic in fp32; every value HF rounds to the model's
// dtype is rounded here too (`rnd`), so outputs match the torch references to the last bit up to
// the order of the RMSNorm sum.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "layer_ops.h"

namespace valora {
namespace {

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_f(float v);
template <>
__device__ __forceinline__ float from_f<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }

// a value as HF holds it: rounded to the model's dtype
template <typename T>
__device__ __forceinline__ float rnd(float v) { return to_f(from_f<T>(v)); }

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> load(const T* p) { return *reinterpret_cast<const Pack<T, VEC>*>(p); }
template <typename T, int VEC>
__device__ __forceinline__ void store(T* p, const Pack<T, VEC>& v) { *reinterpret_cast<Pack<T, VEC>*>(p) = v; }

__device__ float block_sum(float v) {
  __shared__ float partial[32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  const int warps = (blockDim.x + 31) / 32;
  v = lane < warps ? partial[lane] : 0.f;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;  // every thread holds the total
}

// One CTA per row. Pass 1 forms r (= x, or T(x + add) stored to `sum`) and sums r^2; pass 2
// re-reads r (from `sum` when it was formed: each thread re-reads its own elements).
template <typename T, int VEC>
__global__ void rms_norm_kernel(RmsNormArgs a) {
  const long long row = blockIdx.x;
  const T* x = static_cast<const T*>(a.x) + row * a.x_ld;
  const T* add = a.add ? static_cast<const T*>(a.add) + row * a.add_ld : nullptr;
  T* sum = a.add ? static_cast<T*>(a.sum) + row * a.sum_ld : nullptr;
  T* out = static_cast<T*>(a.out) + row * a.out_ld;
  const T* w = static_cast<const T*>(a.w);
  const int nvec = a.hidden / VEC;
  float ss = 0.f;
  for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
    Pack<T, VEC> r = load<T, VEC>(x + i * VEC);
    if (add) {
      const Pack<T, VEC> d = load<T, VEC>(add + i * VEC);
#pragma unroll
      for (int j = 0; j < VEC; ++j) r.v[j] = from_f<T>(to_f(r.v[j]) + to_f(d.v[j]));
      store<T, VEC>(sum + i * VEC, r);
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float f = to_f(r.v[j]);
      ss += f * f;
    }
  }
  const float inv = rsqrtf(block_sum(ss) / a.hidden + a.eps);
  const T* src = add ? sum : x;
  for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
    const Pack<T, VEC> r = load<T, VEC>(src + i * VEC);
    const Pack<T, VEC> g = load<T, VEC>(w + i * VEC);
    Pack<T, VEC> o;
#pragma unroll
    for (int j = 0; j < VEC; ++j) o.v[j] = from_f<T>(to_f(g.v[j]) * rnd<T>(to_f(r.v[j]) * inv));
    store<T, VEC>(out + i * VEC, o);
  }
}

// One CTA per token; items are (head, VEC-wide chunk of the first half of head_dim).
template <typename T, int VEC>
__global__ void rotary_kernel(RotaryArgs a) {
  const long long t = blockIdx.x;
  const int half = a.head_dim / 2;
  const int per_head = half / VEC;
  const int items = (a.q_heads + a.k_heads) * per_head;
  const T* cs = static_cast<const T*>(a.cos) + t * a.cs_ld;
  const T* sn = static_cast<const T*>(a.sin) + t * a.cs_ld;
  for (int it = threadIdx.x; it < items; it += blockDim.x) {
    const int h = it / per_head, i = (it % per_head) * VEC;
    T* x = h < a.q_heads ? static_cast<T*>(a.q) + t * a.q_ld + (long long)h * a.head_dim
                         : static_cast<T*>(a.k) + t * a.k_ld + (long long)(h - a.q_heads) * a.head_dim;
    const Pack<T, VEC> x1 = load<T, VEC>(x + i), x2 = load<T, VEC>(x + half + i);
    const Pack<T, VEC> c1 = load<T, VEC>(cs + i), c2 = load<T, VEC>(cs + half + i);
    const Pack<T, VEC> s1 = load<T, VEC>(sn + i), s2 = load<T, VEC>(sn + half + i);
    Pack<T, VEC> o1, o2;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float a1 = to_f(x1.v[j]), a2 = to_f(x2.v[j]);
      // rotate_half(x) = [-x2, x1]; HF rounds each product, then the sum (_rn: no FMA contraction,
      // which would skip the products' rounding in fp32)
      o1.v[j] = from_f<T>(__fadd_rn(rnd<T>(__fmul_rn(a1, to_f(c1.v[j]))), rnd<T>(__fmul_rn(-a2, to_f(s1.v[j])))));
      o2.v[j] = from_f<T>(__fadd_rn(rnd<T>(__fmul_rn(a2, to_f(c2.v[j]))), rnd<T>(__fmul_rn(a1, to_f(s2.v[j])))));
    }
    store<T, VEC>(x + i, o1);
    store<T, VEC>(x + half + i, o2);
  }
}

template <typename T, int VEC>
__global__ void silu_mul_kernel(SiluMulArgs a) {
  const int per_row = a.width / VEC;
  const long long total = a.rows * per_row;
  for (long long it = (long long)blockIdx.x * blockDim.x + threadIdx.x; it < total;
       it += (long long)gridDim.x * blockDim.x) {
    const long long r = it / per_row;
    const int c = (int)(it % per_row) * VEC;
    const Pack<T, VEC> g = load<T, VEC>(static_cast<const T*>(a.gate) + r * a.gate_ld + c);
    const Pack<T, VEC> u = load<T, VEC>(static_cast<const T*>(a.up) + r * a.up_ld + c);
    Pack<T, VEC> o;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float gv = to_f(g.v[j]);
      o.v[j] = from_f<T>(rnd<T>(gv / (1.f + expf(-gv))) * to_f(u.v[j]));
    }
    store<T, VEC>(static_cast<T*>(a.out) + r * a.out_ld + c, o);
  }
}

bool aligned16(const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Threads for a CTA looping over n items: a multiple of 32, at most `cap`.
int threads_for(long long n, int cap) {
  const long long t = (n + 31) / 32 * 32;
  return (int)(t < 32 ? 32 : t > cap ? cap : t);
}

template <typename T>
cudaError_t rms_norm_t(const RmsNormArgs& a, cudaStream_t s) {
  constexpr int V = 16 / sizeof(T);
  const bool vec = a.hidden % V == 0 && a.x_ld % V == 0 && a.out_ld % V == 0 && (!a.add || (a.add_ld % V == 0 && a.sum_ld % V == 0)) &&
                   aligned16(a.x) && aligned16(a.out) && aligned16(a.w) && aligned16(a.add) && aligned16(a.sum);
  if (vec) {
    rms_norm_kernel<T, V><<<a.rows, threads_for(a.hidden / V, 512), 0, s>>>(a);
  } else {
    rms_norm_kernel<T, 1><<<a.rows, threads_for(a.hidden, 1024), 0, s>>>(a);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t rotary_t(const RotaryArgs& a, cudaStream_t s) {
  constexpr int V = 16 / sizeof(T);
  const int half = a.head_dim / 2;
  const bool vec = half % V == 0 && a.q_ld % V == 0 && a.k_ld % V == 0 && a.cs_ld % V == 0 && aligned16(a.q) &&
                   aligned16(a.k) && aligned16(a.cos) && aligned16(a.sin);
  const int heads = a.q_heads + a.k_heads;
  if (vec) {
    rotary_kernel<T, V><<<a.tokens, threads_for((long long)heads * half / V, 256), 0, s>>>(a);
  } else {
    rotary_kernel<T, 1><<<a.tokens, threads_for((long long)heads * half, 256), 0, s>>>(a);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t silu_mul_t(const SiluMulArgs& a, cudaStream_t s) {
  constexpr int V = 16 / sizeof(T);
  const bool vec = a.width % V == 0 && a.out_ld % V == 0 && a.gate_ld % V == 0 && a.up_ld % V == 0 &&
                   aligned16(a.out) && aligned16(a.gate) && aligned16(a.up);
  const long long items = a.rows * (vec ? a.width / V : a.width);
  long long grid = (items + 255) / 256;
  if (grid > 132 * 16) grid = 132 * 16;  // grid-stride beyond ~16 CTAs per SM
  if (grid < 1) grid = 1;
  if (vec) {
    silu_mul_kernel<T, V><<<(unsigned)grid, 256, 0, s>>>(a);
  } else {
    silu_mul_kernel<T, 1><<<(unsigned)grid, 256, 0, s>>>(a);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_rms_norm(int dtype, const RmsNormArgs& a, cudaStream_t s) {
  if (a.rows == 0) return cudaSuccess;
  switch (dtype) {
    case kLayerBF16: return rms_norm_t<__nv_bfloat16>(a, s);
    case kLayerFP16: return rms_norm_t<__half>(a, s);
    case kLayerFP32: return rms_norm_t<float>(a, s);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_rotary(int dtype, const RotaryArgs& a, cudaStream_t s) {
  if (a.tokens == 0) return cudaSuccess;
  switch (dtype) {
    case kLayerBF16: return rotary_t<__nv_bfloat16>(a, s);
    case kLayerFP16: return rotary_t<__half>(a, s);
    case kLayerFP32: return rotary_t<float>(a, s);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_silu_mul(int dtype, const SiluMulArgs& a, cudaStream_t s) {
  if (a.rows == 0 || a.width == 0) return cudaSuccess;
  switch (dtype) {
    case kLayerBF16: return silu_mul_t<__nv_bfloat16>(a, s);
    case kLayerFP16: return silu_mul_t<__half>(a, s);
    case kLayerFP32: return silu_mul_t<float>(a, s);
  }
  return cudaErrorInvalidValue;
}

}  // namespace valora
