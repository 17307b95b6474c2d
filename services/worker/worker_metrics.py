"""The worker's Prometheus series from its engine (services/common/metrics.py defines them): a
finished request's counts and latencies, a mode change, and what the watchdog samples each period
(gauges, the adapters of the queued requests, the steps logged since the last sample)."""

from __future__ import annotations

import itertools
import time

from services.common import metrics
from services.common.modes import Mode
from services.worker.engine import Engine
from services.worker.requests import EngineStats, FinishReason, GenerationResult


def observe_result(name: str, r: GenerationResult) -> None:
    """A finished request's tokens, finish reason, early release and latencies."""
    metrics.PROMPT_TOKENS.labels(name).inc(r.prompt_tokens)
    metrics.GENERATION_TOKENS.labels(name).inc(r.output_tokens)
    reason = "length" if r.finish_reason == FinishReason.LENGTH else "stop"  # vLLM's finished_reason values
    metrics.REQUEST_SUCCESS.labels(name, reason).inc()
    metrics.REQUEST_PROMPT_TOKENS.labels(name).observe(r.prompt_tokens)
    metrics.REQUEST_GENERATION_TOKENS.labels(name).observe(r.output_tokens)
    if r.released_after_tokens:
        metrics.ADAPTER_RELEASES.labels(name).inc()
        metrics.RELEASED_TOKENS.labels(name).inc(r.output_tokens - r.released_after_tokens)
    prefill_s = max(0.0, r.first_token_ms - r.queue_ms) / 1e3  # queue_ms: arrival to prefill start
    metrics.REQUEST_PREFILL_TIME.labels(name).observe(prefill_s)
    metrics.REQUEST_DECODE_TIME.labels(name).observe(max(0.0, r.total_ms - r.first_token_ms) / 1e3)
    metrics.REQUEST_INFERENCE_TIME.labels(name).observe(max(0.0, r.total_ms - r.queue_ms) / 1e3)
    label = metrics.adapter_label(r.adapter)
    metrics.TIME_TO_FIRST_TOKEN.labels(label).observe(r.first_token_ms / 1e3)
    metrics.E2E_LATENCY.labels(label, "OK").observe(r.total_ms / 1e3)
    for a, b in itertools.pairwise(r.token_times):  # every gap: a stall shows, not a request's mean
        metrics.INTER_TOKEN_LATENCY.observe(b - a)


def observe_mode_change(name: str, merged_before: str, s: EngineStats) -> None:
    """A mode/weights change: counted by kind when the merged adapter changed; valora:mode set."""
    if merged_before != s.merged_adapter:
        kind = "merge" if not merged_before else "unmerge" if not s.merged_adapter else "switch"
        metrics.MODE_SWITCHES.labels(name, kind).inc()
    for m in (Mode.MERGED, Mode.UNMERGED, Mode.MIXTURE):
        metrics.MODE.labels(name, m.value).set(1 if m == s.mode else 0)


def engine_gauges(engine: Engine, name: str) -> None:
    """Running requests, KV usage, adapter counts and valora:mode (the engine's, from start-up on,
    not only after SetMode); reads counters only, never the engine's lock."""
    metrics.REQUESTS_RUNNING.labels(name).set(engine.running_count)
    metrics.KV_CACHE_USAGE.labels(name).set(engine.kv_usage)
    resident, host = engine.pool.counts()
    metrics.LORA_ADAPTERS.labels(name, "resident").set(resident)
    metrics.LORA_ADAPTERS.labels(name, "host").set(host)
    mode = engine.adapters.mode
    for m in Mode:
        metrics.MODE.labels(name, m.value).set(1 if m == mode else 0)


def lora_requests_info(engine: Engine, name: str, last: tuple | None) -> tuple:
    """Sets valora:lora_requests_info to the adapters of the engine's running and waiting requests
    (the previous label set removed: one series a worker); returns the labels set. The queues are
    copied in one step each (no lock: a snapshot, the engine thread goes on)."""
    sched = engine.sched

    def names(seqs) -> str:
        return ",".join(sorted({s.req.adapter for s in seqs if s.req.adapter}))

    labels = (
        name,
        str(engine.config.device_slots),
        names([*sched.running, *sched.prefill]),
        names([*sched.waiting, *sched.incoming]),
    )
    if last is not None and last != labels:
        metrics.LORA_REQUESTS_INFO.remove(*last)
    metrics.LORA_REQUESTS_INFO.labels(*labels).set(time.time())
    return labels


def engine_step_metrics(engine: Engine, name: str, seen: tuple[int, int]) -> tuple[int, int]:
    """valora:engine_step_seconds and iteration_tokens_total get the engine's steps logged since
    `seen` (steps, preemptions: what the last call returned; (0, 0) at first) and
    num_preemptions_total the sequences its step scheduler preempted since; returns the new `seen`.
    Each count is read once (the engine thread goes on logging); a step log that wrapped between
    two calls loses its oldest entries."""
    steps, preempted = engine.steps, engine.sched.preemptions
    new = max(0, min(steps - seen[0], engine.step_log.maxlen))
    if new:
        for prefill_rows, _, ms in list(engine.step_log)[-new:]:
            metrics.ENGINE_STEP.labels(name, "prefill" if prefill_rows else "decode").observe(ms / 1e3)
        for tokens in list(engine.step_tokens)[-new:]:
            metrics.ITERATION_TOKENS.labels(name).observe(tokens)
    if preempted > seen[1]:
        metrics.NUM_PREEMPTIONS.labels(name).inc(preempted - seen[1])
    return steps, preempted
