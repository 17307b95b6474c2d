"""Observability and the other fronts, on a real cluster (four processes on loopback):
Prometheus `/metrics` of every process after a few requests, one trace across the gateway,
scheduler and worker processes (console exporter → their logs), the OpenAI-compatible HTTP API
through the `openai` SDK, and the curl / Node streaming examples."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import openai
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from services.common.adapter_format import BaseModelShapes, make_random_bundle
from valora.client import ValoraClient
from valora.cluster import start_cluster, stop_cluster

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
MAX_NEW = 6
TRACE_ID = "5bf92f3577b34da6a3ce929d0e0e4736"


def png(seed: int, size: int = 56) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_path):
    home = tmp_path_factory.mktemp("valora-obs")
    c = start_cluster(home, workers=1, model_path=model_path, env={"VALORA_TRACE_CONSOLE": "true"})
    yield c
    stop_cluster(home)


@pytest.fixture(scope="module")
def adapter(cluster, model_path) -> str:
    shapes = BaseModelShapes.from_config(json.loads((model_path / "config.json").read_text()))
    bundle, cfg = make_random_bundle(shapes, rank=4, seed=7, lora_alpha=8)
    with ValoraClient(cluster.gateway) as client:
        version = client.upload_adapter_version("obs", bundle, cfg, request_id="obs-upload")
        client.set_alias("adapters/obs", "prod", version.name)
        client.set_alias("adapters/obs", "traced", version.name)  # resolved only by the trace test
    return "adapters/obs@prod"


# A task with a latency objective no CPU request misses (10 min): its request counts as within.
# Its early release policy releases the adapter of its request halfway (EOS banned: all MAX_NEW).
SLO_TASK, SLO_CLASS, SLO_MS, RELEASE_FRACTION = "obs-video", "video", 600_000.0, 0.5


@pytest.fixture(scope="module")
def traffic(cluster, adapter, no_eos) -> int:
    """A few requests through gRPC (unary, streaming, base, adapter and a task with a latency
    objective and an early release policy); returns how many."""
    with ValoraClient(cluster.gateway) as client:
        client.create_task(
            SLO_TASK, adapter, slo_ms=SLO_MS, slo_class=SLO_CLASS, adapter_release_fraction=RELEASE_FRACTION
        )
        client.infer("What is this?", [png(1)], adapter=adapter, max_new_tokens=MAX_NEW)
        client.infer("What is this?", [png(2)], max_new_tokens=MAX_NEW)
        list(client.infer_stream("Describe it.", [png(3)], adapter=adapter, max_new_tokens=MAX_NEW))
        r = client.infer("What is this?", [png(4)], task=f"tasks/{SLO_TASK}", max_new_tokens=MAX_NEW, logit_bias=no_eos)
        assert r.output_tokens == MAX_NEW
    return 4


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(samples, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, lbl), v in samples.items() if n == name and want <= lbl)


def has(samples, name: str) -> bool:
    return any(n == name for n, _ in samples)


def registered_series() -> dict[str, tuple[str, set[str]]]:
    """Every series services/common/metrics.py registers (all of valora's), by the sample that
    shows it counted (a counter's `_total`, a histogram's `_count`, a gauge's own name) -> its
    type and the names of all its samples."""
    from prometheus_client.metrics import MetricWrapperBase

    from services.common import metrics

    suffixes = {
        "counter": ("_total", "_created"),
        "gauge": ("",),
        "histogram": ("_count", "_sum", "_bucket", "_created"),
    }
    out = {}
    for metric in vars(metrics).values():
        if isinstance(metric, MetricWrapperBase):
            family = metric.describe()[0]
            kind = suffixes[family.type]
            out[family.name + kind[0]] = (family.type, {family.name + suffix for suffix in kind})
    return out


# Registered series the traffic cannot count, with why; each is still exported (at zero from
# start-up, metrics.init_worker). Every other registered series must count in this run.
NOT_COUNTED = {
    "valora:num_preemptions_total": "a preemption needs running requests that outgrow the KV pool; the traffic's "
    "requests run one at a time on the default pool (tests/unit/test_worker_server.py "
    "preempts on a tight one)",
}


def test_metrics_of_every_process_after_requests(cluster, traffic):
    gateway = scrape(cluster.by_service("gateway")[0].metrics_url)
    scheduler = scrape(cluster.by_service("scheduler")[0].metrics_url)
    worker_info = cluster.by_service("worker")[0]
    deadline = time.monotonic() + 10
    while True:  # the worker publishes running/mode/steps from its watch loop (every 0.5 s)
        worker = scrape(worker_info.metrics_url)
        if (
            has(worker, "valora:mode")
            and total(worker, "valora:engine_step_seconds_count", kind="decode")
            or time.monotonic() > deadline
        ):
            break
        time.sleep(0.2)

    assert total(gateway, "valora:requests_total", service="gateway", code="OK") >= traffic
    assert total(scheduler, "valora:requests_total", service="scheduler", code="OK") >= traffic
    for samples in (scheduler, worker):
        assert total(samples, "valora:e2e_request_latency_seconds_count", code="OK") >= traffic
        assert total(samples, "valora:time_to_first_token_seconds_count") >= traffic
        assert total(samples, "valora:e2e_request_latency_seconds_sum") > 0
    assert total(scheduler, "valora:e2e_request_latency_seconds_count", adapter="base") >= 1
    assert has(scheduler, "valora:num_requests_waiting")
    # The task's objective went store → gateway → scheduler, which counted its request per class.
    assert total(scheduler, "valora:slo_requests_total", slo_class=SLO_CLASS, outcome="within") == 1
    assert total(scheduler, "valora:slo_requests_total", outcome="over") == 0
    with ValoraClient(cluster.gateway) as client:
        task = client.get_task(SLO_TASK)
    assert (task.slo_ms, task.slo_class) == (SLO_MS, SLO_CLASS)
    assert total(scheduler, "valora:request_queue_time_seconds_count") >= traffic
    assert has(worker, "valora:num_requests_running")
    assert total(worker, "valora:request_success_total") >= traffic  # vLLM's names and meanings
    assert total(worker, "valora:generation_tokens_total") >= traffic
    assert total(worker, "valora:prompt_tokens_total") > total(worker, "valora:generation_tokens_total") > 0
    # one inter-token sample per gap (a request of n tokens: n - 1), not one mean per request
    gaps = total(worker, "valora:generation_tokens_total") - total(worker, "valora:request_success_total")
    assert total(worker, "valora:inter_token_latency_seconds_count") >= gaps > traffic
    assert has(worker, "valora:kv_cache_usage_perc")
    for name in (
        "request_prompt_tokens",
        "request_generation_tokens",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_inference_time_seconds",
    ):  # vLLM's per-request ones
        assert total(worker, f"valora:{name}_count") == total(worker, "valora:request_success_total"), name
    assert total(worker, "valora:request_prompt_tokens_sum") == total(worker, "valora:prompt_tokens_total")
    assert total(worker, "valora:engine_step_seconds_count", kind="prefill") >= 1  # every step, by kind
    assert total(worker, "valora:engine_step_seconds_count", kind="decode") >= 1
    assert total(worker, "valora:lora_adapters", where="host") >= 1  # the traffic's adapter
    for stage in ("fetch", "load"):  # its load, by stage
        assert total(worker, "valora:adapter_load_seconds_count", stage=stage) >= 1, stage
    info = [dict(lbl) for (n, lbl), _ in worker.items() if n == "valora:lora_requests_info"]
    assert len(info) == 1 and info[0]["max_lora"].isdigit(), info  # one series: the worker's adapters now
    modes = {dict(lbl)["mode"]: v for (n, lbl), v in worker.items() if n == "valora:mode"}
    assert sum(modes.values()) == 1, f"exactly one current mode per worker: {modes}"
    assert all(dict(lbl)["worker"] == worker_info.name for (n, lbl), _ in worker.items() if n == "valora:mode")
    # vLLM's scheduler series: one iteration_tokens sample per engine step, its prefill tokens +
    # decode rows (a request's first token comes from its prefill: p + n - 1 <= sum <= p + n);
    # no preemption (the requests ran one at a time; NOT_COUNTED)
    prompt, generated = total(worker, "valora:prompt_tokens_total"), total(worker, "valora:generation_tokens_total")
    finished = total(worker, "valora:request_success_total")
    deadline = time.monotonic() + 10
    while True:  # the steps are published from the watch loop (every 0.5 s), the results at once
        worker = scrape(worker_info.metrics_url)
        if (
            total(worker, "valora:iteration_tokens_total_sum") >= prompt + generated - finished
            or time.monotonic() > deadline
        ):
            break
        time.sleep(0.2)
    steps = total(worker, "valora:engine_step_seconds_count")
    assert total(worker, "valora:iteration_tokens_total_count") == steps >= traffic
    assert prompt + generated - finished <= total(worker, "valora:iteration_tokens_total_sum") <= prompt + generated
    assert total(worker, "valora:num_preemptions_total", worker=worker_info.name) == 0
    assert has(worker, "valora:num_preemptions_total")  # exported from start-up
    # the traffic's early release (its task's policy): counted by the worker
    assert total(worker, "valora:adapter_releases_total") == 1
    assert total(worker, "valora:adapter_released_tokens_total") == MAX_NEW - MAX_NEW * RELEASE_FRACTION

    # Every series the code registers counted in some process after the traffic (a counter or a
    # histogram above zero, a gauge set), or listed in NOT_COUNTED with why; and nothing emitted
    # under valora: that metrics.py does not register (the list is complete).
    series = registered_series()
    assert len(series) > 25 and set(NOT_COUNTED) <= set(series), set(NOT_COUNTED) - set(series)
    every = [item for p in cluster.processes for item in scrape(p.metrics_url).items()]
    exported = {name for (name, _), _ in every}
    counted = {name for (name, _), value in every if name in series and (value > 0 or series[name][0] == "gauge")}
    missing = sorted(set(series) - counted - set(NOT_COUNTED))
    assert missing == [], f"registered series the traffic did not count: {missing}"
    assert set(NOT_COUNTED) <= exported, sorted(set(NOT_COUNTED) - exported)
    known = {sample for _, samples in series.values() for sample in samples}
    unregistered = sorted(name for name in exported if name.startswith("valora:") and name not in known)
    assert unregistered == [], f"emitted but not in services/common/metrics.py: {unregistered}"


DASHBOARD = REPO / "deploy" / "grafana" / "valora-dashboard.json"
# The `service` label Prometheus adds to each process's samples (deploy/prometheus/prometheus.yml).
SCRAPE_SERVICE = {"gateway": "gateway", "scheduler": "scheduler", "adapter_store": "adapter-store", "worker": "worker"}


def _matches(labels: dict, matchers: str) -> bool:
    """Whether a sample's labels satisfy a PromQL selector's matchers (`k="v"`, `!=`, `=~`, `!~`)."""
    for key, op, value in re.findall(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"', matchers):
        have = labels.get(key, "")
        hit = have == value if op in ("=", "!=") else re.fullmatch(value, have) is not None
        if hit == (op.startswith("!")):
            return False
    return True


def test_every_dashboard_panel_has_series_after_requests(cluster, traffic):
    """Each selector of every panel of deploy/grafana/valora-dashboard.json matches a sample some
    process emits after the traffic and one failed call (the errors panel's): no panel queries
    a series nothing emits, or one that appears only after an event the panel waits for (a mode
    switch) and reads "No data" until then."""
    with pytest.raises(grpc.RpcError), ValoraClient(cluster.gateway, retries=0) as client:
        client.infer("hi", adapter="adapters/nope", max_new_tokens=MAX_NEW)
    dash = json.loads(DASHBOARD.read_text())
    selectors = {
        (p["title"], m.group(1), m.group(2) or "")
        for p in dash["panels"]
        if p["type"] != "row"
        for t in p["targets"]
        for m in re.finditer(r"(valora:[a-z0-9_]+)(\{[^}]*\})?", t["expr"])
    }
    assert len(selectors) > 20
    deadline = time.monotonic() + 10
    while True:  # the worker publishes its engine's steps, mode and pool from a loop (every 0.5 s)
        samples = [
            (name, {**dict(lbl), "service": SCRAPE_SERVICE[p.service]})
            for p in cluster.processes
            for name, lbl in scrape(p.metrics_url)
        ]
        empty = sorted(
            (title, name + matchers)
            for title, name, matchers in selectors
            if not any(n == name and _matches(lbl, matchers) for n, lbl in samples)
        )
        if not empty or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert empty == [], f"panels with no series: {empty}"


def spans_in(log: str) -> list[dict]:
    """The console exporter's JSON span objects among a service's log lines."""
    text = Path(log).read_text()
    out = []
    for block in re.findall(r"^\{\n.*?^\}$", text, flags=re.M | re.S):
        try:
            span = json.loads(block)
        except json.JSONDecodeError:
            continue
        if "context" in span:
            out.append(span)
    return out


def test_one_trace_across_the_gateway_scheduler_and_worker_processes(cluster, adapter):
    import grpc

    from valora_protos.v1 import inference_service_pb2, inference_service_pb2_grpc

    # a reference no other request used: the gateway asks the store (it reuses READY resolutions)
    traced = adapter.replace("@prod", "@traced")
    with grpc.insecure_channel(cluster.gateway) as channel:
        stub = inference_service_pb2_grpc.InferenceServiceStub(channel)
        stub.Infer(
            inference_service_pb2.InferRequest(
                input=inference_service_pb2.InferenceInput(
                    prompt="Traced?", adapter=traced, params={"max_new_tokens": 2}
                )
            ),
            metadata=(("traceparent", f"00-{TRACE_ID}-00f067aa0ba902b7-01"),),
            timeout=60,
        )
    want = {
        "gateway": {
            "valora.v1.InferenceService/Infer",
            "valora.internal.v1.SchedulerService/Submit",
            "valora.internal.v1.AdapterStoreService/ResolveReference",
        },
        "scheduler": {"valora.internal.v1.SchedulerService/Submit", "valora.internal.v1.WorkerService/Generate"},
        "worker": {"valora.internal.v1.WorkerService/Generate"},
        "adapter_store": {"valora.internal.v1.AdapterStoreService/ResolveReference"},
    }
    deadline = time.monotonic() + 10
    while True:
        got = {
            service: {
                s["name"]
                for p in cluster.by_service(service)
                for s in spans_in(p.log)
                if s["context"]["trace_id"] == f"0x{TRACE_ID}"
            }
            for service in want
        }
        if all(want[s] <= got[s] for s in want) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert all(want[s] <= got[s] for s in want), got


def test_openai_sdk_against_the_real_model(cluster, adapter):
    client = openai.OpenAI(base_url=cluster.http_url, api_key="unused", max_retries=0, timeout=60)
    url = "data:image/png;base64," + base64.b64encode(png(4)).decode()
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in the picture?"},
                {"type": "image_url", "image_url": {"url": url}},
            ],
        }
    ]
    unary = client.chat.completions.create(model=adapter, messages=messages, max_tokens=MAX_NEW, temperature=0)
    streamed = client.chat.completions.create(
        model=adapter, messages=messages, max_tokens=MAX_NEW, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert unary.choices[0].message.content and unary.usage.completion_tokens > 0
    assert text == unary.choices[0].message.content
    assert {"valora-base", "adapters/obs", adapter} <= {m.id for m in client.models.list().data}
    client.close()


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl missing")
def test_curl_example(cluster, adapter, tmp_path):
    image = tmp_path / "x.png"
    image.write_bytes(png(5))
    script = str(REPO / "examples/curl/chat.sh")
    out = subprocess.run(
        ["bash", script, cluster.http_url, adapter, 'Say "hi"', str(image)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "MAX_TOKENS": "4"},
    )
    assert out.returncode == 0, out.stderr + out.stdout
    body = json.loads(out.stdout)
    assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] > 0
    streamed = subprocess.run(
        ["bash", script, cluster.http_url, "valora-base", "hi"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "STREAM": "1", "MAX_TOKENS": "3"},
    )
    assert streamed.returncode == 0, streamed.stderr
    events = [line for line in streamed.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3
    refused = subprocess.run(
        ["bash", script, cluster.http_url, "valora-base", "hi", "/nonexistent.png"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert refused.returncode != 0


@pytest.mark.skipif(
    shutil.which("node") is None or not (REPO / "examples/node/node_modules").exists(),
    reason="node or examples/node/node_modules missing (npm ci in examples/node)",
)
def test_node_streaming_example(cluster, adapter, tmp_path):
    image = tmp_path / "x.png"
    image.write_bytes(png(6))
    out = subprocess.run(
        ["node", str(REPO / "examples/node/infer_stream.js"), cluster.gateway, "Hello", str(image), adapter],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    deltas = "".join(line["delta"] for line in lines if "delta" in line)
    result = lines[-1]["result"]
    assert deltas == result["text"] and result["adapter_version"].startswith("adapters/obs/versions/")
