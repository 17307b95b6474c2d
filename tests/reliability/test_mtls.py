"""Optional mutual TLS between services (settings tls_cert/tls_key/tls_ca): a service built by
`build_service` with them refuses plaintext, clients without a certificate and clients whose
certificate another CA signed; a client with the right certificate (`client_credentials`) gets
through, and so does the worker's adapter fetch over it. Certificates generated per test."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.channels import client_credentials, open_channel
from services.common.config import ServiceSettings
from services.common.server import build_service
from tests.reliability.conftest import record

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _name(cn: str):
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, key, issuer_name, issuer_key, ca: bool):
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        b = b.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
    return b.sign(issuer_key, hashes.SHA256())


def make_pki(d: Path, prefix: str) -> dict[str, str]:
    """A CA and two leaf certificates it signs (server, client), as PEM files."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert(f"{prefix} CA", ca_key, _name(f"{prefix} CA"), ca_key, ca=True)
    out = {"ca": str(d / f"{prefix}-ca.pem")}
    Path(out["ca"]).write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    for leaf in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _cert(f"{prefix} {leaf}", key, ca.subject, ca_key, ca=False)
        out[f"{leaf}_cert"] = str(d / f"{prefix}-{leaf}.pem")
        out[f"{leaf}_key"] = str(d / f"{prefix}-{leaf}.key")
        Path(out[f"{leaf}_cert"]).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        Path(out[f"{leaf}_key"]).write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    return out


async def _check(address: str, credentials) -> str:
    channel = (
        open_channel(address, credentials=credentials)
        if credentials is not None
        else grpc.aio.insecure_channel(address)
    )
    try:
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return "OK"
    except grpc.RpcError as err:
        return err.code().name
    finally:
        await channel.close()


def test_mutual_tls_between_services(tmp_path):
    good, rogue = make_pki(tmp_path, "valora"), make_pki(tmp_path, "rogue")
    server_settings = ServiceSettings(
        port=0, tls_cert=good["server_cert"], tls_key=good["server_key"], tls_ca=good["ca"]
    )

    def client(pki, with_cert=True, ca=None):
        return client_credentials(
            ServiceSettings(
                tls_ca=ca or good["ca"],
                tls_cert=pki["client_cert"] if with_cert else "",
                tls_key=pki["client_key"] if with_cert else "",
            )
        )

    async def scenario():
        from services.adapter_store.testing import make_bundle
        from services.worker.store_client import AdapterFetcher
        from services.worker.testing import AdapterBundle, InMemoryAdapterStore

        data = make_bundle(seed=1)
        store = InMemoryAdapterStore({"adapters/a/versions/1": AdapterBundle(data, "{}", 4, 8.0, ("q_proj",))})
        service = build_service("store", server_settings, store.register)
        await service.start()
        address = f"127.0.0.1:{service.port}"
        try:
            cases = {
                "plaintext client": (await _check(address, None), "UNAVAILABLE"),
                "TLS, no client certificate": (await _check(address, client(good, with_cert=False)), "UNAVAILABLE"),
                "client certificate from another CA": (await _check(address, client(rogue)), "UNAVAILABLE"),
                "client trusting another CA": (await _check(address, client(good, ca=rogue["ca"])), "UNAVAILABLE"),
                "mutual TLS, right certificates": (await _check(address, client(good)), "OK"),
            }
            fetcher = AdapterFetcher(address, tmp_path / "cache", credentials=client(good))
            try:
                bundle = await fetcher.fetch("adapters/a/versions/1", "")
                cases["worker adapter fetch over mTLS"] = ("OK" if bundle.data == data else "WRONG", "OK")
            finally:
                await fetcher.close()
            return cases
        finally:
            await service.stop(0)

    cases = asyncio.run(scenario())
    wrong = {k: v for k, v in cases.items() if v[0] != v[1]}
    record(
        "mtls",
        "mTLS cases with the wrong outcome",
        len(wrong),
        "0",
        not wrong,
        cases={k: v[0] for k, v in cases.items()},
        wired="common (settings, build_service, open_channel/client_credentials), worker->store, "
        "WorkerPool(credentials=); gateway channels and scheduler/server.py not yet",
    )
    assert not wrong, wrong
