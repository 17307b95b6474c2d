"""Vision inputs of the worker engine on the tiny Qwen2-VL: the image-feature cache (a repeated
image skips the vision tower and answers the same), several images per request and video
chunks checked token for token against HF generate on the same inputs."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from PIL import Image

from services.worker.engine import Engine, EngineConfig
from services.worker.model import build_inputs, ensure_tiny_model, load_model, load_processor
from services.worker.requests import WorkRequest
from services.worker.testing import random_adapter_bundle
from services.worker.vision import FeatureCache

A = "adapters/alpha/versions/1"
MAX_NEW = 8
DEVICE = os.environ.get("VALORA_TEST_DEVICE", "cpu")


def image(seed: int, size: int = 56) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2-vl")


@pytest.fixture(scope="module")
def engine(model_path):
    eng = Engine(EngineConfig(model_path=model_path, device=DEVICE, max_batch_size=4, default_max_new_tokens=MAX_NEW))
    eng.start()
    b = random_adapter_bundle(model_path, rank=4, lora_alpha=8, seed=1)
    eng.load_adapter_bytes(A, b.sha256, b.data, b.config_json)
    yield eng
    eng.stop()


class VisionCalls:
    """Counts vision-tower forwards (and the images/videos in each) through a forward hook."""

    def __init__(self, engine: Engine) -> None:
        self.calls: list[int] = []
        self._h = engine.model.model.visual.register_forward_hook(
            lambda mod, args, kwargs, out: self.calls.append(len(kwargs["grid_thw"])), with_kwargs=True)

    def close(self) -> None:
        self._h.remove()


@pytest.fixture
def vision_calls(engine):
    calls = VisionCalls(engine)
    yield calls
    calls.close()


def test_repeated_image_skips_the_vision_tower(engine, vision_calls):
    engine.vision.cache.clear()
    before = engine.stats().image_cache
    req = lambda rid, img, ad=A: WorkRequest(rid, "Describe the image.", [img], adapter=ad, max_new_tokens=MAX_NEW)
    _, first = engine.generate(req("first", image(11)))
    assert vision_calls.calls == [1]
    # The same pixels in a new PIL object (another client, another turn), for another adapter too.
    _, again = engine.generate(req("again", image(11)))
    _, base = engine.generate(req("base", image(11), None))
    assert vision_calls.calls == [1], "a repeated image ran the vision tower again"
    assert again.token_ids == first.token_ids and again.text == first.text
    assert again.image_tokens == first.image_tokens == 4
    stats = engine.stats().image_cache
    assert stats.hits - before.hits == 2 and stats.misses - before.misses == 1
    assert stats.entries == 1 and 0 < stats.bytes <= stats.max_bytes
    # A cached image and a new one in one request: the tower runs for the new one only.
    engine.generate(WorkRequest("mixed", "Compare them.", [image(11), image(12, 112)], max_new_tokens=2))
    assert vision_calls.calls == [1, 1]
    # The cache-free answer is the same.
    engine.vision.cache.clear()
    _, fresh = engine.generate(req("fresh", image(11), None))
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
