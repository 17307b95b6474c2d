"""What the engine hands back for each sequence: streamed text, the finish, LABEL answers.

`OutputProcessor.accept` takes one new token of a sequence: it detokenizes and streams it, checks
EOS, stop sequences and max_new_tokens, releases the adapter early where the request asked for it
(LoRazor: at its release point, or where its rule sets one from the text, release.py), and
finishes the sequence (through the step scheduler) with its GenerationResult.
Events go to the request's sink on the engine thread; a tensor-parallel follower's copy of a
request has no sink and emits nothing.

Tensor parallel, every rank fails the same requests (`agree`): a unit of work that raised on one
rank only raises on every rank, and a row this rank's `guard` failed is failed on the others at the
next agreement — before anything decides the next forward's rows (tensor_parallel.py).
"""

from __future__ import annotations

import time

import structlog
import torch

from services.common.errors import ValoraError
from services.worker.adapter_pool import AdapterPool
from services.worker.requests import Event, Failed, Finished, FinishReason, GenerationResult, TextDelta, TokenLogprob
from services.worker.sampling import unpack_logprobs
from services.worker.sequence import Sequence
from services.worker.step_scheduler import StepScheduler
from services.worker.tensor_parallel import TPGroup, TPStepFailed, describe

log = structlog.get_logger()


class OutputProcessor:
    def __init__(
        self,
        sched: StepScheduler,
        pool: AdapterPool,
        device: torch.device,
        eos_ids: set[int],
        tp: TPGroup | None = None,
    ) -> None:
        self.sched, self.pool, self.device = sched, pool, device
        self.eos_ids = eos_ids
        self.tp = tp  # more than one rank, or None
        self.failed_here: dict[int, str] = {}  # tensor parallel: rows `guard` failed since the ranks last agreed

    def emit(self, s: Sequence, event: Event) -> None:
        if s.sink is None:  # a tensor-parallel follower's copy of a request
            return
        try:
            s.sink(event)
        except Exception as exc:  # a dead consumer must not kill the engine
            log.warning("sink_failed", request_id=s.req.request_id, error=repr(exc))

    def guard(self, seqs: list[Sequence], fn, *args) -> bool:
        """Runs one unit of work; an exception fails the requests involved, not the engine.
        Returns whether it ran without one."""
        try:
            fn(*args)
            return True
        except Exception as exc:
            log.error("engine_step_failed", error=repr(exc), requests=[s.req.request_id for s in seqs])
            error = (
                exc
                if isinstance(exc, ValoraError)
                else ValoraError(f"engine step failed: {type(exc).__name__}: {exc}", reason="ENGINE_STEP_FAILED")
            )
            for s in seqs:
                self.sched.finish(s)
                self.emit(s, Failed(error))
                if self.tp is not None:
                    self.failed_here[s.id] = describe(error)
            return False

    def agree(self, error: BaseException | None = None) -> None:
        """Tensor parallel: every rank calls it at the same points (after a unit of device work, its
        `error` or None; before what decides a forward's rows): the rows other ranks failed since
        the last agreement are failed here too (INTERNAL, ENGINE_STEP_FAILED, naming the rank),
        then it raises when the unit failed on any rank (Verdict.check). One process: raises
        `error`, if any."""
        if self.tp is None:
            if error is not None:
                raise error
            return
        rows, self.failed_here = self.failed_here, {}
        verdict = self.tp.agree(error, rows)
        if verdict.rows:
            for s in self.sched.active():
                why = verdict.rows.get(s.id)
                if why is not None and not s.finished:
                    log.error("engine_row_failed_on_another_rank", request_id=s.req.request_id, error=why)
                    self.sched.finish(s)
                    self.emit(s, Failed(TPStepFailed(f"request {why}", reason="ENGINE_STEP_FAILED")))
        verdict.check(self.tp.world_size, error)

    def accept(self, s: Sequence, token: int, logprobs: list[float] | None = None) -> None:
        """A new token for `s` (`logprobs`: its packed log-probabilities, sampling.token_logprobs,
        when the request asks): stream it, and finish the sequence if it is done."""
        now = time.monotonic()
        if not s.tokens:
            s.t_first = now
        s.token_times.append(now)
        s.tokens.append(token)
        s.last_token = token
        if s.req.logprobs >= 0 and logprobs is not None:
            s.logprobs.append(TokenLogprob(*unpack_logprobs(token, logprobs, s.req.logprobs)))
        reason = None
        if token in self.eos_ids:
            reason = FinishReason.EOS
        else:
            delta = s.detok.push(token)
            if delta:
                self.emit(s, TextDelta(delta, self._new_logprobs(s)))
            if s.detok.stopped:
                reason = FinishReason.STOP_SEQUENCE
        if reason is None and len(s.tokens) >= s.prep.max_new_tokens:
            reason = FinishReason.LENGTH
        if reason is None:
            if not s.released and s.release_watch.due(len(s.tokens), s.detok.text):
                self.release_adapter(s)
            return
        tail = s.detok.finish()
        if tail:
            self.emit(s, TextDelta(tail, self._new_logprobs(s)))
        self.sched.finish(s)
        self.emit(s, Finished(self.result(s, reason, text=s.detok.text, logprobs=list(s.logprobs))))

    @staticmethod
    def _new_logprobs(s: Sequence) -> tuple:
        """The log-probabilities of the tokens since the previous TextDelta (held-back tokens'
        go with the delta that shows their text)."""
        new = tuple(s.logprobs[s.logprobs_sent :])
        s.logprobs_sent = len(s.logprobs)
        return new

    def release_adapter(self, s: Sequence) -> None:
        """Early adapter release: the next decode steps run `s` on the base path (its rows leave
        the LoRA segments; the KV cache computed with the adapter is kept) and its device slot is
        unpinned, free for other adapters."""
        s.released = True
        self.sched.release_adapter(s)
        log.debug("adapter_released", request_id=s.req.request_id, adapter=s.req.adapter, after_tokens=len(s.tokens))

    def answer_label(self, s: Sequence, hidden: torch.Tensor) -> None:
        """A LABEL request's answer: its task head over the last token's hidden state."""
        weights = self.pool.get(s.req.adapter)
        w, b = weights.heads[s.req.head]
        logits = hidden.float() @ w.float().to(self.device).t()
        if b is not None:
            logits = logits + b.float().to(self.device)
        probs = torch.softmax(logits, dim=-1).cpu()
        labels = weights.head_labels(s.req.head)
        order = torch.argsort(probs, descending=True).tolist()
        s.t_first = time.monotonic()
        scores = [(labels[i], float(probs[i])) for i in order]
        self.sched.finish(s)
        self.emit(s, Finished(self.result(s, FinishReason.LABEL, label=scores[0][0], scores=scores)))

    @staticmethod
    def result(s: Sequence, reason: FinishReason, **kw) -> GenerationResult:
        now = time.monotonic()
        t0 = s.prep.arrived
        return GenerationResult(
            request_id=s.req.request_id,
            token_ids=list(s.tokens),
            finish_reason=reason,
            image_tokens=s.prep.image_tokens,
            prompt_tokens=s.prep.prompt_tokens,
            output_tokens=len(s.tokens),
            queue_ms=(s.t_prefill - t0) * 1e3,
            first_token_ms=(s.t_first - t0) * 1e3,
            total_ms=(now - t0) * 1e3,
            mode=s.mode,
            adapter=s.req.adapter or "",
            token_times=list(s.token_times),
            released_after_tokens=s.release_watch.at if s.released else 0,
            **kw,
        )
