"""Decode steps of the running sequences, pipelined with the host.

Pipelined decode (EngineConfig.pipeline_decode): a step is left pending (its tokens, greedy or
sampled on the device, copied to the host asynchronously) when another step will follow. If at
the next step boundary the batch is the same (no row joined, left or was cancelled) and every
row's next token has a block, the next step is launched at once with the pending step's tokens
as input ids, copied on the device, and only then are the pending step's tokens taken on the host
(detokenized, streamed, finish checks) while the device computes. A row that finishes there has
computed one token too many in the step just launched: it is never emitted, and the row leaves
the batch at the next boundary. Otherwise the pending step is taken first and the step runs from
host tokens, as do all steps with pipelining off. Commands and the engine's stop take a pending
step first too (`flush`).
"""

from __future__ import annotations

import torch

from services.worker.decode_graphs import bucket_rows
from services.worker.lora_plans import LoraPlanner
from services.worker.model_runner import ModelRunner
from services.worker.outputs import OutputProcessor
from services.worker.sequence import PendingStep, Sequence
from services.worker.step_scheduler import StepScheduler


class Decoder:
    def __init__(self, sched: StepScheduler, lora: LoraPlanner, runner: ModelRunner, outputs: OutputProcessor,
                 device: torch.device, pipeline: bool) -> None:
        self.sched, self.lora, self.runner, self.outputs = sched, lora, runner, outputs
        self.device, self.pipeline = device, pipeline
        self.pending: PendingStep | None = None  # the launched step whose tokens the host has not taken
        self.pipelined_steps = 0  # steps launched from the previous step's device tokens
        # largest decode batch seen (rows, distinct LoRA entries in one forward): observability + tests
        self.peak_rows = 0
        self.peak_entries = 0

    def step(self) -> None:
        """One decode step of every running sequence (rows ordered by LoRA entry)."""
        rows = sorted(self.sched.running, key=self.lora.sort_key)
        if self.pending is not None:
            if self._pipelined(rows):
                return
            self.flush()
        self.sched.reserve_decode()
        rows = sorted(self.sched.running, key=self.lora.sort_key)
        if not rows:
            return
        step = self.lora.plan(rows, 1, bucket_rows(len(rows)))
        self.peak_rows = max(self.peak_rows, len(rows))
        self.peak_entries = max(self.peak_entries, len(step.entries))
        tokens, logprobs = self._launch(rows, step)
        if self._holdable(rows):
            self.pending = self._hold(rows, tokens, logprobs)
            return
        for s, token, lp in zip(rows, tokens.tolist(), _rows_of(logprobs, len(rows))):  # one copy for the batch
            self.outputs.guard([s], self.outputs.accept, s, token, lp)  # a row that fails here fails alone

    def flush(self) -> None:
        """Takes the pending step, if any (before anything that needs every token known)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            self.outputs.guard([s for s in pending.rows if not s.finished], self._take, pending)

    def _launch(self, rows: list[Sequence], step, ids: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Runs the step's forward (from `ids` on the device, else the rows' last tokens) and
        chooses its tokens on the device, with their log-probabilities when a row asks (None
        otherwise); every row has then cached one more token."""
        greedy, logits = self.runner.decode(rows, step, bucket_rows(len(rows)), ids=ids)
        for s in rows:
            s.length += 1
        tokens = self.runner.choose(rows, greedy, logits, [s.length + s.rope_delta for s in rows], pending=ids)
        return tokens, self.runner.logprobs(rows, logits, tokens)

    def _pipelined(self, rows: list[Sequence]) -> bool:
        """Launches the next step from the pending one's device tokens, then takes the pending
        step's tokens. False (nothing done) when the batch changed or a row's next token needs a
        block the pool does not have."""
        pending = self.pending
        if rows != pending.rows or not self.sched.can_grow(rows):  # Sequence compares by identity
            return False
        step = self.lora.plan(rows, 1, bucket_rows(len(rows)))  # the plan of the pending step, kept
        self.pending = self._hold(rows, *self._launch(rows, step, ids=pending.tokens))
        self.pipelined_steps += 1
        self._take(pending)
        if not self._holdable(rows):
            self.flush()
        return True

    def _holdable(self, rows: list[Sequence]) -> bool:
        """Whether a launched step's tokens may wait for the next step's launch: pipelining is on,
        some row goes on after this step's token (no speculative step when all are done:
        finished, or at max_new_tokens), and none releases its adapter with it (the next step's
        LoRA plan changes). Sampled rows pipeline too: their tokens are chosen on the device."""
        if not self.pipeline:
            return False
        goes_on = False
        for s in rows:
            if s.finished:
                continue
            n = len(s.tokens) + 1  # its tokens once this step's is taken
            if s.prep.release_after and not s.released and n >= s.prep.release_after:
                return False
            goes_on = goes_on or n < s.prep.max_new_tokens
        return goes_on

    def _hold(self, rows: list[Sequence], tokens: torch.Tensor, logprobs: torch.Tensor | None) -> PendingStep:
        """Queues the copy of a launched step's tokens (and log-probabilities) to the host, right
        behind the step."""
        pin = self.device.type == "cuda"
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=pin)
        host.copy_(tokens, non_blocking=True)
        host_lp = None
        if logprobs is not None:
            host_lp = torch.empty(logprobs.shape, dtype=logprobs.dtype, pin_memory=pin)
            host_lp.copy_(logprobs, non_blocking=True)
        copied = None
        if self.device.type == "cuda":  # the engine thread need not have selected the engine's device
            copied = torch.cuda.Event()
            copied.record(torch.cuda.current_stream(self.device))
        return PendingStep(rows, tokens, host, copied, host_lp)

    def _take(self, pending: PendingStep) -> None:
        """Accepts a pending step's tokens; a row that finished or left since its launch drops its own."""
        if pending.copied is not None:
            pending.copied.synchronize()
        for s, token, lp in zip(pending.rows, pending.host.tolist(), _rows_of(pending.logprobs, len(pending.rows))):
            if not s.finished:
                self.outputs.guard([s], self.outputs.accept, s, token, lp)


def _rows_of(logprobs: torch.Tensor | None, n: int) -> list:
    """Each row's packed log-probabilities (sampling.token_logprobs) as host lists; None each when
    no row asked."""
    return logprobs.tolist() if logprobs is not None else [None] * n
