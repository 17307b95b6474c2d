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
