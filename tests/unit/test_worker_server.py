"""The worker's gRPC server over a real loopback port: adapters fetched from an in-test adapter
store, streaming Generate, status, mode switches, errors, deadlines and health."""

from __future__ import annotations

import asyncio
import threading
import io

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image
from prometheus_client import REGISTRY

from services.common.server import build_service
from services.worker.model import ensure_tiny_model
from services.worker.config import WorkerSettings
from services.worker.server import create_server
from services.worker.testing import InMemoryAdapterStore, random_adapter_bundle, serve_worker
from valora_protos.internal.v1 import work_pb2, worker_service_pb2, worker_service_pb2_grpc
from valora_protos.v1 import types_pb2

pytestmark = pytest.mark.anyio
A, B = "adapters/alpha/versions/1", "adapters/beta/versions/1"


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


def png(seed: int, size: int = 56) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
async def cluster(tmp_path_factory):
    model = ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2-vl")
    store = InMemoryAdapterStore(
        {
            A: random_adapter_bundle(model, rank=4, seed=1),
            B: random_adapter_bundle(model, rank=8, seed=2, heads={"kind": ["car", "bus", "bike"]}),
        },
        chunk_bytes=4096,
    )
    settings = WorkerSettings(
        model_path=str(model),
        port=0,
        build_tiny_model=False,
        max_batch_size=4,
        default_max_new_tokens=8,
        max_new_tokens_limit=2000,
        adapter_cache_dir=str(tmp_path_factory.mktemp("adapter-cache")),
    )
    async with serve_worker(settings, store) as (worker, channel):
        yield worker, store, channel, worker_service_pb2_grpc.WorkerServiceStub(channel)


def ref(name: str, store) -> work_pb2.AdapterRef:
    return work_pb2.AdapterRef(version=name, sha256=store.bundles[name].sha256)


async def generate(stub, **item):
    deltas, result = [], None
    async for msg in stub.Generate(worker_service_pb2.GenerateRequest(item=work_pb2.WorkItem(**item))):
        if msg.HasField("result"):
            result = msg.result
        else:
            deltas.append(msg.text_delta)
    return deltas, result


async def served_image_request(model_path, name: str, bundle, prompt: str, max_new: int, tmp_path, monkeypatch):
    """A worker started from VALORA_MODEL_PATH=`model_path` (a family's tiny checkpoint) answers one
    request with one image (png(7)) and adapter `name`: (the engine's family name, the result,
    the worker's status)."""
    monkeypatch.setenv("VALORA_MODEL_PATH", str(model_path))
    settings = WorkerSettings(
        port=0,
        build_tiny_model=False,
        default_max_new_tokens=max_new,
        adapter_cache_dir=str(tmp_path / "cache"),
        drain_delay_s=0,
    )
    async with serve_worker(settings, InMemoryAdapterStore({name: bundle})) as (worker, channel):
        stub = worker_service_pb2_grpc.WorkerServiceStub(channel)
        _, res = await generate(
            stub,
            request_id="g",
            prompt=prompt,
            images=[types_pb2.Image(data=png(7))],
            adapter=work_pb2.AdapterRef(version=name, sha256=bundle.sha256),
        )
        status = (await stub.GetWorkerStatus(worker_service_pb2.GetWorkerStatusRequest())).status
        return worker.servicer.engine.arch.name, res, status


async def test_health_load_generate_and_status(cluster):
    worker, store, channel, stub = cluster
    health = health_pb2_grpc.HealthStub(channel)
    resp = await health.Check(health_pb2.HealthCheckRequest(service="valora.internal.v1.WorkerService"))
    assert resp.status == health_pb2.HealthCheckResponse.SERVING

    r = await stub.LoadAdapter(worker_service_pb2.LoadAdapterRequest(adapter=ref(A, store), to_device=True))
    assert not r.already_loaded
    r = await stub.LoadAdapter(worker_service_pb2.LoadAdapterRequest(adapter=ref(A, store)))
    assert r.already_loaded and store.fetches == 1

    image = [types_pb2.Image(data=png(1), mime_type="image/png")]
    # B is not loaded yet: Generate fetches it on demand. Base and adapter requests run together.
    runs = await asyncio.gather(
        generate(stub, request_id="r-base", images=image, prompt="Describe the image."),
        generate(stub, request_id="r-a", images=image, prompt="Describe the image.", adapter=ref(A, store)),
        generate(
            stub,
            request_id="r-b",
            images=image,
            prompt="Describe the image.",
            adapter=ref(B, store),
            params=types_pb2.GenerationParams(max_new_tokens=6),
        ),
    )
    for (deltas, res), rid in zip(runs, ["r-base", "r-a", "r-b"]):
        assert res.request_id == rid and "".join(deltas) == res.text
        assert res.usage.image_tokens == 4 and res.usage.prompt_tokens > 4 and res.usage.output_tokens > 0
        assert res.timing.total_ms >= res.timing.first_token_ms > 0
        assert res.worker
    assert runs[0][1].mode == types_pb2.INFERENCE_MODE_BASE and runs[0][1].adapter_version == ""
    assert runs[1][1].mode == types_pb2.INFERENCE_MODE_UNMERGED and runs[1][1].adapter_version == A
    assert runs[2][1].usage.output_tokens <= 6
    assert runs[1][1].text != runs[0][1].text

    _, label = await generate(
        stub,
        request_id="r-l",
        images=image,
        prompt="Which vehicle?",
        adapter=ref(B, store),
        output_kind=types_pb2.OUTPUT_KIND_LABEL,
        head="kind",
    )
    assert label.finish_reason == types_pb2.FINISH_REASON_LABEL and label.label in ("car", "bus", "bike")
    assert label.scores[0].label == label.label and abs(sum(s.score for s in label.scores) - 1) < 1e-4

    status = (await stub.GetWorkerStatus(worker_service_pb2.GetWorkerStatusRequest())).status
    assert status.healthy and status.running_requests == 0 and status.max_batch_size == 4
    assert set(status.host_adapters) == {A, B} and status.device == "cpu"


async def test_a_finished_request_is_one_sample_of_vllms_per_request_histograms(cluster):
    """valora:request_prompt_tokens, request_generation_tokens and the request's prefill, decode
    and inference times (vLLM's names and phases: from its first scheduling) get one sample per
    finished request, the result's own numbers."""
    worker, store, channel, stub = cluster
    labels = {"worker": worker.servicer.worker_name}

    def read(metric: str) -> tuple[float, float]:
        return tuple(REGISTRY.get_sample_value(f"valora:{metric}_{part}", labels) or 0.0 for part in ("count", "sum"))

    names = (
        "request_prompt_tokens",
        "request_generation_tokens",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_inference_time_seconds",
    )
    before = {m: read(m) for m in names}
    _, res = await generate(
        stub,
        request_id="r-hist",
        images=[types_pb2.Image(data=png(3), mime_type="image/png")],
        prompt="Describe the image.",
        params=types_pb2.GenerationParams(max_new_tokens=5),
    )
    t = res.timing
    want = {
        "request_prompt_tokens": res.usage.prompt_tokens,
        "request_generation_tokens": res.usage.output_tokens,
        "request_prefill_time_seconds": (t.first_token_ms - t.queue_ms) / 1e3,
        "request_decode_time_seconds": (t.total_ms - t.first_token_ms) / 1e3,
        "request_inference_time_seconds": (t.total_ms - t.queue_ms) / 1e3,
    }
    assert res.usage.prompt_tokens > 4 and res.usage.output_tokens > 1
    assert 0 < want["request_prefill_time_seconds"] < want["request_inference_time_seconds"]
    for m in names:
        count, total = (after - was for after, was in zip(read(m), before[m]))
        assert count == 1 and total == pytest.approx(want[m], rel=1e-9, abs=1e-9), m


async def metric_reaches(name: str, labels: dict, at_least: float, timeout: float = 10.0) -> float:
    """The sample's value once it is at least `at_least` (the worker's watch loop exports the
    engine's steps every 0.5 s); its last value after `timeout`."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        value = REGISTRY.get_sample_value(name, labels) or 0.0
        if value >= at_least or loop.time() > end:
            return value
        await asyncio.sleep(0.05)


async def test_a_served_request_counts_in_vllms_iteration_tokens(cluster):
    """valora:iteration_tokens_total (vLLM's): one sample per engine step, its prefill tokens plus
    its decode rows; one request alone is its prompt in the prefill step, then a token a step (the
    first comes with the prefill, and a pipelined step may compute one the request never shows)."""
    worker, store, channel, stub = cluster
    engine, labels = worker.servicer.engine, {"worker": worker.servicer.worker_name}
    count0 = await metric_reaches("valora:iteration_tokens_total_count", labels, engine.steps)  # earlier tests' steps
    sum0 = REGISTRY.get_sample_value("valora:iteration_tokens_total_sum", labels)
    one = {**labels, "le": "1.0"}  # steps of one token
    ones0 = REGISTRY.get_sample_value("valora:iteration_tokens_total_bucket", one)
    steps0 = engine.steps
    _, res = await generate(
        stub,
        request_id="r-iter",
        images=[types_pb2.Image(data=png(4), mime_type="image/png")],
        prompt="Describe the image.",
        params=types_pb2.GenerationParams(max_new_tokens=6),
    )
    while engine.running_count:  # the step that emitted the result is logged when it ends
        await asyncio.sleep(0.01)
    steps = engine.steps - steps0
    count = await metric_reaches("valora:iteration_tokens_total_count", labels, count0 + steps) - count0
    total = REGISTRY.get_sample_value("valora:iteration_tokens_total_sum", labels) - sum0
    assert steps >= 2 and count == steps
    p, n = res.usage.prompt_tokens, res.usage.output_tokens
    assert n > 1 and p + n - 1 <= total <= p + n, (p, n, total)
    assert REGISTRY.get_sample_value("valora:iteration_tokens_total_bucket", one) - ones0 == steps - 1  # decode steps


async def test_a_preemption_counts_in_vllms_num_preemptions(cluster, tmp_path):
    """valora:num_preemptions_total (vLLM's): a worker whose KV pool holds the prompts of 7
    concurrent requests but not their growth preempts (StepScheduler.preempt, as in
    test_decode_graphs' tight pool), and the counter follows its step scheduler's count from 0."""
    served, store, _, _ = cluster
    block_bytes = served.servicer.engine.kv_pool.block_bytes // (served.servicer.engine.kv.block_size // 8)
    settings = WorkerSettings(
        model_path=str(served.servicer.engine.config.model_path),
        port=0,
        build_tiny_model=False,
        max_batch_size=8,
        kv_block_size=8,
        kv_cache_bytes=31 * block_bytes,
        worker_name="w-preempt",
        adapter_cache_dir=str(tmp_path / "cache"),
        drain_delay_s=0,
    )
    labels = {"worker": "w-preempt"}
    async with serve_worker(settings, store) as (worker, channel):
        assert REGISTRY.get_sample_value("valora:num_preemptions_total", labels) == 0.0  # from start-up
        engine = worker.servicer.engine
        engine.eos_ids = set()  # every request runs its full length
        stub = worker_service_pb2_grpc.WorkerServiceStub(channel)
        runs = await asyncio.gather(
            *(
                generate(
                    stub,
                    request_id=f"p{i}",
                    prompt="Describe the image." + " more" * i,
                    images=[types_pb2.Image(data=png(i), mime_type="image/png")],
                    params=types_pb2.GenerationParams(max_new_tokens=40),
                )
                for i in range(7)
            )
        )
        assert all(res.usage.output_tokens == 40 for _, res in runs)
        preempted = engine.sched.preemptions
        assert preempted > 0
        assert await metric_reaches("valora:num_preemptions_total", labels, preempted) == preempted


async def test_errors_map_to_status_codes(cluster):
    worker, store, channel, stub = cluster
    with pytest.raises(grpc.RpcError) as err:
        await generate(stub, request_id="bad", images=[types_pb2.Image(data=b"\x89PNG not really")], prompt="hi")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        await generate(
            stub,
            request_id="head",
            prompt="hi",
            adapter=ref(A, store),
            output_kind=types_pb2.OUTPUT_KIND_LABEL,
            head="nope",
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        await generate(
            stub, request_id="nf", prompt="hi", adapter=work_pb2.AdapterRef(version="adapters/nope/versions/1")
        )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    await stub.LoadAdapter(worker_service_pb2.LoadAdapterRequest(adapter=ref(B, store)))  # (whatever ran before)
    with pytest.raises(grpc.RpcError) as err:
        await stub.LoadAdapter(
            worker_service_pb2.LoadAdapterRequest(adapter=work_pb2.AdapterRef(version=B, sha256="00" * 32))
        )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # loaded with another hash
    with pytest.raises(grpc.RpcError) as err:
        await generate(
            stub,
            request_id="rel",
            prompt="hi",
            adapter=ref(A, store),
            params=types_pb2.GenerationParams(adapter_release_fraction=1.5),
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "adapter_release_fraction" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:  # a rule this worker does not know
        await generate(
            stub,
            request_id="rule",
            prompt="hi",
            adapter=ref(A, store),
            params=types_pb2.GenerationParams(adapter_release_rule=7),
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "adapter_release_rule" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:  # a token id past the model's vocabulary: only the worker knows it
        await generate(stub, request_id="bias", prompt="hi", params=types_pb2.GenerationParams(logit_bias={10**6: 1.0}))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "logit_bias[1000000]" in err.value.details()


async def test_typed_vision_placeholders_are_refused_and_batched_requests_go_on(cluster):
    """A prompt whose text holds an image placeholder, without an image and beside one, sent with
    good requests: INVALID_ARGUMENT naming item.prompt (it was INTERNAL for every request of its
    prefill batch, or a StopIteration); the others answer what they answer alone."""
    worker, store, channel, stub = cluster
    image = [types_pb2.Image(data=png(3), mime_type="image/png")]
    good = dict(prompt="Describe the image.", images=image, params=types_pb2.GenerationParams(max_new_tokens=4))
    alone = await generate(stub, request_id="alone", **good)
    runs = await asyncio.gather(
        generate(stub, request_id="pad-no-image", prompt="What is <|image_pad|>?"),
        generate(stub, request_id="g1", **good),
        generate(stub, request_id="pad-one-image", prompt="<|vision_start|><|image_pad|><|vision_end|>?", images=image),
        generate(stub, request_id="g2", **good),
        return_exceptions=True,
    )
    for bad in (runs[0], runs[2]):
        assert isinstance(bad, grpc.RpcError) and bad.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
        assert "item.prompt" in bad.details() and "<|" in bad.details()
    for got in (runs[1], runs[3]):
        assert got[1].text == alone[1].text and got[1].usage.output_tokens == alone[1].usage.output_tokens


async def test_deadline_frees_the_sequence(cluster):
    worker, store, channel, stub = cluster
    call = stub.Generate(
        worker_service_pb2.GenerateRequest(
            item=work_pb2.WorkItem(
                request_id="slow", prompt="Count.", params=types_pb2.GenerationParams(max_new_tokens=2000)
            )
        ),
        timeout=1.0,
    )
    with pytest.raises(grpc.RpcError) as err:
        async for _ in call:
            pass
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    engine = worker.servicer.engine
    for _ in range(200):
        s = engine.stats()
        if s.running == 0 and s.kv_cache_bytes == 0:
            break
        await asyncio.sleep(0.05)
    assert s.running == 0 and s.kv_cache_bytes == 0


async def test_set_mode_and_offload(cluster):
    worker, store, channel, stub = cluster
    r = await stub.SetMode(
        worker_service_pb2.SetModeRequest(mode=types_pb2.INFERENCE_MODE_MERGED, merged_adapter=ref(A, store))
    )
    assert r.switch_ms >= 0
    status = (await stub.GetWorkerStatus(worker_service_pb2.GetWorkerStatusRequest())).status
    assert status.mode == types_pb2.INFERENCE_MODE_MERGED and status.merged_adapter == A
    _, res = await generate(stub, request_id="m", prompt="hi", adapter=ref(A, store))
    assert res.mode == types_pb2.INFERENCE_MODE_MERGED
    with pytest.raises(grpc.RpcError) as err:
        await stub.OffloadAdapter(worker_service_pb2.OffloadAdapterRequest(adapter=ref(A, store)))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    await stub.SetMode(worker_service_pb2.SetModeRequest(mode=types_pb2.INFERENCE_MODE_UNMERGED))
    await stub.OffloadAdapter(worker_service_pb2.OffloadAdapterRequest(adapter=ref(A, store)))
    status = (await stub.GetWorkerStatus(worker_service_pb2.GetWorkerStatusRequest())).status
    assert A not in status.host_adapters and status.mode == types_pb2.INFERENCE_MODE_UNMERGED
    # Loading it again comes from the worker's disk cache, not the store.
    fetches = store.fetches
    r = await stub.LoadAdapter(worker_service_pb2.LoadAdapterRequest(adapter=ref(A, store)))
    assert not r.already_loaded and store.fetches == fetches


async def test_videos_and_repeated_images(cluster):
    worker, store, channel, stub = cluster
    engine = worker.servicer.engine
    frames = [types_pb2.Image(data=png(40 + i)) for i in range(3)]
    _, res = await generate(
        stub,
        request_id="vid",
        prompt="What happens?",
        images=[types_pb2.Image(data=png(39))],
        videos=[types_pb2.Video(frames=frames)],
    )
    assert res.usage.image_tokens == 4 + 2 * 4 and res.usage.output_tokens > 0  # an image + 2 temporal patches
    hits = engine.stats().image_cache.hits
    _, again = await generate(
        stub,
        request_id="vid2",
        prompt="What happens?",
        images=[types_pb2.Image(data=png(39))],
        videos=[types_pb2.Video(frames=frames)],
    )
    assert again.text == res.text and engine.stats().image_cache.hits == hits + 2
    with pytest.raises(grpc.RpcError) as err:
        await generate(
            stub,
            request_id="badvid",
            prompt="hi",
            videos=[types_pb2.Video(frames=[frames[0], types_pb2.Image(data=b"junk")])],
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "videos[0].frames[1]" in err.value.details()


async def test_merge_unmerge_switch_are_idempotent(cluster):
    worker, store, channel, stub = cluster
    status = lambda: stub.GetWorkerStatus(worker_service_pb2.GetWorkerStatusRequest())
    _, unmerged = await generate(stub, request_id="u", prompt="hi", adapter=ref(B, store))
    r = await stub.Unmerge(worker_service_pb2.UnmergeRequest())
    assert r.already_unmerged
    r = await stub.Merge(worker_service_pb2.MergeRequest(adapter=ref(A, store)))
    assert not r.already_merged and r.switch_ms > 0
    r = await stub.Merge(worker_service_pb2.MergeRequest(adapter=ref(A, store)))
    assert r.already_merged and r.switch_ms == 0
    s = (await status()).status
    assert s.mode == types_pb2.INFERENCE_MODE_MERGED and s.merged_adapter == A
    with pytest.raises(grpc.RpcError) as err:  # a stale caller thinks C is merged: refused, nothing changes
        await stub.Switch(
            worker_service_pb2.SwitchRequest(
                from_adapter=work_pb2.AdapterRef(version="adapters/gamma/versions/1"), to_adapter=ref(B, store)
            )
        )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    r = await stub.Switch(worker_service_pb2.SwitchRequest(from_adapter=ref(A, store), to_adapter=ref(B, store)))
    assert not r.already_switched and r.mode == types_pb2.INFERENCE_MODE_MERGED
    r = await stub.Switch(worker_service_pb2.SwitchRequest(from_adapter=ref(A, store), to_adapter=ref(B, store)))
    assert r.already_switched and r.switch_ms == 0  # a retried switch
    _, merged = await generate(stub, request_id="m", prompt="hi", adapter=ref(B, store))
    assert merged.mode == types_pb2.INFERENCE_MODE_MERGED and merged.text == unmerged.text
    # Switch keeps MIXTURE.
    await stub.SetMode(
        worker_service_pb2.SetModeRequest(mode=types_pb2.INFERENCE_MODE_MIXTURE, merged_adapter=ref(B, store))
    )
    r = await stub.Switch(worker_service_pb2.SwitchRequest(to_adapter=ref(A, store)))
    assert r.mode == types_pb2.INFERENCE_MODE_MIXTURE and (await status()).status.merged_adapter == A
    r = await stub.Unmerge(worker_service_pb2.UnmergeRequest())
    assert not r.already_unmerged
    assert (await stub.Unmerge(worker_service_pb2.UnmergeRequest())).already_unmerged
    s = (await status()).status
    assert s.mode == types_pb2.INFERENCE_MODE_UNMERGED and s.merged_adapter == ""
    with pytest.raises(grpc.RpcError) as err:  # nothing merged
        await stub.Switch(worker_service_pb2.SwitchRequest(to_adapter=ref(A, store)))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as err:
        await stub.Merge(worker_service_pb2.MergeRequest())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_status_reports_queue_kv_step_time_and_image_cache(cluster):
    worker, store, channel, stub = cluster
    engine = worker.servicer.engine
    call = stub.Generate(
        worker_service_pb2.GenerateRequest(
            item=work_pb2.WorkItem(
                request_id="long",
                prompt="Count.",
                images=[types_pb2.Image(data=png(39))],
                params=types_pb2.GenerationParams(max_new_tokens=1000),
            )
        )
    )
    await call.read()  # the first token: it is running
    for _ in range(100):
        s = (await stub.GetWorkerStatus(worker_service_pb2.GetWorkerStatusRequest())).status
        if s.kv_cache_bytes > 0:
            break
        await asyncio.sleep(0.02)
    call.cancel()
    stats = engine.stats()
    assert s.running_requests == 1 and s.kv_cache_bytes > 0 and s.last_step_ms > 0 and s.waiting_requests == 0
    assert s.image_cache_hits >= 1 and s.image_cache_misses >= 1  # png(39) was seen in an earlier test
    assert s.image_cache_hits <= stats.image_cache.hits and s.image_cache_misses <= stats.image_cache.misses


async def test_health_follows_the_engine(cluster):
    """Last in this module: it stops the shared worker's engine."""
    worker, store, channel, stub = cluster
    health = health_pb2_grpc.HealthStub(channel)
    await asyncio.get_running_loop().run_in_executor(None, worker.servicer.engine.stop)
    for _ in range(100):
        resp = await health.Check(health_pb2.HealthCheckRequest(service=""))
        if resp.status == health_pb2.HealthCheckResponse.NOT_SERVING:
            break
        await asyncio.sleep(0.05)
    assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.RpcError) as err:
        await generate(stub, request_id="dead", prompt="hi")
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert worker.failed.is_set() and worker.exit_code == 1  # served, the process drains and exits 1


async def test_a_stalled_engine_is_not_serving_until_it_steps_again(tmp_path):
    model = ensure_tiny_model(tmp_path / "tiny-qwen2-vl")
    worker = await create_server(
        WorkerSettings(
            model_path=str(model),
            port=0,
            build_tiny_model=False,
            engine_stall_s=0.5,
            adapter_cache_dir=str(tmp_path / "cache"),
        )
    )
    await worker.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}")
    health = health_pb2_grpc.HealthStub(channel)

    async def status_within(want, timeout_s: float) -> bool:
        for _ in range(int(timeout_s / 0.05)):
            if (await health.Check(health_pb2.HealthCheckRequest())).status == want:
                return True
            await asyncio.sleep(0.05)
        return False

    engine, release = worker.servicer.engine, threading.Event()

    def hold_the_loop():  # the engine thread blocks at its next step on the condition it shares
        with engine._wake:
            release.wait(10)

    try:
        assert await status_within(health_pb2.HealthCheckResponse.SERVING, 5)
        holder = threading.Thread(target=hold_the_loop)
        holder.start()
        assert await status_within(health_pb2.HealthCheckResponse.NOT_SERVING, 5)
        release.set()
        holder.join()
        assert await status_within(health_pb2.HealthCheckResponse.SERVING, 5)
        assert not worker.failed.is_set()  # a stall is not a death
    finally:
        release.set()
        await channel.close()
        await worker.stop(0)


async def test_serve_drains_and_returns_the_exit_code_of_a_failed_service():
    from services.common.server import _serve

    made = []

    async def create(settings):
        made.append(build_service("probe", settings, lambda server: []))
        asyncio.get_running_loop().call_later(0.2, made[0].fail, "probe failure")
        return made[0]

    code = await _serve(create, WorkerSettings(port=0))
    assert code == 1 and made[0].stopping and not made[0].serving


def test_freeze_startup_heap_takes_live_objects_out_of_gc_reach():
    import gc

    from services.common.server import freeze_startup_heap

    class Node:
        pass

    a, b = Node(), Node()
    a.peer, b.peer = b, a  # a cycle: tracked by the collector
    try:
        before = gc.get_freeze_count()
        frozen = freeze_startup_heap()
        assert frozen == gc.get_freeze_count() > before
        tracked = {id(o) for o in gc.get_objects()}  # the collector's generations, not the frozen ones
        assert id(a) not in tracked and id(b) not in tracked
        c = Node()
        c.peer = c
        assert id(c) in {id(o) for o in gc.get_objects()}  # made later: collected as usual
    finally:
        gc.unfreeze()  # the rest of the test session as before


async def test_status_reports_how_decode_steps_ran(tmp_path):
    # A worker with static decode steps (what CUDA graphs capture; no capture on CPU): after a
    # generation, GetWorkerStatus counts its static steps, the keys they made and the replays.
    model = ensure_tiny_model(tmp_path / "tiny-qwen2-vl")
    settings = WorkerSettings(
        model_path=str(model),
        port=0,
        build_tiny_model=False,
        decode_graphs="static",
        default_max_new_tokens=6,
        adapter_cache_dir=str(tmp_path / "cache"),
    )
    worker = await create_server(settings)
    await worker.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
            stub = worker_service_pb2_grpc.WorkerServiceStub(channel)
            before = (await stub.GetWorkerStatus(worker_service_pb2.GetWorkerStatusRequest())).decode_graphs
            assert before.static_steps == 0
            _, result = await generate(
                stub,
                request_id="g",
                images=[types_pb2.Image(data=png(3))],
                prompt="Hi",
                params=types_pb2.GenerationParams(max_new_tokens=6),
            )
            assert result.usage.output_tokens == 6
            g = (await stub.GetWorkerStatus(worker_service_pb2.GetWorkerStatusRequest())).decode_graphs
            assert g.static_steps == 5 and g.new_keys >= 1 and g.captures == 0  # 5 decode steps; CPU: no capture
    finally:
        await worker.stop(0)


async def test_the_disk_cache_keeps_its_budget_least_recently_used_out(tmp_path):
    from services.worker.store_client import AdapterFetcher

    model = ensure_tiny_model(tmp_path / "tiny-qwen2-vl")
    bundles = {f"adapters/d{i}/versions/1": random_adapter_bundle(model, rank=4, seed=200 + i) for i in range(5)}
    names, one = list(bundles), len(next(iter(bundles.values())).data)
    store = InMemoryAdapterStore(bundles)
    service = build_service("store", WorkerSettings(port=0), store.register)
    await service.start()
    cache = tmp_path / "cache"
    fetcher = AdapterFetcher(f"127.0.0.1:{service.port}", cache, cache_bytes=int(2.5 * one))
    try:
        for name in names[:2]:
            await fetcher.fetch(name, bundles[name].sha256)
        await asyncio.sleep(0.02)
        await fetcher.fetch(names[0], bundles[names[0]].sha256)  # a cached read: used again

        def kept() -> set[str]:
            return {p.stem for p in cache.glob("*.safetensors")}

        await asyncio.sleep(0.02)
        await fetcher.fetch(names[2], bundles[names[2]].sha256)
        assert kept() == {bundles[n].sha256 for n in (names[0], names[2])}  # names[1] was least recently used
        for name in names[3:]:
            await asyncio.sleep(0.02)
            await fetcher.fetch(name, bundles[name].sha256)
        assert sum(p.stat().st_size for p in cache.glob("*.safetensors")) <= 2.5 * one
        assert kept() == {bundles[n].sha256 for n in names[3:]}, kept()
        assert {p.stem for p in cache.glob("*.json")} == kept()  # metadata goes with its blob
        again = await fetcher.fetch(names[1], bundles[names[1]].sha256)  # evicted: fetched again
        assert again.data == bundles[names[1]].data
    finally:
        await fetcher.close()
        await service.stop(0)
