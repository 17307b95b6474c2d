"""Fixtures of the e2e suite.

- `shared_cluster`: the four services as processes (1 worker, default settings, the session's
  tiny model), started once for the modules that request it; each of them only adds state of its
  own names (adapters, tasks, jobs) and checks what it added or deltas of counters. It is stopped
  after the last test of a run of consecutive modules that use it; the e2e modules that use it are
  collected one after another, so it starts once per session.
- `tiny_model_copy(dest)`: the session's tiny model copied to `dest` (where a test's own cluster
  or CLI expects its default model), instead of building it again in a subprocess.
- `no_eos`: a logit_bias banning the session model's EOS ids: a request runs its max_new_tokens.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from valora.cluster import start_cluster, stop_cluster

SHARED = "shared_cluster"
_shared: dict = {}  # "home", "cluster": the running shared cluster


def _uses_shared(module_items) -> bool:
    return any(SHARED in getattr(item, "fixturenames", ()) for item in module_items)


def pytest_collection_modifyitems(session, config, items):
    """Within this directory, the modules using the shared cluster run first (in their order), the
    others after them (in theirs); each module's tests keep their order."""
    here = Path(__file__).parent
    slots = [i for i, item in enumerate(items) if Path(str(item.fspath)).is_relative_to(here)]
    by_module: dict[str, list] = {}
    for i in slots:
        by_module.setdefault(str(items[i].fspath), []).append(items[i])
    modules = sorted(by_module.values(), key=lambda module_items: not _uses_shared(module_items))
    for i, item in zip(slots, [item for module_items in modules for item in module_items]):
        items[i] = item


def _stop_shared() -> None:
    if "home" in _shared:
        stop_cluster(_shared.pop("home"))
        _shared.pop("cluster", None)


@pytest.fixture(scope="module")
def shared_cluster(request, model_path, tmp_path_factory):
    if "cluster" not in _shared:
        home = tmp_path_factory.mktemp("valora-shared")
        _shared["home"] = home
        try:
            _shared["cluster"] = start_cluster(home, workers=1, model_path=model_path)
        except BaseException:
            _shared.pop("home")
            raise
    yield _shared["cluster"]
    items = request.session.items
    mine = [i for i, item in enumerate(items) if item.getparent(pytest.Module) is request.node]
    after = items[mine[-1] + 1] if mine and mine[-1] + 1 < len(items) else None
    if after is None or SHARED not in getattr(after, "fixturenames", ()):
        _stop_shared()


def pytest_sessionfinish(session, exitstatus):
    _stop_shared()  # a run stopped early (-x, Ctrl-C) before the last module using it ended


@pytest.fixture(scope="session")
def tiny_model_copy(model_path):
    def copy(dest: Path) -> Path:
        dest = Path(dest)
        if not (dest / "config.json").exists():
            shutil.copytree(model_path, dest)
        return dest

    return copy


@pytest.fixture(scope="session")
def no_eos(model_path) -> dict[int, float]:
    """logit_bias -100 on each id the worker stops at (lora_model.py: the generation config's and
    the text config's eos_token_id)."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = model_path / name
        if not path.exists():
            continue
        cfg = json.loads(path.read_text())
        for c in (cfg, cfg.get("text_config") or {}):
            eos = c.get("eos_token_id")
            ids |= set(eos) if isinstance(eos, list) else {eos} if eos is not None else set()
    assert ids
    return {i: -100.0 for i in ids}
