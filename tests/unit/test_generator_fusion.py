"""The greedy fusion algorithm against a trainer whose accuracies are scripted."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from services.generator.fusion import Source, greedy_fusion


@dataclass(frozen=True)
class FakeState:
    """An adapter state: the tasks it was trained on and a serial number (identity of weights)."""

    tasks: tuple[str, ...]
    serial: int


class ScriptedTrainer:
    """Accuracy of a task depends on the set of tasks its adapter holds: `script[frozenset]`
    gives {task: acc}; sets not scripted give every task `default`."""

    def __init__(self, script: dict[frozenset, dict[str, float]], default: float = 0.95):
        self.script, self.default = script, default
        self.calls: list[tuple] = []
        self._serial = 0

    def empty(self) -> FakeState:
        self._serial += 1
        self.calls.append(("empty",))
        return FakeState((), self._serial)

    def fuse(self, state: FakeState, tasks) -> FakeState:
        self._serial += 1
        self.calls.append(("fuse", state.tasks, tuple(tasks)))
        assert set(state.tasks) <= set(tasks), "fusion must train on the union of held and new tasks"
        return FakeState(tuple(tasks), self._serial)

    def validate(self, state: FakeState, tasks):
        self.calls.append(("validate", tuple(tasks)))
        acc = self.script.get(frozenset(state.tasks), {})
        return {t: acc.get(t, self.default) for t in tasks}


def _single(*names):
    return [Source.single(n) for n in names]


def test_everything_fits_in_one_adapter():
    tr = ScriptedTrainer({})
    res = greedy_fusion(_single("a", "b", "c"), {"a": 0.9, "b": 0.9, "c": 0.9}, tr)
    assert [a.tasks for a in res.adapters] == [["a", "b", "c"]]
    assert [s.decision for s in res.steps] == ["new_adapter", "accepted", "accepted"]
    assert res.adapters[0].meets_thresholds


def test_drop_below_threshold_rolls_back_seals_and_starts_new_adapter():
    # Adding c to {a, b} pushes a under its threshold -> roll back to {a, b}, new adapter for c.
    script = {frozenset("abc"): {"a": 0.70, "b": 0.95, "c": 0.95}}
    tr = ScriptedTrainer(script)
    res = greedy_fusion(_single("a", "b", "c", "d"), {t: 0.9 for t in "abcd"}, tr)
    assert [a.tasks for a in res.adapters] == [["a", "b"], ["c", "d"]]
    first = res.adapters[0]
    # Rolled back: the sealed adapter keeps the weights from before the failed fusion.
    assert first.state.tasks == ("a", "b")
    assert first.accuracy == {"a": 0.95, "b": 0.95}
    rollback = [s for s in res.steps if s.decision == "rolled_back"]
    assert len(rollback) == 1 and rollback[0].source == "c" and rollback[0].failing == ("a",)
    # The new adapter starts from an empty state with the current source only.
    assert ("fuse", (), ("c",)) in tr.calls


def test_new_task_failing_its_own_threshold_also_rolls_back():
    script = {frozenset("ab"): {"a": 0.95, "b": 0.80}, frozenset("b"): {"b": 0.93}}
    res = greedy_fusion(_single("a", "b"), {"a": 0.9, "b": 0.9}, ScriptedTrainer(script))
    assert [a.tasks for a in res.adapters] == [["a"], ["b"]]
    assert res.adapters[1].accuracy == {"b": 0.93}


def test_no_accepted_adapter_violates_a_threshold():
    # Random-ish script over many sets; whatever the packing, every adapter that says it meets
    # its thresholds has validated accuracies >= thresholds for all its tasks.
    import itertools
    import random

    rnd = random.Random(0)
    tasks = "abcdef"
    script = {}
    for k in range(1, len(tasks) + 1):
        for combo in itertools.combinations(tasks, k):
            script[frozenset(combo)] = {t: rnd.uniform(0.8, 1.0) for t in combo}
    thresholds = {t: 0.88 for t in tasks}
    res = greedy_fusion(_single(*tasks), thresholds, ScriptedTrainer(script))
    assert sorted(t for a in res.adapters for t in a.tasks) == sorted(tasks)
    for a in res.adapters:
        assert a.accuracy == {t: script[frozenset(a.tasks)][t] for t in a.tasks}
        if a.meets_thresholds:
            assert all(a.accuracy[t] >= thresholds[t] for t in a.tasks)
        else:
            assert len(a.tasks) == 1


def test_order_is_respected():
    tr = ScriptedTrainer({frozenset("cb"): {"b": 0.5}})
    res = greedy_fusion(_single("c", "b", "a"), {"a": 0.9, "b": 0.9, "c": 0.9}, tr)
    assert [a.tasks for a in res.adapters] == [["c"], ["b", "a"]]
    fused = [c for c in tr.calls if c[0] == "fuse"]
    assert [c[2] for c in fused] == [("c",), ("c", "b"), ("b",), ("b", "a")]
    assert [s.source for s in res.steps] == ["c", "b", "b", "a"]


def test_task_failing_alone_gets_its_own_adapter_marked_and_shares_nothing():
    script = {frozenset("ab"): {"b": 0.5}, frozenset("b"): {"b": 0.5}}
    tr = ScriptedTrainer(script)
    res = greedy_fusion(_single("a", "b", "c"), {t: 0.9 for t in "abc"}, tr)
    assert [a.tasks for a in res.adapters] == [["a"], ["b"], ["c"]]
    assert [a.meets_thresholds for a in res.adapters] == [True, False, True]
    # Nothing was ever fused into the failing adapter.
    assert ("fuse", ("b",), ("b", "c")) not in tr.calls


def test_multi_task_sources_fuse_as_a_unit():
    srcs = [Source("digits", ("digit", "parity")), Source("counting", ("count",))]
    script = {frozenset({"digit", "parity", "count"}): {"parity": 0.5}}
    res = greedy_fusion(srcs, {"digit": 0.9, "parity": 0.9, "count": 0.9}, ScriptedTrainer(script))
    assert [a.sources for a in res.adapters] == [["digits"], ["counting"]]
    assert res.adapter_of("parity").index == 0 and res.adapter_of("count").index == 1


def test_duplicate_tasks_are_rejected():
    with pytest.raises(ValueError):
        greedy_fusion([Source("x", ("a",)), Source("y", ("a",))], {}, ScriptedTrainer({}))


def test_missing_threshold_means_zero():
    res = greedy_fusion(_single("a", "b"), {}, ScriptedTrainer({}, default=0.01))
    assert [a.tasks for a in res.adapters] == [["a", "b"]]
