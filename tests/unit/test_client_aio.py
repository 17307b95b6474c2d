"""The asyncio SDK (valora.aio.AsyncValoraClient) over loopback gRPC: infer, the stream's deltas then
its result, and admin reads through a real gateway (test_gateway's, in front of its in-test store
and scheduler; test_cli_admin's, in front of a real SQLite store); the sync client's typed errors;
its retries against test_client_errors' scripted statuses; the internal token; and closing."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import grpc
import pytest

from services.common.errors import CapacityExceeded, WorkerUnavailable
from services.common.internal_auth import InternalAuthInterceptor
from tests.unit.test_cli_admin import ADMIN_KEY, upload
from tests.unit.test_cli_admin import gateway as store_gateway  # noqa: F401 - fixture: a real store and gateway
from tests.unit.test_client_errors import Scripted, serving
from tests.unit.test_gateway import V1, FakeStore, gateway, png
from tests.unit.test_gateway import anyio_backend  # noqa: F401 - fixture
from tests.unit.test_internal_auth import TOKEN
from valora import errors
from valora.aio import AsyncValoraClient
from valora.client import AdapterVersion, InferResult, ValoraClient
from valora.cluster import free_port
from valora.internal_token import TOKEN_KEY
from valora_protos.v1 import admin_service_pb2_grpc, inference_service_pb2, inference_service_pb2_grpc

pytestmark = pytest.mark.anyio


@contextlib.asynccontextmanager
async def fake_backed_gateway():
    """test_gateway's gateway, and its address."""
    port = free_port()
    async with gateway(port=port) as env:
        yield env, f"127.0.0.1:{port}"


def address_of(client: ValoraClient) -> str:
    """The server a sync client (test_client_errors.serving's) talks to."""
    return client._channel._channel.target().decode()


def untimed(r: InferResult) -> InferResult:
    return dataclasses.replace(r, queue_ms=0.0, first_token_ms=0.0, total_ms=0.0)


async def test_infer_stream_and_admin_reads_through_a_gateway():
    async with fake_backed_gateway() as (env, address):
        async with AsyncValoraClient(address, retries=0, timeout_s=30) as c:
            r = await c.infer(
                "a car?", [png()], adapter="adapters/cars@prod", request_id="aio-1", top_k=5, logit_bias={3: 2.0}
            )
            out = [d async for d in c.infer_stream("a car?", adapter="adapters/cars", request_id="aio-2")]
            status, adapter = await c.cluster_status(), await c.get_adapter("cars")
            await c.infer(prompt_token_ids=[7, 8, 9], request_id="aio-3")  # a raw prompt, as token ids
        with ValoraClient(address, retries=0, timeout_s=30) as sync:  # in a thread: this loop serves the gateway
            same = await asyncio.to_thread(
                sync.infer,
                "a car?",
                [png()],
                adapter="adapters/cars@prod",
                request_id="aio-1",
                top_k=5,
                logit_bias={3: 2.0},
            )
            same_out = await asyncio.to_thread(
                lambda: list(sync.infer_stream("a car?", adapter="adapters/cars", request_id="aio-2"))
            )
            assert status == await asyncio.to_thread(sync.cluster_status)
            assert adapter == await asyncio.to_thread(sync.get_adapter, "cars")
    assert isinstance(r, InferResult) and (r.request_id, r.text, r.worker) == ("aio-1", "a red car", "w1")
    assert (r.adapter_version, r.finish_reason) == (V1.name, "eos")
    item = env.scheduler.items[0]
    assert item.params.top_k == 5 and len(item.images) == 1 and item.adapter.version == V1.name
    assert dict(item.params.logit_bias) == {3: 2.0}
    tokens = env.scheduler.items[2]
    assert tokens.raw_prompt and tokens.prompt == "" and list(tokens.prompt_token_ids) == [7, 8, 9]
    assert env.scheduler.items[3].params == item.params  # the sync client's
    assert out[:-1] == ["a ", "red ", "car"] and isinstance(out[-1], InferResult)
    assert (out[-1].request_id, out[-1].text) == ("aio-2", "a red car")
    assert untimed(r) == untimed(same) and out[:-1] == same_out[:-1]  # what the sync client returns
    assert untimed(out[-1]) == untimed(same_out[-1])
    assert status.workers[0].address == "w1" and adapter.name == "adapters/cars"


async def test_admin_reads_and_typed_errors_of_a_real_store(store_gateway):  # noqa: F811 - the fixture imported above
    keys = dict(api_key=ADMIN_KEY, admin_key=ADMIN_KEY)  # an admin key is an API key too
    with ValoraClient(store_gateway, **keys, retries=0, timeout_s=30) as sync:
        v1, v2 = upload(sync, "aio-cars", 0), upload(sync, "aio-cars", 1)
        want = sync.list_adapters(), sync.get_adapter("aio-cars"), sync.list_versions("aio-cars")
        with pytest.raises(errors.NotFound) as sync_err:
            sync.infer("hi", adapter="adapters/nope")
    async with AsyncValoraClient(store_gateway, **keys, retries=0, timeout_s=30) as c:
        got = (
            await c.list_adapters(page_size=1),
            await c.get_adapter("adapters/aio-cars"),
            await c.list_versions("aio-cars", page_size=1),
        )
        with pytest.raises(errors.NotFound) as err:
            await c.infer("hi", adapter="adapters/nope")
    assert got == want and [v.name for v in got[2]] == [v1.name, v2.name]
    assert all(isinstance(v, AdapterVersion) for v in got[2])
    e, s = err.value, sync_err.value
    assert type(e) is type(s) and isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.NOT_FOUND
    assert (e.reason, e.message, e.field_violations) == (s.reason, s.message, s.field_violations) and e.reason
    async with AsyncValoraClient(store_gateway, retries=0, timeout_s=30) as anonymous:
        with pytest.raises(errors.Unauthenticated):
            await anonymous.list_adapters()


async def test_retries_follow_the_sync_clients_rules():
    down = WorkerUnavailable("no worker", reason="NO_HEALTHY_WORKER")
    s = Scripted([CapacityExceeded("queue full", reason="QUEUE_FULL", retry_after_s=0.05), down])
    with serving(s) as sync:
        async with AsyncValoraClient(address_of(sync), retries=2) as c:
            assert (await c.infer("x")).text == "ok" and s.calls == 3  # a full queue and an outage, retried
            s.script, s.calls = [down], 0
            out = [d async for d in c.infer_stream("x")]
            assert out[0] == "o" and out[-1].text == "ok" and s.calls == 2  # retried before its first message
            s.script, s.calls = [CapacityExceeded("over quota", reason="QUOTA")], 0  # no RetryInfo: not retried
            with pytest.raises(errors.ResourceExhausted) as quota:
                await c.infer("x")
            assert s.calls == 1 and quota.value.retry_after_s is None and quota.value.reason == "QUOTA"
            s.script, s.calls = [down] * 3, 0
            with pytest.raises(errors.Unavailable) as gave_up:
                [d async for d in c.infer_stream("x")]
            assert s.calls == 3 and gave_up.value.reason == "NO_HEALTHY_WORKER"  # 1 + retries


class Loopback(inference_service_pb2_grpc.InferenceServiceServicer):
    """A stream that echoes the internal token it got, or (prompt "cut") fails after its first message."""

    def __init__(self):
        self.calls = 0

    async def InferStream(self, request, context):
        self.calls += 1
        if request.input.prompt == "cut":
            yield inference_service_pb2.InferStreamResponse(text_delta="o")
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker lost")
        yield inference_service_pb2.InferStreamResponse(text_delta=dict(context.invocation_metadata())[TOKEN_KEY])


async def test_a_stream_that_failed_after_its_first_message_is_not_retried():
    loopback, server = Loopback(), grpc.aio.server()
    inference_service_pb2_grpc.add_InferenceServiceServicer_to_server(loopback, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    try:
        got = []
        async with AsyncValoraClient(address, retries=3, timeout_s=5) as c:
            with pytest.raises(errors.Unavailable):
                async for d in c.infer_stream("cut"):
                    got.append(d)
        assert got == ["o"] and loopback.calls == 1  # the output may have been seen
    finally:
        await server.stop(0)


async def test_the_internal_token_is_sent_on_unary_and_streaming_calls():
    """As to an adapter store's AdminService addressed directly (the sync client's internal_token)."""
    store, server = FakeStore(), grpc.aio.server(interceptors=[InternalAuthInterceptor("store", TOKEN)])
    admin_service_pb2_grpc.add_AdminServiceServicer_to_server(store, server)
    inference_service_pb2_grpc.add_InferenceServiceServicer_to_server(Loopback(), server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    try:
        async with AsyncValoraClient(address, retries=0, timeout_s=5, internal_token=TOKEN) as c:
            assert (await c.get_adapter("cars")).name == "adapters/cars"
            assert [d async for d in c.infer_stream("x")] == [TOKEN]
        assert store.metadata[-1][TOKEN_KEY] == TOKEN
        async with AsyncValoraClient(address, retries=0, timeout_s=5) as c:
            with pytest.raises(errors.Unauthenticated) as unary:
                await c.get_adapter("cars")
            with pytest.raises(errors.Unauthenticated):
                [d async for d in c.infer_stream("x")]
        assert unary.value.reason == "MISSING_INTERNAL_TOKEN" and len(store.metadata) == 1
    finally:
        await server.stop(0)


async def test_the_context_manager_closes_the_channel():
    async with fake_backed_gateway() as (_, address):
        async with AsyncValoraClient(address, retries=0, timeout_s=30) as c:
            assert (await c.infer("hi")).text == "a red car"
        assert c._channel.get_state() == grpc.ChannelConnectivity.SHUTDOWN
        with pytest.raises(grpc.aio.UsageError, match="closed"):
            await c.infer("hi")
        c = AsyncValoraClient(address, retries=0, timeout_s=30)
        await c.close()
        assert c._channel.get_state() == grpc.ChannelConnectivity.SHUTDOWN
    with pytest.raises(ValueError, match="together"):
        AsyncValoraClient("localhost:1", tls_key="client.key")  # the sync client's TLS checks
