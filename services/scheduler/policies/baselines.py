"""Unmerged-only baselines run by the same dispatcher and simulator as VaLoRA's policy.

- `SLoRAPolicy` (S-LoRA): every worker UNMERGED; first come first served; a request goes to a
  worker that already holds its adapter on the device, then to the least loaded one; adapters of
  requests that still wait are hinted for prefetch to the worker most likely to run them.
- `PunicaPolicy` (Punica): every worker UNMERGED; first come first served; a request goes to the
  busiest worker that still has room (Punica consolidates to keep batches large); no adapter
  affinity, no prefetch.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.scheduler.policies.base import (
    Assignment,
    Decision,
    ModeCommand,
    PrefetchHint,
    SchedulingPolicy,
    WaitingRequest,
    WorkerView,
    live_workers,
)
from services.common.modes import Mode


class UnmergedFCFSPolicy(SchedulingPolicy):
    """Unmerged mode on every worker, requests in arrival order; subclasses rank the workers."""

    prefetch = False

    def rank(self, worker: WorkerView, req: WaitingRequest, running: int) -> tuple:
        raise NotImplementedError

    def decide(self, now_s: float, waiting: Sequence[WaitingRequest], workers: Sequence[WorkerView]) -> Decision:
        decision = Decision()
        live = live_workers(workers)
        running = {w.address: w.running for w in live}
        for w in live:
            if w.mode in (Mode.MERGED, Mode.MIXTURE):
                decision.mode_commands.append(ModeCommand(w.address, Mode.UNMERGED))
        unplaced: list[WaitingRequest] = []
        for req in sorted(waiting, key=lambda r: (r.arrival_s, r.request_id)):
            fits = [w for w in live if running[w.address] < w.max_batch_size and w.address not in req.excluded_workers]
            if not fits:
                unplaced.append(req)
                if not any(running[w.address] < w.max_batch_size for w in live):
                    break
                continue
            best = min(fits, key=lambda w: self.rank(w, req, running[w.address]))
            running[best.address] += 1
            decision.assignments.append(Assignment(req.request_id, best.address))
        if self.prefetch:
            decision.prefetch = prefetch_hints(unplaced, live, running)
        return decision


class SLoRAPolicy(UnmergedFCFSPolicy):
    prefetch = True

    def rank(self, worker: WorkerView, req: WaitingRequest, running: int) -> tuple:
        resident = req.adapter is None or req.adapter in worker.resident_adapters
        return (0 if resident else 1, running / worker.max_batch_size, worker.address)


class PunicaPolicy(UnmergedFCFSPolicy):
    def rank(self, worker: WorkerView, req: WaitingRequest, running: int) -> tuple:
        return (-running, worker.address)


def prefetch_hints(
    unplaced: Sequence[WaitingRequest], live: Sequence[WorkerView], running: dict[str, int], per_worker: int = 1
) -> list[PrefetchHint]:
    """For the adapters of requests still waiting (most requested first) that no live worker holds
    on its device: copy each to the least loaded worker, at most `per_worker` per worker."""
    counts: dict[str, int] = {}
    for r in unplaced:
        if r.adapter is not None:
            counts[r.adapter] = counts.get(r.adapter, 0) + 1
    given: dict[str, int] = {}
    hints: list[PrefetchHint] = []
    for adapter in sorted(counts, key=lambda a: (-counts[a], a)):
        if any(adapter in w.resident_adapters for w in live):
            continue
        options = [w for w in live if given.get(w.address, 0) < per_worker]
        if not options:
            break
        target = min(options, key=lambda w: (running[w.address] / w.max_batch_size, w.address))
        given[target.address] = given.get(target.address, 0) + 1
        hints.append(PrefetchHint(target.address, adapter))
    return hints
