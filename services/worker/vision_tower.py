"""Qwen2-VL's vision tower over items of one grid at a time, replayed from a CUDA graph per grid;
`HFVisionTower`, HF's own tower run eagerly, for the families whose tower math differs.

HF's tower forward launches ~30 kernels per block from Python (its rotary embedding alone is ~14
elementwise ops, its SDPA path splits every segment into its own call), ~1000 launches for a 7B's
32 blocks. A served 7B worker spent 43 ms of host time per prefill step in it, with the device
waiting on those launches (bench/results/h200-serve-6c14786/steps-summary-a.json: GPU span 40 ms).

`VisionTower.encode(pixels, grid, count)` computes exactly HF's math for `count` items of one grid
(the same modules and weights, the rotary in fp32 as HF does it; every frame of every item is an
attention segment of h*w patches, so attention is one SDPA call over a batch of frames) and, on
CUDA, keeps one graph per (grid (t, h, w), count): its first call runs eagerly (warm-up), the
second is captured, later ones replay (copy the patches into the graph's input, replay, copy the
features out). `encode_items` splits a prefill's images into such calls: items of a grid together,
in power-of-two counts (8 + 4 + 1 for 13) of at most `max_graph_patches` patches where a single
item allows, so a batch of many equal images keeps large GEMMs and few graphs. The most recently
used `max_graphs` keys are kept, in one memory pool; calls over `max_graph_patches` patches run
eagerly (they are device-bound anyway). As for decode graphs, captures are
thread-local and a grid whose capture fails `MAX_CAPTURE_FAILURES` times runs eagerly for good.

Attention is chosen by measurement when a grid is captured: one graph with torch's flash (or
memory-efficient) SDPA, one with cuDNN's; the faster one is kept if its features agree with the
other's. The engine turns cuDNN SDPA off for the language model (attention.py: a per-shape host
cost of ~1.4 ms a call at every new width), a cost a graph pays once, at its capture; at the 7B
tower's head dim of 80, flash attention was a third of a 644 px image's device time
(bench/results/vision-4955695.json).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import structlog
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers.activations import QuickGELUActivation
from transformers.vision_utils import get_vision_position_ids

from kernels.vision_ops import quick_gelu, rotary_vision_
from services.worker.step_graphs import MAX_CAPTURE_FAILURES

log = structlog.get_logger()
# SDPA backends a graph is captured with (the first that takes the inputs), by name
ATTENTION = {
    "flash": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION],
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
}


@dataclass(eq=False)
class _Entry:
    cos: torch.Tensor  # (patches, head_dim) fp32, the grid's rotary angles
    sin: torch.Tensor
    seen: int = 0
    failures: int = 0
    graphless: bool = False
    graph: torch.cuda.CUDAGraph | None = None
    pixels: torch.Tensor | None = None  # the graph's input (patches, channels x t x p x p)
    out: torch.Tensor | None = None  # the graph's output (merged tokens, hidden)
    attention: str = ""  # the ATTENTION choice its graph was captured with
    replay_ms: dict | None = None  # each captured choice's replay time, at capture


class VisionTower:
    def __init__(
        self, visual, device: torch.device, capture: bool, max_graphs: int = 16, max_graph_patches: int = 16384
    ) -> None:
        """`visual`: the model's Qwen2VisionTransformerPretrainedModel; `capture`: graphs on CUDA."""
        self.visual = visual
        self.device = device
        self.capture = capture and device.type == "cuda"
        self.max_graphs, self.max_graph_patches = max_graphs, max_graph_patches
        self.entries: OrderedDict[tuple[tuple[int, int, int], int], _Entry] = OrderedDict()  # (grid, count)
        self.pool_handle = torch.cuda.graph_pool_handle() if self.capture else None
        # observability + tests
        self.replays = self.captures = self.eager = self.capture_failures = 0

    def encode_items(self, items: list[tuple[torch.Tensor, tuple[int, int, int]]]) -> list[torch.Tensor]:
        """Each (patches, grid) item's merged features, in order: items of one grid encoded
        together, in power-of-two counts."""
        out: list[torch.Tensor | None] = [None] * len(items)
        by_grid: dict[tuple[int, int, int], list[int]] = {}
        for i, (_, grid) in enumerate(items):
            by_grid.setdefault(grid, []).append(i)
        for grid, idx in by_grid.items():
            fit = max(1, min(8, self.max_graph_patches // (grid[0] * grid[1] * grid[2])))
            most = 1 << (fit.bit_length() - 1)  # the largest power of two <= fit
            while idx:
                count = min(most, 1 << (len(idx).bit_length() - 1))
                take, idx = idx[:count], idx[count:]
                pixels = items[take[0]][0] if count == 1 else torch.cat([items[i][0] for i in take])
                for i, feats in zip(take, self.encode(pixels, grid, count).chunk(count)):
                    out[i] = feats
        return out

    def encode(self, pixels: torch.Tensor, grid: tuple[int, int, int], count: int = 1) -> torch.Tensor:
        """The merged features (count * t*h*w / merge², hidden) of `count` items of `grid`, their
        patches `pixels` one item after the other (on the device, any float dtype: the tower
        casts), in a tensor of their own."""
        e = self._entry(grid, count)
        if e.graph is None and self.capture and not e.graphless and e.seen > 0 and self._graphable(grid, count):
            self._capture(e, pixels, grid, count)
        if e.graph is not None:
            e.pixels.copy_(pixels)
            e.graph.replay()
            self.replays += 1
            e.seen += 1
            return e.out.clone()
        out = self._forward(pixels, grid, count, e)
        e.seen += 1  # after it ran: a warm-up that raised (the prefill retries its rows) warms up again
        self.eager += 1
        return out

    def _graphable(self, grid: tuple[int, int, int], count: int) -> bool:
        return count * grid[0] * grid[1] * grid[2] <= self.max_graph_patches

    def _entry(self, grid: tuple[int, int, int], count: int) -> _Entry:
        key = (grid, count)
        e = self.entries.get(key)
        if e is not None:
            self.entries.move_to_end(key)
            return e
        v = self.visual
        positions = get_vision_position_ids(torch.tensor([grid]), v.spatial_merge_size)
        if self.device.type == "cuda":
            positions = positions.pin_memory()  # a pageable copy would wait for the queued work
        positions = positions.to(self.device, non_blocking=True)
        cos, sin = v.rotary_pos_emb(positions, positions)  # (patches, head_dim) fp32
        e = _Entry(cos=cos.float().contiguous(), sin=sin.float().contiguous())
        self.entries[key] = e
        while len(self.entries) > self.max_graphs:
            self.entries.popitem(last=False)
        return e

    def _forward(self, pixels: torch.Tensor, grid: tuple[int, int, int], count: int, e: _Entry) -> torch.Tensor:
        """HF's Qwen2VisionTransformerPretrainedModel.forward over `count` items of `grid`, fewer
        launches."""
        v = self.visual
        frames, hw = count * grid[0], grid[1] * grid[2]
        h = v.patch_embed(pixels)
        n, dim = h.shape
        for blk in v.blocks:
            attn = blk.attn
            heads = attn.num_heads
            d = dim // heads
            qkv = attn.qkv(blk.norm1(h)).view(n, 3, heads, d)
            rotary_vision_(qkv, e.cos, e.sin)  # q and k in place, in fp32 as HF's rotary
            # (frames, heads, h*w, d): each frame attends within itself (HF's cu_seqlens segments)
            q, k, val = (qkv[:, i].reshape(frames, hw, heads, d).transpose(1, 2) for i in range(3))
            out = F.scaled_dot_product_attention(q, k, val, scale=attn.scaling)
            h = h + attn.proj(out.transpose(1, 2).reshape(n, dim))
            mlp = blk.mlp
            if isinstance(mlp.act, QuickGELUActivation):
                h = h + mlp.fc2(quick_gelu(mlp.fc1(blk.norm2(h))))
            else:
                h = h + mlp(blk.norm2(h))
        return v.merger(h)

    def _capture(self, e: _Entry, pixels: torch.Tensor, grid: tuple[int, int, int], count: int) -> None:
        """One graph per ATTENTION choice over the same input; the fastest replay whose features
        agree with the first's is kept."""
        e.pixels = torch.empty_like(pixels)
        e.pixels.copy_(pixels)
        graphs, errors = {}, []
        for name, backends in ATTENTION.items():
            graph = torch.cuda.CUDAGraph()
            try:
                with (
                    sdpa_kernel(backends),
                    torch.cuda.graph(graph, pool=self.pool_handle, capture_error_mode="thread_local"),
                ):
                    out = self._forward(e.pixels, grid, count, e)
            except Exception as exc:  # another choice may capture
                errors.append(f"{name}: {exc!r}"[:300])
                torch.cuda.synchronize(self.device)
                continue
            graphs[name] = (graph, out, self._replay_ms(graph))
        if not graphs:
            e.failures += 1
            e.graphless = e.failures >= MAX_CAPTURE_FAILURES
            e.pixels = None
            self.capture_failures += 1
            log.warning(
                "vision_graph_capture_failed",
                errors=errors,
                grid=grid,
                count=count,
                failures=e.failures,
                graphless=e.graphless,
            )
            return
        first = next(iter(graphs.values()))[1].float()
        scale = first.abs().max().clamp_min(1e-6)
        agree = {name: g for name, g in graphs.items() if ((g[1].float() - first).abs().max() / scale).item() < 0.05}
        name = min(agree, key=lambda k: agree[k][2])
        e.graph, e.out, _ = agree[name]
        e.attention, e.replay_ms = name, {k: round(g[2], 3) for k, g in graphs.items()}
        self.captures += 1
        log.info("vision_graph_captured", grid=grid, count=count, attention=name, replay_ms=e.replay_ms)

    def _replay_ms(self, graph: torch.cuda.CUDAGraph, reps: int = 3) -> float:
        graph.replay()  # warm
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / reps


class HFVisionTower:
    """A family's own HF vision tower, run eagerly (no CUDA graphs), for the families whose tower
    VisionTower's forward does not compute (architectures.py `graphed_tower`): Qwen2.5-VL's window
    attention over a permuted patch order, RMSNorm and gated MLP are another forward, and HF's
    is the reference the engine's features must equal. `encode_items` as VisionTower's: every
    item of the call in one `get_image_features` (Qwen2.5-VL's video features are the same
    computation), split back per item."""

    def __init__(self, base_model) -> None:
        """`base_model`: the ForConditionalGeneration's `model` (its get_image_features)."""
        self.base = base_model
        self.eager = 0  # calls (observability + tests)

    def encode_items(self, items: list[tuple[torch.Tensor, tuple[int, int, int]]]) -> list[torch.Tensor]:
        pixels = items[0][0] if len(items) == 1 else torch.cat([p for p, _ in items])
        grids = torch.tensor([g for _, g in items], dtype=torch.long, device=pixels.device)  # as HF generate's
        self.eager += 1
        return list(self.base.get_image_features(pixels, grids).pooler_output)
