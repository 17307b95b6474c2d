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

    settings = StoreSettings(model_path=str(write_tiny_model(tmp_path / "tiny")), max_rank=16,
                             max_header_bytes=4096, max_bundle_bytes=64 * 1024)
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


@pytest.mark.parametrize("data_fn, reason", [
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
])
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
