"""The paged KV cache: one pool of fixed-size blocks for every sequence, and block tables.

The pool is allocated once at start-up (`KVPool`, sized by `pool_blocks` from free device memory
or a byte budget): per layer, keys and values of shape (num_blocks, block_size, kv_heads,
head_dim). A sequence owns a list of blocks (`BlockManager`): token j of a sequence lives at
slot `blocks[j // block_size] * block_size + j % block_size`. Rows join and leave a decode batch
without anyone's KV being copied, and nothing is sized by the longest row.

Block 0 is the null block: it belongs to no sequence. Prefill padding and LABEL requests (which
keep no cache) write there, and the padding rows of a static decode step (decode_graphs.py)
attend to it alone; its contents are don't-care but always finite.

Each sequence holding blocks also holds a row of the device block table (`tables`, (rows + 1,
max_blocks) int32; the last row is the null row, all zeros). A decode step gathers the rows of
its batch from it inside the step, so the host only writes a table entry when a sequence gets a
new block (`sync` pushes the step's writes in one copy), and a CUDA graph captured for a batch
size replays for any batch of that size.

`PagedCache` is the HF `Cache` a forward runs on: each layer writes the step's keys and values
at the step's slots; a prefill then attends over the keys it was given (causal SDPA over the
batch, as before), a decode step over the pool through the block tables (attention.py).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np
import structlog
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

log = structlog.get_logger()
NULL_BLOCK = 0


def kv_bytes_per_token(text_config, dtype: torch.dtype, kv_heads: int | None = None) -> int:
    """Bytes of keys and values one token takes over all layers (`kv_heads`: this rank's)."""
    heads = kv_heads or text_config.num_key_value_heads
    d = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    return 2 * text_config.num_hidden_layers * heads * d * torch.empty((), dtype=dtype).element_size()


def pool_blocks(budget_bytes: int, block_bytes: int) -> int:
    """Blocks a byte budget holds (the null block included; at least 2)."""
    return max(2, budget_bytes // block_bytes)


def device_budget(device: torch.device, memory_fraction: float, reserve_bytes: int) -> int:
    """Bytes the KV pool may take on a CUDA device: what keeps this process's use of the device
    within `memory_fraction` of its memory, less `reserve_bytes` for activations, graphs and
    adapters loaded later, and never more than is free now."""
    free, total = torch.cuda.mem_get_info(device)
    used = total - free  # everything resident now: weights, other processes
    return max(0, min(free - reserve_bytes, int(memory_fraction * total) - used - reserve_bytes))


class KVPool:
    """The preallocated pool, block-major: `storage` (num_blocks, layers, 2, block_size, kv_heads,
    head_dim), so one block is one contiguous piece of memory with every layer's keys and values of
    `block_size` tokens, and a run of consecutive blocks can hold an adapter's weights instead
    (`memory`; S-LoRA's unified pool). A layer's keys (or values) are a strided view (num_blocks,
    block_size, kv_heads, head_dim)."""

    def __init__(
        self,
        layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"kv block size {block_size} is not a power of two")
        self.storage = torch.empty((num_blocks, layers, 2, block_size, kv_heads, head_dim), dtype=dtype, device=device)
        self.storage[NULL_BLOCK].zero_()
        self.num_blocks, self.block_size, self.kv_heads, self.head_dim = num_blocks, block_size, kv_heads, head_dim

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.storage[:, i, 0], self.storage[:, i, 1]

    @property
    def block_bytes(self) -> int:
        return self.storage[0].numel() * self.storage.element_size()

    def memory(self, first: int, count: int) -> torch.Tensor:
        """Blocks [first, first + count) as one flat tensor of the pool's dtype."""
        return self.storage[first : first + count].view(-1)


class PoolMemory:
    """Adapter device memory from the KV pool (AdapterPool's `memory`; S-LoRA's unified pool): a
    resident adapter's packed weights take a run of consecutive blocks, given back when it leaves
    the device, so KV and adapters trade memory."""

    def __init__(self, pool: KVPool, blocks: BlockManager) -> None:
        self.pool, self.blocks = pool, blocks

    def take(self, numel: int, dtype: torch.dtype) -> tuple[tuple[int, int], torch.Tensor] | None:
        """A lease and a flat (numel,) tensor of pool memory, or None (no run that large is free,
        or another dtype)."""
        if dtype != self.pool.storage.dtype:
            return None
        count = max(1, math.ceil(numel * self.pool.storage.element_size() / self.pool.block_bytes))
        first = self.blocks.take_run(count)
        if first is None:
            return None
        return (first, count), self.pool.memory(first, count)[:numel]

    def give(self, lease: tuple[int, int]) -> None:
        self.blocks.give_run(*lease)


class OutOfBlocks(Exception):
    """No free block: the caller preempts a sequence or waits."""


class BlockManager:
    """Free blocks, each sequence's blocks, and the device block table (one row per sequence
    holding blocks, `rows` of them, plus the null row)."""

    def __init__(self, num_blocks: int, block_size: int, rows: int, max_blocks: int, device: torch.device) -> None:
        self.block_size, self.max_blocks = block_size, max_blocks
        self.num_blocks = num_blocks
        # Sequences run on the engine thread; adapter runs (take_run) come from loading threads too.
        self._lock = threading.Lock()
        self._free = list(range(num_blocks - 1, NULL_BLOCK, -1))  # a stack: pop() takes the lowest
        self._is_free = np.ones(num_blocks, dtype=bool)
        self._is_free[NULL_BLOCK] = False
        self.run_blocks = 0  # blocks lent out as runs (resident adapters' weights)
        self._blocks: dict[int, list[int]] = {}  # sequence id -> its blocks
        self._rows: dict[int, int] = {}  # sequence id -> its table row
        self._free_rows = list(range(rows - 1, -1, -1))
        self.null_row = rows
        self.tables = torch.zeros((rows + 1, max_blocks), dtype=torch.int32, device=device)
        self._writes: list[tuple[int, int]] = []  # (flat table index, block) not yet on the device
        self._pin = device.type == "cuda"

    # -- accounting --------------------------------------------------------------------------
    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def usable_blocks(self) -> int:
        """Blocks sequences can hold (all but the null block)."""
        return self.num_blocks - 1

    @property
    def used_blocks(self) -> int:
        """Blocks sequences hold (not counting runs lent to adapters)."""
        return self.usable_blocks - len(self._free) - self.run_blocks

    def holds(self, sid: int) -> bool:
        return sid in self._blocks

    def blocks(self, sid: int) -> list[int]:
        return self._blocks[sid]

    def row(self, sid: int) -> int:
        return self._rows[sid]

    # -- changes -----------------------------------------------------------------------------
    def open(self, sid: int, tokens: int) -> bool:
        """Gives sequence `sid` a table row and blocks for `tokens` tokens; False (nothing taken)
        when there are not enough free blocks or rows."""
        if sid in self._blocks:
            raise ValueError(f"sequence {sid} already holds blocks")
        need = self.blocks_for(tokens)
        if need > self.max_blocks:
            raise ValueError(f"{tokens} tokens exceed the block table's {self.max_blocks * self.block_size}")
        with self._lock:
            if need > len(self._free) or not self._free_rows:
                return False
            self._rows[sid] = self._free_rows.pop()
            self._blocks[sid] = []
            self._append(sid, need)
        return True

    def grow(self, sid: int, tokens: int) -> None:
        """Makes sequence `sid`'s blocks hold `tokens` tokens; OutOfBlocks (nothing taken) when the
        pool has too few free blocks."""
        need = self.blocks_for(tokens) - len(self._blocks[sid])
        if need <= 0:
            return
        if len(self._blocks[sid]) + need > self.max_blocks:
            raise ValueError(f"{tokens} tokens exceed the block table's {self.max_blocks * self.block_size}")
        with self._lock:
            if need > len(self._free):
                raise OutOfBlocks(f"sequence {sid} needs {need} more blocks, {len(self._free)} free")
            self._append(sid, need)

    def _append(self, sid: int, n: int) -> None:
        blocks, row = self._blocks[sid], self._rows[sid]
        for _ in range(n):
            block = self._free.pop()
            self._is_free[block] = False
            self._writes.append((row * self.max_blocks + len(blocks), block))
            blocks.append(block)

    def close(self, sid: int) -> None:
        """Frees sequence `sid`'s blocks and row (no-op when it holds none). Its table row keeps
        stale entries: only a sequence that holds the row reads it, up to its own length."""
        with self._lock:
            blocks = self._blocks.pop(sid, None)
            if blocks is None:
                return
            self._free.extend(reversed(blocks))
            self._is_free[blocks] = True
            self._free_rows.append(self._rows.pop(sid))

    def take_run(self, count: int) -> int | None:
        """`count` consecutive free blocks, the highest such run (sequences take the lowest free
        blocks first, so adapters and KV grow from the two ends): its first block, or None."""
        with self._lock:
            if count < 1 or count > len(self._free):
                return None
            ends = np.concatenate(([0], np.cumsum(self._is_free, dtype=np.int64)))
            starts = np.flatnonzero(ends[count:] - ends[:-count] == count)
            if not len(starts):
                return None
            first = int(starts[-1])
            self._is_free[first : first + count] = False
            self._free = [b for b in self._free if not first <= b < first + count]
            self.run_blocks += count
            return first

    def give_run(self, first: int, count: int) -> None:
        """Blocks [first, first + count) back from a run (taken after the other free blocks)."""
        with self._lock:
            self._is_free[first : first + count] = True
            self._free[:0] = range(first + count - 1, first - 1, -1)
            self.run_blocks -= count

    def sync(self) -> None:
        """Writes the table entries changed since the last sync to the device (one copy)."""
        if not self._writes:
            return
        flat = torch.tensor(self._writes, dtype=torch.int64, pin_memory=self._pin)
        self._writes = []
        dev = flat.to(self.tables.device, non_blocking=True)
        self.tables.view(-1).index_copy_(0, dev[:, 0], dev[:, 1].to(torch.int32))

    # -- addresses ---------------------------------------------------------------------------
    def slot(self, sid: int, position: int) -> int:
        """The pool slot of token `position` of sequence `sid`."""
        bs = self.block_size
        return self._blocks[sid][position // bs] * bs + position % bs

    def slots(self, sid: int, start: int, end: int) -> torch.Tensor:
        """(end - start,) long host tensor: the slots of tokens [start, end) of sequence `sid`."""
        bs = self.block_size
        pos = torch.arange(start, end)
        blocks = torch.tensor(self._blocks[sid], dtype=torch.long)
        return blocks[pos // bs] * bs + pos % bs


def make_pool(cfg, text_config, dtype: torch.dtype, device: torch.device, tp=None) -> tuple[KVPool, BlockManager, int]:
    """The engine's paged KV pool, preallocated now, its block manager and the longest context a
    sequence may reach, from the engine's config (`cfg`: EngineConfig's kv_* settings). Tensor
    parallel (`tp`, this rank's TPGroup): every rank gets the smallest rank's block count, so
    block decisions are the same on every rank."""
    tc = text_config
    kv_heads = tc.num_key_value_heads // (tp.world_size if tp is not None else 1)
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    block_bytes = cfg.kv_block_size * kv_bytes_per_token(tc, dtype, kv_heads)
    if cfg.kv_cache_bytes > 0:
        budget = cfg.kv_cache_bytes
    elif device.type == "cuda":
        budget = device_budget(device, cfg.gpu_memory_fraction, cfg.kv_reserve_bytes)
    else:
        budget = 256 << 20
    blocks = pool_blocks(budget, block_bytes)
    if tp is not None:
        blocks = tp.min_int(blocks)
    max_model_len = min(cfg.max_model_len or tc.max_position_embeddings, tc.max_position_embeddings)
    pool = KVPool(tc.num_hidden_layers, blocks, cfg.kv_block_size, kv_heads, head_dim, dtype, device)
    manager = BlockManager(
        blocks, cfg.kv_block_size, cfg.max_batch_size, math.ceil(max_model_len / cfg.kv_block_size), device
    )
    tokens = (blocks - 1) * cfg.kv_block_size
    gib = round(blocks * block_bytes / 2**30, 2)
    log.info("kv_pool", blocks=blocks, block_size=cfg.kv_block_size, gib=gib, tokens=tokens)
    if tokens < max_model_len:  # requests longer than the pool fail at admission (INVALID_ARGUMENT)
        log.warning(
            "kv_pool_small",
            tokens=tokens,
            max_model_len=max_model_len,
            hint="free device memory, or set VALORA_KV_CACHE_BYTES / VALORA_GPU_MEMORY_FRACTION",
        )
    return pool, manager, max_model_len


@dataclass
class PagedDecode:
    """What a decode step's attention reads besides the pool: each row's block table (rows,
    max_blocks) int32 and its context length including the new token (rows,) int32."""

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    kernel: bool = True  # the Triton kernels (engine's start-up check passed); False: the torch reference


@dataclass
class PagedPrefill:
    """What a prefill chunk's attention reads besides the pool (chunked prefill): the rows' block
    tables (rows, max_blocks) int32, their query tokens' offsets in the packed forward (rows + 1,)
    int32, and each row's context length including the chunk (rows,) int32; a chunk's token at
    position p attends to the row's cached positions 0..p."""

    block_tables: torch.Tensor
    cu_q: torch.Tensor
    seq_lens: torch.Tensor
    kernel: bool = True


class PagedLayer(DynamicLayer):
    """One layer of the pool as an HF cache layer: `update` writes the step's tokens at the
    cache's slots and returns the step's own keys and values (a prefill from position 0:
    attention over the batch as given) or the layer's whole pool (a decode step or a prefill
    chunk after the first: attention through the block tables)."""

    def __init__(self, cache: "PagedCache", k_pool: torch.Tensor, v_pool: torch.Tensor) -> None:
        super().__init__()
        self.cache, self.k_pool, self.v_pool = cache, k_pool, v_pool
        self.is_initialized = True
        self.dtype, self.device = k_pool.dtype, k_pool.device

    def update(self, key_states, value_states, *args, **kwargs):
        b, h, s, d = key_states.shape
        at = self.cache.slot_blocks, self.cache.slot_offsets
        self.k_pool.index_put_(at, key_states.transpose(1, 2).reshape(b * s, h, d))
        self.v_pool.index_put_(at, value_states.transpose(1, 2).reshape(b * s, h, d))
        if self.cache.paged is not None:
            return self.k_pool, self.v_pool
        return key_states, value_states

    def get_seq_length(self) -> int:
        return 0  # a prefill starts from no cached tokens; decode steps pass their positions and masks


class PagedCache(DynamicCache):
    """The pool as the HF cache of one forward: `slots` (tokens,) long device tensor, where the
    forward's (rows x tokens, flattened) keys and values go; `paged` set when attention reads
    the pool (a decode step, a prefill chunk with cached tokens before it)."""

    def __init__(
        self, text_config, pool: KVPool, slots: torch.Tensor, paged: PagedDecode | PagedPrefill | None = None
    ) -> None:
        super().__init__(config=text_config)
        self.slots, self.paged = slots, paged
        self.slot_blocks, self.slot_offsets = slots // pool.block_size, slots % pool.block_size
        self.layers = [PagedLayer(self, *pool.layer(i)) for i in range(len(self.layers))]
