"""valora.v1.AdminService at the gateway: registry RPCs are forwarded to the adapter store
(which serves the same AdminService registry methods), GetClusterStatus is answered from the
scheduler. Auth happens before (auth.py); metadata other than credentials, and the deadline,
travel with the forwarded call; downstream errors pass through unchanged."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from services.common import errors
from services.common.server import REQUEST_ID_KEY, new_request_id
from services.gateway.auth import AUTHORIZATION_KEY
from services.gateway.config import GatewaySettings
from valora_protos.internal.v1 import scheduler_service_pb2, scheduler_service_pb2_grpc
from valora_protos.v1 import admin_service_pb2, admin_service_pb2_grpc

# Registry RPCs that change what a reference resolves to: after one succeeds, this gateway's
# cached resolutions are dropped (InferenceServicer.resolved).
CHANGING = {
    "CreateAdapter",
    "DeleteAdapter",
    "DeleteAdapterVersion",
    "SetAlias",
    "DeleteAlias",
    "CreateTask",
    "UpdateTask",
    "DeleteTask",
    "UploadAdapterVersion",
}

# Unary registry RPCs forwarded as they are.
FORWARDED_UNARY = (
    "CreateAdapter",
    "GetAdapter",
    "ListAdapters",
    "DeleteAdapter",
    "GetAdapterVersion",
    "ListAdapterVersions",
    "DeleteAdapterVersion",
    "SetAlias",
    "DeleteAlias",
    "CreateTask",
    "GetTask",
    "ListTasks",
    "UpdateTask",
    "DeleteTask",
    "CreateGenerationJob",
    "GetGenerationJob",
    "ListGenerationJobs",
    "CancelGenerationJob",
)
_NOT_FORWARDED = {AUTHORIZATION_KEY, "user-agent", "content-type", "te"}


def forwarded_metadata(context: grpc.aio.ServicerContext) -> tuple[tuple[str, str], ...]:
    """Caller metadata minus credentials and transport headers, plus a request id."""
    out = []
    has_rid = False
    for key, value in context.invocation_metadata() or ():
        k = key.lower()
        if k in _NOT_FORWARDED or k.startswith(("grpc-", ":")):
            continue
        has_rid |= k == REQUEST_ID_KEY
        out.append((k, value))
    if not has_rid:
        out.append((REQUEST_ID_KEY, new_request_id()))
    return tuple(out)


def _forward_unary(method: str):
    async def handler(self, request, context):
        resp = await self._call(getattr(self.store, method), request, context)
        if method in CHANGING:
            self.on_registry_change()
        return resp

    handler.__name__ = method
    handler.__doc__ = f"Forwards {method} to the adapter store."
    return handler


class AdminServicer(admin_service_pb2_grpc.AdminServiceServicer):
    def __init__(
        self,
        settings: GatewaySettings,
        store: admin_service_pb2_grpc.AdminServiceStub,
        scheduler: scheduler_service_pb2_grpc.SchedulerServiceStub,
        on_registry_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.scheduler = scheduler
        self.on_registry_change = on_registry_change  # after a CHANGING call succeeded

    def _timeout(self, context) -> float:
        return self.settings.deadline_s(context.time_remaining(), self.settings.admin_deadline_s)

    async def _call(self, stub_method, request, context):
        try:
            return await stub_method(request, timeout=self._timeout(context), metadata=forwarded_metadata(context))
        except grpc.RpcError as err:
            raise errors.from_rpc_error(err) from None

    async def _relay_stream(self, stub_method, request_iterator, context):
        # Parts are written one by one (not relayed through an iterator) so that when the store
        # answers early (bad metadata, size limit) the client gets the store's status, not an
        # INTERNAL from the half-consumed request iterator.
        call = stub_method(timeout=self._timeout(context), metadata=forwarded_metadata(context))
        try:
            try:
                async for part in request_iterator:
                    await call.write(part)
                await call.done_writing()
            except (asyncio.InvalidStateError, grpc.RpcError):
                pass  # the store already answered; its status is raised below
            return await call
        except grpc.RpcError as err:
            raise errors.from_rpc_error(err) from None
        finally:
            call.cancel()

    async def UploadAdapterVersion(self, request_iterator, context):
        resp = await self._relay_stream(self.store.UploadAdapterVersion, request_iterator, context)
        self.on_registry_change()
        return resp

    async def UploadDataset(self, request_iterator, context):
        """Forwards a dataset upload (generation jobs' user data) to the adapter store."""
        return await self._relay_stream(self.store.UploadDataset, request_iterator, context)

    async def GetClusterStatus(self, request, context):
        try:
            status = await self.scheduler.GetSchedulerStatus(
                scheduler_service_pb2.GetSchedulerStatusRequest(),
                timeout=self.settings.deadline_s(context.time_remaining()),
                metadata=forwarded_metadata(context),
            )
        except grpc.RpcError as err:
            raise errors.from_rpc_error(err) from None
        return admin_service_pb2.GetClusterStatusResponse(
            workers=status.workers, queued_requests=status.queued_requests
        )


for _method in FORWARDED_UNARY:
    setattr(AdminServicer, _method, _forward_unary(_method))
