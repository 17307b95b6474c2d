"""LLaVA-1.5 (`LlavaForConditionalGeneration`, architectures.LLAVA_1_5): what differs from the
Qwen2-VL family, kept here — its chat format and processor inputs, its placeholder count, its
vision tower call, and its tiny model.

- **Chat format.** llava-hf's LLaVA-1.5 chat template (`CHAT_TEMPLATE`, saved with the tiny
  model): each turn `ROLE: ` (a system turn without one), its images as `<image>\\n` each, then its
  text and a space; `ASSISTANT:` opens the answer. `chat_text` writes the same text
  (tests/unit/test_engine_llava.py checks it against the template). The tokenizer adds `<s>`.
- **Processor.** HF's LlavaProcessor with a CLIPImageProcessor (resize to the shortest edge,
  center crop to the tower's size, CLIP mean/std): one (3, H, W) image a row of `pixel_values`,
  each `<image>` expanded to (H/patch)·(W/patch) tokens (+ `num_additional_image_tokens`, − 1 for
  the "default" feature selection that drops CLS: 576 at 336 px). It has no grid; vision.py keys
  each image by its pixels. `mm_token_type_ids` (1 at image tokens) is the processor's own output
  too, asked for; HF's generate does not take it.
- **Vision tower.** HF's `get_image_features` (CLIP's second-last layer, CLS dropped, projector),
  eagerly, one call for every image of a prefill: `LlavaVisionTower`.
- **Positions.** Llama's 1-D RoPE: architectures.rope_positions.

Videos are refused (VIDEOS_NOT_SUPPORTED, naming the field): LLaVA-1.5 has no video input.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.common.errors import invalid_field

IMAGE_TOKEN = "<image>"
VISION_TOKENS = (IMAGE_TOKEN,)
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", IMAGE_TOKEN, "<pad>")  # the tiny tokenizer's
IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)  # CLIP's (OPENAI_CLIP_MEAN / STD)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)

# llava-hf's llava-1.5 chat template (its chat_template.json).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{# Render all images first #}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{# Render all text next #}"
    "{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}"
    "{% endfor %}"
    "{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def chat_text(prompt: str, num_images: int, system: str = "", history: Sequence[tuple[str, str, int]] = ()) -> str:
    """The chat template's text: the system turn (none when empty: the template has no default),
    the `history` turns (role, text, how many of the images they show, first), then the user turn
    (the remaining images, then the prompt) and `ASSISTANT:`."""
    parts = [f"{system} "] if system else []
    for role, text, n in history:
        parts.append(f"{role.upper()}: {(IMAGE_TOKEN + chr(10)) * n}{text} ")
    shown = num_images - sum(n for _, _, n in history)
    parts.append(f"USER: {(IMAGE_TOKEN + chr(10)) * shown}{prompt} ASSISTANT:")
    return "".join(parts)


def image_tokens(processor, pixel_values: torch.Tensor) -> int:
    """The `<image>` tokens one image of these pixels (3, H, W) takes: LlavaProcessor's expansion."""
    h, w = pixel_values.shape[-2:]
    n = (h // processor.patch_size) * (w // processor.patch_size) + processor.num_additional_image_tokens
    return n - (processor.vision_feature_select_strategy == "default")


def build_inputs(
    processor,
    images,
    prompt: str,
    videos=None,
    system: str = "",
    history: Sequence[tuple[str, str, int]] = (),
    raw: bool = False,
):
    """processor.build_inputs for LLaVA-1.5 (token-id prompts are handled there): input_ids,
    attention_mask, mm_token_type_ids, with images pixel_values (images, 3, H, W)."""
    if videos:
        raise invalid_field("item.videos", "LLaVA-1.5 takes no videos (images only)", reason="VIDEOS_NOT_SUPPORTED")
    text = prompt if raw else chat_text(prompt, len(images), system, history)
    return processor(images=list(images) or None, text=[text], return_tensors="pt", return_mm_token_type_ids=True)


def placeholder_counts(processor, inputs) -> dict[str, int]:
    """The `<image>` tokens the request's images place (intake's check of the prompt)."""
    pixels = inputs.get("pixel_values")
    n = 0 if pixels is None else pixels.shape[0] * image_tokens(processor, pixels)
    return {IMAGE_TOKEN: n}


class LlavaVisionTower:
    """HF's LLaVA vision tower + projector (`get_image_features` at the config's feature layer and
    selection), eagerly; `encode_items` as vision_tower.VisionTower's: every image of the call in
    one batch, (tokens, hidden) features back per image."""

    def __init__(self, base_model) -> None:
        """`base_model`: the LlavaForConditionalGeneration's `model` (LlavaModel)."""
        self.base = base_model
        self.eager = 0  # calls (observability + tests)

    def encode_items(self, items: list[tuple[torch.Tensor, tuple[int, int, int]]]) -> list[torch.Tensor]:
        pixels = items[0][0] if len(items) == 1 else torch.cat([p for p, _ in items])
        self.eager += 1
        return list(self.base.get_image_features(pixel_values=pixels).pooler_output)


# -- the tiny model (tiny_model.py) -----------------------------------------------------------------


def tiny_config(tokenizer, shape: dict, arch):
    """The family's config of `shape` (architectures entry's `tiny` layout; a SHAPES entry) for
    this tokenizer's ids."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = dict(shape["text"])
    text.setdefault("vocab_size", ((len(tokenizer) + 63) // 64) * 64)
    vision = dict(shape["vision"])
    tokens = (vision["image_size"] // vision["patch_size"]) ** 2
    return arch.hf_config(
        text_config=dict(
            model_type="llama",
            **text,
            rms_norm_eps=1e-5,
            bos_token_id=ids["<s>"],
            eos_token_id=ids["</s>"],
            pad_token_id=ids["<pad>"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        vision_config=dict(model_type="clip_vision_model", hidden_act="quick_gelu", **vision),
        image_token_index=ids[IMAGE_TOKEN],
        image_seq_length=tokens,
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        tie_word_embeddings=False,
    )


def tiny_generation_config(tokenizer):
    from transformers import GenerationConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    return GenerationConfig(
        eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"], bos_token_id=ids["<s>"], do_sample=False
    )


def tiny_processor(tokenizer, image_size: int, patch_size: int):
    """LlavaProcessor with CLIP's image processing at `image_size` (the PIL backend: torchvision
    does not import here; a checkpoint's CLIPImageProcessor loads as it with AutoProcessor)."""
    from transformers import LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": image_size},
        crop_size={"height": image_size, "width": image_size},
        image_mean=list(IMAGE_MEAN),
        image_std=list(IMAGE_STD),
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
    )
