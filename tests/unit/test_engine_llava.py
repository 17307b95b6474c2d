"""The worker engine on a tiny LLaVA-1.5 (architectures.py's third family: CLIP ViT + projector +
Llama with 1-D RoPE): text and image requests token for token against HF + PEFT generate on the
same files, unmerged and merged; its chat format is its chat template's; videos and tensor
parallelism are refused by name; the gRPC worker serves it from VALORA_MODEL_PATH."""

from __future__ import annotations

import json
import os

import pytest
import torch

from services.common.errors import ValoraError
from services.common.modes import Mode
from services.worker.architectures import by_name
from services.worker.config import WorkerSettings, check_tp_size
from services.worker.engine import Engine, EngineConfig
from services.worker.fused_layers import fused_layer_forward
from services.worker.llava import CHAT_TEMPLATE, IMAGE_TOKEN, LlavaVisionTower, chat_text
from services.worker.model import build_inputs, ensure_tiny_model, load_model, load_processor
from services.worker.processor import decode_image
from services.worker.requests import WorkRequest
from services.worker.tensor_parallel import TPGroup
from services.worker.testing import (
    TEST_KV_BYTES,
    random_adapter_bundle,
    random_image,
    write_peft_dir,
)

from tests.unit.test_engine import run_concurrently

DEVICE = os.environ.get("VALORA_TEST_DEVICE", "cpu")  # as test_engine.py's: cuda runs the graphs and kernels
A, B = "adapters/alpha/versions/1", "adapters/beta/versions/1"
MAX_NEW = 8
PROMPT = "Describe the image."
TOKENS = 16  # a tiny LLaVA image: (56 / 14)^2 patches, the CLS token dropped
LABELS = ["red", "green", "blue", "yellow"]


@pytest.fixture(scope="module")
def llava_path(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llava-1.5", arch="llava-1.5")


@pytest.fixture(scope="module")
def bundles(llava_path):
    return {
        A: random_adapter_bundle(llava_path, rank=4, lora_alpha=8, seed=1),
        B: random_adapter_bundle(llava_path, rank=8, lora_alpha=4, seed=2, heads={"color": LABELS}),
    }


@pytest.fixture(scope="module")
def engine(llava_path, bundles):
    eng = Engine(
        EngineConfig(
            model_path=llava_path,
            device=DEVICE,
            max_batch_size=8,
            device_slots=2,
            kv_cache_bytes=TEST_KV_BYTES,
            default_max_new_tokens=MAX_NEW,
        )
    )
    eng.start()
    for name, b in bundles.items():
        assert eng.load_adapter_bytes(name, b.sha256, b.data, b.config_json, b.heads)
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def reference(llava_path, bundles, tmp_path_factory):
    """Greedy tokens of HF generate on the same files, PEFT applying the request's adapter (None: base)."""
    from peft import PeftModel

    peft_dir = tmp_path_factory.mktemp("peft")
    model = PeftModel.from_pretrained(
        load_model(llava_path, DEVICE), write_peft_dir(bundles[A], peft_dir / "a"), adapter_name=A
    ).eval()
    model.load_adapter(write_peft_dir(bundles[B], peft_dir / "b"), adapter_name=B)
    processor = load_processor(llava_path)

    def generate(adapter, images, prompt=PROMPT, system="", history=()):
        inputs = dict(build_inputs(processor, images, prompt, system=system, history=history).to(DEVICE))
        inputs.pop("mm_token_type_ids")  # the processor's, asked for by the engine; LLaVA's generate takes none
        with torch.no_grad():
            if adapter is None:
                with model.disable_adapter():
                    out = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
            else:
                model.set_adapter(adapter)
                out = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
        return out[0, inputs["input_ids"].shape[1] :].tolist()

    generate.model, generate.processor = model, processor
    return generate


# Sizes other than the tower's 56 px are resized and center-cropped by CLIP's processor; rows of
# different lengths (text only, one image, two) are prefilled in one batch.
CASES = {
    "text-base": (None, []),
    "text-a": (A, []),
    "img-base": (None, [56]),
    "img-a": (A, [80]),
    "img-b": (B, [120]),
    "two-a": (A, [56, 90]),
}


def images_of(sizes):
    return [random_image(i, size) for i, size in enumerate(sizes)]


def requests():
    return [
        WorkRequest(name, PROMPT, images_of(sizes), adapter=ad, max_new_tokens=MAX_NEW)
        for name, (ad, sizes) in CASES.items()
    ]


def test_the_peft_reference_wraps_the_language_models_projections_only(reference):
    """PEFT matches a list of target names by suffix: the CLIP tower's q/k/v_proj would be wrapped
    too (zero LoRA terms valora's adapters do not have); write_peft_dir names the decoder layers'."""
    wrapped = [n for n, m in reference.model.named_modules() if hasattr(m, "lora_A")]
    assert len(wrapped) == 2 * 7 and all(".language_model.layers." in n for n in wrapped)


def test_text_and_image_requests_match_hf_peft_unmerged_and_merged(engine, reference):
    assert engine.arch is by_name("llava-1.5")
    assert isinstance(engine.vision.tower, LlavaVisionTower)
    layer = engine.model.model.language_model.layers[0]
    assert layer.forward.__func__ is fused_layer_forward  # valora's fused decoder layer runs Llama's too
    calls = engine.vision.tower.eager
    want = {name: reference(ad, images_of(sizes)) for name, (ad, sizes) in CASES.items()}
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
    assert want["img-a"] != reference(None, images_of([80]))  # the adapter changes the answer
    assert want["img-a"] != reference(A, [random_image(5, 80)])  # and so does the image
    assert unmerged["img-a"][1].image_tokens == TOKENS and unmerged["two-a"][1].image_tokens == 2 * TOKENS


def test_a_conversation_matches_hf_and_the_chat_template(engine, reference, llava_path):
    """System and history turns (an earlier image shown in the first turn) as the template writes
    them, and the engine's answer HF's on that text. A repeated image is a feature-cache hit."""
    processor = load_processor(llava_path)
    history = [("user", "What is this?", 1), ("assistant", "A red car.", 0)]
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A red car."}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]},
    ]
    text = chat_text(PROMPT, 2, "Be brief.", history)
    assert text == processor.apply_chat_template(messages, add_generation_prompt=True)
    assert text == (
        f"Be brief. USER: {IMAGE_TOKEN}\nWhat is this? ASSISTANT: A red car. USER: {IMAGE_TOKEN}\n{PROMPT} ASSISTANT:"
    )
    assert chat_text(PROMPT, 0) == processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}], add_generation_prompt=True
    )
    images = [random_image(7), random_image(8, 70)]
    hits = engine.vision.cache.stats().hits
    for _ in range(2):
        _, got = engine.generate(
            WorkRequest("c", PROMPT, images, adapter=B, system="Be brief.", history=history, max_new_tokens=MAX_NEW)
        )
        assert got.token_ids == reference(B, images, system="Be brief.", history=history)
    assert engine.vision.cache.stats().hits == hits + 2


def test_a_prompt_prefilled_in_chunks_gets_hf_tokens(engine, reference):
    """A context over the step's prefill budget is prefilled in pieces, each at its own 1-D
    positions (the slice of its row's), and gives the tokens HF gives it whole."""
    images = [random_image(11), random_image(12, 64)]
    request = WorkRequest(
        "long", "Describe the picture in detail, every object and colour.", images, adapter=A, max_new_tokens=MAX_NEW
    )
    n = engine.prepare(request).prompt_tokens
    batches, run, budget = [], engine.prefiller.run, engine.config.max_prefill_tokens
    engine.prefiller.run = lambda seqs: (batches.append([s.req.request_id for s in seqs]), run(seqs))[1]
    engine.config.max_prefill_tokens = 16
    try:
        _, got = engine.generate(request)
    finally:
        engine.config.max_prefill_tokens = budget
        del engine.prefiller.run
    assert batches == [["long"]] * -(-n // 16) and n > 3 * 16
    assert got.token_ids == reference(A, images, prompt=request.prompt)


def test_a_label_request_takes_the_heads_argmax_of_hf_peft(engine, reference, bundles):
    from services.worker.adapter_weights import parse_bundle
    from services.worker.requests import FinishReason, OutputKind

    img = random_image(9)
    _, r = engine.generate(
        WorkRequest("lbl", "What color is it?", [img], adapter=B, output_kind=OutputKind.LABEL, head="color")
    )
    inputs = dict(build_inputs(reference.processor, [img], "What color is it?").to(DEVICE))
    inputs.pop("mm_token_type_ids")
    reference.model.set_adapter(B)
    with torch.no_grad():
        hidden = reference.model.base_model.model.model(**inputs).last_hidden_state[0, -1].cpu()
    w = parse_bundle(B, "", bundles[B].data, bundles[B].config_json, engine.shapes).heads["color"]
    probs = torch.softmax(hidden @ w[0].t() + w[1], dim=-1)
    assert r.finish_reason == FinishReason.LABEL and r.label == LABELS[int(probs.argmax())]
    assert dict(r.scores)[r.label] == pytest.approx(float(probs.max()), abs=1e-4)


def write_llava_hf_layout(tiny, directory):
    """The tiny model in llava-hf/llava-1.5-7b-hf's files: transformers 4's weight names
    (language_model.model.*, language_model.lm_head, vision_tower.vision_model.*,
    multi_modal_projector.*) in two shards with model.safetensors.index.json, the image processor in
    preprocessor_config.json, the processor's own fields in processor_config.json, the template in
    chat_template.json, and the tokenizer, config and generation config files."""
    import re
    import shutil

    from safetensors.torch import save_file

    def v4(key: str) -> str:
        if key == "lm_head.weight":
            return "language_model.lm_head.weight"
        key = re.sub(r"^model\.language_model\.", "language_model.model.", key)
        key = re.sub(r"^model\.vision_tower\.", "vision_tower.vision_model.", key)
        return re.sub(r"^model\.multi_modal_projector\.", "multi_modal_projector.", key)

    directory.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, directory / name)
    processor = load_processor(tiny)
    image = {**processor.image_processor.to_dict(), "image_processor_type": "CLIPImageProcessor"}
    (directory / "preprocessor_config.json").write_text(json.dumps(image))
    (directory / "processor_config.json").write_text(
        json.dumps(
            {
                "image_token": IMAGE_TOKEN,
                "num_additional_image_tokens": 1,
                "patch_size": 14,
                "processor_class": "LlavaProcessor",
                "vision_feature_select_strategy": "default",
            }
        )
    )
    (directory / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    weights = [(v4(k), v.contiguous()) for k, v in load_model(tiny).state_dict().items()]
    index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for _, v in weights)}, "weight_map": {}}
    for i, part in enumerate((weights[: len(weights) // 2], weights[len(weights) // 2 :])):
        shard = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file(dict(part), str(directory / shard), metadata={"format": "pt"})
        index["weight_map"].update({k: shard for k, _ in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


def test_a_checkpoint_in_llava_hfs_layout_serves_the_same_tokens(engine, llava_path, tmp_path):
    """A directory as llava-hf's LLaVA-1.5 checkpoints are (sharded, transformers 4's names,
    legacy processor files) loads as the same model and processor: the same answers."""
    path = write_llava_hf_layout(llava_path, tmp_path / "llava-hf")
    names = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert not (path / "model.safetensors").exists() and len(set(names.values())) == 2
    assert {n.split(".")[0] for n in names} == {"language_model", "vision_tower", "multi_modal_projector"}
    processor = load_processor(path)
    assert processor.chat_template == CHAT_TEMPLATE and processor.patch_size == 14
    other = Engine(
        EngineConfig(
            model_path=path,
            device=DEVICE,
            max_batch_size=8,
            device_slots=2,
            kv_cache_bytes=TEST_KV_BYTES,
            default_max_new_tokens=MAX_NEW,
        )
    )
    other.start()
    try:
        for name, b in {A: random_adapter_bundle(path, rank=4, lora_alpha=8, seed=1)}.items():
            assert other.load_adapter_bytes(name, b.sha256, b.data, b.config_json)
        for request in requests()[:4]:
            assert other.generate(request)[1].token_ids == engine.generate(request)[1].token_ids, request.request_id
    finally:
        other.stop()


def test_videos_typed_image_tokens_and_tensor_parallelism_are_refused(engine, llava_path):
    with pytest.raises(ValoraError) as err:
        engine.prepare(WorkRequest("v", PROMPT, [], videos=[[random_image(1), random_image(2)]]))
    assert err.value.reason == "VIDEOS_NOT_SUPPORTED" and err.value.field_violations[0].field == "item.videos"
    with pytest.raises(ValoraError) as err:  # LLaVA's placeholder typed as text (not Qwen's)
        engine.prepare(WorkRequest("t", f"a {IMAGE_TOKEN} b", [random_image(3)]))
    assert err.value.reason == "VISION_TOKEN_IN_PROMPT" and IMAGE_TOKEN in str(err.value)
    with pytest.raises(ValoraError) as err:  # an image token id without pixels
        engine.prepare(
            WorkRequest("i", "", [], raw_prompt=True, prompt_token_ids=[5, engine.model.config.image_token_id])
        )
    assert err.value.reason == "VISION_TOKEN_IN_PROMPT"
    with pytest.raises(ValueError, match=r"tensor parallelism \(2 ranks\) is not supported for llava-1.5"):
        check_tp_size(WorkerSettings(tp_size=2), llava_path)  # the worker's start-up check
    with pytest.raises(ValueError, match=r"not supported for llava-1.5 \(LlavaForConditionalGeneration\)"):
        Engine(EngineConfig(model_path=llava_path, kv_cache_bytes=TEST_KV_BYTES, tp=TPGroup(rank=0, world_size=2)))


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
async def test_the_worker_serves_it_from_valora_model_path(engine, llava_path, bundles, tmp_path, monkeypatch):
    from valora_protos.v1 import types_pb2

    from tests.unit.test_worker_server import png, served_image_request

    arch, res, status = await served_image_request(llava_path, A, bundles[A], PROMPT, MAX_NEW, tmp_path, monkeypatch)
    assert arch == "llava-1.5"
    assert res.usage.image_tokens == TOKENS and res.mode == types_pb2.INFERENCE_MODE_UNMERGED and status.healthy
    # the engine in-process gives the served worker's answer
    _, direct = engine.generate(WorkRequest("d", PROMPT, [decode_image(png(7))], adapter=A, max_new_tokens=MAX_NEW))
    assert res.text == direct.text and res.usage.output_tokens == direct.output_tokens > 0
