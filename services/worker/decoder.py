"""Decode steps of the running sequences, pipelined with the host.

Pipelined decode (EngineConfig.pipeline_decode): tokens chosen on the device are left pending
(copied to the host asynchronously) when a decode step will follow — a launched decode step's,
and a prefill's first tokens (`hold_first`). At the next decode step every running row whose last
token is pending takes it on the device (one gather over the pending tokens, with the host's
last tokens of the other rows), the step is launched, and only then are the pending tokens taken
on the host (detokenized, streamed, finish checks) while the device computes: the host never
waits for the device between a prefill and the decode after it, nor between decode steps, while
rows join and leave. A row that finishes when its pending token is taken has computed one token
too many in the step just launched: it is never emitted, and the row leaves the batch at the
next boundary. The pending tokens are taken first instead (and the step runs from host tokens,
as do all steps with pipelining off) when a row's next token needs a block the pool does not
have (preemption), when penalized rows mix pending and host tokens, or when a row releases its
adapter with a pending token (the next step's LoRA plan depends on it). Commands and the engine's
stop take the pending tokens first too (`flush`).

No batch fails for one row (as a prefill's, prefiller.py): when a decode step's forward or its
choice of tokens raises, the step is undone, the tokens launched before it are taken on the host,
and every row still running decodes that step alone, from its host token (`_isolate`); only a row
whose own step raises fails (INTERNAL, ENGINE_STEP_FAILED), the others take the tokens they would
have had (sampled rows too: a token depends on the seed and its position alone), and the next step
starts from host tokens. Under tensor parallelism every rank does the same, whether the failure
is the inputs' (every rank raises in the same forward) or one rank's alone: a rank that raised in
the forward still runs its remaining all-reduces (tensor_parallel.ForwardLockstep) and the ranks agree on the
step's outcome after it (`_launch`: OutputProcessor.agree), so every rank undoes the same step,
runs the same rows alone, in the same collectives, and fails the same ones (tensor_parallel.py).
"""

from __future__ import annotations

import structlog
import torch

from services.worker.decode_graphs import bucket_rows
from services.worker.lora_plans import LoraPlanner
from services.worker.model_runner import ModelRunner
from services.worker.outputs import OutputProcessor
from services.worker.sequence import PendingStep, Sequence
from services.worker.step_scheduler import StepScheduler

log = structlog.get_logger()


class Decoder:
    def __init__(
        self,
        sched: StepScheduler,
        lora: LoraPlanner,
        runner: ModelRunner,
        outputs: OutputProcessor,
        device: torch.device,
        pipeline: bool,
    ) -> None:
        self.sched, self.lora, self.runner, self.outputs = sched, lora, runner, outputs
        self.device, self.pipeline = device, pipeline
        self.pending: list[PendingStep] = []  # launched tokens the host has not taken, oldest first
        self.pipelined_steps = 0  # steps launched from pending device tokens
        self.isolated_steps = 0  # batched steps that raised, their rows then decoded alone
        self.failed_rows = 0  # rows of those whose step alone raised too
        # largest decode batch seen (rows, distinct LoRA entries in one forward): observability + tests
        self.peak_rows = 0
        self.peak_entries = 0

    def step(self) -> None:
        """One decode step of every running sequence (rows ordered by LoRA entry)."""
        rows = sorted(self.sched.running, key=self.lora.sort_key)
        if self.pending:
            if self._pipelined(rows):
                return
            self.flush()
            self.outputs.agree()  # rows the flush failed on one rank leave every rank's batch
        self.sched.reserve_decode()
        rows = sorted(self.sched.running, key=self.lora.sort_key)
        if not rows:
            return
        lengths = [s.length for s in rows]
        try:
            tokens, logprobs = self._launch(rows)
        except Exception as exc:  # each row alone; a row alone that fails is failed
            self._isolate(rows, lengths, [], exc)
            return
        if self.holdable(rows):
            self.pending.append(self.hold(rows, tokens, logprobs))
            return
        for s, token, lp in zip(rows, tokens.tolist(), _rows_of(logprobs, len(rows))):  # one copy for the batch
            self.outputs.guard([s], self.outputs.accept, s, token, lp)  # a row that fails here fails alone

    def observe(self, rows: int, entries: int) -> None:
        """A forward decoded `rows` rows of `entries` distinct LoRA entries (a decode step's, or a
        mixed step's riders'): the peaks."""
        self.peak_rows = max(self.peak_rows, rows)
        self.peak_entries = max(self.peak_entries, entries)

    def hold_first(self, rows: list[Sequence], tokens: torch.Tensor, logprobs: torch.Tensor | None) -> bool:
        """Holds a prefill's first tokens of `rows` (now running) on the device for the next
        decode step; False (nothing held: the caller takes them) when they may not wait."""
        if not self.holdable(rows):
            return False
        self.pending.append(self.hold(rows, tokens, logprobs))
        return True

    def flush(self) -> None:
        """Takes the pending tokens, if any (before anything that needs every token known)."""
        pending, self.pending = self.pending, []
        for p in pending:
            self.outputs.guard([s for s in p.rows if not s.finished], self.take, p)

    def _launch(
        self, rows: list[Sequence], ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Plans the step's LoRA, runs its forward (from `ids` on the device, else the rows'
        last tokens) and chooses its tokens on the device, with their log-probabilities when a
        row asks (None otherwise); every row has then cached one more token. Tensor parallel:
        raises on every rank when any part of that raised on any (OutputProcessor.agree) — the
        plan too: one that raises on one rank only must not leave the others in a forward."""
        error = out = None
        try:
            bucket = bucket_rows(len(rows))
            greedy, logits = self.runner.decode(rows, lambda: self.lora.plan(rows, 1, bucket), bucket, ids=ids)
            self.observe(len(rows), len(self.lora.last.entries))
            for s in rows:
                s.length += 1
            chooser = self.runner.tokens
            tokens = chooser.choose(rows, greedy, logits, [s.length + s.rope_delta for s in rows], pending=ids)
            out = tokens, chooser.logprobs(rows, logits, tokens)
        except Exception as exc:  # raised below, on every rank when tensor parallel
            error = exc
        self.outputs.agree(error)
        return out

    def _pipelined(self, rows: list[Sequence]) -> bool:
        """Launches the next step from the pending device tokens, then takes them. False (nothing
        done) when it cannot launch from them (`pending_inputs`)."""
        ids = self.pending_inputs(rows)
        if ids is None:
            return False
        taken, self.pending = self.pending, []
        lengths = [s.length for s in rows]
        try:
            launched = self._launch(rows, ids=ids)
        except Exception as exc:  # each row alone; a row alone that fails is failed
            self._isolate(rows, lengths, taken, exc)
            return True
        self.pending.append(self.hold(rows, *launched))
        self.pipelined_steps += 1
        for p in taken:
            self.take(p)
        if not self.holdable(rows):
            self.flush()
        return True

    def pending_inputs(self, rows: list[Sequence]) -> torch.Tensor | None:
        """For a step of `rows` launched from the pending tokens: their last tokens on the device
        (the caller then takes the pending steps once its step is launched). None when no row's
        token is pending, when penalized rows would mix pending and host tokens (the penalties
        count them as not yet taken), or a row's next token needs a block the pool does not have."""
        where = {s: (k, j) for k, p in enumerate(self.pending) for j, s in enumerate(p.rows)}
        held = [s in where for s in rows]
        if not any(held) or (not all(held) and any(s.req.sampling.penalized for s in rows)):
            return None
        if not self.sched.can_grow(rows):
            return None
        return self.gather(rows, where)

    def _isolate(self, rows: list[Sequence], lengths: list[int], taken: list[PendingStep], exc: Exception) -> None:
        """After a decode step of `rows` raised: the step undone, then each row's step alone.

        Every row back to the length it had (a step whose tokens' choice raised had counted its
        new token); the failed forward may have written some layers' keys and values of the new
        token, at the slot the row's step alone writes again, every layer, before reading it (its
        blocks stay the row's). The tokens launched before the step (`taken`, pipelined) are taken
        on the host first, as a flush would: they are the rows' last tokens, and a row they
        finish decodes no more. Then every row still running runs the step alone from its host
        token, in the batch's order, and takes its token at once: a row whose step alone raises
        fails (the guard: INTERNAL with the error, its blocks and adapter pin given back), never
        retried again; when every step fails (a broken device) every row fails. A batch of one
        row is not retried: its error is the row's."""
        for s, n in zip(rows, lengths):
            s.length = n
        for p in taken:
            self.take(p)
        if taken:
            self.outputs.agree()  # rows those tokens failed on one rank are not retried on any
        alive = [s for s in rows if not s.finished]
        if len(rows) == 1:
            if alive:
                raise exc
            return
        self.isolated_steps += 1
        log.warning(
            "decode_step_failed",
            error=repr(exc)[:500],
            requests=[s.req.request_id for s in rows],
            retry="each row alone",
        )
        failed = 0
        for s in alive:
            if not s.finished:  # failed on another rank meanwhile (OutputProcessor.agree)
                failed += not self.outputs.guard([s], self._alone, s)
        self.failed_rows += failed
        if self.runner.trace is not None:
            self.runner.trace.note(decode_retried_rows=len(alive), decode_failed_rows=failed)

    def _alone(self, s: Sequence) -> None:
        """One decode step of `s` alone (its own bucket and LoRA plan), its token taken now."""
        tokens, logprobs = self._launch([s])
        self.outputs.accept(s, tokens.tolist()[0], _rows_of(logprobs, 1)[0])

    def gather(self, rows: list[Sequence], where: dict) -> torch.Tensor:
        """The rows' last tokens on the device: a pending one where it is pending, else the host's."""
        if len(self.pending) == 1 and self.pending[0].rows == rows:  # Sequence compares by identity
            return self.pending[0].tokens  # the same rows as the pending step (steady decoding)
        sources = [p.tokens for p in self.pending]
        starts = [0]
        for t in sources:
            starts.append(starts[-1] + t.shape[0])
        host = [s.last_token for s in rows if s not in where]
        index, h = [], starts[-1]
        for s in rows:
            if s in where:
                k, j = where[s]
                index.append(starts[k] + j)
            else:
                index.append(h)
                h += 1
        if host:
            sources.append(self.runner.upload(torch.tensor(host, dtype=sources[0].dtype)))
        flat = torch.cat(sources) if len(sources) > 1 else sources[0]
        return flat.index_select(0, self.runner.upload(torch.tensor(index)))

    def holdable(self, rows: list[Sequence]) -> bool:
        """Whether tokens just launched for `rows` may wait for the next step's launch: pipelining
        is on, some row goes on after this token (no speculative step when all are done:
        finished, or at max_new_tokens), and none releases its adapter with it (the next step's
        LoRA plan changes). Sampled rows pipeline too: their tokens are chosen on the device."""
        if not self.pipeline:
            return False
        goes_on = False
        for s in rows:
            if s.finished:
                continue
            n = len(s.tokens) + 1  # its tokens once this one is taken
            if not s.released and s.release_watch.comes_with(n):
                return False
            goes_on = goes_on or n < s.prep.max_new_tokens
        return goes_on

    def hold(self, rows: list[Sequence], tokens: torch.Tensor, logprobs: torch.Tensor | None) -> PendingStep:
        """Queues the copy of launched tokens (and log-probabilities) to the host, right behind
        the work that computes them."""
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

    def take(self, pending: PendingStep) -> None:
        """Accepts pending tokens; a row that finished or left since their launch drops its own."""
        if pending.copied is not None:
            pending.copied.synchronize()
        for s, token, lp in zip(pending.rows, pending.host.tolist(), _rows_of(pending.logprobs, len(pending.rows))):
            if not s.finished:
                self.outputs.guard([s], self.outputs.accept, s, token, lp)


def _rows_of(logprobs: torch.Tensor | None, n: int) -> list:
    """Each row's packed log-probabilities (sampling.token_logprobs) as host lists; None each when
    no row asked."""
    return logprobs.tolist() if logprobs is not None else [None] * n
