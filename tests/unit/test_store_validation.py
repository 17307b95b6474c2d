"""Upload validation: safetensors only (pickles never unpickled), limits, shapes, heads, sha256."""

from __future__ import annotations

import hashlib
import pickle

import pytest

from services.adapter_store.domain import Head, PageRequest, page_token
from services.adapter_store.testing import TINY_CONFIG, adapter_config, make_bundle, write_tiny_model
from services.adapter_store.validation import BundleChecker, UploadRequest
from services.common.errors import FailedPrecondition, InvalidAdapter, InvalidArgument


class _Bomb:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture
def checker(tmp_path):
    from services.adapter_store.config import StoreSettings

    settings = StoreSettings(
        model_path=str(write_tiny_model(tmp_path / "tiny")),
        max_rank=16,
        max_header_bytes=4096,
        max_bundle_bytes=64 * 1024,
    )
    return BundleChecker.from_settings(settings)


def req(**kw):
    base = dict(adapter_id="a", adapter_config_json=adapter_config(), sha256="", request_id=None, heads=())
    return UploadRequest(**{**base, **kw})


def test_valid_bundle(checker):
    data = make_bundle(heads={"cls": 2, "count": 3})
    out = checker.check(req(sha256=hashlib.sha256(data).hexdigest(), heads=(Head("cls", ("y", "n")),)), data)
    assert (out.size, out.info.rank, out.info.lora_alpha) == (len(data), 4, 8.0)
    assert out.heads == (Head("cls", ("y", "n")), Head("count", ("0", "1", "2")))
    assert checker.base_model == "tiny"


@pytest.mark.parametrize(
    "data_fn, reason",
    [
        (lambda m: pickle.dumps(_Bomb(m)), "NOT_SAFETENSORS"),
        (lambda m: b"PK\x03\x04" + b"\0" * 64, "NOT_SAFETENSORS"),
        (lambda m: b"12345678not json", "NOT_SAFETENSORS"),
        (lambda m: b"", "NOT_SAFETENSORS"),
        (lambda m: make_bundle(header_pad=8192), "HEADER_TOO_LARGE"),
        (lambda m: make_bundle()[:-10], "TRUNCATED"),
        (lambda m: make_bundle(rank=32), "RANK_TOO_LARGE"),
        (lambda m: make_bundle(dtype="I64"), "BAD_DTYPE"),
        (lambda m: make_bundle(config=dict(TINY_CONFIG, intermediate_size=96), modules=("gate_proj",)), "BAD_SHAPE"),
        (lambda m: make_bundle(rank=16, modules=("gate_proj", "up_proj", "down_proj")) * 2, "BUNDLE_TOO_LARGE"),
    ],
)
def test_rejections(checker, tmp_path, data_fn, reason):
    marker = tmp_path / "marker"
    with pytest.raises(InvalidAdapter) as info:
        checker.check(req(adapter_config_json="{}"), data_fn(marker))
    assert info.value.reason == reason, info.value.message
    assert not marker.exists()


def test_checksum_and_heads(checker):
    data = make_bundle(heads={"cls": 2})
    for kw, reason in [
        (dict(sha256="f" * 64), "CHECKSUM_MISMATCH"),
        (dict(heads=(Head("other", ("a",)),)), "HEAD_MISSING"),
        (dict(heads=(Head("cls", ("a", "b", "c")),)), "HEAD_LABELS_MISMATCH"),
        (dict(adapter_config_json='{"r": 8}'), "BAD_CONFIG"),
    ]:
        with pytest.raises(InvalidAdapter) as info:
            checker.check(req(**kw), data)
        assert info.value.reason == reason


def test_no_base_model_configured():
    checker = BundleChecker(None, "", 16, 4096, 1 << 20)
    with pytest.raises(FailedPrecondition):
        checker.check(req(), make_bundle())


def test_page_tokens():
    assert PageRequest.parse(0, "") == PageRequest(50, None)
    assert PageRequest.parse(5000, "").size == 1000
    assert PageRequest.parse(2, page_token("abc")).after == "abc"
    assert PageRequest.parse(2, page_token(7)).after == 7
    for bad in ("xyz", page_token("a")[:-3], "e30="):
        with pytest.raises(InvalidArgument):
            PageRequest.parse(2, bad)


def test_the_store_checks_with_the_workers_code_path_in_the_familys_layouts(tmp_path):
    """Registration refuses what the worker would: the same validate_bundle, the family from the
    base model's config.json. LLaVA under transformers 4 (its LM under language_model.model.,
    CLIP's q_proj wrapped too): accepted, CLIP's ignored; a module LLaVA's Llama lacks: refused, named."""
    from services.adapter_store.config import StoreSettings
    from structlog.testing import capture_logs

    from services.adapter_store.testing import safetensors_bytes
    from services.common.adapter_format import LM_PREFIX, BaseModelShapes
    from services.worker.adapter_weights import parse_bundle

    llava = {**TINY_CONFIG, "model_type": "llava"}
    settings = StoreSettings(
        model_path=str(write_tiny_model(tmp_path / "llava", llava)),
        max_rank=16,
        max_header_bytes=4096,
        max_bundle_bytes=64 * 1024,
    )
    checker = BundleChecker.from_settings(settings)
    assert checker.shapes.family == "llava"
    old = "base_model.model.language_model.model.layers."
    tensors = {
        f"{old}{i}.self_attn.q_proj.lora_{w}.weight": ("F32", [4, 64] if w == "A" else [64, 4])
        for i in range(2)
        for w in "AB"
    }
    clip = "base_model.model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj"
    tensors |= {f"{clip}.lora_A.weight": ("F32", [4, 32]), f"{clip}.lora_B.weight": ("F32", [32, 4])}
    data = safetensors_bytes(tensors)
    with capture_logs() as logs:
        out = checker.check(req(), data)
        weights = parse_bundle("v", out.sha256, data, adapter_config(), BaseModelShapes.from_config(llava))
    assert out.info.target_modules == ("q_proj",) and out.info.layers == (0, 1)
    ignored = ["vision_tower.vision_model.encoder.layers.N.self_attn.q_proj"]
    assert out.info.ignored == tuple(ignored)
    warned = [e for e in logs if e["event"] == "adapter_vision_lora_ignored"]
    assert [(e["log_level"], e["adapter"], e["modules"]) for e in warned] == [
        ("warning", "a", ignored),
        ("warning", "v", ignored),
    ]
    assert sorted(weights.a) == [(0, "q_proj"), (1, "q_proj")] and weights.a[(0, "q_proj")].shape == (64, 4)
    fused = safetensors_bytes({f"{LM_PREFIX}0.self_attn.qkv_proj.lora_A.weight": ("F32", [4, 64])})
    with pytest.raises(InvalidAdapter, match=r"\['model.language_model.layers.N.self_attn.qkv_proj'\]") as err:
        checker.check(req(), fused)
    assert err.value.reason == "UNKNOWN_TENSOR" and err.value.code.name == "INVALID_ARGUMENT"
