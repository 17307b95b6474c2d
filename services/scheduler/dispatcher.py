"""The bounded request queue and the loop that asks the policy where queued requests go.

Each Submit call holds a `Pending` entry: it waits on `Dispatcher.wait_assigned` until the
dispatch loop (woken by arrivals, finished requests and worker statuses) has the policy place it
on a worker, runs it there, then `release`s the slot. Expired requests are dropped before
dispatch with DEADLINE_EXCEEDED.

The policy sees what each worker is running, as the simulator shows it: the pool counts the
requests placed on every worker per adapter (`WorkerView.running_adapters`, so the credit policy
prices the LoRA term of running rows), and every waiting request carries its prompt size
(`Pending.prompt_tokens`, estimated from the prompt text, plus its image count).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import structlog

from services.common import metrics
from services.common.errors import CapacityExceeded, DeadlineExceeded, WorkerUnavailable
from services.scheduler.policies.base import ModeCommand, PrefetchHint, SchedulingPolicy, WaitingRequest
from services.scheduler.workers import WorkerPool
from valora_protos.internal.v1 import work_pb2, worker_service_pb2

log = structlog.get_logger()


@dataclass
class Pending:
    """One request between admission and the end of its run."""

    request_id: str
    adapter: str | None
    arrival_s: float
    # Monotonic deadline; None = none.
    deadline_s: float | None
    excluded: set[str] = field(default_factory=set)
    max_new_tokens: int = 0
    images: int = 0
    label: bool = False
    # Prompt tokens: a token-id prompt's count, else estimated (credits.estimate_prompt_tokens); 0 = the cost
    # model's default.
    prompt_tokens: int = 0
    # Latency objective in seconds (the task's slo_ms; 0 = none): orders the queue, never drops.
    slo_s: float = 0.0
    key: str = ""
    assigned: asyncio.Future | None = None
    dispatched_s: float | None = None

    def remaining_s(self, now_s: float) -> float | None:
        return None if self.deadline_s is None else self.deadline_s - now_s


class Dispatcher:
    def __init__(
        self,
        pool: WorkerPool,
        policy: SchedulingPolicy,
        *,
        max_queue: int,
        retry_after_s: float,
        tick_s: float,
        mode_switch_timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = pool
        self.policy = policy
        self.max_queue = max_queue
        self.retry_after_s = retry_after_s
        self.tick_s = tick_s
        self.mode_switch_timeout_s = mode_switch_timeout_s
        self.clock = clock
        self.queue: dict[str, Pending] = {}
        self._seq = itertools.count()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        # The latest SetMode sent to each worker; requests placed after it wait for it.
        self._mode_tasks: dict[str, asyncio.Task] = {}
        # Prefetch (LoadAdapter to_device) calls in flight, by (worker, adapter version).
        self._prefetch_tasks: dict[tuple[str, str], asyncio.Task] = {}

    # -- the Submit side ------------------------------------------------------------------

    def admit(self, pending: Pending) -> None:
        """Queue a new request, or refuse it when the queue is full."""
        if not self.pool.workers:
            raise WorkerUnavailable("no workers configured", reason="NO_WORKERS")
        if len(self.queue) >= self.max_queue:
            raise CapacityExceeded(
                f"scheduler queue is full ({self.max_queue} waiting)",
                reason="QUEUE_FULL",
                retry_after_s=self.retry_after_s,
            )
        self._enqueue(pending)

    def requeue(self, pending: Pending) -> None:
        """Put a request whose worker failed before its first token back, keeping its arrival time."""
        if set(self.pool.workers) <= pending.excluded:
            raise WorkerUnavailable(f"every worker failed request {pending.request_id}", reason="NO_WORKER_LEFT")
        self._enqueue(pending)

    def _enqueue(self, pending: Pending) -> None:
        pending.key = f"{next(self._seq)}"
        pending.assigned = asyncio.get_running_loop().create_future()
        self.queue[pending.key] = pending
        metrics.REQUESTS_WAITING.set(len(self.queue))
        self.wake()

    async def wait_assigned(self, pending: Pending) -> str:
        """The worker address the request was placed on. Leaves the queue on any exit."""
        fut = pending.assigned
        assert fut is not None
        try:
            # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation.
            async with asyncio.timeout(pending.remaining_s(self.clock())):
                return await asyncio.shield(fut)
        except BaseException as exc:
            # Timed out or cancelled (client gone): a slot granted meanwhile goes back.
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release(fut.result(), pending)
            if isinstance(exc, TimeoutError):
                raise DeadlineExceeded(
                    f"request {pending.request_id} expired in the queue", reason="QUEUE_TIMEOUT"
                ) from None
            raise
        finally:
            self.queue.pop(pending.key, None)
            metrics.REQUESTS_WAITING.set(len(self.queue))
            if not fut.done():
                fut.cancel()

    async def worker_ready(self, worker: str, pending: Pending) -> None:
        """Wait for a mode switch the policy ordered on `worker` before running there."""
        task = self._mode_tasks.get(worker)
        if task is not None and not task.done():
            try:
                async with asyncio.timeout(pending.remaining_s(self.clock())):
                    await asyncio.shield(task)
            except TimeoutError:
                raise DeadlineExceeded(
                    f"request {pending.request_id} expired waiting for a mode switch", reason="QUEUE_TIMEOUT"
                ) from None

    def release(self, worker: str, pending: Pending) -> None:
        """`pending`'s run on `worker` ended (done, failed, or taken back to be placed again)."""
        self.pool.finished(worker, pending.adapter)
        self.wake()

    # -- the dispatch loop ----------------------------------------------------------------

    def wake(self) -> None:
        self._wake.set()

    def dispatch_once(self) -> None:
        now = self.clock()
        for key, p in list(self.queue.items()):
            if p.deadline_s is not None and p.deadline_s <= now:
                del self.queue[key]
                if not p.assigned.done():
                    p.assigned.set_exception(
                        DeadlineExceeded(f"request {p.request_id} expired in the queue", reason="QUEUE_TIMEOUT")
                    )
        if not self.queue:
            return
        waiting = [
            WaitingRequest(
                key,
                p.arrival_s,
                p.adapter,
                frozenset(p.excluded),
                p.max_new_tokens,
                p.images,
                p.label,
                p.prompt_tokens,
                p.slo_s,
            )
            for key, p in self.queue.items()
        ]
        decision = self.policy.decide(now, waiting, self.pool.views())
        for cmd in decision.mode_commands:
            self._send_mode(cmd)
        for hint in decision.prefetch:
            self._send_prefetch(hint)
        for a in decision.assignments:
            p = self.queue.pop(a.request_id, None)
            if p is None or p.assigned.done():
                continue
            self.pool.started(a.worker, p.adapter)
            p.dispatched_s = now
            metrics.QUEUE_TIME.observe(now - p.arrival_s)
            p.assigned.set_result(a.worker)
        metrics.REQUESTS_WAITING.set(len(self.queue))

    def _send_mode(self, cmd: ModeCommand) -> None:
        handle = self.pool[cmd.worker]
        req = worker_service_pb2.SetModeRequest(mode=cmd.mode.to_pb())
        if cmd.merged_adapter:
            req.merged_adapter.CopyFrom(work_pb2.AdapterRef(version=cmd.merged_adapter))
        # Optimistic until the call ends (statuses reported meanwhile keep it, see WorkerPool._apply),
        # so the policy does not repeat the command.
        handle.pending_mode = (req.mode, cmd.merged_adapter or "")
        if handle.status is not None:
            handle.status.mode = req.mode
            handle.status.merged_adapter = cmd.merged_adapter or ""

        previous = self._mode_tasks.get(cmd.worker)

        async def send() -> None:
            try:
                if previous is not None and not previous.done():
                    await asyncio.wait([previous])
                await handle.stub.SetMode(req, timeout=self.mode_switch_timeout_s)
                log.info("mode_set", worker=cmd.worker, mode=cmd.mode.value, merged=cmd.merged_adapter)
            except grpc.RpcError as err:
                log.warning("mode_set_failed", worker=cmd.worker, mode=cmd.mode.value, code=err.code().name)
            finally:
                if self._mode_tasks.get(cmd.worker) is asyncio.current_task():
                    handle.pending_mode = None  # the worker's next status is the truth again

        self._mode_tasks[cmd.worker] = asyncio.create_task(send(), name=f"set-mode-{cmd.worker}")

    def _send_prefetch(self, hint: PrefetchHint) -> None:
        """Best effort: ask the worker to copy an adapter to its device before requests need it."""
        handle = self.pool.workers.get(hint.worker)
        key = (hint.worker, hint.adapter)
        if handle is None or key in self._prefetch_tasks:
            return
        if handle.status is not None and hint.adapter in handle.status.resident_adapters:
            return
        req = worker_service_pb2.LoadAdapterRequest(adapter=work_pb2.AdapterRef(version=hint.adapter), to_device=True)

        async def send() -> None:
            try:
                await handle.stub.LoadAdapter(req, timeout=self.mode_switch_timeout_s)
                log.info("adapter_prefetched", worker=hint.worker, adapter=hint.adapter)
            except grpc.RpcError as err:
                log.warning("adapter_prefetch_failed", worker=hint.worker, adapter=hint.adapter, code=err.code().name)
            finally:
                self._prefetch_tasks.pop(key, None)

        self._prefetch_tasks[key] = asyncio.create_task(send(), name=f"prefetch-{hint.worker}")

    async def _run(self) -> None:
        while True:
            try:
                async with asyncio.timeout(self.tick_s):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                self.dispatch_once()
            except Exception as exc:  # a policy bug must not stop the loop
                log.error("dispatch_bug", error=repr(exc))

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="dispatcher")

    async def close(self) -> None:
        tasks = [t for t in (self._task, *self._mode_tasks.values(), *self._prefetch_tasks.values()) if t is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        for p in self.queue.values():
            if not p.assigned.done():
                p.assigned.set_exception(WorkerUnavailable("scheduler shutting down", reason="SHUTDOWN"))
        self.queue.clear()
