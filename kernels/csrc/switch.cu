// Explicit instantiations of the in-place switch kernel (W += s1 (A1 B1)^T + s2 (A2 B2)^T).
#include "launch_util.cuh"

namespace valora {

void register_switch(std::vector<OpEntry>& out) {
  out.push_back(SwitchOp<__nv_bfloat16, 64, 128>::entry("switch_bf16_bm64_bn128", kBF16));
  out.push_back(SwitchOp<__nv_bfloat16, 128, 64>::entry("switch_bf16_bm128_bn64", kBF16));
  out.push_back(SwitchOp<__nv_bfloat16, 32, 256>::entry("switch_bf16_bm32_bn256", kBF16));
  out.push_back(SwitchOp<__nv_bfloat16, 64, 64>::entry("switch_bf16_bm64_bn64", kBF16));
  out.push_back(SwitchOp<__half, 64, 128>::entry("switch_fp16_bm64_bn128", kFP16));
}

}  // namespace valora
