"""The demo's generated-adapter cache: keyed by every setting, used only once complete, and the
single-task reuse in greedy fusion (a fresh adapter for one task is the one trained for its threshold)."""

from __future__ import annotations

import json
from dataclasses import replace

from services.generator.demo import DemoSettings, _ReuseSingles, ensure_adapters


def test_key_is_stable_and_changes_with_every_setting():
    s = DemoSettings()
    assert s.key() == DemoSettings().key()
    for change in (
        dict(tasks=("digit", "parity")),
        dict(pretrain_steps=301),
        dict(epochs=4),
        dict(limit=None),
        dict(rank=4),
        dict(margin=0.05),
        dict(seed=1),
        dict(prefix="x"),
        dict(threads=1),
        dict(tasks=("parity", "digit", "digit-rot90", "count")),
    ):
        assert replace(s, **change).key() != s.key(), change


def test_the_pretrained_base_is_keyed_by_threads_too(tmp_path):
    from services.generator.demo import base_dir

    assert base_dir(tmp_path, 300, 0, threads=1) != base_dir(tmp_path, 300, 0, threads=2)
    assert base_dir(tmp_path, 300, 0, threads=2) == base_dir(tmp_path, 300, 0, threads=2)


def test_complete_cache_is_reused_without_training(tmp_path):
    s = DemoSettings(tasks=("parity",))
    d = tmp_path / "demo" / f"gen-{s.key()}"
    d.mkdir(parents=True)
    (d / "manifest.json").write_text(json.dumps({"demo": {"key": s.key()}}))
    out, manifest, cached = ensure_adapters(tmp_path, tmp_path / "no-such-base", s)
    assert cached and out == d and manifest["demo"]["key"] == s.key()


class _State:
    def __init__(self, heads=()):
        self.heads = dict.fromkeys(heads)


class _Trainer:
    def __init__(self):
        self.fused = []

    def empty(self):
        return _State()

    def fuse(self, state, tasks):
        self.fused.append(tuple(tasks))
        return _State(tasks)

    def validate(self, state, tasks, split="val"):
        return {t: 1.0 for t in tasks}


def test_reuse_singles_only_for_a_fresh_one_task_adapter():
    inner = _Trainer()
    single = _State(("digit",))
    t = _ReuseSingles(inner, {"digit": single})
    assert t.fuse(t.empty(), ["digit"]) is single
    assert inner.fused == []
    t.fuse(single, ["digit", "parity"])  # fusing into it trains
    t.fuse(t.empty(), ["parity"])  # no single for parity
    assert inner.fused == [("digit", "parity"), ("parity",)]
