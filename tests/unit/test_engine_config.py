"""EngineConfig refuses, by field name, what no engine can be built with."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.worker.config import EngineConfig


@pytest.mark.parametrize(
    "field, value",
    [
        ("dtype", "float64"),
        ("decode_graphs", "always"),
        ("switch_strategy", "fast"),
        ("kv_block_size", 24),
        ("kv_block_size", 512),
        ("gpu_memory_fraction", 0.0),
        ("lora_fold_rows", -1),
        ("max_prefill_tokens", 0),
    ],
)
def test_engine_config_refuses_what_no_engine_can_be_built_with(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(Path("unused"), **{field: value})
    EngineConfig(Path("unused"))  # the defaults are valid
