"""Generation jobs: the one owner of their state machine

    PENDING --claim--> RUNNING --finish--> SUCCEEDED | FAILED
    PENDING | RUNNING --cancel--> CANCELLED

Admins create, read, list and cancel jobs (AdminService); generator runners claim the oldest
PENDING job and report progress and the outcome (AdapterStoreService). An update for a job that
is no longer RUNNING (cancelled meanwhile) fails with JOB_NOT_RUNNING, which is how a runner
learns to stop. Every method blocks; the servicer runs them in an executor. Inputs and outputs
are the domain objects below, never protobuf.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import asdict, dataclass, field
from datetime import datetime

from sqlalchemy import select, update
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
    m = _JOB.match(value or "")
    if m is None:
        raise invalid_field(field_path, f"{value!r} is not a generation job name (generationJobs/{{job}})")
    return m.group("job")


@dataclass(frozen=True)
class JobSource:
    task: str
    accuracy_threshold: float


@dataclass(frozen=True)
class JobSpec:
    """What to generate (the job's input, stored as spec_json)."""

    base_model: str
    sources: tuple[JobSource, ...]
    rank: int = 8
    epochs: int = 4
    adapter_prefix: str = ""
    split_limit: int = 0

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "sources": [asdict(s) for s in self.sources]})

    @classmethod
    def from_json(cls, text: str) -> "JobSpec":
        d = json.loads(text or "{}")
        return cls(d.get("base_model", ""), tuple(JobSource(**s) for s in d.get("sources", [])),
                   d.get("rank", 8), d.get("epochs", 4), d.get("adapter_prefix", ""), d.get("split_limit", 0))


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

    def to_json(self) -> str:
        return json.dumps({"adapter_versions": list(self.adapter_versions), "tasks": [asdict(t) for t in self.tasks]})

    @classmethod
    def from_json(cls, text: str) -> "JobResult":
        d = json.loads(text or "{}")
        return cls(tuple(d.get("adapter_versions", [])), tuple(TaskOutcome(**t) for t in d.get("tasks", [])))


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

    @property
    def name(self) -> str:
        return job_name(self.id)


def _job(row: GenerationJobRow) -> Job:
    return Job(row.id, JobSpec.from_json(row.spec_json), GenerationJobState(row.state).value, row.progress,
               row.message, JobResult.from_json(row.result_json), row.error, row.created_at, row.updated_at)


class GenerationJobs:
    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self._sessions = sessions

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
                        prior = s.scalars(select(GenerationJobRow)
                                          .where(GenerationJobRow.request_id == request_id)).one_or_none()
                        if prior is not None:
                            if given and prior.id != job_id:
                                raise FailedPrecondition(f"request_id {request_id!r} already created "
                                                         f"{job_name(prior.id)}", reason="REQUEST_ID_REUSED")
                            return _job(prior)
                    if s.get(GenerationJobRow, job_id) is not None:
                        raise AlreadyExists(f"{job_name(job_id)} already exists", reason="JOB_EXISTS")
                    now = utcnow()
                    row = GenerationJobRow(id=job_id, state=GenerationJobState.PENDING, spec_json=spec.to_json(),
                                           result_json="{}", error="", request_id=request_id, created_at=now,
                                           updated_at=now, progress=0.0, message="queued", runner="")
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
                stmt = stmt.where((GenerationJobRow.created_at < after_time)
                                  | ((GenerationJobRow.created_at == after_time) & (GenerationJobRow.id < after_id)))
            rows = list(s.scalars(stmt.limit(page.size + 1)))
            more = len(rows) > page.size
            rows = rows[:page.size]
            token = page_token(f"{rows[-1].created_at.isoformat()}|{rows[-1].id}") if more else ""
            return Page([_job(r) for r in rows], token)

    def cancel(self, job_id: str) -> Job:
        with self._sessions.begin() as s:
            row = self._row(s, job_id, lock=True)
            if row.state == GenerationJobState.CANCELLED:
                return _job(row)
            if row.state in FINISHED:
                raise FailedPrecondition(f"{job_name(job_id)} already {GenerationJobState(row.state).value}",
                                         reason="JOB_FINISHED")
            row.state, row.message, row.updated_at = GenerationJobState.CANCELLED, "cancelled", utcnow()
            s.flush()
            return _job(row)

    def claim(self, runner: str) -> Job | None:
        """The oldest PENDING job, now RUNNING and held by `runner`; None when none is queued.
        The compare-and-set UPDATE makes two runners never hold the same job."""
        for _ in range(5):
            with self._sessions.begin() as s:
                job_id = s.scalar(select(GenerationJobRow.id)
                                  .where(GenerationJobRow.state == GenerationJobState.PENDING)
                                  .order_by(GenerationJobRow.created_at, GenerationJobRow.id).limit(1))
                if job_id is None:
                    return None
                took = s.execute(update(GenerationJobRow)
                                 .where(GenerationJobRow.id == job_id,
                                        GenerationJobRow.state == GenerationJobState.PENDING)
                                 .values(state=GenerationJobState.RUNNING, runner=runner,
                                         message=f"claimed by {runner}", updated_at=utcnow()))
                if took.rowcount == 1:
                    return _job(self._row(s, job_id))
        return None

    def update(self, job_id: str, state: str, progress: float, message: str, result: JobResult | None = None,
               error: str = "") -> Job:
        """A runner's report on a RUNNING job: progress (state RUNNING) or the outcome
        (SUCCEEDED with `result`, FAILED with `error`)."""
        target = GenerationJobState(state)
        if target not in (GenerationJobState.RUNNING, GenerationJobState.SUCCEEDED, GenerationJobState.FAILED):
            raise invalid_field("state", "a runner reports RUNNING, SUCCEEDED or FAILED")
        if not 0.0 <= progress <= 1.0:
            raise invalid_field("progress", "must be within [0, 1]")
        with self._sessions.begin() as s:
            row = self._row(s, job_id, lock=True)
            if row.state != GenerationJobState.RUNNING:
                raise FailedPrecondition(f"{job_name(job_id)} is {GenerationJobState(row.state).value}, "
                                         "not RUNNING", reason="JOB_NOT_RUNNING")
            row.state, row.message, row.updated_at = target, message, utcnow()
            row.progress = 1.0 if target == GenerationJobState.SUCCEEDED else max(row.progress, progress)
            if result is not None:
                row.result_json = result.to_json()
            if error:
                row.error = error
            s.flush()
            return _job(row)
