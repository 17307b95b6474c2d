"""Auth at the gateway (services as processes): inference needs an API key, admin RPCs need the
admin key, health stays open, and no credential is ever written to a service log."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.reliability.conftest import ADMIN_KEY, API_KEY, record
from valora_protos.v1 import admin_service_pb2 as admin
from valora_protos.v1 import admin_service_pb2_grpc as admin_grpc
from valora_protos.v1 import inference_service_pb2 as inf
from valora_protos.v1 import inference_service_pb2_grpc as inf_grpc
from valora_protos.v1 import types_pb2

pytestmark = pytest.mark.e2e
WRONG = "rk-wrong-3b9f1d7c2e4a6b80"


def code_of(fn, req, metadata) -> str:
    try:
        fn(req, timeout=60, metadata=metadata)
        return "OK"
    except grpc.RpcError as err:
        return err.code().name


def test_keys_are_required_and_never_logged(cluster):
    infer = inf.InferRequest(input=inf.InferenceInput(prompt="hi", params=types_pb2.GenerationParams(max_new_tokens=2)))
    listing = admin.ListAdaptersRequest(page_size=5)
    auth = lambda k: [("authorization", f"Bearer {k}")]
    with grpc.insecure_channel(cluster.gateway) as ch:
        i, a = inf_grpc.InferenceServiceStub(ch), admin_grpc.AdminServiceStub(ch)
        h = health_pb2_grpc.HealthStub(ch)
        matrix = {
            "infer, no key": (code_of(i.Infer, infer, []), "UNAUTHENTICATED"),
            "infer, wrong key": (code_of(i.Infer, infer, auth(WRONG)), "UNAUTHENTICATED"),
            "infer, not bearer": (code_of(i.Infer, infer, [("authorization", f"Basic {API_KEY}")]), "UNAUTHENTICATED"),
            "infer, key as request id": (
                code_of(i.Infer, inf.InferRequest(input=infer.input, request_id=API_KEY), []),
                "UNAUTHENTICATED",
            ),
            "infer, api key": (code_of(i.Infer, infer, auth(API_KEY)), "OK"),
            "infer, admin key": (code_of(i.Infer, infer, auth(ADMIN_KEY)), "OK"),
            "stream, no key": (
                code_of(lambda r, **kw: list(i.InferStream(r, **kw)), inf.InferStreamRequest(input=infer.input), []),
                "UNAUTHENTICATED",
            ),
            "admin, no key": (code_of(a.ListAdapters, listing, []), "UNAUTHENTICATED"),
            "admin, wrong key": (code_of(a.ListAdapters, listing, auth(WRONG)), "UNAUTHENTICATED"),
            "admin, api key": (code_of(a.ListAdapters, listing, auth(API_KEY)), "PERMISSION_DENIED"),
            "admin status, api key": (
                code_of(a.GetClusterStatus, admin.GetClusterStatusRequest(), auth(API_KEY)),
                "PERMISSION_DENIED",
            ),
            "admin, admin key": (code_of(a.ListAdapters, listing, auth(ADMIN_KEY)), "OK"),
            "health, no key": (code_of(h.Check, health_pb2.HealthCheckRequest(), []), "OK"),
        }
    logs = {p.name: Path(p.log).read_text(errors="replace") for p in cluster.processes}
    leaks = [(name, key) for name, text in logs.items() for key in (API_KEY, ADMIN_KEY, WRONG) if key in text]
    wrong = {k: v for k, v in matrix.items() if v[0] != v[1]}
    passed = not wrong and not leaks
    record(
        "auth",
        "auth matrix cases wrong + credentials found in service logs",
        len(wrong) + len(leaks),
        "0",
        passed,
        cases={k: v[0] for k, v in matrix.items()},
        wrong=wrong,
        leaks=leaks,
        log_bytes_scanned=sum(len(t) for t in logs.values()),
        mtls="not implemented",
    )
    assert not wrong, wrong
    assert not leaks, leaks
