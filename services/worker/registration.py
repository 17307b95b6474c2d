"""The worker's membership client: joins the scheduler's pool and stays in it.

With `scheduler_address` set, the worker calls `SchedulerService.RegisterWorker` once its engine
is up, then `Heartbeat` every `heartbeat_s` (never slower than a third of the TTL the scheduler
returns). A scheduler that is not up yet, or unreachable, is retried with capped exponential
backoff and jitter, so workers may start before the scheduler. A heartbeat answered NOT_FOUND
(the scheduler restarted or dropped this worker) registers again. On a graceful stop the worker
calls `DeregisterWorker` (best effort).
"""

from __future__ import annotations

import asyncio
import contextlib
import random

import grpc
import structlog

from services.common.channels import open_channel
from valora_protos.internal.v1 import scheduler_service_pb2, scheduler_service_pb2_grpc

log = structlog.get_logger()


class SchedulerRegistration:
    """Background registration + heartbeats of one worker with one scheduler."""

    def __init__(
        self,
        scheduler_address: str,
        *,
        address: str,
        name: str,
        device: str,
        max_batch_size: int,
        heartbeat_s: float,
        channel_options=(),
        tracer_provider=None,
        credentials=None,
        token: str = "",
        rpc_timeout_s: float = 5.0,
        backoff_initial_s: float = 0.2,
        backoff_max_s: float = 5.0,
    ) -> None:
        self.scheduler_address = scheduler_address
        self.address = address
        self.request = scheduler_service_pb2.RegisterWorkerRequest(
            address=address, name=name, device=device, max_batch_size=max_batch_size
        )
        self.heartbeat_s = heartbeat_s
        self.rpc_timeout_s = rpc_timeout_s
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self._channel = open_channel(
            scheduler_address, channel_options, tracer_provider, credentials=credentials, token=token
        )
        self._stub = scheduler_service_pb2_grpc.SchedulerServiceStub(self._channel)
        self._task: asyncio.Task | None = None
        self.registered = False
        # Successful RegisterWorker calls (a restarted scheduler makes the worker register again).
        self.registrations = 0

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="scheduler-registration")

    async def _run(self) -> None:
        backoff = self.backoff_initial_s
        interval = self.heartbeat_s
        while True:
            try:
                if not self.registered:
                    resp = await self._stub.RegisterWorker(self.request, timeout=self.rpc_timeout_s)
                    ttl_s = resp.ttl.ToNanoseconds() / 1e9
                    interval = min(self.heartbeat_s, ttl_s / 3) if ttl_s > 0 else self.heartbeat_s
                    self.registered = True
                    self.registrations += 1
                    log.info(
                        "registered_with_scheduler",
                        scheduler=self.scheduler_address,
                        address=self.address,
                        ttl_s=ttl_s,
                        heartbeat_s=interval,
                    )
                else:
                    await self._stub.Heartbeat(
                        scheduler_service_pb2.HeartbeatRequest(address=self.address), timeout=self.rpc_timeout_s
                    )
                backoff = self.backoff_initial_s
                await asyncio.sleep(interval)
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.NOT_FOUND and self.registered:
                    log.warning("scheduler_forgot_worker", scheduler=self.scheduler_address, address=self.address)
                    self.registered = False
                    continue
                log.warning(
                    "scheduler_unreachable",
                    scheduler=self.scheduler_address,
                    code=err.code().name,
                    registered=self.registered,
                    retry_s=round(backoff, 3),
                )
                await asyncio.sleep(backoff * random.uniform(0.8, 1.2))
                backoff = min(backoff * 2, self.backoff_max_s)

    async def stop(self) -> None:
        """Stops heartbeating and leaves the pool (best effort), then closes the channel."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.registered:
            try:
                await self._stub.DeregisterWorker(
                    scheduler_service_pb2.DeregisterWorkerRequest(address=self.address), timeout=self.rpc_timeout_s
                )
                log.info("deregistered_from_scheduler", scheduler=self.scheduler_address, address=self.address)
            except grpc.RpcError as err:
                log.warning("deregister_failed", scheduler=self.scheduler_address, code=err.code().name)
            self.registered = False
        await self._channel.close()
