"""SchedulerService over real loopback gRPC, against small in-test workers."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from prometheus_client import REGISTRY

from services.common.errors import ValoraError
from services.common.server import REQUEST_ID_KEY
from services.scheduler.config import SchedulerSettings
from services.scheduler.server import create_server
from valora_protos.internal.v1 import (
    scheduler_service_pb2,
    scheduler_service_pb2_grpc,
    work_pb2,
    worker_service_pb2,
    worker_service_pb2_grpc,
)
from valora_protos.v1 import admin_service_pb2, inference_service_pb2, types_pb2

pytestmark = pytest.mark.anyio
ADAPTER = "adapters/cars/versions/1"


@pytest.fixture
def anyio_backend():
    return "asyncio"


class FakeWorker(worker_service_pb2_grpc.WorkerServiceServicer):
    """Streams "hel", "lo" then a result; or fails / hangs as told."""

    def __init__(
        self,
        *,
        healthy=True,
        max_batch=4,
        resident=(),
        fail_before_first=False,
        fail_after_first=False,
        hang=False,
        merged="",
        stall_after_first=False,
        hold_first: asyncio.Event | None = None,
    ):
        self.healthy, self.max_batch, self.resident = healthy, max_batch, list(resident)
        self.hold_first = hold_first  # the first call waits for it: a worker busy while a queue builds
        self.mode = types_pb2.INFERENCE_MODE_MERGED if merged else types_pb2.INFERENCE_MODE_UNMERGED
        self.merged = merged
        self.events: list[str] = []
        self.fail_before_first, self.fail_after_first, self.hang = fail_before_first, fail_after_first, hang
        self.stall_after_first = stall_after_first  # a stopped process: the stream goes silent
        self.calls: list[tuple[str, str]] = []  # (item.request_id, x-request-id metadata)
        self.slo_left: dict[str, float | None] = {}  # request id -> WorkItem.slo_left_ms (None: unset)
        self.cancelled = asyncio.Event()
        self.address = ""

    async def Generate(self, request, context):
        md = dict(context.invocation_metadata())
        self.calls.append((request.item.request_id, md.get(REQUEST_ID_KEY, "")))
        item = request.item
        self.slo_left[item.request_id] = item.slo_left_ms if item.HasField("slo_left_ms") else None
        self.events.append(f"generate {request.item.adapter.version}")
        self.remaining = context.time_remaining()
        if self.hold_first is not None and len(self.calls) == 1:
            await self.hold_first.wait()
        if self.fail_before_first:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine died")
        if self.hang:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        yield worker_service_pb2.GenerateResponse(text_delta="hel")
        if self.stall_after_first:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        if self.fail_after_first == "row":  # the engine failed this request alone (outputs.py's guard)
            err = ValoraError("engine step failed: RuntimeError: bad row", reason="ENGINE_STEP_FAILED")
            await context.abort_with_status(rpc_status.to_status(err.to_status()))
        if self.fail_after_first:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine died mid-stream")
        yield worker_service_pb2.GenerateResponse(text_delta="lo")
        yield worker_service_pb2.GenerateResponse(
            result=inference_service_pb2.InferResult(
                text="hello", finish_reason=types_pb2.FINISH_REASON_EOS, timing=types_pb2.Timing(queue_ms=1.0)
            )
        )

    async def LoadAdapter(self, request, context):
        self.events.append(f"load {request.adapter.version} to_device={request.to_device}")
        return worker_service_pb2.LoadAdapterResponse()

    async def GetWorkerStatus(self, request, context):
        return worker_service_pb2.GetWorkerStatusResponse(
            status=admin_service_pb2.WorkerStatus(
                healthy=self.healthy,
                max_batch_size=self.max_batch,
                resident_adapters=self.resident,
                mode=self.mode,
                merged_adapter=self.merged,
            )
        )

    async def SetMode(self, request, context):
        await asyncio.sleep(0.1)  # a switch takes a while; requests placed after it must wait
        self.mode, self.merged = request.mode, request.merged_adapter.version
        self.events.append(f"set_mode {types_pb2.InferenceMode.Name(request.mode)} {self.merged}")
        return worker_service_pb2.SetModeResponse(switch_ms=100.0)


@contextlib.asynccontextmanager
async def cluster(*workers: FakeWorker, **settings):
    servers = []
    for w in workers:
        server = grpc.aio.server()
        worker_service_pb2_grpc.add_WorkerServiceServicer_to_server(w, server)
        w.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        servers.append(server)
    cfg = SchedulerSettings(
        worker_addresses=[w.address for w in workers], status_poll_s=0.05, dispatch_tick_s=0.05, **settings
    )
    service = await create_server(cfg)
    await service.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{service.port}")
    try:
        yield scheduler_service_pb2_grpc.SchedulerServiceStub(channel)
    finally:
        await channel.close()
        await service.stop(0)
        for server in servers:
            await server.stop(0)


def submit_request(rid="r1", adapter=ADAPTER, slo_ms=0.0, slo_class=""):
    item = work_pb2.WorkItem(
        request_id=rid, prompt="what is it?", output_kind=types_pb2.OUTPUT_KIND_TEXT, slo_ms=slo_ms, slo_class=slo_class
    )
    if adapter:
        item.adapter.CopyFrom(work_pb2.AdapterRef(version=adapter, sha256="ab" * 32))
    return scheduler_service_pb2.SubmitRequest(item=item)


async def collect(stub, request, timeout=10):
    return [r async for r in stub.Submit(request, timeout=timeout)]


async def wait_until(predicate, timeout=5.0):
    async def loop():
        while not await predicate():
            await asyncio.sleep(0.02)

    await asyncio.wait_for(loop(), timeout)


async def test_submit_relays_deltas_and_result_with_worker_and_queue_time():
    w = FakeWorker()
    async with cluster(w) as stub:
        out = await collect(stub, submit_request("req-7"), timeout=7)
    assert [r.text_delta for r in out] == ["hel", "lo", ""]
    result = out[-1].result
    assert result.text == "hello" and result.worker == w.address and result.request_id == "req-7"
    assert result.timing.queue_ms >= 1.0  # the worker's own 1.0 plus the scheduler's queue time
    assert w.calls == [("req-7", "req-7")]
    assert 0 < w.remaining <= 8  # Submit's deadline travelled to the worker call


async def test_queue_full_is_resource_exhausted_with_retry_info():
    w = FakeWorker(healthy=False)  # nothing dispatches: requests stay queued
    async with cluster(w, max_queue=1, retry_after_s=2.5) as stub:
        first = stub.Submit(submit_request("r1"), timeout=10)
        reader = asyncio.ensure_future(first.read())

        async def queued():
            st = await stub.GetSchedulerStatus(scheduler_service_pb2.GetSchedulerStatusRequest())
            return st.queued_requests == 1

        await wait_until(queued)
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await collect(stub, submit_request("r2"))
        first.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await reader
    err = exc.value
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    status = rpc_status.from_call(err)
    retry = [d for d in status.details if d.Is(error_details_pb2.RetryInfo.DESCRIPTOR)]
    assert retry, status
    info = error_details_pb2.RetryInfo()
    retry[0].Unpack(info)
    assert info.retry_delay.ToNanoseconds() == 2_500_000_000


async def test_worker_failing_before_first_token_is_retried_elsewhere():
    bad = FakeWorker(fail_before_first=True, resident=[ADAPTER])  # affinity sends the request here first
    good = FakeWorker()
    async with cluster(bad, good) as stub:
        out = await collect(stub, submit_request("r1"))
        status = await stub.GetSchedulerStatus(scheduler_service_pb2.GetSchedulerStatusRequest())
    assert out[-1].result.worker == good.address and out[-1].result.text == "hello"
    assert len(bad.calls) == 1 and len(good.calls) == 1
    assert status.queued_requests == 0


async def test_worker_failing_after_first_token_is_unavailable_and_not_replayed():
    bad = FakeWorker(fail_after_first=True, resident=[ADAPTER])
    good = FakeWorker()
    async with cluster(bad, good) as stub:
        got = []
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            async for r in stub.Submit(submit_request("r1"), timeout=10):
                got.append(r.text_delta)
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    assert got == ["hel"] and len(bad.calls) == 1 and good.calls == []


async def test_a_row_failed_by_the_engine_after_first_token_keeps_its_own_error():
    """A worker whose engine fails one request mid-stream (ENGINE_STEP_FAILED: a decode step that
    raised for that row alone, services/worker/decoder.py) is not a failed worker: the client gets
    the engine's INTERNAL with its reason and message, not replayed. Before: UNAVAILABLE
    WORKER_FAILED_MID_STREAM, the engine's error gone."""
    bad = FakeWorker(fail_after_first="row", resident=[ADAPTER])
    good = FakeWorker()
    async with cluster(bad, good) as stub:
        got = []
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            async for r in stub.Submit(submit_request("r1"), timeout=10):
                got.append(r.text_delta)
    info = error_details_pb2.ErrorInfo()
    reasons = [info.reason for d in rpc_status.from_call(exc.value).details if d.Unpack(info)]
    assert exc.value.code() == grpc.StatusCode.INTERNAL and reasons == ["ENGINE_STEP_FAILED"], exc.value
    assert "bad row" in exc.value.details()
    assert got == ["hel"] and len(bad.calls) == 1 and good.calls == []


async def test_every_worker_failing_is_unavailable():
    workers = [FakeWorker(fail_before_first=True), FakeWorker(fail_before_first=True)]
    async with cluster(*workers) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await collect(stub, submit_request("r1"))
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    assert [len(w.calls) for w in workers] == [1, 1]


async def test_request_expiring_in_the_queue_is_dropped():
    w = FakeWorker(healthy=False)
    async with cluster(w) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await collect(stub, submit_request("r1"), timeout=0.3)

        async def empty():
            st = await stub.GetSchedulerStatus(scheduler_service_pb2.GetSchedulerStatusRequest())
            return st.queued_requests == 0

        await wait_until(empty)
    assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert w.calls == []


async def test_cancelling_submit_cancels_the_worker_call():
    w = FakeWorker(hang=True)
    async with cluster(w) as stub:
        call = stub.Submit(submit_request("r1"), timeout=10)
        reader = asyncio.ensure_future(call.read())

        async def started():
            return bool(w.calls)

        await wait_until(started)
        call.cancel()
        await asyncio.wait_for(w.cancelled.wait(), 5)
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await reader

        async def freed():
            st = await stub.GetSchedulerStatus(scheduler_service_pb2.GetSchedulerStatusRequest())
            return st.workers[0].running_requests == 0

        await wait_until(freed)


async def test_status_lists_workers():
    up, down = FakeWorker(max_batch=6, resident=[ADAPTER]), FakeWorker(healthy=False)
    async with cluster(up, down) as stub:
        st = await stub.GetSchedulerStatus(scheduler_service_pb2.GetSchedulerStatusRequest())
    by_addr = {w.address: w for w in st.workers}
    assert by_addr[up.address].healthy and by_addr[up.address].max_batch_size == 6
    assert list(by_addr[up.address].resident_adapters) == [ADAPTER]
    assert not by_addr[down.address].healthy


async def test_mode_command_is_applied_before_the_request_runs():
    other = "adapters/trucks/versions/2"
    # Merged with an adapter nobody asks for: the default (valora) policy switches to the
    # request's adapter, and the request runs only once the switch is applied.
    w = FakeWorker(merged=other)
    async with cluster(w) as stub:
        out = await collect(stub, submit_request("r1"))
    assert out[-1].result.text == "hello"
    assert w.events == [f"set_mode INFERENCE_MODE_MERGED {ADAPTER}", f"generate {ADAPTER}"]


async def test_foundation_policy_opens_a_merged_worker_to_mixture_mode():
    other = "adapters/trucks/versions/2"
    w = FakeWorker(merged=other)
    async with cluster(w, policy="affinity") as stub:
        out = await collect(stub, submit_request("r1"))
    assert out[-1].result.text == "hello"
    assert w.events == [f"set_mode INFERENCE_MODE_MIXTURE {other}", f"generate {ADAPTER}"]


async def test_dead_workers_unstarted_requests_are_placed_again():
    bad = FakeWorker(fail_before_first=True, resident=[ADAPTER])  # affinity sends them here first
    good = FakeWorker()
    async with cluster(bad, good) as stub:
        outs = await asyncio.gather(*(collect(stub, submit_request(f"r{i}")) for i in range(3)))
    assert all(out[-1].result.worker == good.address for out in outs)
    assert sorted(rid for rid, _ in good.calls) == ["r0", "r1", "r2"]


async def test_waiting_requests_adapter_is_prefetched_to_a_worker():
    other = "adapters/trucks/versions/2"
    w = FakeWorker(max_batch=1, hang=True, resident=[ADAPTER])
    async with cluster(w) as stub:
        first = stub.Submit(submit_request("r1"), timeout=10)
        reader = asyncio.ensure_future(first.read())

        async def started():
            return bool(w.calls)

        await wait_until(started)
        second = stub.Submit(submit_request("r2", adapter=other), timeout=10)
        reader2 = asyncio.ensure_future(second.read())

        async def prefetched():
            return f"load {other} to_device=True" in w.events

        await wait_until(prefetched)
        for call, r in ((first, reader), (second, reader2)):
            call.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await r


def slo_count(slo_class, outcome):
    return REGISTRY.get_sample_value("valora:slo_requests_total", {"slo_class": slo_class, "outcome": outcome}) or 0


@pytest.mark.parametrize("deadlines", [True, False])
async def test_under_contention_tighter_objectives_run_first_and_attainment_is_counted(deadlines):
    """One slot, busy (with a request whose 1 ms objective it misses) while a queue builds: two
    requests without an objective, two with 800 ms (tighter than θ = 1 s, the objective-less
    requests' bound) and one with 60 s. Earliest deadline first serves 800 ms, none, 60 s; without
    deadlines arrival order. Attainment counts per class: the 1 ms one over, the others within."""
    held = asyncio.Event()
    w = FakeWorker(max_batch=1, hold_first=held)
    queued = [
        ("bulk-1", 0.0, ""),
        ("bulk-2", 0.0, ""),
        ("video-1", 800.0, "t-video"),
        ("video-2", 800.0, "t-video"),
        ("loose-1", 60_000.0, "t-loose"),
    ]
    classes = [
        ("t-video", "within"),
        ("t-video", "over"),
        ("t-loose", "within"),
        ("t-loose", "over"),
        ("t-tight", "within"),
        ("t-tight", "over"),
    ]
    before = {k: slo_count(*k) for k in classes}
    async with cluster(w, slo_deadlines=deadlines) as stub:

        async def queued_is(n):
            st = await stub.GetSchedulerStatus(scheduler_service_pb2.GetSchedulerStatusRequest())
            return st.queued_requests == n

        async def started():
            return bool(w.calls)

        first = asyncio.ensure_future(collect(stub, submit_request("tight-0", slo_ms=1.0, slo_class="t-tight")))
        await wait_until(started)
        calls = []
        for n, (rid, slo_ms, slo_class) in enumerate(queued, 1):  # one at a time: arrival order is this order
            calls.append(asyncio.ensure_future(collect(stub, submit_request(rid, slo_ms=slo_ms, slo_class=slo_class))))
            await wait_until(lambda n=n: queued_is(n))
        held.set()
        outs = await asyncio.gather(first, *calls)
    assert all(out[-1].result.text == "hello" for out in outs)
    order = [rid for rid, _ in w.calls[1:]]
    if deadlines:
        assert order == ["video-1", "video-2", "bulk-1", "bulk-2", "loose-1"]
        # the worker learns what is left of each objective (it orders its own queues by it)
        assert w.slo_left["bulk-1"] is None and w.slo_left["bulk-2"] is None
        assert w.slo_left["tight-0"] < 1.0 and all(0.0 < w.slo_left[v] < 800.0 for v in ("video-1", "video-2"))
        assert 59_000.0 < w.slo_left["loose-1"] < 60_000.0
    else:
        assert order == [rid for rid, _, _ in queued]
        assert set(w.slo_left.values()) == {None}  # first come, first served on the worker too
    moved = {k: slo_count(*k) - v for k, v in before.items()}
    assert moved == {
        ("t-video", "within"): 2,
        ("t-video", "over"): 0,
        ("t-loose", "within"): 1,
        ("t-loose", "over"): 0,
        ("t-tight", "within"): 0,
        ("t-tight", "over"): 1,
    }


@pytest.mark.parametrize("policy", ["slora", "punica", "dlora"])
async def test_baseline_policies_leave_the_workers_first_come_first_served(policy):
    """Only valora tells a worker what is left of a request's objective (WorkItem.slo_left_ms):
    the baselines' engines have no objectives."""
    w = FakeWorker()
    async with cluster(w, policy=policy) as stub:
        out = await collect(stub, submit_request("video-1", slo_ms=800.0, slo_class="t-video"))
    assert out[-1].result.text == "hello" and w.slo_left == {"video-1": None}


def test_worker_addresses_from_env(monkeypatch):
    monkeypatch.setenv("VALORA_WORKER_ADDRESSES", "10.0.0.1:50061,10.0.0.2:50061")
    assert SchedulerSettings().worker_addresses == ["10.0.0.1:50061", "10.0.0.2:50061"]
    monkeypatch.setenv("VALORA_WORKER_ADDRESSES", '["w-0.workers:50061"]')
    assert SchedulerSettings().worker_addresses == ["w-0.workers:50061"]
