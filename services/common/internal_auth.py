"""Service-to-service authentication: one shared internal token.

The adapter store, the scheduler and the workers serve internal APIs (adapter upload and delete,
tile tables, worker registration, Submit, Generate, SetMode, LoadAdapter). With an internal token
configured (VALORA_INTERNAL_TOKEN, or VALORA_INTERNAL_TOKEN_FILE naming a file that holds it: the
compose file and the Helm chart generate one and mount it), each of them refuses every call that
does not carry it in `x-valora-internal-token` metadata with UNAUTHENTICATED (health checks
excepted: probes carry no token), and every outbound channel of a service sends it
(channels.open_channel). A container on the network that lacks the token can then neither
change adapters nor register a worker that would receive users' prompts. Without a token the
internal APIs are open and the service logs `internal_auth_disabled` once.

A shared token rather than only mTLS: it needs no certificate authority, works through the
plaintext loopback of `valora up`, and is one secret to rotate. Mutual TLS (tls_ca, tls_cert)
still composes with it. The gateway's public API keeps its own API keys (gateway/auth.py).
The sending side (channels that add the token) is valora/internal_token.py, in the client package.
"""

from __future__ import annotations

import hmac
from pathlib import Path

import grpc
import structlog
from grpc_status import rpc_status

from services.common.errors import Unauthenticated, ValoraError
from valora.internal_token import TOKEN_KEY

log = structlog.get_logger()

OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


def internal_token(settings) -> str:
    """The token from a service's settings: internal_token, else the first line of
    internal_token_file; "" when neither is set."""
    if settings.internal_token:
        return settings.internal_token
    if settings.internal_token_file:
        token = Path(settings.internal_token_file).expanduser().read_text().strip()
        if not token:
            raise ValueError(f"internal_token_file {settings.internal_token_file} is empty")
        return token
    return ""


class InternalAuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, service: str, token: str) -> None:
        self._token = token.encode()
        if not token:
            log.warning(
                "internal_auth_disabled",
                service=service,
                detail="no internal token configured; any caller may use this service's internal API",
            )

    def check(self, method: str, metadata) -> ValoraError | None:
        if not self._token or method.startswith(OPEN_PREFIXES):
            return None
        got = next((v for k, v in metadata or () if k == TOKEN_KEY), None)
        if got is None:
            return Unauthenticated(f"internal API: missing {TOKEN_KEY} metadata", reason="MISSING_INTERNAL_TOKEN")
        if not hmac.compare_digest(got.encode() if isinstance(got, str) else got, self._token):
            return Unauthenticated("internal API: wrong internal token", reason="INVALID_INTERNAL_TOKEN")
        return None

    async def intercept_service(self, continuation, handler_call_details):
        error = self.check(handler_call_details.method, handler_call_details.invocation_metadata)
        handler = await continuation(handler_call_details)
        if error is None or handler is None:
            return handler
        log.warning("internal_auth_refused", method=handler_call_details.method, reason=error.reason)
        return refusing_handler(handler, error)


def refusing_handler(handler: grpc.RpcMethodHandler, error: ValoraError) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind that answers every call with `error`."""
    status = rpc_status.to_status(error.to_status())

    async def refuse(context) -> None:
        await context.abort_with_status(status)

    if handler.unary_unary:

        async def uu(request, context):
            await refuse(context)

        return grpc.unary_unary_rpc_method_handler(uu, handler.request_deserializer, handler.response_serializer)
    if handler.stream_unary:

        async def su(request_iterator, context):
            await refuse(context)

        return grpc.stream_unary_rpc_method_handler(su, handler.request_deserializer, handler.response_serializer)

    async def stream(request, context):
        await refuse(context)
        yield  # pragma: no cover - makes this an async generator

    make = grpc.unary_stream_rpc_method_handler if handler.unary_stream else grpc.stream_stream_rpc_method_handler
    return make(stream, handler.request_deserializer, handler.response_serializer)
