"""ATMM: multi-LoRA shrink+expand over token segments, on the CUDA extension or the torch reference.

Semantics (same as `kernels.reference.multi_lora_reference_`)::

    for each segment s with slot k = seg_slots[s] >= 0:
        y[seg_starts[s]:seg_starts[s+1]] += scales[k] * (x[seg] @ A[k]) @ B[k]

x: (T, h_in), y: (T, h_out), both bf16 or fp16 (same dtype), A[k]: (h_in, r_k), B[k]: (r_k, h_out),
exact per-slot rank r_k (multiple of 8, at most 128; mixed ranks in one batch, no padding),
accumulated in fp32 and rounded once into y.

How the worker engine uses it (STYLE item 9: plan once per step, run per layer)::

    plan = AtmmPlan(max_segments=64, max_tokens=8192, device="cuda")      # at start-up
    wq = LoraWeights(num_slots=64, h_in=4096, h_out=4096, dtype=torch.bfloat16, device="cuda")
    wq.set(slot, a, b, scale)                                             # on adapter load
    plan.update(seg_starts, seg_slots, ranks=wq.ranks)                    # once per step
    atmm_(y, x, plan, wq)                                                 # every layer, graph-safe

`plan.update` writes the segment metadata into preallocated device buffers (one async copy from
pinned memory); `atmm_` does no host synchronisation, so a step can be captured in a CUDA graph
and replayed for later plans written into the same buffers. The tile configuration comes from
the GPU's tile table (`kernels.tile_table`), one dict lookup per call; the entry names the backend
(our CUDA kernels, CUDA shrink + CUTLASS grouped expand, the Triton SGMV kernels of
`kernels.triton_sgmv`, imported only when a config names it, or the fused single-launch CUDA
kernel for small token counts) that the offline search found fastest.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.build import BUILT_FOR, load_extension, unsupported_gpu
from kernels.reference import SegmentPlan, lora_expand_reference_, multi_lora_reference_
from kernels.tile_table import (
    FUSED_MAX_RANK_BLOCK,
    TileConfig,
    TileTable,
    find_table,
    fused_groups,
    heuristic_config,
    rank_block,
)

BT_MENU = (16, 32, 64, 128)
MAX_RANK = 128
_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


_ext_failed = False


def extension():
    """The compiled extension, or None (no CUDA device, nvcc or headers, or a GPU other than the
    sm_90 it is built for): torch reference then. A failed build is not retried in this process
    (a worker would otherwise rebuild at every merge); an unsupported GPU is logged once."""
    global _ext_failed
    if _ext_failed:
        return None
    capability = unsupported_gpu()
    if capability is not None:
        _ext_failed = True
        import structlog

        structlog.get_logger().warning(
            "kernels_extension_unsupported_gpu",
            capability=f"sm_{capability[0]}{capability[1]}",
            built_for=f"sm_{BUILT_FOR[0]}{BUILT_FOR[1]}",
            using="torch reference LoRA, layer ops and switch; Triton paged attention where it runs",
        )
        return None
    try:
        return load_extension()
    except Exception as exc:  # a failed build must not take the CPU path down
        _ext_failed = True
        import structlog

        structlog.get_logger().warning("kernels_extension_build_failed", error=repr(exc)[:500])
        return None


class AtmmPlan:
    """Token segments of one engine step in preallocated device buffers, shared by every layer.

    Device layout (int32 `meta`): [S, seg_starts (cap+1), seg_slots (cap), then for each token
    tile BT in (16, 32, 64, 128) the prefix count of BT-token tiles per segment (cap+1)].
    Host mirrors (`segment_plan`, `num_tokens`, `tiles`, `rank_stride`) drive the tile choice and
    the reference fallback. `workspace` holds the fp32 split-K partials of x·A.
    """

    def __init__(
        self,
        max_segments: int,
        max_tokens: int,
        device: torch.device | str = "cpu",
        workspace_floats: int | None = None,
    ):
        if max_segments < 1 or max_tokens < 1:
            raise ValueError("max_segments and max_tokens must be >= 1")
        self.device = torch.device(device)
        self.seg_cap = max_segments
        self.max_tokens = max_tokens
        n = 1 + (max_segments + 1) + max_segments + len(BT_MENU) * (max_segments + 1)
        on_cuda = self.device.type == "cuda"
        self.meta = torch.zeros(n, dtype=torch.int32, device=self.device)
        self._pin = on_cuda
        floats = workspace_floats or max(max_tokens * MAX_RANK * 2, 1 << 20)
        self.workspace = torch.empty(floats, dtype=torch.float32, device=self.device)
        # CUTLASS grouped-expand scratch (problem arrays + 16-bit x·A rows), allocated on first use
        self.aux_bytes = 256 * (8 + max_segments) + max_tokens * MAX_RANK * 2 + (1 << 12)
        self._aux: torch.Tensor | None = None
        self.segment_plan = SegmentPlan([0], [])
        self.tiles: dict[int, int] = {bt: 0 for bt in BT_MENU}
        self.rank_stride = 16
        self.num_segments = 0
        self.active_segments = 0
        self.version = 0

    @property
    def num_tokens(self) -> int:
        return self.segment_plan.num_tokens

    @property
    def aux(self) -> torch.Tensor:
        """Scratch of the CUTLASS grouped-GEMM expand path (allocated once, on first use)."""
        if self._aux is None:
            self._aux = torch.empty(self.aux_bytes, dtype=torch.uint8, device=self.device)
        return self._aux

    def update(self, seg_starts: Sequence[int], seg_slots: Sequence[int], ranks: Sequence[int]) -> "AtmmPlan":
        """Write this step's segments (offsets, slots; slot -1 = no LoRA) into the device buffers.

        `ranks[k]` is slot k's rank (a `LoraWeights.ranks` list); it sets the workspace's rank
        stride. Async: one host-to-device copy on the current stream, no synchronisation.
        """
        starts, slots = [int(v) for v in seg_starts], [int(v) for v in seg_slots]
        s = len(slots)
        if len(starts) != s + 1 or (s and starts[0] != 0):
            raise ValueError("seg_starts must have len(seg_slots) + 1 entries starting at 0")
        if s > self.seg_cap:
            raise ValueError(f"{s} segments exceed the plan's capacity {self.seg_cap}")
        if any(b < a for a, b in zip(starts, starts[1:])):
            raise ValueError("seg_starts must be non-decreasing")
        if starts[-1] > self.max_tokens:
            raise ValueError(f"{starts[-1]} tokens exceed the plan's capacity {self.max_tokens}")
        used = [k for k, lo, hi in zip(slots, starts, starts[1:]) if k >= 0 and hi > lo]
        for k in used:
            if k >= len(ranks) or ranks[k] <= 0:
                raise ValueError(f"segment uses slot {k}, which holds no adapter")
        rmax = max((ranks[k] for k in used), default=16)
        if rmax > MAX_RANK:
            raise ValueError(f"rank {rmax} exceeds {MAX_RANK}")
        cap = self.seg_cap
        host = [0] * self.meta.numel()
        host[0] = s
        host[1 : 1 + s + 1] = starts
        host[2 + cap : 2 + cap + s] = slots
        tiles = {}
        for i, bt in enumerate(BT_MENU):
            base = 2 + 2 * cap + i * (cap + 1)
            acc = 0
            for j in range(s):
                host[base + j] = acc
                if slots[j] >= 0:
                    acc += -(-(starts[j + 1] - starts[j]) // bt)
            host[base + s] = acc
            tiles[bt] = acc
        # a new pinned staging tensor each update: torch's pinned allocator keeps its block until the
        # copy ran, so an update never waits for the device (one staging buffer had to wait for the
        # previous update's copy, i.e. for the device to reach it)
        self.meta.copy_(torch.tensor(host, dtype=torch.int32, pin_memory=self._pin), non_blocking=True)
        self.segment_plan = SegmentPlan(starts, slots)
        self.tiles = tiles
        self.rank_stride = max(16, -(-rmax // 16) * 16)
        self.num_segments = s
        self.active_segments = len(used)
        self.version += 1
        return self

    def update_from_token_slots(self, token_slots: Sequence[int], ranks: Sequence[int]) -> "AtmmPlan":
        """`update` for tokens already grouped by slot (equal slots adjacent)."""
        p = SegmentPlan.from_token_slots(token_slots)
        return self.update(p.seg_starts, p.seg_slots, ranks)


class LoraWeights:
    """Adapter slots of one linear layer: A_k (h_in, r_k), B_k (r_k, h_out), scale s_k.

    Keeps the tensors alive and mirrors their pointers, ranks and scales in small device tables
    that the kernel indexes by slot (updated when an adapter is set, never per step). `aligned16`
    (host side, no sync) says whether every A/B set so far starts on a 16-byte boundary, which the
    CUDA kernels' 16-byte copies and the Triton kernels' alignment hints rely on.
    """

    def __init__(
        self,
        num_slots: int,
        h_in: int,
        h_out: int,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
    ):
        if dtype not in _DTYPES and dtype != torch.float32:  # float32: the torch reference only (CPU tests)
            raise ValueError(f"dtype must be bfloat16 or float16 (float32 for the reference), got {dtype}")
        self.num_slots, self.h_in, self.h_out, self.dtype = num_slots, h_in, h_out, dtype
        self.device = torch.device(device)
        self.a: list[torch.Tensor | None] = [None] * num_slots
        self.b: list[torch.Tensor | None] = [None] * num_slots
        self.ranks: list[int] = [0] * num_slots
        self.scales: list[float] = [0.0] * num_slots
        # The four device tables are views of one buffer, written by one async copy per flush: a
        # per-element write of a CUDA tensor is a synchronous pageable copy, i.e. a stall of the
        # engine loop for every slot of every projection when a new set of adapters arrives.
        self._table = torch.zeros(num_slots * 24, dtype=torch.uint8, device=self.device)
        n8 = num_slots * 8
        self.a_ptrs = self._table[:n8].view(torch.int64)
        self.b_ptrs = self._table[n8 : 2 * n8].view(torch.int64)
        self.rank_table = self._table[2 * n8 : 2 * n8 + num_slots * 4].view(torch.int32)
        self.scale_table = self._table[2 * n8 + num_slots * 4 :].view(torch.float32)
        self._dirty = False
        self._misaligned: set[int] = set()  # slots whose A or B does not start on 16 bytes

    @property
    def aligned16(self) -> bool:
        """Every A/B data pointer is 16-byte aligned (rows are: r and h_out are multiples of 8)."""
        return not self._misaligned and self.h_in % 8 == 0 and self.h_out % 8 == 0

    def set(self, slot: int, a: torch.Tensor, b: torch.Tensor, scale: float, flush: bool = True) -> None:
        """Place adapter (A: (h_in, r), B: (r, h_out), contiguous, this dtype/device) in `slot`.
        flush=False defers the device tables' update to `flush()` (batching many slots)."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.num_slots})")
        r = a.shape[1] if a.dim() == 2 else -1
        if a.dim() != 2 or a.shape[0] != self.h_in or r < 1:
            raise ValueError(f"A must be ({self.h_in}, r), got {tuple(a.shape)}")
        if b.dim() != 2 or tuple(b.shape) != (r, self.h_out):
            raise ValueError(f"B must be ({r}, {self.h_out}), got {tuple(b.shape)}")
        if r % 8 or r > MAX_RANK:
            raise ValueError(f"rank must be a multiple of 8 and at most {MAX_RANK}, got {r}")
        for name, t in (("A", a), ("B", b)):
            if t.dtype != self.dtype or t.device != self.device:
                raise ValueError(f"{name} must be {self.dtype} on {self.device}, got {t.dtype} on {t.device}")
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
        self.a[slot], self.b[slot], self.ranks[slot], self.scales[slot] = a, b, r, float(scale)
        self._slot_changed(slot, flush)

    def clear(self, slot: int, flush: bool = True) -> None:
        self.a[slot] = self.b[slot] = None
        self.ranks[slot], self.scales[slot] = 0, 0.0
        self._slot_changed(slot, flush)

    def _slot_changed(self, slot: int, flush: bool) -> None:
        a, b = self.a[slot], self.b[slot]
        if a is not None and (a.data_ptr() % 16 or b.data_ptr() % 16):
            self._misaligned.add(slot)
        else:
            self._misaligned.discard(slot)
        self._dirty = True
        if flush:
            self.flush()

    def flush(self) -> None:
        """Writes the slots' pointers, ranks and scales to the device tables (one async copy from
        pinned memory; torch's pinned allocator keeps the staging block until the copy ran)."""
        if not self._dirty:
            return
        n = self.num_slots
        host = torch.empty(n * 24, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        n8 = n * 8
        host[:n8].view(torch.int64).copy_(torch.tensor([t.data_ptr() if t is not None else 0 for t in self.a]))
        host[n8 : 2 * n8].view(torch.int64).copy_(torch.tensor([t.data_ptr() if t is not None else 0 for t in self.b]))
        host[2 * n8 : 2 * n8 + n * 4].view(torch.int32).copy_(torch.tensor(self.ranks, dtype=torch.int32))
        host[2 * n8 + n * 4 :].view(torch.float32).copy_(torch.tensor(self.scales, dtype=torch.float32))
        self._table.copy_(host, non_blocking=True)
        self._dirty = False


_tables: dict[tuple, TileTable] = {}


def _device_index(device: torch.device | str | int) -> int:
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.index is not None:
        return device.index
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


def gpu_key(device: torch.device | str | int) -> tuple[str, str]:
    """(GPU name, "sm{major}{minor}") of a CUDA device: with the dtype name, the key of its tile
    table (the same as `kernels.tile_search` writes and the adapter store keys)."""
    props = torch.cuda.get_device_properties(_device_index(device))
    return props.name, f"sm{props.major}{props.minor}"


def default_table(device: torch.device, dtype: torch.dtype) -> TileTable:
    """The tile table in use for this GPU and dtype (cached): the one `use_table` installed, else
    the committed one, else heuristics only."""
    key = (_device_index(device), dtype)
    if key not in _tables:
        gpu, arch = gpu_key(device)
        _tables[key] = find_table(gpu, arch, _DTYPES[dtype])
    return _tables[key]


def use_table(device: torch.device | str | int, dtype: torch.dtype, table: TileTable) -> None:
    """Install `table` as the tile table `atmm_` uses for `device` and `dtype` (e.g. one fetched
    from the adapter store), replacing the cached default. Its dtype must be `dtype`'s."""
    name = _DTYPES.get(dtype)
    if name is None:
        raise ValueError(f"tile tables are for bfloat16 or float16, not {dtype}")
    if table.dtype != name:
        raise ValueError(f"the table is for {table.dtype}, not {name}")
    _tables[(_device_index(device), dtype)] = table


_config_ids: dict[str, int] = {}


def config_id(name: str) -> int:
    """Menu index of a compiled kernel configuration by name."""
    if not _config_ids:
        ext = extension()
        if ext is None:
            raise RuntimeError("the CUDA extension is not available")
        _config_ids.update({c["name"]: c["id"] for c in ext.configs()})
    try:
        return _config_ids[name]
    except KeyError:
        raise ValueError(f"no compiled kernel configuration named {name!r}") from None


_resolved: dict[tuple, tuple[int, int, int]] = {}


def _resolve(cfg: TileConfig, dtype: str, rank_stride: int, plan: AtmmPlan, tokens: int) -> tuple[int, int, int]:
    key = (cfg, dtype, rank_stride)
    ids = _resolved.get(key)
    if ids is None:
        ids = (
            config_id(cfg.shrink_name(dtype, rank_block(rank_stride))),
            config_id(cfg.expand_name(dtype)),
            cfg.split_k,
        )
        _resolved[key] = ids
    split_k = ids[2]
    cap = plan.workspace.numel() // max(1, tokens * rank_stride)
    if split_k > cap:
        split_k = max(1, 1 << (cap.bit_length() - 1)) if cap >= 1 else 1
    return ids[0], ids[1], split_k


def triton_available() -> bool:
    """Whether the Triton backend can run (imports triton on first call only)."""
    global _triton_ok
    if _triton_ok is None:
        try:
            from kernels import triton_sgmv  # lazy: triton is optional

            _triton_ok = triton_sgmv.available()
        except Exception:  # a broken triton install must not take the CUDA path down
            _triton_ok = False
    return _triton_ok


_triton_ok: bool | None = None
# misaligned weights: the Triton kernels without alignment hints at the default tiles
_UNALIGNED_TRITON = TileConfig(16, 64, 3, 1, 16, 128, backend="triton")


def _run_cuda(ext, y, x, plan, weights, config, dtype, pdl):
    rs = plan.rank_stride
    shrink_id, expand_id, split_k = _resolve(config, dtype, rs, plan, plan.num_tokens)
    ext.atmm(
        y,
        x,
        plan.meta,
        plan.seg_cap,
        weights.a_ptrs,
        weights.b_ptrs,
        weights.rank_table,
        weights.scale_table,
        plan.workspace,
        shrink_id,
        expand_id,
        split_k,
        rs,
        plan.tiles[config.shrink_bt],
        plan.tiles[config.expand_bt],
        pdl,
    )


def _run_grouped(ext, y, x, plan, weights, config, dtype, pdl):  # CUDA shrink, CUTLASS grouped-GEMM expand
    rs = plan.rank_stride
    shrink_id, _, split_k = _resolve(config, dtype, rs, plan, plan.num_tokens)
    ext.atmm_grouped(
        y,
        x,
        plan.meta,
        plan.seg_cap,
        weights.a_ptrs,
        weights.b_ptrs,
        weights.rank_table,
        weights.scale_table,
        plan.workspace,
        plan.aux,
        shrink_id,
        config_id(config.grouped),
        split_k,
        rs,
        plan.tiles[config.shrink_bt],
        pdl,
    )


def _run_triton(ext, y, x, plan, weights, config, dtype, pdl):
    from kernels.triton_sgmv import atmm_triton_

    atmm_triton_(y, x, plan, weights, config)


_fused_ids: dict[tuple, int] = {}


def fused_launch_args(config: TileConfig, h_out: int, plan: AtmmPlan) -> tuple[int, int]:
    """(column groups, tile count) of a fused launch: the binding's `atmm_shrink` sizes the grid
    as tiles x groups (its split_k), so tiles are counted x cluster to give every CTA of every
    item a place in the persistent grid. Groups are capped where the binding's workspace check
    (written for split-K, unused by this kernel) would reject them."""
    groups = fused_groups(config.split_k, h_out, config.expand_bn, config.cluster)
    cap = plan.workspace.numel() // max(1, plan.num_tokens * plan.rank_stride)
    groups = max(1, min(groups, cap))
    return groups, plan.tiles[config.shrink_bt] * config.cluster


def _run_fused(ext, y, x, plan, weights, config, dtype, pdl):  # one launch: shrink + expand per CTA cluster
    rs = plan.rank_stride
    key = (config, dtype, rank_block(rs))
    fid = _fused_ids.get(key)
    if fid is None:
        fid = _fused_ids[key] = config_id(config.fused_name(dtype, rank_block(rs)))
    groups, tiles = fused_launch_args(config, weights.h_out, plan)
    ext.atmm_shrink(
        y,
        x,
        plan.meta,
        plan.seg_cap,
        weights.a_ptrs,
        weights.b_ptrs,
        weights.rank_table,
        weights.scale_table,
        plan.workspace,
        fid,
        groups,
        rs,
        tiles,
        pdl,
    )


# backend name (TileConfig.backend) -> runner(ext, y, x, plan, weights, config, dtype, pdl)
BACKEND_RUNNERS = {"cuda": _run_cuda, "cutlass_grouped": _run_grouped, "triton": _run_triton, "fused": _run_fused}


def _kernel_ext(y: torch.Tensor):
    """The extension when y is on a CUDA device and the extension is built, else None (reference)."""
    return extension() if y.is_cuda else None


def choose_config(
    config: TileConfig, h_in: int, h_out: int, rank_stride: int, tokens: int, segments: int, dtype: str = "bfloat16"
) -> TileConfig:
    """`config`, or the heuristic CUDA config when it names a backend this machine (or this
    batch: the fused kernels take ranks <= 64) cannot run."""
    if (config.backend == "triton" and not triton_available()) or (
        config.backend == "fused" and rank_block(rank_stride) > FUSED_MAX_RANK_BLOCK
    ):
        return heuristic_config(h_in, h_out, rank_stride, tokens, segments, dtype=dtype)
    return config


def atmm_(
    y: torch.Tensor,
    x: torch.Tensor,
    plan: AtmmPlan,
    weights: LoraWeights,
    *,
    config: TileConfig | None = None,
    table: TileTable | None = None,
    pdl: bool = True,
) -> torch.Tensor:
    """In place: y[seg] += s_k (x[seg] A_k) B_k for every segment of `plan` (see module doc).

    x: (T, h_in), y: (T, h_out), T = plan.num_tokens; CUDA tensors use the kernels (tile config
    from `config`, else `table`, else this GPU's committed table), anything else the torch
    reference. The config's `backend` picks the implementation: our CUDA kernels ("cuda"), CUDA
    shrink + CUTLASS grouped expand ("cutlass_grouped"), the Triton SGMV kernels ("triton";
    the heuristic CUDA config where triton is missing) or the fused single-launch kernel
    ("fused"). `pdl` chains the CUDA launches with programmatic dependent launch. Weights that
    are not 16-byte aligned (`LoraWeights.aligned16`, views into odd offsets) never reach the CUDA
    kernels (16-byte copies): they run on Triton without alignment hints, else the reference.
    Returns y.
    """
    if x.dim() != 2 or y.dim() != 2:
        raise ValueError("x and y must be 2-D (tokens, features)")
    if x.shape[1] != weights.h_in or y.shape[1] != weights.h_out:
        raise ValueError(
            f"x/y features ({x.shape[1]}, {y.shape[1]}) do not match the weights ({weights.h_in}, {weights.h_out})"
        )
    tokens = plan.num_tokens
    if x.shape[0] != tokens or y.shape[0] != tokens:
        raise ValueError(f"plan covers {tokens} tokens, x has {x.shape[0]}, y has {y.shape[0]}")
    ext = _kernel_ext(y)
    if ext is not None and not weights.aligned16 and not triton_available():
        ext = None
    if ext is None:
        return multi_lora_reference_(y, x, plan.segment_plan, weights.a, weights.b, weights.scales)
    if tokens == 0 or plan.active_segments == 0:
        return y
    dtype = _DTYPES.get(x.dtype)
    if dtype is None:
        raise ValueError(f"x must be bfloat16 or float16, got {x.dtype}")
    rs = plan.rank_stride
    if config is None:
        config = (table or default_table(x.device, x.dtype)).lookup(
            weights.h_in, weights.h_out, rs, tokens, plan.active_segments
        )
    config = choose_config(config, weights.h_in, weights.h_out, rs, tokens, plan.active_segments, dtype)
    if not weights.aligned16 and config.backend != "triton":
        config = _UNALIGNED_TRITON
    BACKEND_RUNNERS[config.backend](ext, y, x, plan, weights, config, dtype, pdl)
    return y


def atmm_expand_xa_(
    y: torch.Tensor,
    xa: torch.Tensor,
    cols: torch.Tensor,
    plan: AtmmPlan,
    weights: LoraWeights,
    *,
    host_cols: Sequence[int] | None = None,
    config: TileConfig | None = None,
    table: TileTable | None = None,
    pdl: bool = True,
) -> torch.Tensor:
    """In place: y[seg] += s_k xa[seg, cols[k]:cols[k] + r_k] B_k — ATMM's expand alone, on x·A
    that something else computed: e.g. the extra output columns of a base GEMM whose weight
    carries the slots' A^T as extra rows (services/worker/atmm_backend.py "folded" projections),
    which saves the shrink launch and its read of x. `cols` (int32, one per slot) lives on y's
    device; `host_cols` (its host copy) is what the torch reference reads. x·A is rounded to
    xa's dtype once (as PEFT rounds lora_A's output); scale, B and y as in `atmm_`.
    The expand tiles come from `config`, else the tile table's config for the projection's
    (h_in, h_out) when it names an own expand ("cuda", "cutlass_grouped"), else the heuristic's."""
    if xa.dim() != 2 or y.dim() != 2 or xa.shape[0] != y.shape[0]:
        raise ValueError("xa and y must be 2-D with one row per token")
    if y.shape[1] != weights.h_out:
        raise ValueError(f"y has {y.shape[1]} features, the weights {weights.h_out}")
    tokens = plan.num_tokens
    if xa.shape[0] != tokens:
        raise ValueError(f"plan covers {tokens} tokens, xa has {xa.shape[0]}")
    ext = _kernel_ext(y)
    if ext is None or not weights.aligned16:
        hc = list(host_cols) if host_cols is not None else cols.tolist()
        return lora_expand_reference_(y, xa, hc, plan.segment_plan, weights.b, weights.scales)
    if tokens == 0 or plan.active_segments == 0:
        return y
    dtype = _DTYPES.get(y.dtype)
    if dtype is None or xa.dtype != y.dtype:
        raise ValueError(f"y and xa must be bfloat16 or float16 of one dtype, got {y.dtype}, {xa.dtype}")
    rs = plan.rank_stride
    if config is None:
        config = (table or default_table(y.device, y.dtype)).lookup(
            weights.h_in, weights.h_out, rs, tokens, plan.active_segments
        )
    if config.backend not in ("", "cuda", "cutlass_grouped"):  # those record the best own expand
        config = heuristic_config(weights.h_in, weights.h_out, rs, tokens, plan.active_segments, dtype=dtype)
    ext.atmm_expand_xa(
        y,
        xa,
        cols,
        plan.meta,
        plan.seg_cap,
        weights.b_ptrs,
        weights.rank_table,
        weights.scale_table,
        plan.workspace,
        config_id(config.expand_name(dtype)),
        rs,
        plan.tiles[config.expand_bt],
        pdl,
    )
    return y


def lora_weights_from_lists(
    a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], scales: Sequence[float], num_slots: int | None = None
) -> LoraWeights:
    """LoraWeights holding adapters k = 0..n-1 (convenience for tests and benchmarks)."""
    n = num_slots or len(a)
    w = LoraWeights(n, a[0].shape[0], b[0].shape[1], a[0].dtype, a[0].device)
    for k, (ak, bk, sk) in enumerate(zip(a, b, scales)):
        w.set(k, ak.contiguous(), bk.contiguous(), sk)
    return w


__all__ = [
    "AtmmPlan",
    "LoraWeights",
    "atmm_",
    "atmm_expand_xa_",
    "choose_config",
    "default_table",
    "extension",
    "gpu_key",
    "lora_weights_from_lists",
    "triton_available",
    "use_table",
]
