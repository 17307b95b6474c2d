"""The one way every valora service builds, runs and stops its gRPC server.

`build_service()` makes a grpc.aio server with the error interceptor, the standard health
service and reflection; each service's `create_server(settings)` calls it and returns the
`Service` (server + bound port). `serve()` runs one until SIGTERM/SIGINT, then drains:
health NOT_SERVING, `stop(grace)`, then the service's own cleanup.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import signal
import traceback
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from grpc_status import rpc_status
from opentelemetry.sdk.trace import TracerProvider

from services.common.config import ServiceSettings
from services.common.errors import InvalidArgument, ValoraError
from services.common.internal_auth import InternalAuthInterceptor, internal_token
from services.common.logging import configure_logging
from services.common.metrics import start_metrics_server
from services.common.tracing import TracingServerInterceptor, tracer_provider as make_tracer_provider

log = structlog.get_logger()

REQUEST_ID_KEY = "x-request-id"


def request_id_from(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_KEY and value:
            return value
    return ""


_UNDECODABLE = object()  # what a request that does not parse as its method's message decodes to


def _tolerant(deserializer):
    """The method's deserializer, returning _UNDECODABLE instead of raising: grpc answers a
    deserializer's exception with UNKNOWN, where garbage bytes are the caller's INVALID_ARGUMENT."""
    if deserializer is None:
        return None

    def decode(data: bytes):
        try:
            return deserializer(data)
        except Exception:  # any parse failure is the caller's
            return _UNDECODABLE

    return decode


def _undecodable(method: str) -> ValoraError:
    return InvalidArgument(f"the request is not a valid message of {method}", reason="UNDECODABLE_REQUEST")


async def _each_decoded(request_iterator, method: str):
    async for request in request_iterator:
        if request is _UNDECODABLE:
            raise _undecodable(method)
        yield request


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps domain errors to gRPC statuses (with google.rpc details) and binds the request id
    to every log line of the call. Unexpected exceptions are bugs: logged, then INTERNAL.
    A request that does not parse is INVALID_ARGUMENT."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        deserializer = _tolerant(handler.request_deserializer)
        rid = dict(handler_call_details.invocation_metadata or ()).get(REQUEST_ID_KEY, "")
        streamed_requests = bool(handler.stream_unary or handler.stream_stream)

        def checked(request):
            """The request (or, streamed, its messages), INVALID_ARGUMENT where one did not decode."""
            if streamed_requests:
                return _each_decoded(request, method)
            if request is _UNDECODABLE:
                raise _undecodable(method)
            return request

        async def fail(context, exc: BaseException):
            if isinstance(exc, ValoraError):
                log.info("rpc_error", method=method, code=exc.code.name, reason=exc.reason, error=exc.message)
                await context.abort_with_status(rpc_status.to_status(exc.to_status()))
            log.error("rpc_bug", method=method, error=repr(exc), traceback=traceback.format_exc())
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")

        def bind():
            structlog.contextvars.bind_contextvars(request_id=rid or None, method=method)

        if handler.unary_unary:
            inner_uu = handler.unary_unary

            async def unary_unary(request, context):
                bind()
                try:
                    return await inner_uu(checked(request), context)
                except (grpc.aio.AbortError, asyncio.CancelledError):
                    raise
                except Exception as exc:  # mapped in fail()
                    await fail(context, exc)

            return grpc.unary_unary_rpc_method_handler(unary_unary, deserializer, handler.response_serializer)
        if handler.stream_unary:
            inner_su = handler.stream_unary

            async def stream_unary(request_iterator, context):
                bind()
                try:
                    return await inner_su(checked(request_iterator), context)
                except (grpc.aio.AbortError, asyncio.CancelledError):
                    raise
                except Exception as exc:
                    await fail(context, exc)

            return grpc.stream_unary_rpc_method_handler(stream_unary, deserializer, handler.response_serializer)

        # Streaming responses: ours are async generators; some library handlers (Health.Watch)
        # are coroutines that write through context.write, and must stay coroutines.
        inner_stream = handler.unary_stream or handler.stream_stream

        async def streaming(request, context):
            bind()
            try:
                async for item in inner_stream(checked(request), context):
                    yield item
            except (grpc.aio.AbortError, asyncio.CancelledError):
                raise
            except Exception as exc:
                await fail(context, exc)

        async def streaming_by_writes(request, context):
            bind()
            try:
                await inner_stream(checked(request), context)
            except (grpc.aio.AbortError, asyncio.CancelledError):
                raise
            except Exception as exc:
                await fail(context, exc)

        if not inspect.isasyncgenfunction(inner_stream):
            streaming = streaming_by_writes
        make = grpc.unary_stream_rpc_method_handler if handler.unary_stream else grpc.stream_stream_rpc_method_handler
        return make(streaming, deserializer, handler.response_serializer)


def channel_options(settings: ServiceSettings) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.max_send_message_length", settings.max_message_bytes),
    ]


def server_options(settings: ServiceSettings) -> list[tuple[str, int]]:
    """The server's: message sizes; no SO_REUSEPORT (grpcio's default lets a second process bind
    the same port and silently take half the connections); keepalive pings; and a maximum
    connection age, after which clients reconnect, so they spread over gateway replicas added
    since (0: connections live on)."""
    out = [
        *channel_options(settings),
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_time_ms", int(settings.keepalive_s * 1000)),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]
    if settings.max_connection_age_s > 0:
        out += [
            ("grpc.max_connection_age_ms", int(settings.max_connection_age_s * 1000)),
            ("grpc.max_connection_age_grace_ms", int(max(settings.grace_s, 30.0) * 1000)),
        ]
    return out


@dataclass
class Service:
    """A built (not yet started) gRPC server and what must be closed after it stops."""

    name: str
    server: grpc.aio.Server
    port: int
    health: HealthServicer
    service_names: list[str]
    on_start: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    on_stop: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    # Traces of this service's RPCs (services/common/tracing.py); flushed after stop.
    tracer_provider: TracerProvider | None = None
    # What health says: False until started and from the moment a drain begins.
    serving: bool = False
    # Set by `fail`: the process drains and exits with exit_code (a supervisor restarts it).
    failed: asyncio.Event = field(default_factory=asyncio.Event)
    exit_code: int = 0
    stopping: bool = False  # stop() began: health stays NOT_SERVING

    def fail(self, reason: str) -> None:
        """The service cannot go on (e.g. a worker's engine died): `serve` drains it and the
        process exits non-zero, so compose's restart policy or Kubernetes starts it again."""
        log.error("service_failed", service=self.name, reason=reason)
        self.exit_code = 1
        self.failed.set()

    async def start(self) -> None:
        await self.server.start()
        for hook in self.on_start:
            await hook()
        await self.set_serving(True)

    async def set_serving(self, serving: bool) -> None:
        self.serving = serving
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def stop(self, grace: float | None = None, drain_delay: float = 0.0) -> None:
        """NOT_SERVING; after `drain_delay` seconds (callers routing by health stop sending
        here meanwhile, and what they still send is served) new RPCs are refused, running
        ones get `grace` seconds."""
        self.stopping = True
        await self.set_serving(False)
        if drain_delay > 0:
            await asyncio.sleep(drain_delay)
        await self.server.stop(grace)
        for hook in reversed(self.on_stop):
            await hook()
        if self.tracer_provider is not None:
            await asyncio.to_thread(self.tracer_provider.shutdown)  # flushes batched spans


def _read(path: str) -> bytes | None:
    return Path(path).expanduser().read_bytes() if path else None


def server_credentials(settings: ServiceSettings) -> grpc.ServerCredentials | None:
    """TLS for the server when tls_cert/tls_key are set; client certificates required (mutual TLS)
    when tls_ca is set too. None: plaintext."""
    if not settings.tls_cert:
        return None
    if not settings.tls_key:
        raise ValueError("tls_cert is set but tls_key is not")
    ca = _read(settings.tls_ca)
    return grpc.ssl_server_credentials(
        [(_read(settings.tls_key), _read(settings.tls_cert))], root_certificates=ca, require_client_auth=ca is not None
    )


def build_service(
    name: str,
    settings: ServiceSettings,
    register: Callable[[grpc.aio.Server], Iterable[str]],
    interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
    tracer_provider: TracerProvider | None = None,
    internal: bool = True,
) -> Service:
    """`register(server)` adds the servicers and returns their full service names.
    `tracer_provider`: the one the service's outbound channels use (made from the settings when
    None); the tracing interceptor runs outermost, so its spans see every final status.
    `internal`: the service's API is internal (store, scheduler, worker): calls must carry the
    internal token when one is configured (internal_auth.py); the gateway's is public."""
    tracer_provider = tracer_provider or make_tracer_provider(settings, name)
    if internal:
        interceptors = [InternalAuthInterceptor(name, internal_token(settings)), *interceptors]
    server = grpc.aio.server(
        interceptors=[TracingServerInterceptor(tracer_provider), *interceptors, ErrorInterceptor()],
        options=server_options(settings),
    )
    names = list(register(server))
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME], server
    )
    credentials = server_credentials(settings)
    address = f"{settings.host}:{settings.port}"
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"{name}: could not bind {settings.host}:{settings.port}")
    return Service(
        name=name, server=server, port=port, health=health, service_names=names, tracer_provider=tracer_provider
    )


def freeze_startup_heap() -> int:
    """Takes every object alive now out of the cyclic garbage collector's reach (gc.freeze) and
    returns how many there are. Called once a service has started: in a worker they are the
    model's modules and parameters and every imported module (~460k objects with the 7B
    architecture), which live as long as the process, yet each full collection walked them all —
    ~200 ms with the engine loop stalled behind the GIL, every few seconds under load. Objects
    made later are collected as before; refcounting still frees frozen ones."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


async def _serve(create: Callable[[ServiceSettings], Awaitable[Service]], settings: ServiceSettings) -> int:
    """Runs the service until SIGTERM/SIGINT or its `fail`; returns the process's exit code."""
    service = await create(settings)
    start_metrics_server(settings.metrics_port, settings.host)
    await service.start()
    log.info("heap_frozen", objects=freeze_startup_heap())
    log.info("serving", service=service.name, host=settings.host, port=service.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(service.failed.wait())]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for w in waits:
        w.cancel()
    log.info("draining", service=service.name, grace_s=settings.grace_s)
    await service.stop(settings.grace_s, settings.drain_delay_s)
    log.info("stopped", service=service.name, exit_code=service.exit_code)
    return service.exit_code


def serve(name: str, create: Callable[[ServiceSettings], Awaitable[Service]], settings: ServiceSettings) -> None:
    """Entry point of each service's `python -m services.<name>`."""
    configure_logging(name, settings.log_level, settings.log_json)
    code = asyncio.run(_serve(create, settings))
    if code:
        raise SystemExit(code)


def new_request_id() -> str:
    return uuid.uuid4().hex
