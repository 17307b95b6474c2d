from services.scheduler.policies.affinity import AffinityLeastLoadedPolicy
from services.scheduler.policies.base import (
    Assignment,
    ModeCommand,
    WaitingRequest,
    WorkerView,
)
from services.common.modes import Mode

A1 = "adapters/a/versions/1"
B1 = "adapters/b/versions/1"


def worker(address, *, running=0, max_batch=4, healthy=True, mode=Mode.UNMERGED, merged=None, resident=()):
    return WorkerView(address, healthy, max_batch, running, mode, merged, frozenset(resident))


def req(rid, arrival, adapter=A1, excluded=()):
    return WaitingRequest(rid, arrival, adapter, frozenset(excluded))


def place(waiting, workers):
    return AffinityLeastLoadedPolicy().decide(100.0, waiting, workers)


def test_prefers_merged_then_resident_then_least_loaded():
    workers = [
        worker("w1"),
        worker("w2", resident=[A1], running=3),
        worker("w3", mode=Mode.MIXTURE, merged=A1, running=3),
    ]
    assert place([req("r", 1.0)], workers).assignments == [Assignment("r", "w3")]
    assert place([req("r", 1.0)], workers[:2]).assignments == [Assignment("r", "w2")]
    assert place([req("r", 1.0, adapter=B1)], workers).assignments == [Assignment("r", "w1")]


def test_least_loaded_spreads_requests_without_affinity():
    d = place([req(f"r{i}", float(i), adapter=None) for i in range(4)], [worker("w1"), worker("w2", running=1)])
    counts = {w: sum(a.worker == w for a in d.assignments) for w in ("w1", "w2")}
    assert counts == {"w1": 3, "w2": 1}  # final loads 3 and 2 (w2 already ran one)
    assert d.assignments[0] == Assignment("r0", "w1")


def test_capacity_is_never_exceeded_and_earliest_arrivals_win():
    waiting = [req("late", 5.0), req("early", 1.0), req("mid", 3.0)]
    d = place(waiting, [worker("w1", max_batch=2, running=0)])
    assert [a.request_id for a in d.assignments] == ["early", "mid"]
    assert place(waiting, [worker("w1", max_batch=2, running=2)]).assignments == []


def test_skips_unhealthy_unknown_and_excluded_workers():
    workers = [worker("down", healthy=False, resident=[A1]), worker("unknown", max_batch=0), worker("w1"), worker("w2")]
    d = place([req("r", 1.0, excluded=["w1"])], workers)
    assert d.assignments == [Assignment("r", "w2")]
    assert place([req("r", 1.0, excluded=["w1", "w2"])], workers).assignments == []


def test_merged_worker_runs_only_its_adapter_unless_mixture_is_needed():
    merged_a = worker("wa", mode=Mode.MERGED, merged=A1)
    d = place([req("r", 1.0, adapter=B1)], [merged_a, worker("w2", running=3)])
    assert d.assignments == [Assignment("r", "w2")] and d.mode_commands == []
    # Nowhere else to go: the merged worker opens to mixture mode, keeping its adapter merged.
    d = place([req("r", 1.0, adapter=B1)], [merged_a])
    assert d.mode_commands == [ModeCommand("wa", Mode.MIXTURE, A1)]
    assert d.assignments == [Assignment("r", "wa")]
    d = place([req("r", 1.0, adapter=A1)], [merged_a])
    assert d.assignments == [Assignment("r", "wa")] and d.mode_commands == []


def test_nothing_waiting_or_no_workers_decides_nothing():
    assert place([], [worker("w1")]).assignments == []
    assert place([req("r", 1.0)], []).assignments == []
