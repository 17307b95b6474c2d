"""The hostile adapter corpus through the gateway's UploadAdapterVersion (store as a process):
every bundle refused with INVALID_ARGUMENT, no pickle ever unpickled, the store still serving."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import grpc
import pytest

from services.common.adapter_format import BaseModelShapes, make_random_bundle
from tests.reliability.bundles import corpus
from tests.reliability.conftest import ADMIN_KEY, md, record
from valora.cluster import alive
from valora_protos.v1 import admin_service_pb2 as admin
from valora_protos.v1 import admin_service_pb2_grpc as admin_grpc

pytestmark = pytest.mark.e2e


def upload(stub, adapter: str, data: bytes, cfg: str, sha: str) -> tuple[str, str]:
    meta = admin.UploadAdapterVersionMetadata(
        parent=f"adapters/{adapter}", adapter_config_json=cfg, sha256=sha or hashlib.sha256(data).hexdigest()
    )

    def parts():
        yield admin.UploadAdapterVersionRequest(metadata=meta)
        for i in range(0, len(data), 1 << 20):
            yield admin.UploadAdapterVersionRequest(chunk=data[i : i + (1 << 20)])

    try:
        r = stub.UploadAdapterVersion(parts(), timeout=60, metadata=md(ADMIN_KEY))
        return "OK", r.version.name
    except grpc.RpcError as err:
        return err.code().name, err.details() or ""


def test_hostile_bundles_are_all_rejected(cluster, model_path, tmp_path):
    shapes = BaseModelShapes.from_config(json.loads((Path(model_path) / "config.json").read_text()))
    marker = tmp_path / "PWNED"
    cases = corpus(shapes, str(marker))
    store_pid = next(p.pid for p in cluster.processes if p.service == "adapter_store")
    results = []
    with grpc.insecure_channel(cluster.gateway, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        stub = admin_grpc.AdminServiceStub(ch)
        for adapter_id in ("hostile", "hostile-control"):
            stub.CreateAdapter(admin.CreateAdapterRequest(adapter_id=adapter_id), timeout=30, metadata=md(ADMIN_KEY))
        for name, data, cfg, sha in cases:
            code, detail = upload(stub, "hostile", data, cfg, sha)
            results.append((name, code, detail[:160]))
        good, cfg = make_random_bundle(shapes, rank=4, seed=3)
        control = upload(stub, "hostile-control", good, cfg, "")
        listed = (
            stub.ListAdapterVersions(
                admin.ListAdapterVersionsRequest(parent="adapters/hostile", page_size=100),
                timeout=30,
                metadata=md(ADMIN_KEY),
            )
            if control[0] == "OK"
            else None
        )
    accepted = [r for r in results if r[1] == "OK"]
    wrong_code = [r for r in results if r[1] not in ("OK", "INVALID_ARGUMENT")]
    rejected = len(results) - len(accepted)
    passed = not accepted and not wrong_code and not marker.exists() and alive(store_pid) and control[0] == "OK"
    record(
        "adapter-validation",
        "hostile bundles rejected through UploadAdapterVersion",
        f"{rejected}/{len(results)}",
        "100% rejected (INVALID_ARGUMENT), side effect never runs",
        passed,
        side_effect_ran=marker.exists(),
        accepted=accepted,
        wrong_code=wrong_code,
        cases={r[0]: r[1] for r in results},
        control_upload=control[0],
    )
    assert not marker.exists(), "a pickle was unpickled"
    assert not accepted, accepted
    assert not wrong_code, wrong_code
    assert control[0] == "OK", control  # the store still takes a good bundle
    assert listed is None or not any(v.state == 2 for v in listed.versions)
