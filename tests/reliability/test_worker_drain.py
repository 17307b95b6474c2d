"""Graceful drain on SIGTERM (services as processes): restarting one of the two workers while
traffic flows fails no request, and the scheduler stops sending to the draining worker (a
request sent there would show as a retry in the scheduler's log)."""

from __future__ import annotations

import signal
import threading
import time
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
from valora_protos.v1 import inference_service_pb2 as inf
from valora_protos.v1 import inference_service_pb2_grpc as inf_grpc
from valora_protos.v1 import types_pb2

pytestmark = pytest.mark.e2e


def test_rolling_restart_fails_no_request(cluster):
    sched_log = Path(next(p.log for p in cluster.processes if p.service == "scheduler"))
    stub = inf_grpc.InferenceServiceStub(grpc.insecure_channel(cluster.gateway))
    outcomes: list[tuple[str, str]] = []
    lock = threading.Lock()
    stop = threading.Event()

    def client(c):
        i = 0
        while not stop.is_set():
            i += 1
            req = inf.InferRequest(
                request_id=f"drain-{c}-{i}",
                input=inf.InferenceInput(prompt="What is here?", params=types_pb2.GenerationParams(max_new_tokens=24)),
            )
            try:
                stub.Infer(req, timeout=60, metadata=md(API_KEY))
                code, why = "OK", ""
            except grpc.RpcError as err:
                code, why = err.code().name, err.details() or ""
            with lock:
                outcomes.append((code, why))

    retries_before = sched_log.read_text().count("worker_failed_before_first_token")
    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(6)]
    for t in threads:
        t.start()
    drains = {}
    try:
        time.sleep(1.5)
        for name in ("worker-0",):  # one rolling step; the other worker is the same code path
            proc = next(p for p in cluster.processes if p.name == name)
            env = process_env(proc.pid)
            t0 = time.monotonic()
            kill(proc.pid, signal.SIGTERM)
            seen_down = wait_scheduler_sees(cluster, proc.address, False, 20)
            assert wait_exit(proc.pid, 30), f"{name} did not exit after SIGTERM"
            exit_s = time.monotonic() - t0
            new = respawn_process(cluster, name, env)
            wait_scheduler_sees(cluster, new.address, True, 30)
            drains[name] = {
                "scheduler_saw_not_serving_ms": round(seen_down * 1e3, 1),
                "exited_after_s": round(exit_s, 2),
            }
            time.sleep(1.0)
    finally:
        stop.set()
        for t in threads:
            t.join(90)
    retried = sched_log.read_text().count("worker_failed_before_first_token") - retries_before
    failed = [o for o in outcomes if o[0] != "OK"]
    passed = not failed and retried == 0 and len(outcomes) > 0
    record(
        "drain",
        "failed requests while a worker drains on SIGTERM and restarts under traffic",
        len(failed),
        "0",
        passed,
        requests=len(outcomes),
        sent_to_draining_worker_and_retried=retried,
        drains=drains,
        failures=sorted({f"{c}: {w[:120]}" for c, w in failed}),
    )
    assert not failed, failed[:5]
    assert retried == 0, f"{retried} requests were sent to a draining worker (retried elsewhere)"
