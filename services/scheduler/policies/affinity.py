"""The foundation policy (`affinity`): adapter affinity, then the least loaded worker."""

from __future__ import annotations

from collections.abc import Sequence

from services.common.modes import Mode
from services.scheduler.policies.base import (
    Assignment,
    Decision,
    ModeCommand,
    SchedulingPolicy,
    WaitingRequest,
    WorkerView,
)


def _affinity(worker: WorkerView, adapter: str | None) -> int:
    """0 = adapter merged there, 1 = resident on the device, 2 = must be loaded (or base model)."""
    if adapter is None:
        return 0 if worker.mode != Mode.MERGED else 1
    if worker.merged_adapter == adapter:
        return 0
    if adapter in worker.resident_adapters:
        return 1
    return 2


def _compatible(worker: WorkerView, adapter: str | None) -> bool:
    """A worker in MERGED mode runs only its merged adapter's requests."""
    return worker.mode != Mode.MERGED or adapter == worker.merged_adapter


class AffinityLeastLoadedPolicy(SchedulingPolicy):
    """Foundation policy: first come first served; each request goes to the healthy worker with
    a free slot that (1) already holds its adapter (merged, then resident), then (2) has the
    lowest load (running / max_batch_size), then (3) the lowest address (deterministic).

    A worker merged with another adapter is skipped; when that leaves a request nowhere to go
    but a merged worker has room, the worker is moved to MIXTURE mode (keeps its adapter merged
    at full speed, serves the others through the deLoRA term) and the request placed there.
    """

    def decide(self, now_s: float, waiting: Sequence[WaitingRequest], workers: Sequence[WorkerView]) -> Decision:
        decision = Decision()
        running = {w.address: w.running for w in workers}
        modes = {w.address: w.mode for w in workers}
        live = [w for w in workers if w.healthy and w.max_batch_size > 0]

        def free(w: WorkerView) -> int:
            return w.max_batch_size - running[w.address]

        for req in sorted(waiting, key=lambda r: (r.arrival_s, r.request_id)):
            if not any(free(w) > 0 for w in live):
                break
            candidates = [w for w in live if free(w) > 0 and w.address not in req.excluded_workers]
            fits = [w for w in candidates if modes[w.address] != Mode.MERGED or _compatible(w, req.adapter)]
            if not fits:
                # Only merged workers of other adapters have room: open one up to mixture mode.
                merged = [w for w in candidates if modes[w.address] == Mode.MERGED]
                if not merged:
                    continue
                target = min(merged, key=lambda w: (running[w.address] / w.max_batch_size, w.address))
                decision.mode_commands.append(ModeCommand(target.address, Mode.MIXTURE, target.merged_adapter))
                modes[target.address] = Mode.MIXTURE
                fits = [target]
            best = min(
                fits, key=lambda w: (_affinity(w, req.adapter), running[w.address] / w.max_batch_size, w.address)
            )
            running[best.address] += 1
            decision.assignments.append(Assignment(req.request_id, best.address))
        return decision
