"""Shared pieces of the reliability suite (tests/reliability, issue 9).

- `record()` writes one figure to reliability-<name>.json: in bench/results/ when VALORA_RECORD=1
  (to refresh the committed figures), else in a temporary directory (a plain test run leaves the
  checkout as it was).
- `cluster`: the four services as processes (valora.cluster), 2 workers, auth on, small limits,
  started once per session; `valora.cluster.respawn_process()` brings a killed/stopped worker back
  on its port.
- `InProcessStack`: worker + scheduler + gateway servers in this process (own event loop thread,
  real loopback ports), for tests that must look inside the engine (tokens after a deadline,
  KV cache bytes after cancellations).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest

from valora.cluster import Cluster, ensure_model, start_cluster, stop_cluster

REPO = Path(__file__).resolve().parents[2]
# Hypothesis keeps a cache directory (constants, examples); not in the checkout.
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", str(Path(os.environ.get("TMPDIR", "/tmp")) / "valora-hypothesis"))
RESULTS = (
    REPO / "bench" / "results"
    if os.environ.get("VALORA_RECORD") == "1"
    else Path(os.environ.get("TMPDIR", "/tmp")) / "valora-reliability-results"
)
API_KEY = "rk-inference-7f3a9c1e5b2d4f60"
ADMIN_KEY = "rk-admin-0d8e2b6a4c1f9e37"
MAX_BATCH = 4
MAX_QUEUE = 8
MAX_MESSAGE_BYTES = 8 << 20


def pytest_collection_modifyitems(session, config, items):
    """Within this suite, tests that do not use the process cluster run first (before it starts:
    they measure timings in this process and should not share the CPU with its idle services);
    the cluster tests keep their order, the destructive ones (test_worker_*) last by name."""
    here = Path(__file__).parent
    slots = [i for i, item in enumerate(items) if Path(str(item.fspath)).is_relative_to(here)]
    mine = sorted((items[i] for i in slots), key=lambda item: "cluster" in getattr(item, "fixturenames", ()))
    for i, item in zip(slots, mine):
        items[i] = item


def record(name: str, figure: str, value, target: str, passed: bool, **extra) -> dict:
    """Writes the figure of one reliability test; returns it."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"test": name, "figure": figure, "value": value, "target": target, "pass": bool(passed), **extra}
    (RESULTS / f"reliability-{name}.json").write_text(json.dumps(out, indent=2) + "\n")
    return out


def md(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


@pytest.fixture(scope="session")
def model_path(tmp_path_factory) -> Path:
    path = (
        Path(os.environ.get("VALORA_TEST_MODEL_PATH", ""))
        if os.environ.get("VALORA_TEST_MODEL_PATH")
        else tmp_path_factory.getbasetemp() / "tiny-qwen2-vl"
    )
    ensure_model(path)
    return path


CLUSTER_ENV = {
    "VALORA_API_KEYS": API_KEY,
    "VALORA_ADMIN_KEYS": ADMIN_KEY,
    "VALORA_MAX_BATCH_SIZE": str(MAX_BATCH),
    "VALORA_MAX_QUEUE": str(MAX_QUEUE),
    "VALORA_MAX_MESSAGE_BYTES": str(MAX_MESSAGE_BYTES),
    "VALORA_STATUS_POLL_S": "0.5",
    "VALORA_STATUS_TIMEOUT_S": "1.0",
    "VALORA_LOG_LEVEL": "debug",
    # in-flight requests' time to finish on SIGTERM: 5 s was seen running out on a busy 2-core CI
    # machine, three 24-token requests still decoding on the draining worker (k8s gives 30 s)
    "VALORA_GRACE_S": "15",
}


@pytest.fixture(scope="session")
def cluster(tmp_path_factory, model_path):
    home = tmp_path_factory.mktemp("reliability-home")
    c = start_cluster(home, workers=2, model_path=model_path, env=CLUSTER_ENV)
    yield c
    stop_cluster(home)


def kill(pid: int, sig: int = signal.SIGKILL) -> None:
    os.kill(pid, sig)


def rss_bytes(pid: int) -> int:
    import psutil

    return psutil.Process(pid).memory_info().rss


def wait_scheduler_sees(cluster: Cluster, address: str, healthy: bool, timeout_s: float = 15.0) -> float:
    """Polls GetClusterStatus until `address` has the given health; returns seconds waited."""
    from valora_protos.v1 import admin_service_pb2, admin_service_pb2_grpc

    t0 = time.monotonic()
    with grpc.insecure_channel(cluster.gateway) as ch:
        stub = admin_service_pb2_grpc.AdminServiceStub(ch)
        while True:
            st = stub.GetClusterStatus(admin_service_pb2.GetClusterStatusRequest(), timeout=5, metadata=md(ADMIN_KEY))
            w = {x.address: x for x in st.workers}.get(address)
            if w is not None and w.healthy == healthy:
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"scheduler did not see {address} healthy={healthy} in {timeout_s}s")
            time.sleep(0.02)


class InProcessStack:
    """Worker, scheduler and gateway servers of this process on loopback ports, run by one event
    loop in a background thread. `engine` is the worker's real Engine."""

    def __init__(
        self,
        model_path: Path,
        *,
        max_batch_size: int = 8,
        worker_overrides: dict | None = None,
        scheduler_overrides: dict | None = None,
        gateway_overrides: dict | None = None,
    ) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="inproc-stack", daemon=True)
        self.thread.start()
        self._services = []
        self.model_path = model_path
        self.max_batch_size = max_batch_size
        self.overrides = (worker_overrides or {}, scheduler_overrides or {}, gateway_overrides or {})
        self.run(self._up(), timeout=180)

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _up(self) -> None:
        from services.gateway.config import GatewaySettings
        from services.gateway.server import create_server as create_gateway
        from services.scheduler.config import SchedulerSettings
        from services.scheduler.server import create_server as create_scheduler
        from services.worker.config import WorkerSettings
        from services.worker.server import create_server as create_worker

        wo, so, go = self.overrides
        self.worker = await create_worker(
            WorkerSettings(
                port=0,
                model_path=str(self.model_path),
                build_tiny_model=False,
                max_batch_size=self.max_batch_size,
                log_json=True,
                **wo,
            )
        )
        await self.worker.start()
        self._services.append(self.worker)
        self.scheduler = await create_scheduler(
            SchedulerSettings(port=0, worker_addresses=[f"127.0.0.1:{self.worker.port}"], status_poll_s=0.2, **so)
        )
        await self.scheduler.start()
        self._services.append(self.scheduler)
        self.gateway = await create_gateway(
            GatewaySettings(
                port=0, scheduler_address=f"127.0.0.1:{self.scheduler.port}", adapter_store_address="127.0.0.1:9", **go
            )
        )
        await self.gateway.start()
        self._services.append(self.gateway)

    @property
    def engine(self):
        return self.worker.servicer.engine

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gateway.port}"

    def scheduler_state(self) -> dict:
        """The scheduler's own bookkeeping: queued requests and requests it has on workers."""
        servicer = None
        for s in self._services:
            if s.name == "scheduler":
                servicer = s
        # The dispatcher/pool are reachable through the server's on_stop hooks' owners.
        hooks = [h.__self__ for h in servicer.on_stop if hasattr(h, "__self__")]
        pool = next(h for h in hooks if hasattr(h, "workers"))
        dispatcher = next(h for h in hooks if hasattr(h, "queue"))
        return {"queued": len(dispatcher.queue), "inflight": sum(w.inflight for w in pool.workers.values())}

    def close(self) -> None:
        async def down():
            for s in reversed(self._services):
                await s.stop(1.0)

        try:
            self.run(down(), timeout=60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
