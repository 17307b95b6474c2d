"""OpenTelemetry traces across the gRPC hops: gateway → scheduler → worker and gateway →
adapter_store, the context carried as W3C traceparent in metadata. Real gateway and scheduler
(create_server) on loopback ports; the worker and store are in-test servicers behind the same
tracing server interceptor. Every service has its own TracerProvider; one in-memory exporter
collects them all."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from services.common.config import ServiceSettings
from services.common.tracing import TracingServerInterceptor, tracer_provider
from services.gateway.config import GatewaySettings
from services.gateway.server import create_server as create_gateway
from services.scheduler.config import SchedulerSettings
from services.scheduler.server import create_server as create_scheduler
from valora_protos.internal.v1 import (
    adapter_store_service_pb2,
    adapter_store_service_pb2_grpc,
    worker_service_pb2,
    worker_service_pb2_grpc,
)
from valora_protos.v1 import admin_service_pb2, inference_service_pb2, inference_service_pb2_grpc
from valora_protos.v1 import resources_pb2, types_pb2

pytestmark = pytest.mark.anyio
VERSION = resources_pb2.AdapterVersion(
    name="adapters/cars/versions/1", sha256="ef" * 32, state=resources_pb2.ADAPTER_VERSION_STATE_READY
)
INFER = "valora.v1.InferenceService/Infer"
RESOLVE = "valora.internal.v1.AdapterStoreService/ResolveReference"
SUBMIT = "valora.internal.v1.SchedulerService/Submit"
GENERATE = "valora.internal.v1.WorkerService/Generate"
STATUS = "valora.internal.v1.WorkerService/GetWorkerStatus"


@pytest.fixture
def anyio_backend():
    return "asyncio"


class Store(adapter_store_service_pb2_grpc.AdapterStoreServiceServicer):
    async def ResolveReference(self, request, context):
        return adapter_store_service_pb2.ResolveReferenceResponse(version=VERSION)


class Worker(worker_service_pb2_grpc.WorkerServiceServicer):
    fail_with: grpc.StatusCode | None = None
    after_result_s = 0.0  # the end of stream (and OK status) that long after the result

    async def Generate(self, request, context):
        if self.fail_with is not None:
            await context.abort(self.fail_with, "worker says no")
        yield worker_service_pb2.GenerateResponse(text_delta="two cars")
        yield worker_service_pb2.GenerateResponse(
            result=inference_service_pb2.InferResult(text="two cars", finish_reason=types_pb2.FINISH_REASON_EOS)
        )
        await asyncio.sleep(self.after_result_s)

    async def GetWorkerStatus(self, request, context):
        return worker_service_pb2.GetWorkerStatusResponse(
            status=admin_service_pb2.WorkerStatus(healthy=True, max_batch_size=4)
        )


def collecting(provider: TracerProvider, exporter: InMemorySpanExporter) -> TracerProvider:
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


@contextlib.asynccontextmanager
async def traced_stack(**gateway_kwargs):
    exporter = InMemorySpanExporter()
    worker = Worker()
    backend = grpc.aio.server(
        interceptors=[TracingServerInterceptor(collecting(tracer_provider(ServiceSettings(), "worker"), exporter))]
    )
    worker_service_pb2_grpc.add_WorkerServiceServicer_to_server(worker, backend)
    adapter_store_service_pb2_grpc.add_AdapterStoreServiceServicer_to_server(Store(), backend)
    addr = f"127.0.0.1:{backend.add_insecure_port('127.0.0.1:0')}"
    await backend.start()
    scheduler = await create_scheduler(
        SchedulerSettings(worker_addresses=[addr], status_poll_s=0.05, dispatch_tick_s=0.05)
    )
    collecting(scheduler.tracer_provider, exporter)
    await scheduler.start()
    gateway = await create_gateway(
        GatewaySettings(
            scheduler_address=f"127.0.0.1:{scheduler.port}",
            adapter_store_address=addr,
            **{"http_enabled": False, **gateway_kwargs},
        )
    )
    collecting(gateway.tracer_provider, exporter)
    await gateway.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}")
    try:
        yield worker, inference_service_pb2_grpc.InferenceServiceStub(channel), exporter, gateway
    finally:
        await channel.close()
        await gateway.stop(0)
        await scheduler.stop(0)
        await backend.stop(0)


def request(**kw):
    return inference_service_pb2.InferRequest(
        input=inference_service_pb2.InferenceInput(prompt="how many cars?", adapter="adapters/cars@prod"), **kw
    )


async def finished(exporter: InMemorySpanExporter, names: set[str], timeout_s: float = 5.0):
    """Client spans end from the call's done callback: wait until every expected name is in."""
    for _ in range(int(timeout_s / 0.02)):
        spans = exporter.get_finished_spans()
        if names <= {s.name for s in spans}:
            return spans
        await asyncio.sleep(0.02)
    raise AssertionError(f"missing spans: {names - {s.name for s in exporter.get_finished_spans()}}")


def one(spans, name, kind):
    found = [s for s in spans if s.name == name and s.kind == kind]
    assert len(found) == 1, (name, kind, [(s.name, s.kind) for s in spans])
    return found[0]


async def test_one_trace_from_gateway_through_scheduler_to_worker():
    async with traced_stack() as (_, infer, exporter, _gw):
        resp = await infer.Infer(request(request_id="trace-1"))
        spans = await finished(exporter, {INFER, RESOLVE, SUBMIT, GENERATE})
        await asyncio.sleep(0.15)  # a few status polls happen meanwhile
        spans = exporter.get_finished_spans()
    assert resp.result.text == "two cars"
    assert len({s.context.trace_id for s in spans}) == 1, "one request, one trace; polls are not traced"
    assert all(s.name != STATUS for s in spans)

    gw = one(spans, INFER, SpanKind.SERVER)
    assert gw.parent is None and gw.resource.attributes["service.name"] == "valora-gateway"
    chain = [
        (gw, one(spans, RESOLVE, SpanKind.CLIENT)),
        (one(spans, RESOLVE, SpanKind.CLIENT), one(spans, RESOLVE, SpanKind.SERVER)),
        (gw, one(spans, SUBMIT, SpanKind.CLIENT)),
        (one(spans, SUBMIT, SpanKind.CLIENT), one(spans, SUBMIT, SpanKind.SERVER)),
        (one(spans, SUBMIT, SpanKind.SERVER), one(spans, GENERATE, SpanKind.CLIENT)),
        (one(spans, GENERATE, SpanKind.CLIENT), one(spans, GENERATE, SpanKind.SERVER)),
    ]
    for parent, child in chain:
        assert child.parent is not None and child.parent.span_id == parent.context.span_id, (parent.name, child.name)
    scheduler_span = one(spans, SUBMIT, SpanKind.SERVER)
    worker_span = one(spans, GENERATE, SpanKind.SERVER)
    assert scheduler_span.resource.attributes["service.name"] == "valora-scheduler"
    assert worker_span.resource.attributes["service.name"] == "valora-worker"
    assert scheduler_span.attributes["valora.request_id"] == "trace-1"
    assert worker_span.attributes["rpc.grpc.status_code"] == 0
    errors = [(s.name, s.kind, s.status.description) for s in spans if s.status.status_code == StatusCode.ERROR]
    assert not errors, errors


async def test_a_late_end_of_stream_after_the_result_is_not_a_cancellation():
    """The scheduler reads the worker's end of stream after the result instead of cancelling the
    call: a status still in flight must not turn a finished request into CANCELLED spans."""
    async with traced_stack() as (worker, infer, exporter, _gw):
        worker.after_result_s = 0.3
        resp = await infer.Infer(request(request_id="late-end"))
        spans = await finished(exporter, {INFER, SUBMIT, GENERATE})
    assert resp.result.text == "two cars"
    client = one(spans, GENERATE, SpanKind.CLIENT)
    assert client.status.status_code != StatusCode.ERROR, client.status.description
    assert one(spans, GENERATE, SpanKind.SERVER).attributes["rpc.grpc.status_code"] == 0


async def test_a_callers_traceparent_is_continued():
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    async with traced_stack() as (_, infer, exporter, _gw):
        await infer.Infer(request(), metadata=(("traceparent", f"00-{trace_id}-00f067aa0ba902b7-01"),))
        spans = await finished(exporter, {INFER, GENERATE})
    gw = one(spans, INFER, SpanKind.SERVER)
    assert f"{gw.context.trace_id:032x}" == trace_id and gw.parent.span_id == 0x00F067AA0BA902B7
    assert gw.parent.is_remote
    assert {s.context.trace_id for s in spans} == {gw.context.trace_id}


async def test_error_statuses_are_recorded_on_every_hop():
    async with traced_stack() as (worker, infer, exporter, _gw):
        worker.fail_with = grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await infer.Infer(request())
        spans = await finished(exporter, {INFER, SUBMIT, GENERATE})
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND
    for name in (INFER, SUBMIT, GENERATE):
        server = one(spans, name, SpanKind.SERVER)
        # Set by abort / abort_with_status (the error interceptor's path), read back from the context.
        assert server.attributes["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0], name
        assert server.status.status_code != StatusCode.ERROR, "NOT_FOUND is the caller's error on a server span"
    client = one(spans, GENERATE, SpanKind.CLIENT)
    assert client.status.status_code == StatusCode.ERROR
    assert client.attributes["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]


async def test_unavailable_is_an_error_and_auth_refusals_are_traced():
    async with traced_stack(api_keys="k1") as (worker, infer, exporter, _gw):
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await infer.Infer(request())
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        refused = one(await finished(exporter, {INFER}), INFER, SpanKind.SERVER)
        assert refused.attributes["rpc.grpc.status_code"] == grpc.StatusCode.UNAUTHENTICATED.value[0]
        exporter.clear()
        worker.fail_with = grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.aio.AioRpcError):
            await infer.Infer(request(), metadata=(("authorization", "Bearer k1"),))
        spans = await finished(exporter, {INFER, GENERATE})
    assert one(spans, GENERATE, SpanKind.SERVER).status.status_code == StatusCode.ERROR


async def test_http_requests_join_the_same_trace():
    import aiohttp

    trace_id = "0af7651916cd43dd8448eb211c80319c"
    async with traced_stack(http_enabled=True) as (_, _infer, exporter, gateway):
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                f"http://127.0.0.1:{gateway.http.port}/v1/chat/completions",
                headers={"traceparent": f"00-{trace_id}-b7ad6b7169203331-01"},
                json={"model": "adapters/cars", "messages": [{"role": "user", "content": "how many?"}]},
            ) as r,
        ):
            assert r.status == 200, await r.text()
        spans = await finished(exporter, {"POST /v1/chat/completions", INFER, GENERATE})
    front = one(spans, "POST /v1/chat/completions", SpanKind.SERVER)
    assert f"{front.context.trace_id:032x}" == trace_id and front.attributes["http.response.status_code"] == 200
    loopback = one(spans, INFER, SpanKind.CLIENT)
    assert loopback.parent.span_id == front.context.span_id
    assert one(spans, INFER, SpanKind.SERVER).parent.span_id == loopback.context.span_id
    assert {s.context.trace_id for s in spans} == {front.context.trace_id}


def test_exporters_follow_the_settings():
    plain = tracer_provider(ServiceSettings(), "x")
    assert plain._active_span_processor._span_processors == ()
    both = tracer_provider(ServiceSettings(otlp_endpoint="http://127.0.0.1:4317", trace_console=True), "x")
    names = [type(p).__name__ for p in both._active_span_processor._span_processors]
    assert names == ["BatchSpanProcessor", "SimpleSpanProcessor"]
    both.shutdown()
    with pytest.raises(ValueError):
        ServiceSettings(trace_sample_ratio=1.5)


async def test_coroutine_style_streaming_handlers_survive_the_interceptors():
    """Health.Watch writes through context.write instead of yielding: the error and tracing
    interceptors must keep it a coroutine (it used to fail with INTERNAL: TypeError)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from services.common.server import build_service

    service = build_service("x", ServiceSettings(), lambda server: [])
    await service.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{service.port}") as channel:
            call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=5)
            first = await call.read()
            call.cancel()
    finally:
        await service.stop(0)
    assert first.status == health_pb2.HealthCheckResponse.SERVING


async def test_cancelled_traced_stream_ends_its_span_without_context_errors(caplog):
    """A client cancelling a server stream mid-way: the span ends CANCELLED and the context is not
    detached from another context (OpenTelemetry logged "Failed to detach context" before)."""
    exporter = InMemorySpanExporter()

    class Fast(worker_service_pb2_grpc.WorkerServiceServicer):
        async def Generate(self, request, context):
            yield worker_service_pb2.GenerateResponse(text_delta="one")
            for _ in range(10000):  # the cancel lands while the server writes, the generator paused at a yield
                yield worker_service_pb2.GenerateResponse(text_delta="x" * 1024)

    server = grpc.aio.server(
        interceptors=[TracingServerInterceptor(collecting(tracer_provider(ServiceSettings(), "worker"), exporter))]
    )
    worker_service_pb2_grpc.add_WorkerServiceServicer_to_server(Fast(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    traceparent = ("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    try:
        with caplog.at_level("ERROR"):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = worker_service_pb2_grpc.WorkerServiceStub(channel).Generate(
                    worker_service_pb2.GenerateRequest(), metadata=(traceparent,)
                )
                assert (await call.read()).text_delta == "one"
                call.cancel()
            import gc

            for _ in range(5):  # a paused generator is closed by the event loop's finalizer, elsewhere
                gc.collect()
                await asyncio.sleep(0.05)
            spans = await finished(exporter, {GENERATE})
    finally:
        await server.stop(0)
    span = one(spans, GENERATE, SpanKind.SERVER)
    assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]
    assert not [r for r in caplog.records if "detach" in r.getMessage().lower()]


def test_log_lines_carry_the_current_trace_and_span_ids():
    from opentelemetry.sdk.trace import TracerProvider

    import structlog

    from services.common.logging import add_trace_ids, configure_logging

    old = structlog.get_config()
    try:  # every service's logging runs the processor
        configure_logging("probe", "info", json=True)
        assert add_trace_ids in structlog.get_config()["processors"]
    finally:
        structlog.configure(**old)
        structlog.contextvars.unbind_contextvars("service")
    tracer = TracerProvider().get_tracer("probe")
    with structlog.testing.capture_logs(processors=[add_trace_ids]) as logs:
        with tracer.start_as_current_span("work") as span:
            structlog.get_logger().info("inside")
        structlog.get_logger().info("outside")
    inside, outside = logs
    ctx = span.get_span_context()
    assert inside["trace_id"] == f"{ctx.trace_id:032x}" and inside["span_id"] == f"{ctx.span_id:016x}"
    assert "trace_id" not in outside
