"""WorkerService.WatchWorkerStatus: the worker pushes its status (at once, on every change, and at
least every interval_ms) with recent step-time percentiles; the scheduler's pool follows the
stream instead of polling, and falls back to polls for workers without it.

Worker side: a real worker server (tiny model) on loopback. Scheduler side: WorkerPool against
small in-test workers."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time

import grpc
import pytest

from services.scheduler.config import SchedulerSettings
from services.common.modes import Mode
from services.scheduler.server import create_server as create_scheduler
from services.scheduler.workers import WorkerPool
from services.worker.model import ensure_tiny_model
from services.worker.requests import step_times
from services.worker.config import WorkerSettings
from services.worker.testing import InMemoryAdapterStore, random_adapter_bundle, serve_worker
from valora_protos.internal.v1 import (
    scheduler_service_pb2,
    scheduler_service_pb2_grpc,
    work_pb2,
    worker_service_pb2,
    worker_service_pb2_grpc,
)
from valora_protos.v1 import admin_service_pb2, types_pb2

pytestmark = pytest.mark.anyio
A = "adapters/alpha/versions/1"
MERGED, UNMERGED = types_pb2.INFERENCE_MODE_MERGED, types_pb2.INFERENCE_MODE_UNMERGED


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


def test_step_times_split_decode_and_prefill_steps():
    log = collections.deque([(1, 0, 40.0), (0, 1, 10.0), (0, 2, 12.0), (2, 1, 50.0), (0, 2, 14.0), (0, 0, 99.0)])
    t = step_times(log)
    assert (t.steps, t.decode_steps, t.prefill_steps) == (6, 3, 2)
    assert t.decode_ms_p50 == 12.0 and t.decode_ms_p90 == pytest.approx(13.6)
    assert t.prefill_ms_p50 == 45.0 and t.prefill_ms_p90 == pytest.approx(49.0)
    assert step_times(log, window=2).steps == 2 and step_times(collections.deque()).decode_ms_p50 == 0.0


# -- the worker's stream ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
async def worker(tmp_path_factory):
    model = ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2-vl")
    store = InMemoryAdapterStore({A: random_adapter_bundle(model, rank=4, seed=1)}, chunk_bytes=4096)
    settings = WorkerSettings(
        model_path=str(model),
        port=0,
        build_tiny_model=False,
        max_batch_size=4,
        default_max_new_tokens=6,
        adapter_cache_dir=str(tmp_path_factory.mktemp("cache")),
    )
    async with serve_worker(settings, store) as (service, channel):
        yield service, store, worker_service_pb2_grpc.WorkerServiceStub(channel)


def ref(store) -> work_pb2.AdapterRef:
    return work_pb2.AdapterRef(version=A, sha256=store.bundles[A].sha256)


async def next_matching(call, predicate, timeout=5.0):
    """Reads the stream until a message satisfies `predicate`; returns it."""
    async with asyncio.timeout(timeout):
        while True:
            msg = await call.read()
            assert msg is not grpc.aio.EOF, "the stream ended"
            if predicate(msg):
                return msg


async def no_watchers(servicer, timeout=5.0):
    async with asyncio.timeout(timeout):
        while servicer._watchers:
            await asyncio.sleep(0.02)


async def test_stream_sends_status_at_once_then_on_mode_changes_and_stops_on_cancel(worker):
    service, store, stub = worker
    # A long interval: every message after the first is a change.
    call = stub.WatchWorkerStatus(worker_service_pb2.WatchWorkerStatusRequest(interval_ms=60_000))
    first = await call.read()
    assert first.status.healthy and first.status.mode == UNMERGED and first.status.merged_adapter == ""
    assert first.status.max_batch_size == 4 and first.status.device == "cpu"
    assert first.step_times.steps == 0 and first.step_times.decode_step_ms_p50 == 0.0  # nothing ran yet
    assert len(service.servicer._watchers) == 1

    await stub.SetMode(worker_service_pb2.SetModeRequest(mode=MERGED, merged_adapter=ref(store)))
    t0 = time.monotonic()
    merged = await next_matching(call, lambda m: m.status.mode == MERGED)
    assert merged.status.merged_adapter == A and A in merged.status.resident_adapters
    assert time.monotonic() - t0 < 5.0  # pushed, not waiting for the 60 s interval

    await stub.Unmerge(worker_service_pb2.UnmergeRequest())
    unmerged = await next_matching(call, lambda m: m.status.mode == UNMERGED)
    assert unmerged.status.merged_adapter == ""
    await stub.Merge(worker_service_pb2.MergeRequest(adapter=ref(store)))
    assert (await next_matching(call, lambda m: m.status.mode == MERGED)).status.merged_adapter == A
    await stub.Unmerge(worker_service_pb2.UnmergeRequest())
    await next_matching(call, lambda m: m.status.mode == UNMERGED)

    call.cancel()
    await no_watchers(service.servicer)  # the handler ended with the call


async def test_step_times_after_a_generation_and_the_interval(worker):
    service, store, stub = worker
    item = work_pb2.WorkItem(
        request_id="g1", prompt="Describe it.", adapter=ref(store), params=types_pb2.GenerationParams(max_new_tokens=6)
    )
    async for _ in stub.Generate(worker_service_pb2.GenerateRequest(item=item)):
        pass
    call = stub.WatchWorkerStatus(worker_service_pb2.WatchWorkerStatusRequest(interval_ms=50))
    # The result can reach us a moment before the engine counts the sequence out.
    idle = await next_matching(call, lambda m: m.status.running_requests == 0)
    st = idle.step_times
    assert st.steps >= 2 and st.prefill_steps >= 1 and st.decode_steps >= 1
    assert 0 < st.decode_step_ms_p50 <= st.decode_step_ms_p90
    assert 0 < st.prefill_step_ms_p50 <= st.prefill_step_ms_p90
    assert idle.status.last_step_ms > 0
    # Idle, nothing changes: messages still come every interval_ms (50 ms here).
    for _ in range(3):
        await next_matching(call, lambda m: True, timeout=2.0)
    call.cancel()
    polled = await stub.GetWorkerStatus(worker_service_pb2.GetWorkerStatusRequest())
    assert polled.step_times.steps == st.steps and polled.step_times.decode_step_ms_p50 == st.decode_step_ms_p50
    await no_watchers(service.servicer)

    with pytest.raises(grpc.RpcError) as err:
        await stub.WatchWorkerStatus(worker_service_pb2.WatchWorkerStatusRequest(interval_ms=-1)).read()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_stream_reports_running_requests(worker):
    service, store, stub = worker
    call = stub.WatchWorkerStatus(worker_service_pb2.WatchWorkerStatusRequest(interval_ms=60_000))
    await call.read()
    gen = stub.Generate(
        worker_service_pb2.GenerateRequest(
            item=work_pb2.WorkItem(
                request_id="long", prompt="Count.", params=types_pb2.GenerationParams(max_new_tokens=1000)
            )
        )
    )
    busy = await next_matching(call, lambda m: m.status.running_requests == 1 and m.status.kv_cache_bytes > 0)
    assert busy.status.healthy
    gen.cancel()
    idle = await next_matching(call, lambda m: m.status.running_requests == 0)
    assert idle.status.waiting_requests == 0
    call.cancel()
    await no_watchers(service.servicer)


async def test_stream_ends_cleanly_when_the_worker_drains(worker):
    """Last in this module: it stops the shared worker."""
    service, store, stub = worker
    call = stub.WatchWorkerStatus(worker_service_pb2.WatchWorkerStatusRequest(interval_ms=60_000))
    assert (await call.read()).status.healthy
    t0 = time.monotonic()
    stopping = asyncio.ensure_future(service.stop(grace=10.0, drain_delay=0.3))
    last = await next_matching(call, lambda m: not m.status.healthy, timeout=2.0)
    assert last.status.address
    assert await call.read() is grpc.aio.EOF  # ended by the worker, OK
    assert await call.code() == grpc.StatusCode.OK
    await stopping
    assert time.monotonic() - t0 < 5.0  # the stream did not hold the stop for its 10 s grace
    assert not service.servicer._watchers


# -- the scheduler's side ---------------------------------------------------------------------------


class PushingWorker(worker_service_pb2_grpc.WorkerServiceServicer):
    """Status from `status`; WatchWorkerStatus pushes it on `push()` (unless `streams` is False:
    UNIMPLEMENTED, an older worker). `end_stream()` ends the open stream (a drain)."""

    def __init__(self, *, streams: bool = True) -> None:
        self.streams = streams
        self.status = admin_service_pb2.WorkerStatus(healthy=True, max_batch_size=4, mode=UNMERGED, device="cpu")
        self.polls = 0
        self.opened = 0
        self.open = 0
        self._changed = asyncio.Event()
        self._end = asyncio.Event()
        self.address = ""

    def push(self, **fields) -> None:
        for k, v in fields.items():
            if isinstance(v, list):
                self.status.ClearField(k)
                getattr(self.status, k).extend(v)
            else:
                setattr(self.status, k, v)
        self._changed.set()

    def end_stream(self) -> None:
        self._end.set()

    def _resp(self, cls):
        return cls(
            status=self.status,
            step_times=worker_service_pb2.WorkerStepTimes(
                steps=10, decode_steps=8, decode_step_ms_p50=7.5, decode_step_ms_p90=9.0
            ),
        )

    async def GetWorkerStatus(self, request, context):
        self.polls += 1
        return self._resp(worker_service_pb2.GetWorkerStatusResponse)

    async def WatchWorkerStatus(self, request, context):
        if not self.streams:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
        self.opened += 1
        self.open += 1
        try:
            while True:
                self._changed.clear()
                yield self._resp(worker_service_pb2.WatchWorkerStatusResponse)
                changed = asyncio.ensure_future(self._changed.wait())
                ended = asyncio.ensure_future(self._end.wait())
                await asyncio.wait({changed, ended}, return_when=asyncio.FIRST_COMPLETED)
                changed.cancel()
                ended.cancel()
                if self._end.is_set():
                    self._end.clear()
                    self.status.healthy = False
                    yield self._resp(worker_service_pb2.WatchWorkerStatusResponse)
                    self.status.healthy = True  # back at once (a restart)
                    return
        finally:
            self.open -= 1


@contextlib.asynccontextmanager
async def serving(w: PushingWorker):
    server = grpc.aio.server()
    worker_service_pb2_grpc.add_WorkerServiceServicer_to_server(w, server)
    w.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    try:
        yield
    finally:
        await server.stop(0)


@contextlib.asynccontextmanager
async def pool_of(*workers: PushingWorker, poll_s: float):
    changes = asyncio.Event()
    pool = WorkerPool(
        [w.address for w in workers],
        poll_s=poll_s,
        poll_timeout_s=2.0,
        default_max_batch_size=4,
        channel_options=[],
        on_change=changes.set,
        watch_interval_s=0.5,
        watch_backoff_s=(0.05, 0.2),
    )
    await pool.start()
    try:
        yield pool
    finally:
        await pool.close()


async def until(predicate, timeout=5.0):
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


async def test_pool_view_follows_the_stream_without_polling():
    w = PushingWorker()
    async with serving(w), pool_of(w, poll_s=60.0) as pool:  # one poll at start, then none for a minute
        handle = pool[w.address]
        await until(lambda: handle.watching)
        polls = w.polls
        assert polls == 1 and w.open == 1
        view = handle.view()
        assert view.healthy and view.mode == Mode.UNMERGED and view.merged_adapter is None

        w.push(mode=MERGED, merged_adapter=A, resident_adapters=[A])
        await until(lambda: handle.view().mode == Mode.MERGED)
        view = handle.view()
        assert view.merged_adapter == A and view.resident_adapters == frozenset({A})
        assert handle.step_times.decode_step_ms_p50 == 7.5 and handle.step_times.decode_steps == 8
        assert handle.to_pb().decode_step_ms_p50 == 7.5  # what GetClusterStatus / `valora status` show

        w.push(healthy=False)
        await until(lambda: not handle.view().healthy)
        w.push(healthy=True, mode=UNMERGED, merged_adapter="")
        await until(lambda: handle.view().healthy and handle.view().mode == Mode.UNMERGED)
        assert w.polls == polls  # all of it came over the stream

        # The worker ends the stream (a drain): the pool polls once, then subscribes again.
        w.end_stream()
        await until(lambda: w.opened == 2 and handle.watching)
        await until(lambda: handle.view().healthy)
        w.push(mode=MERGED, merged_adapter=A)
        await until(lambda: handle.view().mode == Mode.MERGED)
    await until(lambda: w.open == 0)  # the pool closed its stream (the server sees the cancel a moment later)


async def test_mode_switch_in_flight_outlives_statuses_sampled_before_it():
    """The dispatcher marks a SetMode in flight (pending_mode): pushed statuses that still show the
    old mode do not undo it (the policy would order the switch again), until the call ends."""
    w = PushingWorker()
    async with serving(w), pool_of(w, poll_s=60.0) as pool:
        handle = pool[w.address]
        await until(lambda: handle.watching)
        handle.pending_mode = (MERGED, A)
        w.push(running_requests=2)  # sampled before the switch: still UNMERGED
        await until(lambda: handle.status.running_requests == 2)
        assert handle.view().mode == Mode.MERGED and handle.view().merged_adapter == A
        handle.pending_mode = None
        w.push(running_requests=1)
        await until(lambda: handle.view().mode == Mode.UNMERGED)


async def test_pool_falls_back_to_polls_when_the_worker_has_no_stream():
    w = PushingWorker(streams=False)
    async with serving(w), pool_of(w, poll_s=0.05) as pool:
        handle = pool[w.address]
        await until(lambda: handle.watch_unsupported)
        assert not handle.watching and handle.view().healthy
        w.push(mode=MERGED, merged_adapter=A)
        await until(lambda: handle.view().mode == Mode.MERGED)  # by polls
        assert w.polls >= 2 and w.opened == 0


async def test_scheduler_reports_pushed_status():
    """The real scheduler service (create_server): GetSchedulerStatus shows what the stream pushed."""
    w = PushingWorker()
    async with serving(w):
        service = await create_scheduler(SchedulerSettings(worker_addresses=[w.address], status_poll_s=60.0))
        await service.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{service.port}")
        stub = scheduler_service_pb2_grpc.SchedulerServiceStub(channel)
        try:
            await until(lambda: w.open == 1)
            w.push(mode=MERGED, merged_adapter=A, resident_adapters=[A], running_requests=3)

            async def merged() -> bool:
                st = await stub.GetSchedulerStatus(scheduler_service_pb2.GetSchedulerStatusRequest())
                return st.workers[0].mode == MERGED and st.workers[0].merged_adapter == A

            async with asyncio.timeout(5):
                while not await merged():
                    await asyncio.sleep(0.02)
            assert w.polls == 1
        finally:
            await channel.close()
            await service.stop(0)
        await until(lambda: w.open == 0)  # the stopped scheduler's stream ends (the worker sees it a moment later)
