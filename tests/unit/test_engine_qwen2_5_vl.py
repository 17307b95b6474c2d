"""The worker engine on a tiny Qwen2.5-VL (architectures.py's second family): text, image and
video requests token for token against HF + PEFT generate on the same weights, unmerged and
merged; HF's own vision tower (window attention) runs for it; the rope index takes each video's
seconds per temporal patch in a batch; the gRPC worker serves it from VALORA_MODEL_PATH."""

from __future__ import annotations


import pytest
import torch

from services.common.modes import Mode
from services.worker.engine import Engine, EngineConfig
from services.worker.model import build_inputs, ensure_tiny_model, load_model, load_processor
from services.worker.processor import decode_image
from services.worker.requests import WorkRequest
from services.worker.sequence import Sequence
from services.worker.testing import (
    TEST_KV_BYTES,
    random_adapter_bundle,
    random_image,
    write_peft_dir,
)
from services.worker.vision_tower import HFVisionTower

from tests.unit.test_engine import run_concurrently

A, B = "adapters/alpha/versions/1", "adapters/beta/versions/1"
MAX_NEW = 8
PROMPT = "Describe the image."


@pytest.fixture(scope="module")
def qwen25_path(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2.5-vl", arch="qwen2.5-vl")


@pytest.fixture(scope="module")
def bundles(qwen25_path):
    return {
        A: random_adapter_bundle(qwen25_path, rank=4, lora_alpha=8, seed=1),
        B: random_adapter_bundle(qwen25_path, rank=8, lora_alpha=4, seed=2),
    }


@pytest.fixture(scope="module")
def engine(qwen25_path, bundles):
    eng = Engine(
        EngineConfig(
            model_path=qwen25_path,
            max_batch_size=8,
            device_slots=2,
            kv_cache_bytes=TEST_KV_BYTES,
            default_max_new_tokens=MAX_NEW,
        )
    )
    eng.start()
    for name, b in bundles.items():
        assert eng.load_adapter_bytes(name, b.sha256, b.data, b.config_json)
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def reference(qwen25_path, bundles, tmp_path_factory):
    """Greedy tokens of HF generate on the same files, PEFT applying the request's adapter (None: base)."""
    from peft import PeftModel

    peft_dir = tmp_path_factory.mktemp("peft")
    model = PeftModel.from_pretrained(
        load_model(qwen25_path), write_peft_dir(bundles[A], peft_dir / "a"), adapter_name=A
    ).eval()
    model.load_adapter(write_peft_dir(bundles[B], peft_dir / "b"), adapter_name=B)
    # PEFT matches a list of target names by suffix; write_peft_dir's regex keeps the vision MLP's
    # gate/up/down_proj out (zero LoRA terms valora's adapters do not have)
    assert all(".language_model.layers." in n for n, m in model.named_modules() if hasattr(m, "lora_A"))
    processor = load_processor(qwen25_path)

    def generate(adapter, images, prompt=PROMPT, videos=None, inputs=None):
        inputs = inputs if inputs is not None else build_inputs(processor, images, prompt, videos)
        with torch.no_grad():
            if adapter is None:
                with model.disable_adapter():
                    out = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
            else:
                model.set_adapter(adapter)
                out = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
        return out[0, inputs["input_ids"].shape[1] :].tolist()

    return generate


# 56 px: one window of the tower; 112 px: four; 84 px: windows of three sizes (padded window index).
CASES = {
    "text-base": (None, []),
    "text-a": (A, []),
    "img-base": (None, [56]),
    "img-a": (A, [112]),
    "img-b": (B, [84]),
    "two-a": (A, [56, 84]),
}


def requests():
    return [
        WorkRequest(
            name, PROMPT, [random_image(i, size) for i, size in enumerate(sizes)], adapter=ad, max_new_tokens=MAX_NEW
        )
        for name, (ad, sizes) in CASES.items()
    ]


def test_text_and_image_requests_match_hf_peft_unmerged_and_merged(engine, reference):
    assert isinstance(engine.vision.tower, HFVisionTower)  # not valora's Qwen2-VL tower math
    calls = engine.vision.tower.eager
    want = {
        name: reference(ad, [random_image(i, size) for i, size in enumerate(sizes)])
        for name, (ad, sizes) in CASES.items()
    }
    unmerged = run_concurrently(engine, requests())
    assert engine.vision.tower.eager > calls
    try:
        engine.set_mode(Mode.MERGED, A)
        merged = run_concurrently(engine, requests())
    finally:
        engine.set_mode(Mode.UNMERGED)
    for name, (ad, _) in CASES.items():
        assert unmerged[name][1].token_ids == want[name], name
        assert merged[name][1].token_ids == want[name], name
        assert merged[name][1].mode == (Mode.MERGED if ad == A else Mode.MIXTURE)
    assert want["img-a"] != reference(None, [random_image(1, 112)])  # the adapter changes the answer
    assert unmerged["img-a"][1].image_tokens == 16 and unmerged["two-a"][1].image_tokens == 4 + 9


def test_video_requests_match_hf_generate(engine, reference, qwen25_path):
    processor = load_processor(qwen25_path)
    frames = [random_image(40), random_image(41), random_image(42, 84)]  # 2 temporal patches
    inputs = build_inputs(processor, [random_image(43)], "What happens?", [frames])
    assert inputs["second_per_grid_ts"].tolist() == [1.0]  # 2 frames a patch at 2 frames a second
    _, got = engine.generate(
        WorkRequest("v", "What happens?", [random_image(43)], videos=[frames], adapter=A, max_new_tokens=MAX_NEW)
    )
    assert got.token_ids == reference(A, None, inputs=inputs)


def test_rope_index_takes_each_videos_seconds_per_patch_in_a_batch(engine, qwen25_path):
    """Two video rows prefilled together, their patches 1 s and 2 s apart (temporal positions 2
    and 4 apart, tokens_per_second 2): each row gets the positions and delta HF's get_rope_index
    gives it alone."""
    frames = [random_image(50), random_image(51), random_image(52)]
    rows = []
    for i, seconds in enumerate((1.0, 2.0)):
        prep = engine.prepare(WorkRequest(f"r{i}", "Again?" * (i + 1), [random_image(53)], videos=[frames]))
        prep.inputs["second_per_grid_ts"] = torch.tensor([seconds])
        rows.append(Sequence(id=100 + i, prep=prep, sink=None, handle=None))
    _, positions, deltas = engine.runner._inputs(rows)
    model, spacing = engine.model.model, []
    for s, pos, delta in zip(rows, positions, deltas):
        inp = s.prep.inputs
        want, want_delta = model.get_rope_index(
            inp["input_ids"],
            inp["mm_token_type_ids"],
            inp["image_grid_thw"],
            inp["video_grid_thw"],
            inp["second_per_grid_ts"],
        )
        assert torch.equal(pos, want[:, 0]) and delta == int(want_delta)
        temporal = pos[0, inp["mm_token_type_ids"][0] == 2].unique()  # the video tokens' time positions
        spacing.append((temporal[1:] - temporal[:-1]).tolist())
    assert spacing == [[2], [4]]


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
async def test_the_worker_serves_it_from_valora_model_path(engine, qwen25_path, bundles, tmp_path, monkeypatch):
    from valora_protos.v1 import types_pb2

    from tests.unit.test_worker_server import png, served_image_request

    arch, res, status = await served_image_request(qwen25_path, A, bundles[A], PROMPT, MAX_NEW, tmp_path, monkeypatch)
    assert arch == "qwen2.5-vl"
    assert res.usage.image_tokens == 4 and res.mode == types_pb2.INFERENCE_MODE_UNMERGED and status.healthy
    # the engine in-process gives the served worker's answer
    _, direct = engine.generate(WorkRequest("d", PROMPT, [decode_image(png(7))], adapter=A, max_new_tokens=MAX_NEW))
    assert res.text == direct.text and res.usage.output_tokens == direct.output_tokens > 0
