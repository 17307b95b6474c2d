// Host interface of the decoder-layer elementwise kernels (layer_ops.cu): RMSNorm with an optional
// fused residual add, in-place rotary embedding of q and k, and SiLU(gate) * up. Each replaces a
// chain of 5-10 small torch kernels of the HF layer and rounds where HF rounds (see
// kernels/reference.py for the semantics), so results match the HF layer to the dtype's rounding.
#pragma once

#include <cuda_runtime.h>

namespace valora {

enum LayerDType { kLayerBF16 = 0, kLayerFP16 = 1, kLayerFP32 = 2 };

// out = w * T(r * rsqrt(mean(r^2) + eps)) per row, r = x (no `add`) or r = T(x + add), the sum
// also written to `sum` (which may alias x). Leading dimensions in elements.
struct RmsNormArgs {
  void* out;
  const void* x;
  const void* add;  // nullptr: plain RMSNorm
  void* sum;        // required with `add`
  const void* w;
  int rows, hidden;
  long long out_ld, x_ld, add_ld, sum_ld;
  float eps;
};

// In place, per token t and head: x = x * cos[t] + rotate_half(x) * sin[t] for q and k
// (tokens, heads, head_dim) with contiguous heads; cos/sin (tokens, head_dim).
struct RotaryArgs {
  void* q;
  void* k;
  const void* cos;
  const void* sin;
  int tokens, q_heads, k_heads, head_dim;
  long long q_ld, k_ld, cs_ld;  // token strides in elements
};

// out = T(silu(gate)) * up, elementwise over (rows, width); out may alias gate.
struct SiluMulArgs {
  void* out;
  const void* gate;
  const void* up;
  long long rows;
  int width;
  long long out_ld, gate_ld, up_ld;
};

cudaError_t launch_rms_norm(int dtype, const RmsNormArgs& a, cudaStream_t stream);
cudaError_t launch_rotary(int dtype, const RotaryArgs& a, cudaStream_t stream);
cudaError_t launch_silu_mul(int dtype, const SiluMulArgs& a, cudaStream_t stream);

}  // namespace valora
