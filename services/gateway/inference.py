"""valora.v1.InferenceService: validate, resolve the adapter/task, submit to the scheduler.

One flow serves both RPCs: `_submit` yields the scheduler's SubmitResponses; `Infer` collects
them into one result, `InferStream` relays text deltas as they come. The downstream calls carry
the request id (`x-request-id`) and the request's deadline (client's, else the default, capped);
cancelling the client call cancels the scheduler call.

Resolutions of READY references are kept for `resolve_cache_s` (ResolutionCache): asking the
store on every request cost it 2-4 ms of CPU a request, and the gateway an RPC, in the scale
bench's rows (`service_cpu_ms_per_request`).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import structlog

from services.common import errors, metrics
from services.common.server import REQUEST_ID_KEY, new_request_id
from services.gateway.config import GatewaySettings
from services.gateway.validation import Limits, validate
from valora_protos.internal.v1 import (
    adapter_store_service_pb2,
    adapter_store_service_pb2_grpc,
    scheduler_service_pb2,
    scheduler_service_pb2_grpc,
    work_pb2,
)
from valora_protos.v1 import inference_service_pb2, inference_service_pb2_grpc, resources_pb2, types_pb2

log = structlog.get_logger()
# How long a resolution waits for the store when an expired answer can stand in (ResolutionCache.stale).
STALE_FALLBACK_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Target:
    adapter: work_pb2.AdapterRef | None
    head: str
    # The named task's latency objective (0 = none) and SLO class, for the scheduler.
    slo_ms: float = 0.0
    slo_class: str = ""
    # The named task's early adapter release policy (0 and UNSPECIFIED: off): a request that sets
    # its own (either field) keeps it.
    adapter_release_fraction: float = 0.0
    adapter_release_rule: int = types_pb2.ADAPTER_RELEASE_RULE_UNSPECIFIED


class ResolutionCache:
    """The store's answers for references (adapter references, task names) whose version is
    READY, for `ttl_s` seconds, at most `size` of them (least recently used dropped first);
    kept `stale_s` seconds longer for `stale`: what serves them while the store is down."""

    def __init__(self, ttl_s: float, size: int = 4096, stale_s: float = 0.0) -> None:
        self.ttl_s = ttl_s
        self.stale_s = stale_s
        self.size = size
        self.generation = 0  # clear() count: an answer asked for before a clear is not kept
        self._entries: OrderedDict[str, tuple[float, adapter_store_service_pb2.ResolveReferenceResponse]] = (
            OrderedDict()
        )

    def get(self, reference: str) -> adapter_store_service_pb2.ResolveReferenceResponse | None:
        hit = self._entries.get(reference)
        if hit is None:
            return None
        now = time.monotonic()
        if now >= hit[0]:
            if now >= hit[0] + self.stale_s:
                del self._entries[reference]
            return None
        self._entries.move_to_end(reference)
        return hit[1]

    def stale(self, reference: str) -> adapter_store_service_pb2.ResolveReferenceResponse | None:
        """An expired answer still within `stale_s` (None: none)."""
        hit = self._entries.get(reference)
        if hit is None or time.monotonic() >= hit[0] + self.stale_s:
            return None
        return hit[1]

    def put(self, reference: str, resp: adapter_store_service_pb2.ResolveReferenceResponse, generation: int) -> None:
        """Keeps `resp`, asked for when `generation` was current (a registry change since: dropped)."""
        if self.ttl_s <= 0 or resp.version.state != resources_pb2.ADAPTER_VERSION_STATE_READY:
            return  # a version on its way to READY must be seen as soon as it gets there
        if generation != self.generation:
            return
        self._entries[reference] = (time.monotonic() + self.ttl_s, resp)
        self._entries.move_to_end(reference)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()
        self.generation += 1


class InferenceServicer(inference_service_pb2_grpc.InferenceServiceServicer):
    def __init__(
        self,
        settings: GatewaySettings,
        scheduler: scheduler_service_pb2_grpc.SchedulerServiceStub,
        store: adapter_store_service_pb2_grpc.AdapterStoreServiceStub,
    ) -> None:
        self.settings = settings
        self.scheduler = scheduler
        self.store = store
        self.resolved = ResolutionCache(settings.resolve_cache_s, stale_s=settings.resolve_stale_s)
        self.limits = Limits(
            max_images=settings.max_images,
            max_image_bytes=settings.max_image_bytes,
            max_image_pixels=settings.max_image_pixels,
            max_request_pixels=settings.max_request_pixels,
            max_prompt_chars=settings.max_prompt_chars,
            max_new_tokens_limit=settings.max_new_tokens_limit,
            max_stop_sequences=settings.max_stop_sequences,
        )

    async def Infer(self, request, context):
        parts: list[str] = []
        result = None
        async for resp in self._counted(request.input, request.request_id, context):
            parts.append(resp.text_delta)
            if resp.HasField("result"):
                result = resp.result
        if result is None:
            raise errors.WorkerUnavailable("the scheduler ended the stream without a result", reason="NO_RESULT")
        if not result.text and result.label == "":
            result.text = "".join(parts)
        return inference_service_pb2.InferResponse(result=result)

    async def InferStream(self, request, context):
        async for resp in self._counted(request.input, request.request_id, context):
            out = inference_service_pb2.InferStreamResponse(text_delta=resp.text_delta, logprobs=resp.logprobs)
            if resp.HasField("result"):
                out.result.CopyFrom(resp.result)
            yield out

    def _counted(self, inp, request_id, context):
        """`_submit`, counted in valora:requests_total{service="gateway", code}."""
        return metrics.counted("gateway", self._submit(inp, request_id, context))

    async def _submit(
        self, inp: inference_service_pb2.InferenceInput, request_id: str, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_service_pb2.SubmitResponse]:
        await validate(inp, request_id, self.limits)
        rid = request_id or new_request_id()
        structlog.contextvars.bind_contextvars(request_id=rid)
        deadline = time.monotonic() + self.settings.deadline_s(context.time_remaining())
        metadata = ((REQUEST_ID_KEY, rid),)
        target = await self._resolve(inp, deadline, metadata)
        item = self._work_item(inp, rid, target)
        log.info(
            "infer",
            adapter=item.adapter.version or None,
            head=item.head or None,
            images=len(item.images),
            prompt_chars=len(item.prompt),
            prompt_token_ids=len(item.prompt_token_ids),
        )
        timeout = deadline - time.monotonic()
        if timeout <= 0:
            raise errors.DeadlineExceeded("deadline expired while resolving the adapter", reason="DEADLINE")
        call = self.scheduler.Submit(scheduler_service_pb2.SubmitRequest(item=item), timeout=timeout, metadata=metadata)
        try:
            async for resp in call:
                if resp.HasField("result"):
                    res = resp.result
                    res.request_id = rid
                    if target.adapter is not None and not res.adapter_version:
                        res.adapter_version = target.adapter.version
                yield resp
        except grpc.RpcError as err:
            raise errors.from_rpc_error(err) from None
        finally:
            call.cancel()  # no-op when finished; frees the request downstream when the client left

    async def _resolve(self, inp: inference_service_pb2.InferenceInput, deadline: float, metadata) -> Target:
        kind = inp.WhichOneof("target")
        if kind is None:
            return Target(adapter=None, head="")
        reference = inp.adapter if kind == "adapter" else inp.task
        resp = self.resolved.get(reference)
        if resp is None:
            generation = self.resolved.generation
            stale = self.resolved.stale(reference)
            timeout = max(0.0, deadline - time.monotonic())
            if stale is not None:  # an answer to fall back on: do not spend the request's deadline on the store
                timeout = min(timeout, STALE_FALLBACK_TIMEOUT_S)
            try:
                resp = await self.store.ResolveReference(
                    adapter_store_service_pb2.ResolveReferenceRequest(reference=reference),
                    timeout=timeout,
                    metadata=metadata,
                )
            except grpc.RpcError as err:
                if stale is None or err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise errors.from_rpc_error(err) from None
                log.warning("store_unreachable_serving_cached", reference=reference, code=err.code().name)
                resp = stale
            else:
                self.resolved.put(reference, resp, generation)
        version = resp.version
        if version.state not in (
            resources_pb2.ADAPTER_VERSION_STATE_READY,
            resources_pb2.ADAPTER_VERSION_STATE_UNSPECIFIED,
        ):
            raise errors.FailedPrecondition(f"{version.name} is not READY", reason="ADAPTER_VERSION_NOT_READY")
        adapter = work_pb2.AdapterRef(version=version.name, sha256=version.sha256)
        head = ""
        if inp.output_kind == types_pb2.OUTPUT_KIND_LABEL:
            head = resp.task.head if resp.HasField("task") else ""
            if not head:
                raise errors.invalid_field("input.task", f"{reference} has no task head; use OUTPUT_KIND_TEXT")
            heads = {h.name for h in version.heads}
            if heads and head not in heads:
                raise errors.FailedPrecondition(
                    f"{version.name} carries no head {head!r}", reason="HEAD_NOT_IN_VERSION"
                )
        task = resp.task if resp.HasField("task") else None
        if task is None:
            return Target(adapter=adapter, head=head)
        return Target(
            adapter=adapter,
            head=head,
            slo_ms=task.slo_ms,
            slo_class=task.slo_class,
            adapter_release_fraction=task.adapter_release_fraction,
            adapter_release_rule=task.adapter_release_rule,
        )

    def _work_item(self, inp: inference_service_pb2.InferenceInput, rid: str, target: Target) -> work_pb2.WorkItem:
        item = work_pb2.WorkItem(
            request_id=rid,
            prompt=inp.prompt,
            head=target.head,
            system=inp.system,
            raw_prompt=inp.raw_prompt,
            prompt_token_ids=inp.prompt_token_ids,
            slo_ms=target.slo_ms,
            slo_class=target.slo_class,
        )
        item.history.extend(inp.history)
        item.images.extend(inp.images)
        item.videos.extend(inp.videos)
        item.output_kind = inp.output_kind or types_pb2.OUTPUT_KIND_TEXT
        if target.adapter is not None:
            item.adapter.CopyFrom(target.adapter)
        item.params.CopyFrom(inp.params)
        if item.params.max_new_tokens == 0:
            item.params.max_new_tokens = self.settings.default_max_new_tokens
        p = item.params
        if p.adapter_release_fraction == 0 and p.adapter_release_rule == types_pb2.ADAPTER_RELEASE_RULE_UNSPECIFIED:
            # the task's policy, as a whole, unless the request set its own
            p.adapter_release_fraction = target.adapter_release_fraction
            p.adapter_release_rule = target.adapter_release_rule
        return item
