"""Dataset builders: shapes, label sets, fixed and disjoint splits."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("sklearn")

from services.generator.datasets import DEFAULT_TASKS, TASKS, build_task, split_indices


def test_at_least_four_distinct_tasks_by_default():
    assert len(DEFAULT_TASKS) >= 4
    assert set(DEFAULT_TASKS) <= set(TASKS)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_images_labels_and_splits(name):
    d = build_task(name, limit=40)
    spec = TASKS[name]
    assert d.labels == spec.labels and len(set(d.labels)) == len(d.labels)
    for split in ("train", "val", "test"):
        assert d.size(split) == len(d.images[split]) == 40
        img = d.images[split][0]
        assert img.mode == "RGB" and img.size == (56, 56)
        y = d.targets[split]
        assert y.dtype == np.int64 and y.min() >= 0 and y.max() < len(d.labels)


@pytest.mark.parametrize("name", ["digit", "parity", "ge5", "count", "colour"])
def test_every_label_occurs_in_every_split(name):
    d = build_task(name)
    for split in ("train", "val", "test"):
        assert set(np.unique(d.targets[split])) == set(range(len(d.labels)))


def test_splits_are_deterministic_disjoint_and_cover_everything():
    a, b = split_indices(1797), split_indices(1797)
    for s in a:
        assert np.array_equal(a[s], b[s])
    union = np.concatenate(list(a.values()))
    assert len(union) == len(set(union.tolist())) == 1797
    assert [len(a[s]) for s in ("train", "val", "test")] == [1078, 359, 360]
    assert not np.array_equal(split_indices(1797, seed=1)["test"], a["test"])


def test_builds_are_pixel_identical_across_calls():
    for name in ("digit-noisy", "count", "colour"):
        x, y = build_task(name, limit=5), build_task(name, limit=5)
        assert np.array_equal(x.targets["val"], y.targets["val"])
        assert all(np.array_equal(np.asarray(p), np.asarray(q)) for p, q in zip(x.images["val"], y.images["val"]))


def test_derived_tasks_share_scans_and_labels_are_consistent():
    digit, parity, ge5 = build_task("digit"), build_task("parity"), build_task("ge5")
    assert np.array_equal(parity.targets["test"], digit.targets["test"] % 2)
    assert np.array_equal(ge5.targets["test"], (digit.targets["test"] >= 5).astype(np.int64))
    rot, inv = build_task("digit-rot90", limit=3), build_task("digit-inverted", limit=3)
    up = np.asarray(digit.images["train"][0])
    assert np.array_equal(np.asarray(rot.images["train"][0]), np.rot90(up, k=-1))
    inverted = np.asarray(inv.images["train"][0]).astype(int)
    assert np.abs(inverted - (255 - up.astype(int))).max() <= 1  # rounding of 8/16 intensities
