"""The SDK's errors and retries (valora.client, valora.errors) against a real gRPC server that
answers with the services' rich statuses (services/common/errors.py)."""

from __future__ import annotations

import contextlib
from concurrent import futures

import grpc
import pytest
from grpc_status import rpc_status

from services.common.errors import CapacityExceeded, FieldViolation, InvalidArgument, WorkerUnavailable
from valora import errors
from valora.client import ValoraClient
from valora_protos.v1 import inference_service_pb2, inference_service_pb2_grpc


class Scripted(inference_service_pb2_grpc.InferenceServiceServicer):
    """Answers each call with the next scripted error, then succeeds."""

    def __init__(self, script):
        self.script, self.calls = list(script), 0

    def _next(self, context):
        self.calls += 1
        if self.script:
            context.abort_with_status(rpc_status.to_status(self.script.pop(0).to_status()))

    def Infer(self, request, context):
        self._next(context)
        return inference_service_pb2.InferResponse(result=inference_service_pb2.InferResult(text="ok"))

    def InferStream(self, request, context):
        self._next(context)
        yield inference_service_pb2.InferStreamResponse(text_delta="o")
        yield inference_service_pb2.InferStreamResponse(result=inference_service_pb2.InferResult(text="ok"))


@contextlib.contextmanager
def serving(servicer):
    server = grpc.server(futures.ThreadPoolExecutor(4))
    inference_service_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with ValoraClient(f"127.0.0.1:{port}", retries=2) as client:
            yield client
    finally:
        server.stop(0)


def test_errors_are_typed_and_carry_the_status_details():
    bad = InvalidArgument(
        "invalid request", reason="INVALID_ARGUMENT", field_violations=[FieldViolation("input.prompt", "too long")]
    )
    with serving(Scripted([bad])) as client:
        with pytest.raises(errors.InvalidArgument) as exc:
            client.infer("x")
    err = exc.value
    assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.INVALID_ARGUMENT  # raw-gRPC compatible
    assert err.reason == "INVALID_ARGUMENT" and err.field_violations == [("input.prompt", "too long")]
    assert "INVALID_ARGUMENT" in str(err)


def test_retries_honour_retry_info_and_give_up_on_the_rest():
    full = CapacityExceeded("queue full", reason="QUEUE_FULL", retry_after_s=0.05)
    down = WorkerUnavailable("no worker", reason="NO_HEALTHY_WORKER")
    s = Scripted([full, down])
    with serving(s) as client:
        assert client.infer("x").text == "ok" and s.calls == 3  # a full queue and an outage, retried
    s = Scripted([CapacityExceeded("over quota", reason="QUOTA")])  # no RetryInfo: not retried
    with serving(s) as client:
        with pytest.raises(errors.ResourceExhausted) as exc:
            client.infer("x")
    assert s.calls == 1 and exc.value.retry_after_s is None
    s = Scripted([down, down, down])
    with serving(s) as client:
        with pytest.raises(errors.Unavailable):
            client.infer("x")
    assert s.calls == 3  # 1 + retries


def test_a_stream_is_retried_only_before_its_first_message():
    s = Scripted([WorkerUnavailable("no worker", reason="NO_HEALTHY_WORKER")])
    with serving(s) as client:
        out = list(client.infer_stream("x"))
    assert out[0] == "o" and out[-1].text == "ok" and s.calls == 2


def test_tls_and_mutual_tls_and_every_page_of_versions(tmp_path):
    """The SDK speaks TLS (server verified against a CA) and mutual TLS (with its certificate),
    and list_versions reads every page."""
    from tests.reliability.test_mtls import make_pki
    from valora_protos.v1 import admin_service_pb2 as admin_pb
    from valora_protos.v1 import admin_service_pb2_grpc as admin_grpc
    from valora_protos.v1 import resources_pb2

    class Versions(admin_grpc.AdminServiceServicer):
        def ListAdapterVersions(self, request, context):
            start = int(request.page_token or 0)
            names = [f"adapters/a/versions/{i}" for i in range(1, 8)][start : start + request.page_size]
            more = start + request.page_size < 7
            return admin_pb.ListAdapterVersionsResponse(
                versions=[resources_pb2.AdapterVersion(name=n) for n in names],
                next_page_token=str(start + request.page_size) if more else "",
            )

    pki = make_pki(tmp_path, "sdk")
    read = lambda k: open(pki[k], "rb").read()
    for mutual in (False, True):
        server = grpc.server(futures.ThreadPoolExecutor(2))
        admin_grpc.add_AdminServiceServicer_to_server(Versions(), server)
        creds = grpc.ssl_server_credentials(
            [(read("server_key"), read("server_cert"))],
            root_certificates=read("ca") if mutual else None,
            require_client_auth=mutual,
        )
        port = server.add_secure_port("127.0.0.1:0", creds)
        server.start()
        try:
            address = f"localhost:{port}"
            client_tls = dict(
                tls_ca=pki["ca"], **({"tls_cert": pki["client_cert"], "tls_key": pki["client_key"]} if mutual else {})
            )
            with ValoraClient(address, retries=0, **client_tls) as client:
                got = client.list_versions("a", page_size=3)
            assert [v.name for v in got] == [f"adapters/a/versions/{i}" for i in range(1, 8)]
            with ValoraClient(address, retries=0, timeout_s=3) as plain, pytest.raises(grpc.RpcError):
                plain.list_versions("a")  # plaintext to a TLS port fails
            if mutual:
                with (
                    ValoraClient(address, retries=0, timeout_s=3, tls_ca=pki["ca"]) as no_cert,
                    pytest.raises(grpc.RpcError),
                ):
                    no_cert.list_versions("a")  # mutual TLS: a client without a certificate is refused
        finally:
            server.stop(0)
    with pytest.raises(ValueError, match="together"):
        ValoraClient("localhost:1", tls_cert=pki["client_cert"])


def test_the_sdk_ships_its_type_annotations():
    import tomllib
    from pathlib import Path

    import valora

    assert (Path(valora.__file__).parent / "py.typed").exists()
    project = tomllib.loads((Path(valora.__file__).parents[1] / "pyproject.toml").read_text())
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["valora"]
