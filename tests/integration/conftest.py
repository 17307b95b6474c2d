"""Fixtures of the store's tests on real backends: a fresh PostgreSQL database per session
(dropped after) and a real S3 protocol server (`moto_server`) on loopback, plus the `store_env`
fixture that runs the same suite on the embedded backend (SQLite + local dir) and on
PostgreSQL + S3 (marked integration)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import urllib.request
import uuid
from dataclasses import dataclass

import pytest

PG_ADMIN_URL = os.environ.get("VALORA_TEST_PG_ADMIN", "host=127.0.0.1 port=5432 dbname=test")
PG_USERS = ("postgres", "root")
S3_ACCESS_KEY = "valora-test"
S3_SECRET_KEY = "valora-test-secret"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pg_connect(dbname: str | None = None):
    import psycopg

    errors = []
    for user in PG_USERS:
        dsn = f"{PG_ADMIN_URL} user={user}" + (f" dbname={dbname}" if dbname else "")
        try:
            return psycopg.connect(dsn, autocommit=True, connect_timeout=3), user
        except psycopg.OperationalError as exc:
            errors.append(str(exc).strip())
    pytest.skip(f"PostgreSQL not reachable at {PG_ADMIN_URL}: {errors}")


@pytest.fixture(scope="session")
def postgres_url():
    """SQLAlchemy URL of a fresh database, dropped at the end of the session."""
    conn, user = _pg_connect()
    name = f"valora_store_test_{uuid.uuid4().hex[:12]}"
    conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"postgresql+psycopg://{user}@127.0.0.1:5432/{name}"
    finally:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.close()


@dataclass(frozen=True)
class S3Server:
    endpoint: str  # host:port
    access_key: str = S3_ACCESS_KEY
    secret_key: str = S3_SECRET_KEY


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """`moto_server` on a free loopback port, answering before the fixture returns."""
    exe = shutil.which("moto_server")
    if exe is None:
        pytest.skip("moto_server is not installed (pip install 'moto[server]')")
    port = _free_port()
    log = (tmp_path_factory.mktemp("moto") / "moto.log").open("wb")
    proc = subprocess.Popen(
        [exe, "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path_factory.getbasetemp(),
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1).read()
            break
        except Exception:  # not up yet
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"moto_server did not start (exit {proc.poll()})")
            time.sleep(0.1)
    try:
        yield S3Server(f"127.0.0.1:{port}")
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _truncate_all(url: str) -> None:
    from sqlalchemy import create_engine, inspect, text

    engine = create_engine(url)
    try:
        tables = [t for t in inspect(engine).get_table_names() if t != "alembic_version"]
        if tables:
            with engine.begin() as conn:
                conn.execute(text("TRUNCATE " + ", ".join(f'"{t}"' for t in tables) + " CASCADE"))
    finally:
        engine.dispose()


@dataclass
class StoreEnv:
    """Backend settings for one test: pass `settings(**overrides)` to the store."""

    backend: str
    base: dict

    def settings(self, **overrides):
        from services.adapter_store.config import StoreSettings

        return StoreSettings(**{**self.base, **overrides})


@pytest.fixture(params=["embedded", pytest.param("postgres_s3", marks=pytest.mark.integration)])
def store_env(request, tmp_path):
    """The registry suite runs once per backend; each test starts from an empty registry."""
    from services.adapter_store.testing import write_tiny_model

    model = write_tiny_model(tmp_path / "model")
    common = {"model_path": str(model), "gc_interval_s": 0, "log_json": False, "db_workers": 4}
    if request.param == "embedded":
        yield StoreEnv(
            "embedded",
            {**common, "database_url": f"sqlite:///{tmp_path / 'registry.db'}", "blob_dir": str(tmp_path / "blobs")},
        )
        return
    url = request.getfixturevalue("postgres_url")
    s3 = request.getfixturevalue("s3_server")
    _truncate_all(url)
    yield StoreEnv(
        "postgres_s3",
        {
            **common,
            "database_url": url,
            "s3_endpoint": s3.endpoint,
            "s3_access_key": s3.access_key,
            "s3_secret_key": s3.secret_key,
            "s3_bucket": f"valora-{uuid.uuid4().hex[:12]}",
            "s3_secure": False,
        },
    )
