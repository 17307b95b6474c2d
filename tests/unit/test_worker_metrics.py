"""The worker's vLLM-compatible lora_requests_info gauge: one series a worker, naming the adapters
of its running (prefilling included) and waiting requests and its device slots."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

from prometheus_client import REGISTRY

from services.worker.worker_metrics import lora_requests_info


def seq(adapter: str | None):
    return SimpleNamespace(req=SimpleNamespace(adapter=adapter))


def series(worker: str) -> list[dict]:
    return [
        s.labels
        for m in REGISTRY.collect()
        if m.name == "valora:lora_requests_info"
        for s in m.samples
        if s.labels["worker"] == worker
    ]


def test_lora_requests_info_names_running_and_waiting_adapters_in_one_series():
    sched = SimpleNamespace(
        running=[seq("adapters/b/versions/1"), seq(None), seq("adapters/a/versions/2")],
        prefill=deque([seq("adapters/a/versions/2")]),
        waiting=deque([seq("adapters/c/versions/1")]),
        incoming=deque(),
    )
    engine = SimpleNamespace(sched=sched, config=SimpleNamespace(device_slots=4))
    labels = lora_requests_info(engine, "w-test", None)
    assert series("w-test") == [
        {
            "worker": "w-test",
            "max_lora": "4",
            "running_lora_adapters": "adapters/a/versions/2,adapters/b/versions/1",
            "waiting_lora_adapters": "adapters/c/versions/1",
        }
    ]
    sched.running, sched.prefill, sched.waiting = [], deque(), deque()  # everyone finished
    lora_requests_info(engine, "w-test", labels)
    assert series("w-test") == [
        {"worker": "w-test", "max_lora": "4", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    ]  # the old series is gone
