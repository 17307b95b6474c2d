import json
import re
import pickle
import struct

import numpy as np
import pytest

from services.common.adapter_format import (
    LM_PREFIX,
    TARGET_MODULES,
    BaseModelShapes,
    lora_key,
    make_random_bundle,
    validate_bundle,
)
from services.common.errors import InvalidAdapter

CONFIG = {
    "text_config": {
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
    }
}
SHAPES = BaseModelShapes.from_config(CONFIG)


def test_random_bundle_validates_with_its_rank_and_heads():
    data, cfg = make_random_bundle(SHAPES, rank=4, seed=1, lora_alpha=8, heads={"digit": 10})
    info = validate_bundle(data, cfg, SHAPES, max_rank=64)
    assert info.rank == 4 and info.lora_alpha == 8.0
    assert info.heads == {"digit": 10}
    assert set(info.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert SHAPES.features["k_proj"] == (32, 16)


@pytest.mark.parametrize(
    "mutate,reason",
    [
        (lambda d: pickle.dumps({"x": 1}), "HEADER_TOO_LARGE"),  # pickle bytes read as a huge header length
        (lambda d: d[:40], "TRUNCATED"),
        (lambda d: struct.pack("<Q", 5) + b"notjs", "NOT_SAFETENSORS"),
        (lambda d: b"", "NOT_SAFETENSORS"),
    ],
)
def test_rejects_non_safetensors(mutate, reason):
    data, cfg = make_random_bundle(SHAPES, rank=4, seed=1)
    with pytest.raises(InvalidAdapter) as err:
        validate_bundle(mutate(data), cfg, SHAPES, max_rank=64)
    assert err.value.reason == reason


def test_rejects_rank_over_limit_and_wrong_shapes():
    data, cfg = make_random_bundle(SHAPES, rank=8, seed=1)
    with pytest.raises(InvalidAdapter) as err:
        validate_bundle(data, cfg, SHAPES, max_rank=4)
    assert err.value.reason == "RANK_TOO_LARGE"
    other = BaseModelShapes.from_config({**CONFIG, "text_config": {**CONFIG["text_config"], "hidden_size": 48}})
    with pytest.raises(InvalidAdapter) as err:
        validate_bundle(data, cfg, other, max_rank=64)
    assert err.value.reason == "BAD_SHAPE"
    with pytest.raises(InvalidAdapter) as err:
        validate_bundle(data, json.dumps({"r": 16}), SHAPES, max_rank=64)
    assert err.value.reason == "BAD_CONFIG"


@pytest.mark.parametrize(
    "rename",
    [lambda n: n + "\n", lambda n: n.replace("layers.0.", "layers.\u0660.")],
    ids=["trailing-newline", "unicode-digit"],
)
def test_tensor_names_are_matched_whole_and_in_ascii(rename):
    # `$` matched before a final newline, and \d took Arabic-Indic digits (int('\u0660') == 0): such
    # bundles were READY in the store and then failed (or loaded empty) on the worker
    data, cfg = make_random_bundle(SHAPES, rank=4, seed=1)
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__" and "layers.0." in k)
    header[rename(name)] = header.pop(name)
    raw = json.dumps(header).encode()
    bad = struct.pack("<Q", len(raw)) + raw + data[8 + n :]
    with pytest.raises(InvalidAdapter) as err:
        validate_bundle(bad, cfg, SHAPES, 64)
    assert err.value.reason == "UNKNOWN_TENSOR"


def _with_body(data: bytes, edit) -> bytes:
    """The bundle with its header JSON edited by `edit(header, body) -> (header, body)`."""
    n = struct.unpack("<Q", data[:8])[0]
    header, body = edit(json.loads(data[8 : 8 + n]), bytearray(data[8 + n :]))
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + bytes(body)


@pytest.mark.parametrize("where", ["lora", "head"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_inf_are_refused(where, value):
    data, cfg = make_random_bundle(SHAPES, rank=4, seed=1, heads={"digit": 10})

    def poison(header, body):
        name = next(k for k in header if k != "__metadata__" and (k.startswith("heads.") == (where == "head")))
        start, end = header[name]["data_offsets"]
        body[start + 4 : start + 8] = struct.pack("<f", value)
        return header, body

    with pytest.raises(InvalidAdapter) as err:
        validate_bundle(_with_body(data, poison), cfg, SHAPES, 64)
    assert err.value.reason == "NOT_FINITE"


@pytest.mark.parametrize("edit", ["trailing", "overlap", "gap"])
def test_tensor_bytes_must_tile_the_body(edit):
    data, cfg = make_random_bundle(SHAPES, rank=4, seed=1)

    def change(header, body):
        names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
        if edit == "trailing":
            body += b"\0" * 8
        elif edit == "overlap":  # the last tensor reads the bytes of the one before
            a, b = header[names[-1]]["data_offsets"]
            header[names[-1]]["data_offsets"] = [a - 4, b - 4]
            del body[-4:]
        else:  # four unused bytes before the last tensor
            a, b = header[names[-1]]["data_offsets"]
            header[names[-1]]["data_offsets"] = [a + 4, b + 4]
            body[a:a] = b"\0" * 4
        return header, body

    with pytest.raises(InvalidAdapter) as err:
        validate_bundle(_with_body(data, change), cfg, SHAPES, 64)
    assert err.value.reason == "NOT_SAFETENSORS"


def _renamed(data: bytes, rename) -> bytes:
    """The bundle with every tensor's name passed through `rename` (None: the tensor dropped)."""

    def edit(header, body):
        return {(rename(k) if k != "__metadata__" else k): v for k, v in header.items()}, body

    return _with_body(data, edit)


FAMILIES = {
    "qwen2_vl": "base_model.model.model.layers.",
    "qwen2_5_vl": "base_model.model.model.layers.",
    "llava": "base_model.model.language_model.model.layers.",
}  # transformers 4's LM, PEFT's prefix


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_family_loads_the_language_model_keys_transformers_4_gave_it(family):
    shapes = BaseModelShapes.from_config({**CONFIG, "model_type": family})
    data, cfg = make_random_bundle(shapes, rank=4, seed=1)
    old = _renamed(data, lambda k: k.replace(LM_PREFIX, FAMILIES[family]))
    new_info, old_info = validate_bundle(data, cfg, shapes, 64), validate_bundle(old, cfg, shapes, 64)
    assert old_info.keys == {k: v.replace(LM_PREFIX, FAMILIES[family]) for k, v in new_info.keys.items()}
    assert (old_info.rank, old_info.layers, old_info.target_modules) == (4, (0, 1), TARGET_MODULES)
    assert old_info.keys[(1, "down_proj", "B")] == f"{FAMILIES[family]}1.mlp.down_proj.lora_B.weight"
    # another family's old layout is not this one's: Qwen2-VL's `model.layers.` is no LLaVA key
    other = next(p for f, p in FAMILIES.items() if p != FAMILIES[family])
    with pytest.raises(InvalidAdapter) as err:
        validate_bundle(_renamed(data, lambda k: k.replace(LM_PREFIX, other)), cfg, shapes, 64)
    assert err.value.reason == "UNKNOWN_TENSOR"


def test_one_weight_under_two_layouts_is_refused():
    shapes = BaseModelShapes.from_config({**CONFIG, "model_type": "qwen2_vl"})
    data, cfg = make_random_bundle(shapes, rank=4, seed=1, target_modules=("q_proj",))
    from safetensors.numpy import load, save

    tensors = load(data)
    one = lora_key(0, "q_proj", "A")
    again = save({**tensors, one.replace(LM_PREFIX, FAMILIES["qwen2_vl"]): tensors[one]})
    with pytest.raises(InvalidAdapter, match="two key layouts"):
        validate_bundle(again, cfg, shapes, 64)


def test_a_config_without_a_family_takes_transformers_5_keys_only():
    data, cfg = make_random_bundle(SHAPES, rank=4, seed=1)
    assert SHAPES.family == "" and validate_bundle(data, cfg, SHAPES, 64).keys
    with pytest.raises(InvalidAdapter):
        validate_bundle(_renamed(data, lambda k: k.replace(LM_PREFIX, FAMILIES["qwen2_vl"])), cfg, SHAPES, 64)


@pytest.mark.parametrize(
    "rename, named",
    [
        (
            lambda k: k.replace("self_attn.q_proj", "self_attn.qkv_proj"),
            "model.language_model.layers.N.self_attn.qkv_proj",
        ),
        (lambda k: k.replace("mlp.up_proj", "self_attn.up_proj"), "model.language_model.layers.N.self_attn.up_proj"),
        (lambda k: k.replace(LM_PREFIX, "base_model.model.transformer.h."), "transformer.h.N.mlp.gate_proj"),
    ],
    ids=["fused-qkv", "wrong-parent", "gpt2-layout"],
)
def test_target_modules_the_family_lacks_are_refused_by_name(rename, named):
    data, cfg = make_random_bundle(SHAPES, rank=4, seed=1)
    extra = _renamed(data, rename)
    with pytest.raises(InvalidAdapter) as err:
        validate_bundle(extra, cfg, SHAPES, 64)
    assert err.value.reason == "UNKNOWN_TENSOR" and err.value.code.name == "INVALID_ARGUMENT"
    assert named in str(err.value) and "do not exist in the language model" in str(err.value)


def test_a_layer_past_the_last_and_doras_magnitudes_are_refused_by_name():
    from safetensors.numpy import load, save

    tensors = load(make_random_bundle(SHAPES, rank=4, seed=1)[0])
    _, cfg = make_random_bundle(SHAPES, rank=4, seed=1)
    past = {k.replace("layers.1.", "layers.7."): v for k, v in tensors.items()}
    with pytest.raises(InvalidAdapter, match="layer 7 does not exist.* has 2 layers"):
        validate_bundle(save(past), cfg, SHAPES, 64)
    dora = {**tensors, f"{LM_PREFIX}0.self_attn.q_proj.lora_magnitude_vector": np.ones(32, np.float32)}
    with pytest.raises(InvalidAdapter, match="DoRA"):
        validate_bundle(save(dora), cfg, SHAPES, 64)


@pytest.mark.parametrize(
    "family, tower",
    [
        ("qwen2_vl", "base_model.model.model.visual.blocks.0.attn.qkv"),
        ("qwen2_vl", "base_model.model.visual.blocks.1.mlp.fc1"),  # transformers 4
        ("qwen2_5_vl", "base_model.model.model.visual.blocks.0.mlp.gate_proj"),
        ("llava", "base_model.model.model.vision_tower.encoder.layers.0.self_attn.q_proj"),
        ("llava", "base_model.model.vision_tower.vision_model.encoder.layers.2.self_attn.v_proj"),  # transformers 4
        ("llava", "base_model.model.multi_modal_projector.linear_1"),
    ],
)
def test_vision_tower_lora_weights_are_ignored_and_named(family, tower):
    from safetensors.numpy import load, save

    shapes = BaseModelShapes.from_config({**CONFIG, "model_type": family})
    data, cfg = make_random_bundle(shapes, rank=4, seed=1)
    vision = {
        f"{tower}.lora_A.weight": np.ones((4, 8), np.float32),
        f"{tower}.lora_B.weight": np.ones((8, 4), np.float32),
    }
    info = validate_bundle(save({**load(data), **vision}), cfg, shapes, 64)
    assert info.ignored == (re.sub(r"\.[0-9]+\.", ".N.", tower.removeprefix("base_model.model.")),)
    assert info.keys == validate_bundle(data, cfg, shapes, 64).keys
    with pytest.raises(InvalidAdapter, match="no LoRA weights of the language model.*vision tower") as err:
        validate_bundle(save(vision), cfg, shapes, 64)
    assert err.value.reason == "EMPTY_ADAPTER"
    # a family without that tower refuses it by name
    other = BaseModelShapes.from_config({**CONFIG, "model_type": "llava" if family != "llava" else "qwen2_vl"})
    with pytest.raises(InvalidAdapter, match="do not exist"):
        validate_bundle(save({**load(data), **vision}), cfg, other, 64)


def test_rslora_scales_by_the_root_of_the_rank_and_dora_and_alpha_patterns_are_refused():
    data, cfg = make_random_bundle(SHAPES, rank=4, seed=1, lora_alpha=8)
    config = json.loads(cfg)
    assert validate_bundle(data, cfg, SHAPES, 64).scale == 2.0
    assert validate_bundle(data, json.dumps({**config, "use_rslora": True}), SHAPES, 64).scale == 4.0
    assert validate_bundle(data, json.dumps({**config, "alpha_pattern": {"q_proj": 8}}), SHAPES, 64).scale == 2.0
    for bad, match in (({"use_dora": True}, "use_dora"), ({"alpha_pattern": {"q_proj": 16}}, "alpha_pattern")):
        with pytest.raises(InvalidAdapter, match=match) as err:
            validate_bundle(data, json.dumps({**config, **bad}), SHAPES, 64)
        assert err.value.reason == "BAD_CONFIG"
