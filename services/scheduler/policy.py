"""Placement policies: which waiting request runs on which worker, and in which mode.

The dispatcher (services/scheduler/dispatcher.py) calls `SchedulingPolicy.decide` whenever the
queue or a worker changes; the simulator (services/scheduler/sim.py) calls the same code. Policies
are pure: plain dataclasses in, a `Decision` out, no protobuf, no I/O, no clocks (the caller
passes `now_s`).

Policies (registry `POLICIES`, chosen by the `policy` setting, env VALORA_POLICY):

- `valora` (default) — paper Alg. 1, `CreditPolicy(mixture=True)`: credits = waiting time +
  estimated execution time (services/scheduler/credits.py, cost_model.py). Per worker and round:
  no starving request → MERGED on the adapter that minimizes the mean latency of the worker's
  requests counting the switch cost; some starving (credit > θ) → MIXTURE (the merged adapter
  stays, starving requests run through the deLoRA term); more than half of max batch starving →
  UNMERGED. Requests with a latency objective (per-application SLO classes) are taken earliest
  deadline first and starve earlier (half their objective), which is what moves a worker to
  mixture for them.
- `dlora` — `CreditPolicy(mixture=False)`: the same credits and merged choice, but starvation
  switches to UNMERGED (dLoRA's merge/unmerge switching, no mixture).
- `slora` — UNMERGED only, first come first served, adapter affinity (resident first) then least
  loaded, prefetch hints for adapters not resident.
- `punica` — UNMERGED only, first come first served, consolidating placement (the busiest worker
  with room, Punica's scheduler), no affinity, no prefetch.
- `affinity` — the foundation policy (`AffinityLeastLoadedPolicy`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from services.common.modes import Mode



@dataclass(frozen=True)
class WaitingRequest:
    """A queued request as the policy sees it."""

    request_id: str
    arrival_s: float
    # Adapter version name ("adapters/a/versions/1"); None = base model.
    adapter: str | None = None
    # Workers this request already failed on (never placed there again).
    excluded_workers: frozenset[str] = frozenset()
    # Inputs of an execution-time estimate (the credit policy needs one).
    max_new_tokens: int = 0
    images: int = 0
    # A task-head request: one forward pass, no decoding.
    label: bool = False
    # Prompt tokens when known (0: the cost model's default); images add their own tokens.
    prompt_tokens: int = 0
    # Latency objective in seconds (its task's slo_ms; 0 = none): see credits.due_s/threshold_s.
    slo_s: float = 0.0


@dataclass(frozen=True)
class WorkerView:
    """One worker's state at decision time."""

    address: str
    healthy: bool
    # Requests the worker can run at once; the policy never exceeds it.
    max_batch_size: int
    # Requests running on it now (dispatched and not finished).
    running: int
    mode: Mode = Mode.UNKNOWN
    merged_adapter: str | None = None
    resident_adapters: frozenset[str] = frozenset()
    # Running requests per adapter (None = base model) when the caller knows them.
    running_adapters: Mapping[str | None, int] = field(default_factory=dict)
    # What the worker reports as its device ("cuda:0", "cpu"): picks the cost profile.
    device: str = ""

    @property
    def free_slots(self) -> int:
        return max(0, self.max_batch_size - self.running)


@dataclass(frozen=True)
class Assignment:
    request_id: str
    worker: str


@dataclass(frozen=True)
class ModeCommand:
    """Put `worker` into `mode`; `merged_adapter` for MERGED and MIXTURE."""

    worker: str
    mode: Mode
    merged_adapter: str | None = None


@dataclass(frozen=True)
class PrefetchHint:
    """Copy `adapter` to `worker`'s device ahead of need (LoadAdapter with to_device)."""

    worker: str
    adapter: str


@dataclass
class Decision:
    """Assignments in dispatch order; mode commands are sent before those assignments run;
    prefetch hints are best effort and never delay anything."""

    assignments: list[Assignment] = field(default_factory=list)
    mode_commands: list[ModeCommand] = field(default_factory=list)
    prefetch: list[PrefetchHint] = field(default_factory=list)


class SchedulingPolicy(ABC):
    @abstractmethod
    def decide(self, now_s: float, waiting: Sequence[WaitingRequest], workers: Sequence[WorkerView]) -> Decision:
        """Place some of `waiting` (any order given) on `workers`. Unplaced requests stay queued."""


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
            best = min(fits, key=lambda w: (_affinity(w, req.adapter), running[w.address] / w.max_batch_size,
                                            w.address))
            running[best.address] += 1
            decision.assignments.append(Assignment(req.request_id, best.address))
        return decision


def live_workers(workers: Sequence[WorkerView]) -> list[WorkerView]:
    """Workers that can take requests now: healthy, with a known capacity."""
    return [w for w in workers if w.healthy and w.max_batch_size > 0]


def merged_of(worker: WorkerView) -> str | None:
    """The adapter folded into the worker's base weights (None when nothing is)."""
    return worker.merged_adapter if worker.mode in (Mode.MERGED, Mode.MIXTURE) else None
