"""The step's prefill: whole contexts of several requests and the next chunk of a long one
(chunked prefill) in one forward, then each completed request's hand-off — a LABEL answer, or its
first token and the start of decoding. The engine's collaborator beside the decoder (decoder.py), which
takes the first tokens after it has launched the next decode step from them."""

from __future__ import annotations

import time

import structlog
import torch

from services.worker.detokenizer import IncrementalDetokenizer
from services.worker.lora_plans import LoraPlanner
from services.worker.decoder import Decoder
from services.worker.model_runner import ModelRunner, PrefillOutput
from services.worker.outputs import OutputProcessor
from services.worker.requests import OutputKind
from services.worker.sequence import Sequence
from services.worker.step_scheduler import StepScheduler

log = structlog.get_logger()


class Prefiller:
    def __init__(
        self,
        sched: StepScheduler,
        lora: LoraPlanner,
        runner: ModelRunner,
        outputs: OutputProcessor,
        decoder: Decoder,
        tokenizer,
    ) -> None:
        self.sched, self.lora, self.runner, self.outputs = sched, lora, runner, outputs
        self.decoder, self.tokenizer = decoder, tokenizer
        self.peak_rows = 0  # largest prefill batch (requests in one forward)
        self.isolated_batches = 0  # batched forwards that failed, their rows then prefilled alone
        self.failed_rows = 0  # rows of those whose forward alone failed too

    def run(self, seqs: list[Sequence]) -> None:
        """The step's prefill pieces (StepScheduler.take_prefills) in one forward
        (ModelRunner.prefill: packed, no padding), rows ordered by LoRA entry; after it each
        completed row's hand-off is its own, and a row prefilled in chunks waits in the prefill
        queue for its next piece.

        No batch fails for one row: when the batched forward (its inputs, the vision tower, its
        first tokens) raises, each row's piece is prefilled again alone (`_isolate`), and only a
        row whose own forward raises fails (the engine's guard: INTERNAL with the error); the
        others go on with the tokens they would have had. A row alone that fails is failed, never
        retried again; when every forward fails (a broken device) every row fails."""
        rows = sorted(seqs, key=self.lora.sort_key)
        self.starting(rows)
        before = [(s.prefilled, s.chunk_inputs) for s in rows]
        try:
            done, out = self._prefill(rows)
        except Exception as exc:  # retried row by row; a row alone that fails is failed
            if len(rows) == 1:
                raise
            self._isolate(rows, before, exc)
            return
        if done:
            self.hand_off(done, out)

    def starting(self, rows: list[Sequence]) -> None:
        """Before a forward prefills `rows`: their prefill start times, the peak batch."""
        t0 = time.monotonic()
        for s in rows:
            if s.prefilled == 0 and not s.tokens:  # a recomputed sequence keeps its first prefill's time
                s.t_prefill = t0
        self.peak_rows = max(self.peak_rows, len(rows))

    def _prefill(self, rows: list[Sequence]) -> tuple[list[Sequence], PrefillOutput]:
        """One forward of the rows' pieces (ModelRunner.prefill) under their LoRA plan."""
        counts = [s.prefill_to - s.prefilled for s in rows]
        # the forward's padding tokens (prefill_graphs.py) extend the last row's LoRA segment
        counts[-1] += self.runner.prefill_tokens(sum(counts)) - sum(counts)
        return self.runner.prefill(rows, lambda: self.lora.plan(rows, counts))

    def _isolate(self, rows: list[Sequence], before: list[tuple[int, tuple | None]], exc: Exception) -> None:
        """After a failed batched forward: every row back to where the step found it, then its
        piece prefilled alone (a failure fails that row only), in the batch's order.

        Back to where it was, as a preemption resets a sequence for recompute, but only as far as
        this step's piece: a failed forward may have written some layers' keys and values of the
        piece (the blocks, held since admission, stay the row's; the retry writes every layer of
        those slots again before reading them), never the row's earlier chunks, cached by forwards
        that succeeded. A forward that failed after its pieces were cached (choosing the first
        tokens) had moved `prefilled` on and dropped the completed rows' chunk inputs: both are
        restored. A first piece's inputs are embedded again, alone (a failure of the batch's
        embedding, e.g. the vision tower over one row's image, is then that row's); a later
        chunk keeps the embeddings its first piece made. The retries are part of this step: its
        trace's phases stay one each (the retries' time is its prefill's) and say how many rows
        were retried and failed."""
        self.isolated_batches += 1
        log.warning(
            "prefill_batch_failed",
            error=repr(exc)[:500],
            requests=[s.req.request_id for s in rows],
            retry="each row alone",
        )
        for s, (prefilled, inputs) in zip(rows, before):
            s.prefilled = prefilled
            s.chunk_inputs = inputs if prefilled else None
        trace, self.runner.trace = self.runner.trace, None  # the step's "inputs" phase was the batch's
        failed = 0
        try:
            for s in rows:
                if not s.finished:  # failed on another tensor-parallel rank meanwhile (OutputProcessor.agree)
                    failed += not self.outputs.guard([s], self._alone, s)
        finally:
            self.runner.trace = trace
        self.failed_rows += failed
        if trace is not None:
            trace.note(prefill_retried_rows=len(rows), prefill_failed_rows=failed)

    def _alone(self, s: Sequence) -> None:
        done, out = self._prefill([s])
        if done:
            self.hand_off(done, out)

    def hand_off(self, rows: list[Sequence], out: PrefillOutput) -> None:
        """After the prefill forward: each row's own hand-off (prefilled), then the text rows'
        first tokens — held on the device for the next decode step when the decoder pipelines
        them (Decoder.hold_first: the host takes them once that step is launched), else taken now."""
        for i, s in enumerate(rows):
            self.outputs.guard([s], self.prefilled, s, out.lengths[i], out.deltas[i], out.hidden[i])
        text = [rows[i] for i in out.text]
        if not text or self.decoder.hold_first(text, out.tokens, out.logprobs):
            return
        packed = out.logprobs.tolist() if out.logprobs is not None else [None] * len(text)
        for s, token, lp in zip(text, out.tokens.tolist(), packed):  # one copy for the batch
            if not s.finished:
                self.outputs.guard([s], self.outputs.accept, s, token, lp)

    def prefilled(self, s: Sequence, length: int, rope_delta: int, hidden: torch.Tensor) -> None:
        """After the prefill forward: answers a LABEL request, or (re)starts decoding (its first
        token follows, hand_off)."""
        s.length = length
        s.rope_delta = rope_delta
        if s.req.output_kind == OutputKind.LABEL:
            self.outputs.answer_label(s, hidden)
            return
        if s.detok is None:  # a recomputed sequence keeps its detokenizer
            s.detok = IncrementalDetokenizer(self.tokenizer, s.req.stop)
        self.sched.prefilled(s)
