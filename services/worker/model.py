"""The model a worker serves: loading it (weights + processor) and turning requests into inputs.

Import `build_inputs` from here (the e2e test's reference does); importing this module also
registers the image-only Qwen2-VL processor, so `AutoProcessor.from_pretrained(model_dir)`
loads the tiny model's processor.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen2VLForConditionalGeneration

from services.worker.processor import ImageQwen2VLProcessor, build_inputs, chat_text, load_processor
from services.worker.tiny_model import DEFAULT_TINY_MODEL_PATH, ensure_tiny_model

__all__ = ["DEFAULT_TINY_MODEL_PATH", "ImageQwen2VLProcessor", "build_inputs", "chat_text", "ensure_tiny_model",
           "load_model", "load_processor"]


def load_model(path: Path | str, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> Qwen2VLForConditionalGeneration:
    model = Qwen2VLForConditionalGeneration.from_pretrained(str(Path(path).expanduser()), dtype=dtype)
    return model.to(device).eval()
