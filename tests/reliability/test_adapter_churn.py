"""300 distinct adapters requested four at a time from a worker whose host pool and disk cache each
hold ~20 of them: every request is served, the host pool and the disk cache never exceed their
budgets (least recently used adapters leave; a held one never does; concurrent loads once went
over together: 23 of 20), the device keeps its slots, the LoRA planner keeps entries only for
resident adapters (it once kept one per adapter ever served, each holding its device tensors: 300,
RSS +37 MiB), and the worker's memory stays flat once the caches are full.

A real worker server over gRPC fetching from an in-memory adapter store (services/worker/testing.py);
tiny-model bundles of rank 8 (~135 KB each); figure: the caches' peak bytes against their budgets
and the process's RSS growth from the 50th adapter to the 300th."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import grpc
import pytest

from services.worker.config import WorkerSettings
from services.worker.testing import InMemoryAdapterStore, random_adapter_bundle, serve_worker
from tests.reliability.conftest import record, rss_bytes
from valora_protos.internal.v1 import work_pb2, worker_service_pb2, worker_service_pb2_grpc
from valora_protos.v1 import types_pb2

pytestmark = pytest.mark.anyio
ADAPTERS = 300
KEEP = 20  # bundles each cache holds
CONCURRENCY = 4


@pytest.fixture
def anyio_backend():
    return "asyncio"


def cache_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


async def test_300_adapters_keep_the_caches_and_memory_bounded(model_path, tmp_path):
    bundles = {
        f"adapters/churn{i}/versions/1": random_adapter_bundle(model_path, rank=8, seed=1000 + i)
        for i in range(ADAPTERS)
    }
    one = max(len(b.data) for b in bundles.values())
    budget = KEEP * one
    store = InMemoryAdapterStore(bundles, chunk_bytes=64 << 10)
    cache = tmp_path / "cache"
    settings = WorkerSettings(
        model_path=str(model_path),
        port=0,
        build_tiny_model=False,
        max_batch_size=4,
        device_slots=4,
        default_max_new_tokens=2,
        adapter_cache_dir=str(cache),
        adapter_cache_bytes=budget,
        host_adapter_bytes=budget,
        drain_delay_s=0,
    )
    peak_host = peak_disk = 0
    rss_at_50 = rss_end = 0
    failures = []
    names = list(bundles)
    t0 = time.monotonic()

    async def one_request(stub, name: str) -> None:
        item = work_pb2.WorkItem(
            request_id=name.split("/")[1],
            prompt="Hi.",
            adapter=work_pb2.AdapterRef(version=name, sha256=bundles[name].sha256),
            params=types_pb2.GenerationParams(max_new_tokens=2),
        )
        try:
            async for _ in stub.Generate(worker_service_pb2.GenerateRequest(item=item), timeout=60):
                pass
        except grpc.aio.AioRpcError as err:
            failures.append((name, err.code().name, err.details()[:200]))

    async with serve_worker(settings, store) as (worker, channel):
        stub = worker_service_pb2_grpc.WorkerServiceStub(channel)
        engine = worker.servicer.engine
        for start in range(0, ADAPTERS, CONCURRENCY):
            await asyncio.gather(*(one_request(stub, n) for n in names[start : start + CONCURRENCY]))
            peak_host = max(peak_host, engine.pool.host_bytes())
            peak_disk = max(peak_disk, cache_bytes(cache))
            if start + CONCURRENCY == 52:
                rss_at_50 = rss_bytes(os.getpid())
        rss_end = rss_bytes(os.getpid())
        elapsed = time.monotonic() - t0
        hosted, resident = len(engine.pool.host_names()), len(engine.pool.resident_names())
        planned = len(engine.lora.entries)  # the LoRA plans' cached entries (each holds its tensors)
    growth_mib = (rss_end - rss_at_50) / 2**20
    ok = (
        not failures
        and peak_host <= budget
        and peak_disk <= budget
        and resident <= 4
        and planned <= 8
        and growth_mib < 16
        and store.fetches >= ADAPTERS
    )
    record(
        "adapter-churn",
        f"{ADAPTERS} distinct adapters through one worker whose host pool and disk cache hold "
        f"~{KEEP}: failures; peak host pool and disk cache bytes of their budget; RSS growth from the 50th",
        {
            "failures": len(failures),
            "peak_host_bytes": peak_host,
            "peak_disk_bytes": peak_disk,
            "budget_bytes": budget,
            "adapters_on_host_at_end": hosted,
            "resident_at_end": resident,
            "plan_entries_at_end": planned,
            "rss_growth_mib": round(growth_mib, 1),
            "fetches": store.fetches,
            "seconds": round(elapsed, 1),
        },
        "0 failures; both peaks <= the budget; <= 4 resident, <= 8 plan entries; RSS growth < 16 MiB",
        ok,
    )
    assert ok, (failures[:3], peak_host, peak_disk, budget, resident, planned, growth_mib, store.fetches)
