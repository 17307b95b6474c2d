"""Switcher kernel: in place W_i += s_n·B_n·A_n − s_m·B_m·A_m over a list of matrices, one launch.

Adapters are in ATMM layout (A: (in, r), B: (r, out)), so for W (out, in) the update is
`W += s·(A·B)^T` (= s·B_peft·A_peft). `merge` = one term (+s), `unmerge` = one term (−s),
`switch` (unmerge m, merge n) = both terms in the same pass over W ([B_n, −B_m]·[A_n; A_m]).
W is bf16/fp16, the product is accumulated in fp32 and added to W before one rounding.
Falls back to `kernels.reference.switch_reference_` without CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kernels.atmm import extension
from kernels.reference import switch_reference_

# SwitchDesc in kernels/csrc/atmm_api.h (72 bytes)
_DESC = np.dtype([("w", "<i8"), ("a1", "<i8"), ("b1", "<i8"), ("a2", "<i8"), ("b2", "<i8"), ("M", "<i4"),
                  ("N", "<i4"), ("r1", "<i4"), ("r2", "<i4"), ("s1", "<f4"), ("s2", "<f4"), ("tile_begin", "<i8")])
assert _DESC.itemsize == 72
DEFAULT_CONFIG = {torch.bfloat16: "switch_bf16_bm64_bn128", torch.float16: "switch_fp16_bm64_bn128"}
_TILES = {"bm64_bn128": (64, 128), "bm128_bn64": (128, 64), "bm32_bn256": (32, 256), "bm64_bn64": (64, 64)}


@dataclass(frozen=True)
class LoraTerm:
    """One adapter's contribution s·(A·B)^T to a weight W (out, in): A (in, r), B (r, out)."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float


def _check_term(w: torch.Tensor, t: LoraTerm, i: int) -> None:
    out, inp = w.shape
    r = t.a.shape[1] if t.a.dim() == 2 else -1
    if t.a.dim() != 2 or t.a.shape[0] != inp or tuple(t.b.shape) != (r, out):
        raise ValueError(f"matrix {i}: W is {tuple(w.shape)}, A must be ({inp}, r) and B (r, {out}); "
                         f"got {tuple(t.a.shape)} and {tuple(t.b.shape)}")
    if r % 8 or r > 128:
        raise ValueError(f"matrix {i}: rank must be a multiple of 8, at most 128; got {r}")
    for name, x in (("A", t.a), ("B", t.b)):
        if x.dtype != w.dtype or x.device != w.device or not x.is_contiguous():
            raise ValueError(f"matrix {i}: {name} must be contiguous {w.dtype} on {w.device}")


class SwitchPlan:
    """Descriptors for one switch over a fixed list of matrices, packed once on the device.

    `run()` launches the kernel (no host sync; capturable in a CUDA graph). Without CUDA or the
    extension, `run()` applies the torch reference.
    """

    def __init__(self, weights: Sequence[torch.Tensor], first: Sequence[LoraTerm],
                 second: Sequence[LoraTerm] | None = None, config: str | None = None):
        if len(first) != len(weights) or (second is not None and len(second) != len(weights)):
            raise ValueError("one term per weight matrix")
        if not weights:
            raise ValueError("no weights")
        dtype = weights[0].dtype
        for i, w in enumerate(weights):
            if w.dim() != 2 or not w.is_contiguous() or w.dtype != dtype or w.dtype not in DEFAULT_CONFIG:
                raise ValueError(f"matrix {i}: W must be a contiguous 2-D bf16/fp16 tensor (all one dtype)")
            if w.shape[1] % 8:
                raise ValueError(f"matrix {i}: in_features must be a multiple of 8")
            _check_term(w, first[i], i)
            if second is not None:
                _check_term(w, second[i], i)
                if second[i].scale == 0:
                    raise ValueError(f"matrix {i}: the second term's scale must be non-zero")
        self.weights, self.first, self.second = list(weights), list(first), list(second) if second else None
        self.config = config or DEFAULT_CONFIG[dtype]
        bm, bn = _TILES[self.config.split("_", 2)[2]]
        descs = np.zeros(len(weights), dtype=_DESC)
        tiles, rmax = 0, 16
        for i, w in enumerate(weights):
            m, n = w.shape
            t1 = first[i]
            t2 = second[i] if second is not None else None
            d = descs[i]
            d["w"], d["a1"], d["b1"] = w.data_ptr(), t1.a.data_ptr(), t1.b.data_ptr()
            d["M"], d["N"], d["r1"], d["s1"] = m, n, t1.a.shape[1], t1.scale
            r_tot = -(-t1.a.shape[1] // 16) * 16
            if t2 is not None:
                d["a2"], d["b2"], d["r2"], d["s2"] = t2.a.data_ptr(), t2.b.data_ptr(), t2.a.shape[1], t2.scale
                r_tot += -(-t2.a.shape[1] // 16) * 16
            d["tile_begin"] = tiles
            tiles += -(-m // bm) * -(-n // bn)
            rmax = max(rmax, r_tot)
        self.total_tiles, self.rmax = tiles, rmax
        self.ext = extension() if weights[0].is_cuda else None
        if self.ext is not None:
            self.config_id = next(c["id"] for c in self.ext.configs() if c["name"] == self.config)
            host = torch.from_numpy(descs.view(np.uint8).copy())
            self.work = host.to(weights[0].device)

    def run(self, pdl: bool = False) -> None:
        """Apply the update in place to every matrix."""
        if self.ext is None:
            for i, w in enumerate(self.weights):
                terms = [self.first[i]] + ([self.second[i]] if self.second else [])
                b_cat = torch.cat([t.scale * t.b.float().t() for t in terms], 1)
                a_cat = torch.cat([t.a.float().t() for t in terms], 0)
                switch_reference_(w, b_cat, a_cat)
            return
        self.ext.switch_packed(self.work, len(self.weights), self.total_tiles, self.rmax, self.config_id, pdl)


def merge_(weights: Sequence[torch.Tensor], terms: Sequence[LoraTerm]) -> None:
    """W_i += s·(A_i·B_i)^T for each matrix (one launch)."""
    SwitchPlan(weights, terms).run()


def unmerge_(weights: Sequence[torch.Tensor], terms: Sequence[LoraTerm]) -> None:
    """W_i −= s·(A_i·B_i)^T for each matrix (one launch)."""
    SwitchPlan(weights, [LoraTerm(t.a, t.b, -t.scale) for t in terms]).run()


def switch_(weights: Sequence[torch.Tensor], new: Sequence[LoraTerm], old: Sequence[LoraTerm]) -> None:
    """Unmerge `old` and merge `new` in one pass over each W: W += s_n (A_n B_n)^T − s_m (A_m B_m)^T."""
    SwitchPlan(weights, new, [LoraTerm(t.a, t.b, -t.scale) for t in old]).run()
