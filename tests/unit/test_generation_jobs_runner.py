"""The generation runner's job handling against a real store (SQLite, real channel), with the
torch work replaced by a scripted `run`: progress reports reach the store, the result is
written on success, an exception fails the job with its text, and a job cancelled mid-run
stops at the runner's next report without being marked anything else.

Leases (a store with a 1 s lease): the heartbeat holds a job through a step longer than the
lease; a runner process killed mid-job loses the job to another runner once its lease lapses,
and the dead runner's late update is refused (LEASE_LOST) without changing the job; a runner
whose lease lapsed and was taken over stops at its next report; a cancel seen by the heartbeat
stops a long step at the next training step; a retry re-registers what a lost attempt left."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from services.adapter_store.config import StoreSettings
from services.adapter_store.testing import RunningStore, adapter_config, make_bundle, write_tiny_model
from services.common.errors import from_rpc_error
from services.generator.bundle import Bundle
from services.generator.runner import Runner, RunnerSettings, register
from valora.client import ValoraClient
from valora_protos.internal.v1 import adapter_store_service_pb2 as store_pb
from valora_protos.v1 import admin_service_pb2 as admin_pb
from valora_protos.v1 import resources_pb2 as res

ROOT = Path(__file__).resolve().parents[2]
LEASE_S = 1.0
RUNNING, SUCCEEDED = res.GENERATION_JOB_STATE_RUNNING, res.GENERATION_JOB_STATE_SUCCEEDED


def _store(tmp_path, **kw):
    return RunningStore(
        StoreSettings(
            database_url=f"sqlite:///{tmp_path / 'r.db'}",
            blob_dir=str(tmp_path / "blobs"),
            model_path=str(write_tiny_model(tmp_path / "tiny")),
            gc_interval_s=0,
            port=0,
            **kw,
        )
    )


@pytest.fixture
def rs(tmp_path):
    with _store(tmp_path) as store:
        yield store


@pytest.fixture
def short(tmp_path):
    """A store whose claims hold for LEASE_S and whose sweep runs every 0.2 s."""
    with _store(tmp_path, job_lease_s=LEASE_S, job_sweep_interval_s=0.2) as store:
        yield store


def create(rs, job_id: str, *tasks: str):
    return rs.admin.CreateGenerationJob(
        admin_pb.CreateGenerationJobRequest(
            job_id=job_id,
            job=res.GenerationJob(
                base_model="/m", sources=[res.GenerationSource(task=t, accuracy_threshold=0.5) for t in tasks]
            ),
        )
    ).job


def get(rs, name):
    return rs.admin.GetGenerationJob(admin_pb.GetGenerationJobRequest(name=name)).job


def runner(rs, run, name="t", **kw) -> Runner:
    return Runner(RunnerSettings(adapter_store_address=rs.address, runner_name=name, poll_s=0.01, **kw), run=run)


def probe_claim(rs) -> bool:
    """Whether another runner could claim a job now."""
    return rs.store.ClaimGenerationJob(store_pb.ClaimGenerationJobRequest(runner="probe")).HasField("job")


def test_success_writes_progress_and_result(rs):
    job = create(rs, "gen-ok", "digit", "parity")
    seen = []

    def run(j, report, admin_address, admin_key, threads, batch_size, **_):
        assert j.name == job.name and admin_address == rs.address
        for i, s in enumerate(j.sources, 1):
            report(i / len(j.sources) * 0.8, f"fused {s.task}")
            seen.append(get(rs, j.name))
        return res.GenerationJobResult(
            adapter_versions=["adapters/gen-ok-0/versions/1"],
            tasks=[
                res.GenerationTaskResult(
                    task="tasks/gen-ok-digit",
                    adapter_version="adapters/gen-ok-0/versions/1",
                    accuracy_threshold=0.5,
                    measured_accuracy=0.9,
                )
            ],
        )

    r = runner(rs, run)
    try:
        final = r.run_once()
        assert r.run_once() is None  # nothing else pending
    finally:
        r.close()
    assert [(round(j.progress, 2), j.message, j.state) for j in seen] == [
        (0.4, "fused digit", res.GENERATION_JOB_STATE_RUNNING),
        (0.8, "fused parity", res.GENERATION_JOB_STATE_RUNNING),
    ]
    assert final.state == res.GENERATION_JOB_STATE_SUCCEEDED and final == get(rs, job.name)
    assert list(final.result.adapter_versions) == ["adapters/gen-ok-0/versions/1"]


def test_failure_is_recorded(rs):
    job = create(rs, "gen-bad", "digit")

    def run(j, report, *_, **__):
        raise ValueError("unknown tasks ['nope']")

    r = runner(rs, run)
    try:
        r.run_once()
    finally:
        r.close()
    got = get(rs, job.name)
    assert got.state == res.GENERATION_JOB_STATE_FAILED and "unknown tasks" in got.error


def test_cancel_stops_the_job_between_steps(rs):
    job = create(rs, "gen-cancel", "digit", "parity", "ge5")
    steps = []

    def run(j, report, *_, **__):
        for i, s in enumerate(j.sources):
            report(i / 3, f"fusing {s.task}")
            steps.append(s.task)
            if i == 0:
                rs.admin.CancelGenerationJob(admin_pb.CancelGenerationJobRequest(name=j.name))
        raise AssertionError("the runner should have stopped")

    r = runner(rs, run)
    try:
        assert r.run_once() is None
    finally:
        r.close()
    assert steps == ["digit"]
    got = get(rs, job.name)
    assert got.state == res.GENERATION_JOB_STATE_CANCELLED and not got.error
    # nothing left to claim
    assert not rs.store.ClaimGenerationJob(store_pb.ClaimGenerationJobRequest(runner="x")).HasField("job")


def test_the_heartbeat_holds_the_job_through_a_long_step(short):
    job = create(short, "gen-long", "digit")
    probes = []

    def run(j, report, *_, **__):
        report(0.1, "one long step")
        for _ in range(3):  # 3 leases without a report of its own
            time.sleep(LEASE_S)
            probes.append((probe_claim(short), get(short, j.name).state))
        return res.GenerationJobResult()

    r = runner(short, run)
    try:
        final = r.run_once()
    finally:
        r.close()
    assert probes == [(False, RUNNING)] * 3
    assert final.state == SUCCEEDED and get(short, job.name).state == SUCCEEDED


DOOMED = """
import sys, time
from services.generator.runner import Runner, RunnerSettings

def run(job, report, *_, **__):
    report(0.3, "step 1 of many")
    print(f"LEASE {report.lease_id} ATTEMPT {report.attempt}", flush=True)
    while True:  # a long step: only the heartbeat reports
        time.sleep(1)

Runner(RunnerSettings(adapter_store_address=sys.argv[1], runner_name="doomed", poll_s=0.05), run=run).run_once()
"""


def test_a_killed_runner_process_loses_the_job_to_another_runner(short, tmp_path):
    job = create(short, "gen-kill", "digit", "parity")
    out = tmp_path / "doomed.log"
    with out.open("w") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-c", DOOMED, short.address], cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT
        )
    try:
        deadline, m = time.monotonic() + 60, None
        while m is None and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
            m = re.search(r"^LEASE (\w+) ATTEMPT (\d+)$", out.read_text(), re.MULTILINE)
        assert m, out.read_text()
        old_lease = m.group(1)
        assert m.group(2) == "1"
        # alive, the runner holds the job across several leases
        time.sleep(3 * LEASE_S)
        held = get(short, job.name)
        assert held.state == RUNNING and held.message == "step 1 of many" and round(held.progress, 2) == 0.3
        assert not probe_claim(short)
    finally:
        proc.kill()
        proc.wait(10)

    seen = {}

    def run(j, report, *_, **__):
        seen.update(attempt=report.attempt, state=get(short, j.name))
        report(0.5, "second runner halfway")
        return res.GenerationJobResult(adapter_versions=["adapters/gen-kill-0/versions/1"])

    other = runner(short, run, name="survivor")
    try:
        final, deadline = None, time.monotonic() + 10 * LEASE_S
        while final is None and time.monotonic() < deadline:
            final = other.run_once()
            time.sleep(0.05)
    finally:
        other.close()
    assert final is not None, get(short, job.name)
    assert final.state == SUCCEEDED and list(final.result.adapter_versions) == ["adapters/gen-kill-0/versions/1"]
    assert seen["attempt"] == 2 and "claimed by survivor (attempt 2 of 3)" in seen["state"].message
    assert round(seen["state"].progress, 2) == 0.0  # the retry starts over

    # the dead runner's late report is refused and changes nothing
    with pytest.raises(grpc.RpcError) as info:
        short.store.UpdateGenerationJob(
            store_pb.UpdateGenerationJobRequest(
                name=job.name, lease_id=old_lease, state=RUNNING, progress=0.9, message="zombie"
            )
        )
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert from_rpc_error(info.value).reason == "LEASE_LOST"
    assert get(short, job.name) == final


def test_a_runner_whose_lease_was_taken_over_stops_there(short):
    job = create(short, "gen-lost", "digit")
    taken = {}

    def run(j, report, *_, **__):
        report(0.2, "a: starting")
        time.sleep(1.5 * LEASE_S)  # no heartbeat (heartbeat_s below): the lease lapses
        taken["b"] = short.store.ClaimGenerationJob(store_pb.ClaimGenerationJobRequest(runner="b"))
        report(0.8, "a: late")
        raise AssertionError("the late report should have stopped the runner")

    a = runner(short, run, name="a", heartbeat_s=3600)
    try:
        assert a.run_once() is None
    finally:
        a.close()
    assert taken["b"].job.name == job.name and taken["b"].attempt == 2
    got = get(short, job.name)
    assert got.state == RUNNING and got.message == "claimed by b (attempt 2 of 3)" and got.progress == 0.0


def test_a_cancel_seen_by_the_heartbeat_stops_a_long_step(short):
    job = create(short, "gen-stop", "digit")
    steps = []

    def run(j, report, *_, **__):
        report(0.1, "training")
        short.admin.CancelGenerationJob(admin_pb.CancelGenerationJobRequest(name=j.name))
        deadline = time.monotonic() + 5 * LEASE_S
        while time.monotonic() < deadline:
            report.check()  # what the trainer's progress callback does every step
            steps.append(1)
            time.sleep(0.01)
        raise AssertionError("the heartbeat should have stopped the step")

    r = runner(short, run)
    started = time.monotonic()
    try:
        assert r.run_once() is None
    finally:
        r.close()
    assert steps and time.monotonic() - started < 2 * LEASE_S
    got = get(short, job.name)
    assert got.state == res.GENERATION_JOB_STATE_CANCELLED and not got.error


def test_a_stopping_runner_hands_its_job_back(short):
    import threading

    job = create(short, "gen-back", "digit")
    holder = []

    def run(j, report, *_, **__):
        report(0.4, "training")
        threading.Timer(0.2, holder[0].stop).start()  # SIGTERM arrives mid-step
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            report.check()
            time.sleep(0.01)
        raise AssertionError("stop() should have stopped the step")

    r = runner(short, run, name="leaving")
    holder.append(r)
    try:
        assert r.run_once() is None
        r.serve_forever()  # returns at once: the runner is stopping
    finally:
        r.close()
    back = get(short, job.name)
    assert back.state == res.GENERATION_JOB_STATE_PENDING and back.progress == 0.0
    assert back.message.startswith("handed back by leaving (stopping)")
    again = short.store.ClaimGenerationJob(store_pb.ClaimGenerationJobRequest(runner="next"))
    assert again.job.name == job.name and again.attempt == 1  # the handed-back claim did not count


def _bundle(seed: int) -> Bundle:
    return Bundle(
        "gen-r-0",
        make_bundle(rank=4, heads={"digit": 10}, seed=seed),
        adapter_config(rank=4),
        {"digit": list("0123456789")},
    )


RESULT = SimpleNamespace(tasks={"digit": {"threshold": 0.5, "accuracy": 0.9}})
PROMPTS = {"digit": "Which digit?"}


def test_a_retry_reuses_or_replaces_what_a_lost_attempt_registered(rs):
    first = register(rs.address, "gen-r", "gen-r", [_bundle(0)], RESULT, PROMPTS, attempt=1)
    assert list(first.adapter_versions) == ["adapters/gen-r-0/versions/1"]
    # the same bytes again (seeded training): the same version and task
    same = register(rs.address, "gen-r", "gen-r", [_bundle(0)], RESULT, PROMPTS, attempt=2)
    assert same == first
    # different bytes in a first attempt are a conflict, as before
    with pytest.raises(grpc.RpcError) as info:
        register(rs.address, "gen-r", "gen-r", [_bundle(1)], RESULT, PROMPTS, attempt=1)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # ... but a retry registers them under its own request id and moves the job's task
    retry = register(rs.address, "gen-r", "gen-r", [_bundle(1)], RESULT, PROMPTS, attempt=3)
    assert list(retry.adapter_versions) == ["adapters/gen-r-0/versions/2"]
    assert retry.tasks[0].task == "tasks/gen-r-digit" and retry.tasks[0].adapter_version == retry.adapter_versions[0]
    with ValoraClient(rs.address) as client:
        assert client.get_task("gen-r-digit").adapter == "adapters/gen-r-0/versions/2"
        # a task of the same name that this job did not create is left alone
        client.create_task(
            "gen-s-digit", adapter="adapters/gen-r-0/versions/1", head="digit", description="made by hand"
        )
    with pytest.raises(grpc.RpcError) as info:
        register(rs.address, "gen-s", "gen-s", [_bundle(2)], RESULT, PROMPTS, attempt=2)
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
