"""Building the CUDA extension: JIT on first use with a cache, or ahead of time in one command.

A CPU-only install never needs nvcc: nothing here runs at import time, and `load_extension()`
returns None when CUDA, nvcc or the CUTLASS headers are missing, or when the GPU is not the
Hopper (sm_90) the code is built for (callers then use the torch references, and the Triton
kernels where they run). GPU build, one command (prints the cache directory)::

    python -m kernels.build

Flags: ``-gencode=arch=compute_90a,code=sm_90a -std=c++17 --expt-relaxed-constexpr`` plus the
CUTLASS include directory of the ``nvidia-cutlass`` wheel (4.2.0.0).
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
CUDA_SOURCES = ("atmm_bf16.cu", "atmm_fp16.cu", "switch.cu", "grouped.cu", "layer_ops.cu")
BINDING = "binding.cpp"
HEADERS = ("atmm.cuh", "atmm_api.h", "launch_util.cuh", "layer_ops.h")
EXT_NAME = "valora_kernels_ext"
NVCC_ARCH_FLAGS = ("-gencode=arch=compute_90a,code=sm_90a",)
# The compute capability that code runs on (sm_90a: Hopper's wgmma/TMA instructions; an A100, an
# L40S or a Blackwell GPU would load the module and fail at the first launch).
BUILT_FOR = (9, 0)


def unsupported_gpu() -> tuple[int, int] | None:
    """The current CUDA device's compute capability when the extension's code cannot run on it
    (not BUILT_FOR), else None (also without CUDA: nothing to decide)."""
    import torch

    if not torch.cuda.is_available():
        return None
    capability = tuple(torch.cuda.get_device_capability())
    return None if capability == BUILT_FOR else capability


NVCC_FLAGS = ("-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo")


def cutlass_include_dir() -> Path | None:
    """Include directory of the nvidia-cutlass wheel's CUTLASS/CuTe headers, or None."""
    try:
        import cutlass_library  # optional dependency
    except ImportError:
        return None
    inc = Path(cutlass_library.__file__).resolve().parent / "source" / "include"
    return inc if (inc / "cutlass" / "cutlass.h").is_file() else None


def nvcc_path() -> str | None:
    """nvcc on PATH or under CUDA_HOME, or None."""
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    cand = Path(home, "bin", "nvcc") if home else None
    return str(cand) if cand and cand.is_file() else None


def cuda_sources() -> list[Path]:
    return [CSRC / s for s in CUDA_SOURCES]


def nvcc_flags() -> list[str]:
    flags = [*NVCC_ARCH_FLAGS, *NVCC_FLAGS]
    inc = cutlass_include_dir()
    if inc is not None:
        flags.append(f"-I{inc}")
    return flags


def _source_hash() -> str:
    h = hashlib.sha256()
    for name in (*CUDA_SOURCES, BINDING, *HEADERS):
        h.update((CSRC / name).read_bytes())
    h.update(" ".join(nvcc_flags()).encode())
    return h.hexdigest()[:16]


def build_directory() -> Path:
    """Cache directory for the JIT build ($VALORA_KERNELS_CACHE or ~/.cache/valora/kernels)."""
    root = Path(os.environ.get("VALORA_KERNELS_CACHE", Path.home() / ".cache" / "valora" / "kernels"))
    import torch

    d = root / f"{EXT_NAME}-torch{torch.__version__.replace('+', '_')}-{_source_hash()}"
    d.mkdir(parents=True, exist_ok=True)
    return d


@functools.cache
def load_extension(verbose: bool = False):
    """The compiled extension module (built on first use, then cached), or None without CUDA or
    nvcc, or on a GPU its code cannot run on (unsupported_gpu)."""
    import torch

    if not torch.cuda.is_available() or nvcc_path() is None or unsupported_gpu() is not None:
        return None
    from torch.utils.cpp_extension import load

    return load(
        name=EXT_NAME,
        sources=[str(CSRC / BINDING), *map(str, cuda_sources())],
        extra_cuda_cflags=nvcc_flags(),
        extra_cflags=["-O3", "-std=c++17"],
        extra_include_paths=[str(CSRC)],
        build_directory=str(build_directory()),
        verbose=verbose,
    )


def main() -> None:
    ext = load_extension(verbose=True)
    if ext is None:
        raise SystemExit("no CUDA device or nvcc: nothing to build (the torch references are used)")
    print(f"built {EXT_NAME} in {build_directory()}: {len(ext.configs())} kernel configurations")


if __name__ == "__main__":
    main()
