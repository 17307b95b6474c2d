"""Gateway over real loopback gRPC: validation, resolution, request ids, deadlines, streaming,
admin forwarding and auth, against small in-test adapter-store and scheduler servicers."""

from __future__ import annotations

import asyncio
import contextlib
import io
import struct
import time
import zlib

import grpc
import pytest
import structlog.testing
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from PIL import Image

from services.common.server import REQUEST_ID_KEY
from services.gateway.config import GatewaySettings
from services.gateway.server import create_server
from valora_protos.internal.v1 import (
    adapter_store_service_pb2,
    adapter_store_service_pb2_grpc,
    scheduler_service_pb2,
    scheduler_service_pb2_grpc,
)
from valora_protos.v1 import (
    admin_service_pb2,
    admin_service_pb2_grpc,
    inference_service_pb2,
    inference_service_pb2_grpc,
    resources_pb2,
    types_pb2,
)

pytestmark = pytest.mark.anyio
V1 = resources_pb2.AdapterVersion(
    name="adapters/cars/versions/3",
    sha256="cd" * 32,
    state=resources_pb2.ADAPTER_VERSION_STATE_READY,
    heads=[resources_pb2.TaskHead(name="color", labels=["red", "blue"])],
)
TASKS = {
    "tasks/car-color": resources_pb2.Task(name="tasks/car-color", adapter="adapters/cars@prod", head="color"),
    "tasks/caption": resources_pb2.Task(name="tasks/caption", adapter="adapters/cars", head=""),
}
API_KEY, ADMIN_KEY = "user-key-1", "admin-key-1"


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


class FakeStore(
    adapter_store_service_pb2_grpc.AdapterStoreServiceServicer, admin_service_pb2_grpc.AdminServiceServicer
):
    def __init__(self):
        self.metadata: list[dict] = []
        self.uploaded = b""
        self.datasets: list[bytes] = []
        self.resolved: list[str] = []  # every ResolveReference asked
        self.pending: set[str] = set()  # references whose version is not READY yet
        self.down: grpc.StatusCode | None = None  # answer every resolution with this (an outage)
        self.hang = False  # never answer a resolution (a black-holed store)

    async def ResolveReference(self, request, context):
        ref = request.reference
        self.resolved.append(ref)
        if self.hang:
            await asyncio.sleep(60)
        if self.down is not None:
            await context.abort(self.down, "store down")
        if ref in self.pending:
            return adapter_store_service_pb2.ResolveReferenceResponse(
                version=resources_pb2.AdapterVersion(
                    name=f"{ref}/versions/9", state=resources_pb2.ADAPTER_VERSION_STATE_PENDING
                )
            )
        if ref in TASKS:
            return adapter_store_service_pb2.ResolveReferenceResponse(version=V1, task=TASKS[ref])
        if ref.startswith("adapters/cars"):
            return adapter_store_service_pb2.ResolveReferenceResponse(version=V1)
        await context.abort(grpc.StatusCode.NOT_FOUND, f"{ref} not found")

    async def GetAdapter(self, request, context):
        self.metadata.append(dict(context.invocation_metadata()))
        if request.name != "adapters/cars":
            await context.abort(grpc.StatusCode.NOT_FOUND, f"{request.name} not found")
        return admin_service_pb2.GetAdapterResponse(adapter=resources_pb2.Adapter(name="adapters/cars"))

    async def SetAlias(self, request, context):
        return admin_service_pb2.SetAliasResponse()

    async def UploadAdapterVersion(self, request_iterator, context):
        meta = None
        async for part in request_iterator:
            if part.HasField("metadata"):
                meta = part.metadata
            else:
                self.uploaded += part.chunk
        return admin_service_pb2.UploadAdapterVersionResponse(
            version=resources_pb2.AdapterVersion(name=f"{meta.parent}/versions/1", size_bytes=len(self.uploaded))
        )

    async def UploadDataset(self, request_iterator, context):
        meta, data = None, b""
        async for part in request_iterator:
            if part.HasField("metadata"):
                meta = part.metadata
            else:
                data += part.chunk
        self.datasets.append(data)
        return admin_service_pb2.UploadDatasetResponse(
            dataset=resources_pb2.Dataset(name=f"datasets/{meta.sha256}", sha256=meta.sha256, size_bytes=len(data))
        )


class FakeScheduler(scheduler_service_pb2_grpc.SchedulerServiceServicer):
    def __init__(self):
        self.items: list = []
        self.request_ids: list[str] = []
        self.remaining: list[float | None] = []
        self.hang = False
        self.cancelled = asyncio.Event()

    async def Submit(self, request, context):
        self.items.append(request.item)
        self.request_ids.append(dict(context.invocation_metadata()).get(REQUEST_ID_KEY, ""))
        self.remaining.append(context.time_remaining())
        if self.hang:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        item = request.item
        if item.output_kind == types_pb2.OUTPUT_KIND_LABEL:
            yield scheduler_service_pb2.SubmitResponse(
                result=inference_service_pb2.InferResult(
                    label="red", finish_reason=types_pb2.FINISH_REASON_LABEL, worker="w1"
                )
            )
            return
        for delta in ("a ", "red ", "car"):
            yield scheduler_service_pb2.SubmitResponse(text_delta=delta)
        yield scheduler_service_pb2.SubmitResponse(
            result=inference_service_pb2.InferResult(
                text="a red car", finish_reason=types_pb2.FINISH_REASON_EOS, worker="w1"
            )
        )

    async def GetSchedulerStatus(self, request, context):
        return scheduler_service_pb2.GetSchedulerStatusResponse(
            workers=[admin_service_pb2.WorkerStatus(address="w1", healthy=True, max_batch_size=8)], queued_requests=2
        )


@contextlib.asynccontextmanager
async def gateway(**settings):
    store, scheduler = FakeStore(), FakeScheduler()
    backend = grpc.aio.server()
    adapter_store_service_pb2_grpc.add_AdapterStoreServiceServicer_to_server(store, backend)
    admin_service_pb2_grpc.add_AdminServiceServicer_to_server(store, backend)
    scheduler_service_pb2_grpc.add_SchedulerServiceServicer_to_server(scheduler, backend)
    addr = f"127.0.0.1:{backend.add_insecure_port('127.0.0.1:0')}"
    await backend.start()
    defaults = dict(
        scheduler_address=addr,
        adapter_store_address=addr,
        max_images=2,
        max_image_bytes=4096,
        max_image_pixels=64 * 64,
        max_prompt_chars=100,
        max_new_tokens_limit=512,
        default_max_new_tokens=64,
        default_deadline_s=30.0,
        max_deadline_s=60.0,
    )
    service = await create_server(GatewaySettings(**{**defaults, **settings}))
    await service.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{service.port}")

    class Env:
        pass

    env = Env()
    env.store, env.scheduler = store, scheduler
    env.infer = inference_service_pb2_grpc.InferenceServiceStub(channel)
    env.admin = admin_service_pb2_grpc.AdminServiceStub(channel)
    env.channel = channel
    try:
        yield env
    finally:
        await channel.close()
        await service.stop(0)
        await backend.stop(0)


@pytest.fixture(scope="module")
async def gw():
    async with gateway() as env:
        yield env


def png(size=(8, 8), mode="RGB", fmt="PNG") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, 0).save(buf, fmt)
    return buf.getvalue()


def png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height (a bomb shape): only the IHDR is patched."""
    data = bytearray(png((1, 1)))
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def request(**kw) -> inference_service_pb2.InferRequest:
    params = kw.pop("params", {})
    images = kw.pop("images", [])
    rid = kw.pop("request_id", "")
    inp = inference_service_pb2.InferenceInput(prompt=kw.pop("prompt", "what color is the car?"), **kw)
    inp.images.extend(types_pb2.Image(data=d) if isinstance(d, bytes) else d for d in images)
    inp.params.CopyFrom(types_pb2.GenerationParams(**params))
    return inference_service_pb2.InferRequest(input=inp, request_id=rid)


def violations(err: grpc.aio.AioRpcError) -> list[str]:
    status = rpc_status.from_call(err)
    out = []
    for d in status.details:
        if d.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            d.Unpack(bad)
            out += [v.field for v in bad.field_violations]
    return out


BAD_INPUTS = {
    "empty": (dict(prompt=""), "input"),
    "prompt_too_long": (dict(prompt="x" * 101), "input.prompt"),
    "too_many_images": (dict(images=[png(), png(), png()]), "input.images"),
    "image_too_big": (dict(images=[b"\x89PNG" + b"\0" * 5000]), "input.images[0].data"),
    "image_empty": (dict(images=[b""]), "input.images[0].data"),
    "image_garbage": (dict(images=[b"definitely not an image"]), "input.images[0].data"),
    "image_truncated": (dict(images=[png((32, 32), "RGB")[:-30]]), "input.images[0].data"),
    "image_bomb_header": (dict(images=[png_claiming(100_000, 100_000)]), "input.images[0].data"),
    "image_too_many_pixels": (dict(images=[png((65, 64))]), "input.images[0].data"),
    "image_format_gif": (dict(images=[png(fmt="GIF", mode="P")]), "input.images[0].data"),
    "image_bad_mime": (dict(images=[types_pb2.Image(data=png(), mime_type="text/plain")]), "input.images[0].mime_type"),
    "max_new_tokens_negative": (dict(params=dict(max_new_tokens=-1)), "input.params.max_new_tokens"),
    "max_new_tokens_over": (dict(params=dict(max_new_tokens=513)), "input.params.max_new_tokens"),
    "temperature_negative": (dict(params=dict(temperature=-0.1)), "input.params.temperature"),
    "temperature_nan": (dict(params=dict(temperature=float("nan"))), "input.params.temperature"),
    "temperature_over": (dict(params=dict(temperature=2.5)), "input.params.temperature"),
    "top_p_over": (dict(params=dict(top_p=1.5)), "input.params.top_p"),
    "top_k_negative": (dict(params=dict(top_k=-1)), "input.params.top_k"),
    "min_p_over": (dict(params=dict(min_p=1.5)), "input.params.min_p"),
    "top_logprobs_over": (dict(params=dict(logprobs=True, top_logprobs=21)), "input.params.top_logprobs"),
    "top_logprobs_alone": (dict(params=dict(top_logprobs=2)), "input.params.top_logprobs"),
    "presence_penalty_over": (dict(params=dict(presence_penalty=2.5)), "input.params.presence_penalty"),
    "frequency_penalty_nan": (dict(params=dict(frequency_penalty=float("nan"))), "input.params.frequency_penalty"),
    "repetition_penalty_negative": (dict(params=dict(repetition_penalty=-1.0)), "input.params.repetition_penalty"),
    "min_p_nan": (dict(params=dict(min_p=float("nan"))), "input.params.min_p"),
    "logit_bias_over": (dict(params=dict(logit_bias={42: 100.5})), "input.params.logit_bias[42]"),
    "logit_bias_inf": (dict(params=dict(logit_bias={7: float("-inf")})), "input.params.logit_bias[7]"),
    "logit_bias_negative_id": (dict(params=dict(logit_bias={-3: 1.0})), "input.params.logit_bias[-3]"),
    "logit_bias_too_many": (dict(params=dict(logit_bias={t: 1.0 for t in range(301)})), "input.params.logit_bias"),
    "stop_empty": (dict(params=dict(stop=[""])), "input.params.stop[0]"),
    "label_without_task": (dict(adapter="adapters/cars", output_kind=types_pb2.OUTPUT_KIND_LABEL), "input.output_kind"),
    "label_task_without_head": (dict(task="tasks/caption", output_kind=types_pb2.OUTPUT_KIND_LABEL), "input.task"),
    "adapter_malformed": (dict(adapter="Adapters/Cars"), "input.adapter"),
    "adapter_bad_version": (dict(adapter="adapters/cars/versions/0"), "input.adapter"),
    "task_malformed": (dict(task="tasks/"), "input.task"),
    "request_id_bad": (dict(request_id="has space"), "request_id"),
    "request_id_newline": (dict(request_id="abc\n"), "request_id"),  # was INTERNAL (a bad metadata value)
    "adapter_newline": (dict(adapter="adapters/cars\n"), "input.adapter"),
    "history_bad_role": (dict(history=[types_pb2.ChatTurn(role="system", text="x")]), "input.history[0].role"),
    "raw_prompt_with_image": (dict(raw_prompt=True, images=[png()]), "input.raw_prompt"),
    "raw_prompt_with_system": (dict(raw_prompt=True, system="Be brief."), "input.raw_prompt"),
    "token_ids_not_raw": (dict(prompt="", prompt_token_ids=[1, 2]), "input.prompt_token_ids"),
    "token_ids_and_text": (dict(raw_prompt=True, prompt_token_ids=[1, 2]), "input.prompt_token_ids"),
    "token_ids_negative": (dict(prompt="", raw_prompt=True, prompt_token_ids=[1, -2]), "input.prompt_token_ids[1]"),
    "token_ids_too_many": (dict(prompt="", raw_prompt=True, prompt_token_ids=[1] * 101), "input.prompt_token_ids"),
    "token_ids_with_image": (
        dict(prompt="", raw_prompt=True, prompt_token_ids=[1], images=[png()]),
        "input.raw_prompt",
    ),
    "history_assistant_image": (
        dict(images=[png()], history=[types_pb2.ChatTurn(role="assistant", images=1)]),
        "input.history[0].images",
    ),
    "history_claims_missing_images": (
        dict(history=[types_pb2.ChatTurn(role="user", text="x", images=1)]),
        "input.history",
    ),
    "history_too_long": (
        dict(prompt="x", system="y" * 60, history=[types_pb2.ChatTurn(role="user", text="z" * 60)]),
        "input.prompt",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
async def test_invalid_requests_name_the_field(gw, case):
    kwargs, field = BAD_INPUTS[case]
    before = len(gw.scheduler.items)
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await gw.infer.Infer(request(**kwargs))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.value.details()
    assert field in violations(exc.value)
    assert len(gw.scheduler.items) == before  # nothing reached the scheduler


async def test_a_request_over_its_pixel_budget_is_refused_before_decoding():
    """Each image within max_image_pixels, together over max_request_pixels: refused on the
    headers' sizes (a header-only image proves nothing was decoded: it has no pixel data)."""
    async with gateway(max_request_pixels=2 * 64 * 64 - 1) as env:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await env.infer.Infer(request(images=[png((64, 64)), png_claiming(64, 64)]))
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "input" in violations(exc.value) and "pixels" in exc.value.details()
        ok = await env.infer.Infer(request(images=[png((64, 63)), png((64, 64))]))  # within it
        assert ok.result.text and len(env.scheduler.items) == 1


async def test_invalid_stream_request_is_refused_too(gw):
    req = request(prompt="")
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        async for _ in gw.infer.InferStream(inference_service_pb2.InferStreamRequest(input=req.input)):
            pass
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and violations(exc.value) == ["input"]


@pytest.mark.parametrize("target", [dict(adapter="adapters/nope"), dict(task="tasks/nope")])
async def test_unknown_adapter_or_task_is_not_found(gw, target):
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await gw.infer.Infer(request(**target))
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_token_prompt_reaches_the_work_item(gw):
    await gw.infer.Infer(request(prompt="", raw_prompt=True, prompt_token_ids=[5] * 100))  # 100: the limit
    item = gw.scheduler.items[-1]
    assert item.raw_prompt and item.prompt == "" and list(item.prompt_token_ids) == [5] * 100


async def test_the_conversation_reaches_the_work_item(gw):
    turns = [types_pb2.ChatTurn(role="user", text="Hi", images=1), types_pb2.ChatTurn(role="assistant", text="Hello")]
    await gw.infer.Infer(request(system="Be brief.", history=turns, images=[png(), png()]))
    item = gw.scheduler.items[-1]
    assert item.system == "Be brief." and list(item.history) == turns and len(item.images) == 2


async def test_infer_builds_the_work_item_and_echoes_the_request_id(gw):
    resp = await gw.infer.Infer(
        request(
            adapter="adapters/cars@prod",
            images=[png()],
            request_id="abc-1",
            params=dict(temperature=0.7, top_p=0.9, top_k=5, logit_bias={t: -100.0 for t in range(300)}),
        )
    )
    item = gw.scheduler.items[-1]
    assert item.request_id == "abc-1" and gw.scheduler.request_ids[-1] == "abc-1"
    assert item.adapter.version == V1.name and item.adapter.sha256 == V1.sha256
    assert item.output_kind == types_pb2.OUTPUT_KIND_TEXT and item.head == ""
    assert item.params.max_new_tokens == 64 and item.params.top_k == 5  # server default filled in
    assert dict(item.params.logit_bias) == {t: -100.0 for t in range(300)}  # 300 entries: OpenAI's bound
    assert len(item.images) == 1
    r = resp.result
    assert (r.request_id, r.text, r.adapter_version, r.worker) == ("abc-1", "a red car", V1.name, "w1")


async def test_task_label_request_carries_the_head(gw):
    resp = await gw.infer.Infer(
        request(task="tasks/car-color", images=[png()], output_kind=types_pb2.OUTPUT_KIND_LABEL)
    )
    item = gw.scheduler.items[-1]
    assert item.head == "color" and item.adapter.version == V1.name
    assert item.output_kind == types_pb2.OUTPUT_KIND_LABEL
    assert resp.result.label == "red" and resp.result.request_id == item.request_id != ""


async def test_generated_request_id_and_default_deadline(gw):
    resp = await gw.infer.Infer(request())
    item = gw.scheduler.items[-1]
    assert item.request_id and resp.result.request_id == item.request_id == gw.scheduler.request_ids[-1]
    assert not item.HasField("adapter")
    assert 0 < gw.scheduler.remaining[-1] <= 31.0  # default deadline (+ clock/encoding slack)


async def test_client_deadline_is_capped(gw):
    await gw.infer.Infer(request(), timeout=3600)
    assert 30.0 < gw.scheduler.remaining[-1] <= 61.0  # cut to max_deadline_s (+ clock/encoding slack)
    await gw.infer.Infer(request(), timeout=5)
    assert 0 < gw.scheduler.remaining[-1] <= 6.0


async def test_stream_relays_deltas_then_the_result(gw):
    out = [
        r
        async for r in gw.infer.InferStream(
            inference_service_pb2.InferStreamRequest(input=request().input, request_id="s-1")
        )
    ]
    assert [r.text_delta for r in out] == ["a ", "red ", "car", ""]
    assert out[-1].result.text == "a red car" and out[-1].result.request_id == "s-1"
    assert not any(r.HasField("result") for r in out[:-1])


async def test_client_cancel_cancels_the_scheduler_call():
    async with gateway() as env:
        env.scheduler.hang = True
        call = env.infer.InferStream(inference_service_pb2.InferStreamRequest(input=request().input))
        reader = asyncio.ensure_future(call.read())
        for _ in range(250):
            if env.scheduler.items:
                break
            await asyncio.sleep(0.02)
        call.cancel()
        await asyncio.wait_for(env.scheduler.cancelled.wait(), 5)
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await reader


async def test_admin_rpcs_are_forwarded_without_credentials():
    async with gateway(admin_keys=[ADMIN_KEY]) as env:
        md = (("authorization", f"Bearer {ADMIN_KEY}"), (REQUEST_ID_KEY, "adm-1"))
        got = await env.admin.GetAdapter(admin_service_pb2.GetAdapterRequest(name="adapters/cars"), metadata=md)
        assert got.adapter.name == "adapters/cars"
        seen = env.store.metadata[-1]
        assert seen.get(REQUEST_ID_KEY) == "adm-1" and "authorization" not in seen
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await env.admin.GetAdapter(admin_service_pb2.GetAdapterRequest(name="adapters/x"), metadata=md)
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND

        async def parts():
            yield admin_service_pb2.UploadAdapterVersionRequest(
                metadata=admin_service_pb2.UploadAdapterVersionMetadata(parent="adapters/cars")
            )
            for chunk in (b"abc", b"def"):
                yield admin_service_pb2.UploadAdapterVersionRequest(chunk=chunk)

        up = await env.admin.UploadAdapterVersion(parts(), metadata=md)
        assert up.version.name == "adapters/cars/versions/1" and env.store.uploaded == b"abcdef"

        status = await env.admin.GetClusterStatus(admin_service_pb2.GetClusterStatusRequest(), metadata=md)
        assert status.queued_requests == 2 and status.workers[0].address == "w1"


async def test_dataset_uploads_are_forwarded_to_the_store_for_admins_only():
    def bearer(key):
        return (("authorization", f"Bearer {key}"),)

    async def code_of(coro):
        try:
            await coro
        except grpc.aio.AioRpcError as err:
            return err.code()
        return grpc.StatusCode.OK

    async with gateway(admin_keys=[ADMIN_KEY], api_keys=[API_KEY]) as env:

        def parts():
            async def gen():
                yield admin_service_pb2.UploadDatasetRequest(
                    metadata=admin_service_pb2.UploadDatasetMetadata(sha256="ab" * 32)
                )
                for chunk in (b"tar", b"gz"):
                    yield admin_service_pb2.UploadDatasetRequest(chunk=chunk)

            return gen()

        assert (
            await code_of(env.admin.UploadDataset(parts(), metadata=bearer(API_KEY)))
            == grpc.StatusCode.PERMISSION_DENIED
        )
        got = await env.admin.UploadDataset(parts(), metadata=bearer(ADMIN_KEY))
        assert got.dataset.name == "datasets/" + "ab" * 32 and got.dataset.size_bytes == 5
        assert env.store.datasets == [b"targz"]


async def test_resolutions_of_ready_versions_are_reused_until_the_registry_changes():
    async with gateway(resolve_cache_s=60.0) as env:
        for _ in range(3):
            await env.infer.Infer(request(adapter="adapters/cars@prod"))
        await env.infer.Infer(request(task="tasks/caption"))
        assert env.store.resolved == ["adapters/cars@prod", "tasks/caption"]
        # not READY: asked again every time (the version must be served once it is READY)
        env.store.pending.add("adapters/cars@next")
        for _ in range(2):
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await env.infer.Infer(request(adapter="adapters/cars@next"))
            assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert env.store.resolved[2:] == ["adapters/cars@next"] * 2
        # NOT_FOUND is not kept either
        for _ in range(2):
            with pytest.raises(grpc.aio.AioRpcError):
                await env.infer.Infer(request(adapter="adapters/nope"))
        assert env.store.resolved[4:] == ["adapters/nope"] * 2
        # a registry change through this gateway drops what it kept
        await env.admin.SetAlias(
            admin_service_pb2.SetAliasRequest(adapter="adapters/cars", alias="prod", version="adapters/cars/versions/3")
        )
        await env.infer.Infer(request(adapter="adapters/cars@prod"))
        assert env.store.resolved[-1] == "adapters/cars@prod" and len(env.store.resolved) == 7


async def test_resolutions_expire_and_can_be_off():
    async with gateway(resolve_cache_s=0.2) as env:
        await env.infer.Infer(request(adapter="adapters/cars"))
        await env.infer.Infer(request(adapter="adapters/cars"))
        assert len(env.store.resolved) == 1
        await asyncio.sleep(0.3)
        await env.infer.Infer(request(adapter="adapters/cars"))
        assert len(env.store.resolved) == 2
    async with gateway(resolve_cache_s=0) as env:
        for _ in range(3):
            await env.infer.Infer(request(adapter="adapters/cars"))
        assert len(env.store.resolved) == 3


async def test_resolved_references_are_served_through_a_store_outage():
    async with gateway(resolve_cache_s=0.1, resolve_stale_s=30.0) as env:
        await env.infer.Infer(request(adapter="adapters/cars"))
        await asyncio.sleep(0.2)  # expired: the store is asked again, and is down
        env.store.down = grpc.StatusCode.UNAVAILABLE
        ok = await env.infer.Infer(request(adapter="adapters/cars"))
        assert ok.result.text and env.store.resolved.count("adapters/cars") == 2
        env.store.down, env.store.hang = None, True  # no answer at all: 2 s, not the request's deadline
        t0 = time.monotonic()
        await env.infer.Infer(request(adapter="adapters/cars"), timeout=20)
        assert time.monotonic() - t0 < 5
        env.store.hang, env.store.down = False, grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.aio.AioRpcError) as never:  # never resolved: nothing to stand in
            await env.infer.Infer(request(adapter="adapters/cars@prod"))
        assert never.value.code() == grpc.StatusCode.UNAVAILABLE
        env.store.down = grpc.StatusCode.NOT_FOUND  # not an outage: the store's answer stands
        with pytest.raises(grpc.aio.AioRpcError) as gone:
            await env.infer.Infer(request(adapter="adapters/cars"))
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    async with gateway(resolve_cache_s=0.1, resolve_stale_s=0) as env:
        await env.infer.Infer(request(adapter="adapters/cars"))
        await asyncio.sleep(0.2)
        env.store.down = grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.aio.AioRpcError) as off:
            await env.infer.Infer(request(adapter="adapters/cars"))
        assert off.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_auth():
    with structlog.testing.capture_logs() as logs:
        env = await _check_auth()
    assert env.store.uploaded == b""  # the refused upload never reached the store
    assert logs and not any(k in repr(line) for line in logs for k in (API_KEY, ADMIN_KEY, "wrong"))


async def _check_auth():
    async with gateway(api_keys=[API_KEY], admin_keys=[ADMIN_KEY]) as env:

        def bearer(key):
            return (("authorization", f"Bearer {key}"),)

        async def code_of(coro):
            try:
                await coro
            except grpc.aio.AioRpcError as err:
                return err.code()
            return grpc.StatusCode.OK

        infer = lambda md=None: env.infer.Infer(request(), metadata=md)
        admin = lambda md=None: env.admin.GetClusterStatus(admin_service_pb2.GetClusterStatusRequest(), metadata=md)
        assert await code_of(infer()) == grpc.StatusCode.UNAUTHENTICATED
        assert await code_of(infer(bearer("wrong"))) == grpc.StatusCode.UNAUTHENTICATED
        assert await code_of(infer((("authorization", API_KEY),))) == grpc.StatusCode.UNAUTHENTICATED
        assert await code_of(infer(bearer(API_KEY))) == grpc.StatusCode.OK
        assert await code_of(infer(bearer(ADMIN_KEY))) == grpc.StatusCode.OK
        assert await code_of(admin()) == grpc.StatusCode.UNAUTHENTICATED
        assert await code_of(admin(bearer("wrong"))) == grpc.StatusCode.UNAUTHENTICATED
        assert await code_of(admin(bearer(API_KEY))) == grpc.StatusCode.PERMISSION_DENIED
        assert await code_of(admin(bearer(ADMIN_KEY))) == grpc.StatusCode.OK

        stream = env.infer.InferStream(inference_service_pb2.InferStreamRequest(input=request().input))
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            async for _ in stream:
                pass
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED

        async def parts():
            yield admin_service_pb2.UploadAdapterVersionRequest(chunk=b"x")

        assert (
            await code_of(env.admin.UploadAdapterVersion(parts(), metadata=bearer(API_KEY)))
            == grpc.StatusCode.PERMISSION_DENIED
        )

        # Health stays open.
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        health = await health_pb2_grpc.HealthStub(env.channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    return env


async def test_auth_off_without_keys(gw):
    status = await gw.admin.GetClusterStatus(admin_service_pb2.GetClusterStatusRequest())
    assert status.queued_requests == 2


def test_settings_lists_from_env(monkeypatch):
    monkeypatch.setenv("VALORA_API_KEYS", "k1, k2")
    monkeypatch.setenv("VALORA_ADMIN_KEYS", '["a1"]')
    s = GatewaySettings()
    assert [k.get_secret_value() for k in s.api_keys] == ["k1", "k2"]
    assert [k.get_secret_value() for k in s.admin_keys] == ["a1"]
    assert "k1" not in repr(s)  # secrets never show up in logs of the settings


def test_an_answer_asked_for_before_a_registry_change_is_not_kept():
    from services.gateway.inference import ResolutionCache

    cache = ResolutionCache(60.0)
    ready = adapter_store_service_pb2.ResolveReferenceResponse(version=V1)
    before = cache.generation
    cache.clear()  # e.g. SetAlias through this gateway while the store was being asked
    cache.put("adapters/cars@prod", ready, before)
    assert cache.get("adapters/cars@prod") is None
    cache.put("adapters/cars@prod", ready, cache.generation)
    assert cache.get("adapters/cars@prod") is ready
