"""The one way services open outbound gRPC channels: the shared message-size options plus the
tracing interceptors, so every hop carries the trace context (services/common/tracing.py)."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from opentelemetry import trace

from services.common.tracing import tracing_client_interceptors


def open_channel(address: str, options: Sequence[tuple[str, int | str]] = (),
                 tracer_provider: trace.TracerProvider | None = None) -> grpc.aio.Channel:
    """An insecure grpc.aio channel to `address` (`host:port`) with tracing client interceptors.
    `options` is usually `services.common.server.channel_options(settings)`."""
    return grpc.aio.insecure_channel(address, options=list(options),
                                     interceptors=tracing_client_interceptors(tracer_provider))
