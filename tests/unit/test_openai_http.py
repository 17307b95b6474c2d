"""The OpenAI-compatible HTTP front of the gateway, driven by the `openai` SDK itself: real
gateway (gRPC + HTTP) and scheduler on loopback, in-test worker and store servicers."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json

import aiohttp
import grpc
import numpy as np
import openai
import pytest
from PIL import Image

from services.common import errors
from services.gateway.config import GatewaySettings
from services.gateway.http_openai import _error_body, build_completion_input, build_input, RequestError
from services.gateway.server import create_server as create_gateway
from services.scheduler.config import SchedulerSettings
from services.scheduler.server import create_server as create_scheduler
from valora_protos.internal.v1 import (
    adapter_store_service_pb2,
    adapter_store_service_pb2_grpc,
    worker_service_pb2,
    worker_service_pb2_grpc,
)
from valora_protos.v1 import admin_service_pb2, admin_service_pb2_grpc, inference_service_pb2, resources_pb2, types_pb2

pytestmark = pytest.mark.anyio
VERSION = resources_pb2.AdapterVersion(
    name="adapters/cars/versions/1", sha256="ef" * 32, state=resources_pb2.ADAPTER_VERSION_STATE_READY
)
KEY = "sk-test"


@pytest.fixture
def anyio_backend():
    return "asyncio"


def png_data_url() -> tuple[str, bytes]:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (28, 28, 3), dtype=np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode(), buf.getvalue()


class Store(adapter_store_service_pb2_grpc.AdapterStoreServiceServicer, admin_service_pb2_grpc.AdminServiceServicer):
    async def ResolveReference(self, request, context):
        if request.reference.startswith("adapters/missing"):
            raise errors.AdapterNotFound(f"{request.reference} does not exist", reason="ADAPTER_NOT_FOUND")
        return adapter_store_service_pb2.ResolveReferenceResponse(version=VERSION)

    async def ListAdapters(self, request, context):
        return admin_service_pb2.ListAdaptersResponse(
            adapters=[resources_pb2.Adapter(name="adapters/cars", aliases={"prod": VERSION.name})]
        )

    async def ListTasks(self, request, context):
        return admin_service_pb2.ListTasksResponse(
            tasks=[resources_pb2.Task(name="tasks/count-cars", adapter="adapters/cars@prod")]
        )


TOKENS = ("two", " ", "cars", "<|im_end|>")  # the fake worker's tokens; the last shows no text


def token_logprob(token: str, logprob: float, top: int) -> types_pb2.TokenLogprob:
    alts = [
        types_pb2.TokenLogprob(token=token if j == 0 else f"alt{j}", logprob=logprob - j, bytes=token.encode())
        for j in range(top)
    ]
    return types_pb2.TokenLogprob(token=token, logprob=logprob, bytes=token.encode(), top_logprobs=alts)


class Worker(worker_service_pb2_grpc.WorkerServiceServicer):
    def __init__(self):
        self.items = []
        self.fail_with: grpc.StatusCode | None = None
        self.fail_error: errors.ValoraError | None = None  # raised as it is (its status details)
        self.hang = False  # a long generation: never answers until cancelled
        self.cancelled = asyncio.Event()

    async def Generate(self, request, context):
        self.items.append(request.item)
        if self.fail_with is not None:
            await context.abort(self.fail_with, "worker says no")
        if self.fail_error is not None:
            raise self.fail_error
        if self.hang:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        p = request.item.params
        lps = [token_logprob(t, -0.1 * (i + 1), p.top_logprobs) for i, t in enumerate(TOKENS)] if p.logprobs else []
        for delta, shown in (("two ", lps[:2]), ("cars", lps[2:3])):
            yield worker_service_pb2.GenerateResponse(text_delta=delta, logprobs=shown)
        yield worker_service_pb2.GenerateResponse(
            result=inference_service_pb2.InferResult(
                text="two cars",
                finish_reason=types_pb2.FINISH_REASON_EOS,
                mode=types_pb2.INFERENCE_MODE_UNMERGED,
                usage=types_pb2.Usage(prompt_tokens=5, image_tokens=4, output_tokens=2),
                logprobs=lps,
            )
        )

    async def GetWorkerStatus(self, request, context):
        return worker_service_pb2.GetWorkerStatusResponse(
            status=admin_service_pb2.WorkerStatus(healthy=True, max_batch_size=4)
        )


@contextlib.asynccontextmanager
async def http_stack(**gateway_kwargs):
    from services.common.server import ErrorInterceptor

    worker, store = Worker(), Store()
    backend = grpc.aio.server(interceptors=[ErrorInterceptor()])
    worker_service_pb2_grpc.add_WorkerServiceServicer_to_server(worker, backend)
    adapter_store_service_pb2_grpc.add_AdapterStoreServiceServicer_to_server(store, backend)
    admin_service_pb2_grpc.add_AdminServiceServicer_to_server(store, backend)
    addr = f"127.0.0.1:{backend.add_insecure_port('127.0.0.1:0')}"
    await backend.start()
    scheduler = await create_scheduler(
        SchedulerSettings(worker_addresses=[addr], status_poll_s=0.05, dispatch_tick_s=0.05)
    )
    await scheduler.start()
    gateway = await create_gateway(
        GatewaySettings(
            scheduler_address=f"127.0.0.1:{scheduler.port}", adapter_store_address=addr, api_keys=KEY, **gateway_kwargs
        )
    )
    await gateway.start()
    base_url = f"http://127.0.0.1:{gateway.http.port}/v1"
    client = openai.AsyncOpenAI(api_key=KEY, base_url=base_url, max_retries=0, timeout=10)
    try:
        yield worker, client, base_url
    finally:
        await client.close()
        await gateway.stop(0)
        await scheduler.stop(0)
        await backend.stop(0)


def user_message(url: str, text: str = "How many cars?") -> list[dict]:
    return [
        {"role": "user", "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]}
    ]


async def test_chat_completion_with_an_image_and_an_adapter():
    url, raw = png_data_url()
    async with http_stack() as (worker, client, _):
        resp = await client.chat.completions.create(
            model="adapters/cars@prod",
            messages=user_message(url),
            max_completion_tokens=7,
            temperature=0.5,
            top_p=0.9,
            stop=["\n"],
            seed=42,
        )
    assert resp.choices[0].message.content == "two cars"
    assert resp.choices[0].finish_reason == "stop" and resp.model == "adapters/cars@prod"
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.total_tokens) == (9, 2, 11)
    item = worker.items[0]
    assert item.prompt == "How many cars?" and item.images[0].data == raw and item.images[0].mime_type == "image/png"
    assert item.adapter.version == VERSION.name
    p = item.params
    assert (p.max_new_tokens, round(p.temperature, 3), round(p.top_p, 3), list(p.stop), p.seed) == (
        7,
        0.5,
        0.9,
        ["\n"],
        42,
    )
    assert resp.id == f"chatcmpl-{item.request_id}"


async def test_streamed_chunks_then_done():
    url, _ = png_data_url()
    async with http_stack() as (worker, client, base_url):
        stream = await client.chat.completions.create(
            model="valora-base",
            messages=user_message(url),
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        async with (
            aiohttp.ClientSession() as raw,
            raw.post(
                f"{base_url}/chat/completions",
                headers={"Authorization": f"Bearer {KEY}"},
                json={"model": "valora-base", "stream": True, "messages": [{"role": "user", "content": "hi"}]},
            ) as r,
        ):
            text = await r.text()
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "two cars"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2
    assert not worker.items[0].HasField("adapter")  # the base model
    events = [line for line in text.split("\n\n") if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


async def test_text_completions_send_the_prompt_without_the_chat_template():
    async with http_stack() as (worker, client, _):
        resp = await client.completions.create(
            model="adapters/cars@prod",
            prompt="Once upon a time",
            max_tokens=5,
            temperature=0.7,
            stop=["."],
            extra_body={"min_p": 0.1},
        )
        chunks = [
            c
            async for c in await client.completions.create(
                model="valora-base", prompt=["Count to three:"], stream=True, stream_options={"include_usage": True}
            )
        ]
    assert resp.object == "text_completion" and resp.choices[0].text == "two cars"
    assert resp.choices[0].finish_reason == "stop" and resp.usage.completion_tokens == 2
    item = worker.items[0]
    assert item.raw_prompt and item.prompt == "Once upon a time" and item.adapter.version == VERSION.name
    assert (item.params.max_new_tokens, round(item.params.min_p, 3), list(item.params.stop)) == (5, 0.1, ["."])
    assert resp.id == f"cmpl-{item.request_id}"
    assert worker.items[1].raw_prompt and worker.items[1].prompt == "Count to three:"
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "two cars"
    assert all(c.object == "text_completion" for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2


async def test_token_id_prompts_reach_the_worker_as_they_are():
    """vLLM's token prompts through the openai SDK: a list of ints, or a batch of one such list;
    a batch of several and a negative id are 400s naming the field."""
    async with http_stack() as (worker, client, _):
        resp = await client.completions.create(model="valora-base", prompt=[11, 12, 13], max_tokens=3)
        chunks = [c async for c in await client.completions.create(model="adapters/cars", prompt=[[7, 8]], stream=True)]
        with pytest.raises(openai.BadRequestError) as batch:
            await client.completions.create(model="valora-base", prompt=[[1], [2]])
        with pytest.raises(openai.BadRequestError) as negative:
            await client.completions.create(model="valora-base", prompt=[5, -1])
    assert resp.choices[0].text == "two cars" and "".join(c.choices[0].text for c in chunks if c.choices)
    first, second = worker.items
    assert first.raw_prompt and first.prompt == "" and list(first.prompt_token_ids) == [11, 12, 13]
    assert second.raw_prompt and list(second.prompt_token_ids) == [7, 8] and second.adapter.version == VERSION.name
    assert batch.value.body["param"] == "prompt" and batch.value.body["code"] == "unsupported_parameter"
    assert negative.value.body["param"] == "prompt"  # the gateway validation's input.prompt_token_ids[1]


def test_completion_request_parsing():
    inp, stream = build_completion_input(
        {"model": "valora-base", "prompt": "Hi", "echo": False, "logprobs": 0}, "valora-base"
    )
    assert inp.raw_prompt and inp.prompt == "Hi" and not stream
    assert inp.params.logprobs and inp.params.top_logprobs == 0  # the legacy logprobs: 0 alternatives
    for prompt in ([1, 2, 3], [[1, 2, 3]]):  # token ids, or a batch of one: sent on as they are
        inp, _ = build_completion_input({"model": "valora-base", "prompt": prompt}, "valora-base")
        assert inp.raw_prompt and not inp.prompt and list(inp.prompt_token_ids) == [1, 2, 3]
    for prompt in (["a", "b"], [[1], [2]], ["a", [2]]):
        with pytest.raises(RequestError) as exc:
            build_completion_input({"model": "valora-base", "prompt": prompt}, "valora-base")
        assert (exc.value.param, exc.value.code) == ("prompt", "unsupported_parameter")
        assert "a batch of 2 prompts is not supported" in exc.value.message
    for body, param in [
        ({"model": "valora-base", "prompt": [1, 2**40]}, "prompt"),
        ({"model": "valora-base", "prompt": [1, "a"]}, "prompt"),
        ({"model": "valora-base", "prompt": [True]}, "prompt"),
        ({"model": "valora-base", "prompt": [[]]}, "prompt"),
        ({"model": "valora-base", "prompt": []}, "prompt"),
        ({"model": "valora-base", "prompt": ""}, "prompt"),
        ({"model": "valora-base"}, "prompt"),
        ({"model": "valora-base", "prompt": "x", "echo": True}, "echo"),
        ({"model": "valora-base", "prompt": "x", "logprobs": True}, "logprobs"),
        ({"model": "valora-base", "prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x"}, "model"),
    ]:
        with pytest.raises(RequestError) as exc:
            build_completion_input(body, "valora-base")
        assert exc.value.param == param, body


async def test_connections_past_the_cap_get_503_and_the_rest_keep_serving():
    async with http_stack(http_max_connections=2) as (_, client, base_url):
        host, port = base_url.split("//")[1].split("/")[0].split(":")
        idle = [await asyncio.open_connection(host, int(port)) for _ in range(2)]
        await asyncio.sleep(0.1)  # aiohttp counts a connection from its first callback
        reader, writer = await asyncio.open_connection(host, int(port))
        answer = await asyncio.wait_for(reader.read(), 5)  # written at once, then closed by the server
        writer.close()
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in head
        assert json.loads(body)["error"]["code"] == "too_many_connections"
        idle[0][1].close()  # one slot frees: requests pass again
        for _ in range(50):
            try:
                models = await client.models.list()
                break
            except openai.APIStatusError as exc:
                assert exc.status_code == 503
                await asyncio.sleep(0.05)
        assert models.data[0].id == "valora-base"
        idle[1][1].close()


async def test_logprobs_in_chat_and_text_completions():
    async with http_stack() as (worker, client, _):
        resp = await client.chat.completions.create(
            model="valora-base", messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=2
        )
        chunks = [
            c
            async for c in await client.chat.completions.create(
                model="valora-base", messages=[{"role": "user", "content": "x"}], logprobs=True, stream=True
            )
        ]
        text = await client.completions.create(model="valora-base", prompt="x", logprobs=1)
        plain = await client.chat.completions.create(model="valora-base", messages=[{"role": "user", "content": "x"}])
    assert (worker.items[0].params.logprobs, worker.items[0].params.top_logprobs) == (True, 2)
    content = resp.choices[0].logprobs.content
    assert [c.token for c in content] == list(TOKENS) and [round(c.logprob, 3) for c in content] == [
        -0.1,
        -0.2,
        -0.3,
        -0.4,
    ]
    assert [t.token for t in content[0].top_logprobs] == ["two", "alt1"] and content[2].bytes == list(b"cars")
    streamed = [c.choices[0].logprobs.content for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t.token for part in streamed for t in part] == list(TOKENS)  # the EOS with the last chunk
    assert (worker.items[2].params.logprobs, worker.items[2].params.top_logprobs) == (True, 1)
    lp = text.choices[0].logprobs
    assert lp.tokens == list(TOKENS) and lp.text_offset == [0, 3, 4, 8]
    assert lp.top_logprobs[2] == {"cars": pytest.approx(-0.3)}
    assert plain.choices[0].logprobs is None and not worker.items[3].params.logprobs


async def test_logit_bias_reaches_the_worker_and_bad_ones_are_400s():
    """OpenAI's logit_bias through the SDK, chat and text completions alike; out of range or too
    many entries: the gateway's 400 naming the field (an id past the vocabulary is the worker's)."""
    async with http_stack() as (worker, client, _):
        await client.chat.completions.create(
            model="valora-base", messages=[{"role": "user", "content": "x"}], logit_bias={"5": 100, "9": -2.5}
        )
        await client.completions.create(model="valora-base", prompt="x", logit_bias={"11": -100})
        bad = []
        for bias in ({"5": 101}, {str(t): 1 for t in range(301)}, {"x": 1}):
            with pytest.raises(openai.BadRequestError) as exc:
                await client.completions.create(model="valora-base", prompt="x", logit_bias=bias)
            bad.append(exc.value.body["param"])
    assert dict(worker.items[0].params.logit_bias) == {5: 100.0, 9: -2.5}
    assert dict(worker.items[1].params.logit_bias) == {11: -100.0}
    assert bad == ["logit_bias"] * 3 and len(worker.items) == 2  # the body's parameter, not input.params.logit_bias[5]


async def test_models_lists_base_adapters_aliases_and_tasks():
    async with http_stack() as (_, client, _url):
        models = await client.models.list()
    ids = [m.id for m in models.data]
    assert ids == ["valora-base", "adapters/cars", "adapters/cars@prod", "tasks/count-cars"]


async def test_a_client_that_leaves_cancels_its_generation():
    url, _ = png_data_url()
    async with http_stack() as (worker, client, base_url):
        worker.hang = True
        async with aiohttp.ClientSession() as raw:
            post = asyncio.ensure_future(
                raw.post(
                    f"{base_url}/chat/completions",
                    headers={"Authorization": f"Bearer {KEY}"},
                    json={"model": "valora-base", "messages": user_message(url)},
                )
            )
            for _ in range(200):
                if worker.items:
                    break
                await asyncio.sleep(0.02)
            post.cancel()  # the client goes away mid-request
        await asyncio.wait_for(worker.cancelled.wait(), 5)  # the work stopped with it


async def test_connections_without_a_request_head_are_closed():
    """Idle sockets and slowloris heads (a partial request line) are closed after the header
    timeout; a connection that sent its request is served."""
    import socket as socket_mod

    async with http_stack(http_header_timeout_s=0.5) as (worker, client, base_url):
        port = int(base_url.rsplit(":", 1)[1].split("/")[0])
        idle = [socket_mod.create_connection(("127.0.0.1", port)) for _ in range(20)]
        slow = socket_mod.create_connection(("127.0.0.1", port))
        slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # never finishes its head
        await asyncio.sleep(2.0)
        assert (await client.models.list()).data  # served meanwhile

        def closed(sock) -> bool:
            sock.settimeout(2)
            try:
                return sock.recv(1024) == b""
            except (ConnectionResetError, TimeoutError, socket_mod.timeout):
                return False

        try:
            assert all(await asyncio.to_thread(lambda: [closed(s) for s in (*idle, slow)]))
        finally:
            for s in (*idle, slow):
                s.close()


async def test_health_and_one_model_by_id():
    async with http_stack() as (worker, client, base_url), aiohttp.ClientSession() as raw:
        async with raw.get(f"{base_url[:-3]}/health") as r:  # no key: probes
            assert r.status == 200
        one = await client.models.retrieve("adapters/cars@prod")
        assert one.id == "adapters/cars@prod" and one.owned_by == "valora"
        assert (await client.models.retrieve("tasks/count-cars")).id == "tasks/count-cars"
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("adapters/nope")


async def test_errors_are_openai_shaped_with_the_right_status():
    url, _ = png_data_url()
    async with http_stack() as (worker, client, base_url):
        with pytest.raises(openai.BadRequestError) as bad:  # never fetched
            await client.chat.completions.create(
                model="valora-base", messages=user_message("http://203.0.113.9/cat.png")
            )
        assert bad.value.body["code"] == "unsupported_image_url"
        assert bad.value.body["param"] == "messages[0].content[1].image_url.url"
        with pytest.raises(openai.BadRequestError) as too_long:  # the gateway's own validation
            await client.chat.completions.create(model="valora-base", messages=user_message(url), max_tokens=10**6)
        assert too_long.value.body["param"] == "max_tokens"  # the body's name, not input.params.max_new_tokens
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="adapters/missing", messages=user_message(url))
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="gpt-4o", messages=user_message(url))
        worker.fail_with = grpc.StatusCode.UNAVAILABLE
        with pytest.raises(openai.InternalServerError) as down:
            await client.chat.completions.create(model="valora-base", messages=user_message(url))
        assert down.value.status_code == 503
        wrong = openai.AsyncOpenAI(api_key="nope", base_url=base_url, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await wrong.chat.completions.create(model="valora-base", messages=user_message(url))
        with pytest.raises(openai.AuthenticationError):
            await wrong.models.list()
        await wrong.close()
        async with aiohttp.ClientSession() as raw:
            async with raw.get(f"{base_url}/models") as r:
                missing_key = (r.status, await r.json())
            async with raw.post(
                f"{base_url}/chat/completions", data=b"{", headers={"Authorization": f"Bearer {KEY}"}
            ) as r:
                not_json = r.status
    assert missing_key[0] == 401 and missing_key[1]["error"]["type"] == "authentication_error"
    assert not_json == 400


async def test_validation_errors_name_the_http_parameter_not_the_grpc_field():
    """A field violation's `param` is the HTTP body's parameter, never a gRPC field path: the
    gateway validation's (`input.params.…`) and the worker's (`item.…`), chat and text completions,
    plain and streamed; a field the body does not have (`item.params`, `request_id`) gives no param;
    an image's is its message's content part. The message names the same parameter."""
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yes"},
        {"role": "user", "content": "and?"},
    ]
    async with http_stack() as (worker, client, _):

        async def param(call, **kwargs):
            with pytest.raises(openai.BadRequestError) as exc:
                got = await call(**kwargs)
                if kwargs.get("stream"):
                    [c async for c in got]
            for text in (str(exc.value.body["param"]), exc.value.body["message"]):
                assert "item." not in text and "input." not in text, exc.value.body
            return exc.value.body["param"]

        chats = client.chat.completions.create
        texts = client.completions.create
        gateway = [  # the gateway validation's own field violations
            (
                await param(chats, model="valora-base", messages=chat, max_completion_tokens=10**6),
                "max_completion_tokens",
            ),
            (await param(chats, model="valora-base", messages=chat, temperature=50), "temperature"),
            (await param(chats, model="valora-base", messages=chat, top_logprobs=99, logprobs=True), "top_logprobs"),
            (await param(texts, model="valora-base", prompt="x", logprobs=99), "logprobs"),
            (await param(texts, model="valora-base", prompt="x", max_tokens=10**6, stream=True), "max_tokens"),
            (await param(chats, model="valora-base", messages=chat, stop=["x" * 10_000]), "stop"),
        ]
        assert [got for got, _ in gateway] == [want for _, want in gateway]
        assert not worker.items
        worked = []
        for field, kwargs, want in (
            ("item.params.max_new_tokens", {"max_tokens": 5}, "max_tokens"),
            ("item.params.max_new_tokens", {"max_completion_tokens": 5, "stream": True}, "max_completion_tokens"),
            ("item.history[1].text", {}, "messages[2].content"),
            ("item.history[0].role", {"stream": True}, "messages[1].role"),
            ("item.prompt", {}, "messages[3].content"),
            ("item.system", {}, "messages[0].content"),
            ("item.images[0].data", {}, "messages"),
            ("item.params.logit_bias[7]", {}, "logit_bias"),
            ("item.params", {}, None),
            ("request_id", {}, None),
        ):
            worker.fail_error = errors.invalid_field(field, "the worker says no")
            worked.append((field, await param(chats, model="valora-base", messages=chat, **kwargs), want))
        for field, want in (
            ("item.prompt", "prompt"),
            ("item.prompt_token_ids[0]", "prompt"),
            ("item.params.top_logprobs", "logprobs"),
            ("item.params.max_new_tokens", "max_tokens"),
        ):
            worker.fail_error = errors.invalid_field(field, "the worker says no")
            worked.append((field, await param(texts, model="valora-base", prompt=[5, 6]), want))
        # an image's violation names its content part, counted over every message's images
        url, _ = png_data_url()
        image = {"type": "image_url", "image_url": {"url": url}}
        shown = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "this"}, image]},
            {"role": "assistant", "content": "yes"},
            {"role": "user", "content": [image, {"type": "text", "text": "and these?"}, image]},
        ]
        for field, want in (
            ("item.images[0].data", "messages[1].content[1]"),
            ("item.images[1]", "messages[3].content[0]"),
            ("item.images[2].data", "messages[3].content[2]"),
            ("item.images[3].data", "messages"),
        ):
            worker.fail_error = errors.invalid_field(field, "the worker says no")
            worked.append((field, await param(chats, model="valora-base", messages=shown), want))
        assert [(f, got) for f, got, _ in worked] == [(f, want) for f, _, want in worked]


async def test_hostile_requests_get_4xx_and_keyless_bodies_are_not_read():
    """What answered 500 (deep JSON, a non-object stream_options, a non-ASCII Authorization
    header), and a keyless caller's body: refused on its key (401) before it is parsed."""
    url, _ = png_data_url()
    good = {"model": "valora-base", "messages": user_message(url)}
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    async with http_stack() as (worker, client, base_url), aiohttp.ClientSession() as raw:

        async def post(body: bytes, headers) -> tuple[int, dict]:
            async with raw.post(f"{base_url}/chat/completions", data=body, headers=headers) as r:
                return r.status, await r.json()

        deep = await post(b"[" * 100_000 + b"]" * 100_000, auth)
        options = await post(json.dumps({**good, "stream": True, "stream_options": [1]}).encode(), auth)
        non_ascii = await post(json.dumps(good).encode(), {**auth, "Authorization": "Bearer sk-t\u00e9st"})
        keyless_garbage = await post(b"{" * 1000, {"Content-Type": "application/json"})
        models = await raw.get(f"{base_url}/models", headers={"Authorization": "Bearer \u00e9"})
        models_status = models.status
        models.release()
    assert deep[0] == 400 and "nested too deeply" in deep[1]["error"]["message"], deep
    assert options[0] == 400 and options[1]["error"]["param"] == "stream_options", options
    assert non_ascii[0] == 401 and models_status == 401, (non_ascii, models_status)
    assert keyless_garbage[0] == 401, keyless_garbage  # the key first: the body was never parsed
    assert not worker.items


@pytest.mark.parametrize(
    ("exc", "status", "retry_after"),
    [
        (errors.InvalidArgument("x"), 400, None),
        (errors.Unauthenticated("x"), 401, None),
        (errors.PermissionDenied("x"), 403, None),
        (errors.AdapterNotFound("x"), 404, None),
        (errors.CapacityExceeded("queue full", retry_after_s=2.2), 429, "2"),
        (errors.WorkerUnavailable("x"), 503, None),
        (errors.DeadlineExceeded("x"), 504, None),
    ],
)
def test_status_mapping(exc, status, retry_after):
    got, body, headers = _error_body(exc)
    assert got == status and body["error"]["message"] == exc.message
    assert headers.get("Retry-After") == retry_after


def test_request_parsing():
    inp, stream = build_input(
        {
            "model": "tasks/count",
            "output_kind": "label",
            "stream": True,
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count."}],
        },
        "valora-base",
    )
    assert stream and inp.task == "tasks/count" and inp.output_kind == types_pb2.OUTPUT_KIND_LABEL
    assert inp.system == "Be brief." and inp.prompt == "Count." and not inp.history
    neutral, _ = build_input(
        {
            "model": "valora-base",
            "messages": [{"role": "user", "content": "x"}],
            "top_k": 5,
            "min_p": 0.25,
            "logprobs": False,
            "presence_penalty": 0.5,
            "frequency_penalty": -1,
            "repetition_penalty": 1.2,
            "response_format": {"type": "text"},
            "logit_bias": {"42": 3, "7": -100.0},
        },
        "valora-base",
    )
    p = neutral.params
    assert p.top_k == 5 and p.min_p == 0.25 and not p.logprobs  # passed on
    assert dict(p.logit_bias) == {42: 3.0, 7: -100.0}
    assert (p.presence_penalty, p.frequency_penalty, round(p.repetition_penalty, 3)) == (0.5, -1.0, 1.2)
    # (neutral values of unsupported parameters are fine)
    url, _ = png_data_url()
    inp, _ = build_input(
        {
            "model": "valora-base",
            "messages": [
                {"role": "system", "content": "Answer in French."},
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What?"}],
                },
                {"role": "assistant", "content": "Une voiture."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "And here?"}, {"type": "image_url", "image_url": url}],
                },
            ],
        },
        "valora-base",
    )
    assert inp.system == "Answer in French." and inp.prompt == "And here?" and len(inp.images) == 2
    assert [(t.role, t.text, t.images) for t in inp.history] == [("user", "What?", 1), ("assistant", "Une voiture.", 0)]
    for body, param in [
        ({"model": "valora-base", "messages": []}, "messages"),
        ({"model": "valora-base", "messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
        ({"model": "valora-base", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2**40}, "max_tokens"),
        ({"model": "valora-base", "messages": [{"role": "user", "content": "x"}], "seed": -1}, "seed"),
        (
            {"model": "valora-base", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
            "max_completion_tokens",
        ),
        (
            {
                "model": "valora-base",
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}],
                    }
                ],
            },
            "messages[0].content[0].image_url.url",
        ),
        (
            {
                "model": "valora-base",
                "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
            },
            "messages",
        ),
        (
            {"model": "valora-base", "messages": [{"role": "tool", "content": "x"}, {"role": "user", "content": "y"}]},
            "messages[0].role",
        ),
        *[
            ({"model": "valora-base", "messages": [{"role": "user", "content": "x"}], key: value}, key)
            for key, value in (
                ("logprobs", 1),
                ("top_logprobs", 2),
                ("presence_penalty", "0.5"),
                ("logit_bias", {"a": 3}),
                ("logit_bias", {"-1": 3}),
                ("logit_bias", {"1" + "0" * 12: 3}),
                ("logit_bias", {"42": "3"}),
                ("logit_bias", {"42": True}),
                ("logit_bias", [42]),
                ("response_format", {"type": "json_object"}),
                ("tools", [{"type": "function"}]),
                ("min_p", "0.1"),
            )
        ],
    ]:
        with pytest.raises(RequestError) as exc:
            build_input(body, "valora-base")
        assert exc.value.param == param


async def test_unknown_arguments_are_refused_as_openai_refuses_them():
    """A misspelled parameter (the SDK's extra_body sends anything) is OpenAI's 400 naming it,
    not silently ignored; inside a message too. valora's and vLLM's extensions pass."""
    async with http_stack() as (worker, client, _):
        with pytest.raises(openai.BadRequestError) as typo:
            await client.chat.completions.create(
                model="valora-base", messages=[{"role": "user", "content": "x"}], extra_body={"temprature": 0.5}
            )
        with pytest.raises(openai.BadRequestError) as nested:
            await client.chat.completions.create(model="valora-base", messages=[{"role": "user", "contnet": "x"}])
        with pytest.raises(openai.BadRequestError) as legacy:  # a chat parameter, not the legacy API's
            await client.completions.create(model="valora-base", prompt="x", extra_body={"top_logprobs": 2})
        assert not worker.items
        first = await client.chat.completions.create(
            model="valora-base",
            messages=[{"role": "user", "content": "x"}],
            extra_body={"top_k": 3, "min_p": 0.1, "repetition_penalty": 1.1, "output_kind": "text"},
            user="u1",
        )
        again = await client.chat.completions.create(
            model="valora-base",
            messages=[{"role": "user", "content": "x"}, first.choices[0].message, {"role": "user", "content": "y"}],
        )
    assert typo.value.body == {
        "message": "Unrecognized request argument supplied: temprature",
        "type": "invalid_request_error",
        "param": "temprature",
        "code": "unrecognized_argument",
    }
    assert nested.value.body["message"] == "Unrecognized request argument supplied: messages[0].contnet"
    assert legacy.value.body["param"] == "top_logprobs"
    assert worker.items[0].params.top_k == 3 and round(worker.items[0].params.repetition_penalty, 3) == 1.1
    assert again.choices[0].message.content == "two cars"  # the SDK's own message, sent back as history
    assert [(t.role, t.text) for t in worker.items[1].history] == [("user", "x"), ("assistant", "two cars")]


async def test_adapter_release_fraction_through_extra_body():
    """Early adapter release per request over HTTP (issue 23): extra_body's
    adapter_release_fraction reaches the worker's request as the gRPC path's field, on chat and
    text completions; out of [0, 1] it is the gateway validation's 400 naming the field."""
    async with http_stack() as (worker, client, _):
        await client.chat.completions.create(
            model="adapters/cars@prod",
            messages=[{"role": "user", "content": "x"}],
            extra_body={"adapter_release_fraction": 0.25},
        )
        await client.completions.create(
            model="adapters/cars@prod", prompt="x", extra_body={"adapter_release_fraction": 1}
        )
        bad = []
        for value in (1.5, -0.1):
            with pytest.raises(openai.BadRequestError) as exc:
                await client.chat.completions.create(
                    model="adapters/cars@prod",
                    messages=[{"role": "user", "content": "x"}],
                    extra_body={"adapter_release_fraction": value},
                )
            bad.append(exc.value)
        with pytest.raises(openai.BadRequestError) as legacy_bad:
            await client.completions.create(
                model="adapters/cars@prod", prompt="x", extra_body={"adapter_release_fraction": 2}
            )
        with pytest.raises(openai.BadRequestError) as typed:  # a string is not a number
            await client.chat.completions.create(
                model="adapters/cars@prod",
                messages=[{"role": "user", "content": "x"}],
                extra_body={"adapter_release_fraction": "0.5"},
            )
    assert [round(i.params.adapter_release_fraction, 3) for i in worker.items] == [0.25, 1.0]
    for err in (*bad, legacy_bad.value):
        assert err.status_code == 400
        assert err.body["param"] == "adapter_release_fraction" and err.body["code"] == "invalid_argument"
        assert "not in [0, 1]" in err.body["message"], err.body
    assert typed.value.body["param"] == "adapter_release_fraction"


async def test_adapter_release_rule_through_extra_body():
    """The run-time release rule over HTTP: extra_body's adapter_release_rule by name reaches the
    worker's request as the gRPC field (with a fraction, the least share before it counts);
    "none" is no rule; a name it does not know, or not a string, is a 400 naming the field."""
    async with http_stack() as (worker, client, _):
        await client.chat.completions.create(
            model="adapters/cars@prod",
            messages=[{"role": "user", "content": "x"}],
            extra_body={"adapter_release_rule": "sentence_end"},
        )
        await client.completions.create(
            model="adapters/cars@prod",
            prompt="x",
            extra_body={"adapter_release_rule": "sentence_end", "adapter_release_fraction": 0.5},
        )
        await client.completions.create(
            model="adapters/cars@prod", prompt="x", extra_body={"adapter_release_rule": "none"}
        )
        errs = []
        for value in ("sentence-end", 1):
            with pytest.raises(openai.BadRequestError) as exc:
                await client.chat.completions.create(
                    model="adapters/cars@prod",
                    messages=[{"role": "user", "content": "x"}],
                    extra_body={"adapter_release_rule": value},
                )
            errs.append(exc.value)
    assert [(i.params.adapter_release_rule, i.params.adapter_release_fraction) for i in worker.items] == [
        (types_pb2.ADAPTER_RELEASE_RULE_SENTENCE_END, 0.0),
        (types_pb2.ADAPTER_RELEASE_RULE_SENTENCE_END, 0.5),
        (types_pb2.ADAPTER_RELEASE_RULE_UNSPECIFIED, 0.0),
    ]
    for err in errs:
        assert err.status_code == 400 and err.body["param"] == "adapter_release_rule", err.body
    assert "not one of none, sentence_end" in errs[0].body["message"]


def test_every_openai_parameter_is_typed_or_refused():
    """Each parameter of the openai package's request types is either a typed field of ours or
    in UNSUPPORTED, where a value other than its neutral one is a 400 naming it."""
    import typing

    from openai.types import completion_create_params as legacy
    from openai.types.chat import completion_create_params as chat

    from services.gateway.http_openai import UNSUPPORTED
    from services.gateway.openai_models import ChatCompletionRequest, CompletionRequest

    for params, model, build, base in (
        (
            chat.CompletionCreateParamsStreaming,
            ChatCompletionRequest,
            build_input,
            {"model": "valora-base", "messages": [{"role": "user", "content": "x"}]},
        ),
        (
            legacy.CompletionCreateParamsStreaming,
            CompletionRequest,
            build_completion_input,
            {"model": "valora-base", "prompt": "x"},
        ),
    ):
        names = typing.get_type_hints(params)
        missing = [n for n in names if n not in model.model_fields and n not in UNSUPPORTED]
        assert not missing, (model.__name__, missing)
        for name in names:
            if name in UNSUPPORTED:
                with pytest.raises(RequestError) as exc:
                    build({**base, name: "used"}, "valora-base")
                assert (exc.value.param, exc.value.code) == (name, "unsupported_parameter")
                assert exc.value.message == f"{name} is not supported by this server"
    with pytest.raises(RequestError) as exc:
        build_input(
            {
                "model": "valora-base",
                "messages": [
                    {"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]},
                    {"role": "user", "content": "x"},
                ],
            },
            "valora-base",
        )
    assert (exc.value.param, exc.value.code) == ("messages[0].tool_calls", "unsupported_parameter")
    for key, value, param in (
        ("temperature", True, "temperature"),
        ("stream", "yes", "stream"),
        ("stop", [1], "stop[0]"),
        ("user", 5, "user"),
        ("top_k", 1.5, "top_k"),
        ("output_kind", "json", "output_kind"),
    ):
        with pytest.raises(RequestError) as exc:
            build_input(
                {"model": "valora-base", "messages": [{"role": "user", "content": "x"}], key: value}, "valora-base"
            )
        assert exc.value.param == param and exc.value.message.startswith(f"{param}: "), exc.value.message


def test_the_readme_openai_example_is_a_request_the_gateway_takes():
    """README's "Using it" OpenAI example (a system prompt, an https image) run against a stand-in
    SDK: the request it sends parses, its image a remote URL for the fetcher (image_urls.py)."""
    import pathlib
    import re
    import sys
    import types

    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "from openai import OpenAI" in b)
    sent = []

    class Completions:
        def create(self, **kwargs):
            sent.append(kwargs)
            return types.SimpleNamespace(choices=[types.SimpleNamespace(message=types.SimpleNamespace(content="x"))])

    class OpenAI:
        def __init__(self, **kwargs):
            self.chat = types.SimpleNamespace(completions=Completions())

    stand_in = types.ModuleType("openai")
    stand_in.OpenAI = OpenAI
    saved = sys.modules.get("openai")
    sys.modules["openai"] = stand_in
    try:
        exec(compile(block, "README.md", "exec"), {"print": lambda *a: None})  # the README's own code
    finally:
        sys.modules["openai"] = saved
    remote = []
    inp, _ = build_input(sent[0], "valora-base", remote)
    assert inp.system and inp.prompt and inp.adapter == sent[0]["model"]
    assert len(remote) == 1 and remote[0][1].startswith("https://")
