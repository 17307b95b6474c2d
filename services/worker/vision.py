"""Vision inputs of a prefill: images and video chunks -> the prompt's input embeddings, with an
image-feature cache keyed by content (the paper's prefix caching of image features).

`vision_items(inputs)` (any thread, in `Engine.prepare`) names every image and video of a
request by a content key: sha256 over its kind, grid (t, h, w) and preprocessed pixel patches.
The patches already hold every processor setting that changes them (resize bounds, mean/std,
patch and merge sizes), so equal keys mean equal vision-tower inputs. The vision tower carries no
LoRA here (adapters target the language model only), so features do not depend on the adapter
or the mode, and one cache serves every request of the worker.

`VisionEncoder.embed` (engine thread) looks every item up in the `FeatureCache`, runs the vision
tower over each missing image and video chunk (vision_tower.py: Qwen2-VL's own math, a CUDA graph
per grid; for a family whose tower differs, HF's, eagerly), stores the features, and scatters them
into the token embeddings at the `<|image_pad|>` / `<|video_pad|>` positions (LLaVA's `<image>`:
its config's image token; llava.LlavaVisionTower, HF's CLIP tower and projector, eagerly).
"""

from __future__ import annotations

import collections
import hashlib
import threading
from dataclasses import dataclass

import structlog
import torch

from services.worker.architectures import for_model
from services.worker.llava import LlavaVisionTower
from services.worker.vision_tower import HFVisionTower, VisionTower
from services.worker.tensor_parallel import GroupBroken, describe

log = structlog.get_logger()

IMAGE = "image"
VIDEO = "video"
# (pixel tensor, grid tensor) per kind, as the processor names them.
_INPUT_KEYS = {IMAGE: ("pixel_values", "image_grid_thw"), VIDEO: ("pixel_values_videos", "video_grid_thw")}


@dataclass(frozen=True)
class VisionItem:
    """One image or video chunk of a request: rows [start, end) of its kind's pixel tensor."""

    kind: str
    key: str
    start: int
    end: int
    grid: tuple[int, int, int]


def content_key(kind: str, grid: tuple[int, int, int], patches: torch.Tensor) -> str:
    h = hashlib.sha256()
    h.update(f"{kind}:{grid[0]}x{grid[1]}x{grid[2]}:{patches.dtype}:{tuple(patches.shape)}:".encode())
    h.update(patches.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())  # any dtype (bf16 staged pixels)
    return h.hexdigest()


def vision_items(inputs) -> list[VisionItem]:
    """Every image then every video of the processor's outputs, with its content key. Images
    without a grid (LLaVA's: pixel_values (images, C, H, W) for a tower of one input size) are
    one pixel row each, keyed with the grid (1, H, W)."""
    items: list[VisionItem] = []
    for kind, (pix_key, grid_key) in _INPUT_KEYS.items():
        pixels, grids = inputs.get(pix_key), inputs.get(grid_key)
        if pixels is not None and grids is None and kind == IMAGE and pixels.dim() == 4:
            grid = (1, int(pixels.shape[2]), int(pixels.shape[3]))
            items.extend(
                VisionItem(kind, content_key(kind, grid, pixels[i : i + 1]), i, i + 1, grid)
                for i in range(pixels.shape[0])
            )
            continue
        if pixels is None or grids is None:
            continue
        row = 0
        for g in grids.tolist():
            n = g[0] * g[1] * g[2]
            grid = (int(g[0]), int(g[1]), int(g[2]))
            items.append(VisionItem(kind, content_key(kind, grid, pixels[row : row + n]), row, row + n, grid))
            row += n
    return items


@dataclass(frozen=True)
class CacheStats:
    hits: int
    misses: int
    evictions: int
    entries: int
    bytes: int
    max_bytes: int


class FeatureCache:
    """LRU map content key -> vision features (tokens, hidden) on the device, bounded by bytes.

    Used on the engine thread; `stats()` may be read from any thread. max_bytes 0 disables it
    (every lookup misses, nothing is kept). An entry larger than max_bytes is not kept."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max(0, int(max_bytes))
        self._entries: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._hits = self._misses = self._evictions = 0

    @staticmethod
    def _size(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def get(self, key: str) -> torch.Tensor | None:
        with self._lock:
            t = self._entries.get(key)
            if t is None:
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
            return t

    def put(self, key: str, features: torch.Tensor) -> None:
        size = self._size(features)
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= self._size(old)
            while self._entries and self._bytes + size > self.max_bytes:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= self._size(dropped)
                self._evictions += 1
            self._entries[key] = features
            self._bytes += size

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(
                self._hits, self._misses, self._evictions, len(self._entries), self._bytes, self.max_bytes
            )


def _map_pixels(inputs: dict, fn) -> None:
    """Replaces the request's pixel tensors (images, videos) in `inputs` by fn(tensor)."""
    for pix_key, _ in _INPUT_KEYS.values():
        if pix_key in inputs:
            inputs[pix_key] = fn(inputs[pix_key])


def cast_pixels(inputs: dict, dtype: torch.dtype) -> None:
    """The request's pixels (images, videos) in `dtype`, in place in the inputs dict."""
    _map_pixels(inputs, lambda t: t.to(dtype))


def stage_pixels(inputs: dict, device: torch.device, dtype: torch.dtype) -> None:
    """For a CUDA worker: the request's pixels in the tower's dtype and in pinned memory, done
    when the request is prepared (its own thread), so the engine loop only starts async copies
    (16 images of 448 px are 77 MB of fp32: ~11 ms of pageable copy, blocking the loop, otherwise).
    The tower casts to its dtype first thing, so the features are the same."""
    if device.type == "cuda":
        _map_pixels(inputs, lambda t: t.to(dtype).pin_memory())  # the cast: a no-op when preprocessing did it


def without_pixels(inputs: dict) -> dict:
    """The inputs with their pixel tensors as meta tensors (shape and dtype, no bytes): what a
    tensor-parallel follower gets of a request; the pixels the tower needs follow at the prefill,
    broadcast by VisionEncoder._encode (pickled through the gloo event group, 16 448 px images
    were 38 MB and held every rank's step start for ~0.1-0.5 s on 2 CPU cores)."""
    out = dict(inputs)
    _map_pixels(out, lambda t: t.to("meta"))
    return out


class VisionEncoder:
    """The model's vision tower behind the feature cache. Tensor parallel (`tp`): every rank runs
    the whole tower over the same pixels, which rank 0 alone holds and broadcasts (NCCL on GPUs)."""

    def __init__(
        self, model, cache: FeatureCache, device: torch.device, dtype: torch.dtype, tp=None, graphs: bool = True
    ) -> None:
        self.model = model  # a served family's ForConditionalGeneration
        arch = for_model(model)
        if arch.graphed_tower:
            self.tower = VisionTower(model.model.visual, device, capture=graphs)  # `graphs`: on CUDA
        else:
            self.tower = HFVisionTower(model.model) if arch.tower_grids else LlavaVisionTower(model.model)
            log.info(
                "vision_tower",
                family=arch.name,
                tower="hf_eager",
                graphs=False,
                why="not Qwen2-VL's tower math (vision_tower.VisionTower)",
            )
        self.cache = cache
        self.device = device
        self.dtype = dtype
        self.tp = tp  # TPGroup of more than one rank (Engine.tp), or None
        # Tensor parallel: the features encoded by the prefill in progress, cached once every rank
        # encoded its own (`settle`), so that the ranks' caches, whose hits decide which pixels
        # are broadcast, stay the same when the tower raised on one rank only.
        self._unsettled: list[tuple[str, torch.Tensor]] = []

    def settle(self, ok: bool) -> None:
        """Tensor parallel, after every rank's embedding step: its features cached (`ok`: it ran on
        every rank) or dropped."""
        unsettled, self._unsettled = self._unsettled, []
        if ok:
            for key, feats in unsettled:
                self.cache.put(key, feats)

    def _pixels(self, kind: str, todo: list[tuple[dict, VisionItem]], failed: bool = False) -> torch.Tensor:
        """The items' pixel rows on the device: tensor parallel, rank 0's, broadcast to every rank.
        `failed` (an earlier kind's tower raised on this rank): only this rank's part in the
        broadcast, so the other ranks' completes; so too when rank 0 cannot have its pixels: it
        sends zeros and raises after (every rank then fails the prefill)."""
        pix_key, _ = _INPUT_KEYS[kind]

        def staged() -> torch.Tensor:  # staged (pinned) pixels copy asynchronously; one cat on the device
            return torch.cat(
                [inputs[pix_key][it.start : it.end].to(self.device, non_blocking=True) for inputs, it in todo]
            )

        if self.tp is None:
            return staged()
        like = todo[0][0][pix_key]  # a follower's is a meta tensor (without_pixels): rank 0's pixels come next
        rows, error = None, None
        if self.tp.rank == 0 and not failed:
            try:
                rows = staged()
            except Exception as exc:  # raised once the broadcast the followers wait in ran
                error = exc
        if rows is None:
            try:
                rows = torch.zeros(
                    (sum(it.end - it.start for _, it in todo), *like.shape[1:]), dtype=like.dtype, device=self.device
                )
            except Exception as exc:  # no buffer for the broadcast: this rank cannot keep up
                raise GroupBroken(
                    f"tensor-parallel rank {self.tp.rank}: no room for the pixels' broadcast: {describe(exc)}"
                ) from exc
        self.tp.broadcast_(rows)  # every rank encodes the same misses (same cache state), in the same order
        if error is not None:
            raise error
        return rows

    def _encode(self, kind: str, todo: list[tuple[dict, VisionItem]]) -> list[torch.Tensor]:
        """Runs the vision tower over the given (request inputs, item) pairs of one kind, items of
        one grid together (VisionTower.encode_items: a CUDA graph per grid and count)."""
        rows = self._pixels(kind, todo)
        items, start = [], 0
        for _, it in todo:
            n = it.end - it.start
            items.append((rows[start : start + n], it.grid))
            start += n
        return [f.to(self.dtype) for f in self.tower.encode_items(items)]

    def features(self, requests: list[tuple[dict, list[VisionItem]]]) -> dict[str, torch.Tensor]:
        """Features by content key for every item of the given requests: the vision tower runs
        once per kind for all cache misses together (a content seen twice is encoded once)."""
        found: dict[str, torch.Tensor] = {}
        missing: dict[str, dict[str, tuple[dict, VisionItem]]] = {IMAGE: {}, VIDEO: {}}
        for inputs, items in requests:
            for it in items:
                if it.key in found or it.key in missing[it.kind]:
                    continue
                t = self.cache.get(it.key)
                if t is None:
                    missing[it.kind][it.key] = (inputs, it)
                else:
                    found[it.key] = t
        error = None  # tensor parallel: a kind's tower raised here; the later kinds' broadcasts still run
        for kind, todo in missing.items():
            if not todo:
                continue
            pairs = list(todo.values())
            if error is not None:  # this rank's features are lost anyway: its part in the broadcast only
                self._pixels(kind, pairs, failed=True)
                continue
            try:
                for key, feats in zip(todo, self._encode(kind, pairs)):
                    found[key] = feats
                    if self.tp is None:
                        self.cache.put(key, feats)
                    else:
                        self._unsettled.append((key, feats))
            except Exception as exc:  # raised once every broadcast ran
                if self.tp is None:
                    raise
                error = error or exc
        if error is not None:
            raise error
        return found

    def embed_batch(self, requests: list[tuple[torch.Tensor, dict, list[VisionItem]]]) -> list[torch.Tensor]:
        """`embed` for several requests (input_ids, inputs, items), one vision pass for all.
        input_ids may live on the host (the processor's): they are copied to the device here and
        the placeholder counts are checked on the host copy (no device sync per request)."""
        found = self.features([(inputs, items) for _, inputs, items in requests])
        return [self._embed(ids, items, found) for ids, _, items in requests]

    def embed(self, input_ids: torch.Tensor, inputs: dict, items: list[VisionItem]) -> torch.Tensor:
        """Token embeddings of the prompt with every image/video's features at its pad tokens."""
        return self.embed_batch([(input_ids, inputs, items)])[0]

    def _embed(self, input_ids: torch.Tensor, items: list[VisionItem], found: dict[str, torch.Tensor]) -> torch.Tensor:
        ids = input_ids.to(self.device, non_blocking=True)  # a blocking copy would wait for the vision tower
        embeds = self.model.model.get_input_embeddings()(ids)
        if not items:
            return embeds
        config = self.model.config
        for kind, token_id in ((IMAGE, config.image_token_id), (VIDEO, getattr(config, "video_token_id", None))):
            feats = [found[it.key] for it in items if it.kind == kind]
            if not feats:
                continue
            values = torch.cat(feats).to(embeds.device, embeds.dtype)
            # placeholder positions on input_ids' device (the host's in the engine: no sync)
            where = (input_ids.reshape(-1) == token_id).nonzero().squeeze(1)
            if where.numel() != values.shape[0]:
                raise ValueError(
                    f"{kind} features ({values.shape[0]} tokens) do not match the prompt's "
                    f"{where.numel()} {kind} tokens"
                )
            embeds.view(-1, embeds.shape[-1])[where.to(self.device, non_blocking=True)] = values
        return embeds
