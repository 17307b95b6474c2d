"""Overload at 2x capacity through the real gateway (services as processes): the excess gets
RESOURCE_EXHAUSTED with RetryInfo, admitted requests keep their latency, and no worker ever
runs more than its max batch (nor the scheduler queues more than its limit)."""

from __future__ import annotations

import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from tests.reliability.conftest import ADMIN_KEY, API_KEY, MAX_BATCH, MAX_QUEUE, md, record
from valora_protos.internal.v1 import worker_service_pb2, worker_service_pb2_grpc
from valora_protos.v1 import admin_service_pb2, admin_service_pb2_grpc
from valora_protos.v1 import inference_service_pb2 as inf
from valora_protos.v1 import inference_service_pb2_grpc as inf_grpc
from valora_protos.v1 import types_pb2

pytestmark = pytest.mark.e2e
TOKENS = 8


def has_retry_info(err: grpc.RpcError) -> bool:
    status = rpc_status.from_call(err)
    return status is not None and any(d.Is(error_details_pb2.RetryInfo.DESCRIPTOR) for d in status.details)


def burst(stub, n: int) -> list[tuple[str, float, bool]]:
    """n requests released together; (code, latency_s, RetryInfo present) each."""
    gate = threading.Barrier(n)

    def one(i):
        req = inf.InferRequest(
            input=inf.InferenceInput(
                prompt=f"Count the objects, case {i}.", params=types_pb2.GenerationParams(max_new_tokens=TOKENS)
            )
        )
        gate.wait()
        t0 = time.monotonic()
        try:
            stub.Infer(req, timeout=120, metadata=md(API_KEY))
            return "OK", time.monotonic() - t0, False
        except grpc.RpcError as err:
            return err.code().name, time.monotonic() - t0, has_retry_info(err)

    with ThreadPoolExecutor(n) as ex:
        return list(ex.map(one, range(n)))


def test_overload_sheds_excess_with_retry_info(cluster):
    workers = [p for p in cluster.processes if p.service == "worker"]
    capacity = len(workers) * MAX_BATCH + MAX_QUEUE
    peaks = {"worker_running": 0, "queued": 0}
    stop = threading.Event()

    def sample():
        chans = [cluster.channel(w.address) for w in workers]
        gw = grpc.insecure_channel(cluster.gateway)
        stubs = [worker_service_pb2_grpc.WorkerServiceStub(c) for c in chans]
        admin = admin_service_pb2_grpc.AdminServiceStub(gw)
        while not stop.is_set():
            for s in stubs:
                try:
                    st = s.GetWorkerStatus(worker_service_pb2.GetWorkerStatusRequest(), timeout=2).status
                    peaks["worker_running"] = max(peaks["worker_running"], st.running_requests)
                except grpc.RpcError:
                    pass
            try:
                cs = admin.GetClusterStatus(
                    admin_service_pb2.GetClusterStatusRequest(), timeout=2, metadata=md(ADMIN_KEY)
                )
                peaks["queued"] = max(peaks["queued"], cs.queued_requests)
            except grpc.RpcError:
                pass
            time.sleep(0.01)
        for c in (*chans, gw):
            c.close()

    with grpc.insecure_channel(cluster.gateway) as ch:
        stub = inf_grpc.InferenceServiceStub(ch)
        burst(stub, 4)  # warm
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            at_capacity, overload = [], []
            for _ in range(2):  # interleaved, so drifting load on a shared machine hits both alike
                at_capacity += burst(stub, capacity)
                overload += burst(stub, 2 * capacity)
        finally:
            stop.set()
            sampler.join(10)
    base_ok = [lat for code, lat, _ in at_capacity if code == "OK"]
    over_ok = [lat for code, lat, _ in overload if code == "OK"]
    rejected = [r for r in overload if r[0] == "RESOURCE_EXHAUSTED"]
    other = sorted({r[0] for r in (*at_capacity, *overload)} - {"OK", "RESOURCE_EXHAUSTED"})
    p50_base, p50_over = statistics.median(base_ok), statistics.median(over_ok)
    ratio = p50_over / p50_base
    reject_ms = 1e3 * statistics.median(r[1] for r in rejected) if rejected else None
    with_retry = sum(1 for r in rejected if r[2])
    passed = (
        bool(rejected)
        and with_retry == len(rejected)
        and not other
        and ratio <= 2.0
        and peaks["worker_running"] <= MAX_BATCH
        and peaks["queued"] <= MAX_QUEUE
    )
    record(
        "overload",
        "admitted p50 latency at 2x capacity / at 1x capacity",
        round(ratio, 2),
        "<= 2.0; every rejection RESOURCE_EXHAUSTED + RetryInfo; running <= max batch",
        passed,
        capacity=capacity,
        sent_at_2x=len(overload),
        admitted_at_2x=len(over_ok),
        rejected_at_2x=len(rejected),
        rejected_with_retry_info=with_retry,
        rejected_at_1x=sum(1 for r in at_capacity if r[0] != "OK"),
        other_codes=other,
        p50_1x_ms=round(p50_base * 1e3),
        p50_2x_admitted_ms=round(p50_over * 1e3),
        p50_rejection_ms=reject_ms and round(reject_ms, 1),
        peak_worker_running=peaks["worker_running"],
        max_batch=MAX_BATCH,
        peak_queued=peaks["queued"],
        max_queue=MAX_QUEUE,
    )
    assert not other, other
    assert rejected and with_retry == len(rejected)
    assert peaks["worker_running"] <= MAX_BATCH and peaks["queued"] <= MAX_QUEUE, peaks
    # The latency ratio is the figure (recorded with its pass/fail above), not an assert: on a
    # shared 2-core CI machine it measures the neighbours as much as the scheduler.
