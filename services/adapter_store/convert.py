"""Protobuf <-> domain conversion: the only module of the store that knows both."""

from __future__ import annotations

from datetime import UTC, datetime

from google.protobuf import timestamp_pb2

from valora.v1 import admin_service_pb2 as admin_pb
from valora.v1 import resources_pb2 as res_pb

from services.common import names
from services.common.errors import invalid_field

from services.adapter_store.domain import Adapter, Head, Task, Version
from services.adapter_store.validation import UploadRequest, normalize_sha256

_STATES = {
    "PENDING": res_pb.ADAPTER_VERSION_STATE_PENDING,
    "READY": res_pb.ADAPTER_VERSION_STATE_READY,
    "RETIRED": res_pb.ADAPTER_VERSION_STATE_RETIRED,
}


def timestamp(value: datetime | None) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    if value is not None:
        ts.FromDatetime(value.replace(tzinfo=UTC) if value.tzinfo is None else value)
    return ts


def adapter_to_pb(a: Adapter) -> res_pb.Adapter:
    return res_pb.Adapter(
        name=a.name, description=a.description, create_time=timestamp(a.create_time),
        aliases={k: names.version_name(a.id, v) for k, v in a.aliases.items()},
        latest_version=a.latest_version,
    )


def version_to_pb(v: Version) -> res_pb.AdapterVersion:
    return res_pb.AdapterVersion(
        name=v.name, sha256=v.sha256, rank=v.rank, lora_alpha=v.lora_alpha,
        target_modules=list(v.target_modules), base_model=v.base_model, size_bytes=v.size_bytes,
        state=_STATES[v.state], create_time=timestamp(v.create_time),
        heads=[res_pb.TaskHead(name=h.name, labels=list(h.labels)) for h in v.heads],
    )


def task_to_pb(t: Task) -> res_pb.Task:
    return res_pb.Task(
        name=t.name, adapter=t.adapter_ref, head=t.head, description=t.description,
        accuracy_threshold=t.accuracy_threshold, measured_accuracy=t.measured_accuracy,
        create_time=timestamp(t.create_time),
    )


def task_from_pb(task_id: str, t: res_pb.Task) -> Task:
    names.check_id(task_id, "task_id")
    if t.name and t.name != names.task_name(task_id):
        raise invalid_field("task.name", f"must be empty or {names.task_name(task_id)!r}")
    names.parse_adapter_ref(t.adapter, "task.adapter")
    if t.head:
        names.check_id(t.head.replace("_", "-"), "task.head")
    for field_name in ("accuracy_threshold", "measured_accuracy"):
        value = getattr(t, field_name)
        if not 0.0 <= value <= 1.0:
            raise invalid_field(f"task.{field_name}", "must be within [0, 1]")
    return Task(task_id, t.adapter, t.head, t.description, t.accuracy_threshold, t.measured_accuracy)


def upload_from_pb(m: admin_pb.UploadAdapterVersionMetadata) -> UploadRequest:
    adapter_id = names.parse_adapter_name(m.parent, "metadata.parent")
    heads = []
    for i, h in enumerate(m.heads):
        if not h.name:
            raise invalid_field(f"metadata.heads[{i}].name", "must not be empty")
        if not h.labels:
            raise invalid_field(f"metadata.heads[{i}].labels", "a head needs its labels")
        heads.append(Head(h.name, tuple(h.labels)))
    return UploadRequest(adapter_id, m.adapter_config_json, normalize_sha256(m.sha256), m.request_id or None,
                         tuple(heads))
