"""The generation runner's job handling against a real store (SQLite, real channel), with the
torch work replaced by a scripted `run`: progress reports reach the store, the result is
written on success, an exception fails the job with its text, and a job cancelled mid-run
stops at the runner's next report without being marked anything else."""

from __future__ import annotations

import pytest

from services.adapter_store.config import StoreSettings
from services.adapter_store.testing import RunningStore, write_tiny_model
from services.generator.runner import Runner, RunnerSettings
from valora.internal.v1 import adapter_store_service_pb2 as store_pb
from valora.v1 import admin_service_pb2 as admin_pb
from valora.v1 import resources_pb2 as res


@pytest.fixture
def rs(tmp_path):
    settings = StoreSettings(database_url=f"sqlite:///{tmp_path / 'r.db'}", blob_dir=str(tmp_path / "blobs"),
                             model_path=str(write_tiny_model(tmp_path / "tiny")), gc_interval_s=0, port=0)
    with RunningStore(settings) as store:
        yield store


def create(rs, job_id: str, *tasks: str):
    return rs.admin.CreateGenerationJob(admin_pb.CreateGenerationJobRequest(job_id=job_id, job=res.GenerationJob(
        base_model="/m", sources=[res.GenerationSource(task=t, accuracy_threshold=0.5) for t in tasks]))).job


def get(rs, name):
    return rs.admin.GetGenerationJob(admin_pb.GetGenerationJobRequest(name=name)).job


def runner(rs, run) -> Runner:
    return Runner(RunnerSettings(adapter_store_address=rs.address, runner_name="t", poll_s=0.01), run=run)


def test_success_writes_progress_and_result(rs):
    job = create(rs, "gen-ok", "digit", "parity")
    seen = []

    def run(j, report, admin_address, admin_key, threads, batch_size):
        assert j.name == job.name and admin_address == rs.address
        for i, s in enumerate(j.sources, 1):
            report(i / len(j.sources) * 0.8, f"fused {s.task}")
            seen.append(get(rs, j.name))
        return res.GenerationJobResult(adapter_versions=["adapters/gen-ok-0/versions/1"], tasks=[
            res.GenerationTaskResult(task="tasks/gen-ok-digit", adapter_version="adapters/gen-ok-0/versions/1",
                                     accuracy_threshold=0.5, measured_accuracy=0.9)])

    r = runner(rs, run)
    try:
        final = r.run_once()
        assert r.run_once() is None  # nothing else pending
    finally:
        r.close()
    assert [(round(j.progress, 2), j.message, j.state) for j in seen] == [
        (0.4, "fused digit", res.GENERATION_JOB_STATE_RUNNING), (0.8, "fused parity", res.GENERATION_JOB_STATE_RUNNING)]
    assert final.state == res.GENERATION_JOB_STATE_SUCCEEDED and final == get(rs, job.name)
    assert list(final.result.adapter_versions) == ["adapters/gen-ok-0/versions/1"]


def test_failure_is_recorded(rs):
    job = create(rs, "gen-bad", "digit")

    def run(j, report, *_):
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

    def run(j, report, *_):
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
