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

Warm-up, capture, retries and the graphs' memory are step_graphs.GraphSet's.
`capture=False` runs the same step without graphs (CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.architectures import for_model, language_model
from services.worker.kv_cache import BlockManager, KVPool, PagedCache, PagedDecode
from services.worker.lora import LoraRuntime, StepLora
from services.worker.step_graphs import REFERENCE, GraphEntry, GraphSet, bucket_rows, lora_launch_key

__all__ = ["DecodeGraphs", "DecodeRow", "bucket_rows"]


@dataclass(eq=False)
class _Entry(GraphEntry):
    # (5 * rows,) long: token ids, positions, new-token slots, context lengths, table rows.
    inp: torch.Tensor | None = None

    def __post_init__(self) -> None:
        r = self.inp.shape[0] // 5
        self.ids, self.host_part = self.inp[:r], self.inp[r:]  # what the host fills when ids are on the device
        self.pos, self.slots = self.inp[r : 2 * r], self.inp[2 * r : 3 * r]
        self.lens, self.rows = self.inp[3 * r : 4 * r], self.inp[4 * r :]


@dataclass
class DecodeRow:
    """One row of a decode step: its last token, M-RoPE position, the pool slot of the new token,
    its context length with it, and its block-table row."""

    token: int
    position: int
    slot: int
    length: int
    table_row: int


class DecodeGraphs(GraphSet):
    def __init__(
        self,
        model,
        runtime: LoraRuntime,
        pool: KVPool,
        blocks: BlockManager,
        device: torch.device,
        capture: bool = True,
        max_graphs: int = 32,
        attention_kernel: bool = True,
        pool_handle=None,
    ) -> None:
        # The reference attention reads lengths on the host: such steps run without graphs.
        super().__init__("decode", device, capture and attention_kernel, max_graphs, pool_handle)
        self.lm = language_model(model)
        self.mrope = for_model(model).mrope  # else the language model takes one axis of the positions
        self.head = model.lm_head
        self.text_config = self.lm.config
        self.runtime = runtime
        self.pool, self.blocks = pool, blocks
        self.attention_kernel = attention_kernel
        self.mask_kinds = sorted(set(getattr(self.lm.config, "layer_types", None) or ["full_attention"]))
        self.pin = device.type == "cuda"  # host inputs from pinned memory: their copy does not wait for the device

    def step(
        self, batch: list[DecodeRow], step: StepLora | None, rows: int = 0, ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Runs one decode step of `batch` (each row's new token written into the pool) and
        returns (greedy tokens (b,), logits (b, vocab)) — tensors owned by the entry: read them
        (or queue their copy) before the next step. `rows`: run that many rows (bucket_rows;
        `step` planned for them), the ones past the batch's padding; 0: the batch's own. `ids`:
        the rows' last tokens as a (b,) long device tensor instead of `batch`'s (pipelined)."""
        b = len(batch)
        pad = max(rows, b) - b
        key = (b + pad, lora_launch_key(self.runtime, step))
        e = self.entry(
            key,
            lambda: _Entry(inp=torch.zeros(5 * key[0], dtype=torch.long, device=self.device)),
            graphless=key[1] == REFERENCE,
        )
        self.reference_steps += key[1] == REFERENCE
        null = self.blocks.null_row
        # padding rows: position 0, the null block's first slot, context 1, the null table row
        host = [
            *(r.position for r in batch),
            *[0] * pad,
            *(r.slot for r in batch),
            *[0] * pad,
            *(r.length for r in batch),
            *[1] * pad,
            *(r.table_row for r in batch),
            *[null] * pad,
        ]
        self.blocks.sync()
        if ids is not None:
            e.host_part.copy_(torch.tensor(host, dtype=torch.long, pin_memory=self.pin), non_blocking=True)
            e.ids[:b].copy_(ids)  # padding rows keep earlier (valid) token ids
        else:
            e.inp.copy_(
                torch.tensor([*(r.token for r in batch), *[0] * pad, *host], dtype=torch.long, pin_memory=self.pin),
                non_blocking=True,
            )
        tokens, logits = self.run(e, self._forward)
        if pad:
            return tokens[:b], logits[:b]
        return tokens, logits

    def _forward(self, e: _Entry) -> tuple[torch.Tensor, torch.Tensor]:
        rows = e.ids.shape[0]
        paged = PagedDecode(
            block_tables=self.blocks.tables.index_select(0, e.rows),
            seq_lens=e.lens.to(torch.int32),
            kernel=self.attention_kernel,
        )
        cache = PagedCache(self.text_config, self.pool, e.slots, paged)
        pos = e.pos.view(1, rows, 1).expand(3, rows, 1) if self.mrope else e.pos.view(rows, 1)
        out = self.lm(
            input_ids=e.ids.view(rows, 1),
            attention_mask={kind: None for kind in self.mask_kinds},
            position_ids=pos,
            past_key_values=cache,
            use_cache=True,
            paged_decode=paged,
        )
        logits = self.head(out.last_hidden_state[:, -1])
        return logits.argmax(-1), logits
