"""The model a worker serves: loading it (weights + processor) and turning requests into inputs.

Import `build_inputs` from here (the e2e test's reference does); importing this module also
registers the image-only Qwen2-VL processor, so `AutoProcessor.from_pretrained(model_dir)`
loads the tiny model's processor.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, GenerationConfig, Qwen2VLForConditionalGeneration

from services.worker.processor import ImageQwen2VLProcessor, build_inputs, chat_text, load_processor
from services.worker.tiny_model import DEFAULT_TINY_MODEL_PATH, ensure_shape_model, ensure_tiny_model

__all__ = ["DEFAULT_TINY_MODEL_PATH", "LOAD_FORMATS", "ImageQwen2VLProcessor", "build_inputs", "chat_text",
           "ensure_shape_model", "ensure_tiny_model", "load_model", "load_processor"]


LOAD_FORMATS = ("auto", "dummy")


def load_model(path: Path | str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               load_format: str = "auto", seed: int = 0) -> Qwen2VLForConditionalGeneration:
    """The model of a local directory. `load_format="dummy"` ignores any weight files and builds
    the directory's architecture with random weights (fixed seed) directly on `device` — for
    benchmarks and tests at full-size shapes without a checkpoint (as vLLM's dummy format)."""
    path = Path(path).expanduser()
    if load_format == "auto":
        model = Qwen2VLForConditionalGeneration.from_pretrained(str(path), dtype=dtype)
        return model.to(device).eval()
    if load_format != "dummy":
        raise ValueError(f"load_format {load_format!r} is not one of {LOAD_FORMATS}")
    config = AutoConfig.from_pretrained(str(path))
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2VLForConditionalGeneration._from_config(config, dtype=dtype)
    if (path / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(str(path))
    return model.eval()
