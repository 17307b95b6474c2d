"""The live policy sees what each worker runs (adapters of running rows) and how long waiting
prompts are, as the simulator shows them, so the credit policy prices the LoRA term of running
rows in production too."""

from __future__ import annotations

import asyncio
import contextlib
import math
from dataclasses import replace

import grpc
import pytest
from test_scheduler_service import ADAPTER, FakeWorker, submit_request, wait_until

from services.scheduler.config import SchedulerSettings
from services.scheduler.cost_model import CostModel
from services.scheduler.credits import estimate_prompt_tokens
from services.scheduler.policies.base import ModeCommand, SchedulingPolicy, WaitingRequest
from services.common.modes import Mode
from services.scheduler.policies.credit import CreditPolicy
from services.scheduler.server import create_server
from services.scheduler.workers import WorkerHandle
from valora_protos.internal.v1 import scheduler_service_pb2, scheduler_service_pb2_grpc, worker_service_pb2_grpc
from valora_protos.v1 import admin_service_pb2, types_pb2

pytestmark = pytest.mark.anyio
A, B, C = ADAPTER, "adapters/b/versions/1", "adapters/c/versions/1"


@pytest.fixture
def anyio_backend():
    return "asyncio"


class Recording(SchedulingPolicy):
    """Delegates to `inner`, keeping what every decision was given."""

    def __init__(self, inner: SchedulingPolicy) -> None:
        self.inner = inner
        self.calls: list[tuple[list, list]] = []

    def decide(self, now_s, waiting, workers):
        self.calls.append((list(waiting), list(workers)))
        return self.inner.decide(now_s, waiting, workers)


def test_prompt_tokens_are_estimated_from_the_text():
    assert estimate_prompt_tokens("") == 0  # the cost model's default applies
    assert estimate_prompt_tokens("abcd") == 1 and estimate_prompt_tokens("abcde") == 2
    assert estimate_prompt_tokens("x" * 400) == 100


def test_handle_reports_running_rows_per_adapter_and_the_credit_policy_prices_them():
    handle = WorkerHandle(
        "w1",
        None,
        None,
        16,
        status=admin_service_pb2.WorkerStatus(
            healthy=True, max_batch_size=16, mode=types_pb2.INFERENCE_MODE_UNMERGED, device="cuda:0"
        ),
        healthy=True,
    )
    for adapter in (B, B, B, B, C, C, C, C):
        handle.started(adapter)
    waiting = [WaitingRequest(f"a{i}", 100.0, A, prompt_tokens=40) for i in range(2)]

    busy = handle.view()
    assert busy.running == 8 and dict(busy.running_adapters) == {B: 4, C: 4}
    # Eight unmerged rows of B and C run there: merging A would push them all through the
    # mixture term, so the worker stays unmerged and takes the A requests as they are.
    d = CreditPolicy(CostModel(), theta_s=5.0).decide(100.0, waiting, [busy])
    assert d.mode_commands == [] and len(d.assignments) == 2
    # Blind to the running rows (what the dispatcher used to report), it would merge A.
    blind = CreditPolicy(CostModel(), theta_s=5.0).decide(100.0, waiting, [replace(busy, running_adapters={})])
    assert blind.mode_commands == [ModeCommand("w1", Mode.MERGED, A)]

    for adapter in (B, B, B, B, C, C, C, C):
        handle.finished(adapter)
    assert handle.view().running == 0 and dict(handle.view().running_adapters) == {}


async def test_dispatcher_tells_the_policy_running_adapters_and_prompt_sizes():
    w = FakeWorker(max_batch=8, hang=True)
    server = grpc.aio.server()
    worker_service_pb2_grpc.add_WorkerServiceServicer_to_server(w, server)
    w.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    # θ tiny: every request starves, so the worker stays unmerged and takes them all.
    policy = Recording(CreditPolicy(CostModel(), theta_s=0.001))
    service = await create_server(
        SchedulerSettings(worker_addresses=[w.address], status_poll_s=0.05, dispatch_tick_s=0.05), policy=policy
    )
    await service.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{service.port}")
    stub = scheduler_service_pb2_grpc.SchedulerServiceStub(channel)
    calls, readers = [], []
    try:
        for n, (rid, adapter) in enumerate((("b1", B), ("c1", C), ("c2", C))):
            call = stub.Submit(submit_request(rid, adapter=adapter), timeout=10)
            calls.append(call)
            readers.append(asyncio.ensure_future(call.read()))
            await wait_until(lambda n=n: _true(len(w.calls) == n + 1))
        long = submit_request("a1", adapter=A)
        long.item.prompt = "describe every vehicle in this picture, one per line " * 8
        call = stub.Submit(long, timeout=10)
        calls.append(call)
        readers.append(asyncio.ensure_future(call.read()))
        await wait_until(lambda: _true(len(w.calls) == 4))
        waiting, workers = next((wt, ws) for wt, ws in policy.calls if any(r.adapter == A for r in wt))
        for call in calls:
            call.cancel()
        for r in readers:
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await r

        async def idle():
            st = await stub.GetSchedulerStatus(scheduler_service_pb2.GetSchedulerStatusRequest())
            return st.workers[0].running_requests == 0

        await wait_until(idle)
        # Every run released its row: the next decision sees none running.
        seen = len(policy.calls)
        last = stub.Submit(submit_request("b2", adapter=B), timeout=10)
        reader = asyncio.ensure_future(last.read())
        await wait_until(lambda: _true(len(w.calls) == 5))
        _, after = next((wt, ws) for wt, ws in policy.calls[seen:] if wt)
        last.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await reader
    finally:
        await channel.close()
        await service.stop(0)
        await server.stop(0)
    (a1,) = [r for r in waiting if r.adapter == A]
    assert a1.prompt_tokens == math.ceil(len(long.item.prompt) / 4)
    assert dict(workers[0].running_adapters) == {B: 1, C: 2} and workers[0].running == 3
    assert after[0].running == 0 and dict(after[0].running_adapters) == {}


async def _true(value):
    return value
