"""The step's prefill: whole contexts of several requests and the next chunk of a long one
(chunked prefill) in one forward, then each completed request's hand-off — a LABEL answer, or its
first token and the start of decoding. The engine's collaborator beside the decoder (decoder.py), which
takes the first tokens after it has launched the next decode step from them."""

from __future__ import annotations

import time

import torch

from services.worker.detokenizer import IncrementalDetokenizer
from services.worker.lora_plans import LoraPlanner
from services.worker.decoder import Decoder
from services.worker.model_runner import ModelRunner, PrefillOutput
from services.worker.outputs import OutputProcessor
from services.worker.requests import OutputKind
from services.worker.sequence import Sequence
from services.worker.step_scheduler import StepScheduler


class Prefiller:
    def __init__(self, sched: StepScheduler, lora: LoraPlanner, runner: ModelRunner, outputs: OutputProcessor,
                 decoder: Decoder, tokenizer) -> None:
        self.sched, self.lora, self.runner, self.outputs = sched, lora, runner, outputs
        self.decoder, self.tokenizer = decoder, tokenizer
        self.peak_rows = 0  # largest prefill batch (requests in one forward)

    def run(self, seqs: list[Sequence]) -> None:
        """The step's prefill pieces (StepScheduler.take_prefills) in one forward
        (ModelRunner.prefill: packed, no padding), rows ordered by LoRA entry; if the forward
        fails, every request in it fails; after it each completed row's hand-off is its own, and
        a row prefilled in chunks waits in the prefill queue for its next piece."""
        t0 = time.monotonic()
        rows = sorted(seqs, key=self.lora.sort_key)
        for s in rows:
            if s.prefilled == 0 and not s.tokens:  # a recomputed sequence keeps its first prefill's time
                s.t_prefill = t0
        self.peak_rows = max(self.peak_rows, len(rows))
        counts = [s.prefill_to - s.prefilled for s in rows]
        # the forward's padding tokens (prefill_graphs.py) extend the last row's LoRA segment
        counts[-1] += self.runner.prefill_tokens(sum(counts)) - sum(counts)
        done, out = self.runner.prefill(rows, self.lora.plan(rows, counts))
        if done:
            self._hand_off(done, out)

    def _hand_off(self, rows: list[Sequence], out: PrefillOutput) -> None:
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
        token follows, _hand_off)."""
        s.length = length
        s.rope_delta = rope_delta
        if s.req.output_kind == OutputKind.LABEL:
            self.outputs.answer_label(s, hidden)
            return
        if s.detok is None:  # a recomputed sequence keeps its detokenizer
            s.detok = IncrementalDetokenizer(self.tokenizer, s.req.stop)
        self.sched.prefilled(s)
