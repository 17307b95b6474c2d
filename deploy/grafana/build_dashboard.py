"""Writes valora-dashboard.json (Grafana) from the metric definitions in
services/common/metrics.py. Edit here, then run:

    python deploy/grafana/build_dashboard.py

tests/unit/test_deploy.py checks that the committed JSON is this script's output.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).with_name("valora-dashboard.json")
DS = {"type": "prometheus", "uid": "${datasource}"}
RATE = "[$__rate_interval]"
# TTFT and e2e latency are observed twice: by the scheduler (arrival there, queue included: what
# clients see) and by each worker (arrival at the worker). Latency panels show the scheduler's.
# `service` is the scrape target's label: "scheduler" in compose, "<release>-scheduler" under the
# Prometheus Operator, hence the regex.
AT_SCHEDULER = '{service=~"(.*-)?scheduler"}'
AT_GATEWAY = '{service=~"(.*-)?gateway"}'


def quantiles(metric: str, by: str = "", where: str = "") -> list[dict]:
    """p50/p90/p99 from a histogram's buckets, plus the mean from _sum/_count."""
    group = f"le, {by}" if by else "le"
    legend = f"{{{{{by}}}}} " if by else ""
    targets = [
        {
            "expr": f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{where}{RATE})))",
            "legendFormat": f"{legend}p{round(q * 100)}",
        }
        for q in (0.5, 0.9, 0.99)
    ]
    agg = f"sum by ({by})" if by else "sum"
    targets.append(
        {
            "expr": f"{agg} (rate({metric}_sum{where}{RATE})) / {agg} (rate({metric}_count{where}{RATE}))",
            "legendFormat": f"{legend}mean",
        }
    )
    return targets


class Board:
    def __init__(self) -> None:
        self.panels: list[dict] = []
        self.y = 0

    def _id(self) -> int:
        return len(self.panels) + 1

    def row(self, title: str) -> None:
        self.panels.append(
            {
                "type": "row",
                "id": self._id(),
                "title": title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y},
                "panels": [],
            }
        )
        self.y += 1

    def stats(self, items: list[tuple[str, str, str, str]]) -> None:
        width = 24 // len(items)
        for i, (title, desc, expr, unit) in enumerate(items):
            self.panels.append(
                {
                    "type": "stat",
                    "id": self._id(),
                    "title": title,
                    "description": desc,
                    "datasource": DS,
                    "gridPos": {"h": 4, "w": width, "x": i * width, "y": self.y},
                    "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                    "options": {
                        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                        "colorMode": "value",
                        "graphMode": "area",
                        "textMode": "auto",
                    },
                    "targets": [{"datasource": DS, "refId": "A", "expr": expr}],
                }
            )
        self.y += 4

    def series(self, items: list[tuple[str, str, list[dict], str]], step: bool = False) -> None:
        width = 24 // len(items)
        for i, (title, desc, targets, unit) in enumerate(items):
            custom = {"lineWidth": 1, "fillOpacity": 10}
            if step:
                custom["lineInterpolation"] = "stepAfter"
            self.panels.append(
                {
                    "type": "timeseries",
                    "id": self._id(),
                    "title": title,
                    "description": desc,
                    "datasource": DS,
                    "gridPos": {"h": 8, "w": width, "x": i * width, "y": self.y},
                    "fieldConfig": {"defaults": {"unit": unit, "custom": custom}, "overrides": []},
                    "options": {
                        "legend": {"displayMode": "list", "placement": "bottom"},
                        "tooltip": {"mode": "multi", "sort": "desc"},
                    },
                    "targets": [dict(datasource=DS, refId=chr(65 + j), **t) for j, t in enumerate(targets)],
                }
            )
        self.y += 8


def build() -> dict:
    b = Board()
    b.stats(
        [
            (
                "Requests running",
                "In the workers' running batches (valora:num_requests_running).",
                "sum(valora:num_requests_running)",
                "short",
            ),
            (
                "Requests waiting",
                "In the scheduler's queue (valora:num_requests_waiting).",
                "sum(valora:num_requests_waiting)",
                "short",
            ),
            (
                "TTFT p90",
                "Time to first token, 90th percentile over 5m.",
                "histogram_quantile(0.9, sum by (le) (rate(valora:time_to_first_token_seconds_bucket"
                f"{AT_SCHEDULER}[5m])))",
                "s",
            ),
            (
                "Mode switches (1h)",
                "Merge/unmerge/switch operations in the last hour (valora:mode_switches_total).",
                "sum(increase(valora:mode_switches_total[1h]))",
                "short",
            ),
            (
                "Adapter swaps (1h)",
                "Adapter copies host to device and evictions in the last hour (valora:adapter_swaps_total).",
                "sum(increase(valora:adapter_swaps_total[1h]))",
                "short",
            ),
            (
                "Errors (5m)",
                "Requests answered with a non-OK status at the gateway in the last 5 minutes (valora:requests_total).",
                'sum(increase(valora:requests_total{code!="OK", ' + AT_GATEWAY[1:-1] + "}[5m]))",
                "short",
            ),
        ]
    )
    b.row("Load")
    b.series(
        [
            (
                "Requests running by worker",
                "valora:num_requests_running.",
                [{"expr": "sum by (worker) (valora:num_requests_running)", "legendFormat": "{{worker}}"}],
                "short",
            ),
            (
                "Requests waiting",
                "valora:num_requests_waiting (scheduler queue).",
                [{"expr": "sum(valora:num_requests_waiting)", "legendFormat": "waiting"}],
                "short",
            ),
            (
                "Finished requests by status",
                "valora:requests_total per service and status code.",
                [
                    {
                        "expr": f"sum by (service, code) (rate(valora:requests_total{RATE}))",
                        "legendFormat": "{{service}} {{code}}",
                    }
                ],
                "reqps",
            ),
        ]
    )
    b.row("Latency")
    b.series(
        [
            (
                "Time to first token",
                "valora:time_to_first_token_seconds (arrival to first token).",
                quantiles("valora:time_to_first_token_seconds", where=AT_SCHEDULER),
                "s",
            ),
            (
                "Inter-token latency",
                "valora:inter_token_latency_seconds.",
                quantiles("valora:inter_token_latency_seconds"),
                "s",
            ),
        ]
    )
    b.series(
        [
            (
                "End-to-end request latency",
                "valora:e2e_request_latency_seconds (arrival to last token).",
                quantiles("valora:e2e_request_latency_seconds", where=AT_SCHEDULER),
                "s",
            ),
            (
                "Queue time",
                "valora:request_queue_time_seconds (time waiting in the scheduler queue).",
                quantiles("valora:request_queue_time_seconds"),
                "s",
            ),
        ]
    )
    b.series(
        [
            (
                "TTFT p90 by adapter",
                "valora:time_to_first_token_seconds, 90th percentile per adapter.",
                [
                    {
                        "expr": "histogram_quantile(0.9, sum by (le, adapter) "
                        "(rate(valora:time_to_first_token_seconds_bucket"
                        f"{AT_SCHEDULER}{RATE})))",
                        "legendFormat": "{{adapter}}",
                    }
                ],
                "s",
            ),
            (
                "E2E p90 by adapter",
                "valora:e2e_request_latency_seconds, 90th percentile per adapter.",
                [
                    {
                        "expr": "histogram_quantile(0.9, sum by (le, adapter) "
                        "(rate(valora:e2e_request_latency_seconds_bucket"
                        f"{AT_SCHEDULER}{RATE})))",
                        "legendFormat": "{{adapter}}",
                    }
                ],
                "s",
            ),
        ]
    )
    b.series(
        [
            (
                "SLO attainment by class",
                "valora:slo_requests_total: share of the requests of tasks with a latency "
                "objective that finished within it, per SLO class.",
                [
                    {
                        "expr": f'sum by (slo_class) (rate(valora:slo_requests_total{{outcome="within"}}{RATE})) / '
                        f"sum by (slo_class) (rate(valora:slo_requests_total{RATE}))",
                        "legendFormat": "{{slo_class}}",
                    }
                ],
                "percentunit",
            ),
        ]
    )
    b.row("Tokens and KV cache")
    b.series(
        [
            (
                "Tokens per second",
                "valora:prompt_tokens_total and valora:generation_tokens_total.",
                [
                    {"expr": f"sum(rate(valora:prompt_tokens_total{RATE}))", "legendFormat": "prompt"},
                    {"expr": f"sum(rate(valora:generation_tokens_total{RATE}))", "legendFormat": "generation"},
                ],
                "short",
            ),
            (
                "KV cache usage by worker",
                "valora:kv_cache_usage_perc (share of the paged KV pool in use).",
                [{"expr": "max by (worker) (valora:kv_cache_usage_perc)", "legendFormat": "{{worker}}"}],
                "percentunit",
            ),
            (
                "Finished requests by reason",
                "valora:request_success_total per finished_reason (stop, length).",
                [
                    {
                        "expr": f"sum by (finished_reason) (rate(valora:request_success_total{RATE}))",
                        "legendFormat": "{{finished_reason}}",
                    }
                ],
                "reqps",
            ),
        ]
    )
    b.row("Modes and adapters")
    b.series(
        [
            (
                "Inference mode by worker",
                "valora:mode: 1 for each worker's current mode (merged, unmerged, mixture).",
                [{"expr": "max by (worker, mode) (valora:mode) == 1", "legendFormat": "{{worker}} {{mode}}"}],
                "short",
            ),
        ],
        step=True,
    )
    b.series(
        [
            (
                "Mode switches",
                "valora:mode_switches_total per worker and kind (merge, unmerge, switch).",
                [
                    {
                        "expr": f"sum by (worker, kind) (rate(valora:mode_switches_total{RATE}))",
                        "legendFormat": "{{worker}} {{kind}}",
                    }
                ],
                "ops",
            ),
            (
                "Adapter swaps",
                "valora:adapter_swaps_total per worker and direction (host to device, evicted).",
                [
                    {
                        "expr": f"sum by (worker, direction) (rate(valora:adapter_swaps_total{RATE}))",
                        "legendFormat": "{{worker}} {{direction}}",
                    }
                ],
                "ops",
            ),
        ]
    )
    b.row("Engine")
    b.series(
        [
            (
                "Engine step time",
                "valora:engine_step_seconds by kind (prefill: a prefill forward, decode beside it or not; decode).",
                [
                    {
                        "expr": "histogram_quantile(0.5, sum by (le, kind) "
                        f"(rate(valora:engine_step_seconds_bucket{RATE})))",
                        "legendFormat": "p50 {{kind}}",
                    },
                    {
                        "expr": "histogram_quantile(0.99, sum by (le, kind) "
                        f"(rate(valora:engine_step_seconds_bucket{RATE})))",
                        "legendFormat": "p99 {{kind}}",
                    },
                ],
                "s",
            ),
            (
                "Adapters loaded",
                "valora:lora_adapters per worker: resident in the device pool, and loaded on the host.",
                [{"expr": "sum by (worker, where) (valora:lora_adapters)", "legendFormat": "{{worker}} {{where}}"}],
                "short",
            ),
        ]
    )
    b.series(
        [
            (
                "Adapter load time",
                "valora:adapter_load_seconds by stage: fetch (adapter store or disk cache) and load "
                "(validation, parse, into the host pool).",
                [
                    {
                        "expr": "histogram_quantile(0.5, sum by (le, stage) "
                        f"(rate(valora:adapter_load_seconds_bucket{RATE})))",
                        "legendFormat": "p50 {{stage}}",
                    },
                    {
                        "expr": "histogram_quantile(0.99, sum by (le, stage) "
                        f"(rate(valora:adapter_load_seconds_bucket{RATE})))",
                        "legendFormat": "p99 {{stage}}",
                    },
                ],
                "s",
            ),
        ]
    )
    return {
        "uid": "valora-overview",
        "title": "valora",
        "description": "valora multi-LoRA serving: load, latency, inference modes, adapters, engine steps.",
        "tags": ["valora"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "annotations": {"list": []},
        "links": [],
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {"text": "Prometheus", "value": "valora-prometheus"},
                    "hide": 0,
                    "refresh": 1,
                    "regex": "",
                    "options": [],
                }
            ]
        },
        "panels": b.panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
