"""What a policy sees and decides: the request and worker views, the `Decision` it returns, the
`SchedulingPolicy` interface, and helpers the policies share. Plain dataclasses, no protobuf, no
I/O, no clocks (the caller passes `now_s`)."""

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
    # Whether workers learn what is left of each request's latency objective (WorkItem.slo_left_ms)
    # and so admit and prefill the earliest due first; False: they serve first come, first served
    # (as S-LoRA's, Punica's and dLoRA's engines do).
    orders_workers: bool = False

    @abstractmethod
    def decide(self, now_s: float, waiting: Sequence[WaitingRequest], workers: Sequence[WorkerView]) -> Decision:
        """Place some of `waiting` (any order given) on `workers`. Unplaced requests stay queued."""


def live_workers(workers: Sequence[WorkerView]) -> list[WorkerView]:
    """Workers that can take requests now: healthy, with a known capacity."""
    return [w for w in workers if w.healthy and w.max_batch_size > 0]


def merged_of(worker: WorkerView) -> str | None:
    """The adapter folded into the worker's base weights (None when nothing is)."""
    return worker.merged_adapter if worker.mode in (Mode.MERGED, Mode.MIXTURE) else None
