"""A real worker (tiny model, CPU) with `scheduler_address` joins a real scheduler that has no
static workers, runs the work the scheduler places on it, and leaves the pool on graceful stop."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.scheduler.config import SchedulerSettings
from services.scheduler.server import create_server as create_scheduler
from services.worker.model import ensure_tiny_model
from services.worker.config import WorkerSettings
from services.worker.server import create_server as create_worker
from valora_protos.internal.v1 import scheduler_service_pb2, scheduler_service_pb2_grpc, work_pb2
from valora_protos.v1 import types_pb2

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def workers(stub) -> list:
    st = await stub.GetSchedulerStatus(
        scheduler_service_pb2.GetSchedulerStatusRequest(), wait_for_ready=True, timeout=5
    )
    return list(st.workers)


async def until(predicate, timeout=20.0):
    async def loop():
        while not await predicate():
            await asyncio.sleep(0.05)

    await asyncio.wait_for(loop(), timeout)


async def test_worker_registers_serves_and_deregisters(tmp_path):
    model = ensure_tiny_model(tmp_path / "tiny-qwen2-vl")
    scheduler = await create_scheduler(SchedulerSettings(status_poll_s=0.05, dispatch_tick_s=0.05))
    await scheduler.start()
    settings = WorkerSettings(
        model_path=str(model),
        build_tiny_model=False,
        max_batch_size=3,
        default_max_new_tokens=4,
        adapter_cache_dir=str(tmp_path / "cache"),
        scheduler_address=f"127.0.0.1:{scheduler.port}",
        heartbeat_s=0.1,
        worker_name="worker-reg",
    )
    worker = await create_worker(settings)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{scheduler.port}")
    stub = scheduler_service_pb2_grpc.SchedulerServiceStub(channel)
    stopped = False
    try:
        assert await workers(stub) == []
        await worker.start()
        address = f"127.0.0.1:{worker.port}"

        async def joined():
            return any(w.address == address and w.healthy for w in await workers(stub))

        await until(joined)
        (listed,) = await workers(stub)
        assert listed.device == "cpu" and listed.max_batch_size == 3

        item = work_pb2.WorkItem(request_id="r1", prompt="Say something.", output_kind=types_pb2.OUTPUT_KIND_TEXT)
        out = [r async for r in stub.Submit(scheduler_service_pb2.SubmitRequest(item=item), timeout=60)]
        assert out[-1].result.request_id == "r1" and out[-1].result.worker == "worker-reg"
        assert out[-1].result.usage.output_tokens > 0

        await worker.stop(1.0)  # graceful: deregisters
        stopped = True

        async def left():
            return await workers(stub) == []

        await until(left, timeout=5)
    finally:
        await channel.close()
        if not stopped:
            await worker.stop(0)
        await scheduler.stop(0)


def test_helm_workers_can_register_instead_of_a_dns_list():
    import json

    from test_deploy import CHART_VALUES, by_kind, rendered_objects

    values = json.loads(json.dumps(CHART_VALUES))
    values["worker"]["register"] = True
    cms = by_kind(rendered_objects(values), "ConfigMap")
    assert (
        cms["valora-worker"]["data"]["VALORA_SCHEDULER_ADDRESS"]
        == cms["valora-gateway"]["data"]["VALORA_SCHEDULER_ADDRESS"]
    )
    assert cms["valora-scheduler"]["data"]["VALORA_WORKER_ADDRESSES"] == ""
    default = by_kind(rendered_objects(), "ConfigMap")
    assert "VALORA_SCHEDULER_ADDRESS" not in default["valora-worker"]["data"]
    assert default["valora-scheduler"]["data"]["VALORA_WORKER_ADDRESSES"]
