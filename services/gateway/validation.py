"""Validation of public inference requests: every problem becomes a field violation.

Cheap checks (`check_input`) run first and report every offending field at once; images are
then decoded with PIL off the event loop (`inspect_image`), after their header-declared pixel
count has been checked, so a decompression bomb is refused before it is decoded.
"""

from __future__ import annotations

import asyncio
import io
import math
import re
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from services.common import names
from services.common.config import MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_TOKENS, MAX_TOP_LOGPROBS
from services.common.errors import FieldViolation, InvalidArgument, ValoraError
from valora_protos.v1 import inference_service_pb2, types_pb2

# PIL format -> canonical MIME type of the formats the model side accepts.
FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "BMP": "image/bmp"}
MIME_ALIASES = {"image/jpg": "image/jpeg", "image/x-ms-bmp": "image/bmp"}
REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
MAX_TEMPERATURE = 2.0
MAX_STOP_CHARS = 256


MAX_HISTORY_TURNS = 256  # earlier turns of one conversation (InferenceInput.history)


@dataclass(frozen=True)
class Limits:
    max_images: int
    max_image_bytes: int
    max_image_pixels: int
    max_prompt_chars: int
    max_new_tokens_limit: int
    max_stop_sequences: int
    max_videos: int = 4
    max_video_frames: int = 64  # per video
    max_request_pixels: int = 64 << 20  # all images and frames of one request, from their headers


def _bad(violations: list[FieldViolation]) -> InvalidArgument:
    summary = "; ".join(f"{v.field}: {v.description}" for v in violations)
    return InvalidArgument(f"invalid request: {summary}", reason="INVALID_ARGUMENT", field_violations=violations)


def _all_images(inp: inference_service_pb2.InferenceInput, prefix: str):
    """(field path, Image) of every image and every video frame; frames are checked like images."""
    for i, image in enumerate(inp.images):
        yield f"{prefix}.images[{i}]", image
    for i, video in enumerate(inp.videos):
        for j, frame in enumerate(video.frames):
            yield f"{prefix}.videos[{i}].frames[{j}]", frame


def check_request_id(request_id: str) -> list[FieldViolation]:
    if request_id and not REQUEST_ID_RE.fullmatch(request_id):
        return [FieldViolation("request_id", "must be 1-128 characters of [A-Za-z0-9._:-]")]
    return []


def _name_violation(fn, value: str, field_path: str) -> list[FieldViolation]:
    try:
        fn(value, field_path)
    except ValoraError as exc:
        return exc.field_violations
    return []


def _check_token_prompt(inp: inference_service_pb2.InferenceInput, limits: Limits, prefix: str) -> list[FieldViolation]:
    """A prompt of token ids: a raw prompt's other form (then no text), as long as a text prompt
    may be in characters; the vocabulary's bound is the worker's (the model's)."""
    ids = inp.prompt_token_ids
    if not ids:
        return []
    field = f"{prefix}.prompt_token_ids"
    out = []
    if not inp.raw_prompt:
        out.append(FieldViolation(field, "token ids are a raw prompt: set raw_prompt"))
    if inp.prompt:
        out.append(FieldViolation(field, "a prompt is text or token ids, not both"))
    if len(ids) > limits.max_prompt_chars:
        out.append(FieldViolation(field, f"{len(ids)} tokens; at most {limits.max_prompt_chars}"))
    negative = next((i for i, t in enumerate(ids) if t < 0), None)
    if negative is not None:
        out.append(FieldViolation(f"{field}[{negative}]", f"{ids[negative]} is not a token id (>= 0)"))
    return out


def check_input(
    inp: inference_service_pb2.InferenceInput, limits: Limits, prefix: str = "input"
) -> list[FieldViolation]:
    """Every violation that needs no decoding and no registry lookup."""
    out: list[FieldViolation] = []
    if not inp.prompt and not inp.prompt_token_ids and not inp.images and not inp.videos:
        out.append(FieldViolation(prefix, "a prompt, an image or a video is required"))
    chars = len(inp.prompt) + len(inp.system) + sum(len(t.text) for t in inp.history)
    if chars > limits.max_prompt_chars:
        out.append(
            FieldViolation(
                f"{prefix}.prompt",
                f"{chars} characters with the system prompt and history; at most {limits.max_prompt_chars}",
            )
        )
    out += _check_token_prompt(inp, limits, prefix)
    if len(inp.history) > MAX_HISTORY_TURNS:
        out.append(FieldViolation(f"{prefix}.history", f"{len(inp.history)} turns; at most {MAX_HISTORY_TURNS}"))
    for i, turn in enumerate(inp.history):
        if turn.role not in ("user", "assistant"):
            out.append(FieldViolation(f"{prefix}.history[{i}].role", f"{turn.role!r} is not 'user' or 'assistant'"))
        if turn.images < 0 or (turn.images and turn.role != "user"):
            out.append(FieldViolation(f"{prefix}.history[{i}].images", "only user turns show images (>= 0)"))
    if inp.raw_prompt and (inp.images or inp.videos or inp.system or inp.history):
        out.append(FieldViolation(f"{prefix}.raw_prompt", "a raw prompt takes no images, videos, system or history"))
    if sum(max(0, t.images) for t in inp.history) > len(inp.images):
        out.append(FieldViolation(f"{prefix}.history", "its turns claim more images than the request has"))
    if len(inp.images) > limits.max_images:
        out.append(FieldViolation(f"{prefix}.images", f"{len(inp.images)} images; at most {limits.max_images}"))
    if len(inp.videos) > limits.max_videos:
        out.append(FieldViolation(f"{prefix}.videos", f"{len(inp.videos)} videos; at most {limits.max_videos}"))
    for path, image in _all_images(inp, prefix):
        if not image.data:
            out.append(FieldViolation(f"{path}.data", "empty"))
        elif len(image.data) > limits.max_image_bytes:
            out.append(FieldViolation(f"{path}.data", f"{len(image.data)} bytes; at most {limits.max_image_bytes}"))
        mime = MIME_ALIASES.get(image.mime_type.lower(), image.mime_type.lower())
        if mime and mime not in FORMATS.values():
            out.append(
                FieldViolation(f"{path}.mime_type", f"{image.mime_type!r} is not one of {sorted(FORMATS.values())}")
            )
    for i, video in enumerate(inp.videos):
        if not 0 < len(video.frames) <= limits.max_video_frames:
            out.append(
                FieldViolation(
                    f"{prefix}.videos[{i}].frames", f"{len(video.frames)} frames; 1 to {limits.max_video_frames}"
                )
            )

    target = inp.WhichOneof("target")
    if target == "adapter":
        out += _name_violation(names.parse_adapter_ref, inp.adapter, f"{prefix}.adapter")
    elif target == "task":
        out += _name_violation(names.parse_task_name, inp.task, f"{prefix}.task")
    if inp.output_kind not in types_pb2.OutputKind.values():
        out.append(FieldViolation(f"{prefix}.output_kind", f"unknown output kind {inp.output_kind}"))
    elif inp.output_kind == types_pb2.OUTPUT_KIND_LABEL and target != "task":
        out.append(FieldViolation(f"{prefix}.output_kind", "OUTPUT_KIND_LABEL needs input.task (a task with a head)"))

    p = inp.params
    pp = f"{prefix}.params"
    if p.max_new_tokens < 0 or p.max_new_tokens > limits.max_new_tokens_limit:
        out.append(
            FieldViolation(
                f"{pp}.max_new_tokens",
                f"{p.max_new_tokens} not in [0, {limits.max_new_tokens_limit}] (0 = server default)",
            )
        )
    if not math.isfinite(p.temperature) or not 0.0 <= p.temperature <= MAX_TEMPERATURE:
        out.append(FieldViolation(f"{pp}.temperature", f"{p.temperature} not in [0, {MAX_TEMPERATURE}]"))
    if not math.isfinite(p.top_p) or not 0.0 <= p.top_p <= 1.0:
        out.append(FieldViolation(f"{pp}.top_p", f"{p.top_p} not in [0, 1] (0 = 1)"))
    f = p.adapter_release_fraction
    if not math.isfinite(f) or not 0.0 <= f <= 1.0:
        out.append(FieldViolation(f"{pp}.adapter_release_fraction", f"{f} not in [0, 1] (0 = never)"))
    if p.adapter_release_rule not in types_pb2.AdapterReleaseRule.values():
        out.append(
            FieldViolation(
                f"{pp}.adapter_release_rule",
                f"unknown rule {p.adapter_release_rule} (known: {', '.join(types_pb2.AdapterReleaseRule.keys())})",
            )
        )
    if p.top_k < 0:
        out.append(FieldViolation(f"{pp}.top_k", f"{p.top_k} is negative (0 disables top-k)"))
    if not 0 <= p.top_logprobs <= MAX_TOP_LOGPROBS:
        out.append(FieldViolation(f"{pp}.top_logprobs", f"{p.top_logprobs} not in [0, {MAX_TOP_LOGPROBS}]"))
    elif p.top_logprobs and not p.logprobs:
        out.append(FieldViolation(f"{pp}.top_logprobs", "needs logprobs"))
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        if not math.isfinite(value) or not -2.0 <= value <= 2.0:
            out.append(FieldViolation(f"{pp}.{name}", f"{value} not in [-2, 2] (0 = off)"))
    if not math.isfinite(p.repetition_penalty) or not 0.0 <= p.repetition_penalty <= 2.0:
        out.append(FieldViolation(f"{pp}.repetition_penalty", f"{p.repetition_penalty} not in (0, 2] (0 = 1, off)"))
    if not math.isfinite(p.min_p) or not 0.0 <= p.min_p <= 1.0:
        out.append(FieldViolation(f"{pp}.min_p", f"{p.min_p} not in [0, 1] (0 = off)"))
    if len(p.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
        out.append(FieldViolation(f"{pp}.logit_bias", f"{len(p.logit_bias)} entries; at most {MAX_LOGIT_BIAS_TOKENS}"))
    else:  # the vocabulary's bound is the worker's (the model's)
        for token, bias in sorted(p.logit_bias.items()):
            if token < 0:
                out.append(FieldViolation(f"{pp}.logit_bias[{token}]", "a token id is not negative"))
            if not math.isfinite(bias) or abs(bias) > MAX_LOGIT_BIAS:
                out.append(
                    FieldViolation(
                        f"{pp}.logit_bias[{token}]", f"{bias} not in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
                    )
                )
    if len(p.stop) > limits.max_stop_sequences:
        out.append(FieldViolation(f"{pp}.stop", f"{len(p.stop)} stop sequences; at most {limits.max_stop_sequences}"))
    for i, s in enumerate(p.stop):
        if not s or len(s) > MAX_STOP_CHARS:
            out.append(FieldViolation(f"{pp}.stop[{i}]", f"must be 1-{MAX_STOP_CHARS} characters"))
    return out


def inspect_image(data: bytes, max_pixels: int) -> str | None:
    """Why the image is unusable, or None. Reads the header first and refuses more than
    `max_pixels` before any pixel is decoded; then verifies and decodes it (bounded)."""
    try:
        with Image.open(io.BytesIO(data)) as im:  # header only
            fmt = im.format
            width, height = im.size
            if fmt not in FORMATS:
                return f"format {fmt} is not one of {sorted(FORMATS)}"
            if width <= 0 or height <= 0:
                return f"bad size {width}x{height}"
            if width * height > max_pixels:
                return f"{width}x{height} = {width * height} pixels; at most {max_pixels}"
            im.verify()
        with Image.open(io.BytesIO(data)) as im:
            im.load()  # catches truncated data that verify() lets through
    except Image.DecompressionBombError as exc:
        return f"too many pixels: {exc}"
    except UnidentifiedImageError:
        return f"not a recognised image (expected one of {sorted(FORMATS)})"
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        return f"cannot decode image: {type(exc).__name__}: {exc}"
    return None


def header_pixels(data: bytes) -> int:
    """width*height from the image's header (nothing decoded); 0 when it has none."""
    try:
        with Image.open(io.BytesIO(data)) as im:
            width, height = im.size
            return max(0, width) * max(0, height)
    except Exception:  # inspect_image says what is wrong with it
        return 0


async def check_images(inp: inference_service_pb2.InferenceInput, limits: Limits, prefix: str = "input") -> None:
    """Every image and frame: first their summed pixels from the headers against the request's
    budget (a request of many large images is refused before any is decoded), then each one."""
    loop = asyncio.get_running_loop()
    images = list(_all_images(inp, prefix))
    total = sum(await loop.run_in_executor(None, lambda: [header_pixels(image.data) for _, image in images]))
    if total > limits.max_request_pixels:
        raise _bad(
            [
                FieldViolation(
                    prefix,
                    f"its images and video frames hold {total} pixels; at most {limits.max_request_pixels} per request",
                )
            ]
        )
    problems = await asyncio.gather(
        *(loop.run_in_executor(None, inspect_image, image.data, limits.max_image_pixels) for _, image in images)
    )
    violations = [FieldViolation(f"{path}.data", why) for (path, _), why in zip(images, problems) if why]
    if violations:
        raise _bad(violations)


async def validate(inp: inference_service_pb2.InferenceInput, request_id: str, limits: Limits) -> None:
    """Raise INVALID_ARGUMENT listing every offending field."""
    violations = check_request_id(request_id) + check_input(inp, limits)
    if violations:
        raise _bad(violations)
    await check_images(inp, limits)
