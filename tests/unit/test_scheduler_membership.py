"""Workers joining and leaving the scheduler's pool at run time (RegisterWorker, Heartbeat,
DeregisterWorker), over real loopback gRPC against small in-test workers, plus the worker's
registration client (services/worker/registration.py) against a real scheduler."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from test_scheduler_service import ADAPTER, FakeWorker, collect, submit_request, wait_until

from services.scheduler.config import SchedulerSettings
from services.scheduler.server import create_server
from services.worker.registration import SchedulerRegistration
from valora.cluster import free_port
from valora_protos.internal.v1 import scheduler_service_pb2, scheduler_service_pb2_grpc, worker_service_pb2_grpc

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


@contextlib.asynccontextmanager
async def serving(worker: FakeWorker):
    server = grpc.aio.server()
    worker_service_pb2_grpc.add_WorkerServiceServicer_to_server(worker, server)
    worker.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    try:
        yield server
    finally:
        await server.stop(0)


@contextlib.asynccontextmanager
async def scheduler(static=(), **settings):
    cfg = SchedulerSettings(worker_addresses=list(static), status_poll_s=0.05, dispatch_tick_s=0.05, **settings)
    service = await create_server(cfg)
    await service.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{service.port}")
    try:
        yield scheduler_service_pb2_grpc.SchedulerServiceStub(channel), service
    finally:
        await channel.close()
        await service.stop(0)


async def status(stub):
    # wait_for_ready: a channel to a port that refused connections a moment ago is still backing off.
    return await stub.GetSchedulerStatus(
        scheduler_service_pb2.GetSchedulerStatusRequest(), wait_for_ready=True, timeout=5
    )


async def healthy(stub, address) -> bool:
    return any(w.address == address and w.healthy for w in (await status(stub)).workers)


async def listed(stub, address) -> bool:
    return any(w.address == address for w in (await status(stub)).workers)


def registration(scheduler_port: int, worker: FakeWorker, **kwargs) -> SchedulerRegistration:
    return SchedulerRegistration(
        f"127.0.0.1:{scheduler_port}",
        address=worker.address,
        name="w",
        device="cpu",
        max_batch_size=worker.max_batch,
        heartbeat_s=0.05,
        **kwargs,
    )


async def test_worker_joining_at_run_time_receives_work():
    static, joiner = FakeWorker(max_batch=1, hang=True), FakeWorker()
    async with serving(static), serving(joiner), scheduler([static.address]) as (stub, service):
        # The static worker is busy with a request that never ends.
        first = stub.Submit(submit_request("r0"), timeout=10)
        reader = asyncio.ensure_future(first.read())
        await wait_until(lambda: _true(bool(static.calls)))
        reg = registration(service.port, joiner)
        await reg.start()
        await wait_until(lambda: healthy(stub, joiner.address))
        out = await collect(stub, submit_request("r1"))
        st = await status(stub)
        await reg.stop()
        first.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await reader
        await wait_until(lambda: _not(listed(stub, joiner.address)))  # deregistered on stop
    assert out[-1].result.worker == joiner.address and joiner.calls[0][0] == "r1"
    by_addr = {w.address: w for w in st.workers}
    assert by_addr[joiner.address].device == "cpu" and by_addr[joiner.address].max_batch_size == 4
    assert reg.registrations == 1


async def test_silent_worker_is_lost_its_waiting_requests_go_elsewhere_and_it_is_removed():
    frozen = FakeWorker(hang=True, resident=[ADAPTER])  # accepts work, never answers, stops heartbeating
    good = FakeWorker()
    async with serving(frozen), serving(good), scheduler(worker_ttl_s=0.5, worker_grace_s=0.5) as (stub, service):
        # Registered by hand: this worker never sends a heartbeat.
        sched = stub
        await sched.RegisterWorker(
            scheduler_service_pb2.RegisterWorkerRequest(address=frozen.address, max_batch_size=4)
        )
        await wait_until(lambda: healthy(stub, frozen.address))
        calls = [asyncio.ensure_future(collect(stub, submit_request(f"r{i}"))) for i in range(2)]
        await wait_until(lambda: _true(len(frozen.calls) == 2))  # both placed on the frozen worker
        reg = registration(service.port, good)
        await reg.start()
        outs = await asyncio.gather(*calls)  # no heartbeat from `frozen` for the TTL: placed again
        await wait_until(lambda: _not(listed(stub, frozen.address)))  # then removed after the grace
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await sched.Heartbeat(scheduler_service_pb2.HeartbeatRequest(address=frozen.address))
        await reg.stop()
    assert all(out[-1].result.worker == good.address for out in outs)
    assert sorted(rid for rid, _ in good.calls) == ["r0", "r1"]
    assert frozen.cancelled.is_set()  # the worker calls were cancelled, not left running
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_worker_lost_mid_stream_fails_its_streams_within_the_ttl():
    """A worker stopped after its first tokens (SIGSTOP: the stream goes silent, heartbeats stop)
    fails its clients UNAVAILABLE once the pool declares it lost, not at their deadlines."""
    stopped = FakeWorker(stall_after_first=True)
    async with serving(stopped), scheduler(worker_ttl_s=0.5, worker_grace_s=5) as (stub, service):
        await stub.RegisterWorker(
            scheduler_service_pb2.RegisterWorkerRequest(address=stopped.address, max_batch_size=4)
        )  # no heartbeats
        await wait_until(lambda: healthy(stub, stopped.address))
        call = stub.Submit(submit_request("r-mid"), timeout=30)
        first = await call.read()
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await call.read()
        waited = asyncio.get_running_loop().time() - t0
    assert first.text_delta == "hel"
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE and "lost after output started" in exc.value.details()
    assert waited < 0.5 + 2, waited  # the TTL plus the pool's check interval, not the 30 s deadline
    assert stopped.cancelled.is_set()


async def test_killed_workers_waiting_requests_go_elsewhere():
    doomed, good = FakeWorker(hang=True), FakeWorker()
    async with scheduler(worker_ttl_s=0.5, worker_grace_s=0.5) as (stub, service), serving(good):
        async with serving(doomed):
            reg = registration(service.port, doomed)
            await reg.start()
            await wait_until(lambda: healthy(stub, doomed.address))
            calls = [asyncio.ensure_future(collect(stub, submit_request(f"r{i}"))) for i in range(2)]
            await wait_until(lambda: _true(len(doomed.calls) == 2))
            reg2 = registration(service.port, good)
            await reg2.start()
            await wait_until(lambda: healthy(stub, good.address))
            reg._task.cancel()  # killed: no deregistration, the server goes away with its calls
        outs = await asyncio.gather(*calls)
        await wait_until(lambda: _not(listed(stub, doomed.address)))
        await reg2.stop()
    assert all(out[-1].result.worker == good.address for out in outs)
    assert sorted(rid for rid, _ in good.calls) == ["r0", "r1"]


async def test_killed_worker_is_removed_and_a_restart_registers_again():
    w = FakeWorker()
    async with scheduler(worker_ttl_s=0.3, worker_grace_s=0.3) as (stub, service):
        async with serving(w):
            reg = registration(service.port, w)
            await reg.start()
            await wait_until(lambda: healthy(stub, w.address))
            port = int(w.address.rsplit(":", 1)[1])
            # Killed: the process is gone without deregistering (heartbeats and polls stop).
            reg._task.cancel()
            reg.registered = False
        await wait_until(lambda: _not(listed(stub, w.address)))
        # Restarted under the same address (a StatefulSet pod): it registers and takes work again.
        restarted = FakeWorker()
        server = grpc.aio.server()
        worker_service_pb2_grpc.add_WorkerServiceServicer_to_server(restarted, server)
        restarted.address = f"127.0.0.1:{server.add_insecure_port(f'127.0.0.1:{port}')}"
        await server.start()
        try:
            reg2 = registration(service.port, restarted)
            await reg2.start()
            await wait_until(lambda: healthy(stub, restarted.address))
            out = await collect(stub, submit_request("r1"))
            await reg2.stop()
            await reg.stop()
        finally:
            await server.stop(0)
    assert restarted.address == w.address
    assert out[-1].result.worker == restarted.address and restarted.calls[0][0] == "r1"


async def test_worker_retries_until_the_scheduler_is_up_and_registers_again_after_its_restart():
    w = FakeWorker()
    async with serving(w):
        # The scheduler's port is chosen first; the worker starts before the scheduler exists.
        port = free_port()
        reg = registration(port, w, backoff_initial_s=0.05, backoff_max_s=0.2)
        await reg.start()
        await asyncio.sleep(0.3)
        assert not reg.registered
        async with scheduler(port=port) as (stub, _):
            await wait_until(lambda: healthy(stub, w.address))
            out = await collect(stub, submit_request("r1"))
        assert out[-1].result.worker == w.address
        # A new scheduler process knows nothing: the heartbeat's NOT_FOUND makes the worker register again.
        async with scheduler(port=port) as (stub, _):
            await wait_until(lambda: healthy(stub, w.address), timeout=10)
        await reg.stop()
    assert reg.registrations == 2


async def test_registration_needs_an_address_and_unknown_heartbeats_are_not_found():
    async with scheduler() as (stub, _):
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await stub.RegisterWorker(scheduler_service_pb2.RegisterWorkerRequest())
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await stub.Heartbeat(scheduler_service_pb2.HeartbeatRequest(address="10.0.0.9:50061"))
        with pytest.raises(grpc.aio.AioRpcError) as gone:
            await stub.DeregisterWorker(scheduler_service_pb2.DeregisterWorkerRequest(address="10.0.0.9:50061"))
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert unknown.value.code() == gone.value.code() == grpc.StatusCode.NOT_FOUND


async def _true(value):
    return value


async def _not(awaitable):
    return not await awaitable


async def test_a_frozen_worker_is_lost_ttl_after_its_last_healthy_status():
    """Loss counts from the worker's last healthy status, not from the poll that noticed it: a
    frozen (SIGSTOPped) worker's stream goes silent, the next poll times out seconds later, and
    counting the TTL from there made its mid-stream clients wait TTL + that detection delay
    (13.5 s against a 10 s TTL, bench/results/reliability-worker-sigstop.json)."""
    from services.scheduler.workers import WorkerPool
    from valora_protos.internal.v1 import worker_service_pb2
    from valora_protos.v1 import admin_service_pb2

    now = [0.0]
    pool = WorkerPool(
        ["127.0.0.1:1"],
        poll_s=1.0,
        poll_timeout_s=2.0,
        default_max_batch_size=4,
        channel_options=[],
        on_change=lambda: None,
        ttl_s=10.0,
        clock=lambda: now[0],
    )
    w = pool["127.0.0.1:1"]
    pool._apply(w, worker_service_pb2.GetWorkerStatusResponse(status=admin_service_pb2.WorkerStatus(healthy=True)))
    assert w.healthy
    now[0] = 3.5  # the stream fell silent after t=0; a poll timed out just now
    w.healthy = False
    pool.sweep()
    assert not w.lost and w.down_since_s == 0.0
    now[0] = 9.9
    pool.sweep()
    assert not w.lost
    now[0] = 10.0
    pool.sweep()
    assert w.lost and w.lost_event.is_set()
    await pool.close()
