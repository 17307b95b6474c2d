"""Plain domain objects of the registry: what the store's logic returns. Handlers convert them
to protobuf at the edge (convert.py); nothing below the servicer sees protobuf types."""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Generic, TypeVar

from services.common import names
from services.common.errors import invalid_field
from services.common.release_rules import ReleaseRule

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 1000

T = TypeVar("T")


@dataclass(frozen=True)
class Head:
    name: str
    labels: tuple[str, ...]


@dataclass(frozen=True)
class Adapter:
    id: str
    description: str
    create_time: datetime
    latest_version: int
    aliases: dict[str, int] = field(default_factory=dict)  # alias -> version number

    @property
    def name(self) -> str:
        return names.adapter_name(self.id)

    @property
    def etag(self) -> str:
        """A digest of every field the Adapter resource shows: it changes exactly when one does,
        with nothing stored (versions and aliases already change the fields)."""
        content = [
            self.id,
            self.description,
            self.create_time.isoformat(),
            self.latest_version,
            sorted(self.aliases.items()),
        ]
        return hashlib.sha256(json.dumps(content).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Version:
    adapter_id: str
    version: int
    sha256: str
    rank: int
    lora_alpha: float
    target_modules: tuple[str, ...]
    base_model: str
    size_bytes: int
    state: str  # PENDING | READY | RETIRED
    create_time: datetime
    heads: tuple[Head, ...]
    adapter_config_json: str

    @property
    def name(self) -> str:
        return names.version_name(self.adapter_id, self.version)


@dataclass(frozen=True)
class Alias:
    adapter_id: str
    alias: str
    version: int
    etag: str


@dataclass(frozen=True)
class Task:
    id: str
    adapter_ref: str
    head: str
    description: str
    accuracy_threshold: float
    measured_accuracy: float
    create_time: datetime | None = None
    # Latency objective in ms (0 = none) and its SLO class (the task's id unless named).
    slo_ms: float = 0.0
    slo_class: str = ""
    # Default early adapter release of the task's requests (GenerationParams'
    # adapter_release_fraction and adapter_release_rule; 0 and NONE = off).
    adapter_release_fraction: float = 0.0
    adapter_release_rule: ReleaseRule = ReleaseRule.NONE

    @property
    def name(self) -> str:
        return names.task_name(self.id)

    @property
    def etag(self) -> str:
        """A digest of every field the Task resource shows (as Adapter.etag): UpdateTask's
        precondition, with nothing stored."""
        content = [
            self.id,
            self.adapter_ref,
            self.head,
            self.description,
            self.accuracy_threshold,
            self.measured_accuracy,
            self.create_time.isoformat() if self.create_time else "",
            self.slo_ms,
            self.slo_class,
            self.adapter_release_fraction,
        ]
        if self.adapter_release_rule is not ReleaseRule.NONE:  # (tasks without one keep their etags)
            content.append(self.adapter_release_rule.value)
        return hashlib.sha256(json.dumps(content).encode()).hexdigest()[:32]


# Longest latency objective a task may carry: past an hour it no longer orders a queue.
MAX_SLO_MS = 3_600_000.0
# The Task fields UpdateTask may change (paths of its update_mask).
MUTABLE_TASK_FIELDS = ("description", "slo_ms", "slo_class", "adapter_release_fraction", "adapter_release_rule")


def check_slo(task_id: str, slo_ms: float, slo_class: str) -> str:
    """The SLO class a task with this objective and class is stored with (INVALID_ARGUMENT on
    task.slo_ms / task.slo_class for values CreateTask and UpdateTask refuse)."""
    if not 0.0 <= slo_ms <= MAX_SLO_MS:  # NaN fails both comparisons
        raise invalid_field("task.slo_ms", f"must be within [0, {MAX_SLO_MS:.0f}] ms (0: no objective)")
    if slo_class:
        names.check_id(slo_class, "task.slo_class")
        if slo_ms == 0:
            raise invalid_field("task.slo_class", "a class needs its objective: set task.slo_ms")
        return slo_class
    return task_id if slo_ms > 0 else ""  # stored as such, so the class shown is the label counted


def check_release_fraction(fraction: float) -> float:
    if not 0.0 <= fraction <= 1.0:  # NaN fails both comparisons
        raise invalid_field("task.adapter_release_fraction", f"{fraction} is not in [0, 1] (0: never released)")
    return fraction


def check_release_rule(value: int) -> ReleaseRule:
    """Task.adapter_release_rule (valora.v1.AdapterReleaseRule); INVALID_ARGUMENT for one this
    build does not know."""
    try:
        return ReleaseRule.from_pb(value)
    except ValueError:
        raise invalid_field("task.adapter_release_rule", f"unknown rule {value}") from None


@dataclass(frozen=True)
class Resolution:
    version: Version
    task: Task | None = None


@dataclass(frozen=True)
class Page(Generic[T]):
    items: list[T]
    next_page_token: str


@dataclass(frozen=True)
class PageRequest:
    size: int
    after: str | int | None

    @classmethod
    def parse(cls, page_size: int, page_token: str) -> "PageRequest":
        """page_size 0 means 50, larger than 1000 is coerced to 1000 (AIP-158); the token is
        opaque to clients (base64 of the last key served)."""
        if page_size < 0:
            raise invalid_field("page_size", "must not be negative")
        size = DEFAULT_PAGE_SIZE if page_size == 0 else min(page_size, MAX_PAGE_SIZE)
        if not page_token:
            return cls(size, None)
        try:
            after = json.loads(base64.urlsafe_b64decode(page_token.encode()))["after"]
            if not isinstance(after, (str, int)):
                raise ValueError(after)
        except Exception as exc:  # any garbage token is the client's error
            raise invalid_field("page_token", "not a token returned by a previous List call") from exc
        return cls(size, after)


def page_token(after: str | int) -> str:
    return base64.urlsafe_b64encode(json.dumps({"after": after}).encode()).decode()


@dataclass(frozen=True)
class GcReport:
    pending_removed: list[str]
    blobs_removed: list[str]


@dataclass(frozen=True)
class Dataset:
    """A dataset archive uploaded for generation jobs ("datasets/{sha256}")."""

    sha256: str
    size: int
