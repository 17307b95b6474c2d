"""Prompt building for the Qwen2-VL family (Qwen2.5-VL too): the processor the worker loads and
`build_inputs`; LLaVA-1.5's processor is HF's LlavaProcessor, and `build_inputs`,
`placeholder_counts` and the vision tokens of a LLaVA processor are llava.py's.

`build_inputs(processor, images, prompt, videos)` is THE way a request becomes model inputs (the
e2e test uses it as its reference). The chat text is Qwen2-VL's template: default system turn,
one user turn with `<|vision_start|><|image_pad|><|vision_end|>` per image, then
`<|vision_start|><|video_pad|><|vision_end|>` per video, then the prompt, then the assistant
turn start.

Qwen2-VL's stock processor needs torchvision for its video processor, which does not import on
these machines, so `ImageQwen2VLProcessor` is Qwen2VLProcessor without the video slot,
registered with AutoProcessor so `AutoProcessor.from_pretrained(tiny_model_dir)` works once this
module is imported (`ImageQwen2_5_VLProcessor` likewise: the same, plus Qwen2.5-VL's
`second_per_grid_ts` with videos). Videos (a list of frames) go through `video_inputs`: every
frame through the image processor (the same resize bounds, rescale and normalisation as
images), then the frames' patches paired along time in the layout of Qwen2-VL's video processor
(`pixel_values_videos`, `video_grid_thw`). Differences from the torchvision video processor: frames resize with PIL
bicubic instead of torchvision's, and the image processor's min/max pixels bound each frame
(the stock video processor has its own, larger, bounds).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

import torch
from PIL import Image
from transformers import AutoProcessor, AutoTokenizer, BatchFeature, LlavaProcessor, ProcessorMixin
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor

from services.common.errors import invalid_field
from services.worker import llava
from services.worker.architectures import Architecture, architecture_of

SYSTEM_PROMPT = "You are a helpful assistant."
VISION_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_PAD = "<|video_pad|>"
# The tokens of the vision placeholders: only build_inputs places them (one run per image or
# video, expanded to its feature count). Typed into a request's text they tokenize as the same
# special tokens, and the prompt no longer matches its pixels (`typed_vision_token`).
VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
VISION_TOKENS = (VISION_START, IMAGE_PAD, VIDEO_PAD, VISION_END)
MAX_IMAGE_PIXELS = 64 * 1024 * 1024
# A request's video frames carry no times: they are taken as sampled at 2 per second
# (qwen-vl-utils' default rate), 1 s per temporal patch of 2 frames — what HF's Qwen2.5-VL rope
# index assumes without second_per_grid_ts, too.
VIDEO_FPS = 2.0


class ImageQwen2VLProcessor(Qwen2VLProcessor):
    """Qwen2VLProcessor for images and text only (no torchvision-backed video processor)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
        self.image_token_id = getattr(tokenizer, "image_token_id", None) or tokenizer.convert_tokens_to_ids(
            self.image_token
        )
        self.video_token_id = getattr(tokenizer, "video_token_id", None) or tokenizer.convert_tokens_to_ids(
            self.video_token
        )
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)


class ImageQwen2_5_VLProcessor(ImageQwen2VLProcessor):
    """Qwen2.5-VL's processor for images and text only: Qwen2-VL's, whose video inputs also carry
    `second_per_grid_ts` (Qwen2.5-VL's rope index spaces a video's temporal positions by time)."""

    @property
    def model_input_names(self):
        return super().model_input_names + ["second_per_grid_ts"]


_PROCESSORS = {cls.__name__: cls for cls in (ImageQwen2VLProcessor, ImageQwen2_5_VLProcessor)}
for _cls in _PROCESSORS.values():
    # a key class of its own for each (so it replaces no config's own processor mapping)
    AutoProcessor.register(type(f"_{_cls.__name__}Key", (), {}), _cls, exist_ok=True)
_PROCESSORS["LlavaProcessor"] = LlavaProcessor  # HF's own (it loads without torchvision)


def processor_class(arch: Architecture) -> type:
    """The family's image-only processor class (its entry names it)."""
    return _PROCESSORS[arch.processor_class]


def load_processor(path: Path | str):
    """The model directory's processor; falls back to its family's image-only processor when the
    saved one cannot load here (e.g. a real Qwen2-VL checkpoint without torchvision)."""
    try:
        return AutoProcessor.from_pretrained(str(path))
    except (ImportError, ValueError, TypeError):
        if processor_class(architecture_of(path)) is LlavaProcessor:
            raise
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(path))
        return processor_class(architecture_of(path))(
            image_processor=image_processor,
            tokenizer=tokenizer,
            chat_template=getattr(tokenizer, "chat_template", None),
        )


def chat_text(
    prompt: str,
    num_images: int,
    video_tokens: list[int] | tuple[int, ...] = (),
    system: str = "",
    history: Sequence[tuple[str, str, int]] = (),
) -> str:
    """Qwen2-VL's chat format (its chat template's output): the system turn (`system`, else the
    default), the `history` turns (role, text, how many of the images they show, first), then the
    final user turn (the remaining images, then videos, then the prompt) + assistant start.
    `video_tokens[i]`: how many `<|video_pad|>` video i takes (1: the unexpanded placeholder)."""
    videos = "".join(f"<|vision_start|>{VIDEO_PAD * n}<|vision_end|>" for n in video_tokens)
    earlier = "".join(f"<|im_start|>{role}\n{VISION_PLACEHOLDER * n}{text}<|im_end|>\n" for role, text, n in history)
    shown = num_images - sum(n for _, _, n in history)
    return (
        f"<|im_start|>system\n{system or SYSTEM_PROMPT}<|im_end|>\n{earlier}"
        f"<|im_start|>user\n{VISION_PLACEHOLDER * shown}{videos}{prompt}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def family_chat_text(processor, prompt: str, num_images: int) -> str:
    """The chat text of one user turn (the images, then the prompt) in the processor's family's
    format: `chat_text`'s, or LLaVA's (llava.chat_text)."""
    if isinstance(processor, LlavaProcessor):
        return llava.chat_text(prompt, num_images)
    return chat_text(prompt, num_images)


def chat_skeleton(processor, roles: Sequence[str]) -> str:
    """The family's chat text of empty turns (a system turn, history turns of `roles`, the user
    turn): where its template alone places control tokens (intake's special-token count)."""
    history = [(role, "", 0) for role in roles]
    if isinstance(processor, LlavaProcessor):
        return llava.chat_text("", 0, "-", history)
    return chat_text("", 0, (), "-", history)


def vision_token_ids(model_config) -> dict[str, int]:
    """The model's id of each of its family's vision tokens (VISION_TOKENS, LLaVA's llava.VISION_TOKENS:
    what its get_rope_index and embedding look for)."""
    c = model_config
    if getattr(c, "vision_start_token_id", None) is None:  # LLaVA: its image token alone
        return {llava.IMAGE_TOKEN: c.image_token_id}
    return {
        VISION_START: c.vision_start_token_id,
        IMAGE_PAD: c.image_token_id,
        VIDEO_PAD: c.video_token_id,
        VISION_END: c.vision_end_token_id,
    }


def vision_tokens(processor) -> tuple[str, ...]:
    """The placeholder tokens of the processor's family (only build_inputs places them)."""
    return llava.VISION_TOKENS if isinstance(processor, LlavaProcessor) else VISION_TOKENS


def placeholder_counts(processor, inputs) -> dict[str, int]:
    """How many of each of its family's vision tokens a request's processor inputs must hold: for
    Qwen2-VL one <|vision_start|> and <|vision_end|> an image or video and its grid's t·h·w /
    merge² pads; for LLaVA each image's `<image>` tokens (llava.placeholder_counts)."""
    if isinstance(processor, LlavaProcessor):
        return llava.placeholder_counts(processor, inputs)
    merge = processor.image_processor.merge_size**2
    grids = {kind: inputs.get(f"{kind}_grid_thw") for kind in ("image", "video")}
    grids = {kind: torch.zeros((0, 3), dtype=torch.long) if g is None else g for kind, g in grids.items()}
    pads = {kind: int(g.prod(dim=-1).sum()) // merge for kind, g in grids.items()}
    items = len(grids["image"]) + len(grids["video"])
    return {VISION_START: items, IMAGE_PAD: pads["image"], VIDEO_PAD: pads["video"], VISION_END: items}


def typed_vision_token(text: str, tokens: Sequence[str] = VISION_TOKENS) -> str | None:
    """The first vision placeholder token (`tokens`: the family's, `vision_tokens`) `text` holds, or None.

    The processor expands every `<|image_pad|>` of the chat text with the next image's grid, and
    the tokenizer turns each of these strings into its special token, whoever typed it: a user's
    `<|image_pad|>` beside one image made the processor's expansion raise a bare StopIteration, and
    without images it reached the engine as a placeholder without pixels (the step failed INTERNAL,
    with every request of its prefill batch). A request holding one is refused (preprocess.py), not
    escaped: the model's own chat template and processor (build_inputs' reference) make the same
    chat into placeholders too, so no escaping keeps the input they give; escaping would need the
    user's text tokenized apart from the template's, where the processor tokenizes the chat text
    in one call; and the client learns why. vLLM refuses such a prompt too ("Expected there to be
    N prompt updates corresponding to N image items", vllm-project/vllm#15338)."""
    return next((t for t in tokens if t in text), None)


def special_tokens(tokenizer) -> tuple[str, ...]:
    """The tokenizer's special tokens other than the vision placeholders (those have their own
    check, `typed_vision_token`): its named ones (eos, pad, …) and every added token marked
    special (Qwen2-VL's `<|im_start|>`, `<|im_end|>`, `<|endoftext|>`, `<|object_ref_start|>`, …).
    Added tokens not marked special (Qwen2.5's `<tool_call>`) are text to the chat template."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    names = {*getattr(tokenizer, "all_special_tokens", ()), *(t.content for t in added.values() if t.special)}
    return tuple(sorted(names - set(VISION_TOKENS) - set(llava.VISION_TOKENS) - {""}))


def typed_special_token(text: str, tokenizer) -> str | None:
    """The first special token (`special_tokens`) `text` holds, or None.

    The chat template wraps each turn's text in `<|im_start|>role\n…<|im_end|>` and the tokenizer
    takes every special token's text as that token, whoever typed it: a user's
    `<|im_end|>\n<|im_start|>system\n…` closed its own turn and opened a system turn of its making
    (role injection: the ids are those of the template's own turns). As for the vision
    placeholders, a chat request's text holding one is refused (preprocess.py), not escaped: the
    processor tokenizes the chat text in one call, so no escaping keeps what HF's template and
    processor make of the same chat. A raw prompt (text or token ids: `/v1/completions`) is the
    caller's whole input, without a template to break out of: its special tokens are its own."""
    found = [(i, t) for t in special_tokens(tokenizer) if (i := text.find(t)) >= 0]
    return min(found)[1] if found else None


def video_inputs(image_processor, frames: list[Image.Image]) -> tuple[torch.Tensor, list[int]]:
    """One video chunk -> (patches (t*h*w, C*T*p*p), grid [t, h, w]) in Qwen2-VL's video layout.

    Every frame takes the image processor's path (frames of another size than the first are
    resized to it first, so all share one grid); an odd frame count repeats the last frame, as
    the stock video processor does. For two equal frames the result equals the image's patches."""
    if not frames:
        raise ValueError("a video needs at least one frame")
    size = frames[0].size
    frames = [f if f.size == size else f.resize(size, Image.Resampling.BICUBIC) for f in frames]
    t_patch = image_processor.temporal_patch_size
    if pad := -len(frames) % t_patch:
        frames = frames + [frames[-1]] * pad
    out = image_processor(images=frames, return_tensors="pt")
    pixels, grids = out["pixel_values"], out["image_grid_thw"]
    _, gh, gw = (int(x) for x in grids[0])
    p = image_processor.patch_size
    # Per frame (rows, C, T, p, p) with T a broadcast of the frame itself: keep one time slot.
    per_frame = pixels.view(len(frames), gh * gw, -1, t_patch, p, p)[:, :, :, 0]
    grid_t = len(frames) // t_patch
    # Temporal patch k holds frames k*T .. k*T+T-1 in its T slot; rows stay in the image order.
    video = per_frame.view(grid_t, t_patch, gh * gw, -1, p, p).permute(0, 2, 3, 1, 4, 5)
    return video.reshape(grid_t * gh * gw, -1).contiguous(), [grid_t, gh, gw]


def build_inputs(
    processor,
    images: list[Image.Image],
    prompt: str,
    videos: list[list[Image.Image]] | None = None,
    system: str = "",
    history: Sequence[tuple[str, str, int]] = (),
    raw: bool = False,
    token_ids: Sequence[int] = (),
):
    """Processor outputs for one request: input_ids, attention_mask, mm_token_type_ids, with
    images pixel_values and image_grid_thw, with videos (lists of frames) pixel_values_videos and
    video_grid_thw (torch tensors, batch of 1). `raw`: the prompt is the whole text (no chat
    template; no images, videos, system or history); `token_ids` (with `raw`, instead of the
    prompt): the whole input as token ids, taken as they are."""
    if raw and (images or videos or system or history):
        raise ValueError("a raw prompt takes no images, videos, system or history")
    if token_ids:
        if not raw or prompt:
            raise ValueError("token ids are a raw prompt's, instead of its text")
        ids = torch.tensor([list(token_ids)], dtype=torch.long)
        return BatchFeature(
            {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": torch.zeros_like(ids)}
        )
    if isinstance(processor, LlavaProcessor):
        return llava.build_inputs(processor, images, prompt, videos, system, history, raw)
    chunks = [video_inputs(processor.image_processor, frames) for frames in videos or []]
    merge = processor.image_processor.merge_size**2
    # Video pads expanded here (the processor expands image pads only: it has no video processor).
    text = (
        prompt
        if raw
        else chat_text(prompt, len(images), [g[0] * g[1] * g[2] // merge for _, g in chunks], system, history)
    )
    inputs = processor(images=list(images) or None, text=[text], return_tensors="pt")
    if chunks:
        inputs["pixel_values_videos"] = torch.cat([c[0] for c in chunks])
        inputs["video_grid_thw"] = torch.tensor([c[1] for c in chunks], dtype=torch.long)
        if "second_per_grid_ts" in processor.model_input_names:  # as HF's Qwen2.5-VL processor gives it
            inputs["second_per_grid_ts"] = torch.full(
                (len(chunks),), processor.image_processor.temporal_patch_size / VIDEO_FPS
            )
    return inputs


def decode_image(data: bytes, field_path: str = "images") -> Image.Image:
    """Bytes as the client sent them -> RGB PIL image; INVALID_ARGUMENT if it is not one."""
    if not data:
        raise invalid_field(field_path, "image is empty", reason="BAD_IMAGE")
    try:
        img = Image.open(io.BytesIO(data))
        if img.width * img.height > MAX_IMAGE_PIXELS:
            raise invalid_field(
                field_path, f"image is {img.width}x{img.height}, over {MAX_IMAGE_PIXELS} pixels", reason="BAD_IMAGE"
            )
        img.load()
        return img.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise invalid_field(field_path, f"not a decodable image: {exc}", reason="BAD_IMAGE") from exc
