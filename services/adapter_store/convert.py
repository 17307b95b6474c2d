"""Protobuf <-> domain conversion: the only module of the store that knows both."""

from __future__ import annotations

from datetime import UTC, datetime

from google.protobuf import json_format, timestamp_pb2

from valora_protos.internal.v1 import adapter_store_service_pb2 as store_pb
from valora_protos.v1 import admin_service_pb2 as admin_pb
from valora_protos.v1 import resources_pb2 as res_pb

from services.common import names
from services.common.errors import invalid_field

from services.adapter_store.domain import (
    MUTABLE_TASK_FIELDS,
    Adapter,
    Dataset,
    Head,
    Task,
    Version,
    check_release_fraction,
    check_release_rule,
    check_slo,
)
from services.adapter_store.jobs import (
    FUSION_ORDERS,
    Job,
    JobResult,
    JobSource,
    JobSpec,
    TaskOutcome,
    dataset_name,
    parse_dataset_name,
)
from services.adapter_store.tile_tables import StoredTileTable
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
        name=a.name,
        description=a.description,
        create_time=timestamp(a.create_time),
        aliases={k: names.version_name(a.id, v) for k, v in a.aliases.items()},
        latest_version=a.latest_version,
        etag=a.etag,
    )


def version_to_pb(v: Version) -> res_pb.AdapterVersion:
    return res_pb.AdapterVersion(
        name=v.name,
        sha256=v.sha256,
        rank=v.rank,
        lora_alpha=v.lora_alpha,
        target_modules=list(v.target_modules),
        base_model=v.base_model,
        size_bytes=v.size_bytes,
        state=_STATES[v.state],
        create_time=timestamp(v.create_time),
        heads=[res_pb.TaskHead(name=h.name, labels=list(h.labels)) for h in v.heads],
    )


def task_to_pb(t: Task) -> res_pb.Task:
    return res_pb.Task(
        name=t.name,
        adapter=t.adapter_ref,
        head=t.head,
        description=t.description,
        accuracy_threshold=t.accuracy_threshold,
        measured_accuracy=t.measured_accuracy,
        create_time=timestamp(t.create_time),
        slo_ms=t.slo_ms,
        slo_class=t.slo_class,
        etag=t.etag,
        adapter_release_fraction=t.adapter_release_fraction,
        adapter_release_rule=t.adapter_release_rule.to_pb(),
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
    slo_class = check_slo(task_id, t.slo_ms, t.slo_class)
    return Task(
        task_id,
        t.adapter,
        t.head,
        t.description,
        t.accuracy_threshold,
        t.measured_accuracy,
        slo_ms=t.slo_ms,
        slo_class=slo_class,
        adapter_release_fraction=check_release_fraction(t.adapter_release_fraction),
        adapter_release_rule=check_release_rule(t.adapter_release_rule),
    )


def task_update_from_pb(r: admin_pb.UpdateTaskRequest) -> tuple[str, dict[str, object]]:
    """UpdateTask's task id and the new values of the fields its update_mask names (checked one by
    one here; together, on the task as it will be, by the registry)."""
    task_id = names.parse_task_name(r.task.name, "task.name")
    paths = list(r.update_mask.paths)
    if not paths:
        raise invalid_field("update_mask", f"name the fields to change, of {', '.join(MUTABLE_TASK_FIELDS)}")
    changes: dict[str, object] = {}
    for path in paths:
        if path not in MUTABLE_TASK_FIELDS:
            raise invalid_field("update_mask", f"{path!r} cannot be updated (only {', '.join(MUTABLE_TASK_FIELDS)})")
        value = getattr(r.task, path)
        changes[path] = check_release_rule(value) if path == "adapter_release_rule" else value
    return task_id, changes


def upload_from_pb(m: admin_pb.UploadAdapterVersionMetadata) -> UploadRequest:
    adapter_id = names.parse_adapter_name(m.parent, "metadata.parent")
    heads = []
    for i, h in enumerate(m.heads):
        if not h.name:
            raise invalid_field(f"metadata.heads[{i}].name", "must not be empty")
        if not h.labels:
            raise invalid_field(f"metadata.heads[{i}].labels", "a head needs its labels")
        heads.append(Head(h.name, tuple(h.labels)))
    return UploadRequest(
        adapter_id, m.adapter_config_json, normalize_sha256(m.sha256), m.request_id or None, tuple(heads)
    )


# ---------------------------------------------------------------------------------- generation jobs

_JOB_STATES = {
    "PENDING": res_pb.GENERATION_JOB_STATE_PENDING,
    "RUNNING": res_pb.GENERATION_JOB_STATE_RUNNING,
    "SUCCEEDED": res_pb.GENERATION_JOB_STATE_SUCCEEDED,
    "FAILED": res_pb.GENERATION_JOB_STATE_FAILED,
    "CANCELLED": res_pb.GENERATION_JOB_STATE_CANCELLED,
}
_JOB_STATE_NAMES = {v: k for k, v in _JOB_STATES.items()}
MAX_RANK = 256


def dataset_to_pb(d: Dataset) -> res_pb.Dataset:
    return res_pb.Dataset(name=dataset_name(d.sha256), sha256=d.sha256, size_bytes=d.size)


def job_to_pb(j: Job) -> res_pb.GenerationJob:
    return res_pb.GenerationJob(
        name=j.name,
        base_model=j.spec.base_model,
        sources=[
            res_pb.GenerationSource(task=s.task, accuracy_threshold=s.accuracy_threshold, dataset=s.dataset)
            for s in j.spec.sources
        ],
        rank=j.spec.rank,
        epochs=j.spec.epochs,
        adapter_prefix=j.spec.adapter_prefix,
        split_limit=j.spec.split_limit,
        fusion_order=j.spec.fusion_order,
        state=_JOB_STATES[j.state],
        progress=j.progress,
        message=j.message,
        result=job_result_to_pb(j.result),
        error=j.error,
        create_time=timestamp(j.create_time),
        update_time=timestamp(j.update_time),
    )


def job_result_to_pb(r: JobResult) -> res_pb.GenerationJobResult:
    return res_pb.GenerationJobResult(
        adapter_versions=list(r.adapter_versions),
        tasks=[
            res_pb.GenerationTaskResult(
                task=t.task,
                adapter_version=t.adapter_version,
                accuracy_threshold=t.accuracy_threshold,
                measured_accuracy=t.measured_accuracy,
            )
            for t in r.tasks
        ],
        fused_order=list(r.fused_order),
        probe=json_format.ParseDict(r.probe, res_pb.GenerationProbe(), ignore_unknown_fields=True) if r.probe else None,
    )


def job_result_from_pb(r: res_pb.GenerationJobResult) -> JobResult:
    return JobResult(
        tuple(r.adapter_versions),
        tuple(TaskOutcome(t.task, t.adapter_version, t.accuracy_threshold, t.measured_accuracy) for t in r.tasks),
        tuple(r.fused_order),
        json_format.MessageToDict(r.probe, preserving_proto_field_name=True) if r.HasField("probe") else {},
    )


def job_state_from_pb(state: int) -> str:
    if state not in _JOB_STATE_NAMES:
        raise invalid_field("state", "must be set")
    return _JOB_STATE_NAMES[state]


def job_spec_from_pb(job_id: str, j: res_pb.GenerationJob) -> JobSpec:
    """Checks the job's inputs (output fields are ignored). Task names are checked by the runner,
    which owns the task catalogue; here they only need to be valid ids and distinct."""
    if job_id:
        names.check_id(job_id, "job_id")
    if not j.base_model:
        raise invalid_field("job.base_model", "must name the base model's path")
    if not j.sources:
        raise invalid_field("job.sources", "needs at least one source")
    seen = set()
    for i, s in enumerate(j.sources):
        names.check_id(s.task, f"job.sources[{i}].task")
        if s.task in seen:
            raise invalid_field(f"job.sources[{i}].task", f"{s.task!r} appears twice")
        seen.add(s.task)
        if not 0.0 <= s.accuracy_threshold <= 1.0:
            raise invalid_field(f"job.sources[{i}].accuracy_threshold", "must be within [0, 1]")
        if s.dataset:
            parse_dataset_name(s.dataset, f"job.sources[{i}].dataset")
    if not 0 <= j.rank <= MAX_RANK:
        raise invalid_field("job.rank", f"must be within [0, {MAX_RANK}] (0 means 8)")
    if j.epochs < 0 or j.split_limit < 0:
        raise invalid_field("job.epochs" if j.epochs < 0 else "job.split_limit", "must not be negative")
    if j.adapter_prefix:
        names.check_id(j.adapter_prefix, "job.adapter_prefix")
    if j.fusion_order not in FUSION_ORDERS:
        raise invalid_field("job.fusion_order", 'must be "given" (or empty) or "probed"')
    return JobSpec(
        j.base_model,
        tuple(JobSource(s.task, s.accuracy_threshold, s.dataset) for s in j.sources),
        j.rank or 8,
        j.epochs or 4,
        j.adapter_prefix,
        j.split_limit,
        j.fusion_order or "given",
    )


def tile_table_to_pb(t: StoredTileTable) -> store_pb.TileTable:
    return store_pb.TileTable(
        gpu_name=t.gpu_name,
        gpu_arch=t.gpu_arch,
        dtype=t.dtype,
        table_json=t.table_json,
        sha256=t.sha256,
        create_time=timestamp(t.created_at),
        update_time=timestamp(t.updated_at),
    )
