"""A worker frozen mid-stream (SIGSTOP: its sockets stay open, it answers nothing): the client
gets UNAVAILABLE within the worker TTL + 2 s (the pool counts the TTL from the worker's last
healthy status) instead of waiting out its deadline, the stream is not replayed
elsewhere, and after SIGCONT the worker is taken back. Figure: detection times."""

from __future__ import annotations

import signal
import time

import grpc
import pytest

from services.scheduler.config import SchedulerSettings
from tests.reliability.conftest import API_KEY, kill, md, record, wait_scheduler_sees
from tests.reliability.test_worker_kill import PeakRunning, long_stream
from valora_protos.v1 import inference_service_pb2 as inf
from valora_protos.v1 import inference_service_pb2_grpc as inf_grpc
from valora_protos.v1 import types_pb2

pytestmark = pytest.mark.e2e
DEADLINE_S = 120
TTL_S = SchedulerSettings().worker_ttl_s  # the cluster's (the default): a frozen worker is lost after it


def test_worker_frozen_mid_stream_fails_the_stream_fast_and_comes_back(cluster):
    workers = {p.name: p for p in cluster.processes if p.service == "worker"}
    stub = inf_grpc.InferenceServiceStub(grpc.insecure_channel(cluster.gateway))
    it, name = long_stream(cluster, stub, workers, "stop", seed=11, timeout_s=DEADLINE_S)
    other = next(nm for nm in workers if nm != name)
    other_peak = PeakRunning(cluster, workers[other].address, period_s=0.05)
    t_stop = time.monotonic()
    kill(workers[name].pid, signal.SIGSTOP)
    code, result_after = "OK", False
    try:
        try:
            for msg in it:
                result_after |= msg.HasField("result")
        except grpc.RpcError as err:
            code = err.code().name
        client_detect_s = time.monotonic() - t_stop
        sched_detect_s = client_detect_s + wait_scheduler_sees(cluster, workers[name].address, False, 60)
    finally:
        kill(workers[name].pid, signal.SIGCONT)
    back_s = wait_scheduler_sees(cluster, workers[name].address, True, 60)
    replayed = other_peak.stop() > 0
    after = stub.Infer(
        inf.InferRequest(
            input=inf.InferenceInput(prompt="Still there?", params=types_pb2.GenerationParams(max_new_tokens=2))
        ),
        timeout=60,
        metadata=md(API_KEY),
    )
    figures = {
        "code": code,
        "result_after_stop": result_after,
        "replayed_on_other_worker": replayed,
        "client_error_after_stop_ms": round(client_detect_s * 1e3, 1),
        "scheduler_marks_down_after_stop_ms": round(sched_detect_s * 1e3, 1),
        "taken_back_after_sigcont_ms": round(back_s * 1e3, 1),
    }
    passed = (
        code == "UNAVAILABLE"
        and not result_after
        and not figures["replayed_on_other_worker"]
        and client_detect_s < TTL_S + 2
        and after.result.usage.output_tokens > 0
    )
    record(
        "worker-sigstop",
        "a worker frozen mid-stream: client error / scheduler marks down / back after SIGCONT",
        f"{figures['client_error_after_stop_ms']} ms / {figures['scheduler_marks_down_after_stop_ms']} ms / "
        f"{figures['taken_back_after_sigcont_ms']} ms",
        f"UNAVAILABLE within the worker TTL + 2 s ({TTL_S + 2:g} s) of a {DEADLINE_S} s deadline, never "
        "replayed, served again",
        passed,
        **figures,
    )
    assert passed, figures
