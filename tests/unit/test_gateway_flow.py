"""Gateway -> real scheduler -> in-test worker over loopback: the request path and hop-by-hop
errors (status, reason and details survive both hops)."""

from __future__ import annotations

import asyncio
import contextlib
import copy

import grpc
import pytest
from google.protobuf import field_mask_pb2
from google.rpc import error_details_pb2
from prometheus_client import REGISTRY
from grpc_status import rpc_status

from services.common.server import REQUEST_ID_KEY
from services.gateway.config import GatewaySettings
from services.gateway.server import create_server as create_gateway
from services.scheduler.config import SchedulerSettings
from services.scheduler.server import create_server as create_scheduler
from valora_protos.internal.v1 import (
    adapter_store_service_pb2,
    adapter_store_service_pb2_grpc,
    worker_service_pb2,
    worker_service_pb2_grpc,
)
from valora_protos.v1 import (
    admin_service_pb2,
    admin_service_pb2_grpc,
    inference_service_pb2,
    inference_service_pb2_grpc,
    resources_pb2,
    types_pb2,
)

pytestmark = pytest.mark.anyio
VERSION = resources_pb2.AdapterVersion(
    name="adapters/cars/versions/1", sha256="ef" * 32, state=resources_pb2.ADAPTER_VERSION_STATE_READY
)


@pytest.fixture
def anyio_backend():
    return "asyncio"


# A task with a latency objective: one the worker below always meets, one it always misses.
TASKS = {
    "tasks/count": resources_pb2.Task(
        name="tasks/count", adapter="adapters/cars@prod", slo_ms=60_000.0, slo_class="video"
    ),
    "tasks/ask": resources_pb2.Task(
        name="tasks/ask", adapter="adapters/cars@prod", slo_ms=0.001, slo_class="retrieval"
    ),
    # A text task that releases its adapter halfway by default.
    "tasks/describe": resources_pb2.Task(
        name="tasks/describe", adapter="adapters/cars@prod", adapter_release_fraction=0.5
    ),
    # One that releases it after the answer's first sentence, past a quarter of the tokens.
    "tasks/answer": resources_pb2.Task(
        name="tasks/answer",
        adapter="adapters/cars@prod",
        adapter_release_fraction=0.25,
        adapter_release_rule=types_pb2.ADAPTER_RELEASE_RULE_SENTENCE_END,
    ),
}


class Store(adapter_store_service_pb2_grpc.AdapterStoreServiceServicer, admin_service_pb2_grpc.AdminServiceServicer):
    def __init__(self):
        self.tasks = {name: copy.deepcopy(t) for name, t in TASKS.items()}
        self.resolved: list[str] = []

    async def ResolveReference(self, request, context):
        self.resolved.append(request.reference)
        return adapter_store_service_pb2.ResolveReferenceResponse(
            version=VERSION, task=self.tasks.get(request.reference)
        )

    async def UpdateTask(self, request, context):
        task = self.tasks[request.task.name]
        for path in request.update_mask.paths:
            setattr(task, path, getattr(request.task, path))
        return admin_service_pb2.UpdateTaskResponse(task=task)


class Worker(worker_service_pb2_grpc.WorkerServiceServicer):
    def __init__(self):
        self.items, self.request_ids = [], []
        self.fail_with: grpc.StatusCode | None = None
        self.healthy = True

    async def Generate(self, request, context):
        self.items.append(request.item)
        self.request_ids.append(dict(context.invocation_metadata()).get(REQUEST_ID_KEY))
        if self.fail_with is not None:
            await context.abort(self.fail_with, "adapter blob missing")
        for delta in ("two ", "cars"):
            yield worker_service_pb2.GenerateResponse(text_delta=delta)
        yield worker_service_pb2.GenerateResponse(
            result=inference_service_pb2.InferResult(
                text="two cars", finish_reason=types_pb2.FINISH_REASON_EOS, mode=types_pb2.INFERENCE_MODE_UNMERGED
            )
        )

    async def GetWorkerStatus(self, request, context):
        return worker_service_pb2.GetWorkerStatusResponse(
            status=admin_service_pb2.WorkerStatus(healthy=self.healthy, max_batch_size=4)
        )


@contextlib.asynccontextmanager
async def stack(max_queue=16, store=None, **gateway_settings):
    worker = Worker()
    backend = grpc.aio.server()
    worker_service_pb2_grpc.add_WorkerServiceServicer_to_server(worker, backend)
    store = store or Store()
    adapter_store_service_pb2_grpc.add_AdapterStoreServiceServicer_to_server(store, backend)
    admin_service_pb2_grpc.add_AdminServiceServicer_to_server(store, backend)
    addr = f"127.0.0.1:{backend.add_insecure_port('127.0.0.1:0')}"
    await backend.start()
    scheduler = await create_scheduler(
        SchedulerSettings(worker_addresses=[addr], status_poll_s=0.05, dispatch_tick_s=0.05, max_queue=max_queue)
    )
    await scheduler.start()
    gateway = await create_gateway(
        GatewaySettings(scheduler_address=f"127.0.0.1:{scheduler.port}", adapter_store_address=addr, **gateway_settings)
    )
    await gateway.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}")
    try:
        yield (
            worker,
            inference_service_pb2_grpc.InferenceServiceStub(channel),
            admin_service_pb2_grpc.AdminServiceStub(channel),
        )
    finally:
        await channel.close()
        await gateway.stop(0)
        await scheduler.stop(0)
        await backend.stop(0)


def infer_input():
    return inference_service_pb2.InferenceInput(prompt="how many cars?", adapter="adapters/cars@prod")


async def test_infer_and_stream_through_scheduler_to_worker():
    async with stack() as (worker, infer, admin):
        resp = await infer.Infer(inference_service_pb2.InferRequest(input=infer_input(), request_id="flow-1"))
        chunks = [r async for r in infer.InferStream(inference_service_pb2.InferStreamRequest(input=infer_input()))]
        status = await admin.GetClusterStatus(admin_service_pb2.GetClusterStatusRequest())
    r = resp.result
    assert (r.text, r.request_id, r.adapter_version) == ("two cars", "flow-1", VERSION.name)
    assert r.worker == status.workers[0].address and status.workers[0].healthy
    assert r.timing.queue_ms >= 0.0
    item = worker.items[0]
    assert worker.request_ids[0] == "flow-1" and item.request_id == "flow-1"
    assert item.adapter.version == VERSION.name and item.adapter.sha256 == VERSION.sha256
    assert [c.text_delta for c in chunks] == ["two ", "cars", ""]
    assert chunks[-1].result.request_id == worker.request_ids[1] != ""


def slo_count(slo_class, outcome):
    return REGISTRY.get_sample_value("valora:slo_requests_total", {"slo_class": slo_class, "outcome": outcome}) or 0


async def test_task_objective_reaches_the_scheduler_which_counts_attainment_per_class():
    before = {(c, o): slo_count(c, o) for c in ("video", "retrieval", "none") for o in ("within", "over")}
    async with stack() as (worker, infer, _):
        for task in ("tasks/count", "tasks/count", "tasks/ask"):
            await infer.Infer(
                inference_service_pb2.InferRequest(
                    input=inference_service_pb2.InferenceInput(prompt="how many cars?", task=task)
                )
            )
        await infer.Infer(inference_service_pb2.InferRequest(input=infer_input()))  # no task: no objective
    assert [(i.slo_class, i.slo_ms) for i in worker.items] == [
        ("video", 60_000.0),
        ("video", 60_000.0),
        ("retrieval", 0.001),
        ("", 0.0),
    ]
    moved = {k: slo_count(*k) - v for k, v in before.items()}
    assert moved == {
        ("video", "within"): 2,
        ("video", "over"): 0,
        ("retrieval", "within"): 0,
        ("retrieval", "over"): 1,
        ("none", "within"): 0,
        ("none", "over"): 0,
    }


async def test_an_updated_task_objective_reaches_the_scheduler_within_the_resolve_cache_bound():
    """The scheduler takes a task's objective from each request (the gateway resolves the task
    and keeps the answer resolve_cache_s): after UpdateTask through a gateway its next request
    carries the new objective at once; another gateway, which cached the old one, within
    resolve_cache_s."""
    store = Store()

    async def count_request(infer):
        await infer.Infer(
            inference_service_pb2.InferRequest(
                input=inference_service_pb2.InferenceInput(prompt="how many cars?", task="tasks/count")
            )
        )

    async with stack(store=store, resolve_cache_s=60.0) as (worker, infer, admin):
        async with stack(store=store, resolve_cache_s=0.3) as (other_worker, other_infer, _):
            await count_request(infer)
            await count_request(other_infer)  # both gateways now keep the old objective
            await count_request(infer)
            assert store.resolved == ["tasks/count"] * 2
            updated = await admin.UpdateTask(
                admin_service_pb2.UpdateTaskRequest(
                    task=resources_pb2.Task(name="tasks/count", slo_ms=80.0, slo_class="fast"),
                    update_mask=field_mask_pb2.FieldMask(paths=["slo_ms", "slo_class"]),
                )
            )
            assert (updated.task.slo_ms, updated.task.slo_class) == (80.0, "fast")
            await count_request(infer)  # the gateway that forwarded the update dropped its cache
            await count_request(other_infer)  # still within the other's resolve_cache_s
            await asyncio.sleep(0.4)
            await count_request(other_infer)
    assert [(i.slo_ms, i.slo_class) for i in worker.items] == [(60_000.0, "video")] * 2 + [(80.0, "fast")]
    assert [(i.slo_ms, i.slo_class) for i in other_worker.items] == [(60_000.0, "video")] * 2 + [(80.0, "fast")]


async def test_a_task_release_policy_is_the_default_of_its_requests():
    """The gateway fills in params.adapter_release_fraction and adapter_release_rule from the
    task it resolved, together, for a request that sets neither; a request that sets either
    keeps its own policy as a whole; a request without the task gets none."""
    rule = types_pb2.ADAPTER_RELEASE_RULE_SENTENCE_END
    async with stack() as (worker, infer, admin):

        async def describe(task="tasks/describe", **params):
            await infer.Infer(
                inference_service_pb2.InferRequest(
                    input=inference_service_pb2.InferenceInput(
                        prompt="describe the cars", task=task, params=types_pb2.GenerationParams(**params)
                    )
                )
            )

        await describe()
        await describe(adapter_release_fraction=0.25)
        await infer.Infer(inference_service_pb2.InferRequest(input=infer_input()))
        await admin.UpdateTask(
            admin_service_pb2.UpdateTaskRequest(
                task=resources_pb2.Task(name="tasks/describe", adapter_release_fraction=0.75),
                update_mask=field_mask_pb2.FieldMask(paths=["adapter_release_fraction"]),
            )
        )
        await describe()
        await describe("tasks/answer")
        await describe("tasks/answer", adapter_release_fraction=0.5)  # the fraction alone, no rule
        await describe(adapter_release_rule=rule)  # the rule alone, from the first sentence
    assert [(i.params.adapter_release_fraction, i.params.adapter_release_rule) for i in worker.items] == [
        (0.5, 0),
        (0.25, 0),
        (0.0, 0),
        (0.75, 0),
        (0.25, rule),
        (0.5, 0),
        (0.0, rule),
    ]


async def test_worker_error_passes_through_both_hops():
    async with stack() as (worker, infer, _):
        worker.fail_with = grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await infer.Infer(inference_service_pb2.InferRequest(input=infer_input()))
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND
    assert "adapter blob missing" in exc.value.details()
    assert len(worker.items) == 1  # NOT_FOUND is about the request: no retry


async def test_scheduler_queue_full_reaches_the_client_with_retry_info():
    async with stack(max_queue=1) as (worker, infer, admin):
        worker.healthy = False
        for _ in range(250):  # until a poll sees the worker down; requests then wait in the queue
            if not (await admin.GetClusterStatus(admin_service_pb2.GetClusterStatusRequest())).workers[0].healthy:
                break
            await asyncio.sleep(0.02)
        first = infer.InferStream(inference_service_pb2.InferStreamRequest(input=infer_input()), timeout=10)
        reader = asyncio.ensure_future(first.read())
        for _ in range(250):
            if (await admin.GetClusterStatus(admin_service_pb2.GetClusterStatusRequest())).queued_requests:
                break
            await asyncio.sleep(0.02)
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await infer.Infer(inference_service_pb2.InferRequest(input=infer_input()))
        first.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await reader
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    details = rpc_status.from_call(exc.value).details
    assert any(d.Is(error_details_pb2.RetryInfo.DESCRIPTOR) for d in details)
    infos = [d for d in details if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR)]
    info = error_details_pb2.ErrorInfo()
    infos[0].Unpack(info)
    assert info.reason == "QUEUE_FULL"
