"""The decode batch's KV cache: per-sequence caches stacked with left padding.

Layers are `GrowingLayer`s: a token is appended into spare capacity (amortised O(1)) instead of
DynamicLayer's torch.cat of the whole cache every step.

The requests of one step are prefilled together into one right-padded batch cache;
`split_rows` gives each sequence its own cache (views of its row without the padding). Running
sequences decode together: their caches are stacked once, right-aligned (left padding, masked
out by the attention mask), and the stacked cache then grows in place step after step. It is
re-packed only when the batch's membership changes (a request joins or leaves, at a step
boundary), and common left padding is trimmed then.

The stacked cache lives in one of two preallocated arenas (per layer (rows, kv_heads, capacity,
head_dim), capacity a power of two >= width + headroom), alternated on each re-pack (the new
stack is copied from views of the old one) and reused while big enough. Stable buffers are what
lets a captured CUDA graph of the decode step (decode_graphs.py) be replayed across re-packs.
In that graph a layer writes the new token at a device-side index (`static_index`) and attends
over the whole capacity under a mask, so the step's shapes do not change as the cache grows.

A re-pack moves the rows that stay in the batch straight from the current stack: they are all
right-aligned at the old width, so each run of rows consecutive in both stacks is one slice copy
per layer (two per layer and row before: 1792 copies launched from Python for 32 rows of the 7B
shape, ~36% of a serving worker's engine thread, bench/results/worker-pyspy-summary-fdbdeb8.txt).
Only the joining rows (their prefill caches) are copied row by row.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values (1, kv_heads, len, head_dim)


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys/values are views into buffers with spare capacity along the
    sequence; appending writes in place and reallocates (doubling) only when full. The views are
    made when read, from `length`: a static decode step only counts its token (no per-layer
    tensor work on the host)."""

    kbuf: torch.Tensor | None = None
    vbuf: torch.Tensor | None = None
    length = 0
    # Set by decode_graphs for one step: write the token at this device index (a (1,) long tensor)
    # and return the whole buffers (the caller masks positions past `length`).
    static_index: torch.Tensor | None = None

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self.kbuf is None else self.kbuf[:, :, :self.length]

    @keys.setter
    def keys(self, value) -> None:
        if value is not None:  # CacheLayerMixin.__init__ clears it; nothing may replace the view
            raise AttributeError("GrowingLayer.keys is a view of its buffer: adopt() buffers instead")

    @property
    def values(self) -> torch.Tensor | None:
        return None if self.vbuf is None else self.vbuf[:, :, :self.length]

    @values.setter
    def values(self, value) -> None:
        if value is not None:
            raise AttributeError("GrowingLayer.values is a view of its buffer: adopt() buffers instead")

    def get_seq_length(self) -> int:
        return self.length

    def adopt(self, kbuf: torch.Tensor, vbuf: torch.Tensor, length: int) -> None:
        self.dtype, self.device = kbuf.dtype, kbuf.device
        self.kbuf, self.vbuf, self.length = kbuf, vbuf, length
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if self.static_index is not None:
            self.kbuf.index_copy_(2, self.static_index, key_states)
            self.vbuf.index_copy_(2, self.static_index, value_states)
            return self.kbuf, self.vbuf
        n, add = self.length, key_states.shape[-2]
        if self.kbuf is None or n + add > self.kbuf.shape[-2]:
            cap = n + add if n == 0 else 2 * (n + add)
            shape = (*key_states.shape[:2], cap, key_states.shape[-1])
            kbuf, vbuf = key_states.new_empty(shape), value_states.new_empty(shape)
            if n:
                kbuf[:, :, :n] = self.keys
                vbuf[:, :, :n] = self.values
            self.kbuf, self.vbuf = kbuf, vbuf
        self.kbuf[:, :, n:n + add] = key_states
        self.vbuf[:, :, n:n + add] = value_states
        self.adopt(self.kbuf, self.vbuf, n + add)
        return self.keys, self.values

    def nbytes(self) -> int:
        if self.kbuf is None:
            return 0
        return self.kbuf.numel() * self.kbuf.element_size() * 2


def new_cache(config) -> DynamicCache:
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() for _ in cache.layers]
    return cache


def cache_from_buffers(config, bufs: KV, length: int) -> DynamicCache:
    cache = new_cache(config)
    for layer, (k, v) in zip(cache.layers, bufs):
        layer.adopt(k, v, length)
    return cache


def kv_from_cache(cache: DynamicCache) -> KV:
    return [(layer.keys, layer.values) for layer in cache.layers]


def split_rows(cache: DynamicCache, lengths: list[int]) -> list[KV]:
    """Each row's own cache from a right-padded batch cache: row i's first lengths[i] positions
    (views; the padding after them is dropped)."""
    kv = kv_from_cache(cache)
    return [[(k[i:i + 1, :, :n], v[i:i + 1, :, :n]) for k, v in kv] for i, n in enumerate(lengths)]


def kv_nbytes(kv: KV) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)


def cache_nbytes(cache: DynamicCache) -> int:
    """Memory held, spare capacity included."""
    return sum(layer.nbytes() if isinstance(layer, GrowingLayer) else
               layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers)


def _runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(dst, src) row pairs -> (dst, src, count) runs consecutive in both."""
    runs: list[list[int]] = []
    for dst, src in pairs:
        if runs and runs[-1][0] + runs[-1][2] == dst and runs[-1][1] + runs[-1][2] == src:
            runs[-1][2] += 1
        else:
            runs.append([dst, src, 1])
    return [(d, s, c) for d, s, c in runs]


class DecodeBatch:
    """Rows (sequence ids) in batch order, their cached lengths and the stacked cache (`width`
    positions, each row right-aligned)."""

    MIN_CAPACITY = 256  # smallest arena capacity (positions)

    def __init__(self, config, headroom: int = 64) -> None:
        self.config = config
        self.headroom = headroom  # decode steps the stacked cache takes before it must grow
        self.rows: list[int] = []
        self.lengths: list[int] = []  # real cached tokens per row
        self.width = 0  # positions of the stacked cache (the longest row's length)
        self.cache: DynamicCache | None = None
        self._arenas: list[KV | None] = [None, None]
        self._serials = [0, 0]  # each arena's allocation number (buffers_key)
        self._allocations = 0
        self._current = 0
        self._static: dict[int, DynamicCache] = {}  # bucket rows -> cache over the arena's first rows

    def nbytes(self) -> int:
        return 0 if self.cache is None else cache_nbytes(self.cache)

    def pack(self, rows: list[int], kvs: dict[int, KV], lengths: dict[int, int]) -> None:
        """Stacks the sequences `rows`, right-aligned, in that order: those in `kvs` from their own
        caches (joining rows), the others from the current stack (rows staying in the batch)."""
        old_index = {sid: i for i, sid in enumerate(self.rows)}
        staying = [(i, old_index[sid]) for i, sid in enumerate(rows) if sid not in kvs]  # KeyError: unknown row
        old_kv = kv_from_cache(self.cache) if staying else []  # (old rows, heads, old width, dim) per layer
        old_width = self.width
        self.rows = list(rows)
        self.lengths = [lengths[s] for s in rows]
        self._static = {}
        if not rows:
            self.cache, self.width = None, 0
            return
        width = self.width = max(self.lengths)
        stacked = self._arena(len(rows), width + self.headroom, kvs[rows[0]] if rows[0] in kvs else old_kv)
        # staying rows keep their tokens and their (zero) left padding: the last m columns move
        m = min(width, old_width)
        for dst, src, count in _runs(staying):
            for (ks, vs), (k, v) in zip(stacked, old_kv):
                ks[dst:dst + count, :, width - m:width] = k[src:src + count, :, old_width - m:old_width]
                vs[dst:dst + count, :, width - m:width] = v[src:src + count, :, old_width - m:old_width]
        for i, sid in enumerate(rows):
            if sid not in kvs:
                continue
            n = self.lengths[i]
            for (ks, vs), (k, v) in zip(stacked, kvs[sid]):
                ks[i, :, width - n:width] = k[0, :, -n:]
                vs[i, :, width - n:width] = v[0, :, -n:]
        self.cache = cache_from_buffers(self.config, stacked, width)

    def _in_arena(self) -> bool:
        """Whether the stacked cache still lives in its arena (an eager step that found it full
        moved it to buffers of its own rows)."""
        arena = self._arenas[self._current]
        if self.cache is None or arena is None:
            return False
        k, a = self.cache.layers[0].kbuf, arena[0][0]
        return k is not None and k.data_ptr() == a.data_ptr() and k.shape[2] == a.shape[2]

    def buffers_key(self) -> tuple:
        """What the stacked cache's buffers are, for the keys of captured decode graphs (which
        hold their addresses): an arena by its allocation number — a freed arena's address can
        come back as a new arena's first layer with the other layers elsewhere, and a graph
        captured on the old one would then write into whatever lives at its other addresses — and
        a cache that left its arena by every layer's buffer addresses."""
        if self._in_arena():
            return "arena", self._serials[self._current]
        return "own", *(t.data_ptr() for layer in self.cache.layers for t in (layer.kbuf, layer.vbuf))

    def bucket_rows(self) -> int:
        """Rows a static decode step runs: the batch's rows rounded up to a power of two, the rows
        past them being spare rows of the arena (so steps of 5 to 8 rows share one CUDA graph as
        requests come and go); the batch's own rows when the cache left the arena."""
        n = len(self.rows)
        if n == 0 or not self._in_arena():
            return n
        return 1 << (n - 1).bit_length()  # the arena's rows are a power of two >= n: they hold it

    def static_cache(self, rows: int) -> DynamicCache:
        """The stacked cache over `rows` rows (bucket_rows): the batch's own rows, then padding
        rows of the arena whose contents are don't-care (each attends to its own new token only)."""
        if rows == len(self.rows):
            return self.cache
        cache = self._static.get(rows)
        if cache is None:
            bufs = [(k[:rows], v[:rows]) for k, v in self._arenas[self._current]]
            cache = self._static[rows] = cache_from_buffers(self.config, bufs, 0)
        for pad, own in zip(cache.layers, self.cache.layers):
            pad.length = own.length
        return cache

    def mask(self, new: int = 0) -> torch.Tensor:
        """(rows, width + new) long attention mask: 1 at each row's cached positions and at the
        `new` ones after them. Built when asked (eager steps; a static step masks from `lengths`)."""
        device = self.cache.layers[0].kbuf.device
        start = torch.tensor([self.width - n for n in self.lengths], device=device)
        return (torch.arange(self.width + new, device=device) >= start[:, None]).long()

    def _arena(self, rows: int, need: int, like: KV) -> KV:
        """Zeroed (rows, kv_heads, capacity, head_dim) views of the arena not holding the current
        stack (its rows are being copied from); reallocated when too small or 4x too large."""
        self._current ^= 1
        arena = self._arenas[self._current]
        k0 = like[0][0]
        if arena is not None:
            a0 = arena[0][0]
            if (a0.shape[0] < rows or a0.shape[2] < need or a0.shape[2] > 4 * max(need, self.MIN_CAPACITY)
                    or a0.dtype != k0.dtype or a0.device != k0.device or len(arena) != len(like)):
                arena = None
        if arena is None:
            self._arenas[self._current] = None  # free it before allocating the new one
            cap, r = max(self.MIN_CAPACITY, 1 << (need - 1).bit_length()), 1 << (rows - 1).bit_length()
            arena = [(k.new_zeros((r, k.shape[1], cap, k.shape[3])), v.new_zeros((r, v.shape[1], cap, v.shape[3])))
                     for k, v in like]
            self._arenas[self._current] = arena
            self._allocations += 1
            self._serials[self._current] = self._allocations
            return [(k[:rows], v[:rows]) for k, v in arena]
        views = [(k[:rows], v[:rows]) for k, v in arena]
        for k, v in views:  # masked positions must hold finite values (0 x NaN is NaN)
            k.zero_()
            v.zero_()
        return views

    def release(self) -> None:
        """Frees the arenas (no rows left)."""
        self.pack([], {}, {})
        self._arenas = [None, None]

    def advance(self) -> None:
        """After a decode step: every row cached one more token."""
        assert self.cache is not None
        self.width += 1
        self.lengths = [n + 1 for n in self.lengths]
