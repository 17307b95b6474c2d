"""The probed fusion order on the real trainer (tiny model, a few images): a probe's budget caps
each task's batches, a probe trainer shares the features and the fresh adapter's first heads (and
trains exactly what the full trainer would from the same start), and `generate --fusion-order
probed` records the order, the probe matrix and its time in the manifest."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

torch = pytest.importorskip("torch")

N = 16  # images per split


@pytest.fixture(scope="module")
def trainer(model_path):
    from services.generator.datasets import build_tasks
    from services.generator.model import BaseModel
    from services.generator.training import TorchTrainer, TrainConfig

    tasks = build_tasks(["digit", "count"], limit=N)
    base = BaseModel.load(model_path, rank=2, lora_alpha=4.0)
    return TorchTrainer(base, tasks, TrainConfig(epochs=1, batch_size=4, head_only_steps=20))


def test_a_probe_budget_caps_each_tasks_batches_per_epoch(trainer):
    import dataclasses

    steps = []
    probe = trainer.with_config(dataclasses.replace(trainer.config, epochs=2, batches_per_epoch=1))
    probe.progress = lambda what, done, total: steps.append(total)
    probe.fuse(probe.empty(), ["digit", "count"])
    assert steps and set(steps) == {2 * 2 * 1}  # epochs x tasks x batches
    assert probe.features("digit", "train") is trainer.features("digit", "train")


def test_a_fresh_adapters_cached_first_head_trains_the_same_weights(trainer):
    # Two trainers at the same adapter count: the first fits digit's head, the second reuses it.
    a = trainer.with_config(trainer.config)
    a._first_heads = {}
    first = a.fuse(a.empty(), ["digit"])
    b = a.with_config(a.config)
    assert len(b._first_heads) == 1
    second = b.fuse(b.empty(), ["digit"])
    for k, (wa, wb) in first.lora.items():
        assert torch.equal(wa, second.lora[k][0]) and torch.equal(wb, second.lora[k][1])
    assert all(torch.equal(x, y) for x, y in zip(first.heads["digit"], second.heads["digit"]))


def test_fusion_order_records_the_probe(trainer):
    from services.generator import pipeline

    with pytest.raises(ValueError):
        pipeline.fusion_order(trainer, ["digit", "count"], {}, "sorted")
    order, record = pipeline.fusion_order(trainer, ["digit", "count"], {"digit": 0.0, "count": 0.0}, "given")
    assert order == ["digit", "count"] and record == {"rule": "given", "order": order}
    probes = []
    thresholds = {"digit": 0.0, "count": 2.0}
    order, record = pipeline.fusion_order(
        trainer, ["count", "digit"], thresholds, "probed", 1, 1, on_probe=lambda g, a: probes.append(g)
    )
    assert probes == [("count",), ("digit",), ("count", "digit")]
    assert order == ["digit", "count"]  # count misses its threshold even alone: last
    assert record["rule"] == "probed" and record["given"] == ["count", "digit"] and record["order"] == order
    assert record["probe_budget"] == {"epochs": 1, "batches_per_epoch": 1, "batch_size": 4}
    probe = record["probe"]
    assert probe["trainings"] == 3 and probe["seconds"] >= 0
    assert set(probe["paired"]["digit"]["count"]) == {"digit"} and set(probe["alone"]["count"]) == {"count"}


def test_generate_with_the_probed_order(model_path, tmp_path):
    from services.generator.__main__ import app

    out = tmp_path / "gen"
    args = ["generate", "--model-path", str(model_path), "--out", str(out), "--order", "count,digit"]
    args += ["--limit", "8", "--rank", "2", "--epochs", "1", "--batch-size", "4", "--threads", "1"]
    args += ["--threshold", "count=0", "--threshold", "digit=0", "--probe-epochs", "1", "--probe-batches", "1"]
    bad = CliRunner().invoke(app, [*args, "--fusion-order", "best"])
    assert bad.exit_code == 2 and "given, probed" in bad.output
    result = CliRunner().invoke(app, [*args, "--fusion-order", "probed"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    record = manifest["greedy"]["fusion_order"]
    assert record["rule"] == "probed" and record["given"] == ["count", "digit"]
    assert manifest["order"] == record["order"] and sorted(record["order"]) == ["count", "digit"]
    assert record["probe"]["trainings"] == 3 and "probed order:" in result.output


def store_settings(tmp_path, model_path):
    """A store on SQLite and a blob directory under tmp_path, on a free port."""
    from services.adapter_store.config import StoreSettings

    return StoreSettings(
        database_url=f"sqlite:///{tmp_path / 'd.db'}",
        blob_dir=str(tmp_path / "blobs"),
        model_path=str(model_path),
        gc_interval_s=0,
        port=0,
    )


def test_a_job_with_the_probed_order_records_the_order_it_fused_in(model_path, tmp_path):
    from services.adapter_store.testing import RunningStore
    from services.generator.runner import Runner, RunnerSettings
    from valora import cli
    from valora_protos.v1 import admin_service_pb2 as admin_pb
    from valora_protos.v1 import resources_pb2 as res

    settings = store_settings(tmp_path, model_path)
    with RunningStore(settings) as rs:
        args = ["generate", "--address", rs.address, "--base-model", str(model_path), "--rank", "2", "--epochs", "1"]
        args += ["--limit", "8", "--source", "count:0.99", "--source", "digit:0", "--job-id", "po"]
        bad = CliRunner().invoke(cli.app, [*args, "--fusion-order", "best"])
        assert bad.exit_code != 0 and "job.fusion_order" in bad.output
        result = CliRunner().invoke(cli.app, [*args, "--fusion-order", "probed"])
        assert result.exit_code == 0, result.output
        job = rs.admin.GetGenerationJob(admin_pb.GetGenerationJobRequest(name="generationJobs/po")).job
        assert job.fusion_order == "probed"
        runner = Runner(RunnerSettings(adapter_store_address=rs.address, runner_name="t", poll_s=0.01, batch_size=4))
        try:
            final = runner.run_once()
        finally:
            runner.close()
    assert final is not None and final.state == res.GENERATION_JOB_STATE_SUCCEEDED, final
    # count (threshold 0.99) is below its threshold even after its brief probe: fused last
    assert list(final.result.fused_order) == ["digit", "count"]
    assert sorted(t.task for t in final.result.tasks) == ["tasks/po-count", "tasks/po-digit"]


def test_the_report_labels_each_order_and_its_min_margin():
    from bench.generation_order import given_orders
    from bench.generation_report import render

    assert given_orders(["a", "b", "c"], ["default", "reversed", "c,a,b"]) == {
        "default": ["a", "b", "c"],
        "reversed": ["c", "b", "a"],
        "c,a,b": ["c", "a", "b"],
    }
    row = lambda label, acc, probe=None: {
        "strategy": "greedy-fusion",
        "n_adapters": 1,
        "tasks": {"a": {"accuracy": acc, "threshold": 0.5, "adapter": "fused-0"}},
        "fusion_order": {"rule": "probed" if probe else "given", "label": label, "order": ["a"], "probe": probe},
        "setup": {"margin": 0.03},
    }
    text = render([row("default", 0.6), row("probed", 0.45, {"trainings": 1, "seconds": 2.0})])
    assert "| greedy-fusion (default order) | 1 | 0.600 | yes | +0.100 |" in text
    assert "| greedy-fusion (probed order) | 1 | 0.450 | no | -0.050 |" in text
    assert "(probes: 1 trainings in 2 s)" in text


def test_a_probed_jobs_result_holds_the_probe_matrix_it_chose_from(model_path, tmp_path, monkeypatch):
    import itertools

    from services.adapter_store.testing import RunningStore
    from services.generator import pipeline
    from services.generator.runner import Runner, RunnerSettings
    from valora import cli
    from valora_protos.v1 import admin_service_pb2 as admin_pb
    from valora_protos.v1 import resources_pb2 as res

    measured = []

    def probe_interference(*args, **kw):
        measured.append(real(*args, **kw))
        return measured[-1]

    real = pipeline.probe_interference
    monkeypatch.setattr(pipeline, "probe_interference", probe_interference)
    settings = store_settings(tmp_path, model_path)
    sources = ["count:0.99", "digit:0", "parity:0"]
    with RunningStore(settings) as rs:
        args = ["generate", "--address", rs.address, "--base-model", str(model_path), "--rank", "2", "--epochs", "1"]
        args += ["--limit", "8", "--job-id", "pm", "--fusion-order", "probed"]
        args += [a for s in sources for a in ("--source", s)]
        assert CliRunner().invoke(cli.app, args).exit_code == 0
        runner = Runner(RunnerSettings(adapter_store_address=rs.address, runner_name="t", poll_s=0.01, batch_size=4))
        try:
            final = runner.run_once()
        finally:
            runner.close()
        assert final is not None and final.state == res.GENERATION_JOB_STATE_SUCCEEDED, final
        # what the admin API returns: the result as the store kept it
        job = rs.admin.GetGenerationJob(admin_pb.GetGenerationJobRequest(name="generationJobs/pm")).job
        shown = CliRunner().invoke(cli.app, ["jobs", "get", "pm", "--address", rs.address])
    assert shown.exit_code == 0, shown.output
    [inter] = measured
    probe = job.result.probe
    assert list(probe.given_order) == ["count", "digit", "parity"]
    pairs = [(p.first, p.second) for p in probe.pairs]
    assert pairs == list(itertools.combinations(["count", "digit", "parity"], 2))  # one entry per probed pair
    for p in probe.pairs:
        a, b = p.first, p.second
        assert p.first_accuracy == pytest.approx(inter.paired[a][b][a], abs=1e-4)
        assert p.second_accuracy == pytest.approx(inter.paired[b][a][b], abs=1e-4)
        assert p.first_drop == pytest.approx(inter.alone[a][a] - inter.paired[a][b][a], abs=1e-4)
        assert p.second_drop == pytest.approx(inter.alone[b][b] - inter.paired[b][a][b], abs=1e-4)
    assert dict(probe.alone) == pytest.approx({t: acc[t] for t, acc in inter.alone.items()}, abs=1e-4)
    assert probe.trainings == inter.trainings == 6 and probe.epochs == 2 and probe.rule
    # the order is the planned adapters one after another; count (threshold .99) is planned last
    assert [t for a in probe.planned for t in a.tasks] == list(job.result.fused_order)
    assert list(probe.planned[-1].tasks) == ["count"] and probe.planned[-1].predicted_margins["count"] < 0
    # and `valora jobs get` shows the matrix
    assert "interference probes" in shown.output and "planned adapters" in shown.output
    drop = next(p for p in probe.pairs if (p.first, p.second) == ("digit", "parity")).first_drop
    assert f"{drop:+.3f}" in shown.output


def test_the_conflict_task_set_its_orders_and_the_full_budget_drops():
    from bench.generation_order import NAMED_ORDERS, TASK_SETS, correlation, drops, given_orders
    from services.generator.datasets import TASKS
    from services.generator.fusion import Interference

    names = list(TASK_SETS["conflict"])
    assert set(names) <= set(TASKS)
    orders = given_orders(names, ["default", "grouped", "reversed"], named=NAMED_ORDERS["conflict"])
    assert orders["default"] == names and sorted(orders["grouped"]) == sorted(names)
    assert orders["reversed"] == names[::-1]
    inter = Interference(
        ("a", "b"), {"a": {"a": 0.9}, "b": {"b": 0.8}}, {"a": {"b": {"a": 0.7}}, "b": {"a": {"b": 0.85}}}
    )
    assert drops(inter) == {"a|b": pytest.approx(0.2), "b|a": pytest.approx(-0.05)}
    assert correlation([0.0, 1.0, 2.0], [1.0, 3.0, 5.0]) == 1.0 and correlation([1.0], [2.0]) is None
