"""API-key auth for the gateway, as a grpc.aio server interceptor.

Clients send `authorization: Bearer <key>` metadata. Inference RPCs accept an API key or an
admin key; admin RPCs accept only admin keys. With no keys configured at all, auth is off (the
embedded default) and a warning is logged once. Health and reflection are always open. Keys are
compared in constant time and never logged.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

import grpc
import structlog

from services.common.errors import PermissionDenied, Unauthenticated, ValoraError
from services.common.internal_auth import refusing_handler

log = structlog.get_logger()

AUTHORIZATION_KEY = "authorization"
INFERENCE_PREFIX = "/valora.v1.InferenceService/"
ADMIN_PREFIX = "/valora.v1.AdminService/"


def bearer_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    for key, value in metadata or ():
        if key.lower() == AUTHORIZATION_KEY:
            if isinstance(value, bytes):
                value = value.decode("utf-8", "replace")
            scheme, _, token = value.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None


def _matches(token: str, keys: list[bytes]) -> bool:
    encoded = token.encode("utf-8")
    hit = False
    for key in keys:  # no early exit: the time taken does not depend on which key matched
        hit |= hmac.compare_digest(encoded, key)
    return hit


class ApiKeyAuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, api_keys: Iterable[str], admin_keys: Iterable[str]) -> None:
        self._admin = [k.encode("utf-8") for k in admin_keys if k]
        self._inference = [k.encode("utf-8") for k in api_keys if k] + self._admin
        self.enabled = bool(self._inference)
        if not self.enabled:
            log.warning("auth_disabled", detail="no api_keys or admin_keys configured; every caller is trusted")
        elif not self._admin:
            log.warning("admin_locked", detail="no admin_keys configured; admin RPCs are refused")

    def check(self, method: str, metadata) -> ValoraError | None:
        """The error to answer `method` with, or None to let it through."""
        if not self.enabled:
            return None
        if method.startswith(ADMIN_PREFIX):
            allowed = self._admin
        elif method.startswith(INFERENCE_PREFIX):
            allowed = self._inference
        else:
            return None  # health, reflection
        token = bearer_token(metadata)
        if token is None:
            return Unauthenticated(
                "missing credentials: send 'authorization: Bearer <key>' metadata", reason="MISSING_API_KEY"
            )
        if _matches(token, allowed):
            return None
        if allowed is self._admin and _matches(token, self._inference):
            return PermissionDenied("this API key may not call admin RPCs", reason="ADMIN_KEY_REQUIRED")
        return Unauthenticated("invalid API key", reason="INVALID_API_KEY")

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        error = self.check(method, handler_call_details.invocation_metadata)
        handler = await continuation(handler_call_details)
        if error is None or handler is None:
            return handler
        log.info("auth_refused", method=method, code=error.code.name, reason=error.reason)
        return refusing_handler(handler, error)
