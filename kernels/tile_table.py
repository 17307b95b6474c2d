"""ATMM tile table: shape bucket -> precompiled kernel configuration, one hash lookup at run time.

Each entry names the backend that won the bucket (our CUDA kernels, CUDA shrink + CUTLASS grouped
expand, the Triton SGMV kernels, or the fused single-launch CUDA kernel for small token counts)
and that backend's tiles. Built offline by
`kernels.tile_search` on the target GPU and stored as JSON under
`kernels/tile_tables/<gpu>-<arch>-<dtype>.json`. Shapes absent from the table fall back to
`heuristic_config`, which needs no measurement.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

TABLE_DIR = Path(__file__).resolve().parent / "tile_tables"
SPLIT_K_MENU = (1, 2, 4, 8, 16, 32)
BACKENDS = ("cuda", "cutlass_grouped", "triton", "fused")
FUSED_MAX_RANK_BLOCK = 4  # the fused kernels are compiled for rank blocks 1, 2, 4 (r <= 64)
FUSED_CLUSTERS = (1, 2, 4, 8)
# expand tiles at least this wide are the CUDA-core kernel (csrc/atmm.cuh atmm_expand_fma_kernel: few rows
# per segment, e.g. decode); the search times them up to this many tokens
FMA_EXPAND_MIN_BN = 512
FMA_EXPAND_MAX_TOKENS = 256
NUM_SMS_DEFAULT = 132  # H100/H200 SXM


@dataclass(frozen=True)
class TileConfig:
    """One ATMM launch choice: which implementation (`backend`) and its tiles.

    backend "cuda": our CUDA shrink kernel (BT, BK, stages, RB), split-K, our expand kernel (BT, BN;
    BN >= FMA_EXPAND_MIN_BN names the CUDA-core expand).
    backend "cutlass_grouped": the same shrink, then the CUTLASS grouped-GEMM expand named by
    `grouped` (e.g. "grouped_bf16_m64n128"; expand_bt/bn then record the best own expand).
    backend "triton": `kernels.triton_sgmv` (shrink BLOCK_M/BLOCK_K/num_stages = shrink_bt/bk/
    stages, split_k, expand BLOCK_M/BLOCK_N = expand_bt/bn, num_warps = `warps`).
    backend "fused": one launch of `fused_<dtype>_bt<BT>_bn<BN>_r<RB>_c<cluster>` (csrc/atmm.cuh):
    BT = shrink_bt = expand_bt, BN = expand_bn, `cluster` CTAs per (token tile, column group)
    splitting the shrink's K, `split_k` = number of column groups (shrink_bk/stages record the
    kernel's fixed 64/4). For the two CUDA-shrink backends `grouped` decides: "cutlass_grouped" when it is set, else
    "cuda" (also for tables written before the field existed).
    """

    shrink_bt: int
    shrink_bk: int
    shrink_stages: int
    split_k: int
    expand_bt: int
    expand_bn: int
    grouped: str = ""
    backend: str = ""
    warps: int = 4
    cluster: int = 1

    def __post_init__(self) -> None:
        if self.backend not in ("", *BACKENDS):
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.backend in ("triton", "fused"):
            if self.grouped:
                raise ValueError(f"backend {self.backend!r} with a grouped configuration {self.grouped!r}")
            if self.backend == "fused" and (self.cluster not in FUSED_CLUSTERS or self.shrink_bt != self.expand_bt):
                raise ValueError(
                    f"fused: cluster must be one of {FUSED_CLUSTERS} and shrink_bt == expand_bt, got {self}"
                )
        else:  # our CUDA shrink: `grouped` decides the expand (so dataclasses.replace(grouped=...) works)
            object.__setattr__(self, "backend", "cutlass_grouped" if self.grouped else "cuda")

    def shrink_name(self, dtype: str, rank_block: int) -> str:
        d = "bf16" if dtype == "bfloat16" else "fp16"
        return f"shrink_{d}_bt{self.shrink_bt}_bk{self.shrink_bk}_s{self.shrink_stages}_r{rank_block}"

    def expand_name(self, dtype: str) -> str:
        d = "bf16" if dtype == "bfloat16" else "fp16"
        return f"expand_{d}_bt{self.expand_bt}_bn{self.expand_bn}"

    def fused_name(self, dtype: str, rank_block: int) -> str:
        d = "bf16" if dtype == "bfloat16" else "fp16"
        return f"fused_{d}_bt{self.shrink_bt}_bn{self.expand_bn}_r{rank_block}_c{self.cluster}"

    @classmethod
    def fused(cls, bt: int, bn: int, cluster: int, groups: int) -> "TileConfig":
        """A "fused" backend entry (the kernel's pipeline is fixed at BK 64, 4 stages)."""
        return cls(bt, 64, 4, groups, bt, bn, backend="fused", cluster=cluster)


def rank_block(rank_stride: int) -> int:
    """Shrink kernels are compiled for rank blocks of 16, 32, 64 and 128 columns (RB = 1, 2, 4, 8)."""
    rb = max(1, -(-rank_stride // 16))
    return 1 if rb <= 1 else 2 if rb <= 2 else 4 if rb <= 4 else 8


def fused_groups(groups: int, h_out: int, bn: int, cluster: int) -> int:
    """Column groups a fused launch really uses: at least one BN chunk per CTA of a cluster."""
    ntn = -(-h_out // bn)
    return max(1, min(groups, -(-ntn // cluster)))


def fused_group_options(h_out: int, bn: int, cluster: int, tiles: int, num_sms: int = NUM_SMS_DEFAULT) -> list[int]:
    """Column-group counts worth timing (powers of two): each CTA keeps >= 1 column chunk, and at
    most ~4 CTAs per SM (beyond that only the recomputed shrink grows)."""
    top = fused_groups(1 << 20, h_out, bn, cluster)
    tiles = max(1, tiles)
    out, g = [], 1
    while g <= top:
        if g == 1 or tiles * g * cluster <= 4 * num_sms:
            out.append(g)
        g *= 2
    return out


def default_fused_groups(h_out: int, bn: int, cluster: int, tiles: int, num_sms: int = NUM_SMS_DEFAULT) -> int:
    """The option whose CTA count (tiles x groups x cluster) is nearest one per SM."""
    opts = fused_group_options(h_out, bn, cluster, tiles, num_sms)
    return min(opts, key=lambda g: abs(math.log2(max(1, tiles) * g * cluster / num_sms)))


def fused_heuristic_config(
    h_out: int, rank_stride: int, tokens: int, segments: int, num_sms: int = NUM_SMS_DEFAULT
) -> TileConfig | None:
    """A fused config without measurements (None for ranks > 64): 16-token tiles unless segments
    average more than 16 tokens, 128-column chunks, clusters of 8, about one CTA per SM."""
    if rank_block(rank_stride) > FUSED_MAX_RANK_BLOCK:
        return None
    segments = max(1, segments)
    avg = tokens / segments
    bt = 16 if avg <= 16 else 32
    tiles = max(1, min(math.ceil(tokens / bt) + segments - 1, segments * math.ceil(max(avg, 1) / bt)))
    return TileConfig.fused(bt, 128, 8, default_fused_groups(h_out, 128, 8, tiles, num_sms))


def token_bucket(tokens: int) -> int:
    """Next power of two (>= 1)."""
    return 1 if tokens <= 1 else 1 << (tokens - 1).bit_length()


def segment_bucket(segments: int) -> int:
    """1, 4, 16, 64, 256 ...: next power of four."""
    b = 1
    while b < segments:
        b *= 4
    return b


def shape_key(h_in: int, h_out: int, rank_stride: int, tokens: int, segments: int) -> str:
    """The table's key for one ATMM call shape."""
    return f"{h_in}x{h_out}/r{rank_stride}/t{token_bucket(tokens)}/s{segment_bucket(segments)}"


def heuristic_config(
    h_in: int,
    h_out: int,
    rank_stride: int,
    tokens: int,
    segments: int,
    num_sms: int = NUM_SMS_DEFAULT,
    dtype: str = "bfloat16",
) -> TileConfig:
    """A reasonable config without measurements (used for shapes the table lacks).

    Fitted to the H200 searches: shrink tiles grow with T, split-K until the shrink has about
    two items per SM, long K chunks take BK=128; the expand streams y with 16x256 tiles, except
    for ranks >= 64 over >= 256 tokens, where the CUTLASS grouped GEMM wins.
    """
    segments = max(1, segments)
    avg = tokens / segments
    rb = rank_block(rank_stride)
    sbt = 16 if avg <= 16 else 32 if tokens <= 1536 or rb == 8 else 64
    tiles = max(1, min(math.ceil(tokens / sbt) + segments - 1, segments * math.ceil(max(avg, 1) / sbt)))
    split_k = 1
    while tiles * split_k < 2 * num_sms and split_k < 32 and h_in // (split_k * 2) >= 128:
        split_k *= 2
    bk, stages = (128, 3) if h_in // split_k >= 512 else (64, 4)
    grouped = ""
    if dtype == "bfloat16" and rank_stride >= 64 and tokens >= 256 and h_out >= 128:
        grouped = "grouped_bf16_m64n128"  # (the fp16 grouped kernel is built but not yet measured)
    return TileConfig(sbt, bk, stages, split_k, 16, 256 if h_out >= 256 else 64, grouped)


@dataclass
class TileTable:
    """Tile choices for one GPU and dtype, keyed by `shape_key`."""

    gpu: str
    arch: str
    dtype: str
    entries: dict[str, TileConfig]
    meta: dict

    def __post_init__(self) -> None:
        # (h_in, h_out, rank_stride, segment bucket) -> sorted token buckets present, for shapes
        # between measured buckets (the common case is the exact key: one dict lookup)
        self._near: dict[tuple, list[int]] = {}
        for key in self.entries:
            shape, r, t, s = key.split("/")
            h_in, h_out = shape.split("x")
            self._near.setdefault((int(h_in), int(h_out), int(r[1:]), int(s[1:])), []).append(int(t[1:]))
        for v in self._near.values():
            v.sort()

    def lookup(self, h_in: int, h_out: int, rank_stride: int, tokens: int, segments: int) -> TileConfig:
        """Entry for the call's bucket; else the nearest measured token bucket of the same shape,
        rank and segment bucket; else `heuristic_config`."""
        cfg = self.entries.get(shape_key(h_in, h_out, rank_stride, tokens, segments))
        if cfg is not None:
            return cfg
        sb = segment_bucket(segments)
        ts = self._near.get((h_in, h_out, rank_stride, sb))
        if ts:
            tb = token_bucket(tokens)
            best = min(ts, key=lambda t: abs(math.log2(t) - math.log2(tb)))
            return self.entries[shape_key(h_in, h_out, rank_stride, best, sb)]
        return heuristic_config(h_in, h_out, rank_stride, tokens, segments, dtype=self.dtype)

    def to_json(self) -> dict:
        return {
            "gpu": self.gpu,
            "arch": self.arch,
            "dtype": self.dtype,
            "meta": self.meta,
            "entries": {k: asdict(v) for k, v in sorted(self.entries.items())},
        }

    @classmethod
    def from_json(cls, d: dict) -> "TileTable":
        return cls(
            d["gpu"], d["arch"], d["dtype"], {k: TileConfig(**v) for k, v in d["entries"].items()}, d.get("meta", {})
        )

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> "TileTable":
        return cls.from_json(json.loads(Path(path).read_text()))


def table_filename(gpu: str, arch: str, dtype: str) -> str:
    safe = "".join(c if c.isalnum() else "_" for c in gpu).strip("_").lower()
    return f"{safe}-{arch}-{dtype}.json"


def find_table(gpu: str, arch: str, dtype: str, directory: Path = TABLE_DIR) -> TileTable:
    """The committed table for this GPU/arch/dtype, or an empty one (heuristics only)."""
    path = directory / table_filename(gpu, arch, dtype)
    if path.is_file():
        return TileTable.load(path)
    return TileTable(gpu, arch, dtype, {}, {"source": "empty: heuristic_config only"})
