// Explicit instantiations of the ATMM tile menu for fp16 (shrink: BT x BK x STAGES x rank
// block RB; expand: BT x BN; fused: BT x BN x RB x cluster size CL). Pruned by registers (<= 16 / 8
// accumulator fragments per warp) and shared memory (see ShrinkCfg / ExpandCfg / FusedCfg); the
// tile table picks among these at run time.
#include "launch_util.cuh"

namespace valora {

using T = __half;

#define SHRINK(BT, BK, ST, RB) out.push_back(ShrinkOp<T, BT, BK, ST, RB>::entry("shrink_fp16" "_bt" #BT "_bk" #BK "_s" #ST "_r" #RB, kFP16))
#define EXPAND(BT, BN) out.push_back(ExpandOp<T, BT, BN>::entry("expand_fp16" "_bt" #BT "_bn" #BN, kFP16))
#define EXPAND_FMA(VEC, WIDTH) do { static_assert(ExpandFmaCfg<T, VEC>::BN == WIDTH, "name"); \
    out.push_back(ExpandFmaOp<T, VEC>::entry("expand_fp16" "_bt16" "_bn" #WIDTH, kFP16)); } while (0)
#define FUSED(BT, BN, RB, CL) out.push_back(FusedOp<T, BT, BN, RB, CL>::entry("fused_fp16" "_bt" #BT "_bn" #BN "_r" #RB "_c" #CL, kFP16))

void register_atmm_fp16(std::vector<OpEntry>& out) {
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
  // fused single-launch small-T path (atmm.cuh): BT x BN x rank block RB x cluster size CL. fp16
  // has no measured table yet: one config per rank block / token tile (the bf16 menu is the
  // searched superset; add entries here when an fp16 table is built)
  FUSED(16, 128, 1, 8);  FUSED(32, 128, 1, 8);  FUSED(16, 128, 2, 8);  FUSED(16, 128, 4, 8);
}

}  // namespace valora
