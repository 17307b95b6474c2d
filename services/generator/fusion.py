"""Accuracy-aware knowledge fusion (VaLoRA §4.2.1): greedy constrained bin packing of task
knowledge into as few LoRA adapters as the accuracy thresholds allow.

Sources (datasets of one or more tasks) are taken in the given order. Each is fused into the
current adapter: a copy of it is trained on the union of the tasks it already holds and the
source's tasks, then every task it would hold is validated on held-out data. If all meet their
thresholds the fused copy becomes the current adapter; otherwise the fusion is rolled back (the
pre-fusion adapter is kept unchanged), that adapter is sealed, and a new, empty adapter is
started with the current source. A source that misses a threshold even in a fresh adapter of its
own still gets that adapter (nothing better exists), marked `meets_thresholds=False`.

Which order (the paper's open problem): greedy packing keeps each adapter a run of consecutive
sources, so an order that puts mutually compatible sources next to each other, the largest such
group first, and a source that conflicts with many others last, packs into fewer adapters.
`probe_interference` measures pairwise interference cheaply: every source trained alone and
every pair of sources trained together, by a trainer with a small budget (a few batches per
task), each task's validation accuracy recorded. `planned_adapters` plans adapters from that
matrix (its docstring gives the rule) and `probed_order` puts them one after another;
`greedy_fusion` then packs that order, validating every fusion for real as before, so a wrong
prediction costs adapters, never a threshold.

The algorithms are pure: all training and measuring goes through a `Trainer`, so they are tested
with a scripted fake trainer and run for real with `training.TorchTrainer`.
"""

from __future__ import annotations

import itertools
import time
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


FUSION_ORDERS = ("given", "probed")  # the sources' order as given, or `probed_order`'s
# A probe's default budget (TorchTrainer): PROBE_EPOCHS epochs of at most PROBE_BATCHES batches per task.
PROBE_EPOCHS, PROBE_BATCHES = 2, 8
# `planned_adapters`' rule in a sentence, for the reports that show an order it chose.
PROBED_RULE = (
    "predicted margin = accuracy alone - drops with the adapter's other tasks - threshold; each "
    "adapter is seeded with the task that fits (margin >= 0) beside the most unplaced others, then "
    "grows by the task keeping the largest minimum margin while one fits"
)


@dataclass
class Interference:
    """What the probes measured (validation accuracy at the probe budget): `alone[s][t]`, task t of
    source s trained in an adapter of its own; `paired[a][b][t]`, task t of source a trained in one
    adapter with source b (one training per pair gives both directions). `seconds`: the probes'
    wall time; `trainings`: how many adapters they trained."""

    sources: tuple[str, ...]
    alone: dict[str, dict[str, float]]
    paired: dict[str, dict[str, dict[str, float]]]
    seconds: float = 0.0
    trainings: int = 0

    def drop(self, source: str, partner: str) -> dict[str, float]:
        """How much each task of `source` loses when trained with `partner` (negative: gains)."""
        return {t: a - self.paired[source][partner][t] for t, a in self.alone[source].items()}

    def pairs(self) -> list[dict]:
        """One entry per probed pair, in the sources' pair order: {"sources": [a, b], "accuracy":
        {task: accuracy in the pair's adapter}, "drop": {task: accuracy alone less that}}, over
        both sources' tasks."""
        out = []
        for a, b in itertools.combinations(self.sources, 2):
            acc = {**self.paired[a][b], **self.paired[b][a]}
            drop = {**self.drop(a, b), **self.drop(b, a)}
            out.append({"sources": [a, b], "accuracy": _rounded(acc), "drop": _rounded(drop)})
        return out

    def to_json(self) -> dict:
        return {
            "sources": list(self.sources),
            "alone": {s: _rounded(acc) for s, acc in self.alone.items()},
            "paired": {a: {b: _rounded(acc) for b, acc in row.items()} for a, row in self.paired.items()},
            "seconds": round(self.seconds, 1),
            "trainings": self.trainings,
        }


def _rounded(accuracy: Mapping[str, float]) -> dict[str, float]:
    return {t: round(v, 4) for t, v in accuracy.items()}


def probe_interference(
    sources: Sequence[Source],
    trainer: Trainer[StateT],
    on_probe: Callable[[tuple[str, ...], Mapping[str, float]], None] | None = None,
) -> Interference:
    """Trains every source alone and every pair of sources together in fresh adapters with
    `trainer` (give it a small budget: n + n(n-1)/2 trainings) and validates each of their tasks.
    `on_probe(source names, accuracies)` after each training."""
    started = time.perf_counter()
    alone: dict[str, dict[str, float]] = {}
    paired: dict[str, dict[str, dict[str, float]]] = {s.name: {} for s in sources}
    trainings = 0

    def probe(group: Sequence[Source]) -> dict[str, float]:
        nonlocal trainings
        tasks = [t for s in group for t in s.tasks]
        acc = dict(trainer.validate(trainer.fuse(trainer.empty(), tasks), tasks))
        trainings += 1
        if on_probe is not None:
            on_probe(tuple(s.name for s in group), acc)
        return acc

    for s in sources:
        alone[s.name] = probe([s])
    for a, b in itertools.combinations(sources, 2):
        acc = probe([a, b])
        paired[a.name][b.name] = {t: acc[t] for t in a.tasks}
        paired[b.name][a.name] = {t: acc[t] for t in b.tasks}
    return Interference(tuple(s.name for s in sources), alone, paired, time.perf_counter() - started, trainings)


def predicted_margins(
    group: Sequence[Source], thresholds: Mapping[str, float], interference: Interference
) -> dict[str, float]:
    """Each task's predicted margin over its threshold in one adapter holding `group`: its probe
    accuracy alone, less its drop with each other source of the group (drops add; a gain counts
    as no drop), less its threshold. At the probe's budget a task that learns slowly is still
    below its threshold alone: predicted to fail, it is planned last (`probed_order`), where a
    task that needs an adapter of its own breaks no group."""
    out = {}
    for s in group:
        for t, acc in interference.alone[s.name].items():
            for other in group:
                if other.name != s.name:
                    acc -= max(0.0, interference.drop(s.name, other.name)[t])
            out[t] = acc - thresholds.get(t, 0.0)
    return out


def probed_order(
    sources: Sequence[Source], thresholds: Mapping[str, float], interference: Interference
) -> list[Source]:
    """An order for `greedy_fusion` from the probes: `planned_adapters`, one after another."""
    return [s for group in planned_adapters(sources, thresholds, interference) for s in group]


def planned_adapters(
    sources: Sequence[Source], thresholds: Mapping[str, float], interference: Interference
) -> list[list[Source]]:
    """The adapters the probes predict, in the order `probed_order` puts them.

    A planned adapter is feasible when every task's predicted margin (`predicted_margins`) is >= 0.
    Each is seeded with the source that fits (a feasible pair) with the most sources still
    unplaced, so a source that conflicts with many waits, and one predicted to miss its threshold
    even alone comes last; then, while some unplaced source keeps it feasible, the one leaving the
    largest minimum margin joins it. Ties go to the larger own margin, then to the given order:
    the order is a function of the probe matrix, the thresholds and the given order."""
    index = {s.name: i for i, s in enumerate(sources)}

    def min_margin(group: Sequence[Source]) -> float:
        return min(predicted_margins(group, thresholds, interference).values())

    def fits(group: Sequence[Source]) -> bool:
        return min_margin(group) >= 0.0

    remaining = list(sources)
    planned: list[list[Source]] = []
    while remaining:
        seed = max(
            remaining,
            key=lambda s: (sum(fits([s, o]) for o in remaining if o is not s), min_margin([s]), -index[s.name]),
        )
        group = [seed]
        remaining.remove(seed)
        while True:
            candidates = [c for c in remaining if fits(group + [c])]
            if not candidates:
                break
            best = max(candidates, key=lambda c: (min_margin(group + [c]), -index[c.name]))
            group.append(best)
            remaining.remove(best)
        planned.append(group)
    return planned
