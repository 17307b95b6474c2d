"""Builds the gateway's gRPC server (auth interceptor, InferenceService, AdminService) and the
OpenAI-compatible HTTP front beside it (services/gateway/http_openai.py)."""

from __future__ import annotations

from services.common import metrics
from services.common.channels import client_credentials, open_channel
from services.common.internal_auth import internal_token
from services.common.server import Service, build_service, channel_options
from services.common.tracing import tracer_provider
from services.gateway.admin import AdminServicer
from services.gateway.auth import ApiKeyAuthInterceptor
from services.gateway.config import GatewaySettings
from services.gateway.http_openai import OpenAIHttpServer, loopback_target
from services.gateway.inference import InferenceServicer
from valora_protos.internal.v1 import adapter_store_service_pb2_grpc, scheduler_service_pb2_grpc
from valora_protos.v1 import admin_service_pb2, admin_service_pb2_grpc, inference_service_pb2
from valora_protos.v1 import inference_service_pb2_grpc


async def create_server(settings: GatewaySettings) -> Service:
    """The gateway's Service; with `http_enabled`, `service.http` is the HTTP front (its `port`
    bound already), started and stopped with the gRPC server."""
    options = channel_options(settings)
    tracing = tracer_provider(settings, "gateway")
    credentials = client_credentials(settings)  # mutual TLS between services when configured
    token = internal_token(settings)  # the scheduler's and the store's internal APIs
    scheduler_channel = open_channel(settings.scheduler_address, options, tracing, credentials=credentials, token=token)
    store_channel = open_channel(settings.adapter_store_address, options, tracing, credentials=credentials, token=token)
    scheduler = scheduler_service_pb2_grpc.SchedulerServiceStub(scheduler_channel)
    inference = InferenceServicer(
        settings, scheduler, adapter_store_service_pb2_grpc.AdapterStoreServiceStub(store_channel)
    )
    store_admin = admin_service_pb2_grpc.AdminServiceStub(store_channel)
    admin = AdminServicer(settings, store_admin, scheduler, on_registry_change=inference.resolved.clear)
    auth = ApiKeyAuthInterceptor(
        [k.get_secret_value() for k in settings.api_keys], [k.get_secret_value() for k in settings.admin_keys]
    )

    def register(server):
        inference_service_pb2_grpc.add_InferenceServiceServicer_to_server(inference, server)
        admin_service_pb2_grpc.add_AdminServiceServicer_to_server(admin, server)
        return [
            inference_service_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name,
            admin_service_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name,
        ]

    service = build_service("gateway", settings, register, interceptors=[auth], tracer_provider=tracing, internal=False)
    metrics.init_service("gateway")  # its requests_total series at zero from start-up
    service.http = None
    if settings.http_enabled:
        target = loopback_target(settings.host, service.port)
        http = OpenAIHttpServer(
            settings,
            target,
            auth,
            store_admin,
            open_channel(target, options, tracing, credentials=credentials),
            tracer_provider=tracing,
        )
        service.http = http
        http.is_serving = lambda: service.serving
        service.on_start.append(http.start)
        service.on_stop.append(http.close)

    async def close_channels() -> None:
        await scheduler_channel.close()
        await store_channel.close()

    service.on_stop.insert(0, close_channels)  # runs last: the HTTP front closes first
    return service
