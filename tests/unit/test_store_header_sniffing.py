import struct

import numpy as np
import pytest
from safetensors.numpy import save

from services.adapter_store.validation import _reject_non_safetensors
from services.common.errors import InvalidAdapter


def _safetensors_with_header_low_byte(low: int) -> bytes:
    for pad in range(512):
        data = save({"t": np.zeros(2, np.float32)}, metadata={"pad": "x" * pad})
        if struct.unpack("<Q", data[:8])[0] & 0xFF == low:
            return data
    raise AssertionError("no padding gives that header length")


def test_header_length_starting_with_pickle_proto_byte_is_still_safetensors():
    data = _safetensors_with_header_low_byte(0x80)
    assert data[:1] == b"\x80"
    _reject_non_safetensors(data)  # must not raise


@pytest.mark.parametrize("blob", [b"\x80\x04\x95" + b"\0" * 20, b"PK\x03\x04" + b"\0" * 20, b"hello world!"])
def test_pickles_zips_and_junk_are_rejected(blob):
    with pytest.raises(InvalidAdapter):
        _reject_non_safetensors(blob)
