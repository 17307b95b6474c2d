"""The one error vocabulary of valora, and its mapping to gRPC status codes.

Handlers and engines raise these domain errors; `ErrorInterceptor` (services/common/server.py)
turns them into a gRPC status with google.rpc details. Anything else reaching the interceptor
is a bug and becomes INTERNAL.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2

DOMAIN = "valora.dev"
# A status travels in trailers, which clients cap (gRPC's default soft limit is 8 KiB): errors
# that echo a hostile value (a 5000-character name) are cut so the status itself gets through.
MAX_MESSAGE_CHARS = 512
MAX_DETAIL_CHARS = 200
MAX_FIELD_VIOLATIONS = 8


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 15] + f"...[{len(text)} chars]"


@dataclass
class FieldViolation:
    field: str
    description: str


@dataclass
class ValoraError(Exception):
    """Base of every domain error; `code` is the gRPC status it maps to."""

    message: str
    reason: str = "VALORA_ERROR"
    field_violations: list[FieldViolation] = field(default_factory=list)
    retry_after_s: float | None = None

    code = grpc.StatusCode.INTERNAL

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def to_status(self) -> status_pb2.Status:
        details = []
        info = error_details_pb2.ErrorInfo(reason=self.reason, domain=DOMAIN)
        details.append(info)
        if self.field_violations:
            details.append(
                error_details_pb2.BadRequest(
                    field_violations=[
                        error_details_pb2.BadRequest.FieldViolation(
                            field=_cut(v.field, MAX_DETAIL_CHARS), description=_cut(v.description, MAX_DETAIL_CHARS)
                        )
                        for v in self.field_violations[:MAX_FIELD_VIOLATIONS]
                    ]
                )
            )
        if self.retry_after_s is not None:
            delay = duration_pb2.Duration()
            delay.FromNanoseconds(int(self.retry_after_s * 1e9))
            details.append(error_details_pb2.RetryInfo(retry_delay=delay))
        packed = []
        for d in details:
            a = any_pb2.Any()
            a.Pack(d)
            packed.append(a)
        return status_pb2.Status(code=self.code.value[0], message=_cut(self.message, MAX_MESSAGE_CHARS), details=packed)


class InvalidArgument(ValoraError):
    code = grpc.StatusCode.INVALID_ARGUMENT


def invalid_field(field_path: str, description: str, reason: str = "INVALID_ARGUMENT") -> InvalidArgument:
    """An INVALID_ARGUMENT naming one offending field."""
    return InvalidArgument(
        f"{field_path}: {description}", reason=reason, field_violations=[FieldViolation(field_path, description)]
    )


class InvalidAdapter(InvalidArgument):
    pass


class NotFound(ValoraError):
    code = grpc.StatusCode.NOT_FOUND


class AdapterNotFound(NotFound):
    pass


class AlreadyExists(ValoraError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(ValoraError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(ValoraError):
    """Optimistic concurrency lost (e.g. an alias etag no longer matches)."""

    code = grpc.StatusCode.ABORTED


class CapacityExceeded(ValoraError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unauthenticated(ValoraError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(ValoraError):
    code = grpc.StatusCode.PERMISSION_DENIED


class WorkerUnavailable(ValoraError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(ValoraError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(ValoraError):
    code = grpc.StatusCode.CANCELLED


_BY_CODE: dict[grpc.StatusCode, type[ValoraError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.ABORTED: Aborted,
    grpc.StatusCode.RESOURCE_EXHAUSTED: CapacityExceeded,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAVAILABLE: WorkerUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
}


def from_rpc_error(err: grpc.RpcError) -> ValoraError:
    """Rebuild the domain error a downstream service raised, keeping its status and details,
    so a hop (gateway -> scheduler -> worker) passes errors through unchanged."""
    from valora.errors import status_details

    code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
    message = err.details() if callable(getattr(err, "details", None)) else str(err)
    cls = _BY_CODE.get(code, WorkerUnavailable if code == grpc.StatusCode.UNKNOWN else ValoraError)
    out = cls(message or code.name, reason=code.name)
    reason, violations, retry = status_details(err)
    out.reason = reason or out.reason
    if violations:
        out.field_violations = [FieldViolation(f, d) for f, d in violations]
    if retry is not None:
        out.retry_after_s = retry
    return out
