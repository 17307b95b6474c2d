"""Users' PEFT adapters as PEFT saves them, for each served family, in each key layout transformers
has given the family's language model (adapter_format.KEY_LAYOUTS): transformers 5's, as PEFT
writes it here, and transformers 4's (<4.52: Qwen2-VL's and Qwen2.5-VL's LM under `model.`, LLaVA's
under `language_model.model.`), the same tensors under the names PEFT wrote then. The engine's
greedy tokens equal HF + PEFT's on the same model. The adapters are made by PEFT's suffix matching
of a list of names, so they also hold LoRA weights of the vision tower (LLaVA's CLIP q/k/v_proj and
fc1, Qwen2-VL's qkv and fc1, Qwen2.5-VL's gate/up/down_proj): valora ignores those, as vLLM does,
so an image request's tokens are PEFT's with the language model's LoRA weights alone."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from services.common.adapter_format import LM_PREFIX, TARGET_MODULES, BaseModelShapes, validate_bundle
from services.worker.architectures import by_name
from services.worker.engine import Engine, EngineConfig
from services.worker.model import build_inputs, ensure_tiny_model, load_model, load_processor
from services.worker.requests import WorkRequest
from services.worker.testing import TEST_KV_BYTES, random_image

MAX_NEW = 8
PROMPT = "Describe the image."
# PEFT's suffix matching: the decoder layers' projections and, by the same names, the vision tower's
TARGETS = [*TARGET_MODULES, "qkv", "fc1"]

# transformers 5's prefixes -> transformers 4's, per family (what PEFT wrote under each)
TRANSFORMERS_4 = {
    "qwen2-vl": {
        LM_PREFIX: "base_model.model.model.layers.",
        "base_model.model.model.visual.": "base_model.model.visual.",
    },
    "llava-1.5": {
        LM_PREFIX: "base_model.model.language_model.model.layers.",
        "base_model.model.model.vision_tower.": "base_model.model.vision_tower.vision_model.",
    },
}
TRANSFORMERS_4["qwen2.5-vl"] = TRANSFORMERS_4["qwen2-vl"]


def renamed(tensors: dict, prefixes: dict) -> dict:
    out = {}
    for key, value in tensors.items():
        new = next((key.replace(old, to, 1) for old, to in prefixes.items() if key.startswith(old)), key)
        out[new] = value
    return out


@pytest.fixture(scope="module", params=["qwen2-vl", "qwen2.5-vl", "llava-1.5"])
def family(request, tmp_path_factory):
    """(family name, model dir, {layout: (bundle bytes, config json)}, reference generate)."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from peft.utils import set_peft_model_state_dict

    name = request.param
    path = ensure_tiny_model(tmp_path_factory.mktemp("models") / name, arch=name)
    torch.manual_seed(0)
    peft_model = get_peft_model(
        load_model(path), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    )
    saved = tmp_path_factory.mktemp("peft") / "full"
    peft_model.save_pretrained(saved)
    tensors = load_file(saved / "adapter_model.safetensors")
    vision = [k for k in tensors if not k.startswith(LM_PREFIX)]
    assert vision, "PEFT's suffix matching wrapped no vision module: the test would not cover them"
    config = (saved / "adapter_config.json").read_text()
    layouts = {
        "transformers-5": save_file_bytes(tensors),
        "transformers-4": save_file_bytes(renamed(tensors, TRANSFORMERS_4[name])),
    }

    model = PeftModel.from_pretrained(load_model(path), saved, adapter_name="full").eval()
    # the same adapter without its vision tower's LoRA weights (what valora applies to an image)
    lm_only = {k: v for k, v in tensors.items() if k.startswith(LM_PREFIX)}
    cfg = json.loads(config)
    cfg["target_modules"] = rf"(.*\.)?language_model\.layers\.\d+\.(self_attn|mlp)\.({'|'.join(TARGET_MODULES)})"
    model.add_adapter("lm", LoraConfig(**{k: v for k, v in cfg.items() if k in ("r", "lora_alpha", "target_modules")}))
    load = set_peft_model_state_dict(model, lm_only, adapter_name="lm")
    assert not load.unexpected_keys
    processor = load_processor(path)

    def generate(adapter, images, logits=False):
        """Greedy new tokens (`logits`: the prompt's last logits instead)."""
        inputs = dict(build_inputs(processor, images, PROMPT))
        if name == "llava-1.5":
            inputs.pop("mm_token_type_ids")  # the processor's, asked for by the engine; LLaVA's generate takes none
        run = (
            (lambda: model(**inputs).logits[0, -1])
            if logits
            else (
                lambda: model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)[
                    0, inputs["input_ids"].shape[1] :
                ]
            )
        )
        with torch.no_grad():
            if adapter is None:
                with model.disable_adapter():
                    out = run()
            else:
                model.set_adapter(adapter)
                out = run()
        return out if logits else out.tolist()

    return name, path, {k: (v, config) for k, v in layouts.items()}, generate


def save_file_bytes(tensors: dict) -> bytes:
    from safetensors.torch import save

    return save(tensors)


@pytest.fixture(scope="module")
def engine(family):
    _, path, layouts, _ = family
    eng = Engine(
        EngineConfig(
            model_path=path,
            max_batch_size=4,
            device_slots=2,
            kv_cache_bytes=TEST_KV_BYTES,
            default_max_new_tokens=MAX_NEW,
        )
    )
    eng.start()
    for layout, (data, config) in layouts.items():
        assert eng.load_adapter_bytes(layout, f"{layout:0<64}"[:64], data, config)
    yield eng
    eng.stop()


def test_every_layout_validates_to_the_same_weights_and_ignores_the_vision_towers(family, engine):
    name, path, layouts, _ = family
    shapes = BaseModelShapes.from_config(json.loads((path / "config.json").read_text()))
    assert shapes.family == by_name(name).model_type
    infos = {layout: validate_bundle(data, config, shapes, max_rank=64) for layout, (data, config) in layouts.items()}
    for info in infos.values():
        assert info.target_modules == TARGET_MODULES and info.layers == (0, 1) and info.rank == 4
        assert info.ignored and all(re.match(r"(model\.)?(visual|vision_tower)\.", m) for m in info.ignored)
        assert len(info.keys) == 2 * 7 * 2
    old, new = infos["transformers-4"], infos["transformers-5"]
    assert len(old.ignored) == len(new.ignored)
    assert set(old.keys.values()).isdisjoint(new.keys.values())  # other names, the same weights below
    a, b = (load_file_bytes(layouts[k][0]) for k in ("transformers-4", "transformers-5"))
    for key in new.keys:
        assert torch.equal(a[old.keys[key]], b[new.keys[key]])


def load_file_bytes(data: bytes) -> dict:
    from safetensors.torch import load

    return load(data)


@pytest.mark.parametrize("layout", ["transformers-5", "transformers-4"])
def test_greedy_tokens_equal_hf_peft(family, engine, layout):
    _, _, _, reference = family
    _, text = engine.generate(WorkRequest("t", PROMPT, [], adapter=layout, max_new_tokens=MAX_NEW))
    _, image = engine.generate(WorkRequest("i", PROMPT, [random_image(3)], adapter=layout, max_new_tokens=MAX_NEW))
    assert text.token_ids == reference("full", [])
    assert text.token_ids != reference(None, [])  # the adapter changes the answer
    # an image request: the language model's LoRA weights only, the vision tower's ignored
    assert image.token_ids == reference("lm", [random_image(3)])
    assert image.token_ids != reference(None, [random_image(3)])
    # PEFT applies its vision LoRA weights: they change an image's logits, which valora's do not follow
    full, lm = (reference(a, [random_image(3)], logits=True) for a in ("full", "lm"))
    assert not torch.allclose(full, lm)


def test_an_rslora_adapter_equals_peft(family, engine, tmp_path):
    """use_rslora (scale lora_alpha / sqrt(r), not / r): read from adapter_config.json, as PEFT does."""
    from peft import LoraConfig, PeftModel, get_peft_model

    _, path, _, _ = family
    torch.manual_seed(1)
    peft_model = get_peft_model(
        load_model(path),
        LoraConfig(r=16, lora_alpha=8, use_rslora=True, target_modules=TARGETS, init_lora_weights=False),
    )
    peft_model.save_pretrained(tmp_path)
    data = (tmp_path / "adapter_model.safetensors").read_bytes()
    assert engine.load_adapter_bytes("rslora", "r" * 64, data, (tmp_path / "adapter_config.json").read_text())
    model = PeftModel.from_pretrained(load_model(path), tmp_path).eval()
    inputs = dict(build_inputs(load_processor(path), [], PROMPT))
    inputs.pop("mm_token_type_ids", None)
    with torch.no_grad():
        want = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)[0, inputs["input_ids"].shape[1] :]
    _, got = engine.generate(WorkRequest("r", PROMPT, [], adapter="rslora", max_new_tokens=MAX_NEW))
    assert got.token_ids == want.tolist()
