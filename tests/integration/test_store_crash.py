"""Crash safety of registration: a subprocess registering a bundle is SIGKILLed at each step;
afterwards every READY version has its blob, GC leaves no orphan, and retrying the request id
registers the version."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from datetime import timedelta

import pytest

from services.adapter_store.models import utcnow
from services.adapter_store.server import build_registry
from services.adapter_store.testing import adapter_config, make_bundle
from services.adapter_store.validation import BundleChecker, UploadRequest

STEPS = ["pending_committed", "blob_put", "verified", "ready_committed"]

CHILD = """
import json, os, signal, sys
from services.adapter_store.config import StoreSettings
from services.adapter_store.server import build_registry
from services.adapter_store.testing import adapter_config, make_bundle
from services.adapter_store.validation import BundleChecker, UploadRequest

settings = StoreSettings(**json.loads(sys.argv[1]))
step = sys.argv[2]

def hook(at):
    if at == step:
        os.kill(os.getpid(), signal.SIGKILL)

registry = build_registry(settings, fault_hook=hook)
data = make_bundle(seed=int(sys.argv[3]))
req = UploadRequest("crash", adapter_config(), "", sys.argv[4], ())
registry.register(req, BundleChecker.from_settings(settings).check(req, data), "tiny", data)
print("finished without being killed")
"""


def test_registration_survives_sigkill_at_every_step(store_env):
    settings = store_env.settings()
    build_registry(settings).close()  # migrate once, up front
    child_settings = json.dumps(settings.model_copy(update={"run_migrations": False}).model_dump())
    for i, step in enumerate(STEPS):
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, child_settings, step, str(100 + i), f"req-{i}"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == -signal.SIGKILL, (step, proc.returncode, proc.stderr[-2000:])

    registry = build_registry(settings.model_copy(update={"run_migrations": False}))
    try:
        versions = _versions(registry)
        for v in versions:
            if v.state == "READY":
                assert registry.blobs.exists(v.sha256), v.name
        assert [v.state for v in versions] == ["PENDING", "PENDING", "PENDING", "READY"]

        report = registry.gc(grace_s=0, now=utcnow() + timedelta(seconds=5))
        assert len(report.pending_removed) == 3
        live = {v.sha256 for v in _versions(registry) if v.state in ("PENDING", "READY")}
        assert {b.sha256 for b in registry.blobs.list()} == live
        for v in _versions(registry):
            assert v.state == "READY" and registry.blobs.exists(v.sha256)

        # Retrying a killed request id registers it (a new number; numbers are never reused).
        checker = BundleChecker.from_settings(settings)
        data = make_bundle(seed=101)
        req = UploadRequest("crash", adapter_config(), "", "req-1", ())
        v = registry.register(req, checker.check(req, data), "tiny", data)
        assert (v.state, v.version) == ("READY", 5)
        assert registry.blobs.read_all(v.sha256) == data
    finally:
        registry.close()


def _versions(registry):
    from services.adapter_store.domain import PageRequest

    return registry.list_versions("crash", PageRequest(1000, None)).items


@pytest.mark.parametrize("step", ["pending_committed"])
def test_retry_resumes_a_pending_row_before_gc(store_env, step):
    """A retry that arrives before GC resumes the PENDING row the crash left."""
    settings = store_env.settings()
    build_registry(settings).close()
    child_settings = json.dumps(settings.model_copy(update={"run_migrations": False}).model_dump())
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, child_settings, step, "7", "resume-me"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    registry = build_registry(settings.model_copy(update={"run_migrations": False}))
    try:
        data = make_bundle(seed=7)
        req = UploadRequest("crash", adapter_config(), "", "resume-me", ())
        v = registry.register(req, BundleChecker.from_settings(settings).check(req, data), "tiny", data)
        assert (v.version, v.state) == (1, "READY")
        assert registry.blobs.exists(v.sha256)
    finally:
        registry.close()
