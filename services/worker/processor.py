"""Prompt building for Qwen2-VL: the processor the worker loads and `build_inputs`.

`build_inputs(processor, images, prompt)` is THE way a request becomes model inputs (the e2e
test uses it as its reference). The chat text is Qwen2-VL's template: default system turn, one
user turn with `<|vision_start|><|image_pad|><|vision_end|>` per image followed by the prompt,
then the assistant turn start.

Qwen2-VL's stock processor needs torchvision for its video processor, which does not import on
these machines; we serve images only, so `ImageQwen2VLProcessor` is Qwen2VLProcessor without the
video slot, registered with AutoProcessor so `AutoProcessor.from_pretrained(tiny_model_dir)`
works once this module is imported.
"""

from __future__ import annotations

import io
from pathlib import Path

from PIL import Image
from transformers import AutoProcessor, AutoTokenizer, ProcessorMixin
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor

from services.common.errors import invalid_field

SYSTEM_PROMPT = "You are a helpful assistant."
VISION_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
MAX_IMAGE_PIXELS = 64 * 1024 * 1024


class ImageQwen2VLProcessor(Qwen2VLProcessor):
    """Qwen2VLProcessor for images and text only (no torchvision-backed video processor)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
        self.image_token_id = getattr(tokenizer, "image_token_id", None) or tokenizer.convert_tokens_to_ids(
            self.image_token)
        self.video_token_id = getattr(tokenizer, "video_token_id", None) or tokenizer.convert_tokens_to_ids(
            self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)


class _ImageProcessorMarker:
    """Registry key for ImageQwen2VLProcessor (so it does not replace Qwen2VLConfig's mapping)."""


AutoProcessor.register(_ImageProcessorMarker, ImageQwen2VLProcessor, exist_ok=True)


def load_processor(path: Path | str):
    """The model directory's processor; falls back to an image-only Qwen2-VL processor when the
    saved one cannot load here (e.g. a real Qwen2-VL checkpoint without torchvision)."""
    try:
        return AutoProcessor.from_pretrained(str(path))
    except (ImportError, ValueError, TypeError):
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(path))
        return ImageQwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                     chat_template=getattr(tokenizer, "chat_template", None))


def chat_text(prompt: str, num_images: int) -> str:
    """Qwen2-VL's chat format for one user turn (images first, then the prompt) + assistant start."""
    return (
        f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
        f"<|im_start|>user\n{VISION_PLACEHOLDER * num_images}{prompt}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def build_inputs(processor, images: list[Image.Image], prompt: str):
    """Processor outputs for one request: input_ids, attention_mask, mm_token_type_ids and, with
    images, pixel_values and image_grid_thw (torch tensors, batch of 1)."""
    text = chat_text(prompt, len(images))
    return processor(images=list(images) or None, text=[text], return_tensors="pt")


def decode_image(data: bytes, field_path: str = "images") -> Image.Image:
    """Bytes as the client sent them -> RGB PIL image; INVALID_ARGUMENT if it is not one."""
    if not data:
        raise invalid_field(field_path, "image is empty", reason="BAD_IMAGE")
    try:
        img = Image.open(io.BytesIO(data))
        if img.width * img.height > MAX_IMAGE_PIXELS:
            raise invalid_field(field_path, f"image is {img.width}x{img.height}, over {MAX_IMAGE_PIXELS} pixels",
                                reason="BAD_IMAGE")
        img.load()
        return img.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise invalid_field(field_path, f"not a decodable image: {exc}", reason="BAD_IMAGE") from exc
