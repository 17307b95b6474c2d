"""The scheduler's view of its workers: one channel each, status polled periodically.

`WorkerPool` owns the channels and the poll task; `WorkerHandle.view()` turns the last status
(plus the scheduler's own count of requests it has running there) into the policy's plain
`WorkerView`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import structlog

from services.common.channels import open_channel
from services.scheduler.policy import Mode, WorkerView
from valora.internal.v1 import worker_service_pb2, worker_service_pb2_grpc
from valora.v1 import admin_service_pb2, types_pb2

log = structlog.get_logger()

_MODES = {
    types_pb2.INFERENCE_MODE_BASE: Mode.BASE,
    types_pb2.INFERENCE_MODE_MERGED: Mode.MERGED,
    types_pb2.INFERENCE_MODE_UNMERGED: Mode.UNMERGED,
    types_pb2.INFERENCE_MODE_MIXTURE: Mode.MIXTURE,
}
MODE_TO_PB = {mode: pb for pb, mode in _MODES.items()}


@dataclass
class WorkerHandle:
    address: str
    channel: grpc.aio.Channel
    stub: worker_service_pb2_grpc.WorkerServiceStub
    default_max_batch_size: int
    # Last status the worker reported; None until the first successful poll.
    status: admin_service_pb2.WorkerStatus | None = None
    healthy: bool = False
    # Requests this scheduler has dispatched there and not yet finished.
    inflight: int = 0
    consecutive_failures: int = 0
    _logged_down: bool = field(default=False, repr=False)

    def view(self) -> WorkerView:
        st = self.status
        if st is None:
            return WorkerView(self.address, healthy=False, max_batch_size=0, running=self.inflight)
        return WorkerView(
            address=self.address,
            healthy=self.healthy,
            max_batch_size=st.max_batch_size or self.default_max_batch_size,
            # The scheduler is the workers' only client: its own count is exact and current.
            running=max(self.inflight, 0),
            mode=_MODES.get(st.mode, Mode.UNKNOWN),
            merged_adapter=st.merged_adapter or None,
            resident_adapters=frozenset(st.resident_adapters),
            device=st.device,
        )

    def to_pb(self) -> admin_service_pb2.WorkerStatus:
        out = admin_service_pb2.WorkerStatus()
        if self.status is not None:
            out.CopyFrom(self.status)
        out.address = self.address
        out.healthy = self.healthy
        out.running_requests = max(out.running_requests, self.inflight)
        return out

    def mark_failed(self, why: str) -> None:
        """A call failed in a way that says the worker is down; the next good poll revives it."""
        if self.healthy:
            log.warning("worker_down", worker=self.address, error=why)
        self.healthy = False


class WorkerPool:
    """Channels to every configured worker and a background status poller."""

    def __init__(self, addresses: list[str], *, poll_s: float, poll_timeout_s: float,
                 default_max_batch_size: int, channel_options: list[tuple[str, int]],
                 on_change: Callable[[], None], tracer_provider=None, credentials=None) -> None:
        """`credentials`: grpc.ChannelCredentials for TLS to the workers (None: plaintext)."""
        self.workers: dict[str, WorkerHandle] = {}
        for addr in addresses:
            channel = open_channel(addr, channel_options, tracer_provider, credentials=credentials)
            self.workers[addr] = WorkerHandle(addr, channel, worker_service_pb2_grpc.WorkerServiceStub(channel),
                                              default_max_batch_size)
        self._poll_s = poll_s
        self._poll_timeout_s = poll_timeout_s
        self._on_change = on_change
        self._task: asyncio.Task | None = None

    def __getitem__(self, address: str) -> WorkerHandle:
        return self.workers[address]

    def views(self) -> list[WorkerView]:
        return [w.view() for w in self.workers.values()]

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(w) for w in self.workers.values()))
        self._on_change()

    async def _poll(self, worker: WorkerHandle) -> None:
        try:
            resp = await worker.stub.GetWorkerStatus(worker_service_pb2.GetWorkerStatusRequest(),
                                                     timeout=self._poll_timeout_s)
        except grpc.RpcError as err:
            worker.consecutive_failures += 1
            if worker.healthy or not worker._logged_down:
                log.warning("worker_status_failed", worker=worker.address, code=err.code().name)
                worker._logged_down = True
            worker.healthy = False
            return
        if resp.status.healthy and not worker.healthy:
            log.info("worker_up", worker=worker.address)
        elif not resp.status.healthy and (worker.healthy or not worker._logged_down):
            log.warning("worker_reports_unhealthy", worker=worker.address)
        worker._logged_down = not resp.status.healthy
        worker.status = resp.status
        worker.healthy = resp.status.healthy
        worker.consecutive_failures = 0

    async def _run(self) -> None:
        while True:
            try:
                await self.poll_once()
            except Exception as exc:  # noqa: BLE001 - the poller must outlive one bad round
                log.error("worker_poll_bug", error=repr(exc))
            await asyncio.sleep(self._poll_s)

    async def start(self) -> None:
        await self.poll_once()
        self._task = asyncio.create_task(self._run(), name="worker-status-poll")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task], timeout=5.0)
        await asyncio.gather(*(w.channel.close() for w in self.workers.values()))
