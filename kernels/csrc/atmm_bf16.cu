// Explicit instantiations of the ATMM tile menu for bf16 (shrink: BT x BK x STAGES x rank
// block RB; expand: BT x BN; fused: BT x BN x RB x cluster size CL). Pruned by registers (<= 16 / 8
// accumulator fragments per warp) and shared memory (see ShrinkCfg / ExpandCfg / FusedCfg); the
// tile table picks among these at run time.
#include "launch_util.cuh"

namespace valora {

using T = __nv_bfloat16;

#define SHRINK(BT, BK, ST, RB) out.push_back(ShrinkOp<T, BT, BK, ST, RB>::entry("shrink_bf16" "_bt" #BT "_bk" #BK "_s" #ST "_r" #RB, kBF16))
#define EXPAND(BT, BN) out.push_back(ExpandOp<T, BT, BN>::entry("expand_bf16" "_bt" #BT "_bn" #BN, kBF16))
#define EXPAND_FMA(VEC, WIDTH) do { static_assert(ExpandFmaCfg<T, VEC>::BN == WIDTH, "name"); \
    out.push_back(ExpandFmaOp<T, VEC>::entry("expand_bf16" "_bt16" "_bn" #WIDTH, kBF16)); } while (0)
#define FUSED(BT, BN, RB, CL) out.push_back(FusedOp<T, BT, BN, RB, CL>::entry("fused_bf16" "_bt" #BT "_bn" #BN "_r" #RB "_c" #CL, kBF16))

void register_atmm_bf16(std::vector<OpEntry>& out) {
  // rank block RB = 1 (r <= 16), 2 (r <= 32), 4 (r <= 64), 8 (r <= 128)
  SHRINK(16, 64, 4, 1);  SHRINK(16, 128, 3, 1);  SHRINK(32, 64, 4, 1);  SHRINK(32, 128, 3, 1);
  SHRINK(64, 64, 4, 1);  SHRINK(64, 128, 3, 1);  SHRINK(128, 64, 4, 1);
  SHRINK(16, 64, 4, 2);  SHRINK(16, 128, 3, 2);  SHRINK(32, 64, 4, 2);  SHRINK(32, 128, 3, 2);
  SHRINK(64, 64, 4, 2);  SHRINK(64, 128, 3, 2);
  SHRINK(16, 64, 4, 4);  SHRINK(16, 128, 3, 4);  SHRINK(32, 64, 4, 4);  SHRINK(32, 128, 3, 4);
  SHRINK(64, 64, 4, 4);  SHRINK(64, 128, 3, 4);
  SHRINK(16, 64, 4, 8);  SHRINK(16, 128, 3, 8);  SHRINK(32, 64, 4, 8);  SHRINK(32, 128, 3, 8);
  EXPAND(16, 64);  EXPAND(16, 128);  EXPAND(16, 256);
  EXPAND(32, 64);  EXPAND(32, 128);  EXPAND(32, 256);
  EXPAND(64, 64);  EXPAND(64, 128);  EXPAND(128, 64);
  // CUDA-core expand for few rows per segment (decode): BT 16, BN = VEC x 128 threads
  EXPAND_FMA(4, 512);  EXPAND_FMA(8, 1024);
  // fused single-launch small-T path (atmm.cuh): BT x BN x rank block RB x cluster size CL;
  // CL CTAs split the shrink's K and share x·A through distributed shared memory
  FUSED(16, 128, 1, 1);  FUSED(16, 128, 1, 4);  FUSED(16, 128, 1, 8);  FUSED(16, 256, 1, 8);
  FUSED(32, 128, 1, 8);  FUSED(64, 128, 1, 8);
  FUSED(16, 128, 2, 8);  FUSED(32, 128, 2, 8);
  FUSED(16, 128, 4, 4);  FUSED(16, 128, 4, 8);  FUSED(32, 128, 4, 8);
}

}  // namespace valora
