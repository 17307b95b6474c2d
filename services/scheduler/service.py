"""valora.internal.v1.SchedulerService: admits requests, runs them on workers, relays output.

A worker that fails before the first output message is excluded and the request goes back to
the queue (up to `max_attempts` workers); once output has reached the caller a failure is
UNAVAILABLE, never a silent replay.
"""

from __future__ import annotations

import asyncio

import grpc
import structlog

from services.common import errors, metrics
from services.common.server import REQUEST_ID_KEY, new_request_id, request_id_from
from services.scheduler.dispatcher import Dispatcher, Pending
from services.scheduler.workers import WorkerPool
from valora.internal.v1 import scheduler_service_pb2, scheduler_service_pb2_grpc, worker_service_pb2
from valora.v1 import types_pb2

log = structlog.get_logger()

# Statuses that say "this worker could not run it", as opposed to "this request is bad".
WORKER_FAILURES = frozenset({
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
})


class SchedulerServicer(scheduler_service_pb2_grpc.SchedulerServiceServicer):
    def __init__(self, pool: WorkerPool, dispatcher: Dispatcher, *, max_attempts: int) -> None:
        self.pool = pool
        self.dispatcher = dispatcher
        self.max_attempts = max_attempts

    async def Submit(self, request, context):
        started = self.dispatcher.clock()
        adapter = request.item.adapter.version if request.item.HasField("adapter") else ""
        code = "OK"
        try:
            async for out in self._submit(request, context, started):
                yield out
        except errors.ValoraError as exc:
            code = exc.code.name
            raise
        except (asyncio.CancelledError, GeneratorExit):
            code = "CANCELLED"
            raise
        except Exception:
            code = "INTERNAL"
            raise
        finally:
            metrics.REQUESTS_TOTAL.labels("scheduler", code).inc()
            metrics.E2E_LATENCY.labels(metrics.adapter_label(adapter), code).observe(
                self.dispatcher.clock() - started)

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
        )
        adapter_label = metrics.adapter_label(pending.adapter or "")
        self.dispatcher.admit(pending)
        attempt = 0
        while True:
            attempt += 1
            worker = await self.dispatcher.wait_assigned(pending)
            handle = self.pool[worker]
            try:
                await self.dispatcher.worker_ready(worker, pending)
            except BaseException:
                self.dispatcher.release(worker)
                raise
            queue_ms = ((pending.dispatched_s or clock()) - pending.arrival_s) * 1000.0
            timeout = pending.remaining_s(clock())
            if timeout is not None and timeout <= 0:
                self.dispatcher.release(worker)
                raise errors.DeadlineExceeded(f"request {item.request_id} expired before dispatch",
                                              reason="QUEUE_TIMEOUT")
            call = handle.stub.Generate(worker_service_pb2.GenerateRequest(item=item), timeout=timeout,
                                        metadata=((REQUEST_ID_KEY, item.request_id),))
            started = False
            try:
                async for resp in call:
                    if not started:
                        metrics.TIME_TO_FIRST_TOKEN.labels(adapter_label).observe(clock() - pending.arrival_s)
                    started = True
                    out = scheduler_service_pb2.SubmitResponse(text_delta=resp.text_delta)
                    if resp.HasField("result"):
                        out.result.CopyFrom(resp.result)
                        out.result.request_id = out.result.request_id or item.request_id
                        out.result.worker = out.result.worker or worker
                        out.result.timing.queue_ms += queue_ms
                        yield out
                        return
                    yield out
                raise errors.WorkerUnavailable(f"worker {worker} ended the stream without a result",
                                               reason="WORKER_NO_RESULT")
            except grpc.RpcError as err:
                code = err.code()
                if code not in WORKER_FAILURES:
                    raise errors.from_rpc_error(err) from None
                if code == grpc.StatusCode.UNAVAILABLE:
                    handle.mark_failed(err.details() or code.name)
                if started:
                    raise errors.WorkerUnavailable(
                        f"worker {worker} failed after output started ({code.name}); not replayed",
                        reason="WORKER_FAILED_MID_STREAM") from None
                log.warning("worker_failed_before_first_token", worker=worker, code=code.name, attempt=attempt)
                pending.excluded.add(worker)
                if attempt >= self.max_attempts or set(self.pool.workers) <= pending.excluded:
                    raise errors.from_rpc_error(err) from None  # no worker left to try: its own status
                self.dispatcher.requeue(pending)
            finally:
                call.cancel()
                self.dispatcher.release(worker)

    async def GetSchedulerStatus(self, request, context):
        return scheduler_service_pb2.GetSchedulerStatusResponse(
            workers=[w.to_pb() for w in self.pool.workers.values()],
            queued_requests=len(self.dispatcher.queue),
        )
