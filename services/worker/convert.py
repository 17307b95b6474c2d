"""The engine's results and state as protobuf: what WorkerService answers (the inbound WorkItem ->
WorkRequest is preprocess.py's). Results name their log-probabilities' tokens (TokenText)."""

from __future__ import annotations

from collections.abc import Callable

from services.worker.config import WorkerSettings
from services.worker.detokenizer import TokenText
from services.worker.engine import Engine
from services.worker.requests import FinishReason, step_times
from valora_protos.internal.v1 import worker_service_pb2 as pb
from valora_protos.v1 import admin_service_pb2, inference_service_pb2, types_pb2

_FINISH_PB = {
    FinishReason.LENGTH: types_pb2.FINISH_REASON_LENGTH,
    FinishReason.EOS: types_pb2.FINISH_REASON_EOS,
    FinishReason.STOP_SEQUENCE: types_pb2.FINISH_REASON_STOP_SEQUENCE,
    FinishReason.LABEL: types_pb2.FINISH_REASON_LABEL,
}


def logprobs_to_pb(entries, token_text: TokenText) -> list[types_pb2.TokenLogprob]:
    """The engine's TokenLogprob entries as the API's, each token named (text and bytes)."""

    def one(token_id: int, logprob: float, top=()) -> types_pb2.TokenLogprob:
        text, raw = token_text(token_id)
        return types_pb2.TokenLogprob(
            token_id=token_id, token=text, logprob=logprob, bytes=raw, top_logprobs=[one(i, v) for i, v in top]
        )

    return [one(e.token_id, e.logprob, e.top) for e in entries]


def result_to_pb(r, worker: str, token_text: TokenText | None = None) -> inference_service_pb2.InferResult:
    """`token_text`: names the tokens of r.logprobs (needed when it has any)."""
    return inference_service_pb2.InferResult(
        request_id=r.request_id,
        text=r.text,
        label=r.label,
        scores=[types_pb2.LabelScore(label=lbl, score=s) for lbl, s in r.scores],
        finish_reason=_FINISH_PB[r.finish_reason],
        usage=types_pb2.Usage(
            image_tokens=r.image_tokens, prompt_tokens=r.prompt_tokens, output_tokens=r.output_tokens
        ),
        timing=types_pb2.Timing(queue_ms=r.queue_ms, first_token_ms=r.first_token_ms, total_ms=r.total_ms),
        mode=r.mode.to_pb(),
        adapter_version=r.adapter,
        worker=worker,
        logprobs=logprobs_to_pb(r.logprobs, token_text),
    )


def worker_status_to_pb(
    engine: Engine | None, address: str, settings: WorkerSettings, is_serving: Callable[[], bool]
) -> admin_service_pb2.WorkerStatus:
    """The worker's status: healthy while its engine lives and the service serves (not draining)."""
    if engine is None:
        return admin_service_pb2.WorkerStatus(
            address=address, healthy=False, device=settings.device, max_batch_size=settings.max_batch_size
        )
    s = engine.stats()
    cache = s.image_cache
    return admin_service_pb2.WorkerStatus(
        address=address,
        healthy=s.alive and is_serving(),
        mode=s.mode.to_pb(),
        merged_adapter=s.merged_adapter,
        resident_adapters=s.resident_adapters,
        host_adapters=s.host_adapters,
        running_requests=s.running,
        max_batch_size=s.max_batch_size,
        device=s.device,
        kv_cache_bytes=s.kv_cache_bytes,
        waiting_requests=s.waiting,
        last_step_ms=s.last_step_ms,
        image_cache_hits=cache.hits if cache else 0,
        image_cache_misses=cache.misses if cache else 0,
    )


def step_times_to_pb(engine: Engine | None) -> pb.WorkerStepTimes:
    if engine is None:
        return pb.WorkerStepTimes()
    t = step_times(engine.step_log)
    return pb.WorkerStepTimes(
        steps=t.steps,
        decode_steps=t.decode_steps,
        prefill_steps=t.prefill_steps,
        decode_step_ms_p50=t.decode_ms_p50,
        decode_step_ms_p90=t.decode_ms_p90,
        prefill_step_ms_p50=t.prefill_ms_p50,
        prefill_step_ms_p90=t.prefill_ms_p90,
    )


def graph_counters_to_pb(g) -> pb.WorkerDecodeGraphs:
    """A GraphSet's counters (step_graphs.py); all 0 without an engine."""
    if not g:
        return pb.WorkerDecodeGraphs()
    return pb.WorkerDecodeGraphs(
        static_steps=g.static_steps,
        replays=g.replays,
        captures=g.captures,
        new_keys=g.new_keys,
        eager_steps=g.eager_steps,
        capture_failures=g.capture_failures,
        reference_steps=g.reference_steps,
    )
