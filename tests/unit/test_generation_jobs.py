"""Generation jobs in the adapter store over a real channel (SQLite + local blobs): create
(idempotent by request_id), get, list with pagination, claim, progress, result, cancel, and the
errors each transition gives."""

from __future__ import annotations

import grpc
import pytest

from services.adapter_store.config import StoreSettings
from services.adapter_store.testing import RunningStore, write_tiny_model
from valora_protos.internal.v1 import adapter_store_service_pb2 as store_pb
from valora_protos.v1 import admin_service_pb2 as admin_pb
from valora_protos.v1 import resources_pb2 as res

PENDING, RUNNING = res.GENERATION_JOB_STATE_PENDING, res.GENERATION_JOB_STATE_RUNNING
SUCCEEDED, FAILED, CANCELLED = (
    res.GENERATION_JOB_STATE_SUCCEEDED,
    res.GENERATION_JOB_STATE_FAILED,
    res.GENERATION_JOB_STATE_CANCELLED,
)


@pytest.fixture
def rs(tmp_path):
    settings = StoreSettings(
        database_url=f"sqlite:///{tmp_path / 'r.db'}",
        blob_dir=str(tmp_path / "blobs"),
        model_path=str(write_tiny_model(tmp_path / "tiny")),
        gc_interval_s=0,
        port=0,
    )
    with RunningStore(settings) as store:
        yield store


def job(*sources: tuple[str, float], **kw) -> res.GenerationJob:
    return res.GenerationJob(
        base_model="/models/tiny",
        rank=kw.pop("rank", 4),
        epochs=1,
        sources=[res.GenerationSource(task=t, accuracy_threshold=a) for t, a in sources],
        **kw,
    )


def create(rs, job_id="", request_id="", j=None):
    return rs.admin.CreateGenerationJob(
        admin_pb.CreateGenerationJobRequest(job_id=job_id, job=j or job(("digit", 0.8)), request_id=request_id)
    ).job


def claim(rs, runner="r"):
    """The claim response (job, lease_id, lease_duration, attempt, max_attempts)."""
    return rs.store.ClaimGenerationJob(store_pb.ClaimGenerationJobRequest(runner=runner))


def update(rs, name, lease_id, **kw):
    return rs.store.UpdateGenerationJob(store_pb.UpdateGenerationJobRequest(name=name, lease_id=lease_id, **kw)).job


def code_of(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code(), info.value.details()


def test_create_is_pending_and_idempotent_by_request_id(rs):
    first = create(rs, "gen-a", request_id="r-1", j=job(("digit", 0.8), ("parity", 0.9)))
    assert first.name == "generationJobs/gen-a" and first.state == PENDING and first.progress == 0
    assert [(s.task, round(s.accuracy_threshold, 3)) for s in first.sources] == [("digit", 0.8), ("parity", 0.9)]
    assert (first.rank, first.epochs, first.base_model) == (4, 1, "/models/tiny")
    assert first.create_time.seconds > 0
    again = create(rs, "gen-a", request_id="r-1")
    assert again == first
    # without a job id the store names the job, and a retry still finds it
    auto = create(rs, request_id="r-2")
    assert auto.name.startswith("generationJobs/gen-") and create(rs, request_id="r-2").name == auto.name
    assert code_of(lambda: create(rs, "gen-a"))[0] == grpc.StatusCode.ALREADY_EXISTS
    assert code_of(lambda: create(rs, "gen-b", request_id="r-1"))[0] == grpc.StatusCode.FAILED_PRECONDITION
    assert rs.admin.GetGenerationJob(admin_pb.GetGenerationJobRequest(name=first.name)).job == first


@pytest.mark.parametrize(
    "bad, field",
    [
        (job(), "job.sources"),
        (job(("digit", 1.5)), "job.sources[0].accuracy_threshold"),
        (job(("digit", 0.5), ("digit", 0.6)), "job.sources[1].task"),
        (job(("Bad Task", 0.5)), "job.sources[0].task"),
        (res.GenerationJob(sources=[res.GenerationSource(task="digit")]), "job.base_model"),
        (job(("digit", 0.5), rank=100000), "job.rank"),
    ],
)
def test_create_rejects_bad_specs(rs, bad, field):
    code, details = code_of(lambda: create(rs, "gen-x", j=bad))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and field.split("[")[0] in details


def test_get_unknown_and_malformed_names(rs):
    assert (
        code_of(lambda: rs.admin.GetGenerationJob(admin_pb.GetGenerationJobRequest(name="generationJobs/nope")))[0]
        == grpc.StatusCode.NOT_FOUND
    )
    assert (
        code_of(lambda: rs.admin.GetGenerationJob(admin_pb.GetGenerationJobRequest(name="jobs/nope")))[0]
        == grpc.StatusCode.INVALID_ARGUMENT
    )


def test_claim_progress_result(rs):
    nothing = claim(rs, "r1")
    assert not nothing.HasField("job") and not nothing.lease_id and not nothing.attempt
    a, b = create(rs, "gen-a"), create(rs, "gen-b")
    first = claim(rs, "r1")
    claimed, lease_a = first.job, first.lease_id
    assert claimed.name == a.name and claimed.state == RUNNING and "r1" in claimed.message
    assert (first.attempt, first.max_attempts) == (1, 3) and first.lease_duration.seconds == 60 and lease_a
    second = claim(rs, "r2")
    assert second.job.name == b.name and second.lease_id != lease_a  # never the same job twice
    assert not claim(rs, "r3").HasField("job")

    j = update(rs, a.name, lease_a, state=RUNNING, progress=0.5, message="fused digit")
    assert (j.state, round(j.progress, 3), j.message) == (RUNNING, 0.5, "fused digit")
    assert (
        code_of(lambda: update(rs, a.name, lease_a, state=RUNNING, progress=2.0))[0] == grpc.StatusCode.INVALID_ARGUMENT
    )
    assert code_of(lambda: update(rs, a.name, lease_a, state=CANCELLED))[0] == grpc.StatusCode.INVALID_ARGUMENT
    # the lease is required, and only the claim's own lease is accepted
    code, details = code_of(lambda: update(rs, a.name, "", state=RUNNING, progress=0.6))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "lease_id" in details
    code, details = code_of(lambda: update(rs, a.name, second.lease_id, state=RUNNING, progress=0.9, message="x"))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "no longer held" in details
    got = rs.admin.GetGenerationJob(admin_pb.GetGenerationJobRequest(name=a.name)).job
    assert (round(got.progress, 3), got.message) == (0.5, "fused digit")
    result = res.GenerationJobResult(
        adapter_versions=["adapters/gen-a-0/versions/1"],
        tasks=[
            res.GenerationTaskResult(
                task="tasks/digit",
                adapter_version="adapters/gen-a-0/versions/1",
                accuracy_threshold=0.8,
                measured_accuracy=0.93,
            )
        ],
    )
    done = update(rs, a.name, lease_a, state=SUCCEEDED, message="done", result=result)
    assert done.state == SUCCEEDED and done.progress == 1.0 and done.result == result
    got = rs.admin.GetGenerationJob(admin_pb.GetGenerationJobRequest(name=a.name)).job
    assert got == done and got.update_time.ToDatetime() >= got.create_time.ToDatetime()
    # a finished job takes no more updates and cannot be cancelled
    assert (
        code_of(lambda: update(rs, a.name, lease_a, state=RUNNING, progress=0.9))[0]
        == grpc.StatusCode.FAILED_PRECONDITION
    )
    assert (
        code_of(lambda: rs.admin.CancelGenerationJob(admin_pb.CancelGenerationJobRequest(name=a.name)))[0]
        == grpc.StatusCode.FAILED_PRECONDITION
    )

    failed = update(rs, b.name, second.lease_id, state=FAILED, progress=0.3, message="failed", error="unknown task 'x'")
    assert failed.state == FAILED and failed.error == "unknown task 'x'" and round(failed.progress, 3) == 0.3


def test_cancel_pending_and_running(rs):
    pending, running = create(rs, "gen-p"), create(rs, "gen-r")
    cancelled = rs.admin.CancelGenerationJob(admin_pb.CancelGenerationJobRequest(name=pending.name)).job
    assert cancelled.state == CANCELLED
    # a cancelled PENDING job is never claimed
    claimed = claim(rs)
    assert claimed.job.name == running.name
    rs.admin.CancelGenerationJob(admin_pb.CancelGenerationJobRequest(name=running.name))
    # the runner learns at its next report, and cancelling again is a no-op
    code, details = code_of(lambda: update(rs, running.name, claimed.lease_id, state=RUNNING, progress=0.5))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "CANCELLED" in details
    again = rs.admin.CancelGenerationJob(admin_pb.CancelGenerationJobRequest(name=running.name)).job
    assert again.state == CANCELLED


def test_list_newest_first_with_pagination(rs):
    made = [create(rs, f"gen-{i}").name for i in range(5)]
    seen, token, pages = [], "", 0
    while True:
        r = rs.admin.ListGenerationJobs(admin_pb.ListGenerationJobsRequest(page_size=2, page_token=token))
        seen += [j.name for j in r.jobs]
        pages += 1
        token = r.next_page_token
        if not token:
            break
    assert pages == 3 and sorted(seen) == sorted(made) and len(set(seen)) == 5
    times = [
        (j.create_time.ToDatetime(), j.name)
        for j in rs.admin.ListGenerationJobs(admin_pb.ListGenerationJobsRequest()).jobs
    ]
    assert times == sorted(times, reverse=True)
    assert (
        code_of(lambda: rs.admin.ListGenerationJobs(admin_pb.ListGenerationJobsRequest(page_token="garbage")))[0]
        == grpc.StatusCode.INVALID_ARGUMENT
    )
