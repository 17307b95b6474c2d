"""Which sequences run in each engine step: the queues, admission, the prefill budget, KV growth
and preemption.

A request moves incoming (submitted, under the engine's lock) -> waiting (queued on the engine
thread) -> prefill (admitted: holds its adapter's device slot and its context's KV blocks) ->
running (decoding), and leaves through `finish`. Admission is FIFO within max_batch_size —
earliest due first when requests carry what is left of a latency objective (`earliest_due_first`:
the late ones last; the valora policy's workers), and so is the prefill queue's order — except
that a request whose adapter finds no free device slot (every slot held by running requests) lets
the ones behind it in and keeps its place; a request whose context finds too few free KV blocks
stops admission (the blocks running sequences free go to it first); resident adapters no
running request holds give their blocks back first (they live in the same pool). A step prefills
pieces of contexts within max_prefill_tokens tokens in all: whole contexts, and the next chunk
of one that does not fit (chunked prefill), packed into one forward. Before a decode step every running sequence
gets room for its next token, oldest first; when the pool runs out an idle adapter is evicted,
and when none is left the youngest sequence is preempted
(its blocks freed; it waits at the head of the queue to be prefilled again over its prompt and
generated tokens).
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Callable

import structlog

from services.common.errors import ValoraError
from services.worker.adapter_pool import AdapterPool
from services.worker.kv_cache import BlockManager, OutOfBlocks
from services.worker.sequence import Sequence

log = structlog.get_logger()
MIN_CHUNK = 256  # tokens (at most a quarter of the budget): a shorter chunk behind other pieces waits


class StepScheduler:
    def __init__(
        self,
        config,
        kv: BlockManager,
        pool: AdapterPool,
        lock: threading.Condition,
        padded: Callable[[int], int] | None = None,
    ) -> None:
        """`config`: the engine's EngineConfig (max_batch_size, max_prefills_per_step,
        max_prefill_tokens, prefill_fill_padding, read when used); `lock`: the engine's condition
        guarding `incoming` and `waiting` (submit runs on other threads); everything else is the
        engine thread's. `padded`: the tokens a prefill forward of n tokens runs (ModelRunner.
        prefill_tokens: its graph bucket)."""
        self.config, self.kv, self.pool, self.lock, self.padded = config, kv, pool, lock, padded
        self.incoming: collections.deque[Sequence] = collections.deque()
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.prefill: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.preemptions = 0  # sequences whose blocks were taken back (recomputed later)

    def queued(self) -> int:
        with self.lock:
            return len(self.incoming) + len(self.waiting)

    def active(self) -> list[Sequence]:
        """Admitted sequences: prefilling, then running."""
        return [*self.prefill, *self.running]

    def take_everyone(self) -> list[Sequence]:
        """Every sequence, out of the queues (the engine stops)."""
        with self.lock:
            everyone = [*self.incoming, *self.waiting, *self.prefill, *self.running]
            self.incoming.clear()
            self.waiting.clear()
            self.prefill.clear()
        self.running = []
        return everyone

    # -- admission ---------------------------------------------------------------------------
    def admit(
        self,
        halted: Callable[[Sequence], bool],
        fail: Callable[[Sequence, ValoraError | None], None],
        now: float,
        take_incoming: bool = True,
    ) -> None:
        """Queues the submitted requests (`take_incoming`; tensor parallel: the engine's broadcast
        queued them), drops the waiting ones `halted` says stopped (`fail(s, None)`: the engine
        says why) and admits what fits. `now`: the step's time (Inbox.step_time), which orders
        requests by their objectives."""
        with self.lock:
            if take_incoming:
                self.waiting.extend(self.incoming)
                self.incoming.clear()
            kept: collections.deque[Sequence] = collections.deque()
            for s in self.waiting:
                if halted(s):
                    fail(s, None)
                else:
                    kept.append(s)
            # the preempted (at the head) first, to be recomputed
            self.waiting = earliest_due_first(kept, lambda s: s.preemptions > 0 and s.prefilled == 0, now)
        blocked: collections.deque[Sequence] = collections.deque()
        while self.waiting and len(self.prefill) + len(self.running) < self.config.max_batch_size:
            seq = self.waiting[0]
            # the adapter first: an upload takes its memory from the same pool as the KV blocks
            if seq.req.adapter and not seq.released and not seq.pinned:
                try:
                    slot = self.pool.acquire(seq.req.adapter)
                except ValoraError as exc:  # offloaded while it waited
                    fail(self.waiting.popleft(), exc)
                    continue
                if slot is None:
                    blocked.append(self.waiting.popleft())
                    continue
                seq.pinned = seq.req.adapter
            # every prefill reads its keys and values back from its blocks (a LABEL request's are
            # freed with its answer, right after its prefill)
            if not (self.room(self.kv.blocks_for(seq.context)) and self.kv.open(seq.id, seq.context)):
                self.release_adapter(seq)  # resident still, but evictable while it waits
                break
            self.prefill.append(self.waiting.popleft())
        blocked.extend(self.waiting)
        self.waiting = blocked

    # -- prefill -----------------------------------------------------------------------------
    def take_prefills(self, now: float) -> list[Sequence]:
        """This step's prefill pieces, FIFO over the prefill queue (earliest due first at `now`
        when requests carry objectives: `earliest_due_first`): at most max_prefills_per_step
        sequences and max_prefill_tokens tokens in all, each sequence's `prefill_to` set to where
        its piece ends — the rest of its context, or as much as the budget has left (a chunk: the
        batch ends with it, and its next chunk leads the next step's batch, beside the requests
        behind it that fit). A chunk shorter than MIN_CHUNK (or a quarter of the budget) behind
        other pieces waits for the next step. Sequences stay in the queue until prefilled
        (StepScheduler.prefilled)."""
        self.prefill = earliest_due_first(self.prefill, lambda s: s.prefilled > 0, now)  # a chunk leads
        batch: list[Sequence] = []
        left = self.config.max_prefill_tokens
        for s in self.prefill:
            if len(batch) == self.config.max_prefills_per_step or left <= 0:
                break
            rest = s.context - s.prefilled
            if rest > left and batch and left < min(MIN_CHUNK, self.config.max_prefill_tokens // 4):
                break
            s.prefill_to = s.prefilled + min(rest, left)
            left -= s.prefill_to - s.prefilled
            batch.append(s)
            if s.prefill_to < s.context:
                break  # a chunk ends the batch (FIFO: nobody overtakes it)
        if self.config.prefill_fill_padding and self.padded is not None:
            self._fill_padding(batch)
        return batch

    def _fill_padding(self, batch: list[Sequence]) -> None:
        """Pieces of the next queued sequences into the tokens the forward would pad to its graph
        bucket anyway (a 2060-token step pads to 2304): at most the bucket, max_prefills_per_step
        rows, FIFO (the last one taken may be a chunk, which ends the batch as above)."""
        if not batch or batch[-1].prefill_to < batch[-1].context:
            return
        total = sum(s.prefill_to - s.prefilled for s in batch)
        if self.config.mixed_steps:
            total += len(self.running)  # the running rows ride in the forward, a token each (mixed_step.py)
        room = self.padded(total) - total
        for s in itertools.islice(self.prefill, len(batch), None):
            if room <= 0 or len(batch) == self.config.max_prefills_per_step:
                break
            s.prefill_to = s.prefilled + min(s.context - s.prefilled, room)
            room -= s.prefill_to - s.prefilled
            batch.append(s)
            if s.prefill_to < s.context:
                break

    def prefilled(self, s: Sequence) -> None:
        """`s` was prefilled (its whole context): it decodes from the next step on."""
        self.prefill.remove(s)
        self.running.append(s)

    # -- decode ------------------------------------------------------------------------------
    def reserve_decode(self) -> None:
        """Gives every running sequence room for its next token, oldest first; when the pool runs
        out (idle adapters evicted first), preempts the youngest running sequence (it may be the
        one asking) and goes on."""
        for s in sorted(self.running, key=lambda x: x.id):
            while s in self.running and not self._grow(s):
                self.preempt(max(self.running, key=lambda x: x.id))

    def can_grow(self, rows: list[Sequence]) -> bool:
        """Gives `rows` room for their next token if the pool has it (no preemption)."""
        return all(self._grow(s) for s in rows)

    def _grow(self, s: Sequence) -> bool:
        """Room for `s`'s next token, evicting idle resident adapters while the pool has none."""
        while True:
            try:
                self.kv.grow(s.id, s.length + 1)
                return True
            except OutOfBlocks:
                if not self.pool.evict_idle():
                    return False

    def room(self, blocks: int) -> bool:
        """Whether `blocks` blocks are free, evicting idle resident adapters (their blocks are
        the KV pool's) until they are; False when even that leaves too few."""
        while self.kv.free_blocks < blocks:
            if not self.pool.evict_idle():
                return False
        return True

    def preempt(self, s: Sequence) -> None:
        """Takes `s`'s blocks back: it waits at the head of the queue, to be prefilled again over
        its prompt and generated tokens (no decode step is pending: the caller flushed it)."""
        self.running.remove(s)
        self.release_adapter(s)
        self.kv.close(s.id)
        s.length = s.prefilled = 0
        s.preemptions += 1
        self.preemptions += 1
        with self.lock:
            self.waiting.appendleft(s)
        log.info(
            "sequence_preempted", request_id=s.req.request_id, tokens=len(s.tokens), free_blocks=self.kv.free_blocks
        )

    # -- leaving -----------------------------------------------------------------------------
    def finish(self, s: Sequence) -> None:
        """Removes `s` from the queues and frees its blocks and adapter hold."""
        if s in self.prefill:
            self.prefill.remove(s)
        if s in self.running:
            self.running.remove(s)
        s.finished = True
        self.release_adapter(s)
        self.kv.close(s.id)

    def release_adapter(self, s: Sequence) -> None:
        """Unpins the adapter slot `s` holds, if any."""
        if s.pinned:
            self.pool.release(s.pinned)
            s.pinned = None


def earliest_due_first(
    queue: collections.deque[Sequence], ahead: Callable[[Sequence], bool], now: float
) -> collections.deque[Sequence]:
    """`queue` earliest due first (PreparedRequest.due) among the requests that can still meet
    their objective, then the late ones oldest due first — the sequences `ahead` picks before all
    — when some request in it has a latency objective; else as it is (first come, first served:
    no request has one, or the scheduler's policy does not order workers). The late go last as the
    scheduler's starving requests do (credits.claims_deadline): under overload plain EDF serves
    requests that are late anyway and makes every one behind them late too."""
    if not any(s.req.slo_left_s is not None for s in queue):
        return queue
    return collections.deque(sorted(queue, key=lambda s: (not ahead(s), s.prep.due <= now, s.prep.due)))
