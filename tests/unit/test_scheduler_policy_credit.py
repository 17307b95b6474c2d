"""VaLoRA's credit policy (paper Alg. 1), its placement over workers, and the baselines."""

from dataclasses import replace

import pytest

from services.scheduler.config import SchedulerSettings
from services.scheduler.cost_model import CostModel
from services.scheduler.credits import credit_of, due_s, starving, threshold_s
from services.scheduler.policies import POLICIES, POLICY_NAMES, make_policy
from services.scheduler.policies.base import ModeCommand, PrefetchHint, WaitingRequest, WorkerView
from services.common.modes import Mode
from services.scheduler.policies.baselines import PunicaPolicy, SLoRAPolicy
from services.scheduler.policies.credit import CreditPolicy

A, B, C, D = (f"adapters/{x}/versions/1" for x in "abcd")
NOW = 100.0
COST = CostModel()


def worker(
    address="w1",
    *,
    running=0,
    max_batch=16,
    mode=Mode.UNMERGED,
    merged=None,
    resident=(),
    healthy=True,
    running_adapters=None,
):
    return WorkerView(
        address, healthy, max_batch, running, mode, merged, frozenset(resident), dict(running_adapters or {})
    )


def req(rid, adapter=A, *, waited=0.0, label=False, excluded=(), slo_s=0.0):
    return WaitingRequest(rid, NOW - waited, adapter, frozenset(excluded), 32, 1, label, slo_s=slo_s)


def valora(theta=1.0, cost=COST):
    return CreditPolicy(cost, theta_s=theta)


def placed(decision):
    return {a.request_id: a.worker for a in decision.assignments}


# -- credits ------------------------------------------------------------------------------------
def test_credit_is_waiting_time_plus_estimated_run_time():
    fresh, old, head = req("fresh"), req("old", waited=2.0), req("head", label=True)
    c_fresh, c_old, c_head = (credit_of(r, NOW, COST) for r in (fresh, old, head))
    assert c_fresh.wait_s == 0 and c_fresh.exec_s > 0
    assert c_old.value_s == pytest.approx(2.0 + c_fresh.exec_s)
    assert c_head.exec_s < c_fresh.exec_s  # a task-head request is one forward pass
    assert [c.request_id for c in starving([c_fresh, c_old, c_head], theta_s=1.0)] == ["old"]


# -- Alg. 1, one rule each ------------------------------------------------------------------------
def test_no_starvation_merges_the_adapter_of_the_waiting_requests():
    d = valora().decide(NOW, [req(f"r{i}") for i in range(3)], [worker()])
    assert d.mode_commands == [ModeCommand("w1", Mode.MERGED, A)]
    assert sorted(placed(d)) == ["r0", "r1", "r2"]


def test_merged_worker_leaves_other_adapters_waiting_until_they_starve():
    w = worker(mode=Mode.MERGED, merged=A, running=12, running_adapters={A: 12})
    d = valora().decide(NOW, [req("a1"), req("b1", B)], [w])
    assert placed(d) == {"a1": "w1"} and d.mode_commands == []


def test_starving_requests_run_through_mixture_keeping_the_merged_adapter():
    w = worker(mode=Mode.MERGED, merged=A, running=4, running_adapters={A: 4})
    d = valora().decide(NOW, [req("a1"), req("b-old", B, waited=3.0)], [w])
    assert d.mode_commands == [ModeCommand("w1", Mode.MIXTURE, A)]
    assert d.assignments[0].request_id == "b-old"  # starving first
    assert placed(d) == {"b-old": "w1", "a1": "w1"}


def test_more_than_half_a_batch_starving_switches_to_unmerged():
    w = worker(mode=Mode.MERGED, merged=A, max_batch=4)
    waiting = [req("b", B, waited=3.0), req("c", C, waited=3.0), req("d", D, waited=3.0)]
    d = valora().decide(NOW, waiting, [w])
    assert d.mode_commands == [ModeCommand("w1", Mode.UNMERGED, None)]
    assert sorted(placed(d)) == ["b", "c", "d"]
    # Exactly half starving is still mixture.
    d = valora().decide(NOW, waiting[:2], [w])
    assert d.mode_commands == [ModeCommand("w1", Mode.MIXTURE, A)]


def test_switch_happens_only_when_the_gain_beats_the_switch_cost():
    waiting = [req(f"b{i}", B) for i in range(6)]
    idle_on_a = worker(mode=Mode.MERGED, merged=A, resident=[A, B])
    # Cheap switch: six requests of B are worth leaving A.
    d = valora().decide(NOW, waiting, [idle_on_a])
    assert d.mode_commands == [ModeCommand("w1", Mode.MERGED, B)]
    # The same queue when a switch costs more than serving it otherwise: no switch to B.
    slow = replace(COST, switch_ms=60_000.0, unmerge_ms=60_000.0, merge_ms=60_000.0)
    d = valora(cost=slow).decide(NOW, waiting, [idle_on_a])
    assert all(c.merged_adapter == A for c in d.mode_commands)
    assert not any(c.mode == Mode.MERGED and c.merged_adapter == B for c in d.mode_commands)


def test_busy_merged_worker_does_not_thrash_for_one_request():
    w = worker(mode=Mode.MERGED, merged=A, running=14, running_adapters={A: 14})
    d = valora().decide(NOW, [req("b1", B)], [w])
    assert d.mode_commands == [] and d.assignments == []


def test_dlora_has_no_mixture_any_starvation_unmerges():
    w = worker(mode=Mode.MERGED, merged=A, running=2, running_adapters={A: 2})
    d = make_policy("dlora").decide(NOW, [req("a1"), req("b-old", B, waited=3.0)], [w])
    assert d.mode_commands == [ModeCommand("w1", Mode.UNMERGED, None)]
    assert set(placed(d)) == {"a1", "b-old"}


# -- latency objectives (per-application SLO classes) -----------------------------------------------
def test_thresholds_and_due_times_of_objectives():
    plain, video, loose = req("p", waited=0.2), req("v", waited=0.1, slo_s=0.4), req("l", slo_s=30.0)
    assert threshold_s(plain, 1.0) == 1.0 and due_s(plain, 1.0) == pytest.approx(NOW - 0.2 + 1.0)
    assert threshold_s(video, 1.0) == pytest.approx(0.2) and due_s(video, 1.0) == pytest.approx(NOW + 0.3)
    assert threshold_s(loose, 1.0) == 1.0 and due_s(loose, 1.0) == pytest.approx(NOW + 30.0)  # θ stays the bound


def test_under_contention_the_tightest_deadlines_are_served_first():
    # Two slots, six waiting (same adapter, none starving): earliest due first — task-head video
    # requests with a 500 ms objective, then those without one (due at arrival + θ) in arrival
    # order, a 20 s objective last; without deadlines the first two to arrive.
    waiting = [
        req("old", waited=0.3),
        req("older", waited=0.35),
        req("video-1", label=True, waited=0.05, slo_s=0.5),
        req("video-2", label=True, slo_s=0.5),
        req("loose", waited=0.5, slo_s=20.0),
        req("new"),
    ]
    w = worker(max_batch=2)
    assert [a.request_id for a in valora().decide(NOW, waiting, [w]).assignments] == ["video-1", "video-2"]
    fcfs = CreditPolicy(COST, deadlines=False)
    assert [a.request_id for a in fcfs.decide(NOW, waiting, [w]).assignments] == ["loose", "older"]
    roomy = [a.request_id for a in valora().decide(NOW, waiting, [worker(max_batch=6)]).assignments]
    assert roomy == ["video-1", "video-2", "older", "old", "new", "loose"]


def test_a_request_past_half_its_objective_opens_a_merged_worker_to_mixture():
    # A merged worker leaves another adapter's request waiting until it starves (θ = 1 s); one
    # with a 300 ms objective that has waited 200 ms starves now, and goes first.
    w = worker(mode=Mode.MERGED, merged=A, running=12, running_adapters={A: 12})
    waiting = [req("a1"), req("b-video", B, waited=0.2, slo_s=0.3)]
    d = valora().decide(NOW, waiting, [w])
    assert d.mode_commands == [ModeCommand("w1", Mode.MIXTURE, A)]
    assert d.assignments[0].request_id == "b-video"
    ignored = CreditPolicy(COST, deadlines=False).decide(NOW, waiting, [w])
    assert ignored.mode_commands == [] and placed(ignored) == {"a1": "w1"}  # the paper's rule alone
    # The same wait without an objective does not starve.
    plain = valora().decide(NOW, [req("a1"), req("b", B, waited=0.2)], [w])
    assert plain.mode_commands == [] and placed(plain) == {"a1": "w1"}


def test_starving_requests_still_in_time_go_before_starving_ones_without_objectives():
    # Past capacity everyone starves. A video request that can still make its 500 ms objective
    # goes before retrieval requests starving longer (credit order would put it last); one that
    # has lost its objective is one more starving request in credit order, so it does not make
    # the ones still in time late too.
    waiting = [
        req("retrieval-old", waited=2.0),
        req("retrieval", waited=1.5),
        req("video", label=True, waited=0.4, slo_s=0.5),
        req("video-lost", label=True, waited=1.6, slo_s=0.5),
    ]
    w = worker(max_batch=4)
    assert [a.request_id for a in valora().decide(NOW, waiting, [w]).assignments] == [
        "video",
        "retrieval-old",
        "retrieval",
        "video-lost",
    ]
    assert [a.request_id for a in CreditPolicy(COST, deadlines=False).decide(NOW, waiting, [w]).assignments] == [
        "retrieval-old",
        "retrieval",
        "video-lost",
        "video",
    ]  # 0.4 s + a forward is below θ: not starving


def test_without_objectives_deadlines_change_nothing():
    """Default behaviour: with no objective anywhere the decisions are those of Alg. 1 as the
    paper has it (deadlines=False), starving or not, merged or not."""
    queues = [
        [req(f"r{i}", (A, B, C, D)[i % 4], waited=0.3 * i, label=i % 3 == 0) for i in range(12)],
        [req(f"s{i}", B, waited=1.5 + 0.1 * i) for i in range(5)] + [req("a", A)],
    ]
    pools = [
        [worker(max_batch=4)],
        [
            worker(mode=Mode.MERGED, merged=A, running=2, running_adapters={A: 2}),
            worker("w2", max_batch=3, resident=[B]),
        ],
    ]
    for waiting in queues:
        for workers in pools:
            assert valora().decide(NOW, waiting, workers) == CreditPolicy(COST, deadlines=False).decide(
                NOW, waiting, workers
            )


# -- placement over workers ------------------------------------------------------------------------
def test_affinity_merged_worker_gets_its_adapter():
    workers = [worker("w1"), worker("w2", mode=Mode.MERGED, merged=A)]
    d = valora().decide(NOW, [req("a1"), req("a2")], workers)
    assert placed(d) == {"a1": "w2", "a2": "w2"} and d.mode_commands == []


def test_load_balance_spreads_a_mixed_queue_over_idle_workers():
    waiting = [req(f"r{i}", f"adapters/x{i}/versions/1") for i in range(8)]
    d = valora().decide(NOW, waiting, [worker("w1"), worker("w2")])
    counts = {w: sum(v == w for v in placed(d).values()) for w in ("w1", "w2")}
    assert sum(counts.values()) == 8 and min(counts.values()) >= 3


def test_capacity_unhealthy_and_excluded_workers_are_respected():
    waiting = [req(f"r{i}", B, excluded=["w2"] if i == 0 else ()) for i in range(6)]
    workers = [worker("w1", max_batch=2), worker("w2", max_batch=2), worker("down", healthy=False)]
    d = valora().decide(NOW, waiting, workers)
    got = placed(d)
    assert len(got) == 4 and "down" not in got.values()
    assert got.get("r0", "w1") == "w1"  # excluded from w2 (failed there before its first token)
    assert valora().decide(NOW, waiting, [worker("w1", running=16)]).assignments == []


def test_prefetch_hints_name_adapters_nobody_holds():
    w = worker("w1", max_batch=1, running=1)
    d = valora().decide(NOW, [req("b1", B)], [w])
    assert d.assignments == [] and d.prefetch == [PrefetchHint("w1", B)]
    assert valora().decide(NOW, [req("b1", B)], [replace(w, resident_adapters=frozenset([B]))]).prefetch == []


# -- baselines -------------------------------------------------------------------------------------
def test_slora_is_unmerged_only_fcfs_with_affinity():
    merged = worker("w1", mode=Mode.MERGED, merged=A)
    d = SLoRAPolicy().decide(
        NOW,
        [req("late", B, waited=0.0), req("early", B, waited=1.0)],
        [merged, worker("w2", resident=[B], max_batch=1)],
    )
    assert d.mode_commands == [ModeCommand("w1", Mode.UNMERGED)]
    assert d.assignments[0].request_id == "early" and d.assignments[0].worker == "w2"  # resident there
    assert placed(d)["late"] == "w1"


def test_punica_is_unmerged_fcfs_and_consolidates():
    d = PunicaPolicy().decide(NOW, [req("r2"), req("r1", waited=1.0)], [worker("w1"), worker("w2", running=3)])
    assert [a.request_id for a in d.assignments] == ["r1", "r2"]
    assert set(placed(d).values()) == {"w2"} and d.prefetch == []
    assert all(c.mode == Mode.UNMERGED for c in d.mode_commands)


def test_policy_registry_and_setting(monkeypatch):
    assert POLICY_NAMES == tuple(POLICIES) == ("valora", "dlora", "slora", "punica", "affinity")
    for name in POLICY_NAMES:
        assert type(make_policy(name)) is POLICIES[name][0]
        assert make_policy(name).decide(NOW, [], [worker()]).assignments == []
    assert make_policy("valora").mixture and not make_policy("dlora").mixture
    with pytest.raises(ValueError, match="unknown policy 'fastest'; known: valora, dlora"):
        make_policy("fastest")
    assert SchedulerSettings().policy == "valora"
    monkeypatch.setenv("VALORA_POLICY", "punica")
    monkeypatch.setenv("VALORA_STARVATION_THETA_S", "0.25")
    s = SchedulerSettings()
    assert s.policy == "punica" and s.starvation_theta_s == 0.25
    monkeypatch.setenv("VALORA_POLICY", "fastest")
    with pytest.raises(ValueError):
        SchedulerSettings()
