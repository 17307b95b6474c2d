"""`valora demo` end to end with tiny settings: a briefly pretrained base, greedy-fused adapters
generated on real data (one task, few images, one epoch), registered through the gateway of a real
cluster, the generator's whole test split answered by the task head (label requests) mixed with
text requests; the report's per-task accuracy is computed from the served labels, and every served
label is the generator's prediction for that image (so the served accuracy is the generator's test
accuracy, exactly). A second run must reuse the cached base and adapters and re-register without
error (same versions, tasks kept)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from valora.cli import app
from valora.cluster import default_model_path, start_cluster, stop_cluster

pytestmark = pytest.mark.e2e

LIMIT = 24  # split cap: the test split the demo serves whole
TINY = [
    "--tasks",
    "parity",
    "--text-requests",
    "3",
    "--epochs",
    "1",
    "--limit",
    str(LIMIT),
    "--pretrain-steps",
    "2",
    "--concurrency",
    "4",
    "--max-new-tokens",
    "3",
    "--threads",
    "1",
]


@pytest.fixture(scope="module")
def home_and_cluster(tmp_path_factory, tiny_model_copy):
    from services.generator.demo import ensure_base

    home = tmp_path_factory.mktemp("valora-demo")
    tiny_model_copy(default_model_path(home))  # where the demo looks for it (valora/cli/demo.py)
    base, _, _ = ensure_base(
        default_model_path(home), home, steps=2, seed=0, log=lambda _: None, threads=1
    )  # the demo's --threads 1: the same cached base
    cluster = start_cluster(home / "cluster", model_path=base)
    yield home, cluster
    stop_cluster(home / "cluster")


def run_demo(home: Path, gateway: str, report: Path) -> dict:
    result = CliRunner().invoke(
        app, ["demo", "--home", str(home), "--address", gateway, "--report", str(report), *TINY]
    )
    assert result.exit_code == 0, result.output + repr(result.exception)
    return json.loads(report.read_text())


def test_demo_serves_generated_adapters_and_reports_served_accuracy(home_and_cluster, tmp_path):
    home, cluster = home_and_cluster
    first = run_demo(home, cluster.gateway, tmp_path / "r1.json")
    assert first["demo"] == "generated" and first["base_cached"] and not first["generated_cached"]
    [task] = first["tasks"]
    assert task["task"] == "parity" and task["target"] == "tasks/demo-parity"
    assert task["n"] == task["test_split"] == first["generation"]["split_sizes"]["parity"]["test"] == LIMIT
    # served = offline: the served label of every test image is the generator's prediction for it
    assert task["agree"] == LIMIT and first["served_equals_generator"]
    assert task["served_accuracy"] == task["generator_accuracy_same_images"] == task["generator_test_accuracy"]
    lo, hi = task["interval_95"]
    assert lo <= task["served_accuracy"] <= hi
    assert task["adapter"] == "adapters/demo-fused-0/versions/1"
    assert task["threshold"] == first["generation"]["thresholds"]["parity"]
    assert task["meets_threshold"] == (task["served_accuracy"] >= task["threshold"])
    label_row = next(r for r in first["rows"] if r["target"] == "tasks/demo-parity")
    assert label_row["kind"] == "label" and label_row["n"] == LIMIT and label_row["modes"]
    # served accuracy is the share of served labels equal to the truth (a multiple of 1/LIMIT)
    assert abs(task["served_accuracy"] * LIMIT - round(task["served_accuracy"] * LIMIT)) < 1e-3
    assert label_row["correct"] == task["served_accuracy"]
    text_targets = {r["target"] for r in first["rows"] if r["kind"] == "text"}
    assert text_targets == {"base", "adapters/demo-fused-0@demo"}
    assert first["requests"] == LIMIT + 3 and first["label_requests"] == LIMIT

    # Again: cached base and adapters, idempotent registration (same version, task kept), same labels.
    second = run_demo(home, cluster.gateway, tmp_path / "r2.json")
    assert second["base_cached"] and second["generated_cached"]
    assert second["cache_key"] == first["cache_key"]
    assert second["registered"] == first["registered"]
    assert second["tasks"][0]["served_accuracy"] == task["served_accuracy"]


def test_every_service_freezes_its_startup_heap(home_and_cluster):
    # The worker's model and imports leave the cyclic GC's reach once it serves (no ~200 ms full
    # collections stalling the engine loop); the other services do the same.
    _, cluster = home_and_cluster
    for p in cluster.processes:
        assert "heap_frozen" in Path(p.log).read_text(errors="replace"), p.name
