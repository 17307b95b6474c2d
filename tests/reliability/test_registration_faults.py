"""Registration crash consistency under network faults: Postgres and the S3 server (moto) sit
behind TCP proxies on loopback that are cut at every step of a registration (and in the middle
of the blob PUT). Afterwards every READY row has its blob, GC leaves no orphan, and retrying
each request id registers the version."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from urllib.parse import urlsplit, urlunsplit

import pytest

from services.adapter_store.domain import PageRequest
from services.adapter_store.models import utcnow
from services.adapter_store.server import build_registry
from services.adapter_store.servicer import _Blocking
from services.common.errors import ValoraError
from services.adapter_store.testing import adapter_config, make_bundle
from services.adapter_store.validation import BundleChecker, UploadRequest
from tests.integration.conftest import _truncate_all, postgres_url, s3_server  # noqa: F401 - fixtures reused
from tests.reliability.conftest import record
from tests.reliability.tcp_proxy import TcpProxy

pytestmark = pytest.mark.integration

# (name, step at which to cut, which connections: "pg", "s3", "both"); step "mid_put" cuts the
# S3 connection after part of the bundle went upstream.
SCENARIOS = [
    ("s3 cut before the blob PUT", "pending_committed", "s3"),
    ("s3 cut in the middle of the blob PUT", "mid_put", "s3"),
    ("pg cut before the blob PUT", "pending_committed", "pg"),
    ("s3 cut after the PUT, before verify", "blob_put", "s3"),
    ("pg cut after the PUT", "blob_put", "pg"),
    ("pg cut after verify, before READY", "verified", "pg"),
    ("both cut after verify", "verified", "both"),
    ("both cut after READY committed", "ready_committed", "both"),
]


@pytest.fixture
def proxied(postgres_url, s3_server, tmp_path):  # noqa: F811 - the fixtures imported above
    """Store settings through proxies, and the same settings direct (for the checks)."""
    import uuid

    from services.adapter_store.config import StoreSettings
    from services.adapter_store.testing import write_tiny_model

    _truncate_all(postgres_url)
    u = urlsplit(postgres_url)
    pg = TcpProxy((u.hostname, u.port or 5432))
    s3_host, s3_port = s3_server.endpoint.split(":")
    s3 = TcpProxy((s3_host, int(s3_port)))
    model = write_tiny_model(tmp_path / "model")
    common = {
        "model_path": str(model),
        "gc_interval_s": 0,
        "log_json": False,
        "db_workers": 2,
        "s3_access_key": s3_server.access_key,
        "s3_secret_key": s3_server.secret_key,
        "s3_bucket": f"valora-{uuid.uuid4().hex[:12]}",
        "s3_secure": False,
    }
    netloc = u.netloc.replace(f"{u.hostname}:{u.port}", f"127.0.0.1:{pg.port}")
    via = StoreSettings(
        **common, database_url=urlunsplit(u._replace(netloc=netloc)), s3_endpoint=f"127.0.0.1:{s3.port}"
    )
    direct = StoreSettings(**common, database_url=postgres_url, s3_endpoint=s3_server.endpoint)
    yield via, direct, pg, s3
    pg.close()
    s3.close()


def test_registration_survives_cut_connections(proxied):
    via, direct, pg, s3 = proxied
    build_registry(direct).close()  # migrate + bucket, up front
    checker = BundleChecker.from_settings(direct)
    proxies = {"pg": [pg], "s3": [s3], "both": [pg, s3]}
    outcomes = {}
    requests = []
    executor = ThreadPoolExecutor(2)
    for i, (name, step, which) in enumerate(SCENARIOS):
        data = make_bundle(seed=200 + i, rank=4) if step != "mid_put" else make_bundle(seed=200 + i, rank=64)
        req = UploadRequest("faulty", adapter_config(rank=4 if step != "mid_put" else 64), "", f"fault-{i}", ())
        bundle = checker.check(req, data)
        requests.append((req, bundle, data))

        def hook(at, step=step, which=which):
            if at == step:
                for p in proxies[which]:
                    p.cut()

        if step == "mid_put":
            s3.cut_after(len(data) // 3)
        registry = build_registry(via.model_copy(update={"run_migrations": False}), fault_hook=hook)
        t0 = time.monotonic()
        try:  # through the servicer's executor wrapper: what a client would see
            v = asyncio.run(_Blocking(executor).run(registry.register, req, bundle, "tiny", data))
            outcomes[name] = f"OK {v.state}"
        except ValoraError as exc:
            outcomes[name] = exc.code.name
        except Exception as exc:  # would be INTERNAL at the RPC
            outcomes[name] = f"INTERNAL ({type(exc).__name__}: {str(exc)[:300]})"  # the cause, in the record
        outcomes[name] += f" in {time.monotonic() - t0:.1f}s"
        for p in (pg, s3):
            p.restore()
        try:
            registry.close()
        except Exception:  # its connections were cut
            pass

    registry = build_registry(direct.model_copy(update={"run_migrations": False}))
    try:
        versions = registry.list_versions("faulty", PageRequest(1000, None)).items
        ready_without_blob = [v.name for v in versions if v.state == "READY" and not _blob_ok(registry, v)]
        report = registry.gc(grace_s=0, now=utcnow() + timedelta(seconds=5))
        live = {
            v.sha256
            for v in registry.list_versions("faulty", PageRequest(1000, None)).items
            if v.state in ("PENDING", "READY")
        }
        orphans = sorted({b.sha256 for b in registry.blobs.list()} - live)
        missing = sorted(live - {b.sha256 for b in registry.blobs.list()})
        retried = []
        for req, bundle, data in requests:  # every request id, retried once the network is back
            v = registry.register(req, bundle, "tiny", data)
            retried.append(v.state == "READY" and _blob_ok(registry, v))
    finally:
        registry.close()
    executor.shutdown()
    bad = len(ready_without_blob) + len(orphans) + len(missing)
    internal = [k for k, v in outcomes.items() if v.startswith("INTERNAL")]
    passed = bad == 0 and all(retried) and not internal
    record(
        "registration-faults",
        "READY rows without a blob + orphan blobs after GC, over cut connections",
        bad,
        "0 (every request id registers on retry; outages UNAVAILABLE, never INTERNAL)",
        passed,
        scenarios=outcomes,
        cuts={"pg": pg.cuts, "s3": s3.cuts},
        gc_pending_removed=len(report.pending_removed),
        gc_blobs_removed=len(report.blobs_removed) if hasattr(report, "blobs_removed") else None,
        retries_ready=sum(retried),
        retries=len(retried),
    )
    assert not ready_without_blob, ready_without_blob
    assert not orphans and not missing, (orphans, missing)
    assert all(retried), retried
    assert not internal, {k: outcomes[k] for k in internal}  # an outage is UNAVAILABLE/ABORTED, never INTERNAL


def _blob_ok(registry, v) -> bool:
    info = registry.blobs.stat(v.sha256)
    return info is not None and info.size == v.size_bytes
