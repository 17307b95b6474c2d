"""`python -m services.adapter_store` configured only through VALORA_* variables: it migrates,
serves (health SERVING), registers a bundle, and drains on SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from valora_protos.internal.v1 import adapter_store_service_pb2 as store_pb
from valora_protos.internal.v1 import adapter_store_service_pb2_grpc as store_grpc
from valora_protos.v1 import admin_service_pb2_grpc as admin_grpc

from services.adapter_store.testing import make_bundle, upload_messages


def test_module_entry_point(store_env, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ)
    for key, value in store_env.settings(port=port, log_json=True).model_dump().items():
        env[f"VALORA_{key.upper()}"] = str(value).lower() if isinstance(value, bool) else str(value)
    log = (tmp_path / "store.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.adapter_store"], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 30
        while True:
            try:
                if (
                    health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    break
            except grpc.RpcError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "store.log").read_text()
            time.sleep(0.2)
        data = make_bundle(seed=99)
        v = admin_grpc.AdminServiceStub(channel).UploadAdapterVersion(upload_messages("adapters/p", data)).version
        resolved = store_grpc.AdapterStoreServiceStub(channel).ResolveReference(
            store_pb.ResolveReferenceRequest(reference="adapters/p")
        )
        assert resolved.version == v
        channel.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert b'"stopped"' in (tmp_path / "store.log").read_bytes()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
