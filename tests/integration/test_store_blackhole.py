"""A black-holed PostgreSQL (connections open, nothing answered): the adapter store's calls fail
UNAVAILABLE within its backend timeout instead of hanging, its health turns NOT_SERVING, and
both recover once the database answers again. The store runs in this process (its real gRPC
server) on a loopback TCP proxy to the session's PostgreSQL that can stop forwarding."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.adapter_store.config import StoreSettings
from services.adapter_store.server import create_server
from valora_protos.v1 import admin_service_pb2 as admin
from valora_protos.v1 import admin_service_pb2_grpc as admin_grpc

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


@pytest.fixture
def anyio_backend():
    return "asyncio"


class BlackholeProxy:
    """TCP proxy to host:port; while `hold` is set it forwards nothing (bytes wait, unsent)."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.hold = threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                while self.hold.is_set():
                    time.sleep(0.01)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


async def test_a_blackholed_database_fails_calls_fast_and_recovers(postgres_url, tmp_path):
    proxy = BlackholeProxy("127.0.0.1", 5432)
    url = postgres_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
    service = await create_server(
        StoreSettings(
            port=0,
            database_url=url,
            run_migrations=True,
            blob_dir=str(tmp_path / "blobs"),
            backend_timeout_s=2.0,
            health_check_s=0.3,
            health_check_timeout_s=1.0,
            gc_interval_s=0,
            job_sweep_interval_s=0,
            db_connect_timeout_s=2.0,
            db_statement_timeout_s=5.0,
        )
    )
    await service.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{service.port}")
    stub, health = admin_grpc.AdminServiceStub(channel), health_pb2_grpc.HealthStub(channel)

    async def status():
        return (await health.Check(health_pb2.HealthCheckRequest(), timeout=5)).status

    async def wait_status(want, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if await status() == want:
                return True
            await asyncio.sleep(0.05)
        return False

    try:
        await stub.ListAdapters(admin.ListAdaptersRequest(page_size=5), timeout=10)
        proxy.hold.set()
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ListAdapters(admin.ListAdaptersRequest(page_size=5), timeout=30)
        waited = time.monotonic() - t0
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
        assert waited < 5.0, waited  # bounded by backend_timeout_s, not the client's 30 s
        assert await wait_status(health_pb2.HealthCheckResponse.NOT_SERVING, 5)
        proxy.hold.clear()
        assert await wait_status(health_pb2.HealthCheckResponse.SERVING, 15)
        await stub.ListAdapters(admin.ListAdaptersRequest(page_size=5), timeout=10)
    finally:
        proxy.hold.clear()
        await channel.close()
        await service.stop(0)
        proxy.close()
