"""The greedy fusion algorithm and the probed fusion order against a trainer whose accuracies are
scripted."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from services.generator.fusion import Source, greedy_fusion, predicted_margins, probe_interference, probed_order


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


# -- the probed order ----------------------------------------------------------------------------


def _hurts_everyone(bad: str, tasks: str, hit: float = 0.8) -> dict[frozenset, dict[str, float]]:
    """A script where any adapter holding `bad` and another task drops the other task to `hit`."""
    import itertools

    script = {}
    for k in range(2, len(tasks) + 1):
        for combo in itertools.combinations(tasks, k):
            if bad in combo:
                script[frozenset(combo)] = {t: hit for t in combo if t != bad}
    return script


def test_probes_train_each_source_alone_and_each_pair_from_empty_adapters():
    tr = ScriptedTrainer({frozenset("ab"): {"a": 0.90, "b": 0.85}})
    inter = probe_interference(_single("a", "b", "c"), tr)
    fused = [c for c in tr.calls if c[0] == "fuse"]
    assert [c[1:] for c in fused] == [((), ("a",)), ((), ("b",)), ((), ("c",))] + [
        ((), p) for p in (("a", "b"), ("a", "c"), ("b", "c"))
    ]
    assert inter.trainings == 6 and inter.sources == ("a", "b", "c")
    assert inter.alone == {"a": {"a": 0.95}, "b": {"b": 0.95}, "c": {"c": 0.95}}
    assert inter.paired["a"]["b"] == {"a": 0.90} and inter.paired["b"]["a"] == {"b": 0.85}
    assert inter.drop("b", "a") == pytest.approx({"b": 0.10}) and inter.drop("a", "c") == {"a": 0.0}


def test_probes_of_multi_task_sources_keep_each_sources_tasks():
    srcs = [Source("digits", ("digit", "parity")), Source("counting", ("count",))]
    script = {frozenset({"digit", "parity", "count"}): {"parity": 0.6}}
    inter = probe_interference(srcs, ScriptedTrainer(script))
    assert inter.paired["digits"]["counting"] == {"digit": 0.95, "parity": 0.6}
    assert inter.paired["counting"]["digits"] == {"count": 0.95}
    assert predicted_margins(srcs, {"parity": 0.9}, inter) == pytest.approx(
        {"digit": 0.95, "parity": 0.6 - 0.9, "count": 0.95}
    )


def test_predicted_margins_add_drops_and_ignore_gains():
    script = {
        frozenset("ab"): {"a": 0.93},  # b costs a 0.02
        frozenset("ac"): {"a": 0.92, "c": 0.99},  # c costs a 0.03; a helps c
    }
    inter = probe_interference(_single("a", "b", "c"), ScriptedTrainer(script))
    margins = predicted_margins(_single("a", "b", "c"), {"a": 0.9, "c": 0.9}, inter)
    assert margins == pytest.approx({"a": 0.95 - 0.02 - 0.03 - 0.9, "b": 0.95, "c": 0.95 - 0.9})


def test_probed_order_needs_fewer_adapters_than_the_given_order():
    # x hurts whichever task shares its adapter; the given order puts it second, so greedy packing
    # seals {a}, then {x}, then fuses {b, c}: 3 adapters. The probes see it: x goes last, 2 adapters.
    script = _hurts_everyone("x", "abcx")
    thresholds = {t: 0.9 for t in "abcx"}
    given = _single("a", "x", "b", "c")
    res = greedy_fusion(given, thresholds, ScriptedTrainer(script))
    assert [a.tasks for a in res.adapters] == [["a"], ["x"], ["b", "c"]]

    probe = ScriptedTrainer(script)
    order = probed_order(given, thresholds, probe_interference(given, probe))
    assert [s.name for s in order] == ["a", "b", "c", "x"]
    res = greedy_fusion(order, thresholds, ScriptedTrainer(script))
    assert [a.tasks for a in res.adapters] == [["a", "b", "c"], ["x"]]
    assert all(a.meets_thresholds for a in res.adapters)


def test_probed_order_groups_compatible_sources_and_puts_a_failing_one_last():
    # Two cliques: {a, b} and {c, d} (a pair across them drops both tasks under 0.9); f misses its
    # threshold even alone. Given interleaved, greedy packing needs 5 adapters; probed, 3.
    import itertools

    script = {}
    for k in range(1, 6):
        for combo in map(frozenset, itertools.combinations("abcdf", k)):
            across = bool(combo & set("ab")) and bool(combo & set("cd"))
            script[combo] = {t: 0.5 if t == "f" else 0.85 if across else 0.95 for t in combo}
    thresholds = {t: 0.9 for t in "abcdf"}
    given = _single("a", "c", "f", "b", "d")
    assert len(greedy_fusion(given, thresholds, ScriptedTrainer(script)).adapters) == 5
    order = probed_order(given, thresholds, probe_interference(given, ScriptedTrainer(script)))
    assert [s.name for s in order] == ["a", "b", "c", "d", "f"]
    res = greedy_fusion(order, thresholds, ScriptedTrainer(script))
    assert [a.tasks for a in res.adapters] == [["a", "b"], ["c", "d"], ["f"]]
    assert [a.meets_thresholds for a in res.adapters] == [True, True, False]


def test_probed_order_is_deterministic_and_ties_keep_the_given_order():
    import random

    rnd = random.Random(1)
    tasks = "abcdef"
    script = {}
    for i, a in enumerate(tasks):
        for b in tasks[i + 1 :]:
            script[frozenset((a, b))] = {a: rnd.uniform(0.85, 0.95), b: rnd.uniform(0.85, 0.95)}
    thresholds = {t: 0.88 for t in tasks}
    given = _single(*tasks)
    inter = probe_interference(given, ScriptedTrainer(script))
    first = [s.name for s in probed_order(given, thresholds, inter)]
    assert sorted(first) == sorted(tasks)
    for _ in range(3):
        assert [s.name for s in probed_order(given, thresholds, inter)] == first
        again = probe_interference(given, ScriptedTrainer(script))
        assert again.alone == inter.alone and again.paired == inter.paired
    # With no interference at all, every order packs alike: the given order is kept.
    flat = probe_interference(given, ScriptedTrainer({}))
    assert [s.name for s in probed_order(given, thresholds, flat)] == list(tasks)
    assert [s.name for s in probed_order(given[::-1], thresholds, flat)] == list(reversed(tasks))
