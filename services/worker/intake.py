"""A request's way into the engine, on the caller's thread (CPU work): its parameters checked
against the worker's limits, its seed drawn, its images run through the processor (here or in a
preprocessing process, preprocess.py), its pixels staged for the device, and its context checked
against the model's positions and the KV pool — a request that can never fit is refused here,
never at a step."""

from __future__ import annotations

import collections
import dataclasses
import math

import torch

from services.common.errors import invalid_field
from services.worker.kv_cache import BlockManager
from services.worker.preprocess import process_request
from services.worker.llava import IMAGE_TOKEN
from services.worker.release import ReleasePolicy
from services.worker.processor import IMAGE_PAD, VIDEO_PAD, chat_skeleton, placeholder_counts, special_tokens
from services.worker.requests import OutputKind, WorkRequest
from services.common.config import MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_TOKENS, MAX_TOP_LOGPROBS
from services.worker.sequence import PreparedRequest
from services.worker.vision import VisionItem, stage_pixels


class RequestIntake:
    def __init__(
        self,
        processor,
        config,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        kv: BlockManager,
        vision_tokens: dict[str, int],
        vocab_size: int,
    ) -> None:
        """`config`: the EngineConfig (default_max_new_tokens, max_new_tokens_limit);
        `vision_tokens`: the model's id of each of its family's vision tokens; `vocab_size`: the
        model's (its logits' width: the token ids a request may name)."""
        self.processor, self.config, self.device, self.dtype = processor, config, device, dtype
        self.max_model_len, self.kv, self.vision_tokens = max_model_len, kv, vision_tokens
        self.vocab_size = vocab_size
        # the pads (LLaVA's <image> tokens): usage's image_tokens
        self.vision_token_ids = tuple(i for t, i in vision_tokens.items() if t in (IMAGE_PAD, VIDEO_PAD, IMAGE_TOKEN))
        tokenizer = processor.tokenizer
        self.special_ids = {t: tokenizer.convert_tokens_to_ids(t) for t in special_tokens(tokenizer)}
        self._special_id_tensor = torch.tensor(sorted(self.special_ids.values()), dtype=torch.long)
        self._template_ids: dict[tuple[str, ...], collections.Counter] = {}  # history roles -> the template's ids

    @property
    def pixel_dtype(self) -> torch.dtype | None:
        """The dtype requests' pixels are prepared in (the tower's on CUDA; None: the processor's)."""
        return self.dtype if self.device.type == "cuda" else None

    def prepare(self, request: WorkRequest, processed: tuple[dict, list[VisionItem]] | None = None) -> PreparedRequest:
        """Validates and tokenizes (any thread). `processed`: the request's processor inputs and
        content keys from `preprocess.process_request` run elsewhere (a preprocessing process,
        with `pixel_dtype`); the request's images are not read then."""
        n = request.max_new_tokens or self.config.default_max_new_tokens
        if n < 0 or n > self.config.max_new_tokens_limit:
            raise invalid_field("item.params.max_new_tokens", f"{n} is outside (0, {self.config.max_new_tokens_limit}]")
        if request.output_kind == OutputKind.LABEL and (not request.adapter or not request.head):
            raise invalid_field("item.head", "a LABEL request needs an adapter and a head name")
        sp = request.sampling
        if sp.temperature < 0 or not 0 <= sp.top_p <= 1 or sp.top_k < 0 or not 0 <= sp.min_p <= 1:
            raise invalid_field("item.params", "temperature >= 0, top_p in [0, 1], top_k >= 0, min_p in [0, 1]")
        if not (abs(sp.presence_penalty) <= 2 and abs(sp.frequency_penalty) <= 2 and 0 < sp.repetition_penalty <= 2):
            raise invalid_field(
                "item.params", "presence and frequency penalties in [-2, 2], repetition_penalty in (0, 2]"
            )
        if not -1 <= request.logprobs <= MAX_TOP_LOGPROBS:
            raise invalid_field("item.params.top_logprobs", f"{request.logprobs} is not in [-1, {MAX_TOP_LOGPROBS}]")
        self._check_logit_bias(sp.logit_bias)
        bad = next((i for i, t in enumerate(request.prompt_token_ids) if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise invalid_field(
                f"item.prompt_token_ids[{bad}]",
                f"token id {request.prompt_token_ids[bad]} is not in the model's vocabulary [0, {self.vocab_size})",
                reason="TOKEN_NOT_IN_VOCABULARY",
            )
        release = ReleasePolicy.of(
            request.adapter_release_fraction, request.adapter_release_rule, n, bool(request.adapter)
        )
        seeded = sp.seeded()  # seed 0: a random seed, drawn once here (every TP rank alike)
        if seeded is not sp:
            request = dataclasses.replace(request, sampling=seeded)
        inputs, vision = processed or process_request(self.processor, request, self.pixel_dtype)
        stage_pixels(inputs, self.device, self.dtype)
        ids = inputs["input_ids"]
        if ids.shape[1] + n > self.max_model_len:
            raise invalid_field(
                "item.prompt",
                f"{ids.shape[1]} prompt tokens + {n} new tokens exceed the worker's {self.max_model_len} positions",
                reason="PROMPT_TOO_LONG",
            )
        if self.kv.blocks_for(ids.shape[1] + n) > self.kv.usable_blocks:
            raise invalid_field(
                "item.prompt",
                f"{ids.shape[1]} prompt tokens + {n} new tokens exceed the "
                f"worker's KV cache ({self.kv.usable_blocks * self.kv.block_size} tokens)",
                reason="EXCEEDS_KV_CACHE",
            )
        self._check_placeholders(request, inputs)
        self._check_special_tokens(request, ids)
        image_tokens = int(torch.isin(ids, torch.tensor(self.vision_token_ids)).sum())  # images' and videos'
        return PreparedRequest(
            request=request,
            inputs=inputs,
            max_new_tokens=n,
            image_tokens=image_tokens,
            prompt_tokens=int(ids.shape[1]),
            vision=vision,
            release=release,
        )

    def _check_placeholders(self, request: WorkRequest, inputs: dict) -> None:
        """The prompt's vision placeholder tokens against what its images and videos place
        (processor.placeholder_counts: for Qwen2-VL each one <|vision_start|>, its grid's t·h·w /
        merge² pads, <|vision_end|>; for LLaVA each image's <image> tokens); a raw prompt none.
        A pad without features (or features without their pads) fails the engine's prefill step,
        INTERNAL for every request of the batch, or the processor's expansion: so they are refused
        here, INVALID_ARGUMENT. Text typed with them is refused before the processor, naming its
        field (preprocess.process_request); this catches what that cannot see (token ids, a
        tokenizer that makes them of other text)."""
        ids = inputs["input_ids"]
        per_image = inputs.get("image_grid_thw", inputs.get("pixel_values"))  # LLaVA's: a pixel row an image
        images = 0 if per_image is None else len(per_image)
        videos = 0 if inputs.get("video_grid_thw") is None else len(inputs["video_grid_thw"])
        for token, n in placeholder_counts(self.processor, inputs).items():
            got = int((ids == self.vision_tokens[token]).sum())
            if got != n:
                field = "item.prompt_token_ids" if request.prompt_token_ids else "item.prompt"
                media = (
                    "a raw prompt takes no images or videos"
                    if request.raw_prompt
                    else f"its {images} images and {videos} videos place {n}"
                )
                raise invalid_field(
                    field,
                    f"holds {got} {token} tokens (id {self.vision_tokens[token]}); {media}",
                    reason="VISION_TOKEN_IN_PROMPT",
                )

    def _check_special_tokens(self, request: WorkRequest, ids: torch.Tensor) -> None:
        """A chat request's tokens against its template: each special token (processor.
        special_tokens: `<|im_start|>`, `<|im_end|>`, …) as many times as the family's template
        places it around the turns (processor.chat_skeleton, tokenized). Text typed with one is
        refused before the processor, naming its field (preprocess.process_request); this catches
        what that cannot see: a tokenizer that makes one of other text (a special token matched
        after an NFKC normalizer: `＜｜im_start｜＞`). A raw prompt's are the caller's own."""
        if request.raw_prompt:
            return
        roles = tuple(role for role, _, _ in request.history)
        wanted = self._template_ids.get(roles)
        if wanted is None:  # tokenized once per shape of history, with what the tokenizer adds (LLaVA's <s>)
            wanted = collections.Counter(self.processor.tokenizer(chat_skeleton(self.processor, roles))["input_ids"])
            if len(self._template_ids) < 256:
                self._template_ids[roles] = wanted
        found = collections.Counter(ids[torch.isin(ids, self._special_id_tensor)].tolist())
        for token, token_id in self.special_ids.items():
            want, got = wanted[token_id], found[token_id]
            if got != want:
                raise invalid_field(
                    "item.prompt",
                    f"its text makes {got} {token} tokens (id {token_id}) where the chat template places {want}",
                    reason="SPECIAL_TOKEN_IN_PROMPT",
                )

    def _check_logit_bias(self, bias: tuple[tuple[int, float], ...]) -> None:
        """OpenAI's bounds (as the gateway's), and every token id in the model's vocabulary."""
        if len(bias) > MAX_LOGIT_BIAS_TOKENS:
            raise invalid_field("item.params.logit_bias", f"{len(bias)} entries; at most {MAX_LOGIT_BIAS_TOKENS}")
        for token, value in bias:
            if not 0 <= token < self.vocab_size:
                raise invalid_field(
                    f"item.params.logit_bias[{token}]",
                    f"token id {token} is not in the model's vocabulary [0, {self.vocab_size})",
                    reason="TOKEN_NOT_IN_VOCABULARY",
                )
            if not math.isfinite(value) or abs(value) > MAX_LOGIT_BIAS:
                raise invalid_field(
                    f"item.params.logit_bias[{token}]", f"{value} is not in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
                )
