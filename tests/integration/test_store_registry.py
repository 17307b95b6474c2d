"""The registry suite: the store over a real gRPC channel, on SQLite + local dir and on
PostgreSQL + S3 (moto_server) — see conftest.store_env."""

from __future__ import annotations

import hashlib
import json
import pickle
from datetime import timedelta

import grpc
import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from google.protobuf import field_mask_pb2
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from valora_protos.internal.v1 import adapter_store_service_pb2 as store_pb
from valora_protos.v1 import admin_service_pb2 as admin_pb
from valora_protos.v1 import resources_pb2 as res_pb
from valora_protos.v1 import types_pb2

from services.adapter_store import db
from services.adapter_store.models import Base, utcnow
from services.adapter_store.server import build_registry
from services.adapter_store.testing import (
    TINY_CONFIG,
    RunningStore,
    adapter_config,
    make_bundle,
    safetensors_bytes,
    upload_messages,
)

READY = res_pb.ADAPTER_VERSION_STATE_READY
RETIRED = res_pb.ADAPTER_VERSION_STATE_RETIRED


@pytest.fixture
def store(store_env):
    with RunningStore(
        store_env.settings(fetch_chunk_bytes=4096, max_rank=16, max_header_bytes=64 * 1024, max_bundle_bytes=256 * 1024)
    ) as rs:
        yield rs


def upload(rs, parent="adapters/demo", data=None, **kw):
    data = make_bundle() if data is None else data
    return rs.admin.UploadAdapterVersion(upload_messages(parent, data, **kw)).version


def error_of(call, *args):
    with pytest.raises(grpc.RpcError) as info:
        call(*args)
    err = info.value
    status = rpc_status.from_call(err)
    reason, fields = "", []
    for d in status.details if status else []:
        if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            ei = error_details_pb2.ErrorInfo()
            d.Unpack(ei)
            reason = ei.reason
        elif d.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            br = error_details_pb2.BadRequest()
            d.Unpack(br)
            fields = [v.field for v in br.field_violations]
    return err.code(), reason, fields, err.details()


def test_migrations_match_models(store_env):
    engine = db.make_engine(store_env.settings().database_url)
    try:
        db.upgrade(engine)
        db.upgrade(engine)  # idempotent
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
        assert diff == []
    finally:
        engine.dispose()


def test_register_resolve_fetch(store):
    data = make_bundle(heads={"cls": 3}, seed=1)
    sha = hashlib.sha256(data).hexdigest()
    v = upload(store, data=data, sha256=sha, heads={"cls": ["cat", "dog", "bird"]}, request_id="r-1")
    assert v.name == "adapters/demo/versions/1"
    assert (v.sha256, v.size_bytes, v.rank, v.lora_alpha, v.state) == (sha, len(data), 4, 8.0, READY)
    assert list(v.target_modules) == ["q_proj", "v_proj"]
    assert [(h.name, list(h.labels)) for h in v.heads] == [("cls", ["cat", "dog", "bird"])]
    assert v.base_model == "model"

    for ref in ("adapters/demo", "adapters/demo/versions/1"):
        assert store.store.ResolveReference(store_pb.ResolveReferenceRequest(reference=ref)).version == v
    parts = list(store.store.FetchAdapter(store_pb.FetchAdapterRequest(version=v.name)))
    assert parts[0].WhichOneof("part") == "metadata"
    assert parts[0].metadata.version == v
    assert parts[0].metadata.adapter_config_json == adapter_config()
    assert len(parts) > 2  # chunked (fetch_chunk_bytes=4096)
    assert b"".join(p.chunk for p in parts[1:]) == data

    v2 = upload(store, data=make_bundle(seed=2))
    assert v2.name == "adapters/demo/versions/2"
    latest = store.store.ResolveReference(store_pb.ResolveReferenceRequest(reference="adapters/demo")).version
    assert latest.name == v2.name
    got = store.admin.GetAdapter(admin_pb.GetAdapterRequest(name="adapters/demo")).adapter
    assert got.latest_version == 2


def test_upload_retry_is_idempotent(store):
    data = make_bundle(seed=3)
    first = upload(store, data=data, request_id="same")
    again = upload(store, data=data, request_id="same")
    assert again == first
    assert store.admin.GetAdapter(admin_pb.GetAdapterRequest(name="adapters/demo")).adapter.latest_version == 1
    sha = hashlib.sha256(data).hexdigest()
    assert upload(store, data=b"", sha256=sha, request_id="same") == first  # named bytes: no re-send
    code, reason, _, _ = error_of(lambda: upload(store, data=make_bundle(seed=4), request_id="same"))
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "REQUEST_ID_REUSED")


def test_create_adapter(store):
    req = admin_pb.CreateAdapterRequest(adapter_id="vqa", description="visual QA", request_id="c-1")
    a = store.admin.CreateAdapter(req).adapter
    assert (a.name, a.description, a.latest_version) == ("adapters/vqa", "visual QA", 0)
    assert store.admin.CreateAdapter(req).adapter == a  # retry
    code, reason, _, _ = error_of(store.admin.CreateAdapter, admin_pb.CreateAdapterRequest(adapter_id="vqa"))
    assert (code, reason) == (grpc.StatusCode.ALREADY_EXISTS, "ADAPTER_EXISTS")
    code, _, fields, _ = error_of(store.admin.CreateAdapter, admin_pb.CreateAdapterRequest(adapter_id="Bad_Id"))
    assert (code, fields) == (grpc.StatusCode.INVALID_ARGUMENT, ["adapter_id"])
    assert store.admin.GetAdapter(admin_pb.GetAdapterRequest(name="adapters/vqa")).adapter == a


def test_alias_moves_with_etag(store):
    v1 = upload(store, data=make_bundle(seed=5))
    v2 = upload(store, data=make_bundle(seed=6))
    set1 = store.admin.SetAlias(admin_pb.SetAliasRequest(adapter="adapters/demo", alias="prod", version=v1.name))
    assert (set1.alias, set1.version) == ("prod", v1.name) and set1.etag
    resolved = store.store.ResolveReference(store_pb.ResolveReferenceRequest(reference="adapters/demo@prod"))
    assert resolved.version.name == v1.name

    moved = store.admin.SetAlias(
        admin_pb.SetAliasRequest(adapter="adapters/demo", alias="prod", version=v2.name, etag=set1.etag)
    )
    assert moved.version == v2.name and moved.etag != set1.etag
    code, reason, _, _ = error_of(
        store.admin.SetAlias,
        admin_pb.SetAliasRequest(adapter="adapters/demo", alias="prod", version=v1.name, etag=set1.etag),
    )
    assert (code, reason) == (grpc.StatusCode.ABORTED, "ETAG_MISMATCH")
    resolved = store.store.ResolveReference(store_pb.ResolveReferenceRequest(reference="adapters/demo@prod"))
    assert resolved.version.name == v2.name
    aliases = store.admin.GetAdapter(admin_pb.GetAdapterRequest(name="adapters/demo")).adapter.aliases
    assert dict(aliases) == {"prod": v2.name}

    # A version an alias points at cannot be retired; once the alias is gone it can.
    code, reason, _, _ = error_of(store.admin.DeleteAdapterVersion, admin_pb.DeleteAdapterVersionRequest(name=v2.name))
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "VERSION_IN_USE")
    store.admin.DeleteAlias(admin_pb.DeleteAliasRequest(adapter="adapters/demo", alias="prod"))
    store.admin.DeleteAdapterVersion(admin_pb.DeleteAdapterVersionRequest(name=v2.name))
    got = store.admin.GetAdapterVersion(admin_pb.GetAdapterVersionRequest(name=v2.name)).version
    assert got.state == RETIRED
    latest = store.store.ResolveReference(store_pb.ResolveReferenceRequest(reference="adapters/demo")).version
    assert latest.name == v1.name
    code, _, _, _ = error_of(store.store.ResolveReference, store_pb.ResolveReferenceRequest(reference=v2.name))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    code, reason, _, _ = error_of(
        store.store.ResolveReference, store_pb.ResolveReferenceRequest(reference="adapters/demo@prod")
    )
    assert (code, reason) == (grpc.StatusCode.NOT_FOUND, "ALIAS_NOT_FOUND")
    code, _, _, _ = error_of(
        store.admin.SetAlias, admin_pb.SetAliasRequest(adapter="adapters/demo", alias="prod", version=v2.name)
    )  # retired: not READY
    assert code == grpc.StatusCode.FAILED_PRECONDITION


def test_pagination(store):
    ids = [f"a{i}" for i in range(5)]
    for i in ids:
        store.admin.CreateAdapter(admin_pb.CreateAdapterRequest(adapter_id=i))
    seen, token, pages = [], "", 0
    while True:
        resp = store.admin.ListAdapters(admin_pb.ListAdaptersRequest(page_size=2, page_token=token))
        assert len(resp.adapters) <= 2
        seen += [a.name for a in resp.adapters]
        pages += 1
        token = resp.next_page_token
        if not token:
            break
    assert seen == [f"adapters/{i}" for i in ids] and pages == 3
    assert len(store.admin.ListAdapters(admin_pb.ListAdaptersRequest(page_size=5000)).adapters) == 5
    assert not store.admin.ListAdapters(admin_pb.ListAdaptersRequest()).next_page_token

    for seed in range(3):
        upload(store, parent="adapters/a0", data=make_bundle(seed=10 + seed))
    first = store.admin.ListAdapterVersions(admin_pb.ListAdapterVersionsRequest(parent="adapters/a0", page_size=2))
    assert [v.name for v in first.versions] == ["adapters/a0/versions/1", "adapters/a0/versions/2"]
    rest = store.admin.ListAdapterVersions(
        admin_pb.ListAdapterVersionsRequest(parent="adapters/a0", page_size=2, page_token=first.next_page_token)
    )
    assert [v.name for v in rest.versions] == ["adapters/a0/versions/3"] and not rest.next_page_token

    code, _, fields, _ = error_of(store.admin.ListAdapters, admin_pb.ListAdaptersRequest(page_token="garbage!"))
    assert (code, fields) == (grpc.StatusCode.INVALID_ARGUMENT, ["page_token"])
    code, _, fields, _ = error_of(store.admin.ListTasks, admin_pb.ListTasksRequest(page_size=-1))
    assert (code, fields) == (grpc.StatusCode.INVALID_ARGUMENT, ["page_size"])


def _pickle_bomb(marker) -> bytes:
    class Bomb:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    return pickle.dumps(Bomb())


def test_validation_rejections(store, tmp_path):
    marker = tmp_path / "unpickled.marker"
    bad_shapes = dict(TINY_CONFIG, hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    cases = {
        "NOT_SAFETENSORS": dict(data=_pickle_bomb(marker)),
        "HEADER_TOO_LARGE": dict(data=make_bundle(header_pad=70 * 1024)),
        "UNKNOWN_TENSOR": dict(data=safetensors_bytes({"model.layers.0.q_proj.weight": ("F32", [4, 4])})),
        "BAD_SHAPE": dict(data=make_bundle(config=bad_shapes)),
        "RANK_TOO_LARGE": dict(data=make_bundle(rank=32), config_json=adapter_config(rank=32)),
        "BAD_DTYPE": dict(data=make_bundle(dtype="F64")),
        "BUNDLE_TOO_LARGE": dict(
            data=make_bundle(
                rank=16, modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
            )
            * 4,
            config_json=adapter_config(rank=16),
        ),
        "CHECKSUM_MISMATCH": dict(sha256="0" * 64),
        "HEAD_MISSING": dict(heads={"nope": ["x"]}),
        "HEAD_LABELS_MISMATCH": dict(data=make_bundle(heads={"cls": 3}), heads={"cls": ["a", "b"]}),
        "BAD_CONFIG": dict(config_json="{not json"),
    }
    for reason, kw in cases.items():
        code, got, _, message = error_of(lambda: upload(store, parent="adapters/bad", **kw))
        assert (code, got) == (grpc.StatusCode.INVALID_ARGUMENT, reason), message
    assert not marker.exists()
    # Nothing was registered, and no blob was written.
    code, _, _, _ = error_of(store.store.ResolveReference, store_pb.ResolveReferenceRequest(reference="adapters/bad"))
    assert code == grpc.StatusCode.NOT_FOUND
    registry = build_registry(store.settings.model_copy(update={"run_migrations": False}))
    try:
        assert list(registry.blobs.list()) == []
    finally:
        registry.close()


def test_names_are_checked(store):
    code, _, fields, _ = error_of(store.admin.GetAdapter, admin_pb.GetAdapterRequest(name="adapter/x"))
    assert (code, fields) == (grpc.StatusCode.INVALID_ARGUMENT, ["name"])
    code, _, fields, _ = error_of(
        store.store.ResolveReference, store_pb.ResolveReferenceRequest(reference="adapters/x/versions/0")
    )
    assert (code, fields) == (grpc.StatusCode.INVALID_ARGUMENT, ["reference"])
    code, _, fields, _ = error_of(lambda: upload(store, parent="adapters/Nope"))
    assert (code, fields) == (grpc.StatusCode.INVALID_ARGUMENT, ["metadata.parent"])
    for ref in ("adapters/ghost", "adapters/ghost/versions/3", "adapters/ghost@prod", "tasks/ghost"):
        code, _, _, _ = error_of(store.store.ResolveReference, store_pb.ResolveReferenceRequest(reference=ref))
        assert code == grpc.StatusCode.NOT_FOUND, ref
    code, _, _, _ = error_of(store.admin.GetTask, admin_pb.GetTaskRequest(name="tasks/ghost"))
    assert code == grpc.StatusCode.NOT_FOUND
    code, _, _, _ = error_of(store.admin.GetClusterStatus, admin_pb.GetClusterStatusRequest())
    assert code == grpc.StatusCode.UNIMPLEMENTED


def test_tasks(store):
    v1 = upload(store, data=make_bundle(heads={"cls": 2}, seed=20), heads={"cls": ["yes", "no"]})
    store.admin.SetAlias(admin_pb.SetAliasRequest(adapter="adapters/demo", alias="prod", version=v1.name))
    task = res_pb.Task(
        adapter="adapters/demo@prod",
        head="cls",
        description="is there a car",
        accuracy_threshold=0.9,
        measured_accuracy=0.95,
    )
    created = store.admin.CreateTask(admin_pb.CreateTaskRequest(task_id="car", task=task)).task
    assert (created.name, created.adapter, created.head) == ("tasks/car", "adapters/demo@prod", "cls")
    assert abs(created.accuracy_threshold - 0.9) < 1e-6
    code, _, _, _ = error_of(store.admin.CreateTask, admin_pb.CreateTaskRequest(task_id="car", task=task))
    assert code == grpc.StatusCode.ALREADY_EXISTS

    r = store.store.ResolveReference(store_pb.ResolveReferenceRequest(reference="tasks/car"))
    assert r.version.name == v1.name and r.task.name == "tasks/car" and r.task.head == "cls"

    code, _, fields, _ = error_of(
        store.admin.CreateTask,
        admin_pb.CreateTaskRequest(task_id="t2", task=res_pb.Task(adapter="adapters/demo", head="nohead")),
    )
    assert (code, fields) == (grpc.StatusCode.INVALID_ARGUMENT, ["task.head"])
    code, _, _, _ = error_of(
        store.admin.CreateTask, admin_pb.CreateTaskRequest(task_id="t3", task=res_pb.Task(adapter="adapters/ghost"))
    )
    assert code == grpc.StatusCode.NOT_FOUND
    code, _, fields, _ = error_of(
        store.admin.CreateTask,
        admin_pb.CreateTaskRequest(task_id="t4", task=res_pb.Task(adapter="adapters/demo", accuracy_threshold=1.5)),
    )
    assert (code, fields) == (grpc.StatusCode.INVALID_ARGUMENT, ["task.accuracy_threshold"])
    store.admin.CreateTask(admin_pb.CreateTaskRequest(task_id="caption", task=res_pb.Task(adapter=v1.name)))

    listed = store.admin.ListTasks(admin_pb.ListTasksRequest(page_size=1))
    assert [t.name for t in listed.tasks] == ["tasks/caption"] and listed.next_page_token

    # The alias and the versions tasks resolve to are protected.
    code, reason, _, _ = error_of(
        store.admin.DeleteAlias, admin_pb.DeleteAliasRequest(adapter="adapters/demo", alias="prod")
    )
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "ALIAS_IN_USE")
    code, _, _, _ = error_of(store.admin.DeleteAdapter, admin_pb.DeleteAdapterRequest(name="adapters/demo"))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    store.admin.DeleteTask(admin_pb.DeleteTaskRequest(name="tasks/car"))
    store.admin.DeleteTask(admin_pb.DeleteTaskRequest(name="tasks/caption"))
    code, _, _, _ = error_of(store.admin.GetTask, admin_pb.GetTaskRequest(name="tasks/car"))
    assert code == grpc.StatusCode.NOT_FOUND


def test_task_latency_objective_round_trips(store):
    """A task's SLO (objective + class) is stored, listed and resolved as given; one class keeps one
    objective; a class defaults to the task's id; bad objectives are refused field by field."""
    v1 = upload(store, data=make_bundle(heads={"cls": 2}, seed=21), heads={"cls": ["yes", "no"]})
    create = store.admin.CreateTask
    count = create(
        admin_pb.CreateTaskRequest(
            task_id="count", task=res_pb.Task(adapter="adapters/demo", head="cls", slo_ms=250.0, slo_class="video")
        )
    ).task
    assert (count.slo_ms, count.slo_class) == (250.0, "video")
    create(
        admin_pb.CreateTaskRequest(
            task_id="detect", task=res_pb.Task(adapter=v1.name, head="cls", slo_ms=250.0, slo_class="video")
        )
    )
    own = create(
        admin_pb.CreateTaskRequest(task_id="ask", task=res_pb.Task(adapter="adapters/demo", slo_ms=2000.5))
    ).task
    assert (own.slo_ms, own.slo_class) == (2000.5, "ask")  # the task's id names its class
    plain = create(admin_pb.CreateTaskRequest(task_id="plain", task=res_pb.Task(adapter="adapters/demo"))).task
    assert (plain.slo_ms, plain.slo_class) == (0.0, "")

    got = store.admin.GetTask(admin_pb.GetTaskRequest(name="tasks/count")).task
    assert (got.slo_ms, got.slo_class) == (250.0, "video")
    listed = {t.name: (t.slo_ms, t.slo_class) for t in store.admin.ListTasks(admin_pb.ListTasksRequest()).tasks}
    assert listed == {
        "tasks/count": (250.0, "video"),
        "tasks/detect": (250.0, "video"),
        "tasks/ask": (2000.5, "ask"),
        "tasks/plain": (0.0, ""),
    }
    r = store.store.ResolveReference(store_pb.ResolveReferenceRequest(reference="tasks/detect"))
    assert (r.task.slo_ms, r.task.slo_class) == (250.0, "video")  # what the gateway hands the scheduler

    code, reason, _, _ = error_of(
        create,
        admin_pb.CreateTaskRequest(
            task_id="track", task=res_pb.Task(adapter="adapters/demo", slo_ms=500.0, slo_class="video")
        ),
    )
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "SLO_CLASS_OBJECTIVE_MISMATCH")
    for task, field in (
        (res_pb.Task(adapter="adapters/demo", slo_ms=-1.0), "task.slo_ms"),
        (res_pb.Task(adapter="adapters/demo", slo_ms=float("nan")), "task.slo_ms"),
        (res_pb.Task(adapter="adapters/demo", slo_ms=4e6), "task.slo_ms"),
        (res_pb.Task(adapter="adapters/demo", slo_class="video"), "task.slo_class"),
        (res_pb.Task(adapter="adapters/demo", slo_ms=10.0, slo_class="Video!"), "task.slo_class"),
    ):
        code, _, fields, _ = error_of(create, admin_pb.CreateTaskRequest(task_id="bad", task=task))
        assert (code, fields) == (grpc.StatusCode.INVALID_ARGUMENT, [field]), task


def test_delete_adapter_retires_and_numbers_never_repeat(store):
    v1 = upload(store, data=make_bundle(seed=30))
    store.admin.SetAlias(admin_pb.SetAliasRequest(adapter="adapters/demo", alias="prod", version=v1.name))
    store.admin.DeleteAdapter(admin_pb.DeleteAdapterRequest(name="adapters/demo"))
    code, _, _, _ = error_of(store.admin.GetAdapter, admin_pb.GetAdapterRequest(name="adapters/demo"))
    assert code == grpc.StatusCode.NOT_FOUND
    assert store.admin.GetAdapterVersion(admin_pb.GetAdapterVersionRequest(name=v1.name)).version.state == RETIRED
    v2 = upload(store, data=make_bundle(seed=31))  # re-creates the adapter
    assert v2.name == "adapters/demo/versions/2"
    assert dict(store.admin.GetAdapter(admin_pb.GetAdapterRequest(name="adapters/demo")).adapter.aliases) == {}


def test_delete_adapter_with_a_stale_etag_is_aborted(store):
    """Adapter.etag changes with the resource (a version registered, an alias moved); a delete
    guarded by an etag read before another admin's change is ABORTED and deletes nothing."""
    v1 = upload(store, data=make_bundle(seed=32))
    read = store.admin.GetAdapter(admin_pb.GetAdapterRequest(name="adapters/demo")).adapter
    again = store.admin.GetAdapter(admin_pb.GetAdapterRequest(name="adapters/demo")).adapter
    assert read.etag and read.etag == again.etag  # stable while nothing changes
    store.admin.SetAlias(admin_pb.SetAliasRequest(adapter="adapters/demo", alias="prod", version=v1.name))
    moved = store.admin.GetAdapter(admin_pb.GetAdapterRequest(name="adapters/demo")).adapter
    assert moved.etag != read.etag
    code, reason, _, _ = error_of(
        store.admin.DeleteAdapter, admin_pb.DeleteAdapterRequest(name="adapters/demo", etag=read.etag)
    )
    assert (code, reason) == (grpc.StatusCode.ABORTED, "ETAG_MISMATCH")
    assert store.admin.GetAdapter(admin_pb.GetAdapterRequest(name="adapters/demo")).adapter.aliases["prod"] == v1.name
    v2 = upload(store, data=make_bundle(seed=33))
    assert store.admin.GetAdapter(admin_pb.GetAdapterRequest(name="adapters/demo")).adapter.etag != moved.etag
    current = store.admin.GetAdapter(admin_pb.GetAdapterRequest(name="adapters/demo")).adapter.etag
    store.admin.DeleteAdapter(admin_pb.DeleteAdapterRequest(name="adapters/demo", etag=current))
    assert store.admin.GetAdapterVersion(admin_pb.GetAdapterVersionRequest(name=v2.name)).version.state == RETIRED


def test_gc_removes_orphans_and_stale_pending(store):
    keep = upload(store, data=make_bundle(seed=40))
    settings = store.settings.model_copy(update={"run_migrations": False})

    class Crash(Exception):
        pass

    def crash_after_put(step):
        if step == "blob_put":
            raise Crash(step)

    registry = build_registry(settings, fault_hook=crash_after_put)
    try:
        from services.adapter_store.validation import BundleChecker, UploadRequest

        checker = BundleChecker.from_settings(settings)
        data = make_bundle(seed=41)
        req = UploadRequest("demo", adapter_config(), "", "crashy", ())
        with pytest.raises(Crash):
            registry.register(req, checker.check(req, data), "model", data)
        orphan = make_bundle(seed=42)
        orphan_sha = hashlib.sha256(orphan).hexdigest()
        registry.blobs.put(orphan_sha, orphan, len(orphan))
        pending_sha = hashlib.sha256(data).hexdigest()
        assert registry.blobs.exists(pending_sha) and registry.blobs.exists(orphan_sha)

        fresh = registry.gc(grace_s=3600)  # everything is younger than the grace period
        assert fresh.pending_removed == [] and fresh.blobs_removed == []

        report = registry.gc(grace_s=0, now=utcnow() + timedelta(seconds=5))
        assert report.pending_removed == ["adapters/demo/versions/2"]
        assert sorted(report.blobs_removed) == sorted([orphan_sha, pending_sha])
        assert registry.blobs.exists(keep.sha256)
        assert not registry.blobs.exists(orphan_sha)
    finally:
        registry.close()
    parts = list(store.store.FetchAdapter(store_pb.FetchAdapterRequest(version=keep.name)))
    assert hashlib.sha256(b"".join(p.chunk for p in parts[1:])).hexdigest() == keep.sha256
    # The PENDING row is gone; its request id registers afresh.
    again = upload(store, data=make_bundle(seed=41), request_id="crashy")
    assert again.name == "adapters/demo/versions/3" and again.state == READY


def test_concurrent_uploads_and_alias_moves(store):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        versions = list(pool.map(lambda seed: upload(store, data=make_bundle(seed=seed)), range(50, 56)))
    assert sorted(v.name for v in versions) == [f"adapters/demo/versions/{n}" for n in range(1, 7)]

    base = store.admin.SetAlias(
        admin_pb.SetAliasRequest(adapter="adapters/demo", alias="canary", version=versions[0].name)
    )

    def move(v):
        try:
            store.admin.SetAlias(
                admin_pb.SetAliasRequest(adapter="adapters/demo", alias="canary", version=v.name, etag=base.etag)
            )
            return "moved"
        except grpc.RpcError as err:
            return err.code()

    with ThreadPoolExecutor(4) as pool:
        outcomes = list(pool.map(move, versions[1:]))
    assert outcomes.count("moved") == 1
    assert outcomes.count(grpc.StatusCode.ABORTED) == len(versions) - 2


def _dataset_archive(n: int = 20_000) -> bytes:
    import io
    import tarfile

    import random

    payload = random.Random(0).randbytes(n)  # incompressible: larger than fetch_chunk_bytes (4096) packed
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo("pets/cat/0.png")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    return buf.getvalue()


def test_datasets_upload_fetch_and_live_while_a_job_names_them(store):
    """On each backend (S3 blobs, the PostgreSQL job query GC runs): a dataset archive uploaded
    in chunks is fetched back byte for byte, a job names it, and GC keeps it until the job ends."""
    data = _dataset_archive()
    sha = hashlib.sha256(data).hexdigest()

    def parts():
        yield admin_pb.UploadDatasetRequest(metadata=admin_pb.UploadDatasetMetadata(sha256=sha))
        for i in range(0, len(data), 3000):
            yield admin_pb.UploadDatasetRequest(chunk=data[i : i + 3000])

    d = store.admin.UploadDataset(parts()).dataset
    assert (d.name, d.sha256, d.size_bytes) == (f"datasets/{sha}", sha, len(data))
    chunks = [p.chunk for p in store.store.FetchDataset(store_pb.FetchDatasetRequest(name=d.name))]
    assert b"".join(chunks) == data and len(chunks) > 1
    code, reason, _, _ = error_of(
        lambda: list(store.store.FetchDataset(store_pb.FetchDatasetRequest(name="datasets/" + "f" * 64)))
    )
    assert (code, reason) == (grpc.StatusCode.NOT_FOUND, "DATASET_NOT_FOUND")

    job = store.admin.CreateGenerationJob(
        admin_pb.CreateGenerationJobRequest(
            job_id="pets",
            job=res_pb.GenerationJob(
                base_model="/m", sources=[res_pb.GenerationSource(task="pets", accuracy_threshold=0.5, dataset=d.name)]
            ),
        )
    ).job
    assert job.sources[0].dataset == d.name
    registry = build_registry(store.settings.model_copy(update={"run_migrations": False}))
    try:
        later = utcnow() + timedelta(seconds=5)
        assert sha not in registry.gc(grace_s=0, now=later).blobs_removed
        assert registry.blobs.exists(sha)
        store.admin.CancelGenerationJob(admin_pb.CancelGenerationJobRequest(name=job.name))
        assert sha in registry.gc(grace_s=0, now=later).blobs_removed
        assert not registry.blobs.exists(sha)
    finally:
        registry.close()
    code, reason, fields, _ = error_of(
        store.admin.CreateGenerationJob,
        admin_pb.CreateGenerationJobRequest(
            job=res_pb.GenerationJob(
                base_model="/m", sources=[res_pb.GenerationSource(task="pets", accuracy_threshold=0.5, dataset=d.name)]
            )
        ),
    )
    assert (code, reason, fields) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "DATASET_NOT_FOUND",
        ["job.sources[0].dataset"],
    )


def test_update_task_changes_its_mutable_fields_guarded_by_its_etag(store):
    """UpdateTask changes what the mask names and nothing else (resolution shows it at once),
    keeps the rules CreateTask checks (one objective per class, the class follows the objective),
    refuses immutable or unknown paths and bad values field by field, and is ABORTED on a stale
    etag; NOT_FOUND for no such task."""
    upload(store, data=make_bundle(heads={"cls": 2}, seed=22), heads={"cls": ["yes", "no"]})
    create, update = store.admin.CreateTask, store.admin.UpdateTask

    def mask(*paths):
        return field_mask_pb2.FieldMask(paths=list(paths))

    create(
        admin_pb.CreateTaskRequest(
            task_id="count",
            task=res_pb.Task(adapter="adapters/demo", head="cls", description="cars", slo_ms=250.0, slo_class="video"),
        )
    )
    create(
        admin_pb.CreateTaskRequest(
            task_id="detect", task=res_pb.Task(adapter="adapters/demo", head="cls", slo_ms=250.0, slo_class="video")
        )
    )
    read = store.admin.GetTask(admin_pb.GetTaskRequest(name="tasks/count")).task
    assert read.etag and read.etag == store.admin.GetTask(admin_pb.GetTaskRequest(name="tasks/count")).task.etag

    # description only: the SLO fields sent along are not in the mask, so they stay
    got = update(
        admin_pb.UpdateTaskRequest(
            task=res_pb.Task(name="tasks/count", description="trucks", slo_ms=9.0),
            update_mask=mask("description"),
            etag=read.etag,
        )
    ).task
    assert (got.description, got.slo_ms, got.slo_class, got.head) == ("trucks", 250.0, "video", "cls")
    assert got.etag != read.etag and got.create_time == read.create_time
    assert store.admin.GetTask(admin_pb.GetTaskRequest(name="tasks/count")).task == got
    code, reason, _, _ = error_of(
        update,
        admin_pb.UpdateTaskRequest(
            task=res_pb.Task(name="tasks/count", description="stale"), update_mask=mask("description"), etag=read.etag
        ),
    )
    assert (code, reason) == (grpc.StatusCode.ABORTED, "ETAG_MISMATCH")

    # one class keeps one objective: moving one of its two tasks alone is refused
    code, reason, _, _ = error_of(
        update,
        admin_pb.UpdateTaskRequest(task=res_pb.Task(name="tasks/count", slo_ms=100.0), update_mask=mask("slo_ms")),
    )
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "SLO_CLASS_OBJECTIVE_MISMATCH")
    moved = update(
        admin_pb.UpdateTaskRequest(
            task=res_pb.Task(name="tasks/count", slo_ms=100.0, slo_class="fast"),
            update_mask=mask("slo_ms", "slo_class"),
        )
    ).task
    assert (moved.slo_ms, moved.slo_class, moved.description) == (100.0, "fast", "trucks")
    r = store.store.ResolveReference(store_pb.ResolveReferenceRequest(reference="tasks/count"))
    assert (r.task.slo_ms, r.task.slo_class) == (100.0, "fast")  # what the gateway hands the scheduler
    # objective alone to 0 clears the class; back above 0 without a class names it after the task
    off = update(admin_pb.UpdateTaskRequest(task=res_pb.Task(name="tasks/count"), update_mask=mask("slo_ms"))).task
    assert (off.slo_ms, off.slo_class) == (0.0, "")
    own = update(
        admin_pb.UpdateTaskRequest(task=res_pb.Task(name="tasks/count", slo_ms=40.0), update_mask=mask("slo_ms"))
    ).task
    assert (own.slo_ms, own.slo_class) == (40.0, "count")

    for request, field in (
        (
            admin_pb.UpdateTaskRequest(task=res_pb.Task(name="tasks/count", slo_ms=-1.0), update_mask=mask("slo_ms")),
            "task.slo_ms",
        ),
        (
            admin_pb.UpdateTaskRequest(
                task=res_pb.Task(name="tasks/count", slo_ms=float("nan")), update_mask=mask("slo_ms")
            ),
            "task.slo_ms",
        ),
        (
            admin_pb.UpdateTaskRequest(
                task=res_pb.Task(name="tasks/count", slo_class="Video!"), update_mask=mask("slo_class")
            ),
            "task.slo_class",
        ),
        # a class without an objective
        (
            admin_pb.UpdateTaskRequest(
                task=res_pb.Task(name="tasks/count", slo_class="video"), update_mask=mask("slo_ms", "slo_class")
            ),
            "task.slo_class",
        ),
        (
            admin_pb.UpdateTaskRequest(task=res_pb.Task(name="tasks/count", head="other"), update_mask=mask("head")),
            "update_mask",
        ),
        (admin_pb.UpdateTaskRequest(task=res_pb.Task(name="tasks/count", slo_ms=5.0)), "update_mask"),
        (admin_pb.UpdateTaskRequest(task=res_pb.Task(name="count"), update_mask=mask("slo_ms")), "task.name"),
    ):
        code, _, fields, _ = error_of(update, request)
        assert (code, fields) == (grpc.StatusCode.INVALID_ARGUMENT, [field]), request
    assert store.admin.GetTask(admin_pb.GetTaskRequest(name="tasks/count")).task == own  # nothing changed
    code, reason, _, _ = error_of(
        update,
        admin_pb.UpdateTaskRequest(
            task=res_pb.Task(name="tasks/ghost", description="x"), update_mask=mask("description")
        ),
    )
    assert (code, reason) == (grpc.StatusCode.NOT_FOUND, "TASK_NOT_FOUND")


def test_task_release_policy_round_trips_and_updates(store):
    """A task's early adapter release default is stored, resolved (what the gateway applies),
    updated on its own, and refused outside [0, 1] at create and at update."""
    upload(store, data=make_bundle(seed=23))
    created = store.admin.CreateTask(
        admin_pb.CreateTaskRequest(
            task_id="ask", task=res_pb.Task(adapter="adapters/demo", adapter_release_fraction=0.5, slo_ms=100.0)
        )
    ).task
    assert created.adapter_release_fraction == 0.5
    r = store.store.ResolveReference(store_pb.ResolveReferenceRequest(reference="tasks/ask"))
    assert r.task.adapter_release_fraction == 0.5
    got = store.admin.UpdateTask(
        admin_pb.UpdateTaskRequest(
            task=res_pb.Task(name="tasks/ask", adapter_release_fraction=0.25),
            update_mask=field_mask_pb2.FieldMask(paths=["adapter_release_fraction"]),
            etag=created.etag,
        )
    ).task
    assert (got.adapter_release_fraction, got.slo_ms, got.slo_class) == (0.25, 100.0, "ask")
    assert got.etag != created.etag
    assert store.admin.GetTask(admin_pb.GetTaskRequest(name="tasks/ask")).task.adapter_release_fraction == 0.25
    for bad in (-0.1, 1.5, float("nan")):
        code, _, fields, _ = error_of(
            store.admin.CreateTask,
            admin_pb.CreateTaskRequest(
                task_id="bad", task=res_pb.Task(adapter="adapters/demo", adapter_release_fraction=bad)
            ),
        )
        assert (code, fields) == (grpc.StatusCode.INVALID_ARGUMENT, ["task.adapter_release_fraction"]), bad
        code, _, fields, _ = error_of(
            store.admin.UpdateTask,
            admin_pb.UpdateTaskRequest(
                task=res_pb.Task(name="tasks/ask", adapter_release_fraction=bad),
                update_mask=field_mask_pb2.FieldMask(paths=["adapter_release_fraction"]),
            ),
        )
        assert (code, fields) == (grpc.StatusCode.INVALID_ARGUMENT, ["task.adapter_release_fraction"]), bad
    off = store.admin.UpdateTask(
        admin_pb.UpdateTaskRequest(
            task=res_pb.Task(name="tasks/ask"), update_mask=field_mask_pb2.FieldMask(paths=["adapter_release_fraction"])
        )
    )
    assert off.task.adapter_release_fraction == 0.0


def test_task_release_rule_round_trips_and_updates(store):
    """A task's release rule is stored, resolved with its fraction (what the gateway applies as
    one policy), updated on its own (the fraction kept), cleared, and refused naming
    task.adapter_release_rule when this build does not know it; a task without a rule keeps the
    etag it had before rules existed."""
    from services.adapter_store.domain import Task

    sentence_end = types_pb2.ADAPTER_RELEASE_RULE_SENTENCE_END
    upload(store, data=make_bundle(seed=29))
    created = store.admin.CreateTask(
        admin_pb.CreateTaskRequest(
            task_id="say",
            task=res_pb.Task(adapter="adapters/demo", adapter_release_fraction=0.25, adapter_release_rule=sentence_end),
        )
    ).task
    assert (created.adapter_release_fraction, created.adapter_release_rule) == (0.25, sentence_end)
    r = store.store.ResolveReference(store_pb.ResolveReferenceRequest(reference="tasks/say"))
    assert (r.task.adapter_release_fraction, r.task.adapter_release_rule) == (0.25, sentence_end)

    def update(**fields):
        return store.admin.UpdateTask(
            admin_pb.UpdateTaskRequest(
                task=res_pb.Task(name="tasks/say", **fields),
                update_mask=field_mask_pb2.FieldMask(paths=["adapter_release_rule"]),
            )
        ).task

    cleared = update()
    assert (cleared.adapter_release_fraction, cleared.adapter_release_rule) == (0.25, 0)
    assert cleared.etag != created.etag
    again = update(adapter_release_rule=sentence_end)
    assert again.adapter_release_rule == sentence_end and again.etag == created.etag
    got = store.admin.GetTask(admin_pb.GetTaskRequest(name="tasks/say")).task
    assert got.adapter_release_rule == sentence_end
    for call, req in (
        (
            store.admin.CreateTask,
            admin_pb.CreateTaskRequest(
                task_id="bad", task=res_pb.Task(adapter="adapters/demo", adapter_release_rule=9)
            ),
        ),
        (
            store.admin.UpdateTask,
            admin_pb.UpdateTaskRequest(
                task=res_pb.Task(name="tasks/say", adapter_release_rule=9),
                update_mask=field_mask_pb2.FieldMask(paths=["adapter_release_rule"]),
            ),
        ),
    ):
        code, _, fields, _ = error_of(call, req)
        assert (code, fields) == (grpc.StatusCode.INVALID_ARGUMENT, ["task.adapter_release_rule"])
    # without a rule, the digest of the fields it had before (a client's etag stays good)
    plain = Task("t", "adapters/demo", "", "", 0.5, 0.5, None, 10.0, "t", 0.5)
    old = ["t", "adapters/demo", "", "", 0.5, 0.5, "", 10.0, "t", 0.5]
    assert plain.etag == hashlib.sha256(json.dumps(old).encode()).hexdigest()[:32]
