"""The one way services open outbound gRPC channels: the shared message-size options, the
tracing interceptors, so every hop carries the trace context (services/common/tracing.py), and
the internal token (services/common/internal_auth.py)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import grpc
from opentelemetry import trace

from valora.internal_token import token_interceptors
from services.common.tracing import tracing_client_interceptors


def open_channel(
    address: str,
    options: Sequence[tuple[str, int | str]] = (),
    tracer_provider: trace.TracerProvider | None = None,
    credentials: grpc.ChannelCredentials | None = None,
    token: str = "",
) -> grpc.aio.Channel:
    """A grpc.aio channel to `address` (`host:port`) with tracing client interceptors; TLS when
    `credentials` (see `client_credentials(settings)`), else plaintext; `token` (see
    `internal_auth.internal_token(settings)`) sent on every call when set.
    `options` is usually `services.common.server.channel_options(settings)`."""
    interceptors = [*token_interceptors(token), *tracing_client_interceptors(tracer_provider)]
    if credentials is not None:
        return grpc.aio.secure_channel(address, credentials, options=list(options), interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)


def client_credentials(settings) -> grpc.ChannelCredentials | None:
    """Outbound TLS from a service's settings: verify servers against tls_ca and present
    tls_cert/tls_key as the client certificate. None when neither tls_ca nor tls_cert is set."""
    if not settings.tls_ca and not settings.tls_cert:
        return None

    def read(path: str) -> bytes | None:
        return Path(path).expanduser().read_bytes() if path else None

    return grpc.ssl_channel_credentials(
        root_certificates=read(settings.tls_ca),
        private_key=read(settings.tls_key),
        certificate_chain=read(settings.tls_cert),
    )
