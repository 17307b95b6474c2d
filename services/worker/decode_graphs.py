"""CUDA graphs for the decode step: one replay instead of ~2000 kernel launches from Python.

A decode step of a 7B model on an H200 reads ~17 GB of weights (~4 ms) but launches a couple of
thousand kernels from Python (HF layers + LoRA), which takes several times longer. So the step —
language model forward, lm_head and greedy argmax — is captured once per *shape key* and
replayed:

    key = (rows, cache capacity, the cache buffers (DecodeBatch.buffers_key), LoRA launch key)

Rows are the batch's rounded up to a power of two (DecodeBatch.bucket_rows; spare rows of the
KV arena, each attending only to its own new token, outputs dropped), so the graphs survive
requests joining and leaving: with exact rows, a served batch whose size moves with arrivals
and finishes often met a new key instead of replaying (bench/decode_keys.py: 70% of static
steps replayed with exact rows, 92% padded).

The KV cache lives in DecodeBatch's preallocated arenas (stable addresses, kv_batch.py). In the
static step every layer writes its new token at a device-side index and attends over the whole
capacity under a boolean mask (the row's cached positions and the new one), so shapes do not
change as the cache grows. A step's inputs are one small tensor per key (token ids, positions,
each row's first cached column, the write index): the host fills it with one asynchronous copy
(from pinned memory on CUDA, so nothing waits for the device) and the graph derives the M-RoPE
positions and the mask from it. The token ids may instead come from the device: pipelined
decode (engine.py) feeds a step the previous step's greedy tokens without a host round trip.
The LoRA term must be the ATMM kernel (its segment plan is device data written before the
replay; `AtmmBackend.launch_key` names the host values its launches depend on) or absent; the
torch reference slices on the host, so such steps stay eager, as do steps whose cache is full
(it grows eagerly).

A key is captured the second time it is seen (its first, eager, static step is the warm-up), and
the most recently used `max_graphs` are kept in one memory pool. A capture that fails (e.g. an
op that synchronises) marks the key eager for good and logs why. `capture=False` runs the same
static step without graphs: that is how CPU tests check it equals the eager decode.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import structlog
import torch

from services.worker.kv_batch import DecodeBatch
from services.worker.lora import LoraRuntime, StepLora

log = structlog.get_logger()


@dataclass(eq=False)
class _Entry:
    # (3 * rows + 1,) long: token ids, positions (the same on the 3 M-RoPE axes), each row's first
    # cached column, the write index (= the batch width); views of it below.
    inp: torch.Tensor
    cols: torch.Tensor  # (capacity,) position index, for building the mask
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    seen: int = 0
    eager_only: bool = False

    def __post_init__(self) -> None:
        rows = (self.inp.shape[0] - 1) // 3
        self.ids, self.host_part = self.inp[:rows], self.inp[rows:]  # what the host fills when ids are on the device
        self.pos, self.start, self.index = self.inp[rows:2 * rows], self.inp[2 * rows:3 * rows], self.inp[3 * rows:]


class DecodeGraphs:
    def __init__(self, model, runtime: LoraRuntime, device: torch.device, capture: bool = True,
                 max_graphs: int = 16) -> None:
        self.lm = model.model.language_model
        self.head = model.lm_head
        self.runtime = runtime
        self.device = device
        self.capture = capture and device.type == "cuda"
        self.max_graphs = max_graphs
        self.mask_kinds = sorted(set(getattr(self.lm.config, "layer_types", None) or ["full_attention"]))
        self.pin = device.type == "cuda"  # host inputs from pinned memory: their copy does not wait for the device
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self.static_steps = 0  # observability + tests
        self.replays = 0
        self.captures = 0
        self.new_keys = 0  # entries made (each costs an eager warm-up step, then a capture)

    def _key(self, cache, width: int, step: StepLora | None, buffers: tuple) -> tuple | None:
        """`buffers`: DecodeBatch.buffers_key() of the cache the step runs on."""
        layer = cache.layers[0]
        if getattr(layer, "kbuf", None) is None:
            return None
        rows, cap = layer.kbuf.shape[0], layer.kbuf.shape[2]
        if width + 1 > cap:
            return None  # full: the eager step grows the buffers
        lora = None
        if step is not None and step.active:
            if step.kernel:
                lora = self.runtime.backend.launch_key()
            elif self.capture:
                return None  # the torch reference slices segments on the host: not capturable
            else:
                lora = "reference"
        return rows, cap, buffers, lora

    def _lookup(self, cache, width: int, step: StepLora | None, buffers: tuple) -> _Entry | None:
        key = self._key(cache, width, step, buffers)
        if key is None:
            return None
        e = self.entries.get(key)
        if e is None:
            rows, cap = key[0], key[1]
            e = _Entry(inp=torch.zeros(3 * rows + 1, dtype=torch.long, device=self.device),
                       cols=torch.arange(cap, device=self.device))
            self.entries[key] = e
            self.new_keys += 1
            while len(self.entries) > self.max_graphs:
                self.entries.popitem(last=False)
        else:
            self.entries.move_to_end(key)
        return None if e.eager_only else e

    def step(self, batch: DecodeBatch, ids: list[int] | torch.Tensor, positions: list[int],
             step: StepLora | None, rows: int = 0) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Runs one decode step (cache advanced by one token in every layer) and returns (greedy
        tokens (rows,), logits (rows, vocab)) — tensors owned by the graph: read them (or queue
        their copy) before the next step. `ids`: each row's last token, from the host or a (rows,)
        long tensor on the device. `rows`: run that many rows (batch.bucket_rows(); `step` planned
        for them): the batch's own, then padding rows whose outputs are dropped; 0: the batch's
        own. None when this step cannot run static (the caller runs it eagerly); nothing is done
        then."""
        b = len(positions)
        pad = max(rows, b) - b
        cache = batch.static_cache(b + pad)
        width = batch.width
        e = self._lookup(cache, width, step, batch.buffers_key())
        if e is None:
            return None
        # padding rows: position 0, first cached column = the write index (each sees only itself)
        host = [*positions, *[0] * pad, *(width - n for n in batch.lengths), *[width] * pad, width]
        if isinstance(ids, torch.Tensor):
            e.host_part.copy_(torch.tensor(host, dtype=torch.long, pin_memory=self.pin), non_blocking=True)
            e.ids[:b].copy_(ids)  # padding rows keep earlier (valid) token ids
        else:
            e.inp.copy_(torch.tensor([*ids, *[0] * pad, *host], dtype=torch.long, pin_memory=self.pin),
                        non_blocking=True)
        layers = cache.layers
        for layer in layers:
            layer.static_index = e.index
        try:
            e.seen += 1
            self.static_steps += 1
            if e.graph is None and self.capture and e.seen >= 2:
                self._capture(e, cache)
            if e.graph is not None:
                e.graph.replay()
                self.replays += 1
            else:
                e.tokens, e.logits = self._forward(e, cache)
        finally:
            for layer in layers:
                layer.static_index = None
        for layer in batch.cache.layers:  # the batch's own cache (a padded one syncs from it)
            layer.length += 1
        if pad:
            return e.tokens[:b], e.logits[:b]
        return e.tokens, e.logits

    def _forward(self, e: _Entry, cache) -> tuple[torch.Tensor, torch.Tensor]:
        rows, cap = e.ids.shape[0], e.cols.shape[0]
        mask = ((e.cols >= e.start[:, None]) & (e.cols <= e.index)).view(rows, 1, 1, cap)
        out = self.lm(input_ids=e.ids.view(rows, 1), attention_mask={kind: mask for kind in self.mask_kinds},
                      position_ids=e.pos.view(1, rows, 1).expand(3, rows, 1), past_key_values=cache,
                      use_cache=True)
        logits = self.head(out.last_hidden_state[:, -1])
        return logits.argmax(-1), logits

    def release(self) -> None:
        """Frees every captured graph (at the engine's stop). A graph that captured NCCL
        collectives keeps the communicator busy: destroy_process_group hangs while one is alive
        (pytorch/pytorch#115388). Static (uncaptured) entries hold no graph: kept."""
        if self.capture:
            torch.cuda.synchronize(self.device)
            self.entries.clear()

    def _capture(self, e: _Entry, cache) -> None:
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                tokens, logits = self._forward(e, cache)
        except Exception as exc:  # noqa: BLE001 - an op that cannot be captured: this key stays eager
            e.eager_only = True
            log.warning("decode_graph_capture_failed", error=repr(exc)[:500], rows=e.ids.shape[0])
            torch.cuda.synchronize(self.device)
            return
        e.graph, e.tokens, e.logits = graph, tokens, logits
        self.captures += 1
