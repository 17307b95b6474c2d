// Launch helpers shared by the instantiation units: PDL launches and the registry glue.
#pragma once

#include "atmm.cuh"
#include "atmm_api.h"

namespace valora {

template <typename Kernel, typename... Args>
cudaError_t launch_kernel(Kernel k, int grid, size_t smem, cudaStream_t stream, bool pdl, Args... args) {
  static bool configured = false;  // allow > 48 KB dynamic shared memory once per kernel
  if (!configured) {
    cudaError_t e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024);
    if (e != cudaSuccess) return e;
    configured = true;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, k, args...);
}

template <typename Kernel>
cudaError_t occupancy_of(Kernel k, int* blocks, size_t smem) {
  cudaError_t e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024);
  if (e != cudaSuccess) return e;
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, k, kThreads, smem);
}

template <typename T, int BT, int BK, int ST, int RB>
struct ShrinkOp {
  static size_t smem(int) { return ShrinkCfg<T, BT, BK, ST, RB>::SMEM; }
  static cudaError_t occ(int* b, size_t s) { return occupancy_of(atmm_shrink_kernel<T, BT, BK, ST, RB>, b, s); }
  static cudaError_t launch(const void* a, int grid, size_t s, cudaStream_t st, bool pdl) {
    return launch_kernel(atmm_shrink_kernel<T, BT, BK, ST, RB>, grid, s, st, pdl, *static_cast<const AtmmArgs*>(a));
  }
  static OpEntry entry(const char* name, int dtype) {
    return OpEntry{name, kShrink, dtype, BT, BK, ST, RB, 0, 0, &smem, &occ, &launch};
  }
};

template <typename T, int BT, int BN>
struct ExpandOp {
  static size_t smem(int rs) { return ExpandCfg<T, BT, BN>::smem(rs); }
  static cudaError_t occ(int* b, size_t s) { return occupancy_of(atmm_expand_kernel<T, BT, BN>, b, s); }
  static cudaError_t launch(const void* a, int grid, size_t s, cudaStream_t st, bool pdl) {
    return launch_kernel(atmm_expand_kernel<T, BT, BN>, grid, s, st, pdl, *static_cast<const AtmmArgs*>(a));
  }
  static OpEntry entry(const char* name, int dtype) {
    return OpEntry{name, kExpand, dtype, BT, 0, 0, 0, BN, 0, &smem, &occ, &launch};
  }
};

// CUDA-core expand (atmm_expand_fma_kernel): registered as an expand of BT 16 and BN = VEC * kThreads
// (512 / 1024; the tensor-core expand's BN is at most 256).
template <typename T, int VEC>
struct ExpandFmaOp {
  static size_t smem(int rs) { return ExpandFmaCfg<T, VEC>::smem(rs); }
  static cudaError_t occ(int* b, size_t s) { return occupancy_of(atmm_expand_fma_kernel<T, VEC>, b, s); }
  static cudaError_t launch(const void* a, int grid, size_t s, cudaStream_t st, bool pdl) {
    return launch_kernel(atmm_expand_fma_kernel<T, VEC>, grid, s, st, pdl, *static_cast<const AtmmArgs*>(a));
  }
  static OpEntry entry(const char* name, int dtype) {
    return OpEntry{name, kExpand, dtype, ExpandFmaCfg<T, VEC>::BT, 0, 0, 0, ExpandFmaCfg<T, VEC>::BN, 0, &smem, &occ, &launch};
  }
};

template <typename T, int BM, int BN>
struct SwitchOp {
  static size_t smem(int R) { return SwitchCfg<T, BM, BN>::smem(R); }
  static cudaError_t occ(int* b, size_t s) { return occupancy_of(switch_kernel<T, BM, BN>, b, s); }
  static cudaError_t launch(const void* a, int grid, size_t s, cudaStream_t st, bool pdl) {
    const SwitchLaunch* l = static_cast<const SwitchLaunch*>(a);
    return launch_kernel(switch_kernel<T, BM, BN>, grid, s, st, pdl, l->descs, l->n, l->total_tiles, l->rmax);
  }
  static OpEntry entry(const char* name, int dtype) {
    return OpEntry{name, kSwitch, dtype, 0, 0, 0, 0, BN, BM, &smem, &occ, &launch};
  }
};

}  // namespace valora
