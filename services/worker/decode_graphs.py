"""The decode step, replayed as CUDA graphs keyed by the padded batch size.

A decode step of a 7B model on an H200 reads ~17 GB of weights (~4 ms) but launches a couple of
thousand kernels from Python (HF layers + LoRA), which takes several times longer. So the step —
language model forward over the paged KV cache, lm_head and greedy argmax — is captured once per

    key = (rows bucket, LoRA launch key)

and replayed. Rows are the batch's rounded up to a bucket (`bucket_rows`: 1, 2, 3, 4, 6, 8, 12,
16, ...; powers of two and 1.5x them); the padding rows past the batch's own attend to the null
block only and their outputs are dropped. Nothing else of the batch is in the key: the KV pool
and the block tables have fixed addresses (kv_cache.py), and everything that changes from step
to step is data in the entry's input buffer, filled by one asynchronous host copy (from pinned
memory on CUDA, so nothing waits for the device): token ids, positions (the same on the 3
M-RoPE axes), each row's slot for its new token, its context length and its block-table row.
The step gathers the batch's block tables from the manager's table inside the graph. So after a
bucket's warm-up no step of that size runs eagerly, whatever the batch's composition, its
context lengths or where its blocks are.

The token ids may instead come from the device: pipelined decode (engine.py) feeds a step the
previous step's greedy tokens without a host round trip. The LoRA term must be the ATMM kernel
(its segment plan is device data written before the replay; `AtmmBackend.launch_key` names the
host values its launches depend on) or absent; the torch reference slices on the host, so such
steps run without a graph (counted in `eager_steps`).

A key is captured the second time it is seen (its first step, run without a graph, is the
warm-up: lazy initialisation and kernel compilation happen outside the capture), and the most
recently used `max_graphs` are kept in one memory pool. Captures are thread-local: the worker's
other threads (request preparation, adapter staging into pinned memory) keep calling CUDA while
the engine thread captures, and a global capture fails on such a call — both the capture and the
other thread's work (serve-h200-7b9279e.json: no capture succeeded in 1334 static steps). A
capture that fails is retried at the key's next steps; after `MAX_CAPTURE_FAILURES` the key runs
without a graph for good (each failure is logged and counted in `capture_failures`).
`capture=False` runs the same step without graphs (CPU).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import structlog
import torch

from services.worker.kv_cache import BlockManager, KVPool, PagedCache, PagedDecode
from services.worker.lora import LoraRuntime, StepLora

log = structlog.get_logger()
MAX_CAPTURE_FAILURES = 3  # failed captures after which a key runs without a graph


def bucket_rows(n: int) -> int:
    """The smallest bucket >= n: a power of two or 1.5 times one (1, 2, 3, 4, 6, 8, 12, ...)."""
    if n <= 2:
        return max(n, 1)
    p = 1 << (n - 1).bit_length()
    return 3 * p // 4 if n <= 3 * p // 4 else p


@dataclass(eq=False)
class _Entry:
    # (5 * rows,) long: token ids, positions, new-token slots, context lengths, table rows.
    inp: torch.Tensor
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    seen: int = 0
    graphless: bool = False
    failures: int = 0  # failed captures of this key

    def __post_init__(self) -> None:
        r = self.inp.shape[0] // 5
        self.ids, self.host_part = self.inp[:r], self.inp[r:]  # what the host fills when ids are on the device
        self.pos, self.slots = self.inp[r:2 * r], self.inp[2 * r:3 * r]
        self.lens, self.rows = self.inp[3 * r:4 * r], self.inp[4 * r:]


@dataclass
class DecodeRow:
    """One row of a decode step: its last token, M-RoPE position, the pool slot of the new token,
    its context length with it, and its block-table row."""

    token: int
    position: int
    slot: int
    length: int
    table_row: int


class DecodeGraphs:
    def __init__(self, model, runtime: LoraRuntime, pool: KVPool, blocks: BlockManager, device: torch.device,
                 capture: bool = True, max_graphs: int = 32, attention_kernel: bool = True) -> None:
        self.lm = model.model.language_model
        self.head = model.lm_head
        self.text_config = self.lm.config
        self.runtime = runtime
        self.pool, self.blocks = pool, blocks
        self.device = device
        # The reference attention reads lengths on the host: such steps run without graphs.
        self.attention_kernel = attention_kernel
        self.capture = capture and device.type == "cuda" and attention_kernel
        self.max_graphs = max_graphs
        self.mask_kinds = sorted(set(getattr(self.lm.config, "layer_types", None) or ["full_attention"]))
        self.pin = device.type == "cuda"  # host inputs from pinned memory: their copy does not wait for the device
        self.pool_handle = torch.cuda.graph_pool_handle() if self.capture else None
        self.entries: OrderedDict[tuple, _Entry] = OrderedDict()
        # observability + tests
        self.static_steps = 0  # decode steps run (every one is static: same shapes for a bucket)
        self.replays = 0
        self.captures = 0
        self.new_keys = 0  # entries made (each costs a warm-up step without a graph, then a capture)
        self.warmup_steps = 0  # a key's first step
        self.eager_steps = 0  # steps after their key's warm-up that ran without a graph while capturing
        self.capture_failures = 0
        self.reference_steps = 0  # LoRA steps the kernel backend did not take (graph-less by design)

    def _key(self, rows: int, step: StepLora | None) -> tuple:
        lora = None
        if step is not None and step.active:
            lora = self.runtime.backend.launch_key() if step.kernel else "reference"
        return rows, lora

    def _entry(self, key: tuple, step: StepLora | None) -> _Entry:
        e = self.entries.get(key)
        if e is None:
            e = _Entry(inp=torch.zeros(5 * key[0], dtype=torch.long, device=self.device))
            e.graphless = not self.capture or (step is not None and step.active and not step.kernel)
            self.entries[key] = e
            self.new_keys += 1
            while len(self.entries) > self.max_graphs:
                self.entries.popitem(last=False)
        else:
            self.entries.move_to_end(key)
        return e

    def step(self, batch: list[DecodeRow], step: StepLora | None, rows: int = 0,
             ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Runs one decode step of `batch` (each row's new token written into the pool) and
        returns (greedy tokens (b,), logits (b, vocab)) — tensors owned by the entry: read them
        (or queue their copy) before the next step. `rows`: run that many rows (bucket_rows;
        `step` planned for them), the ones past the batch's padding; 0: the batch's own. `ids`:
        the rows' last tokens as a (b,) long device tensor instead of `batch`'s (pipelined)."""
        b = len(batch)
        pad = max(rows, b) - b
        key = self._key(b + pad, step)
        e = self._entry(key, step)
        self.reference_steps += key[1] == "reference"
        null = self.blocks.null_row
        # padding rows: position 0, the null block's first slot, context 1, the null table row
        host = [*(r.position for r in batch), *[0] * pad, *(r.slot for r in batch), *[0] * pad,
                *(r.length for r in batch), *[1] * pad, *(r.table_row for r in batch), *[null] * pad]
        self.blocks.sync()
        if ids is not None:
            e.host_part.copy_(torch.tensor(host, dtype=torch.long, pin_memory=self.pin), non_blocking=True)
            e.ids[:b].copy_(ids)  # padding rows keep earlier (valid) token ids
        else:
            e.inp.copy_(torch.tensor([*(r.token for r in batch), *[0] * pad, *host], dtype=torch.long,
                                     pin_memory=self.pin), non_blocking=True)
        e.seen += 1
        self.static_steps += 1
        if e.seen == 1:
            self.warmup_steps += 1
        elif e.graph is None and not e.graphless:
            self._capture(e)
        if e.graph is not None:
            e.graph.replay()
            self.replays += 1
        else:
            if e.seen > 1 and self.capture:
                self.eager_steps += 1
            e.tokens, e.logits = self._forward(e)
        if pad:
            return e.tokens[:b], e.logits[:b]
        return e.tokens, e.logits

    def _forward(self, e: _Entry) -> tuple[torch.Tensor, torch.Tensor]:
        rows = e.ids.shape[0]
        paged = PagedDecode(block_tables=self.blocks.tables.index_select(0, e.rows),
                            seq_lens=e.lens.to(torch.int32), kernel=self.attention_kernel)
        cache = PagedCache(self.text_config, self.pool, e.slots, paged)
        out = self.lm(input_ids=e.ids.view(rows, 1), attention_mask={kind: None for kind in self.mask_kinds},
                      position_ids=e.pos.view(1, rows, 1).expand(3, rows, 1), past_key_values=cache,
                      use_cache=True, paged_decode=paged)
        logits = self.head(out.last_hidden_state[:, -1])
        return logits.argmax(-1), logits

    def release(self) -> None:
        """Frees every captured graph (at the engine's stop). A graph that captured NCCL
        collectives keeps the communicator busy: destroy_process_group hangs while one is alive
        (pytorch/pytorch#115388). Entries without graphs are kept (tests read their keys)."""
        if self.capture:
            torch.cuda.synchronize(self.device)
            self.entries.clear()

    def _capture(self, e: _Entry) -> None:
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool_handle, capture_error_mode="thread_local"):
                tokens, logits = self._forward(e)
        except Exception as exc:  # noqa: BLE001 - this step runs without a graph; the key retries
            e.failures += 1
            e.graphless = e.failures >= MAX_CAPTURE_FAILURES
            self.capture_failures += 1
            log.warning("decode_graph_capture_failed", error=repr(exc)[:500], rows=e.ids.shape[0],
                        failures=e.failures, graphless=e.graphless)
            torch.cuda.synchronize(self.device)
            return
        e.graph, e.tokens, e.logits = graph, tokens, logits
        self.captures += 1
