"""Generation jobs: the one owner of their state machine

    PENDING --claim--> RUNNING --finish--> SUCCEEDED | FAILED
    PENDING | RUNNING --cancel--> CANCELLED
    RUNNING --lease expired--> PENDING (attempts < max_attempts) | FAILED (attempts == max_attempts)
    RUNNING --handed back by its runner (shutting down)--> PENDING (the attempt does not count)

Admins create, read, list and cancel jobs (AdminService); generator runners claim the oldest
PENDING job and report progress and the outcome (AdapterStoreService).

A claim is a lease: it gets a fresh lease_id, counts one attempt and holds for `lease_s`; every
update carrying that lease_id renews it (runners also heartbeat while a long step runs). A
RUNNING job whose lease lapsed (its runner died or lost the store) is requeued: PENDING again,
progress reset, so the next claim starts it over, or FAILED once `max_attempts` claims were
lost. `requeue_expired()` does this; every claim runs it first, and the server runs it on a
timer so the state shows without a runner polling. A lapsed lease that nobody took over yet
is still the runner's: its next update is accepted and renews it.

An update must carry the lease_id of the job's current claim; a late update from a runner whose
lease was lost (requeued, or claimed again by another runner) fails with LEASE_LOST, one for a
job that is no longer RUNNING (cancelled meanwhile) with JOB_NOT_RUNNING; both are
FAILED_PRECONDITION, change nothing, and are how a runner learns to stop. Every method blocks;
the servicer runs them in an executor. Inputs and outputs are the domain objects below, never
protobuf.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from services.common import names
from services.common.errors import AlreadyExists, FailedPrecondition, NotFound, invalid_field

from services.adapter_store.domain import Page, PageRequest, page_token
from services.adapter_store.models import GenerationJobRow, GenerationJobState, utcnow

_JOB = re.compile(rf"^generationJobs/(?P<job>{names.ID_RE})$")
FINISHED = (GenerationJobState.SUCCEEDED, GenerationJobState.FAILED, GenerationJobState.CANCELLED)


def job_name(job_id: str) -> str:
    return f"generationJobs/{job_id}"


def parse_job_name(value: str, field_path: str = "name") -> str:
    m = _JOB.fullmatch(value or "")
    if m is None:
        raise invalid_field(field_path, f"{value!r} is not a generation job name (generationJobs/{{job}})")
    return m.group("job")


@dataclass(frozen=True)
class JobSource:
    task: str
    accuracy_threshold: float
    dataset: str = ""  # "datasets/{sha256}" of an uploaded dataset holding the task; "": built-in


_DATASET = re.compile(r"^datasets/(?P<sha256>[0-9a-f]{64})$")


def dataset_name(sha256: str) -> str:
    return f"datasets/{sha256}"


def parse_dataset_name(value: str, field_path: str = "name") -> str:
    """The sha256 of "datasets/{sha256}"."""
    m = _DATASET.fullmatch(value or "")
    if m is None:
        raise invalid_field(field_path, f"{value!r} is not a dataset name (datasets/{{sha256}}, lowercase hex)")
    return m.group("sha256")


def datasets_of(spec_json: str) -> set[str]:
    """The sha256 of every dataset a stored job spec names."""
    return {
        s["dataset"].removeprefix("datasets/")
        for s in json.loads(spec_json or "{}").get("sources", [])
        if s.get("dataset")
    }


# A job's fusion orders (the runner's services/generator/fusion.py FUSION_ORDERS; "" means given).
FUSION_ORDERS = ("", "given", "probed")


@dataclass(frozen=True)
class JobSpec:
    """What to generate (the job's input, stored as spec_json)."""

    base_model: str
    sources: tuple[JobSource, ...]
    rank: int = 8
    epochs: int = 4
    adapter_prefix: str = ""
    split_limit: int = 0
    fusion_order: str = "given"  # "given" | "probed" (services/generator/fusion.py)

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "sources": [asdict(s) for s in self.sources]})

    @classmethod
    def from_json(cls, text: str) -> "JobSpec":
        d = json.loads(text or "{}")
        return cls(
            d.get("base_model", ""),
            tuple(JobSource(**s) for s in d.get("sources", [])),
            d.get("rank", 8),
            d.get("epochs", 4),
            d.get("adapter_prefix", ""),
            d.get("split_limit", 0),
            d.get("fusion_order", "given"),
        )


@dataclass(frozen=True)
class TaskOutcome:
    task: str  # "tasks/{task}"
    adapter_version: str
    accuracy_threshold: float
    measured_accuracy: float


@dataclass(frozen=True)
class JobResult:
    adapter_versions: tuple[str, ...] = ()
    tasks: tuple[TaskOutcome, ...] = ()
    fused_order: tuple[str, ...] = ()  # the sources' tasks in the order they were fused
    # A probed order's interference probes, as valora.v1.GenerationProbe's JSON (convert.py);
    # empty for the given order. Kept as the runner reported it: the store only stores it.
    probe: dict = field(default_factory=dict, hash=False, compare=True)

    def to_json(self) -> str:
        return json.dumps(
            {
                "adapter_versions": list(self.adapter_versions),
                "tasks": [asdict(t) for t in self.tasks],
                "fused_order": list(self.fused_order),
                **({"probe": self.probe} if self.probe else {}),
            }
        )

    @classmethod
    def from_json(cls, text: str) -> "JobResult":
        d = json.loads(text or "{}")
        return cls(
            tuple(d.get("adapter_versions", [])),
            tuple(TaskOutcome(**t) for t in d.get("tasks", [])),
            tuple(d.get("fused_order", [])),
            d.get("probe", {}),
        )


@dataclass(frozen=True)
class Job:
    id: str
    spec: JobSpec
    state: str  # GenerationJobState value
    progress: float = 0.0
    message: str = ""
    result: JobResult = field(default_factory=JobResult)
    error: str = ""
    create_time: datetime | None = None
    update_time: datetime | None = None
    runner: str = ""  # who holds (or last held) the job
    attempts: int = 0  # claims so far
    lease_expire_time: datetime | None = None  # set while RUNNING

    @property
    def name(self) -> str:
        return job_name(self.id)


@dataclass(frozen=True)
class Claim:
    """A claimed job and the lease its runner holds on it."""

    job: Job
    lease_id: str
    lease_s: float
    attempt: int
    max_attempts: int


def _job(row: GenerationJobRow) -> Job:
    return Job(
        row.id,
        JobSpec.from_json(row.spec_json),
        GenerationJobState(row.state).value,
        row.progress,
        row.message,
        JobResult.from_json(row.result_json),
        row.error,
        row.created_at,
        row.updated_at,
        row.runner,
        row.attempts,
        row.lease_expires_at,
    )


def _stamp(t: datetime) -> str:
    return f"{t:%Y-%m-%dT%H:%M:%S}Z"


class GenerationJobs:
    def __init__(
        self,
        sessions: sessionmaker[Session],
        lease_s: float = 60.0,
        max_attempts: int = 3,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        if lease_s <= 0 or max_attempts < 1:
            raise ValueError("lease_s must be positive and max_attempts at least 1")
        self._sessions = sessions
        self.lease_s = lease_s
        self.max_attempts = max_attempts
        self._clock = clock

    def _lease_end(self, now: datetime) -> datetime:
        return now + timedelta(seconds=self.lease_s)

    def _row(self, s: Session, job_id: str, lock: bool = False) -> GenerationJobRow:
        row = s.get(GenerationJobRow, job_id, with_for_update=lock)
        if row is None:
            raise NotFound(f"{job_name(job_id)} not found", reason="JOB_NOT_FOUND")
        return row

    def create(self, job_id: str, spec: JobSpec, request_id: str | None) -> Job:
        """Queue a PENDING job; a retried request_id returns the job it created."""
        given = bool(job_id)
        job_id = job_id or f"gen-{uuid.uuid4().hex[:12]}"
        for attempt in range(3):
            try:
                with self._sessions.begin() as s:
                    if request_id:
                        prior = s.scalars(
                            select(GenerationJobRow).where(GenerationJobRow.request_id == request_id)
                        ).one_or_none()
                        if prior is not None:
                            if given and prior.id != job_id:
                                raise FailedPrecondition(
                                    f"request_id {request_id!r} already created {job_name(prior.id)}",
                                    reason="REQUEST_ID_REUSED",
                                )
                            return _job(prior)
                    if s.get(GenerationJobRow, job_id) is not None:
                        raise AlreadyExists(f"{job_name(job_id)} already exists", reason="JOB_EXISTS")
                    now = utcnow()
                    row = GenerationJobRow(
                        id=job_id,
                        state=GenerationJobState.PENDING,
                        spec_json=spec.to_json(),
                        result_json="{}",
                        error="",
                        request_id=request_id,
                        created_at=now,
                        updated_at=now,
                        progress=0.0,
                        message="queued",
                        runner="",
                        lease_id="",
                        lease_expires_at=None,
                        attempts=0,
                    )
                    s.add(row)
                    s.flush()
                    return _job(row)
            except IntegrityError:  # a concurrent create took the id or request_id
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def get(self, job_id: str) -> Job:
        with self._sessions.begin() as s:
            return _job(self._row(s, job_id))

    def list(self, page: PageRequest) -> Page[Job]:
        """Newest first (by creation time, then id)."""
        with self._sessions.begin() as s:
            stmt = select(GenerationJobRow).order_by(GenerationJobRow.created_at.desc(), GenerationJobRow.id.desc())
            if page.after is not None:
                if not isinstance(page.after, str) or "|" not in page.after:
                    raise invalid_field("page_token", "not a token returned by ListGenerationJobs")
                at, _, after_id = page.after.partition("|")
                after_time = datetime.fromisoformat(at)
                stmt = stmt.where(
                    (GenerationJobRow.created_at < after_time)
                    | ((GenerationJobRow.created_at == after_time) & (GenerationJobRow.id < after_id))
                )
            rows = list(s.scalars(stmt.limit(page.size + 1)))
            more = len(rows) > page.size
            rows = rows[: page.size]
            token = page_token(f"{rows[-1].created_at.isoformat()}|{rows[-1].id}") if more else ""
            return Page([_job(r) for r in rows], token)

    def cancel(self, job_id: str) -> Job:
        with self._sessions.begin() as s:
            row = self._row(s, job_id, lock=True)
            if row.state == GenerationJobState.CANCELLED:
                return _job(row)
            if row.state in FINISHED:
                raise FailedPrecondition(
                    f"{job_name(job_id)} already {GenerationJobState(row.state).value}", reason="JOB_FINISHED"
                )
            row.state, row.message, row.updated_at = GenerationJobState.CANCELLED, "cancelled", self._clock()
            row.lease_expires_at = None
            s.flush()
            return _job(row)

    def requeue_expired(self) -> list[Job]:
        """Every RUNNING job whose lease lapsed goes back to PENDING (progress 0, lease dropped),
        or to FAILED when it has had max_attempts claims; returns the jobs changed. A RUNNING row
        without a lease (claimed before leases existed) counts as lapsed. Each change is a
        compare-and-set on the lease it saw, so a runner renewing meanwhile keeps its job."""
        now = self._clock()
        lapsed = (GenerationJobRow.state == GenerationJobState.RUNNING) & or_(
            GenerationJobRow.lease_expires_at.is_(None), GenerationJobRow.lease_expires_at < now
        )
        with self._sessions.begin() as s:
            seen = s.execute(
                select(
                    GenerationJobRow.id,
                    GenerationJobRow.lease_id,
                    GenerationJobRow.attempts,
                    GenerationJobRow.runner,
                    GenerationJobRow.lease_expires_at,
                    GenerationJobRow.message,
                )
                .where(lapsed)
                .order_by(GenerationJobRow.created_at, GenerationJobRow.id)
            ).all()
        changed = []
        for job_id, lease_id, attempts, runner, expired_at, last in seen:
            expired = f"lease expired {_stamp(expired_at)}" if expired_at else "claimed before leases existed"
            lost = f"runner {runner or '?'} stopped reporting ({expired})"
            if attempts >= self.max_attempts:
                values = dict(
                    state=GenerationJobState.FAILED,
                    message=f"failed: {lost}",
                    error=f"gave up after {attempts} attempts: each runner that claimed the job "
                    f"stopped reporting before its lease ran out; the last, {lost}, "
                    f"had reported {last!r}",
                )
            else:
                values = dict(
                    state=GenerationJobState.PENDING,
                    progress=0.0,
                    message=f"requeued: {lost} in attempt {attempts} of {self.max_attempts}",
                )
            with self._sessions.begin() as s:
                took = s.execute(
                    update(GenerationJobRow)
                    .where(GenerationJobRow.id == job_id, GenerationJobRow.lease_id == lease_id, lapsed)
                    .values(lease_id="", lease_expires_at=None, updated_at=now, **values)
                )
                if took.rowcount == 1:
                    changed.append(_job(self._row(s, job_id)))
        return changed

    def claim(self, runner: str) -> Claim | None:
        """The oldest PENDING job (after requeueing lapsed ones), now RUNNING under a new lease
        held by `runner`; None when none is queued. The compare-and-set UPDATE makes two runners
        never hold the same job."""
        self.requeue_expired()
        for _ in range(5):
            with self._sessions.begin() as s:
                found = s.execute(
                    select(GenerationJobRow.id, GenerationJobRow.attempts)
                    .where(GenerationJobRow.state == GenerationJobState.PENDING)
                    .order_by(GenerationJobRow.created_at, GenerationJobRow.id)
                    .limit(1)
                ).first()
                if found is None:
                    return None
                job_id, attempts = found
                now, lease_id, attempt = self._clock(), uuid.uuid4().hex, attempts + 1
                message = f"claimed by {runner}"
                if attempt > 1:
                    message += f" (attempt {attempt} of {self.max_attempts})"
                took = s.execute(
                    update(GenerationJobRow)
                    .where(
                        GenerationJobRow.id == job_id,
                        GenerationJobRow.state == GenerationJobState.PENDING,
                        GenerationJobRow.attempts == attempts,
                    )
                    .values(
                        state=GenerationJobState.RUNNING,
                        runner=runner,
                        message=message,
                        lease_id=lease_id,
                        lease_expires_at=self._lease_end(now),
                        attempts=attempt,
                        updated_at=now,
                    )
                )
                if took.rowcount == 1:
                    return Claim(_job(self._row(s, job_id)), lease_id, self.lease_s, attempt, self.max_attempts)
        return None

    def update(
        self,
        job_id: str,
        lease_id: str,
        state: str,
        progress: float,
        message: str,
        result: JobResult | None = None,
        error: str = "",
    ) -> Job:
        """A runner's report on the RUNNING job it holds the lease `lease_id` on: progress (state
        RUNNING, which renews the lease), the outcome (SUCCEEDED with `result`, FAILED with
        `error`), or PENDING: the runner hands the job back unfinished (it is shutting down), so
        it is queued again at once and this claim does not count as an attempt."""
        target = GenerationJobState(state)
        if target == GenerationJobState.CANCELLED:
            raise invalid_field("state", "a runner reports RUNNING, SUCCEEDED, FAILED or PENDING (hands the job back)")
        if not 0.0 <= progress <= 1.0:
            raise invalid_field("progress", "must be within [0, 1]")
        if not lease_id:
            raise invalid_field("lease_id", "required: the lease_id ClaimGenerationJob returned")
        with self._sessions.begin() as s:
            row = self._row(s, job_id, lock=True)
            current = GenerationJobState(row.state).value
            if row.lease_id != lease_id:
                now_held = (
                    f"claimed again by {row.runner} (attempt {row.attempts})"
                    if row.state == GenerationJobState.RUNNING
                    else f"{current}: {row.message}"
                )
                raise FailedPrecondition(
                    f"{job_name(job_id)}: lease {lease_id} is no longer held; the job was {now_held}",
                    reason="LEASE_LOST",
                )
            if row.state != GenerationJobState.RUNNING:
                raise FailedPrecondition(f"{job_name(job_id)} is {current}, not RUNNING", reason="JOB_NOT_RUNNING")
            now = self._clock()
            if target == GenerationJobState.PENDING:
                row.state, row.message, row.updated_at, row.progress = target, message or "handed back", now, 0.0
                row.lease_id, row.lease_expires_at, row.attempts = "", None, max(row.attempts - 1, 0)
                s.flush()
                return _job(row)
            row.state, row.message, row.updated_at = target, message, now
            row.lease_expires_at = self._lease_end(now) if target == GenerationJobState.RUNNING else None
            row.progress = 1.0 if target == GenerationJobState.SUCCEEDED else max(row.progress, progress)
            if result is not None:
                row.result_json = result.to_json()
            if error:
                row.error = error
            s.flush()
            return _job(row)
