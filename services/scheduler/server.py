"""Builds the scheduler's gRPC server: worker pool, dispatcher, SchedulerService."""

from __future__ import annotations

from services.common import metrics
from services.common.channels import client_credentials
from services.common.internal_auth import internal_token
from services.common.server import Service, build_service, channel_options
from services.common.tracing import tracer_provider
from services.scheduler.config import SchedulerSettings
from services.scheduler.dispatcher import Dispatcher
from services.scheduler.cost_model import load_profile
from services.scheduler.policies import make_policy
from services.scheduler.policies.base import SchedulingPolicy
from services.scheduler.service import SchedulerServicer
from services.scheduler.workers import WorkerPool
from valora_protos.internal.v1 import scheduler_service_pb2, scheduler_service_pb2_grpc


async def create_server(settings: SchedulerSettings, policy: SchedulingPolicy | None = None) -> Service:
    dispatcher: Dispatcher | None = None
    tracing = tracer_provider(settings, "scheduler")

    def on_change() -> None:
        if dispatcher is not None:
            dispatcher.wake()

    pool = WorkerPool(
        settings.worker_addresses,
        poll_s=settings.status_poll_s,
        poll_timeout_s=settings.status_timeout_s,
        default_max_batch_size=settings.default_max_batch_size,
        channel_options=channel_options(settings),
        on_change=on_change,
        tracer_provider=tracing,
        credentials=client_credentials(settings),
        token=internal_token(settings),
        ttl_s=settings.worker_ttl_s,
        grace_s=settings.worker_grace_s,
        watch=settings.status_watch,
        watch_interval_s=settings.status_watch_interval_ms / 1e3,
    )
    if policy is None:
        cost = load_profile(settings.cost_profile, settings.cost_results_dir or None)
        policy = make_policy(
            settings.policy, cost, theta_s=settings.starvation_theta_s, deadlines=settings.slo_deadlines
        )
    dispatcher = Dispatcher(
        pool,
        policy,
        max_queue=settings.max_queue,
        retry_after_s=settings.retry_after_s,
        tick_s=settings.dispatch_tick_s,
        mode_switch_timeout_s=settings.mode_switch_timeout_s,
    )
    servicer = SchedulerServicer(pool, dispatcher, max_attempts=settings.max_attempts)

    def register(server):
        scheduler_service_pb2_grpc.add_SchedulerServiceServicer_to_server(servicer, server)
        return [scheduler_service_pb2.DESCRIPTOR.services_by_name["SchedulerService"].full_name]

    service = build_service("scheduler", settings, register, tracer_provider=tracing)
    metrics.init_service("scheduler")  # its requests_total series at zero from start-up
    service.on_start.append(pool.start)
    service.on_start.append(dispatcher.start)
    # on_stop runs in reverse: the dispatcher fails queued requests, then channels close.
    service.on_stop.append(pool.close)
    service.on_stop.append(dispatcher.close)
    return service
