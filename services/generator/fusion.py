"""Accuracy-aware knowledge fusion (VaLoRA §4.2.1): greedy constrained bin packing of task
knowledge into as few LoRA adapters as the accuracy thresholds allow.

Sources (datasets of one or more tasks) are taken in the given order. Each is fused into the
current adapter: a copy of it is trained on the union of the tasks it already holds and the
source's tasks, then every task it would hold is validated on held-out data. If all meet their
thresholds the fused copy becomes the current adapter; otherwise the fusion is rolled back (the
pre-fusion adapter is kept unchanged), that adapter is sealed, and a new, empty adapter is
started with the current source. A source that misses a threshold even in a fresh adapter of its
own still gets that adapter (nothing better exists), marked `meets_thresholds=False`.

The algorithm is pure: all training and measuring goes through a `Trainer`, so it is tested
with a scripted fake trainer and run for real with `training.TorchTrainer`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Generic, Mapping, Protocol, Sequence, TypeVar

StateT = TypeVar("StateT")


class Trainer(Protocol[StateT]):
    """What fusion needs from training. States are values: `fuse` must not modify its input."""

    def empty(self) -> StateT:
        """A new adapter that holds no task."""
        ...

    def fuse(self, state: StateT, tasks: Sequence[str]) -> StateT:
        """A copy of `state` trained on the union of `tasks` (the held ones plus the new ones)."""
        ...

    def validate(self, state: StateT, tasks: Sequence[str]) -> Mapping[str, float]:
        """Held-out accuracy in [0, 1] of each of `tasks` under `state`."""
        ...


@dataclass(frozen=True)
class Source:
    """One unit of external knowledge: a dataset covering one or more tasks."""

    name: str
    tasks: tuple[str, ...]

    @classmethod
    def single(cls, task: str) -> "Source":
        return cls(task, (task,))


@dataclass
class FusedAdapter(Generic[StateT]):
    """A sealed adapter: its tasks in fusion order, weights, and validation accuracies."""

    index: int
    sources: list[str]
    tasks: list[str]
    state: StateT
    accuracy: dict[str, float]
    meets_thresholds: bool = True


@dataclass(frozen=True)
class FusionStep:
    """One attempt to fuse a source: where, what was measured, and what was decided."""

    source: str
    adapter_index: int
    accuracy: dict[str, float]
    decision: str  # "accepted" | "rolled_back" | "new_adapter" | "below_threshold_alone"
    failing: tuple[str, ...] = ()


@dataclass
class FusionResult(Generic[StateT]):
    adapters: list[FusedAdapter[StateT]]
    steps: list[FusionStep] = field(default_factory=list)

    def adapter_of(self, task: str) -> FusedAdapter[StateT]:
        for a in self.adapters:
            if task in a.tasks:
                return a
        raise KeyError(task)


def _failing(accuracy: Mapping[str, float], thresholds: Mapping[str, float], tasks: Sequence[str]) -> tuple[str, ...]:
    return tuple(t for t in tasks if accuracy[t] < thresholds.get(t, 0.0))


def greedy_fusion(
    sources: Sequence[Source],
    thresholds: Mapping[str, float],
    trainer: Trainer[StateT],
    on_step: Callable[[FusionStep], None] | None = None,
) -> FusionResult[StateT]:
    """Pack `sources` (in order) into adapters so every task meets `thresholds[task]` (0 when
    absent) on the trainer's validation data; returns the sealed adapters and the decision log."""
    seen: set[str] = set()
    for s in sources:
        if not s.tasks:
            raise ValueError(f"source {s.name!r} has no tasks")
        dup = seen.intersection(s.tasks)
        if dup:
            raise ValueError(f"tasks {sorted(dup)} appear in more than one source")
        seen.update(s.tasks)

    result: FusionResult[StateT] = FusionResult(adapters=[])
    current: FusedAdapter[StateT] | None = None

    def log(step: FusionStep) -> None:
        result.steps.append(step)
        if on_step is not None:
            on_step(step)

    def start(source: Source) -> FusedAdapter[StateT]:
        index = len(result.adapters)
        tasks = list(source.tasks)
        state = trainer.fuse(trainer.empty(), tasks)
        acc = dict(trainer.validate(state, tasks))
        failing = _failing(acc, thresholds, tasks)
        log(FusionStep(source.name, index, acc, "below_threshold_alone" if failing else "new_adapter", failing))
        return FusedAdapter(index, [source.name], tasks, state, acc, meets_thresholds=not failing)

    for source in sources:
        if current is None:
            current = start(source)
            continue
        if not current.meets_thresholds:  # a task that fails alone shares its adapter with nothing
            result.adapters.append(current)
            current = start(source)
            continue
        tasks = current.tasks + list(source.tasks)
        candidate = trainer.fuse(current.state, tasks)
        acc = dict(trainer.validate(candidate, tasks))
        failing = _failing(acc, thresholds, tasks)
        if not failing:
            current = FusedAdapter(current.index, current.sources + [source.name], tasks, candidate, acc)
            log(FusionStep(source.name, current.index, acc, "accepted"))
            continue
        # Roll back: `current` still holds the pre-fusion weights; seal it and start afresh.
        log(FusionStep(source.name, current.index, acc, "rolled_back", failing))
        result.adapters.append(current)
        current = start(source)
    if current is not None:
        result.adapters.append(current)
    return result
