"""The worker's gRPC face: `valora.internal.v1.WorkerService` over one Engine, and create_server.

Protobuf stops here: handlers convert WorkItems into `WorkRequest`s (preprocess.py) and engine
results into `InferResult`s (convert.py). Torch work (image processing, adapter parsing) runs in
executors; the engine's own thread runs the model. The model loads when the service starts
(startup.py: the engine, with VALORA_TP_SIZE > 1 as rank 0 of a tensor-parallel group whose other
ranks it spawns; the scheduler registration). Health is NOT_SERVING until then, and again as
soon as the engine thread or a follower process dies (watchdog.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time

import structlog

from services.common import metrics
from services.common.channels import client_credentials
from services.common.errors import DeadlineExceeded, FailedPrecondition, WorkerUnavailable, invalid_field
from services.common.internal_auth import internal_token
from services.common.modes import Mode
from services.common.names import parse_version_name
from services.common.server import Service, build_service, channel_options
from services.common.tracing import tracer_provider
from services.worker import convert, startup, worker_metrics
from services.worker.config import WorkerSettings
from services.worker.detokenizer import TokenText
from services.worker.engine import Engine
from services.worker.preprocess import Preprocessor, work_request_from_pb
from services.worker.relay import EventRelay
from services.worker.requests import Failed, Finished, TextDelta
from services.worker.store_client import AdapterFetcher
from services.worker.tp_ranks import Followers
from valora_protos.internal.v1 import worker_service_pb2 as pb
from valora_protos.internal.v1 import worker_service_pb2_grpc as pb_grpc
from valora_protos.v1 import admin_service_pb2

log = structlog.get_logger()

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["WorkerService"].full_name


# WatchWorkerStatus: how often a stream samples the status for changes, and the bounds of the
# longest gap between two of its messages (interval_ms; 0 = the default).
WATCH_TICK_S = 0.05
WATCH_INTERVAL_MS = (500, 50, 60_000)  # default, min, max


def _status_key(st: admin_service_pb2.WorkerStatus) -> tuple:
    """What a status change is, for WatchWorkerStatus (not step times nor cache counters)."""
    return (
        st.healthy,
        st.mode,
        st.merged_adapter,
        frozenset(st.resident_adapters),
        frozenset(st.host_adapters),
        st.running_requests,
        st.waiting_requests,
        st.kv_cache_bytes,
    )


class WorkerServicer(pb_grpc.WorkerServiceServicer):
    def __init__(self, settings: WorkerSettings, fetcher: AdapterFetcher) -> None:
        self.settings = settings
        self.fetcher = fetcher
        self.engine: Engine | None = None
        self._token_text: TokenText | None = None
        self.worker_name = settings.worker_name
        self.address = settings.advertise_address
        self._adapter_locks: dict[str, asyncio.Lock] = {}
        self.is_serving = lambda: True  # create_server binds it to the service's health
        # One event per open WatchWorkerStatus stream, set to send a fresh status now.
        self._watchers: set[asyncio.Event] = set()
        self._closing = False
        self.followers: Followers | None = None  # tensor parallel: ranks 1..N-1 (tp_ranks.py)
        self.preprocessor: Preprocessor | None = None  # preprocess_processes > 0
        self._event_relay: EventRelay | None = None  # engine events into the server loop's request queues

    @property
    def token_text(self) -> TokenText:
        """Names tokens for log-probabilities (the engine's tokenizer; made at first use)."""
        if self._token_text is None:
            self._token_text = TokenText(self.engine.tokenizer)
        return self._token_text

    def _engine(self) -> Engine:
        if self.engine is None or not self.engine.alive:
            raise WorkerUnavailable("the worker engine is not running", reason="ENGINE_DOWN")
        return self.engine

    async def ensure_adapter(
        self, version: str, sha256: str, to_device: bool = False, field_path: str = "adapter.version"
    ) -> bool:
        """Loads the adapter version if needed; True when it was already loaded."""
        engine = self._engine()
        parse_version_name(version, field_path)
        if engine.pool.has(version):
            engine.pool.touch(version)  # host LRU: what host_adapter_bytes evicts last
            held = engine.pool.get(version)
            if sha256 and held.sha256 and sha256 != held.sha256:
                raise FailedPrecondition(
                    f"{version} is loaded with sha256 {held.sha256}, not {sha256}", reason="SHA256_MISMATCH"
                )
            if to_device:
                engine.adapter_to_device(version)
            return True
        lock = self._adapter_locks.setdefault(version, asyncio.Lock())
        async with lock:
            if engine.pool.has(version):
                return True
            t0 = time.perf_counter()
            bundle = await self.fetcher.fetch(version, sha256)
            t1 = time.perf_counter()
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(
                None,
                lambda: engine.load_adapter_bytes(
                    version, bundle.sha256, bundle.data, bundle.config_json, bundle.head_labels, to_device
                ),
            )
            t2 = time.perf_counter()
            metrics.ADAPTER_LOAD.labels(self.worker_name, "fetch").observe(t1 - t0)
            metrics.ADAPTER_LOAD.labels(self.worker_name, "load").observe(t2 - t1)
            log.info(
                "adapter_loaded",
                adapter=version,
                sha256=bundle.sha256,
                bytes=len(bundle.data),
                fetch_ms=round((t1 - t0) * 1e3, 1),
                load_ms=round((t2 - t1) * 1e3, 1),
            )
            return False

    async def Generate(self, request, context):
        engine = self._engine()
        item = request.item
        adapter = None
        if item.HasField("adapter") and item.adapter.version:
            adapter = item.adapter.version
            await self.ensure_adapter(adapter, item.adapter.sha256, field_path="item.adapter.version")
        loop = asyncio.get_running_loop()
        if self.preprocessor is not None:  # decode + processor in the preprocessing processes
            work, inputs, vision = await self.preprocessor.prepare(item, adapter)
            prep = await loop.run_in_executor(None, lambda: engine.prepare(work, (inputs, vision)))
        else:
            prep = await loop.run_in_executor(None, lambda: engine.prepare(work_request_from_pb(item, adapter)))
        events: asyncio.Queue = asyncio.Queue()

        if self._event_relay is None:
            self._event_relay = EventRelay(loop)
        sink = functools.partial(self._event_relay.put, events)  # called on the engine thread

        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        # The engine enforces the deadline itself at step boundaries (no event-loop latency).
        handle = engine.submit(prep, sink, deadline)
        done = False
        try:
            while True:
                # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation
                # (client gone) when the event arrives at the same moment, and the stream lives on.
                when = None if deadline is None else loop.time() + (deadline - time.monotonic())
                try:
                    async with asyncio.timeout_at(when):
                        ev = await events.get()
                except TimeoutError:
                    raise DeadlineExceeded(
                        f"request {item.request_id} ran past its deadline", reason="DEADLINE_EXCEEDED"
                    ) from None
                if isinstance(ev, TextDelta):
                    yield pb.GenerateResponse(
                        text_delta=ev.text, logprobs=convert.logprobs_to_pb(ev.logprobs, self.token_text)
                    )
                elif isinstance(ev, Finished):
                    done = True
                    worker_metrics.observe_result(self.worker_name, ev.result)
                    yield pb.GenerateResponse(result=convert.result_to_pb(ev.result, self.worker_name, self.token_text))
                    return
                elif isinstance(ev, Failed):
                    done = True
                    raise ev.error
        finally:
            if not done:
                handle.cancel()  # client cancelled / deadline: free the sequence at the next step

    async def LoadAdapter(self, request, context):
        already = await self.ensure_adapter(request.adapter.version, request.adapter.sha256, request.to_device)
        self._notify_watchers()
        return pb.LoadAdapterResponse(already_loaded=already)

    async def OffloadAdapter(self, request, context):
        parse_version_name(request.adapter.version, "adapter.version")
        self._engine().offload_adapter(request.adapter.version)
        self._notify_watchers()
        return pb.OffloadAdapterResponse()

    async def SetMode(self, request, context):
        engine = self._engine()
        mode = Mode.from_pb(request.mode)
        if mode is Mode.UNKNOWN:
            raise invalid_field("mode", "must be MERGED, UNMERGED or MIXTURE (BASE = UNMERGED)")
        if mode == Mode.BASE:  # nothing merged: the same weights as UNMERGED
            mode = Mode.UNMERGED
        merged = request.merged_adapter.version if request.HasField("merged_adapter") else ""
        if mode in (Mode.MERGED, Mode.MIXTURE):
            if not merged:
                raise invalid_field("merged_adapter", "MERGED and MIXTURE need the adapter to merge")
            await self.ensure_adapter(merged, request.merged_adapter.sha256, field_path="merged_adapter.version")
        switch_ms, _ = await self._change_mode(engine.set_mode, mode, merged or None)
        return pb.SetModeResponse(switch_ms=switch_ms)

    async def _change_mode(self, fn, *args):
        """Runs a mode/weights change on the engine (executor); (wall ms, fn's result). Metrics + log."""
        engine = self._engine()
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        before = engine.stats().merged_adapter
        result = await loop.run_in_executor(None, fn, *args)
        switch_ms = (time.perf_counter() - t0) * 1e3
        s = engine.stats()
        worker_metrics.observe_mode_change(self.worker_name, before, s)
        log.info("mode_set", mode=s.mode.value, merged=s.merged_adapter, switch_ms=round(switch_ms, 3))
        self._notify_watchers()
        return switch_ms, result

    async def Merge(self, request, context):
        engine = self._engine()
        version = request.adapter.version
        if not version:
            raise invalid_field("adapter.version", "the adapter to merge is required")
        await self.ensure_adapter(version, request.adapter.sha256)
        s = engine.stats()
        if s.mode == Mode.MERGED and s.merged_adapter == version:
            return pb.MergeResponse(already_merged=True)
        switch_ms, _ = await self._change_mode(engine.set_mode, Mode.MERGED, version)
        return pb.MergeResponse(switch_ms=switch_ms)

    async def Unmerge(self, request, context):
        engine = self._engine()
        if engine.stats().mode == Mode.UNMERGED:
            return pb.UnmergeResponse(already_unmerged=True)
        switch_ms, _ = await self._change_mode(engine.set_mode, Mode.UNMERGED, None)
        return pb.UnmergeResponse(switch_ms=switch_ms)

    async def Switch(self, request, context):
        engine = self._engine()
        to = request.to_adapter.version
        if not to:
            raise invalid_field("to_adapter.version", "the adapter to switch to is required")
        expected = request.from_adapter.version if request.HasField("from_adapter") else ""
        if expected:
            parse_version_name(expected, "from_adapter.version")
        await self.ensure_adapter(to, request.to_adapter.sha256, field_path="to_adapter.version")
        switch_ms, changed = await self._change_mode(engine.switch, to, expected or None)
        return pb.SwitchResponse(
            switch_ms=switch_ms if changed else 0.0, already_switched=not changed, mode=engine.stats().mode.to_pb()
        )

    async def GetWorkerStatus(self, request, context):
        engine = self.engine
        return pb.GetWorkerStatusResponse(
            status=self._status(),
            step_times=convert.step_times_to_pb(engine),
            decode_graphs=convert.graph_counters_to_pb(engine and engine.graphs),
            prefill_graphs=convert.graph_counters_to_pb(engine and engine.runner.prefill_graphs),
        )

    def _status(self) -> admin_service_pb2.WorkerStatus:
        return convert.worker_status_to_pb(self.engine, self.address, self.settings, self.is_serving)

    def _notify_watchers(self) -> None:
        for wake in self._watchers:
            wake.set()

    def close_watches(self) -> None:
        """Ends every WatchWorkerStatus stream (worker shutdown)."""
        self._closing = True
        self._notify_watchers()

    def _watch_over(self) -> bool:
        """Streams end when the worker shuts down, drains (NOT_SERVING once the engine is loaded:
        ended now, a stream does not hold the server's stop for its grace) or its engine stopped."""
        return self._closing or (self.engine is not None and not self.is_serving())

    async def WatchWorkerStatus(self, request, context):
        default, lo, hi = WATCH_INTERVAL_MS
        if request.interval_ms < 0:
            raise invalid_field("interval_ms", "must not be negative")
        interval_s = min(max(request.interval_ms or default, lo), hi) / 1e3
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        self._watchers.add(wake)
        try:
            last_key, last_sent = None, float("-inf")
            while True:
                wake.clear()
                status = self._status()
                key, now = _status_key(status), loop.time()
                if key != last_key or now - last_sent >= interval_s:
                    yield pb.WatchWorkerStatusResponse(status=status, step_times=convert.step_times_to_pb(self.engine))
                    last_key, last_sent = key, loop.time()
                if self._watch_over():
                    return  # OK: the last message said healthy=false (or the worker is closing)
                pause = min(WATCH_TICK_S, max(last_sent + interval_s - loop.time(), 0.0))
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(pause):
                        await wake.wait()
        finally:  # also on client cancel (CancelledError at the yield or the wait)
            self._watchers.discard(wake)


async def create_server(settings: WorkerSettings) -> Service:
    """Builds the worker's server; the model loads when the service starts (health NOT_SERVING
    until then, and again if the engine dies)."""
    tracing = tracer_provider(settings, "worker")
    fetcher = AdapterFetcher(
        settings.adapter_store_address,
        settings.adapter_cache_dir,
        channel_options(settings),
        tracer_provider=tracing,
        credentials=client_credentials(settings),
        token=internal_token(settings),
        cache_bytes=settings.adapter_cache_bytes,
    )
    servicer = WorkerServicer(settings, fetcher)

    def register(server):
        pb_grpc.add_WorkerServiceServicer_to_server(servicer, server)
        return [SERVICE_NAME]

    service = build_service("worker", settings, register, tracer_provider=tracing)
    address = f"{settings.host}:{service.port}"
    servicer.worker_name = settings.worker_name or address
    metrics.init_worker(servicer.worker_name)
    servicer.address = settings.advertise_address or address
    service.servicer = servicer  # tests and tools reach the engine through it
    servicer.is_serving = lambda: service.serving  # draining: the scheduler stops placing requests here
    await service.set_serving(False)
    startup.attach(service, settings, servicer, fetcher, tracing)
    return service
