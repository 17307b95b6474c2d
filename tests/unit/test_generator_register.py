"""Registration through the SDK: uploads each bundle with its heads, then one task per head with
its threshold and measured accuracy. The AdminService here is a recording servicer on a real
gRPC channel (port 0), standing in for the gateway."""

from __future__ import annotations

import hashlib
from concurrent import futures

import grpc
import numpy as np
import pytest

from services.generator.bundle import Bundle
from services.generator.datasets import TaskData
from services.generator.pipeline import StrategyResult, register
from valora_protos.v1 import admin_service_pb2 as admin_pb
from valora_protos.v1 import admin_service_pb2_grpc as admin_grpc
from valora_protos.v1 import resources_pb2


class RecordingAdmin(admin_grpc.AdminServiceServicer):
    def __init__(self):
        self.uploads: list[tuple[admin_pb.UploadAdapterVersionMetadata, bytes]] = []
        self.tasks: list[admin_pb.CreateTaskRequest] = []

    def UploadAdapterVersion(self, request_iterator, context):
        meta, data = None, b""
        for part in request_iterator:
            if part.HasField("metadata"):
                meta = part.metadata
            else:
                data += part.chunk
        assert hashlib.sha256(data).hexdigest() == meta.sha256
        self.uploads.append((meta, data))
        n = sum(1 for m, _ in self.uploads if m.parent == meta.parent)
        return admin_pb.UploadAdapterVersionResponse(
            version=resources_pb2.AdapterVersion(
                name=f"{meta.parent}/versions/{n}",
                sha256=meta.sha256,
                rank=4,
                state=resources_pb2.ADAPTER_VERSION_STATE_READY,
                heads=meta.heads,
            )
        )

    def CreateTask(self, request, context):
        self.tasks.append(request)
        task = resources_pb2.Task()
        task.CopyFrom(request.task)
        task.name = f"tasks/{request.task_id}"
        return admin_pb.CreateTaskResponse(task=task)


@pytest.fixture()
def admin():
    servicer = RecordingAdmin()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    admin_grpc.add_AdminServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0)


def _task(name: str, labels: tuple[str, ...]) -> TaskData:
    return TaskData(name, f"{name}?", labels, {}, {"train": np.zeros(0, dtype=np.int64)})


def test_register_uploads_bundles_and_creates_tasks_with_accuracy(admin):
    servicer, address = admin
    tasks = {
        "digit": _task("digit", tuple("0123456789")),
        "parity": _task("parity", ("even", "odd")),
        "count": _task("count", tuple("12345")),
    }
    bundles = [
        Bundle("fused-0", b"bundle-0" * 100, '{"r": 4}', {"digit": list("0123456789"), "parity": ["even", "odd"]}),
        Bundle("fused-1", b"bundle-1", '{"r": 4}', {"count": list("12345")}),
    ]
    result = StrategyResult(
        "greedy-fusion",
        [["digit", "parity"], ["count"]],
        {
            "digit": {"threshold": 0.88, "accuracy": 0.9, "adapter": "fused-0"},
            "parity": {"threshold": 0.87, "accuracy": 0.91, "adapter": "fused-0"},
            "count": {"threshold": 0.8, "accuracy": 0.85, "adapter": "fused-1"},
        },
    )
    versions = register(address, bundles, result, {t: d.prompt for t, d in tasks.items()}, log=lambda _: None)
    assert versions == {
        "digit": "adapters/fused-0/versions/1",
        "parity": "adapters/fused-0/versions/1",
        "count": "adapters/fused-1/versions/1",
    }
    assert [(m.parent, data) for m, data in servicer.uploads] == [
        ("adapters/fused-0", b"bundle-0" * 100),
        ("adapters/fused-1", b"bundle-1"),
    ]
    assert {h.name: list(h.labels) for h in servicer.uploads[0][0].heads} == bundles[0].heads
    by_id = {r.task_id: r.task for r in servicer.tasks}
    assert set(by_id) == {"digit", "parity", "count"}
    assert by_id["parity"].adapter == "adapters/fused-0/versions/1" and by_id["parity"].head == "parity"
    assert by_id["count"].accuracy_threshold == pytest.approx(0.8)
    assert by_id["count"].measured_accuracy == pytest.approx(0.85)


def test_a_text_task_is_registered_without_a_head(admin):
    servicer, address = admin
    bundles = [
        Bundle("fused-0", b"bundle-0", '{"r": 4}', {"count": list("12345")}, ("count", "square-colour")),
        Bundle("fused-1", b"bundle-1", '{"r": 4}', {}, ("shapes",)),
    ]
    result = StrategyResult(
        "greedy-fusion",
        [["count", "square-colour"], ["shapes"]],
        {
            "count": {"threshold": 0.5, "accuracy": 0.6, "adapter": "fused-0"},
            "square-colour": {"threshold": 0.4, "accuracy": 0.45, "adapter": "fused-0"},
            "shapes": {"threshold": 0.3, "accuracy": 0.5, "adapter": "fused-1"},
        },
    )
    prompts = {"count": "How many?", "square-colour": "What colour is the square?", "shapes": "What is it?"}
    versions = register(
        address, bundles, result, prompts, log=lambda _: None, max_new_tokens={"square-colour": 5, "shapes": 7}
    )
    assert versions == {
        "count": "adapters/fused-0/versions/1",
        "square-colour": "adapters/fused-0/versions/1",
        "shapes": "adapters/fused-1/versions/1",
    }
    assert [list(m.heads) for m, _ in servicer.uploads][1] == []  # a plain LoRA, no heads
    by_id = {r.task_id: r.task for r in servicer.tasks}
    assert by_id["count"].head == "count" and by_id["square-colour"].head == "" and by_id["shapes"].head == ""
    assert by_id["square-colour"].adapter == "adapters/fused-0/versions/1"
    assert by_id["shapes"].description == (
        "prompt: What is it? (text task: answer as TEXT, greedy, max_new_tokens 7) (generated by valora generator)"
    )
    assert by_id["square-colour"].measured_accuracy == pytest.approx(0.45)
    assert by_id["count"].description == "prompt: How many? (generated by valora generator)"
