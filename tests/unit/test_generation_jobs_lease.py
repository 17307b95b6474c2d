"""Generation job leases in the store (services/adapter_store/jobs.py), on SQLite and on
PostgreSQL (skipped when unreachable), with a hand-driven clock: a claim holds for lease_s and
each update renews it; a lapsed lease is requeued (PENDING, progress 0) and claimed again as a
new attempt, and after max_attempts lost claims the job ends FAILED with the reason; an update
carrying a lost lease is refused (LEASE_LOST) and changes nothing."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta

import pytest
from sqlalchemy import update

from services.adapter_store import db
from services.adapter_store.jobs import GenerationJobs, JobResult, JobSource, JobSpec
from services.adapter_store.models import GenerationJobRow
from services.common.errors import FailedPrecondition, InvalidArgument

SPEC = JobSpec("/models/tiny", (JobSource("digit", 0.8),), rank=4, epochs=1)
T0 = datetime(2026, 11, 30, 12, 0, 0)


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


def _postgres_url():
    psycopg = pytest.importorskip("psycopg")
    for user in ("postgres", "root"):
        try:
            conn = psycopg.connect(
                f"host=127.0.0.1 port=5432 dbname=test user={user}", autocommit=True, connect_timeout=3
            )
        except psycopg.OperationalError:
            continue
        name = f"valora_lease_test_{uuid.uuid4().hex[:12]}"
        conn.execute(f'CREATE DATABASE "{name}"')
        return conn, name, f"postgresql+psycopg://{user}@127.0.0.1:5432/{name}"
    pytest.skip("PostgreSQL not reachable at 127.0.0.1:5432")


@pytest.fixture(params=["sqlite", "postgresql"])
def sessions(request, tmp_path):
    admin = name = None
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'jobs.db'}"
    else:
        admin, name, url = _postgres_url()
    engine = db.make_engine(url)
    try:
        db.upgrade(engine)
        yield db.make_sessionmaker(engine)
    finally:
        engine.dispose()
        if admin is not None:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            admin.close()


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def jobs(sessions, clock):
    return GenerationJobs(sessions, lease_s=30.0, max_attempts=3, clock=clock)


def reason_of(fn) -> tuple[str, str]:
    with pytest.raises(FailedPrecondition) as info:
        fn()
    return info.value.reason, info.value.message


def test_a_claim_holds_while_renewed(jobs, clock):
    jobs.create("gen-a", SPEC, None)
    c = jobs.claim("r1")
    assert (c.job.id, c.attempt, c.max_attempts, c.lease_s) == ("gen-a", 1, 3, 30.0)
    assert c.job.runner == "r1" and c.job.lease_expire_time == T0 + timedelta(seconds=30)
    for _ in range(4):  # 80 s in all, never 30 s without an update
        clock.advance(20)
        j = jobs.update("gen-a", c.lease_id, "RUNNING", 0.5, "training")
        assert j.lease_expire_time == clock.now + timedelta(seconds=30)
        assert jobs.claim("r2") is None and jobs.requeue_expired() == []
    done = jobs.update("gen-a", c.lease_id, "SUCCEEDED", 1.0, "done", JobResult(("adapters/a/versions/1",)))
    assert done.state == "SUCCEEDED" and done.lease_expire_time is None and done.attempts == 1
    clock.advance(3600)
    assert jobs.requeue_expired() == [] and jobs.get("gen-a").state == "SUCCEEDED"


def test_a_lapsed_lease_is_requeued_and_claimed_again(jobs, clock):
    jobs.create("gen-a", SPEC, None)
    first = jobs.claim("r1")
    jobs.update("gen-a", first.lease_id, "RUNNING", 0.4, "fused digit")
    clock.advance(29)
    assert jobs.claim("r2") is None  # still r1's
    clock.advance(2)
    [requeued] = jobs.requeue_expired()
    assert requeued.state == "PENDING" and requeued.progress == 0.0 and requeued.lease_expire_time is None
    assert "r1 stopped reporting" in requeued.message and "attempt 1 of 3" in requeued.message

    second = jobs.claim("r2")
    assert second.job.id == "gen-a" and second.attempt == 2 and second.lease_id != first.lease_id
    assert second.job.state == "RUNNING" and "attempt 2 of 3" in second.job.message
    j = jobs.update("gen-a", second.lease_id, "RUNNING", 0.2, "r2 fusing")

    # r1 comes back: refused, and nothing changes
    reason, message = reason_of(lambda: jobs.update("gen-a", first.lease_id, "RUNNING", 0.9, "r1 late"))
    assert reason == "LEASE_LOST" and "claimed again by r2 (attempt 2)" in message
    reason, _ = reason_of(
        lambda: jobs.update(
            "gen-a", first.lease_id, "SUCCEEDED", 1.0, "r1 done", JobResult(("adapters/stale/versions/1",))
        )
    )
    assert reason == "LEASE_LOST"
    after = jobs.get("gen-a")
    assert (after.state, after.progress, after.message, after.result, after.runner) == (
        "RUNNING",
        j.progress,
        "r2 fusing",
        JobResult(),
        "r2",
    )
    assert after.update_time == j.update_time

    done = jobs.update("gen-a", second.lease_id, "SUCCEEDED", 1.0, "done", JobResult(("adapters/a/versions/1",)))
    assert done.state == "SUCCEEDED" and done.attempts == 2


def test_claim_itself_requeues_without_the_sweep(jobs, clock):
    jobs.create("gen-a", SPEC, None)
    jobs.claim("r1")
    clock.advance(31)
    c = jobs.claim("r2")
    assert c is not None and c.job.id == "gen-a" and c.attempt == 2


def test_a_late_update_before_anyone_took_over_still_counts(jobs, clock):
    jobs.create("gen-a", SPEC, None)
    c = jobs.claim("r1")
    clock.advance(45)  # lapsed, but no claim or sweep ran
    j = jobs.update("gen-a", c.lease_id, "RUNNING", 0.5, "slow step done")
    assert j.state == "RUNNING" and j.lease_expire_time == clock.now + timedelta(seconds=30)
    assert jobs.claim("r2") is None


def test_an_update_after_the_requeue_is_refused(jobs, clock):
    jobs.create("gen-a", SPEC, None)
    c = jobs.claim("r1")
    clock.advance(31)
    jobs.requeue_expired()
    reason, message = reason_of(lambda: jobs.update("gen-a", c.lease_id, "RUNNING", 0.5, "late"))
    assert reason == "LEASE_LOST" and "PENDING" in message
    assert jobs.get("gen-a").state == "PENDING"


def test_after_max_attempts_the_job_fails_with_the_reason(jobs, clock):
    jobs.create("gen-a", SPEC, None)
    for attempt in (1, 2, 3):
        c = jobs.claim(f"r{attempt}")
        assert c.attempt == attempt
        jobs.update("gen-a", c.lease_id, "RUNNING", 0.3, f"step of r{attempt}")
        clock.advance(31)
    [failed] = jobs.requeue_expired()
    assert failed.state == "FAILED" and failed.attempts == 3
    assert "gave up after 3 attempts" in failed.error and "r3" in failed.error and "step of r3" in failed.error
    assert jobs.claim("r4") is None
    assert reason_of(lambda: jobs.update("gen-a", c.lease_id, "RUNNING", 0.5, "late"))[0] == "LEASE_LOST"


def test_cancel_of_a_held_job_tells_its_runner(jobs, clock):
    jobs.create("gen-a", SPEC, None)
    c = jobs.claim("r1")
    cancelled = jobs.cancel("gen-a")
    assert cancelled.state == "CANCELLED" and cancelled.lease_expire_time is None
    reason, message = reason_of(lambda: jobs.update("gen-a", c.lease_id, "RUNNING", 0.5, "x"))
    assert reason == "JOB_NOT_RUNNING" and "CANCELLED" in message
    clock.advance(3600)
    assert jobs.requeue_expired() == [] and jobs.get("gen-a").state == "CANCELLED"


def test_a_runner_that_stops_hands_the_job_back_without_spending_an_attempt(jobs, clock):
    jobs.create("gen-a", SPEC, None)
    c = jobs.claim("r1")
    jobs.update("gen-a", c.lease_id, "RUNNING", 0.6, "fusing")
    back = jobs.update("gen-a", c.lease_id, "PENDING", 0.0, "handed back by r1 (stopping)")
    assert (back.state, back.progress, back.attempts, back.lease_expire_time) == ("PENDING", 0.0, 0, None)
    assert reason_of(lambda: jobs.update("gen-a", c.lease_id, "RUNNING", 0.7, "x"))[0] == "LEASE_LOST"
    again = jobs.claim("r2")
    assert again.attempt == 1 and again.job.message == "claimed by r2"
    with pytest.raises(InvalidArgument):
        jobs.update("gen-a", again.lease_id, "CANCELLED", 0.0, "")


def test_the_lease_is_required(jobs):
    jobs.create("gen-a", SPEC, None)
    jobs.claim("r1")
    with pytest.raises(InvalidArgument):
        jobs.update("gen-a", "", "RUNNING", 0.5, "x")


def test_a_running_job_from_before_leases_is_requeued(jobs, sessions):
    """A RUNNING row migrated from revision 0002 has no lease: it counts as lapsed."""
    jobs.create("gen-old", SPEC, None)
    with sessions.begin() as s:
        s.execute(
            update(GenerationJobRow)
            .where(GenerationJobRow.id == "gen-old")
            .values(state="RUNNING", runner="old-runner", lease_id="", lease_expires_at=None, attempts=1)
        )
    [requeued] = jobs.requeue_expired()
    assert requeued.state == "PENDING" and "old-runner" in requeued.message
    assert jobs.claim("r1").attempt == 2


def test_a_renewal_racing_the_sweep_keeps_the_job(jobs, sessions, clock):
    """The requeue is a compare-and-set on the lease it saw lapse: a renewal that lands between
    the sweep's read and its write wins."""
    jobs.create("gen-a", SPEC, None)
    c = jobs.claim("r1")
    clock.advance(31)
    real_begin = sessions.begin
    calls = []

    def begin():
        calls.append(1)
        if len(calls) == 2:  # after the sweep's read, before its write
            jobs.update("gen-a", c.lease_id, "RUNNING", 0.5, "renewed just in time")
        return real_begin()

    sessions.begin = begin
    try:
        assert jobs.requeue_expired() == []
    finally:
        sessions.begin = real_begin
    j = jobs.get("gen-a")
    assert j.state == "RUNNING" and j.message == "renewed just in time"
