"""Runs the model for the engine: the batched prefill forward, the decode step (through
decode_graphs), the choice of tokens on the device, and the paged KV pool they write.

The runner holds no request state beyond what a call is given: the engine's scheduler decides
which sequences run and owns their blocks (kv_cache.BlockManager); the runner turns a batch of
sequences into device work and hands back tensors (`PrefillOutput`, tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import structlog
import torch

from kernels import paged_attention, paged_prefill
from services.worker.architectures import for_model, rope_positions
from services.worker.decode_graphs import DecodeGraphs, DecodeRow
from services.worker.kv_cache import make_pool
from services.worker.lora import LoraRuntime, StepLora
from services.worker.prefill_graphs import PrefillGraphs
from services.worker.requests import OutputKind
from services.worker.sequence import Sequence
from services.worker.step_trace import StepTrace
from services.worker.tensor_parallel import ForwardLockstep, TPGroup
from services.worker.token_choice import TokenChooser
from services.worker.tp_sharding import RowParallelLoraLinear
from services.worker.vision import VisionEncoder

log = structlog.get_logger()


@dataclass
class PrefillOutput:
    """A prefill forward's results, by row: context lengths, M-RoPE deltas, the last real token's
    hidden state (rows, hidden); for the text rows (`text`: their row indices) the first tokens
    chosen on the device (len(text),) from their logits (len(text), vocab) and, when a row asks,
    their packed log-probabilities (sampling.token_logprobs) on the device — read back by whoever
    takes them (the decoder holds them for the next decode step's launch, prefiller.py)."""

    lengths: list[int]
    deltas: list[int]
    hidden: torch.Tensor
    text: list[int] = field(default_factory=list)
    tokens: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None


@dataclass
class Riders:
    """Decode rows riding a prefill forward (mixed_step.py): each row's next token as a piece of
    one token beside the prefill pieces. `ids`: their last tokens on the device, in `rows` order
    (a pipelined step's pending tokens), else None (the host's). After the forward their tokens
    (rows,) and packed log-probabilities (or None) are on the device, as a decode step's."""

    rows: list[Sequence]  # in the order they take among the forward's rows
    ids: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None


class ModelRunner:
    def __init__(
        self,
        model,
        runtime: LoraRuntime,
        vision: VisionEncoder,
        config,
        dtype: torch.dtype,
        device: torch.device,
        tp: TPGroup | None,
    ) -> None:
        """`config`: the engine's EngineConfig (KV pool, graph and block settings)."""
        self.model, self.runtime, self.vision = model, runtime, vision
        self.rope_inputs = for_model(model).rope_inputs  # what the family's get_rope_index takes
        self.text_config = model.config.text_config
        self.device, self.dtype, self.tp = device, dtype, tp
        # tensor parallel: each forward's unit of work in step with the other ranks'
        # (its all-reduces: one per row-parallel layer)
        self.lockstep = ForwardLockstep(
            tp,
            sum(isinstance(m, RowParallelLoraLinear) for m in model.modules()),
            self.text_config.hidden_size,
            dtype,
            device,
        )
        self.pool, self.blocks, self.max_model_len = make_pool(config, self.text_config, dtype, device, tp)
        # The Triton attention kernels, each checked once against its reference on this device;
        # one that fails there is replaced by its reference (correct, slow; decode without graphs).
        heads = self.text_config.num_attention_heads // (tp.world_size if tp is not None else 1)
        shape = (heads, self.pool.kv_heads, self.pool.head_dim, config.kv_block_size)
        attention_kernel = self._kernel_usable("decode", paged_attention, dtype, shape)
        self.prefill_kernel = self._kernel_usable("prefill", paged_prefill, dtype, shape)
        self.tokens = TokenChooser(device, self.upload)  # the rows' next tokens from their logits
        self.trace: StepTrace | None = None  # the engine's (its "inputs" phase: embeddings, vision tower)
        # decode and prefill graphs capture into one memory pool: their forwards run one at a time
        handle = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.graphs = DecodeGraphs(
            self.model,
            self.runtime,
            self.pool,
            self.blocks,
            self.device,
            capture=config.decode_graphs == "auto",
            attention_kernel=attention_kernel,
            pool_handle=handle,
        )
        self.prefill_graphs = PrefillGraphs(
            self.model,
            self.runtime,
            self.pool,
            self.blocks,
            self.device,
            rows=max(config.max_prefills_per_step, config.max_batch_size if config.mixed_steps else 0),
            capture=config.prefill_graphs == "auto",
            pad=config.prefill_graphs != "off",
            kernel=self.prefill_kernel,
            pool_handle=handle,
        )

    def _kernel_usable(self, name: str, module, dtype: torch.dtype, shape: tuple[int, int, int, int]) -> bool:
        """Whether `module`'s Triton kernel runs here (its self_check on CUDA; never on the CPU)."""
        problem = module.self_check(self.device, dtype, *shape) if self.device.type == "cuda" else "no CUDA"
        if self.device.type == "cuda" and problem is not None:
            log.warning("paged_attention_kernel_unusable", kernel=name, reason=problem)
        log.info("paged_attention", kernel=name, op="triton" if problem is None else "torch_reference")
        return problem is None

    def prefill(
        self, rows: list[Sequence], plan: Callable[[], StepLora], riders: Riders | None = None
    ) -> tuple[list[Sequence], PrefillOutput]:
        """Prefills each row's piece [s.prefilled, s.prefill_to) of its context in one forward of
        the language model; `plan()` makes their LoRA plan (rows ordered by LoRA entry, each row's
        piece length: one StepLora, no permutation, ATMM takes it), inside the forward's first
        unit of work, so a plan that raises on one tensor-parallel rank only (an adapter missing
        from that rank's slots) fails the forward on every rank. Returns the rows whose whole
        context is now cached, in order, and their PrefillOutput.

        The pieces are packed into one sequence of tokens (padded at its end to a bucket and
        replayed from a CUDA graph: prefill_graphs.py; `step` planned for the padded count, see
        `prefill_tokens`); attention reads each
        row's keys and values back from its blocks of the pool (PagedPrefill: causal within the
        row, over the tokens it has cached before its piece too, rows apart), after the forward
        wrote the piece's there. A row's first piece embeds its whole context (the vision tower
        over its images included) and computes its M-RoPE positions (get_rope_index over the
        batch, padded on the host, padding masked out: every row gets the positions and rope
        delta it has alone); a row prefilled in chunks keeps them for its next pieces. A
        sequence prefilled again after a preemption runs over its prompt and its generated
        tokens (text). The completed text rows' first tokens are chosen on the device.

        `riders`: rows of `rows` that decode in this forward (mixed_step.py): each runs its next
        token as a piece of one (embedded from its last token, at its next position and slot) and
        takes a token chosen with the first tokens, in one sampling call."""
        ride = {s: j for j, s in enumerate(riders.rows)} if riders is not None else {}
        if [ride[s] for s in rows if s in ride] != list(range(len(ride))):
            raise ValueError("riders must be listed in the order they take among the rows")
        settle = self.vision.settle
        step, ride_embeds = self.lockstep.agreed(self._plan_and_embed, plan, rows, riders, ride, settle=settle)
        if self.trace is not None:
            self.trace.mark("inputs")
        tokens = self.prefill_tokens(sum(1 if s in ride else s.prefill_to - s.prefilled for s in rows))
        return self.lockstep.agreed(self._prefill_forward, rows, step, riders, ride, ride_embeds, tokens=tokens)

    def _plan_and_embed(
        self, plan: Callable[[], StepLora], rows: list[Sequence], riders: Riders | None, ride: dict
    ) -> tuple[StepLora, torch.Tensor | None]:
        # embeddings first: tensor parallel, they take part in rank 0's broadcast of the pixels,
        # which a plan raising on this rank alone must not skip (the collectives would mismatch)
        embeds = self._embed_inputs(rows, riders, ride)
        return plan(), embeds

    def _embed_inputs(self, rows: list[Sequence], riders: Riders | None, ride: dict) -> torch.Tensor | None:
        """A prefill's inputs: the riders' embeddings (returned) and each fresh row's whole context
        (its chunk_inputs: embeddings, the vision tower over its images included, positions)."""
        ride_embeds = None
        if ride:
            ids = riders.ids
            if ids is None:
                ids = self.upload(torch.tensor([s.last_token for s in riders.rows]))
            ride_embeds = self.model.get_input_embeddings()(ids.view(-1)[: len(ride)].long())
        fresh = [s for s in rows if s.prefilled == 0 and s not in ride]
        if fresh:
            for s, e, pos, delta in zip(fresh, *self._inputs(fresh)):
                s.chunk_inputs = (e, pos, delta)
        return ride_embeds

    def _prefill_forward(
        self, rows: list[Sequence], step: StepLora, riders: Riders | None, ride: dict, ride_embeds: torch.Tensor | None
    ) -> tuple[list[Sequence], PrefillOutput]:
        """The prefill's packed forward over the rows' inputs and the completed rows' first tokens.
        Consecutive riders' inputs are built as one chunk from host integers (per-row tensors
        cost ~25 µs a rider on the host, ~2.7 ms a step of 105 riders on a 2-core host)."""
        parts, positions, slots, counts, lens = [], [], [], [], []
        wanted, at, end = [], {}, 0  # each completed row's last token; each rider's token
        run: list[Sequence] = []  # consecutive riders not yet in the chunks

        def flush() -> None:
            if not run:
                return
            j = ride[run[0]]  # riders come in the rows' order (Riders), so a run's embeddings are a slice
            parts.append(ride_embeds[j : j + len(run)])
            positions.append(torch.tensor([s.length + s.rope_delta for s in run]).expand(3, -1))
            slots.append(torch.tensor([self.blocks.slot(s.id, s.length) for s in run]))
            run.clear()

        for s in rows:
            if s in ride:
                run.append(s)
                counts.append(1)
                lens.append(s.length + 1)
                at[s] = end
                end += 1
                continue
            flush()
            e, pos, _ = s.chunk_inputs
            a, b = s.prefilled, s.prefill_to
            parts.append(e[a:b])
            positions.append(pos[:, a:b])
            slots.append(self.blocks.slots(s.id, a, b))
            counts.append(b - a)
            lens.append(b)
            end += b - a
            if b == s.context:
                wanted.append(end - 1)
        flush()
        completed = [s for s in rows if s not in ride and s.prefill_to == s.context]
        if ride:
            wanted += [at[s] for s in riders.rows]
        self.runtime.step = step
        try:
            hidden = self.prefill_graphs.forward(
                parts, positions, slots, counts, [self.blocks.row(s.id) for s in rows], lens, wanted, step
            )
            self.lockstep.forward_ran = True
        finally:
            self.runtime.step = None
        for s in rows:
            if s in ride:
                s.length += 1
            else:
                s.prefilled = s.prefill_to
        deltas = [s.chunk_inputs[2] for s in completed]
        for s in completed:
            s.chunk_inputs = None
        k = len(completed)
        return completed, self._first_tokens(
            completed, [s.context for s in completed], deltas, hidden[:k], riders if ride else None, hidden[k:]
        )

    def prefill_tokens(self, n: int) -> int:
        """The tokens a prefill forward of `n` packed tokens runs (its LoRA plan covers them all)."""
        return self.prefill_graphs.tokens(n)

    def _inputs(self, rows: list[Sequence]) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
        """Each row's whole context as prefill inputs: embeddings (context, hidden) on the device
        (one vision-tower pass for every image/video not in the feature cache; a recomputed
        sequence's generated tokens embedded as text), M-RoPE positions (3, context) on the host
        and its rope delta: the family's get_rope_index over the batch, given each of its
        `rope_inputs` concatenated row after row as it walks them (grids; Qwen2.5-VL's seconds
        per temporal patch of each video, without which every video would take its default)."""
        lengths = [s.context for s in rows]
        b, width = len(rows), max(lengths)
        first = rows[0].prep.inputs
        ids = first["input_ids"].new_zeros((b, width))
        types = first["mm_token_type_ids"].new_zeros((b, width))
        mask = torch.zeros((b, width), dtype=torch.long)
        found: dict[str, list[torch.Tensor]] = {key: [] for key in self.rope_inputs}  # grids, in row order
        for i, (s, n) in enumerate(zip(rows, lengths)):
            inp = s.prep.inputs
            p = s.prep.prompt_tokens
            ids[i, :p] = inp["input_ids"][0]
            ids[i, p:n] = torch.tensor(s.tokens, dtype=ids.dtype)
            types[i, :p] = inp["mm_token_type_ids"][0]
            mask[i, :n] = 1
            for key, got in found.items():
                if inp.get(key) is not None:
                    got.append(inp[key])
        # The step launches everything before it waits on the device once, for the first tokens:
        # host inputs go up with non-blocking copies (a blocking one waits for all queued work,
        # e.g. the vision tower, and the GPU then idles while the host prepares the next launch).
        # On the host: the rope index walks every row in Python (no device syncs per row).
        position_ids, deltas = rope_positions(
            self.model,
            ids,
            mm_token_type_ids=types,
            attention_mask=mask,
            **{key: torch.cat(got) if got else None for key, got in found.items()},
        )
        row_embeds = self.vision.embed_batch([(s.prep.inputs["input_ids"], s.prep.inputs, s.prep.vision) for s in rows])
        embeds = []
        for i, (e, s) in enumerate(zip(row_embeds, rows)):
            e = e[0]
            if s.tokens:  # recompute after a preemption: the generated tokens' embeddings
                p = s.prep.prompt_tokens
                e = torch.cat([e, self.model.get_input_embeddings()(self.upload(ids[i, p : p + len(s.tokens)]))])
            embeds.append(e)
        return embeds, [position_ids[:, i, :n] for i, n in enumerate(lengths)], [int(d) for d in deltas]

    def _first_tokens(
        self,
        rows: list[Sequence],
        lengths: list[int],
        deltas: list[int],
        hidden: torch.Tensor,
        riders: Riders | None = None,
        ridden: torch.Tensor | None = None,
    ) -> PrefillOutput:
        """The text rows' first tokens from their last hidden states (rows, hidden), on the device;
        with `riders`, theirs too (from `ridden`, (riders, hidden)), in the same sampling call."""
        b = len(rows)
        text = [i for i, s in enumerate(rows) if s.req.output_kind != OutputKind.LABEL]
        if not text and riders is None:
            return PrefillOutput(lengths, deltas, hidden)
        head_in = hidden if len(text) == b else hidden[self.upload(torch.tensor(text, dtype=torch.long))]
        chosen_rows = [rows[i] for i in text]
        # each row's token takes position (its context + rope delta): the sampler's counter
        counters = [lengths[i] + deltas[i] for i in text]
        if riders is not None:
            head_in = torch.cat([head_in, ridden]) if text else ridden
            chosen_rows += riders.rows
            counters += [s.length + s.rope_delta for s in riders.rows]
        head_out = self.model.lm_head(head_in)
        chosen = self.tokens.choose(chosen_rows, head_out.argmax(-1), head_out, counters)
        packed = self.tokens.logprobs(chosen_rows, head_out, chosen)
        k = len(text)
        if riders is not None:
            riders.tokens = chosen[k:]
            riders.logprobs = None if packed is None else packed[k:]
        if not text:
            return PrefillOutput(lengths, deltas, hidden)
        return PrefillOutput(
            lengths, deltas, hidden, text, chosen[:k], head_out[:k], None if packed is None else packed[:k]
        )

    def upload(self, t: torch.Tensor) -> torch.Tensor:
        """A small host tensor on the device, without waiting for the stream's queued work (torch's
        blocking host-to-device copy synchronizes the stream). Pageable memory is staged at once,
        so the host tensor may be dropped right after."""
        return t.to(self.device, non_blocking=True)

    def decode(
        self, rows: list[Sequence], plan: Callable[[], StepLora], bucket: int, ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Launches one decode step of `rows` (`plan()`: makes their LoRA plan over `bucket` rows,
        inside the step's lockstep: a plan that raises on one tensor-parallel rank only still
        runs that rank's part of the forward's all-reduces; `ids`: their last tokens on the
        device, else the sequences' own) and returns (greedy tokens, logits) of the batch's
        rows, owned by the step's graph entry."""
        try:
            with self.lockstep.around(max(bucket, len(rows))):
                step = self.runtime.step = plan()
                out = self.graphs.step(self.decode_rows(rows), step, bucket, ids=ids)
                self.lockstep.forward_ran = True
                return out
        finally:
            self.runtime.step = None

    def decode_rows(self, rows: list[Sequence]) -> list[DecodeRow]:
        """Each row's inputs to its next decode step."""
        kv = self.blocks
        return [
            DecodeRow(
                token=s.last_token,
                position=s.length + s.rope_delta,
                slot=kv.slot(s.id, s.length),
                length=s.length + 1,
                table_row=kv.row(s.id),
            )
            for s in rows
        ]
