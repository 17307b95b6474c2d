"""Per-application latency objectives in the scheduler (services/scheduler/slo.py)."""

import pytest
from prometheus_client import REGISTRY

from services.scheduler import slo


@pytest.mark.parametrize(
    ("code", "latency_s", "slo_ms", "expected"),
    [
        ("OK", 0.2, 250.0, "within"),
        ("OK", 0.25, 250.0, "within"),  # on the objective is within it
        ("OK", 0.3, 250.0, "over"),
        ("DEADLINE_EXCEEDED", 0.1, 250.0, "over"),  # expired in the queue: the service missed it
        ("UNAVAILABLE", 0.1, 250.0, "over"),
        ("RESOURCE_EXHAUSTED", 0.0, 250.0, "over"),  # queue full
        ("CANCELLED", 9.0, 250.0, None),  # the caller left: says nothing about the service
        ("INVALID_ARGUMENT", 0.0, 250.0, None),  # the caller's own error
        ("OK", 9.0, 0.0, None),  # no objective: not counted at all
    ],
)
def test_outcome(code, latency_s, slo_ms, expected):
    assert slo.outcome(code, latency_s, slo_ms) == expected


def test_observe_counts_by_class_and_outcome():
    def count(outcome):
        return (
            REGISTRY.get_sample_value("valora:slo_requests_total", {"slo_class": "test-obs", "outcome": outcome}) or 0
        )

    before = count("within"), count("over")
    slo.observe("test-obs", 100.0, "OK", 0.05)
    slo.observe("test-obs", 100.0, "OK", 0.15)
    slo.observe("test-obs", 100.0, "UNAVAILABLE", 0.01)
    slo.observe("test-obs", 100.0, "CANCELLED", 0.01)
    slo.observe("test-obs", 0.0, "OK", 0.01)
    assert (count("within") - before[0], count("over") - before[1]) == (1, 2)
