"""A black-holed backend of the adapter store (issue 20: "black-holed Postgres/S3 → bounded
UNAVAILABLE, recovery after"): PostgreSQL or the S3 server (moto) behind a loopback TCP proxy that
keeps its connections open and forwards nothing. The store (its real gRPC server, in this
process) answers the calls that need that backend UNAVAILABLE within its backend timeout instead
of holding them, its health turns NOT_SERVING, and once the backend answers again both recover:
health SERVING, the bundle fetched whole, a new version registered.
(tests/integration/test_store_blackhole.py is the PostgreSQL case's first test; this one records
both backends' figures.)"""

from __future__ import annotations

import hashlib
import time
import uuid
from urllib.parse import urlsplit, urlunsplit

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.adapter_store.config import StoreSettings
from services.adapter_store.testing import RunningStore, make_bundle, upload_messages, write_tiny_model
from tests.integration.conftest import _truncate_all, postgres_url, s3_server  # noqa: F401 - fixtures reused
from tests.reliability.conftest import record
from tests.reliability.tcp_proxy import TcpProxy
from valora_protos.internal.v1 import adapter_store_service_pb2 as store_pb
from valora_protos.v1 import admin_service_pb2 as admin

pytestmark = pytest.mark.integration
BACKEND_TIMEOUT_S = 2.0
HEALTH_CHECK_S, HEALTH_TIMEOUT_S = 0.3, 1.0
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def proxied_store(postgres_url, s3_server, tmp_path):  # noqa: F811 - the fixtures imported above
    """The store on PostgreSQL and S3, each through its own proxy; yields (store, proxies)."""
    _truncate_all(postgres_url)
    u = urlsplit(postgres_url)
    pg = TcpProxy((u.hostname, u.port or 5432))
    s3_host, s3_port = s3_server.endpoint.split(":")
    s3 = TcpProxy((s3_host, int(s3_port)))
    netloc = u.netloc.replace(f"{u.hostname}:{u.port}", f"127.0.0.1:{pg.port}")
    settings = StoreSettings(
        port=0,
        model_path=str(write_tiny_model(tmp_path / "model")),
        log_json=False,
        db_workers=4,
        database_url=urlunsplit(u._replace(netloc=netloc)),
        run_migrations=True,
        s3_endpoint=f"127.0.0.1:{s3.port}",
        s3_access_key=s3_server.access_key,
        s3_secret_key=s3_server.secret_key,
        s3_bucket=f"valora-{uuid.uuid4().hex[:12]}",
        s3_secure=False,
        backend_timeout_s=BACKEND_TIMEOUT_S,
        db_connect_timeout_s=2.0,
        db_statement_timeout_s=5.0,
        s3_connect_timeout_s=2.0,
        s3_read_timeout_s=2.0,
        health_check_s=HEALTH_CHECK_S,
        health_check_timeout_s=HEALTH_TIMEOUT_S,
        gc_interval_s=0,
        job_sweep_interval_s=0,
    )
    store = RunningStore(settings)
    try:
        yield store, {"postgres": pg, "s3": s3}
    finally:
        pg.restore()
        s3.restore()
        store.close()
        pg.close()
        s3.close()


def timed(fn) -> tuple[str, float]:
    """(status code name, seconds) of one call."""
    t0 = time.monotonic()
    try:
        fn()
        return "OK", time.monotonic() - t0
    except grpc.RpcError as err:
        return err.code().name, time.monotonic() - t0


def wait_health(health, want, timeout_s: float) -> float | None:
    """Seconds until the store's health is `want`, or None past `timeout_s`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            if health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == want:
                return time.monotonic() - t0
        except grpc.RpcError:
            pass
        time.sleep(0.05)
    return None


@pytest.mark.parametrize("backend", ["postgres", "s3"])
def test_a_blackholed_backend_fails_calls_bounded_and_recovers(proxied_store, backend):
    store, proxies = proxied_store
    health = health_pb2_grpc.HealthStub(store.channel)
    data = make_bundle(seed=7)
    v1 = store.admin.UploadAdapterVersion(upload_messages("adapters/bh", data), timeout=30).version

    def fetch():
        parts = list(store.store.FetchAdapter(store_pb.FetchAdapterRequest(version=v1.name), timeout=30))
        got = b"".join(p.chunk for p in parts if p.WhichOneof("part") == "chunk")
        assert hashlib.sha256(got).hexdigest() == v1.sha256

    def upload(seed):
        return lambda: store.admin.UploadAdapterVersion(
            upload_messages("adapters/bh", make_bundle(seed=seed)), timeout=30
        )

    def list_adapters():
        store.admin.ListAdapters(admin.ListAdaptersRequest(page_size=5), timeout=30)

    assert timed(fetch)[0] == "OK" and wait_health(health, SERVING, 5) is not None
    proxies[backend].blackhole()
    to_not_serving = wait_health(health, NOT_SERVING, 10)
    # with S3 down the database still answers: a call that needs only it goes on
    during = {"fetch": timed(fetch), "upload": timed(upload(8)), "list_adapters": timed(list_adapters)}
    proxies[backend].restore()
    to_serving = wait_health(health, SERVING, 30)
    after = {"fetch": timed(fetch), "upload": timed(upload(9)), "list_adapters": timed(list_adapters)}
    need = ("fetch", "upload", "list_adapters") if backend == "postgres" else ("fetch", "upload")
    bounded = all(during[c][0] == "UNAVAILABLE" and during[c][1] < BACKEND_TIMEOUT_S + 1.5 for c in need)
    unaffected = backend == "postgres" or during["list_adapters"][0] == "OK"
    recovered = to_serving is not None and all(code == "OK" for code, _ in after.values())
    worst = max(during[c][1] for c in need)
    passed = bounded and unaffected and to_not_serving is not None and recovered
    record(
        f"store-blackhole-{backend}",
        f"seconds to UNAVAILABLE for a store call needing a black-holed {backend} (worst)",
        round(worst, 2),
        f"UNAVAILABLE < backend_timeout_s {BACKEND_TIMEOUT_S:g} + 1.5 s; NOT_SERVING; all calls OK after",
        passed,
        during={c: {"code": code, "s": round(s, 2)} for c, (code, s) in during.items()},
        not_serving_after_s=None if to_not_serving is None else round(to_not_serving, 2),
        serving_again_after_restore_s=None if to_serving is None else round(to_serving, 2),
        after={c: {"code": code, "s": round(s, 2)} for c, (code, s) in after.items()},
        backend_timeout_s=BACKEND_TIMEOUT_S,
        health_check_s=HEALTH_CHECK_S,
        health_check_timeout_s=HEALTH_TIMEOUT_S,
    )
    assert bounded, during
    assert unaffected, during
    assert to_not_serving is not None, "health stayed SERVING"
    assert recovered, (to_serving, after)
