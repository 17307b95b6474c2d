"""The architecture registry: a model directory's family found from its config.json, and a family
the worker does not serve refused at start-up with its name and the supported ones."""

from __future__ import annotations

import json

import pytest

from services.worker.architectures import ARCHITECTURES, architecture_of, by_name, for_model
from services.worker.config import WorkerSettings
from services.worker.server import create_server

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


@pytest.fixture
def idefics_dir(tmp_path):
    """A directory of an HF checkpoint's config of a family not served (yet)."""
    d = tmp_path / "idefics3"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps({"architectures": ["Idefics3ForConditionalGeneration"], "model_type": "idefics3"})
    )
    return d


async def test_the_worker_refuses_a_model_of_an_unsupported_architecture(idefics_dir, tmp_path):
    worker = await create_server(
        WorkerSettings(
            model_path=str(idefics_dir),
            port=0,
            build_tiny_model=False,
            adapter_cache_dir=str(tmp_path / "cache"),
            drain_delay_s=0,
        )
    )
    try:
        with pytest.raises(ValueError) as err:
            await worker.start()
        message = str(err.value)
        assert "'Idefics3ForConditionalGeneration' is not supported" in message and str(idefics_dir) in message
        assert all(a.hf_class in message for a in ARCHITECTURES.values())
        assert worker.servicer.engine is None
    finally:
        await worker.stop(0)


def test_families_by_directory_name_and_model(model_path, tmp_path):
    from services.worker.model import load_model

    qwen2_vl = architecture_of(model_path)
    assert qwen2_vl is by_name("qwen2-vl") is by_name("Qwen2VLForConditionalGeneration")
    assert for_model(load_model(model_path)) is qwen2_vl
    # A config without `architectures` (written by hand): its model_type decides.
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
    assert architecture_of(tmp_path) is qwen2_vl
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava"}))
    assert architecture_of(tmp_path) is by_name("llava-1.5") is by_name("LlavaForConditionalGeneration")
    with pytest.raises(ValueError, match="'idefics3' is not supported"):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "idefics3"}))
        architecture_of(tmp_path)


def test_the_qwen2_5_vl_7b_shape_model_is_a_full_size_qwen2_5_vl(tmp_path):
    """`ensure_shape_model(path, "qwen2.5-vl-7b")` (engine_bench --arch): the released model's
    dimensions, built on the meta device as the dummy load format would build them."""
    import torch
    from transformers import AutoConfig

    from services.worker.model import ensure_shape_model

    path = ensure_shape_model(tmp_path / "qwen2.5-vl-7b", "qwen2.5-vl-7b")
    family = architecture_of(path)
    assert family is by_name("qwen2.5-vl")
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = family.hf_model._from_config(config)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(8.29e9, rel=0.01)  # Qwen2.5-VL-7B's
    assert config.vision_config.out_hidden_size == config.text_config.hidden_size == 3584


def test_the_llava_1_5_7b_shape_model_is_a_full_size_llava(tmp_path):
    """`ensure_shape_model(path, "llava-1.5-7b")` (engine_bench --arch): llava-1.5-7b-hf's
    dimensions (Vicuna-7B + CLIP ViT-L/14 at 336 px), its processor placing 576 image tokens."""
    import torch
    from transformers import AutoConfig

    from services.worker.model import build_inputs, ensure_shape_model, load_processor
    from services.worker.testing import random_image

    path = ensure_shape_model(tmp_path / "llava-1.5-7b", "llava-1.5-7b")
    family = architecture_of(path)
    assert family is by_name("llava-1.5")
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = family.hf_model._from_config(config)
    assert sum(p.numel() for p in model.parameters()) == 7_063_427_072  # llava-hf/llava-1.5-7b-hf's
    inputs = build_inputs(load_processor(path), [random_image(0, 448)], "Describe.")
    assert inputs["pixel_values"].shape == (1, 3, 336, 336)
    assert int((inputs["input_ids"] == config.image_token_id).sum()) == config.image_seq_length == 576


def test_every_family_names_its_peft_key_layouts():
    """A family added to the registry without its adapters' key layouts would take only
    transformers 5's keys and refuse its vision tower's LoRA weights instead of ignoring them."""
    from services.common.adapter_format import KEY_LAYOUTS, LM_PREFIX

    for arch in ARCHITECTURES.values():
        layout = KEY_LAYOUTS[arch.model_type]
        assert layout.language_model[0] == LM_PREFIX and len(layout.language_model) > 1 and layout.vision, arch.name
