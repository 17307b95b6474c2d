"""The packed prefill forward, replayed as CUDA graphs keyed by its padded token count.

A prefill step packs its rows' pieces into one sequence of tokens (model_runner.py). Launched
from Python, the 7B language model's forward over ~1000 such tokens took 47 ms of the engine
thread against ~37 ms on the device (bench/results/h200-serve-2eaa0e7/steps-summary.json): the
GPU waited on the launches, and the thread had no time left for anything else. So the forward —
embeddings in, each completed row's last hidden state out — is captured per

    key = (token bucket, rows, LoRA launch key)

and replayed (step_graphs.GraphSet: warm-up, capture, retries, memory). The tokens are padded to
a bucket (`bucket_tokens`: multiples of 128 up to 1024, then eight buckets per doubling, so at most
~1/8 of a large step is padding) and the rows to the step's most (`max_prefills_per_step`);
everything else is data in the entry's buffers, filled by asynchronous copies before the replay:
the embeddings, M-RoPE positions, the pool slot of every token, the rows' query offsets, context
lengths and block-table rows (kernels/paged_prefill.py's grid depends on the token and row counts
only), and which tokens' hidden states are wanted.

Padding tokens sit past the last row's queries: the attention kernel writes nothing for them,
their keys and values go to the null block, and the LoRA plan gives them the last row's segment
(`Prefiller` pads that row's count: a segment extended at the end keeps the rows sorted by
entry); every other op is per token, so they never touch a real row. Padding rows have no tokens.

The LoRA term must be the ATMM kernel or absent, as for decode graphs: a step the torch
reference takes (it slices on the host) runs eagerly. `capture=False` (CPU, or graphs off) runs
the same padded forward eagerly; `pad=False` (prefill_graphs "off") runs it unpadded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.architectures import for_model, language_model
from services.worker.kv_cache import BlockManager, KVPool, PagedCache, PagedPrefill
from services.worker.lora import LoraRuntime, StepLora
from services.worker.step_graphs import REFERENCE, GraphEntry, GraphSet, lora_launch_key

MIN_BUCKET = 128


def bucket_tokens(n: int) -> int:
    """The smallest bucket >= n: a multiple of 128, or past 1024 of 1/8 of the next power of two
    (1024, 1280, 1536, ..., 2048, 2560, ...)."""
    p = 1 << max(0, n - 1).bit_length()
    step = max(MIN_BUCKET, p // 8)
    return max(step, -(-n // step) * step)


@dataclass(eq=False)
class _Entry(GraphEntry):
    embeds: torch.Tensor | None = None  # (tokens, hidden)
    # long: positions (3 x tokens), slots (tokens), query offsets (rows + 1), context lengths,
    # block-table rows, wanted tokens (rows each)
    inp: torch.Tensor | None = None

    def __post_init__(self) -> None:
        t = self.embeds.shape[0]
        r = (self.inp.shape[0] - 4 * t - 1) // 4
        self.pos, self.slots = self.inp[: 3 * t].view(3, 1, t), self.inp[3 * t : 4 * t]
        rest = self.inp[4 * t :]
        self.cu, self.lens = rest[: r + 1], rest[r + 1 : 2 * r + 1]
        self.rows, self.last = rest[2 * r + 1 : 3 * r + 1], rest[3 * r + 1 :]


class PrefillGraphs(GraphSet):
    def __init__(
        self,
        model,
        runtime: LoraRuntime,
        pool: KVPool,
        blocks: BlockManager,
        device: torch.device,
        rows: int,
        capture: bool = True,
        pad: bool = True,
        kernel: bool = True,
        max_graphs: int = 128,
        pool_handle=None,
    ) -> None:
        """`rows`: the most rows a step prefills; `kernel`: the Triton paged prefill attention
        (its reference reads lengths on the host: no graphs without it); `max_graphs`: ~20
        buckets x the LoRA mixes' launch keys (a key's graph holds no memory of its own but
        its outputs: the set's captures share one pool and its entries of a bucket their inputs)."""
        super().__init__("prefill", device, capture and kernel and pad, max_graphs, pool_handle)
        self.lm = language_model(model)
        self.mrope = for_model(model).mrope  # else the language model takes one axis of the positions
        self.text_config = self.lm.config
        self.runtime, self.pool, self.blocks = runtime, pool, blocks
        self.max_rows, self.pad, self.kernel = rows, pad, kernel
        self.mask_kinds = sorted(set(getattr(self.text_config, "layer_types", None) or ["full_attention"]))
        self.pin = device.type == "cuda"
        self._inputs: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.padding_tokens = 0  # tokens run as padding (observability)

    def tokens(self, n: int) -> int:
        """The tokens a forward of `n` packed tokens runs (its bucket when padding)."""
        return bucket_tokens(n) if self.pad else n

    def forward(
        self,
        embeds: list[torch.Tensor],
        positions: list[torch.Tensor],
        slots: list[torch.Tensor],
        counts: list[int],
        table_rows: list[int],
        seq_lens: list[int],
        wanted: list[int],
        step: StepLora,
    ) -> torch.Tensor:
        """The language model over the rows' pieces packed: `counts` (n_i) tokens a row, their
        inputs in packing order as chunks that concatenate to them (`embeds` (m, hidden) device,
        `positions` (3, m) and `slots` (m,) long host tensors; a chunk may hold several rows'
        pieces: decode riders come in runs), each row's block-table row and context length with
        its piece; `step` planned for `tokens(sum n_i)` tokens. Every piece's keys and values are
        written to its slots. Returns the hidden states of the packed tokens `wanted`
        (len(wanted), hidden), owned by the entry."""
        n, r = sum(counts), len(counts)
        t = self.tokens(n)
        if step.plan.num_tokens not in (0, t) and step.active:
            raise ValueError(f"the LoRA plan covers {step.plan.num_tokens} tokens, the forward {t}")
        rows = max(self.max_rows, r)
        lora = lora_launch_key(self.runtime, step)
        e = self.entry(
            (t, rows, lora), lambda: _Entry(**self._buffers(t, rows, embeds[0].dtype)), graphless=lora == REFERENCE
        )
        host = torch.zeros(e.inp.shape[0], dtype=torch.long, pin_memory=self.pin)  # copied up without a wait
        host[: 3 * t].view(3, t)[:, :n] = torch.cat(positions, dim=1)
        host[3 * t : 3 * t + n] = torch.cat(slots)  # padding tokens: slot 0, the null block's
        cu = [0]
        for c in counts:
            cu.append(cu[-1] + c)
        null = self.blocks.null_row
        tail = [
            *cu,
            *[n] * (rows - r),
            *seq_lens,
            *[0] * (rows - r),
            *table_rows,
            *[null] * (rows - r),
            *wanted,
            *[0] * (rows - len(wanted)),
        ]
        host[4 * t :] = torch.tensor(tail, dtype=torch.long)
        e.inp.copy_(host, non_blocking=True)
        torch.cat(embeds, out=e.embeds[:n])
        self.blocks.sync()
        (out,) = self.run(e, self._forward)  # raises: the entry and the counters as they were
        self.padding_tokens += t - n
        self.reference_steps += lora == REFERENCE
        return out[: len(wanted)]

    def _buffers(self, t: int, rows: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The input buffers of every entry of `t` tokens and `rows` rows (the LoRA mixes of one
        bucket share them: each replay's inputs are copied in right before it)."""
        got = self._inputs.get((t, rows))
        if got is None:
            got = self._inputs[(t, rows)] = dict(
                embeds=torch.zeros(t, self.text_config.hidden_size, dtype=dtype, device=self.device),
                inp=torch.zeros(4 * t + 4 * rows + 1, dtype=torch.long, device=self.device),
            )
        return got

    def _forward(self, e: _Entry) -> tuple[torch.Tensor]:
        paged = PagedPrefill(
            block_tables=self.blocks.tables.index_select(0, e.rows),
            cu_q=e.cu.to(torch.int32),
            seq_lens=e.lens.to(torch.int32),
            kernel=self.kernel,
        )
        cache = PagedCache(self.text_config, self.pool, e.slots, paged)
        out = self.lm(
            inputs_embeds=e.embeds[None],
            attention_mask={kind: None for kind in self.mask_kinds},
            position_ids=e.pos if self.mrope else e.pos[0],
            past_key_values=cache,
            use_cache=True,
            paged_prefill=paged,
        )
        return (out.last_hidden_state[0].index_select(0, e.last),)
