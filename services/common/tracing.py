"""OpenTelemetry tracing across the gRPC hops (gateway → scheduler → worker, gateway/worker →
adapter_store).

The W3C trace context (`traceparent`, `tracestate`, `baggage`) travels in gRPC metadata through
OpenTelemetry's global propagator. Two small grpc.aio interceptors do the work:

- `TracingServerInterceptor` extracts the caller's context and opens one SERVER span per RPC.
  It sits outermost, so the span sees the final status of every call, including the domain
  errors that `ErrorInterceptor` reports with `abort_with_status` and the auth refusals.
- `tracing_client_interceptors()` open one CLIENT span per outbound call and inject the context.

What is traced: calls that arrive with a trace context, and calls to the public API
(`/valora.v1.*`), which start a trace when they come without one. Health checks, reflection and
background calls made outside any span (worker status polls, mode commands) are not traced, so
they make no root spans. (`opentelemetry-instrumentation-grpc` 0.66b2 was evaluated against
grpcio 1.85 aio and not used: its server span misses the status set by `abort_with_status`, it
iterates coroutine-style streaming handlers such as Health.Watch as generators, and a client
stream span stays open after `cancel()` until the call is garbage-collected.)

Each service builds its own `TracerProvider` (`tracer_provider(settings, name)`), passed
explicitly to its server and channels — no global provider. Exporters come from the settings:
`otlp_endpoint` (OTLP/gRPC, batched), `trace_console` (stdout); none configured = spans are made
and dropped (embedders and tests may add a processor to `Service.tracer_provider`).
"""

from __future__ import annotations

import asyncio
import inspect

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.common.config import ServiceSettings

TRACER_NAME = "valora.grpc"
REQUEST_ID_KEY = "x-request-id"
PUBLIC_PREFIX = "/valora.v1."
UNTRACED_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")
# Server spans: per OpenTelemetry's RPC conventions only these codes mark the span as an error
# (NOT_FOUND, INVALID_ARGUMENT … are the client's doing). Client spans: every non-OK code.
SERVER_ERROR_CODES = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)


def tracer_provider(settings: ServiceSettings, service_name: str) -> TracerProvider:
    """The service's provider: resource `service.name`, parent-based ratio sampling, and the
    exporters the settings ask for."""
    provider = TracerProvider(
        resource=Resource.create({"service.name": f"valora-{service_name}", "service.namespace": "valora"}),
        sampler=ParentBased(TraceIdRatioBased(settings.trace_sample_ratio)),
    )
    if settings.otlp_endpoint:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError as exc:  # pragma: no cover - the package is a pinned dependency
            raise RuntimeError(
                "otlp_endpoint is set but opentelemetry-exporter-otlp-proto-grpc is not installed"
            ) from exc
        endpoint = settings.otlp_endpoint
        provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://")))
        )
    if settings.trace_console:
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    return provider


def _method(value: str | bytes) -> str:
    # grpc.aio may hand the method over as bytes (grpc/grpc#31092).
    return value.decode() if isinstance(value, bytes) else value


def _rpc_attributes(method: str) -> dict[str, str]:
    service, _, name = method.lstrip("/").partition("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}


def _set_code(span: trace.Span, code: grpc.StatusCode, details: str | None, server: bool) -> None:
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code is not grpc.StatusCode.OK and (not server or code in SERVER_ERROR_CODES):
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details or ''}".rstrip(": ")))


# -- server ---------------------------------------------------------------------------------------


class TracingServerInterceptor(grpc.aio.ServerInterceptor):
    """One SERVER span per traced RPC, child of the caller's context from the metadata."""

    def __init__(self, provider: trace.TracerProvider | None = None) -> None:
        self._tracer = trace.get_tracer(TRACER_NAME, tracer_provider=provider)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = _method(handler_call_details.method)
        if handler is None or method.startswith(UNTRACED_PREFIXES):
            return handler
        carrier: dict[str, str] = {}
        for key, value in handler_call_details.invocation_metadata or ():
            if isinstance(value, str):
                carrier[key.lower()] = value
        parent = propagate.extract(carrier)
        if not method.startswith(PUBLIC_PREFIX) and not trace.get_current_span(parent).get_span_context().is_valid:
            return handler  # internal call made outside any trace (status polls, mode commands)
        attributes = _rpc_attributes(method)
        if carrier.get(REQUEST_ID_KEY):
            attributes["valora.request_id"] = carrier[REQUEST_ID_KEY]
        tracer = self._tracer
        name = method.lstrip("/")

        def open_span():
            span = tracer.start_span(name, context=parent, kind=SpanKind.SERVER, attributes=attributes)
            return span, otel_context.attach(trace.set_span_in_context(span, parent))

        def close_span(span, token, context, exc: BaseException | None) -> None:
            end_span(span, context, exc)
            otel_context.detach(token)

        def end_span(span, context, exc: BaseException | None) -> None:
            if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):  # GeneratorExit: the caller went away
                code, details = grpc.StatusCode.CANCELLED, "cancelled"
            else:
                code = context.code() or grpc.StatusCode.OK
                details = context.details()
                if exc is not None and not isinstance(exc, grpc.aio.AbortError) and code is grpc.StatusCode.OK:
                    code, details = grpc.StatusCode.UNKNOWN, repr(exc)
            if exc is not None and not isinstance(exc, (grpc.aio.AbortError, asyncio.CancelledError, GeneratorExit)):
                span.record_exception(exc)
            _set_code(span, code, details if isinstance(details, str) else None, server=True)
            span.end()

        def wrap_unary(inner):
            async def behavior(request, context):
                span, token = open_span()
                exc = None
                try:
                    return await inner(request, context)
                except BaseException as e:
                    exc = e
                    raise
                finally:
                    close_span(span, token, context, exc)

            return behavior

        def wrap_stream(inner):
            if not inspect.isasyncgenfunction(inner):
                return wrap_unary(inner)  # a coroutine that writes through context.write

            async def behavior(request, context):
                # The span's context is attached around each step of the inner generator only: a
                # stream closed from another context (client cancel -> aclose) must not detach a
                # token attached elsewhere ("Failed to detach context").
                span = tracer.start_span(name, context=parent, kind=SpanKind.SERVER, attributes=attributes)
                ctx = trace.set_span_in_context(span, parent)
                items = inner(request, context)
                exc = None
                try:
                    while True:
                        token = otel_context.attach(ctx)
                        try:
                            item = await items.__anext__()
                        except StopAsyncIteration:
                            break
                        finally:
                            otel_context.detach(token)
                        yield item
                except BaseException as e:
                    exc = e
                    raise
                finally:
                    await items.aclose()
                    end_span(span, context, exc)

            return behavior

        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                wrap_unary(handler.unary_unary), handler.request_deserializer, handler.response_serializer
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                wrap_unary(handler.stream_unary), handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                wrap_stream(handler.unary_stream), handler.request_deserializer, handler.response_serializer
            )
        return grpc.stream_stream_rpc_method_handler(
            wrap_stream(handler.stream_stream), handler.request_deserializer, handler.response_serializer
        )


# -- client ---------------------------------------------------------------------------------------


class _ClientTracing:
    def __init__(self, provider: trace.TracerProvider | None) -> None:
        self._tracer = trace.get_tracer(TRACER_NAME, tracer_provider=provider)

    async def _traced(self, continuation, details, request):
        if not trace.get_current_span().get_span_context().is_valid:
            return await continuation(details, request)  # no trace to continue: background call
        method = _method(details.method)
        span = self._tracer.start_span(method.lstrip("/"), kind=SpanKind.CLIENT, attributes=_rpc_attributes(method))
        metadata = grpc.aio.Metadata(*tuple(details.metadata or ()))
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        for key, value in carrier.items():
            metadata[key] = value  # replaces a traceparent the caller forwarded
        try:
            call = await continuation(details._replace(metadata=metadata), request)
        except BaseException as exc:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, repr(exc)))
            span.end()
            raise

        def done(finished_call) -> None:
            asyncio.ensure_future(_end_client_span(span, finished_call))

        try:
            call.add_done_callback(done)
        except NotImplementedError:  # pragma: no cover - not a plain call object
            span.end()
        return call


async def _end_client_span(span: trace.Span, call) -> None:
    try:
        code = await call.code()
        details = await call.details()
    except Exception:  # the span must end whatever the call did
        code, details = grpc.StatusCode.UNKNOWN, "status unavailable"
    _set_code(span, code, details, server=False)
    span.end()


class _UnaryUnary(_ClientTracing, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await self._traced(continuation, client_call_details, request)


class _UnaryStream(_ClientTracing, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await self._traced(continuation, client_call_details, request)


class _StreamUnary(_ClientTracing, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await self._traced(continuation, client_call_details, request_iterator)


class _StreamStream(_ClientTracing, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await self._traced(continuation, client_call_details, request_iterator)


def tracing_client_interceptors(provider: trace.TracerProvider | None = None) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors for a grpc.aio channel: a CLIENT span per call made inside a trace, with the
    context injected into the call's metadata."""
    return [_UnaryUnary(provider), _UnaryStream(provider), _StreamUnary(provider), _StreamStream(provider)]
