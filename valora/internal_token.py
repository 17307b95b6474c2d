"""The client side of the services' internal token: channels that send it on every call.

Services send the shared token (services/common/internal_auth.py checks it) in
`x-valora-internal-token` metadata; `with_token` wraps a synchronous channel (tools, the SDK,
`valora.cluster`), `token_interceptors` a grpc.aio channel (services/common/channels.py). Here,
in the client package, so the SDK needs nothing of `services`.
"""

from __future__ import annotations

import grpc

TOKEN_KEY = "x-valora-internal-token"


def _with_token(metadata, token: str):
    return (*(m for m in metadata or () if m[0] != TOKEN_KEY), (TOKEN_KEY, token))


class _AioToken:
    def __init__(self, token: str) -> None:
        self._token = token

    def _details(self, details):
        return details._replace(metadata=grpc.aio.Metadata(*_with_token(details.metadata, self._token)))


# One class per call kind: grpc.aio sorts a channel's interceptors by kind, each into one list.
class _UnaryUnary(_AioToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _UnaryStream(_AioToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _StreamUnary(_AioToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


class _StreamStream(_AioToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


def token_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """Client interceptors of a grpc.aio channel that send `token` on every call (none for "")."""
    return [kind(token) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)] if token else []


class _SyncToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, token: str) -> None:
        self._token = token

    def _details(self, details):
        return _Details(
            details.method,
            details.timeout,
            _with_token(details.metadata, self._token),
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


class _Details(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = credentials, wait_for_ready, compression


def with_token(channel: grpc.Channel, token: str) -> grpc.Channel:
    """A synchronous channel that sends `token` on every call (the channel itself for "")."""
    return grpc.intercept_channel(channel, _SyncToken(token)) if token else channel
