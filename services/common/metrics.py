"""Prometheus metrics, named after vLLM's where they mean the same thing (`vllm:` → `valora:`).

Every service calls `start_metrics_server(settings.metrics_port)`; 0 disables the endpoint.
Labels whose values users choose are bounded: `adapter_label()` and `slo_class_label()` fold values
past `MAX_ADAPTER_LABELS` / `MAX_SLO_CLASS_LABELS` into "other". Series counted per event whose
label values are known up front are exported at zero from start-up (`init_service`, `init_worker`);
those of user-chosen labels (adapter, SLO class) appear with their first event.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import grpc
from prometheus_client import Counter, Gauge, Histogram, start_http_server

from services.common.errors import ValoraError

T = TypeVar("T")

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
MAX_ADAPTER_LABELS = 64
MAX_SLO_CLASS_LABELS = 32

REQUESTS_RUNNING = Gauge("valora:num_requests_running", "Requests in the engine's running batch.", ["worker"])
REQUESTS_WAITING = Gauge("valora:num_requests_waiting", "Requests queued in the scheduler.")
TIME_TO_FIRST_TOKEN = Histogram(
    "valora:time_to_first_token_seconds", "Arrival to first token.", ["adapter"], buckets=LATENCY_BUCKETS
)
INTER_TOKEN_LATENCY = Histogram(
    "valora:inter_token_latency_seconds",
    "Time between consecutive output tokens of a request (every gap).",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
)
E2E_LATENCY = Histogram(
    "valora:e2e_request_latency_seconds", "Arrival to last token.", ["adapter", "code"], buckets=LATENCY_BUCKETS
)
QUEUE_TIME = Histogram(
    "valora:request_queue_time_seconds", "Time waiting in the scheduler queue.", buckets=LATENCY_BUCKETS
)
REQUESTS_TOTAL = Counter("valora:requests_total", "Finished requests by status code.", ["service", "code"])
PROMPT_TOKENS = Counter("valora:prompt_tokens_total", "Prompt tokens prefilled (text and vision).", ["worker"])
GENERATION_TOKENS = Counter("valora:generation_tokens_total", "Tokens generated.", ["worker"])
REQUEST_SUCCESS = Counter(
    "valora:request_success_total",
    "Requests a worker finished, by why they stopped (stop: EOS, a stop sequence or a label; length: max_new_tokens).",
    ["worker", "finished_reason"],
)
# vLLM's per-request histograms (a request a worker finished): its token counts, and its time on
# the worker by phase from its first scheduling (prefill start): prefill = to the first token,
# decode = first to last token, inference = prefill start to the last token.
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
REQUEST_PROMPT_TOKENS = Histogram(
    "valora:request_prompt_tokens",
    "Prompt tokens (text and vision) of a finished request.",
    ["worker"],
    buckets=TOKEN_BUCKETS,
)
REQUEST_GENERATION_TOKENS = Histogram(
    "valora:request_generation_tokens", "Tokens a finished request generated.", ["worker"], buckets=TOKEN_BUCKETS
)
REQUEST_PREFILL_TIME = Histogram(
    "valora:request_prefill_time_seconds",
    "A finished request's prefill start to its first token.",
    ["worker"],
    buckets=LATENCY_BUCKETS,
)
REQUEST_DECODE_TIME = Histogram(
    "valora:request_decode_time_seconds",
    "A finished request's first token to its last.",
    ["worker"],
    buckets=LATENCY_BUCKETS,
)
REQUEST_INFERENCE_TIME = Histogram(
    "valora:request_inference_time_seconds",
    "A finished request's prefill start to its last token (prefill + decode).",
    ["worker"],
    buckets=LATENCY_BUCKETS,
)
ADAPTER_RELEASES = Counter(
    "valora:adapter_releases_total",
    "Finished requests whose adapter was released early "
    "(GenerationParams.adapter_release_fraction or adapter_release_rule, or their task's default).",
    ["worker"],
)
RELEASED_TOKENS = Counter(
    "valora:adapter_released_tokens_total",
    "Tokens finished requests generated on the base path after their adapter's early release (no LoRA work).",
    ["worker"],
)
KV_CACHE_USAGE = Gauge("valora:kv_cache_usage_perc", "Share of the worker's paged KV pool in use, 0 to 1.", ["worker"])
MODE = Gauge("valora:mode", "1 for the worker's current inference mode.", ["worker", "mode"])
MODE_SWITCHES = Counter("valora:mode_switches_total", "Merge/unmerge/switch operations.", ["worker", "kind"])
LORA_ADAPTERS = Gauge(
    "valora:lora_adapters",
    "Adapters loaded on a worker, by where their weights are: resident (in the device pool) or host (all loaded ones).",
    ["worker", "where"],
)
ADAPTER_SWAPS = Counter(
    "valora:adapter_swaps_total", "Adapters copied host→device or evicted.", ["worker", "direction"]
)
LORA_REQUESTS_INFO = Gauge(
    "valora:lora_requests_info",
    "vLLM's lora_requests_info: the adapters of a worker's "
    "running and waiting requests (comma-separated, sorted) and its device slots (max_lora), "
    "the value the time they were read; one series a worker.",
    ["worker", "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
)
ADAPTER_LOAD = Histogram(
    "valora:adapter_load_seconds",
    "A worker's adapter loads by stage: fetch (from the "
    "adapter store or the disk cache) and load (validation, parse, into the host pool).",
    ["worker", "stage"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
SLO_REQUESTS = Counter(
    "valora:slo_requests_total",
    "Requests of tasks with a latency objective "
    "(valora.v1.Task.slo_ms) by SLO class and outcome: within (finished within the objective) or "
    "over (finished later, or failed by the service); attainment = within / (within + over).",
    ["slo_class", "outcome"],
)
ENGINE_STEP = Histogram(
    "valora:engine_step_seconds",
    "Engine steps by what they ran: prefill (a prefill forward, decode rows beside it or not) or decode.",
    ["worker", "kind"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
# vLLM's scheduler series: the tokens each engine step ran (its prefill pieces' tokens + its decode
# rows, one token each; vLLM's buckets) and the sequences the step scheduler preempted (their KV
# blocks taken back; each is prefilled again over its prompt and generated tokens).
ITERATION_TOKENS = Histogram(
    "valora:iteration_tokens_total",
    "Tokens per engine step: prefill tokens plus decode rows.",
    ["worker"],
    buckets=(1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384),
)
NUM_PREEMPTIONS = Counter(
    "valora:num_preemptions_total",
    "Sequences the worker's step scheduler preempted (KV blocks taken back; recomputed later).",
    ["worker"],
)

# The label values of series counted per event: each is exported at zero from start-up
# (init_service, init_worker), so rate() and increase() see a series before its first event.
FINISHED_REASONS = ("stop", "length")  # vLLM's finished_reason values a worker reports
SWITCH_KINDS = ("merge", "unmerge", "switch")
SWAP_DIRECTIONS = ("in", "out")  # host→device, evicted
LOAD_STAGES = ("fetch", "load")
STEP_KINDS = ("prefill", "decode")
STATUS_CODES = tuple(code.name for code in grpc.StatusCode)


def init_service(service: str) -> None:
    """valora:requests_total{service} at zero for every status code (gateway, scheduler)."""
    for code in STATUS_CODES:
        REQUESTS_TOTAL.labels(service, code)


def init_worker(worker: str) -> None:
    """A worker's counters and per-request histograms at zero, with every label value they take."""
    for metric in (
        PROMPT_TOKENS,
        GENERATION_TOKENS,
        REQUEST_PROMPT_TOKENS,
        REQUEST_GENERATION_TOKENS,
        REQUEST_PREFILL_TIME,
        REQUEST_DECODE_TIME,
        REQUEST_INFERENCE_TIME,
        ITERATION_TOKENS,
        NUM_PREEMPTIONS,
    ):
        metric.labels(worker)
    for metric, values in (
        (REQUEST_SUCCESS, FINISHED_REASONS),
        (MODE_SWITCHES, SWITCH_KINDS),
        (ADAPTER_SWAPS, SWAP_DIRECTIONS),
        (ADAPTER_LOAD, LOAD_STAGES),
        (ENGINE_STEP, STEP_KINDS),
    ):
        for value in values:
            metric.labels(worker, value)


class BoundedLabel:
    """Values of one label whose values users choose: the first `limit` distinct ones are kept,
    later ones read "other" (each value is a series for the process's life)."""

    def __init__(self, limit: int, empty: str) -> None:
        self.limit = limit
        self.empty = empty
        self._lock = threading.Lock()
        self._seen: set[str] = set()

    def __call__(self, value: str) -> str:
        name = value or self.empty
        with self._lock:
            if name in self._seen:
                return name
            if len(self._seen) < self.limit:
                self._seen.add(name)
                return name
        return "other"


# The adapter's name ("base" for none); the SLO class of a task's objective.
adapter_label = BoundedLabel(MAX_ADAPTER_LABELS, "base")
slo_class_label = BoundedLabel(MAX_SLO_CLASS_LABELS, "none")


def start_metrics_server(port: int, host: str = "127.0.0.1") -> None:
    if port:
        start_http_server(port, addr=host)


async def counted(
    service: str, stream: AsyncIterator[T], on_done: Callable[[str], None] | None = None
) -> AsyncIterator[T]:
    """Yields `stream`, then counts it in valora:requests_total{service, code} (the status code
    name it ended with; CANCELLED when the caller went away) and calls `on_done(code)`."""
    code = "OK"
    try:
        async for item in stream:
            yield item
    except ValoraError as exc:
        code = exc.code.name
        raise
    except (asyncio.CancelledError, GeneratorExit):
        code = "CANCELLED"
        raise
    except Exception:
        code = "INTERNAL"
        raise
    finally:
        REQUESTS_TOTAL.labels(service, code).inc()
        if on_done is not None:
            on_done(code)
