"""The decode batch's KV cache: per-sequence caches stacked with left padding.

Each sequence is prefilled alone into its own cache. Running sequences decode together: their
caches are stacked once, right-aligned (left padding, masked out by the attention mask), and
the stacked cache then grows in place step after step. It is re-packed only when the batch's
membership changes (a request joins or leaves, at a step boundary), and common left padding
is trimmed then.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values (1, kv_heads, len, head_dim)


def _set_layers(cache: DynamicCache, kv: KV) -> DynamicCache:
    for layer, (k, v) in zip(cache.layers, kv):
        layer.dtype, layer.device = k.dtype, k.device
        layer.keys, layer.values = k, v
        layer.is_initialized = True
    return cache


def cache_from_kv(config, kv: KV) -> DynamicCache:
    return _set_layers(DynamicCache(config=config), kv)


def kv_from_cache(cache: DynamicCache) -> KV:
    return [(layer.keys, layer.values) for layer in cache.layers]


def kv_nbytes(kv: KV) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)


class DecodeBatch:
    """Rows (sequence ids) in batch order, the stacked cache and its (rows, length) mask."""

    def __init__(self, config) -> None:
        self.config = config
        self.rows: list[int] = []
        self.lengths: list[int] = []  # real cached tokens per row
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None

    @property
    def width(self) -> int:
        return 0 if self.mask is None else self.mask.shape[1]

    def nbytes(self) -> int:
        return 0 if self.cache is None else kv_nbytes(kv_from_cache(self.cache))

    def unpack(self) -> dict[int, KV]:
        """Each row's own cache (views into the stacked one), keyed by sequence id."""
        out: dict[int, KV] = {}
        if self.cache is None:
            return out
        kv = kv_from_cache(self.cache)
        w = self.width
        for i, (sid, n) in enumerate(zip(self.rows, self.lengths)):
            out[sid] = [(k[i:i + 1, :, w - n:], v[i:i + 1, :, w - n:]) for k, v in kv]
        return out

    def pack(self, rows: list[int], kvs: dict[int, KV], lengths: dict[int, int]) -> None:
        """Stacks the given sequences' caches, right-aligned, in `rows` order."""
        self.rows = list(rows)
        self.lengths = [lengths[s] for s in rows]
        if not rows:
            self.cache, self.mask = None, None
            return
        width = max(self.lengths)
        first = kvs[rows[0]]
        stacked: KV = []
        for li, (k0, v0) in enumerate(first):
            ks = k0.new_zeros((len(rows), k0.shape[1], width, k0.shape[3]))
            vs = v0.new_zeros((len(rows), v0.shape[1], width, v0.shape[3]))
            for i, sid in enumerate(rows):
                k, v = kvs[sid][li]
                n = self.lengths[i]
                ks[i, :, width - n:] = k[0, :, -n:]
                vs[i, :, width - n:] = v[0, :, -n:]
            stacked.append((ks, vs))
        self.cache = cache_from_kv(self.config, stacked)
        mask = torch.zeros((len(rows), width), dtype=torch.long, device=first[0][0].device)
        for i, n in enumerate(self.lengths):
            mask[i, width - n:] = 1
        self.mask = mask

    def advance(self) -> None:
        """After a decode step: every row cached one more token."""
        assert self.mask is not None
        self.mask = torch.cat([self.mask, self.mask.new_ones((self.mask.shape[0], 1))], dim=1)
        self.lengths = [n + 1 for n in self.lengths]
