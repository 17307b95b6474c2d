"""What `valora demo` measures (services/generator/demo_workload.py), on a fake client: the mixed
workload's items and their targets, each item sent as its kind of request, and the report's rows
per task (served labels against the truth and the generator's predictions) and per target."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

from services.generator import demo_workload as workload

MANIFEST = {
    "prompts": {"parity": "Odd or even?"},
    "adapters": [{"name": "demo-fused-0", "tasks": ["parity"]}],
    "test_predictions": {"parity": ["odd", "even", "odd", "even"]},
    "demo": {"single_task_accuracy": {"parity": {"val": 0.9}}},
}
REGISTERED = {
    "parity": {
        "task": "tasks/demo-parity",
        "adapter": "adapters/demo-fused-0",
        "version": "adapters/demo-fused-0/versions/1",
        "threshold": 0.5,
        "accuracy": 0.75,
    }
}


class FakeClient:
    """Answers a label request with "odd", a text request with " 7 "; records what it was sent."""

    def __init__(self):
        self.sent = []

    def infer(self, prompt, images, *, task=None, label=False, adapter=None, max_new_tokens=0):
        self.sent.append({"task": task, "label": label, "adapter": adapter, "max_new_tokens": max_new_tokens})
        return SimpleNamespace(
            label="odd" if label else "",
            text="" if label else " 7 ",
            mode="merged",
            first_token_ms=1.0,
            queue_ms=0.5,
            output_tokens=0 if label else 2,
            worker="w1",
        )


def test_percentile_and_latency_row():
    assert workload.percentile([5.0, 1.0, 3.0], 50) == 3.0 and workload.percentile([5.0, 1.0, 3.0], 99) == 5.0
    r = SimpleNamespace(mode="mixture", first_token_ms=2.0, queue_ms=1.0, output_tokens=3)
    row = workload.latency_row("base", [(10.0, r), (20.0, r)])
    assert row == {
        "target": "base",
        "n": 2,
        "modes": ["mixture"],
        "mean_ms": 15.0,
        "p50_ms": 10.0,
        "p99_ms": 20.0,
        "ttft_ms": 2.0,
        "queue_ms": 1.0,
        "output_tokens": 6,
    }


def test_the_mixed_workload_is_sent_measured_and_reported_per_task_and_target():
    work, text_targets = workload.mixed_workload(
        ["parity"], REGISTERED, MANIFEST, limit=8, per_task=4, text_requests=4, seed=0
    )
    assert text_targets == ["base", "adapters/demo-fused-0@demo"]
    labels = sorted((w for w in work if w["kind"] == "label"), key=lambda w: w["index"])
    assert [w["index"] for w in labels] == [0, 1, 2, 3]
    assert all(w["target"] == "tasks/demo-parity" and w["prompt"] == "Odd or even?" for w in labels)
    texts = [w for w in work if w["kind"] == "text"]
    assert len(texts) == 4 and {w["target"] for w in texts} == set(text_targets)
    assert work == workload.mixed_workload(["parity"], REGISTERED, MANIFEST, 8, 4, 4, seed=0)[0]  # seeded

    client = FakeClient()
    results = workload.run_workload(client, work, concurrency=2, max_new_tokens=3)
    assert [it for it, *_ in results] == work
    assert Counter((s["task"], s["label"], s["adapter"], s["max_new_tokens"]) for s in client.sent) == {
        ("tasks/demo-parity", True, None, 0): 4,
        (None, False, None, 3): 2,
        (None, False, "adapters/demo-fused-0@demo", 3): 2,
    }

    # The fake serves "odd" for every image; truths set here (the items are the results' own dicts).
    labels[0]["truth"], labels[1]["truth"], labels[2]["truth"], labels[3]["truth"] = "odd", "even", "odd", "odd"
    [row] = workload.task_rows(["parity"], results, REGISTERED, MANIFEST)
    assert row["task"] == "parity" and row["target"] == "tasks/demo-parity" and row["n"] == 4
    assert row["served_accuracy"] == 0.75 and row["agree"] == 2 and row["generator_accuracy_same_images"] == 0.75
    assert row["threshold"] == 0.5 and row["meets_threshold"] and row["test_split"] == 4
    assert row["adapter"] == "adapters/demo-fused-0/versions/1" and row["single_task_val_accuracy"] == 0.9
    assert {"mean_ms", "p50_ms", "p99_ms", "ttft_ms", "queue_ms"} <= set(row) and "modes" not in row

    rows = workload.target_rows(["tasks/demo-parity", *text_targets], results)
    assert [(r["target"], r["kind"], r["n"]) for r in rows] == [
        ("tasks/demo-parity", "label", 4),
        ("base", "text", 2),
        ("adapters/demo-fused-0@demo", "text", 2),
    ]
    assert rows[0]["correct"] == 0.75 and "sample" not in rows[0]
    assert all(len(r["sample"]) == 2 and r["sample"][0]["text"] == " 7 " for r in rows[1:])
