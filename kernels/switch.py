"""Switcher kernel: W_i = S_i + s_n·B_n·A_n − s_m·B_m·A_m over a list of matrices, one launch.

Adapters are in ATMM layout (A: (in, r), B: (r, out)), so for W (out, in) the update is
`W += s·(A·B)^T` (= s·B_peft·A_peft). `merge` = one term (+s), `unmerge` = one term (−s),
`switch` (unmerge m, merge n) = both terms in the same pass over W ([B_n, −B_m]·[A_n; A_m]).
The source S is W itself (in place) or, per matrix, another tensor of the same shape (out of
place: the worker's pristine strategy writes W = W0 + s·B·A from its pristine copy W0 in one
pass). W is bf16/fp16, the product is accumulated in fp32 and added to S before one rounding.
Falls back to `kernels.reference.switch_reference_` without CUDA.

Kernel configs (kernels/csrc/switch.cu; `switch_configs()` lists the compiled ones):
`switch_<dt>_bm<BM>_bn<BN>` (the original kernel, padded total rank up to 256) and the
bandwidth-oriented `switch_<dt>_pipe_bm*_bn*_s4_t256` / `switch_<dt>_regs_bm*_bn*_t256` (padded
total rank up to 128; a plan needing more falls back to `FALLBACK_CONFIG`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kernels.atmm import extension
from kernels.reference import switch_reference_

# SwitchDesc in kernels/csrc/atmm_api.h (80 bytes)
_DESC = np.dtype(
    [
        ("w", "<i8"),
        ("a1", "<i8"),
        ("b1", "<i8"),
        ("a2", "<i8"),
        ("b2", "<i8"),
        ("M", "<i4"),
        ("N", "<i4"),
        ("r1", "<i4"),
        ("r2", "<i4"),
        ("s1", "<f4"),
        ("s2", "<f4"),
        ("tile_begin", "<i8"),
        ("src", "<i8"),
    ]
)
assert _DESC.itemsize == 80
# Fastest on the H200 (bench/results/switch-9fae01b.json: 8.67 ms one-pass switch of the 7B shape vs
# 10.99 for the first kernel); bench/switch_bench.py times every compiled config.
DEFAULT_CONFIG = {
    torch.bfloat16: "switch_bf16_pipe_bm128_bn64_s4_t256",
    torch.float16: "switch_fp16_pipe_bm128_bn64_s4_t256",
}
# Handles every rank the API accepts (two terms of rank 128): used when DEFAULT_CONFIG cannot.
FALLBACK_CONFIG = {torch.bfloat16: "switch_bf16_bm64_bn128", torch.float16: "switch_fp16_bm64_bn128"}
_DTYPE_TAG = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def config_tiles(name: str) -> tuple[int, int]:
    """(BM, BN) of a switch config from its name (tiles are BM rows x BN columns of W)."""
    m = re.search(r"_bm(\d+)_bn(\d+)", name)
    if not m or not name.startswith("switch_"):
        raise ValueError(f"not a switch kernel config: {name!r}")
    return int(m.group(1)), int(m.group(2))


def config_max_rank(name: str) -> int:
    """Largest padded total rank (r1 rounded up to 16 + r2 rounded up to 16) a config handles."""
    return 128 if ("_pipe_" in name or "_regs_" in name) else 256


def switch_configs(dtype: torch.dtype | None = None) -> list[str]:
    """Names of the compiled switch configs (all dtypes, or one); [] without the extension."""
    ext = extension()
    if ext is None:
        return []
    want = None if dtype is None else {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    return [c["name"] for c in ext.configs() if c["kind"] == "switch" and want in (None, c["dtype"])]


@functools.cache
def _config_ids() -> dict[str, int]:
    ext = extension()
    return {} if ext is None else {c["name"]: c["id"] for c in ext.configs() if c["kind"] == "switch"}


@dataclass(frozen=True)
class LoraTerm:
    """One adapter's contribution s·(A·B)^T to a weight W (out, in): A (in, r), B (r, out)."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[1]


def _pad16(r: int) -> int:
    return -(-r // 16) * 16


def _term_info(w_shape, w_dtype, w_dev: int, t: LoraTerm, i: int) -> tuple[int, int, int]:
    """(A pointer, B pointer, rank) of a checked term (attributes read once: plans are built per switch)."""
    a, b = t.a, t.b
    ash, bsh = a.shape, b.shape
    out, inp = w_shape
    r = ash[1] if len(ash) == 2 else -1
    if r < 0 or ash[0] != inp or len(bsh) != 2 or bsh[0] != r or bsh[1] != out:
        raise ValueError(
            f"matrix {i}: W is {tuple(w_shape)}, A must be ({inp}, r) and B (r, {out}); "
            f"got {tuple(ash)} and {tuple(bsh)}"
        )
    if r % 8 or r > 128:
        raise ValueError(f"matrix {i}: rank must be a multiple of 8, at most 128; got {r}")
    for name, x in (("A", a), ("B", b)):
        if x.dtype != w_dtype or x.get_device() != w_dev or not x.is_contiguous():
            raise ValueError(f"matrix {i}: {name} must be contiguous {w_dtype} on the weights' device")
    return a.data_ptr(), b.data_ptr(), r


def _collect(
    weights: Sequence[torch.Tensor],
    first: Sequence[LoraTerm | None],
    second: Sequence[LoraTerm | None],
    sources: Sequence[torch.Tensor],
) -> dict[str, list]:
    """Checked descriptor columns (all but tile_begin), one pass over the inputs."""
    n = len(weights)
    cols: dict[str, list] = {k: [0] * n for k in _DESC.names}
    dtype = weights[0].dtype
    for i, (w, t1, t2, src) in enumerate(zip(weights, first, second, sources)):
        shape, dev = w.shape, w.get_device()
        if len(shape) != 2 or w.dtype != dtype or dtype not in DEFAULT_CONFIG or not w.is_contiguous():
            raise ValueError(f"matrix {i}: W must be a contiguous 2-D bf16/fp16 tensor (all one dtype)")
        if shape[1] % 8 or shape[0] % 8:
            raise ValueError(f"matrix {i}: in_features and out_features must be multiples of 8, got {tuple(shape)}")
        cols["w"][i] = w.data_ptr()
        cols["M"][i], cols["N"][i] = shape
        if src is w:
            cols["src"][i] = cols["w"][i]
        else:
            if src.shape != shape or src.dtype != dtype or src.get_device() != dev or not src.is_contiguous():
                raise ValueError(
                    f"matrix {i}: the source must be a contiguous {dtype} {tuple(shape)} tensor on {w.device}"
                )
            cols["src"][i] = src.data_ptr()
        for tag, t in (("1", t1), ("2", t2)):
            if t is not None:
                cols["a" + tag][i], cols["b" + tag][i], cols["r" + tag][i] = _term_info(shape, dtype, dev, t, i)
                cols["s" + tag][i] = t.scale
        if t2 is not None and t2.scale == 0:
            raise ValueError(f"matrix {i}: the second term's scale must be non-zero")
    return cols


def _finish(cols: dict[str, list], bm: int, bn: int) -> tuple[np.ndarray, int, int]:
    tiles, rmax, begins = 0, 16, []
    for m, k, r1, r2 in zip(cols["M"], cols["N"], cols["r1"], cols["r2"]):
        begins.append(tiles)
        tiles += -(-m // bm) * -(-k // bn)
        rmax = max(rmax, _pad16(r1) + _pad16(r2))
    descs = np.zeros(len(begins), dtype=_DESC)
    for name, vals in cols.items():
        descs[name] = begins if name == "tile_begin" else vals
    return descs, tiles, rmax


def pack_descriptors(
    weights: Sequence[torch.Tensor],
    first: Sequence[LoraTerm | None],
    second: Sequence[LoraTerm | None],
    sources: Sequence[torch.Tensor],
    bm: int,
    bn: int,
) -> tuple[np.ndarray, int, int]:
    """SwitchDesc rows (numpy, `_DESC`), total BM x BN tiles, max padded total rank (>= 16).

    A missing term packs as rank 0 (null pointers); the source pointer is packed for every matrix
    (== w in place)."""
    return _finish(_collect(weights, first, second, sources), bm, bn)


class SwitchPlan:
    """Descriptors for one switch over a fixed list of matrices, packed once on the device.

    `first` / `second`: one term per matrix (None: no such term for that matrix; `second` None:
    no second term at all). `sources`: per matrix the tensor read (default: W, in place).
    `run()` launches the kernel (no host sync; capturable in a CUDA graph). Without CUDA or the
    extension, `run()` applies the torch reference. Building a plan copies no weight: it packs
    pointers (80 bytes per matrix) and copies them to the device once.
    """

    def __init__(
        self,
        weights: Sequence[torch.Tensor],
        first: Sequence[LoraTerm | None],
        second: Sequence[LoraTerm | None] | None = None,
        config: str | None = None,
        sources: Sequence[torch.Tensor] | None = None,
    ):
        if (
            len(first) != len(weights)
            or (second is not None and len(second) != len(weights))
            or (sources is not None and len(sources) != len(weights))
        ):
            raise ValueError("one term per weight matrix (and one source per matrix when given)")
        if not weights:
            raise ValueError("no weights")
        dtype = weights[0].dtype
        second_l = list(second) if second is not None else [None] * len(weights)
        sources_l = list(sources) if sources is not None else list(weights)
        cols = _collect(weights, first, second_l, sources_l)
        self.weights, self.first, self.second = list(weights), list(first), second_l
        self.sources = sources_l
        self.ext = extension() if weights[0].is_cuda else None
        if self.ext is not None:  # 16-byte vector accesses everywhere
            for i, ptrs in enumerate(zip(*(cols[k] for k in ("w", "src", "a1", "b1", "a2", "b2")))):
                if any(p % 16 for p in ptrs):
                    raise ValueError(f"matrix {i}: W, its source, A and B must be 16-byte aligned")
        self.config = self._pick_config(config, dtype)
        self.descs, self.total_tiles, self.rmax = _finish(cols, *config_tiles(self.config))
        if self.rmax > config_max_rank(self.config):
            if config is not None:
                raise ValueError(
                    f"{config} handles padded total ranks up to {config_max_rank(config)}, "
                    f"this switch needs {self.rmax}"
                )
            self.config = FALLBACK_CONFIG[dtype]
            self.descs, self.total_tiles, self.rmax = _finish(cols, *config_tiles(self.config))
        if self.ext is not None:
            ids = _config_ids()
            if self.config not in ids:
                raise ValueError(f"switch config {self.config!r} is not compiled; have {sorted(ids)}")
            self.config_id = ids[self.config]
            host = torch.from_numpy(self.descs.view(np.uint8).copy())
            self.work = host.to(weights[0].device)

    @staticmethod
    def _pick_config(config: str | None, dtype: torch.dtype) -> str:
        name = config or DEFAULT_CONFIG[dtype]
        config_tiles(name)
        if f"_{_DTYPE_TAG[dtype]}_" not in name:
            raise ValueError(f"switch config {name!r} is not for {dtype}")
        return name

    def run(self, pdl: bool = False) -> None:
        """Apply the update to every matrix (W = source + terms)."""
        if self.ext is None:
            for w, t1, t2, src in zip(self.weights, self.first, self.second, self.sources):
                terms = [t for t in (t1, t2) if t is not None]
                if not terms:
                    if src is not w:
                        w.copy_(src)
                    continue
                b_cat = torch.cat([t.scale * t.b.float().t() for t in terms], 1)
                a_cat = torch.cat([t.a.float().t() for t in terms], 0)
                switch_reference_(w, b_cat, a_cat, src=None if src is w else src)
            return
        self.ext.switch_packed(self.work, len(self.weights), self.total_tiles, self.rmax, self.config_id, pdl)


def merge_(
    weights: Sequence[torch.Tensor], terms: Sequence[LoraTerm], sources: Sequence[torch.Tensor] | None = None
) -> None:
    """W_i = S_i + s·(A_i·B_i)^T for each matrix (S = W: in place), one launch."""
    SwitchPlan(weights, terms, sources=sources).run()


def unmerge_(weights: Sequence[torch.Tensor], terms: Sequence[LoraTerm]) -> None:
    """W_i −= s·(A_i·B_i)^T for each matrix (one launch)."""
    SwitchPlan(weights, [LoraTerm(t.a, t.b, -t.scale) for t in terms]).run()


def switch_(weights: Sequence[torch.Tensor], new: Sequence[LoraTerm], old: Sequence[LoraTerm]) -> None:
    """Unmerge `old` and merge `new` in one pass over each W: W += s_n (A_n B_n)^T − s_m (A_m B_m)^T."""
    SwitchPlan(weights, new, [LoraTerm(t.a, t.b, -t.scale) for t in old]).run()
