"""What every service's gRPC server does with a request it cannot parse (services/common/server.py:
ErrorInterceptor), shown on the scheduler's server."""

from __future__ import annotations

import grpc
import pytest

from services.scheduler.config import SchedulerSettings
from services.scheduler.server import create_server

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def test_garbage_request_bytes_are_invalid_argument_not_unknown():
    """Bytes that do not parse as the method's message are the caller's error (grpc itself
    answers a deserializer's exception with UNKNOWN), unary and streaming alike."""
    service = await create_server(SchedulerSettings(worker_addresses=[]))
    await service.start()
    garbage = b"\xff\xff\xff\xff\x0f"
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{service.port}") as ch:
            unary = ch.unary_unary("/valora.internal.v1.SchedulerService/GetSchedulerStatus")
            streaming = ch.unary_stream("/valora.internal.v1.SchedulerService/Submit")
            with pytest.raises(grpc.RpcError) as a:
                await unary(garbage, timeout=5)
            with pytest.raises(grpc.RpcError) as b:
                [r async for r in streaming(garbage, timeout=5)]
            ok = await unary(b"", timeout=5)  # an empty message is a valid (default) request
        assert a.value.code() == b.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (a.value, b.value)
        assert "not a valid message" in a.value.details()
        assert isinstance(ok, bytes)
    finally:
        await service.stop(0)


async def test_a_second_server_cannot_take_a_bound_port():
    """grpcio's default SO_REUSEPORT let a second `valora up` bind the first one's port and
    silently take part of its connections; build_service turns it off."""
    first = await create_server(SchedulerSettings(worker_addresses=[]))
    await first.start()
    try:
        with pytest.raises(RuntimeError, match="(?i)bind"):
            await create_server(SchedulerSettings(worker_addresses=[], port=first.port))
    finally:
        await first.stop(0)


def test_server_options_keepalive_and_connection_age():
    from services.common.server import server_options

    plain = dict(server_options(SchedulerSettings()))
    assert plain["grpc.so_reuseport"] == 0 and plain["grpc.keepalive_time_ms"] == 60_000
    assert "grpc.max_connection_age_ms" not in plain
    aged = dict(server_options(SchedulerSettings(max_connection_age_s=300)))
    assert aged["grpc.max_connection_age_ms"] == 300_000 and aged["grpc.max_connection_age_grace_ms"] >= 30_000
