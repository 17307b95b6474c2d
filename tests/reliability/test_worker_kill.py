"""Worker SIGKILL (services as processes, 2 workers): before the first token the request is
retried on the other worker and succeeds; after the first token the client gets UNAVAILABLE and
the request is never replayed. Figure: detection times."""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from valora.cluster import process_env, respawn_process, wait_exit
from tests.reliability.conftest import (
    API_KEY,
    kill,
    md,
    record,
    wait_scheduler_sees,
)
from valora_protos.internal.v1 import worker_service_pb2, worker_service_pb2_grpc
from valora_protos.v1 import inference_service_pb2 as inf
from valora_protos.v1 import inference_service_pb2_grpc as inf_grpc
from valora_protos.v1 import types_pb2

pytestmark = pytest.mark.e2e


def running(cluster, address: str) -> int:
    with cluster.channel(address) as ch:
        try:
            return (
                worker_service_pb2_grpc.WorkerServiceStub(ch)
                .GetWorkerStatus(worker_service_pb2.GetWorkerStatusRequest(), timeout=2)
                .status.running_requests
            )
        except grpc.RpcError:
            return -1


class PeakRunning:
    """Watches, from a thread, the most requests a worker runs at once (a stream replayed on it
    shows as > 0) until stop(), which returns that peak."""

    def __init__(self, cluster, address: str, period_s: float = 0.02) -> None:
        self.peak, self._stop = 0, threading.Event()

        def watch():
            while not self._stop.is_set():
                self.peak = max(self.peak, running(cluster, address))
                time.sleep(period_s)

        self._thread = threading.Thread(target=watch, daemon=True)
        self._thread.start()

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(5)
        return self.peak


def long_stream(cluster, stub, workers: dict, request_prefix: str, seed: int, timeout_s: float = 120):
    """A stream of up to 1000 sampled tokens that has sent its first text: (its message iterator,
    the name of the worker running it). A sampled EOS can end a stream early: up to 5 tries."""
    for attempt in range(5):
        params = types_pb2.GenerationParams(max_new_tokens=1000, temperature=0.7, seed=seed + attempt)
        request = inf.InferStreamRequest(
            request_id=f"{request_prefix}-{attempt}",
            input=inf.InferenceInput(prompt="Tell a long story.", params=params),
        )
        call = stub.InferStream(request, timeout=timeout_s, metadata=md(API_KEY))
        it = iter(call)
        first = next(it, None)
        name = None
        for _ in range(20):
            where = {nm: running(cluster, p.address) for nm, p in workers.items()}
            name = next((nm for nm, r in where.items() if r == 1), None)
            if name is not None or first is None:
                break
            time.sleep(0.05)
        if first is not None and first.text_delta and name is not None:
            return it, name
        call.cancel()
    raise AssertionError("no long stream found running on a worker")


def test_worker_sigkill_before_and_after_first_token(cluster):
    workers = {p.name: p for p in cluster.processes if p.service == "worker"}
    sched_log = Path(next(p.log for p in cluster.processes if p.service == "scheduler"))
    stub = inf_grpc.InferenceServiceStub(grpc.insecure_channel(cluster.gateway))
    figures = {}

    # -- before the first token: worker-0 frozen (SIGSTOP) while requests reach it, then killed.
    victim = workers["worker-0"]
    env = process_env(victim.pid)
    retries_before = sched_log.read_text().count("worker_failed_before_first_token")
    kill(victim.pid, signal.SIGSTOP)
    n = 8

    def one(i):
        req = inf.InferRequest(
            request_id=f"kill-before-{i}",
            input=inf.InferenceInput(prompt="Name the object.", params=types_pb2.GenerationParams(max_new_tokens=4)),
        )
        try:
            r = stub.Infer(req, timeout=60, metadata=md(API_KEY))
            return "OK", r.result.worker
        except grpc.RpcError as err:
            return err.code().name, err.details()

    with ThreadPoolExecutor(n) as ex:
        futures = [ex.submit(one, i) for i in range(n)]
        time.sleep(1.0)
        kill(victim.pid, signal.SIGKILL)
        before = [f.result() for f in futures]
    assert wait_exit(victim.pid, 10)
    retried = sched_log.read_text().count("worker_failed_before_first_token") - retries_before
    figures["before_first_token"] = {
        "requests": n,
        "ok": sum(1 for c, _ in before if c == "OK"),
        "retried_on_other_worker": retried,
        "served_by": sorted({w for c, w in before if c == "OK"}),
    }
    workers["worker-0"] = respawn_process(cluster, "worker-0", env)
    wait_scheduler_sees(cluster, workers["worker-0"].address, True, 20)

    # -- after the first token: a long stream; kill the worker running it.
    it, name = long_stream(cluster, stub, workers, "kill-after", seed=3)
    other = next(nm for nm in workers if nm != name)
    env = process_env(workers[name].pid)
    other_peak = PeakRunning(cluster, workers[other].address)
    t_kill = time.monotonic()
    kill(workers[name].pid, signal.SIGKILL)
    code, deltas_after, result_after = "OK", 0, False
    try:
        for msg in it:
            deltas_after += 1
            result_after |= msg.HasField("result")
    except grpc.RpcError as err:
        code = err.code().name
    client_detect_s = time.monotonic() - t_kill
    sched_detect_s = client_detect_s + wait_scheduler_sees(cluster, workers[name].address, False, 20)
    time.sleep(1.0)
    replayed = other_peak.stop() > 0
    assert wait_exit(workers[name].pid, 10)
    figures["after_first_token"] = {
        "code": code,
        "result_after_kill": result_after,
        "replayed_on_other_worker": replayed,
        "client_error_after_kill_ms": round(client_detect_s * 1e3, 1),
        "scheduler_marks_down_after_kill_ms": round(sched_detect_s * 1e3, 1),
    }
    respawn_process(cluster, name, env)
    wait_scheduler_sees(cluster, workers[name].address, True, 20)

    b, a = figures["before_first_token"], figures["after_first_token"]
    passed = (
        b["ok"] == n
        and b["served_by"] == ["worker-1"]
        and b["retried_on_other_worker"] >= 1
        and a["code"] == "UNAVAILABLE"
        and not a["result_after_kill"]
        and not a["replayed_on_other_worker"]
    )
    record(
        "worker-kill",
        "detection time after SIGKILL mid-stream (client error / scheduler marks down)",
        f"{a['client_error_after_kill_ms']} ms / {a['scheduler_marks_down_after_kill_ms']} ms",
        "before first token: retried elsewhere, all OK; after: UNAVAILABLE, never replayed",
        passed,
        **figures,
    )
    assert b["ok"] == n, before
    assert b["served_by"] == ["worker-1"], before
    assert b["retried_on_other_worker"] >= 1
    assert a["code"] == "UNAVAILABLE", a
    assert not a["result_after_kill"] and not a["replayed_on_other_worker"], a
