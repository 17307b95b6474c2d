"""The internal token (services/common/internal_auth.py): a scheduler built with one refuses
calls without it, unary and streaming alike, lets health through, and sends it to workers that
check it too; sync channels and token files."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.channels import open_channel
from services.common.internal_auth import InternalAuthInterceptor, internal_token
from valora.internal_token import TOKEN_KEY, with_token
from services.scheduler.config import SchedulerSettings
from services.scheduler.server import create_server
from tests.unit.test_scheduler_service import FakeWorker, submit_request
from valora_protos.internal.v1 import scheduler_service_pb2, scheduler_service_pb2_grpc, worker_service_pb2_grpc

pytestmark = pytest.mark.anyio
TOKEN = "it-3f9a1c7e5b2d"


@pytest.fixture
def anyio_backend():
    return "asyncio"


def code(err: grpc.RpcError) -> grpc.StatusCode:
    return err.code()


async def test_scheduler_and_workers_check_and_send_the_token():
    worker = FakeWorker()
    server = grpc.aio.server(interceptors=[InternalAuthInterceptor("worker", TOKEN)])
    worker_service_pb2_grpc.add_WorkerServiceServicer_to_server(worker, server)
    worker.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    service = await create_server(
        SchedulerSettings(
            worker_addresses=[worker.address], status_poll_s=0.05, dispatch_tick_s=0.05, internal_token=TOKEN
        )
    )
    await service.start()
    address = f"127.0.0.1:{service.port}"
    try:
        for token, want in (("", grpc.StatusCode.UNAUTHENTICATED), ("wrong", grpc.StatusCode.UNAUTHENTICATED)):
            async with open_channel(address, token=token) as ch:
                stub = scheduler_service_pb2_grpc.SchedulerServiceStub(ch)
                with pytest.raises(grpc.RpcError) as unary:
                    await stub.GetSchedulerStatus(scheduler_service_pb2.GetSchedulerStatusRequest(), timeout=5)
                with pytest.raises(grpc.RpcError) as streaming:
                    [r async for r in stub.Submit(submit_request("r-no"), timeout=5)]
                assert code(unary.value) == code(streaming.value) == want, token
                status = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert status.status == health_pb2.HealthCheckResponse.SERVING  # probes carry no token
        assert worker.calls == []  # nothing unauthenticated reached the worker
        async with open_channel(address, token=TOKEN) as ch:
            stub = scheduler_service_pb2_grpc.SchedulerServiceStub(ch)
            st = await stub.GetSchedulerStatus(scheduler_service_pb2.GetSchedulerStatusRequest(), timeout=5)
            assert [w.healthy for w in st.workers] == [True]  # its status polls carried the token
            out = [r async for r in stub.Submit(submit_request("r-ok"), timeout=10)]
        assert out[-1].result.text == "hello" and [c[0] for c in worker.calls] == ["r-ok"]
    finally:
        await service.stop(0)
        await server.stop(0)


async def test_sync_channels_send_the_token():
    service = await create_server(SchedulerSettings(worker_addresses=[], internal_token=TOKEN))
    await service.start()
    try:
        import asyncio

        def status(token):
            with with_token(grpc.insecure_channel(f"127.0.0.1:{service.port}"), token) as ch:
                try:
                    scheduler_service_pb2_grpc.SchedulerServiceStub(ch).GetSchedulerStatus(
                        scheduler_service_pb2.GetSchedulerStatusRequest(),
                        timeout=5,
                        metadata=[(TOKEN_KEY, "caller-set")] if token == TOKEN else None,
                    )
                    return grpc.StatusCode.OK
                except grpc.RpcError as err:
                    return err.code()

        got = [await asyncio.to_thread(status, t) for t in ("", "nope", TOKEN)]
        assert got == [grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.OK]
    finally:
        await service.stop(0)


def test_token_comes_from_the_setting_or_its_file(tmp_path):
    f = tmp_path / "token"
    f.write_text(TOKEN + "\n")
    assert internal_token(SchedulerSettings(internal_token="direct", internal_token_file=str(f))) == "direct"
    assert internal_token(SchedulerSettings(internal_token_file=str(f))) == TOKEN
    assert internal_token(SchedulerSettings()) == ""
    f.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        internal_token(SchedulerSettings(internal_token_file=str(f)))
