"""ValoraClient.update_task against a real adapter store (SQLite) behind a real gateway over
loopback gRPC: only the fields given change, the etag guards the update, and bad values and
unknown tasks come back as typed errors; and the SDK's requests' own release policy
(adapter_release_fraction and adapter_release_rule; test_gateway's gateway, in front of its
in-test store and scheduler)."""

from __future__ import annotations

import asyncio

import pytest

from services.adapter_store.config import StoreSettings
from services.adapter_store.testing import RunningStore, adapter_config, make_bundle, write_tiny_model
from services.common.testing import ServiceThread
from services.gateway.config import GatewaySettings
from services.gateway.server import create_server as create_gateway
from tests.unit.test_gateway import anyio_backend  # noqa: F401 - fixture
from tests.unit.test_gateway import gateway
from valora import errors
from valora.aio import AsyncValoraClient
from valora.client import ValoraClient
from valora.cluster import free_port

ADMIN_KEY = "admin-key-update-task"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sdk-update-task")
    settings = StoreSettings(
        database_url=f"sqlite:///{tmp / 'r.db'}",
        blob_dir=str(tmp / "blobs"),
        model_path=str(write_tiny_model(tmp / "tiny")),
        gc_interval_s=0,
        port=0,
    )
    with RunningStore(settings) as store:
        settings = GatewaySettings(
            adapter_store_address=store.address,
            scheduler_address=store.address,
            admin_keys=[ADMIN_KEY],
            http_enabled=False,
            port=0,
        )
        with ServiceThread(create_gateway, settings, "gateway") as gw:
            with ValoraClient(gw.address, admin_key=ADMIN_KEY, retries=0, timeout_s=30) as c:
                yield c


def test_sdk_update_task(client):
    client.upload_adapter_version("sdk-upd", make_bundle(rank=4, seed=3), adapter_config(rank=4))
    created = client.create_task(
        "sdk-upd-ask", adapter="adapters/sdk-upd", description="ask", slo_ms=500.0, slo_class="retrieval"
    )
    got = client.update_task("sdk-upd-ask", description="ask it", etag=created.etag)
    assert (got.description, got.slo_ms, got.slo_class) == ("ask it", 500.0, "retrieval")
    assert client.get_task("tasks/sdk-upd-ask") == got
    with pytest.raises(errors.Aborted) as exc:  # changed since `created` was read
        client.update_task("sdk-upd-ask", slo_ms=100.0, etag=created.etag)
    assert exc.value.reason == "ETAG_MISMATCH"
    got = client.update_task("tasks/sdk-upd-ask", slo_ms=100.0, slo_class="", etag=got.etag)
    assert (got.slo_ms, got.slo_class, got.description) == (100.0, "sdk-upd-ask", "ask it")
    got = client.update_task("sdk-upd-ask", slo_ms=0.0)
    assert (got.slo_ms, got.slo_class) == (0.0, "")
    with pytest.raises(errors.InvalidArgument):
        client.update_task("sdk-upd-ask", slo_ms=-5.0)
    with pytest.raises(errors.InvalidArgument):  # nothing to change
        client.update_task("sdk-upd-ask")
    with pytest.raises(errors.NotFound) as exc:
        client.update_task("sdk-upd-nope", description="x")
    assert exc.value.reason == "TASK_NOT_FOUND"
    assert client.get_task("sdk-upd-ask") == got


@pytest.mark.anyio
async def test_sdk_requests_carry_their_own_release_policy():
    """infer / infer_stream (sync and asyncio) send adapter_release_fraction and the rule by name
    (adapter_release_rule); 0 and none leave it to the task's policy, filled in by the gateway;
    a rule the SDK does not know is a ValueError naming the known ones, before any call."""
    port = free_port()
    rule = "sentence_end"
    async with gateway(port=port) as env:
        address = f"127.0.0.1:{port}"
        async with AsyncValoraClient(address, retries=0, timeout_s=30) as c:
            await c.infer("a car?", adapter="adapters/cars", adapter_release_fraction=0.5)
            [_ async for _ in c.infer_stream("a car?", task="tasks/caption", adapter_release_fraction=0.25)]
            await c.infer("a car?", adapter="adapters/cars", adapter_release_rule=rule)
        with ValoraClient(address, retries=0, timeout_s=30) as sync:  # in a thread: this loop serves the gateway
            await asyncio.to_thread(sync.infer, "a car?", adapter="adapters/cars", adapter_release_fraction=0.75)
            await asyncio.to_thread(
                lambda: list(sync.infer_stream("a car?", adapter="adapters/cars", adapter_release_fraction=1.0))
            )
            await asyncio.to_thread(sync.infer, "a car?", adapter="adapters/cars")
            await asyncio.to_thread(
                lambda: list(
                    sync.infer_stream(
                        "a car?", adapter="adapters/cars", adapter_release_fraction=0.5, adapter_release_rule=rule
                    )
                )
            )
            with pytest.raises(ValueError, match="none, sentence_end"):
                sync.infer("a car?", adapter="adapters/cars", adapter_release_rule="sentence-end")
    items = env.scheduler.items
    assert [i.params.adapter_release_fraction for i in items] == [0.5, 0.25, 0.0, 0.75, 1.0, 0.0, 0.5]
    assert [i.params.adapter_release_rule for i in items] == [0, 0, 1, 0, 0, 0, 1]
