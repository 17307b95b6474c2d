"""Internal APIs authenticated (services as processes, `valora.cluster.start_cluster`'s generated
internal token): the adapter store, the scheduler and the workers refuse calls without the
token, or with a wrong one, with UNAUTHENTICATED; health stays open; a rogue worker cannot
register, so it receives no request; with the token the same calls succeed."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from valora.internal_token import TOKEN_KEY
from tests.reliability.conftest import record
from valora_protos.internal.v1 import adapter_store_service_pb2 as store
from valora_protos.internal.v1 import adapter_store_service_pb2_grpc as store_grpc
from valora_protos.internal.v1 import scheduler_service_pb2 as sched
from valora_protos.internal.v1 import scheduler_service_pb2_grpc as sched_grpc
from valora_protos.internal.v1 import worker_service_pb2 as work
from valora_protos.internal.v1 import worker_service_pb2_grpc as work_grpc
from valora_protos.v1 import admin_service_pb2 as admin
from valora_protos.v1 import admin_service_pb2_grpc as admin_grpc

pytestmark = pytest.mark.e2e
ROGUE = "127.0.0.1:1"


def code_of(call, metadata) -> str:
    try:
        call(metadata)
        return "OK"
    except grpc.RpcError as err:
        return err.code().name


def test_internal_calls_need_the_internal_token(cluster):
    assert cluster.internal_token, "start_cluster turns internal auth on"
    by = {p.service: p.address for p in reversed(cluster.processes)}
    channels = {s: grpc.insecure_channel(a) for s, a in by.items()}
    try:
        calls = {
            "store: ResolveReference": lambda md: store_grpc.AdapterStoreServiceStub(
                channels["adapter_store"]
            ).ResolveReference(store.ResolveReferenceRequest(reference="adapters/none"), timeout=10, metadata=md),
            "store: AdminService.ListAdapters": lambda md: admin_grpc.AdminServiceStub(
                channels["adapter_store"]
            ).ListAdapters(admin.ListAdaptersRequest(page_size=1), timeout=10, metadata=md),
            "scheduler: GetSchedulerStatus": lambda md: sched_grpc.SchedulerServiceStub(
                channels["scheduler"]
            ).GetSchedulerStatus(sched.GetSchedulerStatusRequest(), timeout=10, metadata=md),
            "scheduler: RegisterWorker (rogue)": lambda md: sched_grpc.SchedulerServiceStub(
                channels["scheduler"]
            ).RegisterWorker(
                sched.RegisterWorkerRequest(address=ROGUE, name="rogue", device="cpu", max_batch_size=64),
                timeout=10,
                metadata=md,
            ),
            "worker: GetWorkerStatus": lambda md: work_grpc.WorkerServiceStub(channels["worker"]).GetWorkerStatus(
                work.GetWorkerStatusRequest(), timeout=10, metadata=md
            ),
        }
        refused = {
            name: (code_of(call, []), code_of(call, [(TOKEN_KEY, "wrong-token")])) for name, call in calls.items()
        }
        health = {
            s: health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
            for s, ch in channels.items()
        }
        with cluster.channel(by["scheduler"]) as ch:
            listed = [
                w.address
                for w in sched_grpc.SchedulerServiceStub(ch)
                .GetSchedulerStatus(sched.GetSchedulerStatusRequest(), timeout=10)
                .workers
            ]
        allowed = {
            name: code_of(call, [(TOKEN_KEY, cluster.internal_token)])
            for name, call in calls.items()
            if "rogue" not in name
        }
    finally:
        for ch in channels.values():
            ch.close()
    ok = (
        all(r == ("UNAUTHENTICATED", "UNAUTHENTICATED") for r in refused.values())
        and all(s == health_pb2.HealthCheckResponse.SERVING for s in health.values())
        and ROGUE not in listed
        and all(code in ("OK", "NOT_FOUND") for code in allowed.values())
    )
    record(
        "internal_auth",
        "internal calls without / with a wrong token",
        refused,
        "UNAUTHENTICATED for every internal service; health open; no rogue worker listed",
        ok,
        with_token=allowed,
        rogue_listed=ROGUE in listed,
    )
    assert all(r == ("UNAUTHENTICATED", "UNAUTHENTICATED") for r in refused.values()), refused
    assert all(s == health_pb2.HealthCheckResponse.SERVING for s in health.values()), health
    assert ROGUE not in listed, listed
    assert all(code in ("OK", "NOT_FOUND") for code in allowed.values()), allowed
