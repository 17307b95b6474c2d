"""`create_server(settings)`: migrations, blob store, registry, servicers, background GC."""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor

import structlog

from valora_protos.internal.v1 import adapter_store_service_pb2 as store_pb
from valora_protos.internal.v1 import adapter_store_service_pb2_grpc as store_grpc
from valora_protos.v1 import admin_service_pb2 as admin_pb
from valora_protos.v1 import admin_service_pb2_grpc as admin_grpc

from services.common.server import Service, build_service

from services.adapter_store import db
from services.adapter_store.blobs import make_blob_store
from services.adapter_store.config import StoreSettings
from services.adapter_store.jobs import GenerationJobs
from services.adapter_store.registry import FaultHook, Registry
from services.adapter_store.servicer import AdapterStoreServicer, AdminServicer
from services.adapter_store.validation import BundleChecker

log = structlog.get_logger()

ADMIN_SERVICE = admin_pb.DESCRIPTOR.services_by_name["AdminService"].full_name
STORE_SERVICE = store_pb.DESCRIPTOR.services_by_name["AdapterStoreService"].full_name


def build_registry(settings: StoreSettings, fault_hook: FaultHook | None = None) -> Registry:
    """Engine (+ migrations when enabled), blob store and registry; blocking."""
    engine = db.make_engine(settings.database_url, settings.db_connect_timeout_s, settings.db_statement_timeout_s)
    if settings.run_migrations:
        db.upgrade(engine)
    return Registry(db.make_sessionmaker(engine), make_blob_store(settings), fault_hook)


async def create_server(settings: StoreSettings) -> Service:
    executor = ThreadPoolExecutor(max_workers=settings.db_workers, thread_name_prefix="store")
    loop = asyncio.get_running_loop()
    registry = await loop.run_in_executor(executor, build_registry, settings)
    checker = await loop.run_in_executor(executor, BundleChecker.from_settings, settings)
    jobs = GenerationJobs(registry.sessions, settings.job_lease_s, settings.job_max_attempts)
    admin = AdminServicer(
        registry,
        checker,
        executor,
        settings.upload_spool_dir,
        jobs,
        timeout_s=settings.backend_timeout_s,
        max_dataset_bytes=settings.max_dataset_bytes,
    )
    store = AdapterStoreServicer(
        registry, executor, settings.fetch_chunk_bytes, jobs, timeout_s=settings.backend_timeout_s
    )

    def register(server):
        admin_grpc.add_AdminServiceServicer_to_server(admin, server)
        store_grpc.add_AdapterStoreServiceServicer_to_server(store, server)
        return [ADMIN_SERVICE, STORE_SERVICE]

    service = build_service("adapter_store", settings, register)
    tasks: list[asyncio.Task] = []

    async def gc_loop():
        while True:
            await asyncio.sleep(settings.gc_interval_s)
            try:
                report = await loop.run_in_executor(executor, registry.gc, settings.pending_grace_s)
                if report.pending_removed or report.blobs_removed:
                    log.info("gc", pending_removed=report.pending_removed, blobs_removed=report.blobs_removed)
            except Exception as exc:  # GC retries next round; the error is logged
                log.warning("gc_failed", error=repr(exc))

    async def job_sweep_loop():
        """Requeues (or fails) generation jobs whose runner's lease lapsed, so their state shows
        even while no runner polls."""
        while True:
            await asyncio.sleep(settings.job_sweep_interval_s)
            try:
                for job in await loop.run_in_executor(executor, jobs.requeue_expired):
                    log.warning(
                        "generation_job_lease_expired",
                        job=job.name,
                        state=job.state,
                        attempts=job.attempts,
                        message=job.message,
                    )
            except Exception as exc:  # the next round (or the next claim) retries
                log.warning("job_sweep_failed", error=repr(exc))

    async def health_loop():
        """Health follows the backends: NOT_SERVING while the database or the blob store does
        not answer (a black-holed Postgres used to leave the store SERVING with every call hung),
        SERVING again once both do."""
        healthy = True
        while True:
            await asyncio.sleep(settings.health_check_s)
            try:
                await asyncio.wait_for(loop.run_in_executor(None, registry.ping), settings.health_check_timeout_s)
                ok, why = True, ""
            except Exception as exc:  # any failure (or the timeout) is an outage
                ok, why = False, f"{type(exc).__name__}: {exc}"[:300]
            if ok != healthy and not service.stopping:
                healthy = ok
                (log.info if ok else log.error)("backends_up" if ok else "backends_down", error=why or None)
                await service.set_serving(ok)

    async def on_start():
        if settings.health_check_s > 0:
            tasks.append(asyncio.create_task(health_loop(), name="adapter-store-health"))
        if settings.gc_interval_s > 0:
            tasks.append(asyncio.create_task(gc_loop(), name="adapter-store-gc"))
        if settings.job_sweep_interval_s > 0:
            tasks.append(asyncio.create_task(job_sweep_loop(), name="adapter-store-job-sweep"))

    async def on_stop():
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        executor.shutdown(wait=True, cancel_futures=True)
        registry.close()

    service.on_start.append(on_start)
    service.on_stop.append(on_stop)
    return service
