"""Per-application latency objectives (valora.v1.Task.slo_ms and slo_class) in the scheduler.

A request that named a task with an objective carries it in its WorkItem (the gateway copies it
from the resolution). Its latency is the scheduler's end to end: arrival at Submit to the end of
the call, the span E2E_LATENCY measures, which is what an application waiting on the answer sees
past the gateway.

Attainment: every such request ends as `within` (finished OK within the objective) or `over`
(finished late, or failed for a reason that is the service's: it expired in the queue, no
worker could run it, the queue was full). A request the caller gave up on (CANCELLED) or that
was refused as malformed says nothing about the service's latency and is not counted.
"""

from __future__ import annotations

from services.common import metrics

# Status codes (names, as metrics.counted reports them) of requests the service failed.
SERVICE_FAILURES = frozenset(
    {"DEADLINE_EXCEEDED", "UNAVAILABLE", "RESOURCE_EXHAUSTED", "INTERNAL", "UNKNOWN", "ABORTED"}
)


def outcome(code: str, latency_s: float, slo_ms: float) -> str | None:
    """ "within", "over", or None when the request does not count (no objective, or an end that
    says nothing about latency)."""
    if slo_ms <= 0:
        return None
    if code == "OK":
        return "within" if latency_s * 1000.0 <= slo_ms else "over"
    return "over" if code in SERVICE_FAILURES else None


def observe(slo_class: str, slo_ms: float, code: str, latency_s: float) -> None:
    """Counts one finished request in valora:slo_requests_total{slo_class, outcome}."""
    result = outcome(code, latency_s, slo_ms)
    if result is not None:
        metrics.SLO_REQUESTS.labels(metrics.slo_class_label(slo_class), result).inc()
