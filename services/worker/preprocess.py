"""Request preprocessing: a WorkItem's images decoded, the processor run (resize, normalize,
patchify, tokenize), the pixels cast to the tower's dtype and content-hashed for the feature cache.

That is ~13 ms of CPU per 448 px image (Qwen2-VL-7B's processor), and much of it holds the GIL:
on the worker's threads it slows the engine thread, whose step is host-bound Python. As vLLM keeps
its engine core apart from the frontend's preprocessing, a worker can run it in spawned processes
(`Preprocessor`, VALORA_PREPROCESS_PROCESSES): the worker process then only receives tensors.
`python -m bench.prepare_gil` measures it: on 2 cores an engine-like loop kept 0.69 of its speed
beside one preparing thread, 0.86 beside one preparing process
(bench/results/prepare-gil-cpu2-2026-11-29.json). But on the H200 host a 7B worker with 4 such
processes served 18.7 req/s instead of 36.6, its decode p90 84-140 ms instead of 8
(bench/results/scale-7b-h200x2-0bb1dc8-VALORA_PREPROCESS_PROCESSES.json): off by default.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import structlog
import torch

from services.common.errors import ValoraError, invalid_field
from services.worker.processor import build_inputs, decode_image, typed_special_token, typed_vision_token, vision_tokens
from services.common.release_rules import ReleaseRule
from services.worker.requests import OutputKind, WorkRequest
from services.worker.sampling import SamplingParams
from services.worker.vision import VisionItem, cast_pixels, vision_items
from valora_protos.internal.v1 import work_pb2
from valora_protos.v1 import types_pb2

log = structlog.get_logger()


def release_rule(value: int) -> ReleaseRule:
    """GenerationParams.adapter_release_rule; INVALID_ARGUMENT for a value this worker does not know."""
    try:
        return ReleaseRule.from_pb(value)
    except ValueError:
        raise invalid_field("item.params.adapter_release_rule", f"unknown rule {value}") from None


def work_request_from_pb(item, adapter: str | None) -> WorkRequest:
    """WorkItem -> WorkRequest (decodes images: CPU work, call from an executor)."""
    p = item.params
    kind = OutputKind.LABEL if item.output_kind == types_pb2.OUTPUT_KIND_LABEL else OutputKind.TEXT
    if p.max_new_tokens < 0:
        raise invalid_field("item.params.max_new_tokens", "must not be negative")
    return WorkRequest(
        request_id=item.request_id,
        prompt=item.prompt,
        images=[decode_image(img.data, f"item.images[{i}]") for i, img in enumerate(item.images)],
        videos=[
            [decode_image(f.data, f"item.videos[{i}].frames[{j}]") for j, f in enumerate(v.frames)]
            for i, v in enumerate(item.videos)
        ],
        adapter=adapter,
        output_kind=kind,
        head=item.head,
        max_new_tokens=p.max_new_tokens,
        sampling=SamplingParams(
            temperature=p.temperature,
            top_p=p.top_p or 1.0,
            top_k=p.top_k,
            seed=p.seed,
            min_p=p.min_p,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty or 1.0,
            logit_bias=tuple(sorted(p.logit_bias.items())),
        ),
        stop=list(p.stop),
        adapter_release_fraction=p.adapter_release_fraction,
        adapter_release_rule=release_rule(p.adapter_release_rule),
        system=item.system,
        history=[(t.role, t.text, t.images) for t in item.history],
        raw_prompt=item.raw_prompt,
        prompt_token_ids=list(item.prompt_token_ids),
        logprobs=p.top_logprobs if p.logprobs else -1,
        slo_left_s=item.slo_left_ms / 1000.0 if item.HasField("slo_left_ms") else None,
    )


def process_request(processor, request: WorkRequest, pixel_dtype: torch.dtype | None) -> tuple[dict, list[VisionItem]]:
    """The processor's inputs for the request (pixels cast to `pixel_dtype` when given) and its
    images'/videos' content keys; INVALID_ARGUMENT for images it cannot take (BAD_IMAGE) and for
    text holding a vision placeholder token (VISION_TOKEN_IN_PROMPT: processor.typed_vision_token)
    and a chat request's text holding another special token of the tokenizer, `<|im_start|>` …
    (SPECIAL_TOKEN_IN_PROMPT: processor.typed_special_token; a raw prompt's are its own)."""
    if request.raw_prompt and (request.images or request.videos or request.system or request.history):
        raise invalid_field("item.raw_prompt", "a raw prompt takes no images, videos, system or history")
    if request.prompt_token_ids and (not request.raw_prompt or request.prompt):
        raise invalid_field("item.prompt_token_ids", "token ids are a raw prompt's (raw_prompt set, no prompt text)")
    for i, frames in enumerate(request.videos):
        if not frames:
            raise invalid_field(f"item.videos[{i}].frames", "a video needs at least one frame", reason="BAD_IMAGE")
    texts = [
        ("item.prompt", request.prompt),
        ("item.system", request.system),
        *((f"item.history[{i}].text", turn[1]) for i, turn in enumerate(request.history)),
    ]
    placeholders = vision_tokens(processor)
    for field, text in texts:  # before the processor: it expands every <|image_pad|> it finds
        if token := typed_vision_token(text, placeholders):
            raise invalid_field(
                field,
                f"holds {token!r}, a vision placeholder token: the request's images and "
                f"videos place their own ({', '.join(placeholders)} are not taken as text)",
                reason="VISION_TOKEN_IN_PROMPT",
            )
        if not request.raw_prompt and (token := typed_special_token(text, processor.tokenizer)):
            raise invalid_field(
                field,
                f"holds {token!r}, a special token of the model's tokenizer: the chat "
                "template places the turns' control tokens, text may not",
                reason="SPECIAL_TOKEN_IN_PROMPT",
            )
    try:
        inputs = dict(
            build_inputs(
                processor,
                request.images,
                request.prompt,
                request.videos,
                request.system,
                request.history,
                raw=request.raw_prompt,
                token_ids=request.prompt_token_ids,
            )
        )
    except (ValueError, TypeError) as exc:
        raise invalid_field(
            "item.images", f"cannot process the request's images or videos: {exc}", reason="BAD_IMAGE"
        ) from exc
    if pixel_dtype is not None:
        cast_pixels(inputs, pixel_dtype)
    return inputs, vision_items(inputs)  # keys over the pixels the tower gets


# -- the pool's processes ---------------------------------------------------------------------
_processor = None
_pixel_dtype: torch.dtype | None = None


def _init_child(model_path: str, pixel_dtype: torch.dtype | None) -> None:
    global _processor, _pixel_dtype
    from services.worker.model import load_processor

    torch.set_num_threads(1)  # one request at a time per process; the pool is the parallelism
    _processor = load_processor(Path(model_path))
    _pixel_dtype = pixel_dtype


def _ready() -> bool:
    return _processor is not None


def _child_prepare(item_bytes: bytes, adapter: str | None) -> tuple[WorkRequest, dict, list[VisionItem]]:
    request = work_request_from_pb(work_pb2.WorkItem.FromString(item_bytes), adapter)
    inputs, vision = process_request(_processor, request, _pixel_dtype)
    # the decoded images stay here: the engine needs their processed inputs only
    request.images, request.videos = [], []
    return request, inputs, vision


class Preprocessor:
    """A pool of `processes` spawned processes running `process_request` (each loads the model
    directory's processor once). `prepare` takes the request's WorkItem; errors raised in a
    process (ValoraError: INVALID_ARGUMENT for a bad image) come back as they were raised. A
    process that dies (killed, out of memory, a crash in a decoder) breaks the whole pool: it is
    replaced, a request that met the broken pool is tried once more on the new one, and fails
    INTERNAL if that pool breaks too (a request that kills its process every time)."""

    def __init__(self, model_path: Path | str, processes: int, pixel_dtype: torch.dtype | None) -> None:
        if processes < 1:
            raise ValueError("a Preprocessor needs at least one process")
        self._processes = processes
        self._initargs = (str(model_path), pixel_dtype)
        self._pool = self._new_pool()

    def _new_pool(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(
            max_workers=self._processes,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_child,
            initargs=self._initargs,
        )

    async def start(self) -> None:
        """Starts every process (spawn, imports, processor load) before the first request."""
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(self._pool, _ready) for _ in range(self._processes)))

    async def prepare(self, item, adapter: str | None) -> tuple[WorkRequest, dict, list[VisionItem]]:
        """(request without its decoded images, processor inputs, content keys) of a WorkItem."""
        loop = asyncio.get_running_loop()
        data = item.SerializeToString()
        for attempt in range(2):
            pool = self._pool
            try:
                return await loop.run_in_executor(pool, _child_prepare, data, adapter)
            except BrokenProcessPool:
                if self._pool is pool:  # the first request to notice replaces it
                    log.warning("preprocess_pool_broken", request_id=item.request_id, attempt=attempt)
                    pool.shutdown(wait=False, cancel_futures=True)
                    self._pool = self._new_pool()
        raise ValoraError(
            f"request {item.request_id}: its preprocessing process died twice", reason="PREPROCESS_FAILED"
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
