"""The scheduler's view of its workers: one channel each, status pushed by the worker or polled.

`WorkerPool` owns the channels, one status stream per worker and the poll task;
`WorkerHandle.view()` turns the last status (plus the scheduler's own count of requests it has
running there, per adapter) into the policy's plain `WorkerView`.

Status: each member's `WatchWorkerStatus` stream is followed (the worker sends its status at
once, on every change and at least every `watch_interval_s`), and every message updates the view
and wakes the dispatcher. A worker is polled (`GetWorkerStatus` every `poll_s`) while its stream
is not delivering: before the first message, after it breaks or ends (one poll at once, then the
stream is opened again with backoff), for good when the worker answers UNIMPLEMENTED (an older
worker; a new registration under its address tries the stream again), and when `watch` is off.
A stream silent for three intervals is dropped as broken.

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
import contextlib
import contextvars
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import structlog

from services.common.channels import open_channel
from services.scheduler.policies.base import WorkerView
from services.common.modes import Mode
from valora_protos.internal.v1 import worker_service_pb2, worker_service_pb2_grpc
from valora_protos.v1 import admin_service_pb2

log = structlog.get_logger()


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
    # Monotonic time of the last healthy status it reported (poll answer or stream message).
    last_ok_s: float | None = None
    # Monotonic time it went down (None while healthy): since its last healthy status, when it
    # had one, so a frozen worker's loss counts from when it went silent, not from when a poll
    # timed out; and whether it has been declared lost.
    down_since_s: float | None = None
    lost: bool = False
    lost_since_s: float | None = None
    # Set when the worker is declared lost; a fresh one after it recovers.
    lost_event: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    _logged_down: bool = field(default=False, repr=False)
    # Status stream: delivering now (the poller skips the worker), or refused as UNIMPLEMENTED.
    watching: bool = False
    watch_unsupported: bool = False
    # Recent engine step times the worker reported with its last status (None until one came).
    step_times: worker_service_pb2.WorkerStepTimes | None = None
    # (mode, merged adapter) of a SetMode the dispatcher has in flight: kept over reported statuses
    # (sampled before the switch) until the call ends, so the policy does not order it again.
    pending_mode: tuple[int, str] | None = None
    _watch_task: asyncio.Task | None = field(default=None, repr=False)
    _watch_kick: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def view(self) -> WorkerView:
        st = self.status
        running = max(self.inflight, 0)
        counts = {a: n for a, n in self.running_adapters.items() if n > 0}
        if st is None:
            return WorkerView(
                self.address,
                healthy=False,
                max_batch_size=0,
                running=running,
                running_adapters=counts,
                device=self.registered_device,
            )
        return WorkerView(
            address=self.address,
            healthy=self.healthy and not self.lost,
            max_batch_size=st.max_batch_size or self.registered_max_batch_size or self.default_max_batch_size,
            # The scheduler is the workers' only client: its own count is exact and current.
            running=running,
            mode=Mode.from_pb(st.mode),
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
        if self.step_times is not None:
            out.decode_step_ms_p50 = self.step_times.decode_step_ms_p50
            out.prefill_step_ms_p50 = self.step_times.prefill_step_ms_p50
        return out

    def mark_failed(self, why: str) -> None:
        """A call failed in a way that says the worker is down; the next good poll revives it."""
        if self.healthy:
            log.warning("worker_down", worker=self.address, error=why)
        self.healthy = False


class WorkerPool:
    """Channels to every member worker, a background status poller, and membership (static
    addresses, registration, heartbeats, loss and removal)."""

    def __init__(
        self,
        addresses: list[str],
        *,
        poll_s: float,
        poll_timeout_s: float,
        default_max_batch_size: int,
        channel_options: list[tuple[str, int]],
        on_change: Callable[[], None],
        tracer_provider=None,
        credentials=None,
        token: str = "",
        ttl_s: float = 10.0,
        grace_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        watch: bool = True,
        watch_interval_s: float = 0.5,
        watch_backoff_s: tuple[float, float] = (0.2, 5.0),
    ) -> None:
        """`credentials`: grpc.ChannelCredentials for TLS to the workers (None: plaintext).
        `ttl_s`: heartbeat / down time after which a worker is lost; `grace_s`: further time a
        lost registered worker stays listed before it is removed. `watch`: follow each worker's
        status stream (`watch_interval_s` the longest gap it leaves between messages; reopened
        after `watch_backoff_s` = (first, most) seconds, doubling) instead of polling it."""
        self._channel_options = channel_options
        self._tracer_provider = tracer_provider
        self._credentials = credentials
        self._token = token  # the workers' internal token (internal_auth.py)
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
        self.watch = watch
        self.watch_interval_s = watch_interval_s
        self.watch_backoff_s = watch_backoff_s
        self._started = False

    def _new_handle(self, address: str, *, static: bool = True) -> WorkerHandle:
        channel = open_channel(
            address, self._channel_options, self._tracer_provider, credentials=self._credentials, token=self._token
        )
        return WorkerHandle(
            address,
            channel,
            worker_service_pb2_grpc.WorkerServiceStub(channel),
            self._default_max_batch_size,
            static=static,
        )

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
            handle.step_times = None
            handle.healthy = False
            handle.watch_unsupported = False  # maybe a newer build: try its stream again
            self._revive(handle)
        log.info("worker_registered", worker=address, name=name, device=device, new=new, static=handle.static)
        self._spawn(self._poll_and_notify(handle), f"poll-{address}")
        self._ensure_watch(handle)
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
        self._stop_watch(handle)
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
                handle.down_since_s = handle.last_ok_s if handle.last_ok_s is not None else now
            if not handle.lost and (expired or now - handle.down_since_s >= self.ttl_s):
                handle.lost = True
                handle.lost_since_s = now
                handle.lost_event.set()
                log.warning(
                    "worker_lost",
                    worker=handle.address,
                    heartbeat_expired=expired,
                    down_s=round(now - handle.down_since_s, 3),
                )
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
        """Polls the members whose status stream is not delivering, then applies loss/removal."""
        await asyncio.gather(*(self._poll(w) for w in list(self.workers.values()) if not w.watching))
        self.sweep()
        self._on_change()

    async def _poll(self, worker: WorkerHandle) -> None:
        try:
            resp = await worker.stub.GetWorkerStatus(
                worker_service_pb2.GetWorkerStatusRequest(), timeout=self._poll_timeout_s
            )
        except grpc.RpcError as err:
            worker.consecutive_failures += 1
            if worker.healthy or not worker._logged_down:
                log.warning("worker_status_failed", worker=worker.address, code=err.code().name)
                worker._logged_down = True
            worker.healthy = False
            return
        self._apply(worker, resp)

    def _apply(self, worker: WorkerHandle, resp) -> None:
        """A status the worker reported (poll answer or stream message) becomes its view."""
        status = resp.status
        healthy = status.healthy and not worker.heartbeat_expired(self.clock(), self.ttl_s)
        if healthy and not worker.healthy:
            log.info("worker_up", worker=worker.address)
        elif not healthy and (worker.healthy or not worker._logged_down):
            log.warning(
                "worker_reports_unhealthy", worker=worker.address, heartbeat_expired=status.healthy and not healthy
            )
        if worker.pending_mode is not None:
            status.mode, status.merged_adapter = worker.pending_mode
        worker._logged_down = not healthy
        worker.status = status
        worker.step_times = resp.step_times if resp.HasField("step_times") else None
        worker.healthy = healthy
        worker.consecutive_failures = 0
        if healthy:
            worker.last_ok_s = self.clock()
            self._revive(worker)

    # -- status streams ------------------------------------------------------------------------------
    def _ensure_watch(self, worker: WorkerHandle) -> None:
        """Follows the worker's status stream (a running follower is woken from its backoff)."""
        if not self.watch or not self._started:
            return
        task = worker._watch_task
        if task is not None and not task.done():
            worker._watch_kick.set()
            return
        # A fresh context: the stream lives on, outside the trace of the call that added the worker.
        worker._watch_task = asyncio.get_running_loop().create_task(
            self._follow(worker), name=f"watch-{worker.address}", context=contextvars.Context()
        )

    def _stop_watch(self, worker: WorkerHandle) -> None:
        if worker._watch_task is not None:
            worker._watch_task.cancel()
            worker._watch_task = None
        worker.watching = False

    async def _follow(self, worker: WorkerHandle) -> None:
        """Reads the worker's status stream; opens it again after it breaks or ends, with backoff.
        Returns when the worker answers UNIMPLEMENTED (polls then cover it)."""
        first_backoff, most_backoff = self.watch_backoff_s
        backoff = first_backoff
        request = worker_service_pb2.WatchWorkerStatusRequest(interval_ms=round(self.watch_interval_s * 1e3))
        silence_s = max(3 * self.watch_interval_s, self._poll_timeout_s)
        while True:
            worker._watch_kick.clear()
            call = worker.stub.WatchWorkerStatus(request)
            why = "ended"
            try:
                while True:
                    async with asyncio.timeout(silence_s):
                        resp = await call.read()
                    if resp is grpc.aio.EOF:
                        break  # the worker drains or stops: its last message said so
                    if not worker.watching:
                        log.info("worker_status_stream", worker=worker.address)
                    self._apply(worker, resp)
                    worker.watching = True
                    backoff = first_backoff
                    self._on_change()
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                    worker.watch_unsupported = True
                    log.info("worker_status_stream_unsupported", worker=worker.address, fallback="polls")
                    return
                why = err.code().name
            except TimeoutError:
                why = "silent"
            finally:
                call.cancel()
                was_watching, worker.watching = worker.watching, False
            if was_watching:
                log.info("worker_status_stream_closed", worker=worker.address, why=why)
                # Until the stream is back: one poll now (a dead worker shows at once), then the poll loop.
                self._spawn(self._poll_and_notify(worker), f"poll-{worker.address}")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(backoff):
                    await worker._watch_kick.wait()
            backoff = min(backoff * 2, most_backoff)

    async def _run(self) -> None:
        while True:  # start() has just polled
            await asyncio.sleep(self._poll_s)
            try:
                await self.poll_once()
            except Exception as exc:  # the poller must outlive one bad round
                log.error("worker_poll_bug", error=repr(exc))

    async def _sweep_loop(self) -> None:
        """Loss checked every poll_s even while a poll round waits out a frozen worker's timeout
        (a round then takes poll_timeout_s, and loss was declared up to that much late)."""
        while True:
            await asyncio.sleep(self._poll_s)
            try:
                self.sweep()
                self._on_change()
            except Exception as exc:  # as the poller
                log.error("worker_sweep_bug", error=repr(exc))

    async def start(self) -> None:
        await self.poll_once()
        self._task = asyncio.create_task(self._run(), name="worker-status-poll")
        self._spawn(self._sweep_loop(), "worker-sweep")
        self._started = True
        for worker in list(self.workers.values()):
            self._ensure_watch(worker)

    async def close(self) -> None:
        watches = [w._watch_task for w in (*self.workers.values(), *self._retired.values())]
        tasks = [t for t in (self._task, *self._side_tasks, *watches) if t is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        await asyncio.gather(*(w.channel.close() for w in (*self.workers.values(), *self._retired.values())))
