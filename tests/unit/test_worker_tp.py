"""A tensor-parallel worker (VALORA_TP_SIZE=2) on CPU: the gRPC worker process is rank 0 and spawns
rank 1 (gloo on loopback); it serves the same tokens as a single-process worker, its shutdown
ends the follower, a dead follower takes health to NOT_SERVING, and a size that does not split
the model is refused at start-up."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import grpc
import pytest
import torch.distributed as dist
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.server import build_service
from services.worker.config import WorkerSettings
from services.worker.server import create_server
from services.worker.testing import InMemoryAdapterStore, random_adapter_bundle
from services.worker.tp_ranks import rank_device
from tests.unit.test_worker_server import generate, png
from valora_protos.internal.v1 import work_pb2, worker_service_pb2, worker_service_pb2_grpc
from valora_protos.v1 import types_pb2

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
    ),
]
A = "adapters/alpha/versions/1"
HEALTH = health_pb2.HealthCheckRequest(service="valora.internal.v1.WorkerService")


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


def _settings(model_path, tmp_path, **kw) -> WorkerSettings:
    return WorkerSettings(
        model_path=str(model_path),
        port=0,
        build_tiny_model=False,
        max_batch_size=4,
        default_max_new_tokens=8,
        adapter_cache_dir=str(tmp_path / "adapter-cache"),
        tp_timeout_s=60,
        **kw,
    )


@pytest.fixture
async def store(model_path, tmp_path):
    store = InMemoryAdapterStore({A: random_adapter_bundle(model_path, rank=4, seed=1)})
    service = build_service("store", _settings(model_path, tmp_path), store.register)
    await service.start()
    yield store, f"127.0.0.1:{service.port}"
    await service.stop(0)


async def _run_requests(settings: WorkerSettings, store, workers: list | None = None) -> list[tuple[str, int, str]]:
    """Starts a worker (appended to `workers`), loads A through LoadAdapter, runs an image request
    without and with A (concurrently: one decode batch of two LoRA segments), stops the worker;
    (text, output tokens, mode) of each."""
    worker = await create_server(settings)
    if workers is not None:
        workers.append(worker)
    await worker.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
            stub = worker_service_pb2_grpc.WorkerServiceStub(channel)
            ref = work_pb2.AdapterRef(version=A, sha256=store.bundles[A].sha256)
            loaded = await stub.LoadAdapter(worker_service_pb2.LoadAdapterRequest(adapter=ref, to_device=True))
            assert not loaded.already_loaded
            image = [types_pb2.Image(data=png(3), mime_type="image/png")]
            runs = await asyncio.gather(
                generate(stub, request_id="base", images=image, prompt="Describe the image."),
                generate(stub, request_id="lora", images=image, prompt="Describe the image.", adapter=ref),
            )
            return [(res.text, res.usage.output_tokens, res.mode) for _, res in runs]
    finally:
        await worker.stop(0)


async def test_tp2_worker_serves_the_single_process_tokens_and_stops_its_follower(model_path, tmp_path, store):
    store, address = store
    single = await _run_requests(_settings(model_path, tmp_path, adapter_store_address=address), store)

    started = []
    tp = await _run_requests(_settings(model_path, tmp_path, adapter_store_address=address, tp_size=2), store, started)
    assert tp == single
    assert single[0][0] != single[1][0] and single[0][1] > 0  # the adapter changes the answer
    followers = started[0].servicer.followers
    assert [p.name for p in followers.procs] == ["valora-tp1"]
    proc = followers.procs[0]
    assert not proc.is_alive() and proc.exitcode == 0  # ended by rank 0's stop, not terminated
    with pytest.raises(ProcessLookupError):
        os.kill(proc.pid, 0)
    assert not dist.is_initialized()  # the worker left the group: another can start in this process


@contextlib.asynccontextmanager
async def _serving_tp2_worker(model_path, tmp_path):
    """A TP=2 worker (rank 0 here, its follower a process) seen SERVING: (worker, channel, health
    stub); stopped on leaving."""
    worker = await create_server(_settings(model_path, tmp_path, tp_size=2))
    await worker.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            assert (await health.Check(HEALTH)).status == health_pb2.HealthCheckResponse.SERVING
            yield worker, channel, health
    finally:
        await worker.stop(0)


async def _wait_not_serving(health) -> None:
    deadline = time.monotonic() + 20
    while (await health.Check(HEALTH)).status == health_pb2.HealthCheckResponse.SERVING:
        assert time.monotonic() < deadline, "health still SERVING with the follower gone"
        await asyncio.sleep(0.1)


async def test_a_follower_seen_dead_takes_the_worker_out_of_service(model_path, tmp_path, monkeypatch):
    """The watchdog's own check of the follower processes (for a collective that would hang rather
    than fail, e.g. NCCL): rank 0's engine still alive, health goes NOT_SERVING."""
    async with _serving_tp2_worker(model_path, tmp_path) as (worker, channel, health):
        monkeypatch.setattr(worker.servicer.followers, "dead", lambda: ["valora-tp1 (exit code -9)"])
        await _wait_not_serving(health)
        assert worker.servicer.engine.alive
    assert not worker.servicer.followers.procs[0].is_alive()


# Rank 0's engine thread dies of the broken collective (logged, re-raised: pytest reports the thread).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
async def test_a_killed_follower_fails_rank_0s_engine_instead_of_hanging(model_path, tmp_path):
    async with _serving_tp2_worker(model_path, tmp_path) as (worker, channel, health):
        os.kill(worker.servicer.followers.procs[0].pid, signal.SIGKILL)
        await _wait_not_serving(health)
        stub = worker_service_pb2_grpc.WorkerServiceStub(channel)
        status = (await stub.GetWorkerStatus(worker_service_pb2.GetWorkerStatusRequest())).status
        assert not status.healthy
        # Its next collective with the lost rank fails (an idle rank 0 still broadcasts every step).
        deadline = time.monotonic() + 20
        while worker.servicer.engine.alive:
            assert time.monotonic() < deadline, "rank 0's engine outlived its follower"
            await asyncio.sleep(0.1)
        with pytest.raises(grpc.RpcError) as err:
            await generate(stub, request_id="r", prompt="hi")
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        t0 = time.monotonic()  # the worker stops on leaving the block
    assert time.monotonic() - t0 < 30
    assert not dist.is_initialized()


def test_rank_devices():
    assert [rank_device("cuda", r) for r in range(3)] == ["cuda:0", "cuda:1", "cuda:2"]
    assert [rank_device("cuda:2", r) for r in range(2)] == ["cuda:2", "cuda:3"]
    assert rank_device("cpu", 1) == "cpu"


@pytest.mark.parametrize("size, what", [(3, "attention heads"), (4, "KV heads")])
async def test_a_tp_size_that_does_not_split_the_model_fails_at_start_up(model_path, tmp_path, size, what):
    worker = await create_server(_settings(model_path, tmp_path, tp_size=size))
    try:
        with pytest.raises(ValueError, match=f"VALORA_TP_SIZE={size}: {what}"):
            await worker.start()
        assert worker.servicer.followers is None  # refused before any rank was spawned
    finally:
        await worker.stop(0)
