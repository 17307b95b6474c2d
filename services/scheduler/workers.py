"""The scheduler's view of its workers: one channel each, status polled periodically.

`WorkerPool` owns the channels and the poll task; `WorkerHandle.view()` turns the last status
(plus the scheduler's own count of requests it has running there, per adapter) into the policy's
plain `WorkerView`.

Membership: the `worker_addresses` setting gives *static* members, kept for the scheduler's
life. Workers may also join at run time (`register`, from the RegisterWorker RPC) and keep their
place with heartbeats. A worker is *down* while its status polls fail, it reports itself
unhealthy, or its heartbeats are older than `ttl_s`; nothing is placed on a down worker. It is
*lost* when its heartbeats expired or it has been down for `ttl_s`: the requests placed there
that have not produced output are then taken back (`WorkerHandle.lost_event`, watched by
SchedulerService.Submit) and placed again. A registered worker still down `grace_s` after it was
lost, or one that deregisters, leaves the pool; its channel closes once its last running request
is done. Registering again (a restart under the same address) revives it.
"""

from __future__ import annotations

import asyncio
import time
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
    # The same requests by adapter version (None = base model): the policy prices their LoRA term.
    running_adapters: dict[str | None, int] = field(default_factory=dict)
    consecutive_failures: int = 0
    # False for workers that joined through RegisterWorker (they leave when lost or deregistered).
    static: bool = True
    # What the worker said when it registered (used until its first status poll).
    name: str = ""
    registered_device: str = ""
    registered_max_batch_size: int = 0
    # Monotonic time of the last RegisterWorker/Heartbeat; None = not heartbeat-monitored.
    last_heartbeat_s: float | None = None
    # Monotonic time it went down (None while healthy), and whether it has been declared lost.
    down_since_s: float | None = None
    lost: bool = False
    lost_since_s: float | None = None
    # Set when the worker is declared lost; a fresh one after it recovers.
    lost_event: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    _logged_down: bool = field(default=False, repr=False)

    def view(self) -> WorkerView:
        st = self.status
        running = max(self.inflight, 0)
        counts = {a: n for a, n in self.running_adapters.items() if n > 0}
        if st is None:
            return WorkerView(self.address, healthy=False, max_batch_size=0, running=running,
                              running_adapters=counts, device=self.registered_device)
        return WorkerView(
            address=self.address,
            healthy=self.healthy and not self.lost,
            max_batch_size=st.max_batch_size or self.registered_max_batch_size or self.default_max_batch_size,
            # The scheduler is the workers' only client: its own count is exact and current.
            running=running,
            mode=_MODES.get(st.mode, Mode.UNKNOWN),
            merged_adapter=st.merged_adapter or None,
            resident_adapters=frozenset(st.resident_adapters),
            running_adapters=counts,
            device=st.device or self.registered_device,
        )

    def heartbeat_expired(self, now_s: float, ttl_s: float) -> bool:
        return self.last_heartbeat_s is not None and now_s - self.last_heartbeat_s > ttl_s

    def started(self, adapter: str | None) -> None:
        """A request for `adapter` was placed here."""
        self.inflight += 1
        self.running_adapters[adapter] = self.running_adapters.get(adapter, 0) + 1

    def finished(self, adapter: str | None) -> None:
        """A request placed here ended (done, failed or taken back)."""
        self.inflight -= 1
        n = self.running_adapters.get(adapter, 0) - 1
        if n > 0:
            self.running_adapters[adapter] = n
        else:
            self.running_adapters.pop(adapter, None)

    def to_pb(self) -> admin_service_pb2.WorkerStatus:
        out = admin_service_pb2.WorkerStatus()
        if self.status is not None:
            out.CopyFrom(self.status)
        out.address = self.address
        out.healthy = self.healthy and not self.lost
        if not out.device:
            out.device = self.registered_device
        out.running_requests = max(out.running_requests, self.inflight)
        return out

    def mark_failed(self, why: str) -> None:
        """A call failed in a way that says the worker is down; the next good poll revives it."""
        if self.healthy:
            log.warning("worker_down", worker=self.address, error=why)
        self.healthy = False


class WorkerPool:
    """Channels to every member worker, a background status poller, and membership (static
    addresses, registration, heartbeats, loss and removal)."""

    def __init__(self, addresses: list[str], *, poll_s: float, poll_timeout_s: float,
                 default_max_batch_size: int, channel_options: list[tuple[str, int]],
                 on_change: Callable[[], None], tracer_provider=None, credentials=None,
                 ttl_s: float = 10.0, grace_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        """`credentials`: grpc.ChannelCredentials for TLS to the workers (None: plaintext).
        `ttl_s`: heartbeat / down time after which a worker is lost; `grace_s`: further time a
        lost registered worker stays listed before it is removed."""
        self._channel_options = channel_options
        self._tracer_provider = tracer_provider
        self._credentials = credentials
        self._default_max_batch_size = default_max_batch_size
        self.workers: dict[str, WorkerHandle] = {}
        # Removed workers with requests still running there, by address (channels open until done).
        self._retired: dict[str, WorkerHandle] = {}
        for addr in addresses:
            self.workers[addr] = self._new_handle(addr)
        self._poll_s = poll_s
        self._poll_timeout_s = poll_timeout_s
        self._on_change = on_change
        self.ttl_s = ttl_s
        self.grace_s = grace_s
        self.clock = clock
        self._task: asyncio.Task | None = None
        self._side_tasks: set[asyncio.Task] = set()

    def _new_handle(self, address: str, *, static: bool = True) -> WorkerHandle:
        channel = open_channel(address, self._channel_options, self._tracer_provider, credentials=self._credentials)
        return WorkerHandle(address, channel, worker_service_pb2_grpc.WorkerServiceStub(channel),
                            self._default_max_batch_size, static=static)

    def __getitem__(self, address: str) -> WorkerHandle:
        return self.workers[address]

    def handle(self, address: str) -> WorkerHandle | None:
        """A member, or a removed worker that still has requests running there."""
        return self.workers.get(address) or self._retired.get(address)

    def views(self) -> list[WorkerView]:
        return [w.view() for w in self.workers.values()]

    # -- requests placed on workers ----------------------------------------------------------------
    def started(self, address: str, adapter: str | None) -> None:
        self.workers[address].started(adapter)

    def finished(self, address: str, adapter: str | None) -> None:
        handle = self.handle(address)
        if handle is None:
            return
        handle.finished(adapter)
        if address in self._retired and handle.inflight <= 0:
            del self._retired[address]
            self._spawn(handle.channel.close(), f"close-{address}")

    # -- membership --------------------------------------------------------------------------------
    def register(self, address: str, *, name: str = "", device: str = "", max_batch_size: int = 0) -> bool:
        """Adds (or refreshes) a worker that called RegisterWorker; True when it is new to the pool.
        Its status is polled at once, so it can take work without waiting for the next round."""
        now = self.clock()
        handle = self.workers.get(address)
        new = handle is None
        if handle is None:
            handle = self._retired.pop(address, None) or self._new_handle(address, static=False)
            self.workers[address] = handle
        handle.name = name or handle.name
        handle.registered_device = device or handle.registered_device
        handle.registered_max_batch_size = max_batch_size or handle.registered_max_batch_size
        handle.last_heartbeat_s = now
        if handle.lost or new:
            # A restarted worker: forget the old process's status until it is polled again.
            handle.status = None
            handle.healthy = False
            self._revive(handle)
        log.info("worker_registered", worker=address, name=name, device=device, new=new, static=handle.static)
        self._spawn(self._poll_and_notify(handle), f"poll-{address}")
        return new

    def heartbeat(self, address: str) -> bool:
        """Refreshes a member's heartbeat; False when the address is not a member (register again)."""
        handle = self.workers.get(address)
        if handle is None:
            return False
        handle.last_heartbeat_s = self.clock()
        return True

    def deregister(self, address: str) -> bool:
        """A worker stopping gracefully leaves the pool (static members only stop being monitored);
        False when the address is not a member."""
        handle = self.workers.get(address)
        if handle is None:
            return False
        log.info("worker_deregistered", worker=address, static=handle.static)
        if handle.static:
            handle.last_heartbeat_s = None
            handle.healthy = False
        else:
            self._remove(handle)
        self._on_change()
        return True

    def _remove(self, handle: WorkerHandle) -> None:
        self.workers.pop(handle.address, None)
        if handle.inflight > 0:
            self._retired[handle.address] = handle
        else:
            self._spawn(handle.channel.close(), f"close-{handle.address}")
        log.warning("worker_removed", worker=handle.address, running=handle.inflight)

    def _revive(self, handle: WorkerHandle) -> None:
        handle.down_since_s = None
        if handle.lost:
            handle.lost = False
            handle.lost_since_s = None
            handle.lost_event = asyncio.Event()

    def sweep(self) -> None:
        """Applies heartbeat expiry, loss and removal (called after every poll round)."""
        now = self.clock()
        for handle in list(self.workers.values()):
            expired = handle.heartbeat_expired(now, self.ttl_s)
            if expired:
                handle.healthy = False
            if handle.healthy:
                if handle.lost:
                    log.info("worker_recovered", worker=handle.address)
                self._revive(handle)
                continue
            if handle.down_since_s is None:
                handle.down_since_s = now
            if not handle.lost and (expired or now - handle.down_since_s >= self.ttl_s):
                handle.lost = True
                handle.lost_since_s = now
                handle.lost_event.set()
                log.warning("worker_lost", worker=handle.address, heartbeat_expired=expired,
                            down_s=round(now - handle.down_since_s, 3))
            if handle.lost and not handle.static and now - (handle.lost_since_s or now) >= self.grace_s:
                self._remove(handle)

    def _spawn(self, coro, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)

    async def _poll_and_notify(self, worker: WorkerHandle) -> None:
        await self._poll(worker)
        self._on_change()

    # -- status polls --------------------------------------------------------------------------------
    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(w) for w in list(self.workers.values())))
        self.sweep()
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
        healthy = resp.status.healthy and not worker.heartbeat_expired(self.clock(), self.ttl_s)
        if healthy and not worker.healthy:
            log.info("worker_up", worker=worker.address)
        elif not healthy and (worker.healthy or not worker._logged_down):
            log.warning("worker_reports_unhealthy", worker=worker.address,
                        heartbeat_expired=resp.status.healthy and not healthy)
        worker._logged_down = not healthy
        worker.status = resp.status
        worker.healthy = healthy
        worker.consecutive_failures = 0
        if healthy:
            self._revive(worker)

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
        tasks = [t for t in (self._task, *self._side_tasks) if t is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        await asyncio.gather(*(w.channel.close() for w in (*self.workers.values(), *self._retired.values())))
