"""Typed errors of the Python SDK (valora.client): one class per gRPC status the API answers,
carrying what the server put in the status details (google.rpc ErrorInfo.reason, BadRequest
field violations, RetryInfo delay).

Each is a grpc.RpcError too, with `code()` and `details()`, so code written against raw gRPC
errors keeps working:

    try:
        client.infer("hi", adapter="adapters/nope")
    except valora.errors.NotFound as err:
        print(err.reason)                # "ADAPTER_NOT_FOUND"
    except valora.errors.InvalidArgument as err:
        print(err.field_violations)      # [("input.prompt", "…")]
"""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status


class ValoraRpcError(grpc.RpcError):
    """An RPC that failed with `code`; `reason` (ErrorInfo), `field_violations` (BadRequest:
    (field, description) pairs), `retry_after_s` (RetryInfo; None when the server gave none)."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        reason: str = "",
        field_violations: list[tuple[str, str]] | None = None,
        retry_after_s: float | None = None,
        trailing_metadata=(),
    ) -> None:
        super().__init__(f"{code.name}: {message}" + (f" ({reason})" if reason else ""))
        self._code, self.message, self.reason = code, message, reason
        self.field_violations = list(field_violations or [])
        self.retry_after_s = retry_after_s
        self._trailing = tuple(trailing_metadata or ())

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self.message

    def trailing_metadata(self):
        """The call's trailing metadata (the status details travel there)."""
        return self._trailing


class InvalidArgument(ValoraRpcError):
    pass


class NotFound(ValoraRpcError):
    pass


class AlreadyExists(ValoraRpcError):
    pass


class FailedPrecondition(ValoraRpcError):
    pass


class Aborted(ValoraRpcError):
    pass  # a concurrent change won (e.g. a stale etag): read again


class Unauthenticated(ValoraRpcError):
    pass


class PermissionDenied(ValoraRpcError):
    pass


class ResourceExhausted(ValoraRpcError):
    pass


class Unavailable(ValoraRpcError):
    pass


class DeadlineExceeded(ValoraRpcError):
    pass


class Cancelled(ValoraRpcError):
    pass


class Internal(ValoraRpcError):
    pass


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.ABORTED: Aborted,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
}


def status_details(err: grpc.RpcError) -> tuple[str, list[tuple[str, str]], float | None]:
    """(ErrorInfo reason, BadRequest field violations, RetryInfo delay) of a failed call's status
    ("", [], None where absent or malformed). The services read them here too (services/common/errors.py)."""
    reason, violations, retry = "", [], None
    try:
        status = rpc_status.from_call(err)
    except Exception:  # malformed details: the code and message stand alone
        status = None
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason = info.reason
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            violations = [(v.field, v.description) for v in bad.field_violations]
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            retry = info.retry_delay.ToNanoseconds() / 1e9
    return reason, violations, retry


def from_rpc_error(err: grpc.RpcError) -> ValoraRpcError:
    """The typed error of a failed call (its status details parsed when the server sent them)."""
    if isinstance(err, ValoraRpcError):
        return err
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    message = err.details() if hasattr(err, "details") else str(err)
    reason, violations, retry = status_details(err)
    trailing = err.trailing_metadata() if hasattr(err, "trailing_metadata") else ()
    return _BY_CODE.get(code, Internal)(code, message or "", reason, violations, retry, trailing)
