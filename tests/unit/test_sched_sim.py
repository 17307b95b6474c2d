"""The scheduling simulator (real policies, cost model), traces, Azure CSV loader, cost model."""

import json
import statistics

import pytest
from typer.testing import CliRunner

from services.scheduler.cost_model import CPU_TINY, CostModel, load_profile
from services.scheduler.policies import make_policy
from services.common.modes import Mode
from services.scheduler.sim import Simulator, simulate
from services.scheduler.traces import (
    TraceRequest,
    load_azure_csv,
    synthetic_trace,
    trace_stats,
    two_app_trace,
    zipf_weights,
)

COST = CostModel()
RARE = "adapters/rare/versions/1"


# -- traces ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("alpha", [0.5, 1.0, 1.5])
def test_synthetic_trace_rate_and_skew(alpha):
    tr = synthetic_trace(n=4000, rate=50.0, alpha=alpha, adapters=64, task_head_fraction=0.3, seed=3)
    st = trace_stats(tr)
    assert st["rate"] == pytest.approx(50.0, rel=0.08)
    assert st["top_share"] == pytest.approx(zipf_weights(64, alpha)[0], abs=0.03)
    assert st["task_head_share"] == pytest.approx(0.3, abs=0.03)
    assert all(r.output_tokens == 1 for r in tr if r.label) and all(r.output_tokens >= 2 for r in tr if not r.label)


def test_skew_grows_with_alpha_and_bursts_raise_variance():
    shares = [
        trace_stats(synthetic_trace(n=3000, rate=20, alpha=a, adapters=128, seed=1))["top_share"]
        for a in (0.5, 1.0, 1.5)
    ]
    assert shares[0] < shares[1] < shares[2]

    def gap_cv(cv):
        t = [r.arrival_s for r in synthetic_trace(n=3000, rate=20, alpha=1.0, burst_cv=cv, seed=2)]
        gaps = [b - a for a, b in zip(t, t[1:], strict=False)]
        return statistics.pstdev(gaps) / statistics.fmean(gaps)

    assert gap_cv(1.0) == pytest.approx(1.0, abs=0.1)
    assert gap_cv(3.0) > 2.0


def test_azure_csv_loader(tmp_path):
    path = tmp_path / "AzureLLMInferenceTrace_conv.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n"
        "2023-11-16 18:15:47.1805900,879,1\n"
    )
    tr = load_azure_csv(path, alpha=1.0, adapters=32, seed=0)
    assert [round(r.arrival_s, 3) for r in tr] == [0.0, 0.5, 4.315]  # sorted, relative to the first
    assert [(r.prompt_tokens, r.output_tokens, r.label) for r in tr] == [
        (374, 44, False),
        (879, 1, True),
        (396, 109, False),
    ]
    assert all(r.adapter.startswith("adapters/") for r in tr)
    assert [r.arrival_s for r in load_azure_csv(path, time_scale=2.0)][-1] == pytest.approx(4.315 / 2, abs=1e-3)
    bad = tmp_path / "bad.csv"
    bad.write_text("time,prompt\n1,2\n")
    with pytest.raises(ValueError, match="Azure"):
        load_azure_csv(bad)


# -- cost model -----------------------------------------------------------------------------------
def test_cost_model_loads_measured_numbers_or_keeps_defaults(tmp_path):
    assert CostModel.from_results(tmp_path).switch_ms == CostModel().switch_ms  # nothing there: defaults
    (tmp_path / "switch_abc.json").write_text(
        json.dumps(
            {
                "ours": {"x": {"merge_ms": 7.0, "switch_ms": 8.0}, "y": {"merge_ms": 9.0, "switch_ms": 12.0}},
                "h2d_adapter": {"ms": 2.5},
            }
        )
    )
    (tmp_path / "atmm_headline_abc.json").write_text(
        json.dumps(
            {
                "cases": [
                    {"rank": "16", "h_in": 4096, "T": 16, "N": 8, "atmm": {"amortized_us": 4.0}},
                    {"rank": "16", "h_in": 4096, "T": 1024, "N": 8, "atmm": {"amortized_us": 16.0}},
                    {"rank": "32", "h_in": 4096, "T": 16, "N": 8, "atmm": {"amortized_us": 99.0}},
                ]
            }
        )
    )
    m = CostModel.from_results(tmp_path)
    assert (m.switch_ms, m.merge_ms, m.load_ms) == (8.0, 7.0, 2.5)
    assert m.atmm_op_us(16, 8) == 4.0 and m.atmm_op_us(1024, 64) == 16.0
    assert 4.0 < m.atmm_op_us(128, 8) < 16.0  # interpolated
    assert m.switch_cost_ms("a", "a") == 0 and m.switch_cost_ms(None, "a", ["a"]) == 7.0
    assert m.switch_cost_ms("a", "b") == 8.0 + 2.5  # b not resident: copied first


def test_merged_steps_skip_the_lora_term_and_profiles_exist():
    assert COST.step_ms(16, 0, 0, 0) < COST.step_ms(16, 0, 16, 8) < COST.step_ms(16, 0, 16, 8, mixture=True)
    assert COST.request_ms(32, 1, 0, label=True) < COST.request_ms(32, 1, 32)
    assert load_profile("cpu-tiny") is CPU_TINY
    with pytest.raises(ValueError):
        load_profile("tpu")


def test_two_app_trace_streams_chunks_per_second_beside_poisson_retrieval():
    tr = two_app_trace(seconds=20, streams=8, retrieval_rate=30.0, video_tasks=4, video_slo_ms=250.0, seed=1)
    video = [r for r in tr if r.slo_class == "video"]
    retrieval = [r for r in tr if r.slo_class == "retrieval"]
    assert len(video) + len(retrieval) == len(tr) and tr == sorted(tr, key=lambda r: r.arrival_s)
    assert 8 * 19 <= len(video) <= 8 * 21  # one chunk a second per stream
    assert all(r.label and r.images == 4 and r.slo_s == 0.25 for r in video)
    assert len({r.adapter for r in video}) == 4
    assert len(retrieval) / 20 == pytest.approx(30.0, rel=0.15)
    assert all(not r.label and r.slo_s == 0.0 for r in retrieval)  # the throughput application: no objective


# -- simulator ------------------------------------------------------------------------------------
def _with_rare(trace, every_s=1.5):
    end = trace[-1].arrival_s
    rare = [TraceRequest(f"rare{i}", 0.2 + i * every_s, RARE, 32, 1, 16) for i in range(int(end / every_s))]
    return sorted([*trace, *rare], key=lambda r: r.arrival_s)


def test_no_request_waits_forever_under_heavy_skew():
    """α = 1.5 plus a rare adapter: under valora and dlora every request finishes and the rare
    adapter's longest wait for a worker stays bounded (θ plus a batch draining)."""
    trace = _with_rare(synthetic_trace(n=600, rate=70.0, alpha=1.5, adapters=32, seed=5))
    for name in ("valora", "dlora"):
        res = simulate(make_policy(name, COST, theta_s=0.5), trace, COST, workers=2, max_batch=8)
        assert res.unfinished == 0 and res.completed == len(trace)
        assert res.max_queue_by_adapter[RARE] < 0.5 + 3.0


def test_every_policy_finishes_the_trace_and_never_overfills():
    trace = synthetic_trace(n=300, rate=40.0, alpha=1.0, adapters=48, seed=7)
    for name in ("valora", "dlora", "slora", "punica", "affinity"):
        res = simulate(make_policy(name, COST), trace, COST, workers=2, max_batch=8)
        s = res.summary()
        assert res.completed == len(trace), name
        assert s["p50_ms"] <= s["p99_ms"] and s["throughput_rps"] > 0


def test_baselines_in_the_simulator_behave_as_named():
    trace = synthetic_trace(n=300, rate=40.0, alpha=1.5, adapters=32, seed=8)
    seen: dict[str, set] = {}
    for name in ("slora", "punica", "dlora", "valora"):
        policy = make_policy(name, COST, theta_s=0.3)
        modes: set = set()
        inner = policy.decide

        def decide(now, waiting, workers, inner=inner, modes=modes):
            d = inner(now, waiting, workers)
            modes.update(c.mode for c in d.mode_commands)
            return d

        policy.decide = decide
        sim = Simulator(policy, COST, workers=2, max_batch=8)
        res = sim.run(trace)
        seen[name] = modes
        if name in ("slora", "punica"):
            assert res.switches == 0 and set(res.mode_time_s) == {"unmerged"}
    assert seen["slora"] <= {Mode.UNMERGED} and seen["punica"] <= {Mode.UNMERGED}
    assert Mode.MIXTURE not in seen["dlora"]
    assert Mode.MERGED in seen["valora"]


def test_deadline_ordering_raises_the_video_class_attainment_in_the_simulator():
    """Video chunks with a 1 s objective beside retrieval past the workers' capacity: valora with
    deadlines meets the objective for more chunks than without, and finishes the same work."""
    trace = two_app_trace(seconds=8, streams=16, retrieval_rate=70.0, seed=2)
    on, off = (
        simulate(make_policy("valora", COST, deadlines=d), trace, COST, workers=2, max_batch=16) for d in (True, False)
    )
    v_on, v_off = on.classes["video"], off.classes["video"]
    assert (
        v_on["within"] + v_on["over"] == v_off["within"] + v_off["over"] == sum(r.slo_class == "video" for r in trace)
    )
    assert v_on["attainment"] > v_off["attainment"] + 0.1
    assert "attainment" not in on.classes["retrieval"]  # no objective, latency figures only
    assert on.completed == off.completed == len(trace)


def test_without_objectives_the_simulation_is_the_same_with_or_without_deadlines():
    trace = synthetic_trace(n=400, rate=60.0, alpha=1.0, adapters=32, seed=4)
    on, off = (
        simulate(make_policy("valora", COST, deadlines=d), trace, COST, workers=2, max_batch=8) for d in (True, False)
    )
    assert on.latencies_s == off.latencies_s and on.switches == off.switches and on.classes == off.classes == {}


def test_bench_sched_cli_two_app_rows_carry_classes(tmp_path):
    from valora.cli import app

    out = tmp_path / "sched.json"
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "sched",
            "--workload",
            "two-app",
            "--alphas",
            "1",
            "--rates",
            "20",
            "--seconds",
            "3",
            "--video-streams",
            "4",
            "--deadlines",
            "both",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert sorted((r["policy"], r["deadlines"]) for r in rows if r["policy"] in ("valora", "dlora")) == [
        ("dlora", False),
        ("dlora", True),
        ("valora", False),
        ("valora", True),
    ]
    assert {r["deadlines"] for r in rows if r["policy"] in ("slora", "punica")} == {None}
    for r in rows:
        assert r["trace"] == "two-app" and set(r["classes"]) == {"video", "retrieval"}
        assert 0.0 <= r["classes"]["video"]["attainment"] <= 1.0 and r["classes"]["video"]["slo_ms"] == 1000.0
    assert data["info"]["two_app"]["video_streams"] == 4


def test_bench_sched_cli_writes_rows(tmp_path):
    from valora.cli import app

    out = tmp_path / "sched.json"
    result = CliRunner().invoke(
        app,
        ["bench", "sched", "--alphas", "1.5", "--rates", "20", "--seconds", "3", "--adapters", "32", "--out", str(out)],
    )
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["rows"]
    assert {r["policy"] for r in rows} == {"valora", "dlora", "slora", "punica"}
    for r in rows:
        assert r["source"] == "sim" and r["alpha"] == 1.5 and r["rate"] == 20
        assert {"mean_ms", "p50_ms", "p99_ms", "throughput_rps", "switches_per_s"} <= set(r)
