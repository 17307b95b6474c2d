"""Resource names: the one place that parses and formats `adapters/…` and `tasks/…`."""

from __future__ import annotations

import re
from dataclasses import dataclass

from services.common.errors import invalid_field

ID_RE = r"[a-z][a-z0-9-]{0,62}"
_ADAPTER = re.compile(
    rf"^adapters/(?P<adapter>{ID_RE})"
    rf"(?:/versions/(?P<version>[1-9][0-9]{{0,9}})|@(?P<alias>{ID_RE}))?$"
)
_TASK = re.compile(rf"^tasks/(?P<task>{ID_RE})$")


@dataclass(frozen=True)
class AdapterRefName:
    """A parsed adapter reference: exactly one of version/alias, or neither (= latest)."""

    adapter: str
    version: int | None = None
    alias: str | None = None

    @property
    def adapter_name(self) -> str:
        return f"adapters/{self.adapter}"


def adapter_name(adapter_id: str) -> str:
    return f"adapters/{adapter_id}"


def version_name(adapter_id: str, version: int) -> str:
    return f"adapters/{adapter_id}/versions/{version}"


def task_name(task_id: str) -> str:
    return f"tasks/{task_id}"


def check_id(value: str, field_path: str) -> str:
    if not re.fullmatch(ID_RE, value or ""):
        raise invalid_field(field_path, f"{value!r} must match {ID_RE}")
    return value


def parse_adapter_ref(value: str, field_path: str = "adapter") -> AdapterRefName:
    m = _ADAPTER.fullmatch(value or "")
    if not m:
        raise invalid_field(
            field_path,
            f"{value!r} is not adapters/{{adapter}}, adapters/{{adapter}}/versions/{{n}} "
            "or adapters/{adapter}@{alias}",
        )
    return AdapterRefName(m["adapter"], int(m["version"]) if m["version"] else None, m["alias"])


def parse_version_name(value: str, field_path: str = "name") -> tuple[str, int]:
    ref = parse_adapter_ref(value, field_path)
    if ref.version is None:
        raise invalid_field(field_path, f"{value!r} is not adapters/{{adapter}}/versions/{{n}}")
    return ref.adapter, ref.version


def parse_adapter_name(value: str, field_path: str = "name") -> str:
    ref = parse_adapter_ref(value, field_path)
    if ref.version is not None or ref.alias is not None:
        raise invalid_field(field_path, f"{value!r} is not adapters/{{adapter}}")
    return ref.adapter


def parse_task_name(value: str, field_path: str = "task") -> str:
    m = _TASK.fullmatch(value or "")
    if not m:
        raise invalid_field(field_path, f"{value!r} is not tasks/{{task}}")
    return m["task"]
