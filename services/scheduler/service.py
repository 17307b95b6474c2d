"""valora.internal.v1.SchedulerService: admits requests, runs them on workers, relays output.

A worker that fails before the first output message is excluded and the request goes back to
the queue (up to `max_attempts` workers); once output has reached the caller a failure is
UNAVAILABLE, never a silent replay — except the worker's engine failing that request alone
(ENGINE_STEP_FAILED: the worker goes on serving), which reaches the caller as the worker sent it,
not replayed either. The same holds when the pool declares the worker lost
(heartbeats stopped, or down for the TTL) while the request waits there for its first output:
the worker call is cancelled and the request placed again; after output started the request
fails UNAVAILABLE as soon as the worker is lost (a stopped worker no longer holds its clients
until their deadlines).

Workers join and leave through RegisterWorker / Heartbeat / DeregisterWorker (workers.py says
how membership works).
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
from google.protobuf import duration_pb2
import structlog

from services.common import errors, metrics
from services.common.server import REQUEST_ID_KEY, new_request_id, request_id_from
from services.scheduler.credits import estimate_prompt_tokens
from services.scheduler import slo
from services.scheduler.dispatcher import Dispatcher, Pending
from services.scheduler.workers import WorkerPool
from valora_protos.internal.v1 import scheduler_service_pb2, scheduler_service_pb2_grpc, worker_service_pb2
from valora_protos.v1 import types_pb2

log = structlog.get_logger()

# Statuses that say "this worker could not run it", as opposed to "this request is bad".
WORKER_FAILURES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)
# The worker's engine failed this request alone (services/worker/outputs.py, OutputProcessor.guard)
# and goes on serving: after output started the client gets that error, not a worker failure.
ROW_FAILED = "ENGINE_STEP_FAILED"


class SchedulerServicer(scheduler_service_pb2_grpc.SchedulerServiceServicer):
    def __init__(self, pool: WorkerPool, dispatcher: Dispatcher, *, max_attempts: int) -> None:
        self.pool = pool
        self.dispatcher = dispatcher
        self.max_attempts = max_attempts

    async def Submit(self, request, context):
        started = self.dispatcher.clock()
        item = request.item
        adapter = item.adapter.version if item.HasField("adapter") else ""
        slo_class, slo_ms = item.slo_class, item.slo_ms  # read now: _submit may fill in the item

        def observe(code: str) -> None:
            latency = self.dispatcher.clock() - started
            metrics.E2E_LATENCY.labels(metrics.adapter_label(adapter), code).observe(latency)
            slo.observe(slo_class, slo_ms, code, latency)

        async for out in metrics.counted("scheduler", self._submit(request, context, started), observe):
            yield out

    async def _submit(self, request, context, now: float):
        item = request.item
        if not item.request_id:
            item.request_id = request_id_from(context) or new_request_id()
        clock = self.dispatcher.clock
        remaining = context.time_remaining()
        pending = Pending(
            request_id=item.request_id,
            adapter=item.adapter.version if item.HasField("adapter") and item.adapter.version else None,
            arrival_s=now,
            deadline_s=None if remaining is None else now + remaining,
            max_new_tokens=item.params.max_new_tokens,
            images=len(item.images),
            label=item.output_kind == types_pb2.OUTPUT_KIND_LABEL,
            prompt_tokens=len(item.prompt_token_ids) or estimate_prompt_tokens(item.prompt),
            slo_s=max(0.0, item.slo_ms) / 1000.0,
        )
        adapter_label = metrics.adapter_label(pending.adapter or "")
        self.dispatcher.admit(pending)
        attempt = 0
        while True:
            attempt += 1
            worker = await self.dispatcher.wait_assigned(pending)
            handle = self.pool.handle(worker)
            if handle is None:  # removed between placement and here (nothing ran)
                self.dispatcher.release(worker, pending)
                pending.excluded.add(worker)
                self.dispatcher.requeue(pending)
                continue
            lost = handle.lost_event
            try:
                await self.dispatcher.worker_ready(worker, pending)
            except BaseException:
                self.dispatcher.release(worker, pending)
                raise
            queue_ms = ((pending.dispatched_s or clock()) - pending.arrival_s) * 1000.0
            timeout = pending.remaining_s(clock())
            if timeout is not None and timeout <= 0:
                self.dispatcher.release(worker, pending)
                raise errors.DeadlineExceeded(
                    f"request {item.request_id} expired before dispatch", reason="QUEUE_TIMEOUT"
                )
            if self.dispatcher.policy.orders_workers and pending.slo_s > 0:
                item.slo_left_ms = (pending.slo_s - (clock() - pending.arrival_s)) * 1000.0
            call = handle.stub.Generate(
                worker_service_pb2.GenerateRequest(item=item),
                timeout=timeout,
                metadata=((REQUEST_ID_KEY, item.request_id),),
            )
            started = False
            try:
                resp = await _next_response(call, lost)
                if resp is _LOST:
                    log.warning("worker_lost_before_first_token", worker=worker, attempt=attempt)
                    pending.excluded.add(worker)
                    if attempt >= self.max_attempts or set(self.pool.workers) <= pending.excluded:
                        raise errors.WorkerUnavailable(
                            f"worker {worker} was lost and no other worker is left", reason="WORKER_LOST"
                        )
                    self.dispatcher.requeue(pending)
                    continue
                while resp is not grpc.aio.EOF:
                    if not started:
                        metrics.TIME_TO_FIRST_TOKEN.labels(adapter_label).observe(clock() - pending.arrival_s)
                    started = True
                    out = scheduler_service_pb2.SubmitResponse(text_delta=resp.text_delta, logprobs=resp.logprobs)
                    if resp.HasField("result"):
                        out.result.CopyFrom(resp.result)
                        out.result.request_id = out.result.request_id or item.request_id
                        out.result.worker = out.result.worker or worker
                        out.result.timing.queue_ms += queue_ms
                        yield out
                        await _read_end(call)
                        return
                    yield out
                    resp = await _next_response(call, lost)
                    if resp is _LOST:
                        raise errors.WorkerUnavailable(
                            f"worker {worker} was lost after output started; not replayed",
                            reason="WORKER_LOST_MID_STREAM",
                        )
                raise errors.WorkerUnavailable(
                    f"worker {worker} ended the stream without a result", reason="WORKER_NO_RESULT"
                )
            except grpc.RpcError as err:
                code = err.code()
                if code not in WORKER_FAILURES:
                    raise errors.from_rpc_error(err) from None
                if code == grpc.StatusCode.UNAVAILABLE:
                    handle.mark_failed(err.details() or code.name)
                if started:
                    failed = errors.from_rpc_error(err)
                    if failed.reason == ROW_FAILED:  # the request's own failure, the worker goes on: its error
                        raise failed from None
                    raise errors.WorkerUnavailable(
                        f"worker {worker} failed after output started ({code.name}); not replayed",
                        reason="WORKER_FAILED_MID_STREAM",
                    ) from None
                log.warning("worker_failed_before_first_token", worker=worker, code=code.name, attempt=attempt)
                pending.excluded.add(worker)
                if attempt >= self.max_attempts or set(self.pool.workers) <= pending.excluded:
                    raise errors.from_rpc_error(err) from None  # no worker left to try: its own status
                self.dispatcher.requeue(pending)
            finally:
                call.cancel()
                self.dispatcher.release(worker, pending)

    async def GetSchedulerStatus(self, request, context):
        return scheduler_service_pb2.GetSchedulerStatusResponse(
            workers=[w.to_pb() for w in self.pool.workers.values()],
            queued_requests=len(self.dispatcher.queue),
        )

    # -- membership ------------------------------------------------------------------------------
    async def RegisterWorker(self, request, context):
        if not request.address:
            raise errors.invalid_field("address", "must be the worker's host:port")
        if request.max_batch_size < 0:
            raise errors.invalid_field("max_batch_size", "must not be negative")
        self.pool.register(
            request.address, name=request.name, device=request.device, max_batch_size=request.max_batch_size
        )
        ttl = duration_pb2.Duration()
        ttl.FromNanoseconds(int(self.pool.ttl_s * 1e9))
        return scheduler_service_pb2.RegisterWorkerResponse(ttl=ttl)

    async def Heartbeat(self, request, context):
        if not request.address:
            raise errors.invalid_field("address", "must be the address the worker registered with")
        if not self.pool.heartbeat(request.address):
            raise errors.NotFound(f"worker {request.address} is not registered", reason="WORKER_NOT_REGISTERED")
        return scheduler_service_pb2.HeartbeatResponse()

    async def DeregisterWorker(self, request, context):
        if not request.address:
            raise errors.invalid_field("address", "must be the address the worker registered with")
        if not self.pool.deregister(request.address):
            raise errors.NotFound(f"worker {request.address} is not registered", reason="WORKER_NOT_REGISTERED")
        return scheduler_service_pb2.DeregisterWorkerResponse()


_LOST = object()


async def _read_end(call, timeout_s: float = 1.0) -> None:
    """After the result: the worker's end of stream and status, so the call closes as the worker
    ended it — cancelling it first (the `finally`) would end a finished request as CANCELLED at
    both ends (an error span on the scheduler's client side) whenever the status is still in flight."""
    with contextlib.suppress(grpc.RpcError, asyncio.TimeoutError):
        await asyncio.wait_for(call.read(), timeout_s)


async def _next_response(call, lost: asyncio.Event):
    """The worker call's next message (grpc.aio.EOF when it ends), or `_LOST` when the pool
    declares the worker lost first."""
    if lost.is_set():
        return _LOST
    read = asyncio.ensure_future(call.read())
    gone = asyncio.ensure_future(lost.wait())
    try:
        await asyncio.wait({read, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not read.done():
            read.cancel()
    if read.done() and not read.cancelled():
        return read.result()  # raises the call's RpcError
    return _LOST
