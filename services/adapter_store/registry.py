"""The registry: the one owner of the adapter version lifecycle (PENDING -> READY -> RETIRED),
aliases and tasks. Every method blocks (database and blob I/O); the servicer runs them in an
executor. Inputs and outputs are domain objects (domain.py), never protobuf.

Registration is crash-safe: (1) a PENDING row is committed, (2) the blob is PUT under its
sha256, (3) the blob is verified, (4) the row turns READY in one transaction. A crash after (1)
leaves a PENDING row that GC removes after the grace period; a blob whose row never committed
(or was removed) is an orphan GC deletes. A retried request_id resumes or returns its version.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import datetime, timedelta
from typing import BinaryIO

from sqlalchemy import delete, func, select, text, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from services.common import names
from services.common.release_rules import ReleaseRule
from services.common.errors import (
    Aborted,
    AdapterNotFound,
    AlreadyExists,
    FailedPrecondition,
    NotFound,
    invalid_field,
)

from services.adapter_store.blobs import BlobStore
from services.adapter_store.domain import (
    MUTABLE_TASK_FIELDS,
    Adapter,
    Alias,
    Dataset,
    GcReport,
    Head,
    Page,
    PageRequest,
    Resolution,
    Task,
    Version,
    check_release_fraction,
    check_slo,
    page_token,
)
from services.adapter_store.jobs import dataset_name, datasets_of
from services.adapter_store.models import (
    AdapterRow,
    AliasRow,
    FusedMemberRow,
    GenerationJobRow,
    GenerationJobState,
    TaskRow,
    VersionRow,
    VersionState,
    utcnow,
)
from services.adapter_store.validation import CheckedBundle, UploadRequest

FaultHook = Callable[[str], None]


def _version(row: VersionRow) -> Version:
    return Version(
        adapter_id=row.adapter_id,
        version=row.version,
        sha256=row.sha256,
        rank=row.rank,
        lora_alpha=row.lora_alpha,
        target_modules=tuple(row.target_modules),
        base_model=row.base_model,
        size_bytes=row.size_bytes,
        state=VersionState(row.state).value,
        create_time=row.created_at,
        heads=tuple(Head(h["name"], tuple(h["labels"])) for h in row.heads),
        adapter_config_json=row.adapter_config_json,
    )


def _task(row: TaskRow) -> Task:
    return Task(
        row.id,
        row.adapter_ref,
        row.head,
        row.description,
        row.accuracy_threshold,
        row.measured_accuracy,
        row.created_at,
        row.slo_ms,
        row.slo_class,
        row.adapter_release_fraction,
        ReleaseRule(row.adapter_release_rule),
    )


class Registry:
    def __init__(self, sessions: sessionmaker[Session], blobs: BlobStore, fault_hook: FaultHook | None = None) -> None:
        self._sessions = sessions
        self.blobs = blobs
        self._fault = fault_hook or (lambda step: None)

    @property
    def sessions(self) -> sessionmaker[Session]:
        """The session factory (shared with the generation jobs, jobs.py)."""
        return self._sessions

    def ping(self) -> None:
        """Raises when the database or the blob store cannot be reached (the health loop)."""
        with self._sessions() as s:
            s.execute(text("SELECT 1"))
        self.blobs.ping()

    def close(self) -> None:
        """Release the database connections."""
        bind = self._sessions.kw.get("bind")
        if bind is not None:
            bind.dispose()

    # ------------------------------------------------------------------ adapters

    def _adapter(self, s: Session, adapter_id: str) -> Adapter:
        row = s.get(AdapterRow, adapter_id)
        if row is None or row.deleted_at is not None:
            raise AdapterNotFound(f"{names.adapter_name(adapter_id)} not found", reason="ADAPTER_NOT_FOUND")
        aliases = dict(
            s.execute(select(AliasRow.alias, AliasRow.version).where(AliasRow.adapter_id == adapter_id)).all()
        )
        return Adapter(row.id, row.description, row.created_at, row.latest_version, aliases)

    def _live_adapter_row(self, s: Session, adapter_id: str, lock: bool = False) -> AdapterRow:
        stmt = select(AdapterRow).where(AdapterRow.id == adapter_id)
        if lock:
            stmt = stmt.with_for_update()
        row = s.scalars(stmt).one_or_none()
        if row is None or row.deleted_at is not None:
            raise AdapterNotFound(f"{names.adapter_name(adapter_id)} not found", reason="ADAPTER_NOT_FOUND")
        return row

    def create_adapter(self, adapter_id: str, description: str, request_id: str | None) -> Adapter:
        for attempt in range(3):
            try:
                with self._sessions.begin() as s:
                    if request_id:
                        prior = s.scalars(select(AdapterRow).where(AdapterRow.request_id == request_id)).one_or_none()
                        if prior is not None:
                            if prior.id != adapter_id:
                                raise FailedPrecondition(
                                    f"request_id {request_id!r} already created {names.adapter_name(prior.id)}",
                                    reason="REQUEST_ID_REUSED",
                                )
                            return self._adapter(s, adapter_id)
                    row = s.get(AdapterRow, adapter_id, with_for_update=True)
                    if row is not None and row.deleted_at is None:
                        raise AlreadyExists(f"{names.adapter_name(adapter_id)} already exists", reason="ADAPTER_EXISTS")
                    if row is None:
                        s.add(
                            AdapterRow(
                                id=adapter_id,
                                description=description,
                                latest_version=0,
                                request_id=request_id,
                                created_at=utcnow(),
                            )
                        )
                    else:  # re-created after a delete: version numbers continue, never repeat
                        row.description, row.request_id = description, request_id
                        row.deleted_at, row.created_at = None, utcnow()
                    s.flush()
                    return self._adapter(s, adapter_id)
            except IntegrityError:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def get_adapter(self, adapter_id: str) -> Adapter:
        with self._sessions.begin() as s:
            return self._adapter(s, adapter_id)

    def list_adapters(self, page: PageRequest) -> Page[Adapter]:
        with self._sessions.begin() as s:
            stmt = select(AdapterRow.id).where(AdapterRow.deleted_at.is_(None)).order_by(AdapterRow.id)
            if page.after is not None:
                stmt = stmt.where(AdapterRow.id > str(page.after))
            rows = list(
                s.scalars(
                    select(AdapterRow).where(AdapterRow.id.in_(stmt.limit(page.size + 1))).order_by(AdapterRow.id)
                )
            )
            more = len(rows) > page.size
            rows = rows[: page.size]
            aliases: dict[str, dict[str, int]] = {r.id: {} for r in rows}
            for a in s.scalars(select(AliasRow).where(AliasRow.adapter_id.in_(list(aliases)))):
                aliases[a.adapter_id][a.alias] = a.version
            items = [Adapter(r.id, r.description, r.created_at, r.latest_version, aliases[r.id]) for r in rows]
            return Page(items, page_token(rows[-1].id) if more else "")

    def delete_adapter(self, adapter_id: str, etag: str = "") -> None:
        """Retires every version, removes the aliases and the name; with `etag`, only if the
        adapter is still as read (Adapter.etag), else ABORTED."""
        with self._sessions.begin() as s:
            self._live_adapter_row(s, adapter_id, lock=True)
            if etag and self._adapter(s, adapter_id).etag != etag:
                raise Aborted(
                    f"{names.adapter_name(adapter_id)} changed (etag {etag!r} is stale); read it again",
                    reason="ETAG_MISMATCH",
                )
            users = [t.id for t in s.scalars(select(TaskRow)) if _ref_adapter(t.adapter_ref) == adapter_id]
            if users:
                raise FailedPrecondition(
                    f"tasks {users[:5]} still use {names.adapter_name(adapter_id)}", reason="ADAPTER_IN_USE"
                )
            s.execute(delete(AliasRow).where(AliasRow.adapter_id == adapter_id))
            s.execute(
                update(VersionRow)
                .where(VersionRow.adapter_id == adapter_id, VersionRow.state != VersionState.RETIRED)
                .values(state=VersionState.RETIRED, updated_at=utcnow())
            )
            s.execute(update(AdapterRow).where(AdapterRow.id == adapter_id).values(deleted_at=utcnow()))

    # ------------------------------------------------------------------ registration

    def find_upload(self, request_id: str) -> Version | None:
        """The version a request_id registered, if that upload finished (READY or RETIRED)."""
        with self._sessions.begin() as s:
            row = s.scalars(select(VersionRow).where(VersionRow.request_id == request_id)).one_or_none()
            if row is None or row.state == VersionState.PENDING:
                return None
            return _version(row)

    def register(
        self, req: UploadRequest, bundle: CheckedBundle, base_model: str, data: bytes | bytearray | BinaryIO
    ) -> Version:
        """PENDING row -> blob PUT -> verify -> READY (see the module docstring). `data` is the
        checked bundle's bytes or a stream positioned at its start."""
        row_id, finished = self._begin_version(req, bundle, base_model)
        if finished is not None:  # a retried request_id whose upload completed before
            return finished
        self._fault("pending_committed")
        self.blobs.put(bundle.sha256, data, bundle.size)
        self._fault("blob_put")
        info = self.blobs.stat(bundle.sha256)
        if info is None or info.size != bundle.size:
            raise Aborted(f"blob {bundle.sha256} did not verify after upload; retry", reason="BLOB_VERIFY_FAILED")
        self._fault("verified")
        with self._sessions.begin() as s:
            done = s.execute(
                update(VersionRow)
                .where(VersionRow.id == row_id, VersionRow.state == VersionState.PENDING)
                .values(state=VersionState.READY, updated_at=utcnow())
            )
            row = s.get(VersionRow, row_id)
            if row is None or (done.rowcount != 1 and row.state != VersionState.READY):
                raise Aborted(
                    "the pending version was garbage-collected or retired before it finished; retry",
                    reason="PENDING_EXPIRED",
                )
            version = _version(row)
        self._fault("ready_committed")
        return version

    def _begin_version(self, req: UploadRequest, bundle: CheckedBundle, base_model: str) -> tuple[int, Version | None]:
        """Commit the PENDING row, or find the row a retried request_id left: returns its id and,
        when that upload already finished, its version."""
        for attempt in range(3):
            try:
                with self._sessions.begin() as s:
                    if req.request_id:
                        prior = s.scalars(
                            select(VersionRow).where(VersionRow.request_id == req.request_id)
                        ).one_or_none()
                        if prior is not None:
                            if prior.adapter_id != req.adapter_id or prior.sha256 != bundle.sha256:
                                raise FailedPrecondition(
                                    f"request_id {req.request_id!r} already registered a different bundle "
                                    f"({names.version_name(prior.adapter_id, prior.version)})",
                                    reason="REQUEST_ID_REUSED",
                                )
                            return prior.id, None if prior.state == VersionState.PENDING else _version(prior)
                    adapter = s.get(AdapterRow, req.adapter_id, with_for_update=True)
                    if adapter is None:
                        adapter = AdapterRow(
                            id=req.adapter_id, description="", latest_version=0, request_id=None, created_at=utcnow()
                        )
                        s.add(adapter)
                        s.flush()
                    elif adapter.deleted_at is not None:
                        adapter.deleted_at, adapter.created_at = None, utcnow()
                    adapter.latest_version += 1
                    now = utcnow()
                    row = VersionRow(
                        adapter_id=req.adapter_id,
                        version=adapter.latest_version,
                        sha256=bundle.sha256,
                        rank=bundle.info.rank,
                        lora_alpha=bundle.info.lora_alpha,
                        target_modules=list(bundle.info.target_modules),
                        base_model=base_model,
                        size_bytes=bundle.size,
                        state=VersionState.PENDING,
                        heads=[{"name": h.name, "labels": list(h.labels)} for h in bundle.heads],
                        adapter_config_json=req.adapter_config_json,
                        request_id=req.request_id,
                        created_at=now,
                        updated_at=now,
                    )
                    s.add(row)
                    s.flush()
                    return row.id, None
            except IntegrityError:  # a concurrent upload took the version number or request_id
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ versions

    def _version_row(self, s: Session, adapter_id: str, version: int) -> VersionRow:
        row = s.scalars(
            select(VersionRow).where(VersionRow.adapter_id == adapter_id, VersionRow.version == version)
        ).one_or_none()
        if row is None:
            raise NotFound(f"{names.version_name(adapter_id, version)} not found", reason="VERSION_NOT_FOUND")
        return row

    def get_version(self, adapter_id: str, version: int) -> Version:
        with self._sessions.begin() as s:
            return _version(self._version_row(s, adapter_id, version))

    def list_versions(self, adapter_id: str, page: PageRequest) -> Page[Version]:
        with self._sessions.begin() as s:
            self._live_adapter_row(s, adapter_id)
            stmt = select(VersionRow).where(VersionRow.adapter_id == adapter_id).order_by(VersionRow.version)
            if page.after is not None:
                if not isinstance(page.after, int):
                    raise invalid_field("page_token", "not a token returned by ListAdapterVersions")
                stmt = stmt.where(VersionRow.version > page.after)
            rows = list(s.scalars(stmt.limit(page.size + 1)))
            more = len(rows) > page.size
            rows = rows[: page.size]
            return Page([_version(r) for r in rows], page_token(rows[-1].version) if more else "")

    def delete_version(self, adapter_id: str, version: int) -> None:
        with self._sessions.begin() as s:
            self._live_adapter_row(s, adapter_id, lock=True)
            row = self._version_row(s, adapter_id, version)
            if row.state == VersionState.RETIRED:
                return
            aliases = list(
                s.scalars(select(AliasRow.alias).where(AliasRow.adapter_id == adapter_id, AliasRow.version == version))
            )
            if aliases:
                raise FailedPrecondition(
                    f"aliases {aliases} point at {names.version_name(adapter_id, version)}", reason="VERSION_IN_USE"
                )
            users = []
            for t in s.scalars(select(TaskRow)):
                if _ref_adapter(t.adapter_ref) != adapter_id:
                    continue
                try:
                    if self._resolve_adapter_ref(s, t.adapter_ref).version == version:
                        users.append(t.id)
                except (NotFound, FailedPrecondition):
                    pass
            if users:
                raise FailedPrecondition(
                    f"tasks {users[:5]} resolve to {names.version_name(adapter_id, version)}", reason="VERSION_IN_USE"
                )
            row.state, row.updated_at = VersionState.RETIRED, utcnow()

    # ------------------------------------------------------------------ aliases

    def set_alias(self, adapter_id: str, alias: str, version: int, etag: str) -> Alias:
        """Point the alias at a READY version. With `etag`, only if the alias still has it
        (compare-and-set in one UPDATE); otherwise ABORTED."""
        for attempt in range(3):
            try:
                with self._sessions.begin() as s:
                    self._live_adapter_row(s, adapter_id, lock=True)  # serialises with delete_version
                    row = self._version_row(s, adapter_id, version)
                    if row.state != VersionState.READY:
                        raise FailedPrecondition(
                            f"{names.version_name(adapter_id, version)} is {VersionState(row.state).value}, not READY",
                            reason="VERSION_NOT_READY",
                        )
                    new_etag = uuid.uuid4().hex
                    where = [AliasRow.adapter_id == adapter_id, AliasRow.alias == alias]
                    if etag:
                        where.append(AliasRow.etag == etag)
                    moved = s.execute(
                        update(AliasRow).where(*where).values(version=version, etag=new_etag, updated_at=utcnow())
                    )
                    if moved.rowcount == 1:
                        return Alias(adapter_id, alias, version, new_etag)
                    if etag:
                        raise Aborted(
                            f"alias {alias!r} of {names.adapter_name(adapter_id)} changed "
                            f"(etag {etag!r} is stale); read it again",
                            reason="ETAG_MISMATCH",
                        )
                    s.add(
                        AliasRow(
                            adapter_id=adapter_id, alias=alias, version=version, etag=new_etag, updated_at=utcnow()
                        )
                    )
                    s.flush()
                    return Alias(adapter_id, alias, version, new_etag)
            except IntegrityError:  # created concurrently; the next attempt updates it
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def delete_alias(self, adapter_id: str, alias: str) -> None:
        with self._sessions.begin() as s:
            self._live_adapter_row(s, adapter_id, lock=True)
            users = [
                t.id
                for t in s.scalars(
                    select(TaskRow).where(TaskRow.adapter_ref == f"{names.adapter_name(adapter_id)}@{alias}")
                )
            ]
            if users:
                raise FailedPrecondition(f"tasks {users[:5]} use alias {alias!r}", reason="ALIAS_IN_USE")
            gone = s.execute(delete(AliasRow).where(AliasRow.adapter_id == adapter_id, AliasRow.alias == alias))
            if gone.rowcount == 0:
                raise NotFound(f"{names.adapter_name(adapter_id)}@{alias} not found", reason="ALIAS_NOT_FOUND")

    # ------------------------------------------------------------------ resolution

    def _resolve_adapter_ref(self, s: Session, reference: str, field_path: str = "reference") -> VersionRow:
        ref = names.parse_adapter_ref(reference, field_path)
        self._live_adapter_row(s, ref.adapter)
        if ref.version is not None:
            row = self._version_row(s, ref.adapter, ref.version)
        elif ref.alias is not None:
            alias = s.get(AliasRow, (ref.adapter, ref.alias))
            if alias is None:
                raise NotFound(f"{reference} not found: no such alias", reason="ALIAS_NOT_FOUND")
            row = self._version_row(s, ref.adapter, alias.version)
        else:
            row = s.scalars(
                select(VersionRow)
                .where(VersionRow.adapter_id == ref.adapter, VersionRow.state == VersionState.READY)
                .order_by(VersionRow.version.desc())
                .limit(1)
            ).one_or_none()
            if row is None:
                raise NotFound(f"{reference} has no READY version", reason="VERSION_NOT_FOUND")
        if row.state != VersionState.READY:
            raise FailedPrecondition(
                f"{names.version_name(row.adapter_id, row.version)} is {VersionState(row.state).value}, not READY",
                reason="VERSION_NOT_READY",
            )
        return row

    def resolve(self, reference: str) -> Resolution:
        with self._sessions.begin() as s:
            if (reference or "").startswith("tasks/"):
                task_id = names.parse_task_name(reference, "reference")
                task = s.get(TaskRow, task_id)
                if task is None:
                    raise NotFound(f"{reference} not found", reason="TASK_NOT_FOUND")
                return Resolution(_version(self._resolve_adapter_ref(s, task.adapter_ref)), _task(task))
            return Resolution(_version(self._resolve_adapter_ref(s, reference)))

    def open_ready(self, adapter_id: str, version: int) -> tuple[Version, Iterator[bytes]]:
        """A READY version and its bundle's byte chunks."""
        with self._sessions.begin() as s:
            row = self._version_row(s, adapter_id, version)
            if row.state != VersionState.READY:
                raise FailedPrecondition(
                    f"{names.version_name(adapter_id, version)} is {VersionState(row.state).value}, not READY",
                    reason="VERSION_NOT_READY",
                )
            v = _version(row)
        try:
            return v, self.blobs.open(v.sha256)
        except FileNotFoundError as exc:
            raise FailedPrecondition(
                f"the bundle of {v.name} is missing from the blob store", reason="BLOB_MISSING"
            ) from exc

    # ------------------------------------------------------------------ tasks

    def create_task(self, task: Task) -> Task:
        with self._sessions.begin() as s:
            if s.get(TaskRow, task.id) is not None:
                raise AlreadyExists(f"{task.name} already exists", reason="TASK_EXISTS")
            # Lock the adapter so a concurrent DeleteAdapterVersion/DeleteAlias sees this task.
            self._live_adapter_row(s, names.parse_adapter_ref(task.adapter_ref, "task.adapter").adapter, lock=True)
            row = self._resolve_adapter_ref(s, task.adapter_ref, "task.adapter")
            if task.head and task.head not in {h["name"] for h in row.heads}:
                raise invalid_field(
                    "task.head", f"{names.version_name(row.adapter_id, row.version)} has no head {task.head!r}"
                )
            self._check_slo_class(s, task)
            new = TaskRow(
                id=task.id,
                adapter_ref=task.adapter_ref,
                head=task.head,
                description=task.description,
                accuracy_threshold=task.accuracy_threshold,
                measured_accuracy=task.measured_accuracy,
                created_at=utcnow(),
                slo_ms=task.slo_ms,
                slo_class=task.slo_class,
                adapter_release_fraction=task.adapter_release_fraction,
                adapter_release_rule=task.adapter_release_rule.value,
            )
            s.add(new)
            s.flush()
            return _task(new)

    @staticmethod
    def _check_slo_class(s: Session, task: Task) -> None:
        """One class, one objective: its attainment count would mean nothing otherwise."""
        if not task.slo_class:
            return
        other = s.scalars(
            select(TaskRow)
            .where(TaskRow.slo_class == task.slo_class, TaskRow.id != task.id, TaskRow.slo_ms != task.slo_ms)
            .limit(1)
        ).first()
        if other is not None:
            raise FailedPrecondition(
                f"SLO class {task.slo_class!r} has objective {other.slo_ms:g} ms ({names.task_name(other.id)}), "
                f"not {task.slo_ms:g} ms; to change a shared objective, move its tasks to a new class",
                reason="SLO_CLASS_OBJECTIVE_MISMATCH",
            )

    def update_task(self, task_id: str, changes: dict[str, object], etag: str = "") -> Task:
        """Sets the task's mutable fields named in `changes` (domain.MUTABLE_TASK_FIELDS), the
        task checked as CreateTask checks it; with `etag`, only if the task is still as read
        (Task.etag), else ABORTED. slo_ms changed alone to 0 clears the class too."""
        unknown = set(changes) - set(MUTABLE_TASK_FIELDS)
        if unknown:
            raise invalid_field("update_mask", f"{sorted(unknown)} cannot be updated")
        with self._sessions.begin() as s:
            row = s.get(TaskRow, task_id, with_for_update=True)
            if row is None:
                raise NotFound(f"{names.task_name(task_id)} not found", reason="TASK_NOT_FOUND")
            current = _task(row)
            if etag and current.etag != etag:
                raise Aborted(f"{current.name} changed (etag {etag!r} is stale); read it again", reason="ETAG_MISMATCH")
            slo_ms = float(changes.get("slo_ms", current.slo_ms))
            if "slo_class" in changes:
                slo_class = str(changes["slo_class"])
            else:  # the class follows the objective: none without one, the task's own id by default
                slo_class = current.slo_class if slo_ms > 0 else ""
            fraction = float(changes.get("adapter_release_fraction", current.adapter_release_fraction))
            rule = changes.get("adapter_release_rule", current.adapter_release_rule)
            updated = replace(
                current,
                description=str(changes.get("description", current.description)),
                slo_ms=slo_ms,
                slo_class=check_slo(task_id, slo_ms, slo_class),
                adapter_release_fraction=check_release_fraction(fraction),
                adapter_release_rule=ReleaseRule(rule),
            )
            self._check_slo_class(s, updated)
            row.description, row.slo_ms, row.slo_class = updated.description, updated.slo_ms, updated.slo_class
            row.adapter_release_fraction = updated.adapter_release_fraction
            row.adapter_release_rule = updated.adapter_release_rule.value
            s.flush()
            return _task(row)

    def get_task(self, task_id: str) -> Task:
        with self._sessions.begin() as s:
            row = s.get(TaskRow, task_id)
            if row is None:
                raise NotFound(f"{names.task_name(task_id)} not found", reason="TASK_NOT_FOUND")
            return _task(row)

    def list_tasks(self, page: PageRequest) -> Page[Task]:
        with self._sessions.begin() as s:
            stmt = select(TaskRow).order_by(TaskRow.id)
            if page.after is not None:
                stmt = stmt.where(TaskRow.id > str(page.after))
            rows = list(s.scalars(stmt.limit(page.size + 1)))
            more = len(rows) > page.size
            rows = rows[: page.size]
            return Page([_task(r) for r in rows], page_token(rows[-1].id) if more else "")

    def delete_task(self, task_id: str) -> None:
        with self._sessions.begin() as s:
            if s.get(TaskRow, task_id) is None:
                raise NotFound(f"{names.task_name(task_id)} not found", reason="TASK_NOT_FOUND")
            s.execute(delete(FusedMemberRow).where(FusedMemberRow.task_id == task_id))
            s.execute(delete(TaskRow).where(TaskRow.id == task_id))

    # ------------------------------------------------------------------ garbage collection

    def gc(self, grace_s: float, now: datetime | None = None) -> GcReport:
        """Remove PENDING versions older than the grace period, then blobs no PENDING/READY
        version names that are older than the grace period (younger ones may belong to an
        upload whose row is being written)."""
        cutoff = (now or utcnow()) - timedelta(seconds=grace_s)
        with self._sessions.begin() as s:
            stale = list(
                s.scalars(
                    select(VersionRow).where(VersionRow.state == VersionState.PENDING, VersionRow.updated_at < cutoff)
                )
            )
            pending_removed = [names.version_name(r.adapter_id, r.version) for r in stale]
            for r in stale:
                s.delete(r)
        self.blobs.remove_partial(cutoff)
        removed = []
        live = self._live_shas()
        for blob in list(self.blobs.list()):
            if blob.sha256 in live or blob.modified >= cutoff:
                continue
            if self._is_live(blob.sha256):  # registered since the snapshot
                continue
            self.blobs.delete(blob.sha256)
            removed.append(blob.sha256)
        return GcReport(pending_removed, removed)

    def _live_shas(self) -> set[str]:
        with self._sessions.begin() as s:
            return set(
                s.scalars(
                    select(VersionRow.sha256).where(VersionRow.state.in_([VersionState.PENDING, VersionState.READY]))
                )
            ) | self._job_datasets(s)

    def _is_live(self, sha256: str) -> bool:
        with self._sessions.begin() as s:
            return bool(
                s.scalar(
                    select(func.count())
                    .select_from(VersionRow)
                    .where(
                        VersionRow.sha256 == sha256, VersionRow.state.in_([VersionState.PENDING, VersionState.READY])
                    )
                )
            ) or sha256 in self._job_datasets(s)

    @staticmethod
    def _job_datasets(s: Session) -> set[str]:
        """Datasets a PENDING or RUNNING generation job names: kept until the job ends."""
        out: set[str] = set()
        for spec in s.scalars(
            select(GenerationJobRow.spec_json).where(
                GenerationJobRow.state.in_([GenerationJobState.PENDING, GenerationJobState.RUNNING])
            )
        ):
            out |= datasets_of(spec)
        return out

    # ------------------------------------------------------------------ datasets

    def put_dataset(self, sha256: str, data: BinaryIO, size: int) -> Dataset:
        """Stores a dataset archive under its sha256 (BlobIntegrityError when the bytes differ).
        A blob like any other: GC keeps it while a PENDING or RUNNING job names it, and for the
        grace period after this put (the time to create the job)."""
        self.blobs.put(sha256, data, size)
        return Dataset(sha256, size)

    def get_dataset(self, sha256: str) -> Dataset:
        info = self.blobs.stat(sha256)
        if info is None:
            raise NotFound(
                f"{dataset_name(sha256)} was not uploaded, or was collected after its jobs ended; upload it again",
                reason="DATASET_NOT_FOUND",
            )
        return Dataset(sha256, info.size)

    def open_dataset(self, sha256: str) -> Iterator[bytes]:
        self.get_dataset(sha256)
        return self.blobs.open(sha256)


def _ref_adapter(reference: str) -> str | None:
    try:
        return names.parse_adapter_ref(reference).adapter
    except Exception:  # a stored reference is valid by construction
        return None
