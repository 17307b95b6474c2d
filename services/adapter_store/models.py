"""SQLAlchemy models of the registry. Alembic migrations (migrations/versions/) must match
these exactly; tests compare them with `alembic.autogenerate.compare_metadata`.

Times are naive UTC (`utcnow()`), the same on SQLite and PostgreSQL.
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Enum,
    Float,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_N_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

ID_LEN = 63
RULE_LEN = 32  # a release rule's name (tasks.adapter_release_rule)
SHA_LEN = 64


def utcnow() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class VersionState(enum.StrEnum):
    PENDING = "PENDING"
    READY = "READY"
    RETIRED = "RETIRED"


class GenerationJobState(enum.StrEnum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


class AdapterRow(Base):
    """`adapters/{id}`. Deleting sets deleted_at; the row stays so version numbers never repeat."""

    __tablename__ = "adapters"

    id: Mapped[str] = mapped_column(String(ID_LEN), primary_key=True)
    description: Mapped[str] = mapped_column(Text, default="")
    latest_version: Mapped[int] = mapped_column(Integer, default=0)
    request_id: Mapped[str | None] = mapped_column(String(128), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    deleted_at: Mapped[datetime | None] = mapped_column(DateTime)


class VersionRow(Base):
    """`adapters/{adapter_id}/versions/{version}`: immutable once READY."""

    __tablename__ = "adapter_versions"
    __table_args__ = (
        UniqueConstraint("adapter_id", "version"),
        Index(None, "state", "created_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    adapter_id: Mapped[str] = mapped_column(ForeignKey("adapters.id"))
    version: Mapped[int] = mapped_column(Integer)
    sha256: Mapped[str] = mapped_column(String(SHA_LEN), index=True)
    rank: Mapped[int] = mapped_column(Integer)
    lora_alpha: Mapped[float] = mapped_column(Float)
    target_modules: Mapped[list[str]] = mapped_column(JSON)
    base_model: Mapped[str] = mapped_column(String(256))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    state: Mapped[VersionState] = mapped_column(Enum(VersionState, name="version_state", native_enum=False, length=16))
    # [{"name": str, "labels": [str, ...]}, ...]
    heads: Mapped[list[dict]] = mapped_column(JSON)
    adapter_config_json: Mapped[str] = mapped_column(Text)
    request_id: Mapped[str | None] = mapped_column(String(128), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)


class AliasRow(Base):
    """`adapters/{adapter_id}@{alias}` -> a version; moved only with a matching etag."""

    __tablename__ = "aliases"
    __table_args__ = (
        ForeignKeyConstraint(["adapter_id", "version"], ["adapter_versions.adapter_id", "adapter_versions.version"]),
    )

    adapter_id: Mapped[str] = mapped_column(ForeignKey("adapters.id"), primary_key=True)
    alias: Mapped[str] = mapped_column(String(ID_LEN), primary_key=True)
    version: Mapped[int] = mapped_column(Integer)
    etag: Mapped[str] = mapped_column(String(64))
    updated_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)


class TaskRow(Base):
    """`tasks/{id}`: a vision application answered by an adapter reference (+ head)."""

    __tablename__ = "tasks"

    id: Mapped[str] = mapped_column(String(ID_LEN), primary_key=True)
    adapter_ref: Mapped[str] = mapped_column(String(256), index=True)
    head: Mapped[str] = mapped_column(String(ID_LEN), default="")
    description: Mapped[str] = mapped_column(Text, default="")
    accuracy_threshold: Mapped[float] = mapped_column(Float, default=0.0)
    measured_accuracy: Mapped[float] = mapped_column(Float, default=0.0)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    # Latency objective (0 = none) and the SLO class it belongs to (valora.v1.Task.slo_ms).
    slo_ms: Mapped[float] = mapped_column(Float, default=0.0)
    slo_class: Mapped[str] = mapped_column(String(ID_LEN), default="", index=True)
    # Default early adapter release of the task's requests, in [0, 1] (0 = off), and its run-time
    # rule by name (release_rules.ReleaseRule's value; "none": the fraction alone).
    adapter_release_fraction: Mapped[float] = mapped_column(Float, default=0.0)
    adapter_release_rule: Mapped[str] = mapped_column(String(RULE_LEN), default="none")


class FusedMemberRow(Base):
    """Which tasks a fused adapter version was trained to serve (accuracy-aware generation)."""

    __tablename__ = "fused_adapter_members"
    __table_args__ = (
        ForeignKeyConstraint(["adapter_id", "version"], ["adapter_versions.adapter_id", "adapter_versions.version"]),
    )

    adapter_id: Mapped[str] = mapped_column(String(ID_LEN), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    task_id: Mapped[str] = mapped_column(ForeignKey("tasks.id"), primary_key=True)
    head: Mapped[str] = mapped_column(String(ID_LEN), default="")
    measured_accuracy: Mapped[float] = mapped_column(Float, default=0.0)
    added_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)


class TileTableRow(Base):
    """The ATMM tile table (kernels.tile_table JSON) of one GPU name/arch and dtype; a put
    replaces it (the latest wins)."""

    __tablename__ = "tile_tables"

    gpu_name: Mapped[str] = mapped_column(String(128), primary_key=True)
    gpu_arch: Mapped[str] = mapped_column(String(32), primary_key=True)
    dtype: Mapped[str] = mapped_column(String(16), primary_key=True)
    table_json: Mapped[str] = mapped_column(Text)
    sha256: Mapped[str] = mapped_column(String(SHA_LEN))
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)


class GenerationJobRow(Base):
    """An accuracy-aware adapter generation job (offline greedy bin packing of tasks).
    PENDING -> RUNNING (claimed by a runner) -> SUCCEEDED | FAILED; CANCELLED from either of the
    first two; RUNNING -> PENDING (or FAILED after max attempts) when the runner's lease expires.
    The store (jobs.py) owns the transitions; runners send updates."""

    __tablename__ = "generation_jobs"
    __table_args__ = (Index(None, "state", "created_at"),)

    id: Mapped[str] = mapped_column(String(ID_LEN), primary_key=True)
    state: Mapped[GenerationJobState] = mapped_column(
        Enum(GenerationJobState, name="generation_job_state", native_enum=False, length=16)
    )
    spec_json: Mapped[str] = mapped_column(Text, default="{}")
    result_json: Mapped[str] = mapped_column(Text, default="{}")
    error: Mapped[str] = mapped_column(Text, default="")
    request_id: Mapped[str | None] = mapped_column(String(128), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    progress: Mapped[float] = mapped_column(Float, default=0.0)
    message: Mapped[str] = mapped_column(Text, default="")
    runner: Mapped[str] = mapped_column(String(128), default="")
    # The current claim: its id (updates must carry it), when it lapses without an update, and
    # how many claims the job has had (attempts).
    lease_id: Mapped[str] = mapped_column(String(64), default="")
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
