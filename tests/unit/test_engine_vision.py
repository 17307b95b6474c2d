"""Vision inputs of the worker engine on the tiny Qwen2-VL: the image-feature cache (a repeated
image skips the vision tower and answers the same), several images per request and video
chunks checked token for token against HF generate on the same inputs."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from services.worker.engine import Engine, EngineConfig
from services.worker.model import build_inputs, load_model, load_processor
from services.worker.requests import WorkRequest
from services.worker.testing import TEST_KV_BYTES, random_adapter_bundle, random_image
from services.worker.vision import FeatureCache

A = "adapters/alpha/versions/1"
MAX_NEW = 8
DEVICE = os.environ.get("VALORA_TEST_DEVICE", "cpu")


@pytest.fixture(scope="module")
def engine(model_path):
    eng = Engine(
        EngineConfig(
            model_path=model_path,
            device=DEVICE,
            max_batch_size=4,
            default_max_new_tokens=MAX_NEW,
            kv_cache_bytes=TEST_KV_BYTES,
        )
    )
    eng.start()
    b = random_adapter_bundle(model_path, rank=4, lora_alpha=8, seed=1)
    eng.load_adapter_bytes(A, b.sha256, b.data, b.config_json)
    yield eng
    eng.stop()


class VisionCalls:
    """Counts the vision encoder's tower passes (and the images/videos in each)."""

    def __init__(self, engine: Engine) -> None:
        self.calls: list[int] = []
        self._vision = engine.vision
        encode = type(self._vision)._encode

        def counted(kind, todo):
            self.calls.append(len(todo))
            return encode(self._vision, kind, todo)

        self._vision._encode = counted

    def close(self) -> None:
        del self._vision._encode


@pytest.fixture
def vision_calls(engine):
    calls = VisionCalls(engine)
    yield calls
    calls.close()


def test_repeated_image_skips_the_vision_tower(engine, vision_calls):
    engine.vision.cache.clear()
    before = engine.stats().image_cache
    req = lambda rid, img, ad=A: WorkRequest(rid, "Describe the image.", [img], adapter=ad, max_new_tokens=MAX_NEW)
    _, first = engine.generate(req("first", random_image(11)))
    assert vision_calls.calls == [1]
    # The same pixels in a new PIL object (another client, another turn), for another adapter too.
    _, again = engine.generate(req("again", random_image(11)))
    _, base = engine.generate(req("base", random_image(11), None))
    assert vision_calls.calls == [1], "a repeated image ran the vision tower again"
    assert again.token_ids == first.token_ids and again.text == first.text
    assert again.image_tokens == first.image_tokens == 4
    stats = engine.stats().image_cache
    assert stats.hits - before.hits == 2 and stats.misses - before.misses == 1
    assert stats.entries == 1 and 0 < stats.bytes <= stats.max_bytes
    # A cached image and a new one in one request: the tower runs for the new one only.
    engine.generate(WorkRequest("mixed", "Compare them.", [random_image(11), random_image(12, 112)], max_new_tokens=2))
    assert vision_calls.calls == [1, 1]
    # The cache-free answer is the same.
    engine.vision.cache.clear()
    _, fresh = engine.generate(req("fresh", random_image(11), None))
    assert fresh.token_ids == base.token_ids


def test_feature_cache_is_lru_and_bounded_by_bytes():
    t = lambda n: torch.zeros(n, 4)  # n * 16 bytes
    cache = FeatureCache(max_bytes=100)
    cache.put("a", t(2))
    cache.put("b", t(2))
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("c", t(3))  # 32 + 32 + 48 > 100: evicts b (least recent)
    assert "b" not in cache and "a" in cache and "c" in cache
    cache.put("huge", t(7))  # 112 bytes > max: never kept, nothing evicted for it
    assert "huge" not in cache and "a" in cache
    s = cache.stats()
    assert (s.hits, s.evictions, s.entries, s.bytes) == (1, 1, 2, 80)
    off = FeatureCache(max_bytes=0)
    off.put("a", t(1))
    assert off.get("a") is None and off.stats().entries == 0


def hf_generate(model_path, inputs, max_new=MAX_NEW) -> list[int]:
    """Greedy tokens of HF generate on a fresh model over the same processor outputs (base model)."""
    model = load_model(model_path, DEVICE)
    inputs = {k: v.to(DEVICE) for k, v in inputs.items()}
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def test_several_images_and_videos_match_hf_generate(engine, model_path, vision_calls):
    engine.vision.cache.clear()
    processor = load_processor(model_path)
    prompt = "What changed between them?"
    cases = {
        "two-images": ([random_image(21), random_image(22, 112)], []),
        # 3 frames: 2 temporal patches (the last frame repeated), plus a one-frame video and an image.
        "video": ([random_image(23)], [[random_image(24), random_image(25), random_image(26)], [random_image(27, 84)]]),
    }
    for name, (imgs, vids) in cases.items():
        _, r = engine.generate(WorkRequest(name, prompt, imgs, videos=vids, max_new_tokens=MAX_NEW))
        inputs = build_inputs(processor, imgs, prompt, vids)
        assert r.token_ids == hf_generate(model_path, inputs), name
        vision = int((inputs["mm_token_type_ids"] > 0).sum())
        assert r.image_tokens == vision and r.prompt_tokens == inputs["input_ids"].shape[1]
    # One tower call per kind per request (all misses).
    assert vision_calls.calls == [2, 1, 2]
    assert (
        engine.generate(
            WorkRequest(
                "v2", prompt, [], videos=[[random_image(24), random_image(25), random_image(26)]], max_new_tokens=1
            )
        )[1].output_tokens
        == 1
    )
    assert vision_calls.calls == [2, 1, 2], "a repeated video ran the vision tower again"


def test_vision_tower_gives_hf_towers_features(engine, model_path):
    """VisionTower (one item a pass, graphs on CUDA) against HF's tower forward on the same patches:
    images of two sizes and a 3-frame video (2 temporal patches: two attention segments)."""
    processor = load_processor(model_path)
    inputs = build_inputs(
        processor,
        [random_image(31), random_image(32, 112)],
        "x",
        [[random_image(33), random_image(34), random_image(35)]],
    )
    visual = engine.model.model.visual
    tower = engine.vision.tower
    for pix_key, grid_key in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
        pixels, grids = inputs[pix_key].to(DEVICE), inputs[grid_key]
        with torch.inference_mode():  # as on the engine thread
            want = visual(pixels, grid_thw=grids.to(DEVICE)).pooler_output
            row, got = 0, []
            for g in grids.tolist():
                n = g[0] * g[1] * g[2]
                for _ in range(3):  # eager, then on CUDA captured and replayed: the same features
                    got_one = tower.encode(pixels[row : row + n], tuple(g))
                    assert got_one.shape == (n // 4, want.shape[1])
                got.append(got_one)
                row += n
        torch.testing.assert_close(torch.cat(got), want, rtol=1e-4, atol=1e-5)
    if DEVICE == "cpu":
        assert tower.captures == tower.replays == 0 and tower.eager > 0


def test_items_of_one_grid_are_encoded_together(engine, model_path):
    """encode_items: 5 images of one grid and 2 of another in 4 tower passes (4 + 1 and 2 items;
    the mixed order kept), each item's features those it has alone."""
    processor = load_processor(model_path)
    imgs = [random_image(40 + i, 112 if i in (2, 5) else 84) for i in range(7)]
    inputs = build_inputs(processor, imgs, "x")
    tower = engine.vision.tower
    items, row = [], 0
    with torch.inference_mode():
        pixels = inputs["pixel_values"].to(DEVICE)
        for g in inputs["image_grid_thw"].tolist():
            n = g[0] * g[1] * g[2]
            items.append((pixels[row : row + n], tuple(g)))
            row += n
        alone = [tower.encode(p, g) for p, g in items]
        counts = []
        encode = tower.encode
        tower.encode = lambda p, g, count=1: counts.append((g, count)) or encode(p, g, count)
        try:
            together = tower.encode_items(items)
        finally:
            del tower.encode
    assert sorted(counts) == [((1, 6, 6), 1), ((1, 6, 6), 4), ((1, 8, 8), 2)]
    for a, b in zip(alone, together):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_video_patches_follow_qwen2vl_video_layout(model_path):
    """`video_inputs` against the stock video processor's own patchify (its module needs
    torchvision to import, so the function is taken from its source), on frames that need no resize."""
    import ast
    import inspect
    import math

    import transformers.models.qwen2_vl as qwen2_vl

    from services.worker.processor import video_inputs

    src = (inspect.getfile(qwen2_vl).rsplit("/", 1)[0]) + "/video_processing_qwen2_vl.py"
    tree = ast.parse(open(src).read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Qwen2VLVideoProcessor")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "patchify")
    ns = {"torch": torch}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), src, "exec"), ns)
    processor = load_processor(model_path).image_processor
    frames = [random_image(30 + i, 56) for i in range(5)]  # odd: the last frame is repeated
    got, grid = video_inputs(processor, frames)
    mean = torch.tensor(processor.image_mean).view(1, 3, 1, 1)
    std = torch.tensor(processor.image_std).view(1, 3, 1, 1)
    pixels = torch.stack([torch.from_numpy(np.array(f)).permute(2, 0, 1).float() for f in frames])
    videos = ((pixels * processor.rescale_factor - mean) / std).unsqueeze(0)
    want, t, h, w = ns["patchify"](
        None, videos, processor.patch_size, processor.merge_size, processor.temporal_patch_size
    )
    assert grid == [t, h, w] == [math.ceil(5 / 2), 4, 4]
    torch.testing.assert_close(got, want[0], rtol=0, atol=1e-5)
    try:  # where torchvision imports (the GPU machines), the stock video processor itself
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
    except ImportError:
        Qwen2VLVideoProcessor = None
    if Qwen2VLVideoProcessor is not None:
        stock = Qwen2VLVideoProcessor(
            min_pixels=processor.size["shortest_edge"], max_pixels=processor.size["longest_edge"]
        )
        out = stock(videos=[np.stack([np.array(f) for f in frames])], return_tensors="pt", cap_pixels_per_frame=False)
        assert out["video_grid_thw"].tolist() == [grid]
        torch.testing.assert_close(out["pixel_values_videos"], got, rtol=0, atol=1e-4)
    # Two equal frames are exactly the image.
    same, grid1 = video_inputs(processor, [frames[0], frames[0]])
    assert grid1 == [1, 4, 4] and torch.equal(same, processor(images=[frames[0]], return_tensors="pt")["pixel_values"])


def test_gateway_validates_video_frames_like_images():
    """(And GenerationParams' adapter_release_fraction and adapter_release_rule.)"""
    import asyncio
    import io

    from services.common.errors import InvalidArgument
    from services.gateway.validation import Limits, validate
    from valora_protos.v1 import inference_service_pb2, types_pb2

    buf = io.BytesIO()
    random_image(1).save(buf, "PNG")
    ok = types_pb2.Image(data=buf.getvalue(), mime_type="image/png")
    limits = Limits(
        max_images=4,
        max_image_bytes=1 << 20,
        max_image_pixels=1 << 20,
        max_prompt_chars=100,
        max_new_tokens_limit=16,
        max_stop_sequences=4,
        max_videos=2,
        max_video_frames=3,
    )
    good = inference_service_pb2.InferenceInput(videos=[types_pb2.Video(frames=[ok, ok])])
    asyncio.run(validate(good, "r", limits))
    bad = inference_service_pb2.InferenceInput(
        prompt="hi",
        params=types_pb2.GenerationParams(adapter_release_fraction=float("nan"), adapter_release_rule=7),
        videos=[
            types_pb2.Video(frames=[ok, types_pb2.Image(data=b"nope")]),
            types_pb2.Video(),
            types_pb2.Video(frames=[ok, types_pb2.Image(data=ok.data, mime_type="text/plain")]),
        ],
    )
    with pytest.raises(InvalidArgument) as err:
        asyncio.run(validate(bad, "r", limits))
    fields = {v.field for v in err.value.field_violations}
    assert fields == {
        "input.videos",
        "input.videos[1].frames",
        "input.videos[2].frames[1].mime_type",
        "input.params.adapter_release_fraction",
        "input.params.adapter_release_rule",
    }
    bad = inference_service_pb2.InferenceInput(videos=[types_pb2.Video(frames=[ok, types_pb2.Image(data=b"nope")])])
    with pytest.raises(InvalidArgument) as err:
        asyncio.run(validate(bad, "r", limits))
    assert [v.field for v in err.value.field_violations] == ["input.videos[0].frames[1].data"]


def test_content_keys_of_staged_bf16_pixels(model_path):
    """A CUDA worker stages pixels in bf16 (vision.stage_pixels): their content keys are computed
    like fp32 ones (numpy has no bf16), equal for equal images and different otherwise."""
    from services.worker.vision import vision_items

    processor = load_processor(model_path)

    def keys(*seeds):
        inputs = build_inputs(processor, [random_image(s) for s in seeds], "Describe.")
        inputs["pixel_values"] = inputs["pixel_values"].to(torch.bfloat16)
        return [it.key for it in vision_items(inputs)]

    a, b, a2 = keys(1, 2, 1)
    assert a == a2 and a != b
    assert keys(1)[0] == a
