"""An OpenAI-compatible HTTP front next to the gateway's gRPC API (aiohttp).

- `POST /v1/chat/completions`: `messages` (text and `image_url` parts; images as `data:` URLs, or
  remote URLs from the hosts an operator allows, fetched under image_urls.py's rules), `model` =
  an adapter reference (`adapters/…`), a task (`tasks/…`) or the base model's served name;
  `max_completion_tokens`/`max_tokens`, `temperature`, `top_p`, `top_k`, `min_p`, `stop`, `seed`,
  `logprobs`/`top_logprobs`, `presence_penalty`, `frequency_penalty`, `repetition_penalty`
  (vLLM's extension), `logit_bias` (token ids as strings -> biases in [-100, 100], at most 300;
  ids outside the model's vocabulary are the worker's 400), `stream` (SSE chunks, then
  `data: [DONE]`), `stream_options.include_usage`. Extension: `output_kind: "label"` with a task
  runs its head; the label is the message content and its scores come back under
  `valora.scores`. Extension: `adapter_release_fraction` (GenerationParams', [0, 1]: after that
  share of the output the request goes on without its adapter) and `adapter_release_rule`
  (`"sentence_end"`: after the answer's first sentence, the fraction then the least share before
  it counts); neither set: the task's own policy, else never. Bodies are parsed through
  openai_models.py's typed models: a parameter the engine does not implement (`tools`,
  `response_format`, …; `UNSUPPORTED`) is a 400 naming it unless it has its neutral value, never
  silently ignored; an unknown one (`temprature`) is OpenAI's `Unrecognized request argument
  supplied: temprature`; a mistyped one names its field.
- `POST /v1/completions`: `prompt` (a string, or a list of one) tokenized as is, without the chat
  template (`raw_prompt`), or token ids (a list of ints, or a list of one such list) sent on as
  they are (`prompt_token_ids`); a batch of several prompts is a 400. Special tokens in either
  are the caller's own (no template to break out of); in a chat message's text they are a 400
  (`special_token_in_prompt`, the worker's refusal naming the token and field). The same parameters
  (`logprobs`: the legacy API's count of alternatives); `text_completion` objects and chunks.
- `GET /v1/models`: the base model, every adapter (and its aliases) and every task;
  `GET /v1/models/{id}` one of them.
- `GET /health`: 200 while the gateway serves, 503 once it drains (no key: for probes).

Connections: idle ones close after `http_keepalive_s`, ones without a whole request head after
`http_header_timeout_s`, and past `http_max_connections` open ones a new connection gets a 503
(Retry-After: 1) and is closed before anything is read.

One design choice keeps the behaviour identical to gRPC's: completions call the gateway's
own InferenceService over loopback, carrying the caller's `Authorization` header as metadata, so
auth, validation, deadlines, request ids, metrics and tracing are the gRPC path's. Every route but
`/health` first checks the key with the same auth interceptor (an inference key suffices),
before reading the body; `/v1/models` lists through the adapter store's registry. gRPC statuses
become OpenAI-style JSON errors: 400/401/403/404/409/429 (+Retry-After)/503/504, their `param`
the body's parameter behind the first field violation (`max_tokens` for
`input.params.max_new_tokens`: http_param), or none.

Sampling follows the gRPC API's defaults: `temperature` omitted (or 0) is greedy decoding, not
OpenAI's 1.0; `max_tokens` omitted is the gateway's `default_max_new_tokens`.

Messages become a conversation (`conversation`): system (and developer) messages replace the
model's default system prompt, the last message, a user's, is the prompt, and the turns before it
travel as `history`, which the worker renders with the model's chat template. Images keep their
order across messages; each turn shows its own.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import itertools
import json
import re
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import structlog
from aiohttp import web
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.common import errors
from services.common.release_rules import RULE_NAMES, ReleaseRule
from services.common.server import REQUEST_ID_KEY, new_request_id
from services.gateway.auth import AUTHORIZATION_KEY, INFERENCE_PREFIX, ApiKeyAuthInterceptor
from services.gateway.config import GatewaySettings
from services.gateway.image_urls import ImageFetcher, ImageUrlError
from services.gateway.openai_models import ChatCompletionRequest, CompletionRequest, Message, RequestError, parse
from valora_protos.v1 import admin_service_pb2, admin_service_pb2_grpc, inference_service_pb2
from valora_protos.v1 import inference_service_pb2_grpc, types_pb2

log = structlog.get_logger()

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.ABORTED: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}
_FINISH = {
    types_pb2.FINISH_REASON_LENGTH: "length",
    types_pb2.FINISH_REASON_EOS: "stop",
    types_pb2.FINISH_REASON_STOP_SEQUENCE: "stop",
    types_pb2.FINISH_REASON_LABEL: "stop",
}
_LIST_PAGE = 1000
_BODY = web.RequestKey("valora.body", tuple)  # a completion request's (JSON body, whether chat)


def error_response(
    status: int,
    message: str,
    type_: str,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return web.json_response(body, status=status, headers=headers)


# The HTTP body's parameter behind each gRPC field a validation error names (the gateway
# validation's `input.…`, the worker's `item.…`; here without that prefix and without [indices]):
# one name, or (chat's, text completions') where the two APIs differ. A field not found here, nor
# a parent of it, is answered with no `param` (never an internal path): `request_id` (a header),
# `params` as a whole, `videos` (not on HTTP). http_param narrows "messages" to the message (an
# image to its content part).
_HTTP_PARAMS: dict[str, str | tuple[str, str]] = {
    "": ("messages", "prompt"),  # the input as a whole (no prompt, no image)
    "prompt": ("messages", "prompt"),
    "prompt_token_ids": "prompt",
    "raw_prompt": ("messages", "prompt"),
    "system": "messages",
    "history": "messages",
    "images": "messages",
    "adapter": "model",
    "task": "model",
    "head": "model",
    "output_kind": "output_kind",
    "params.max_new_tokens": "max_tokens",  # or max_completion_tokens, the one the body set
    "params.temperature": "temperature",
    "params.top_p": "top_p",
    "params.top_k": "top_k",
    "params.min_p": "min_p",
    "params.seed": "seed",
    "params.presence_penalty": "presence_penalty",
    "params.frequency_penalty": "frequency_penalty",
    "params.repetition_penalty": "repetition_penalty",
    "params.adapter_release_fraction": "adapter_release_fraction",
    "params.adapter_release_rule": "adapter_release_rule",
    "params.logprobs": "logprobs",
    "params.top_logprobs": ("top_logprobs", "logprobs"),  # the legacy API's logprobs is the count
    "params.logit_bias": "logit_bias",
    "params.stop": "stop",
}
_SYSTEM_ROLES = ("system", "developer")


def http_param(field: str, body: Any, chat: bool) -> str | None:
    """The OpenAI-style `param` of a gRPC field violation (`input.params.max_new_tokens` ->
    `max_tokens`) for a chat (`chat`) or text completion with this JSON `body`; None when the
    field is not one of the body's (_HTTP_PARAMS)."""
    head, _, rest = field.partition(".")
    if head not in ("input", "item"):
        return None
    parts = re.sub(r"\[[^\]]*\]", "", rest).split(".")
    for n in range(len(parts), 0, -1):
        name = _HTTP_PARAMS.get(".".join(parts[:n]))
        if name is not None:
            break
    else:
        return None
    if isinstance(name, tuple):
        name = name[0] if chat else name[1]
    body = body if isinstance(body, dict) else {}
    if name == "max_tokens" and chat and body.get("max_completion_tokens") is not None:
        return "max_completion_tokens"
    messages = body.get("messages")
    if name != "messages" or not isinstance(messages, list):
        return name
    roles = [m.get("role") if isinstance(m, dict) else None for m in messages]
    turns = [i for i, role in enumerate(roles) if role not in _SYSTEM_ROLES]  # history, then the prompt
    systems = [i for i, role in enumerate(roles) if role in _SYSTEM_ROLES]
    at = re.fullmatch(r"history\[(\d+)\](?:\.(\w+))?", rest)
    if at and int(at[1]) < len(turns) - 1:
        return f"messages[{turns[int(at[1])]}].{'role' if at[2] == 'role' else 'content'}"
    if rest == "prompt" and turns:
        return f"messages[{turns[-1]}].content"
    if rest == "system" and len(systems) == 1:
        return f"messages[{systems[0]}].content"
    at = re.fullmatch(r"images\[(\d+)\](?:\..*)?", rest)
    if at:
        return _image_part(messages, int(at[1])) or "messages"
    return "messages"


def _is_image(part_type: str | None) -> bool:
    """Whether a content part of this `type` is one of the request's images: every part that is
    not text, counted in order over every message (the one rule _message_parts, which converts
    the typed body, and _image_part, which names a part of the raw JSON, both count by)."""
    return part_type != "text"


def _image_part(messages: list, k: int) -> str | None:
    """`messages[i].content[j]`: the body's k-th image part (`_is_image`), None when there are
    fewer."""
    n = 0
    for i, msg in enumerate(messages):
        content = msg.get("content") if isinstance(msg, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, dict) and _is_image(part.get("type")):
                if n == k:
                    return f"messages[{i}].content[{j}]"
                n += 1
    return None


def _error_body(
    exc: errors.ValoraError, body: Any = None, chat: bool = True
) -> tuple[int, dict[str, Any], dict[str, str]]:
    """The HTTP status, OpenAI-style error JSON and headers of a domain error answering a
    request with this JSON `body` (http_param: its first field violation as `param`)."""
    status, type_ = _HTTP_STATUS.get(exc.code, (500, "server_error"))
    param = http_param(exc.field_violations[0].field, body, chat) if exc.field_violations else None
    message = exc.message
    for v in exc.field_violations:  # the message names the body's parameters too, not gRPC paths
        if v.field.startswith(("input.", "item.")) and v.field in message:
            message = message.replace(v.field, http_param(v.field, body, chat) or "the request")
    headers = {}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
    out = {"error": {"message": message, "type": type_, "param": param, "code": exc.reason.lower()}}
    return status, out, headers


def _from_valora_error(exc: errors.ValoraError, body: Any = None, chat: bool = True) -> web.Response:
    status, out, headers = _error_body(exc, body, chat)
    return web.json_response(out, status=status, headers=headers)


# -- request parsing ------------------------------------------------------------------------------


def _image_from_data_url(url: str, param: str) -> types_pb2.Image:
    if not url.startswith("data:"):
        raise RequestError(
            "only data: URLs are accepted for images (data:image/png;base64,...); this gateway "
            "fetches no remote URLs (VALORA_IMAGE_URL_HOSTS)",
            param,
            code="unsupported_image_url",
        )
    header, sep, payload = url[5:].partition(",")
    if not sep or not header.endswith(";base64"):
        raise RequestError("image data URL must be base64: data:<mime>;base64,<data>", param)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError("image data URL is not valid base64", param) from None
    return types_pb2.Image(data=data, mime_type=header[: -len(";base64")])


def _message_parts(
    messages: list[Message] | None, remote: list | None = None
) -> tuple[list[tuple[str, str, int]], list[types_pb2.Image]]:
    """(role, text, images it shows) per message, and every image in order. `remote`: where the
    remote image URLs go, (index, url, param) each, their images left empty to fetch (None: a
    remote URL is a 400)."""
    if not messages:
        raise RequestError("messages must be a non-empty list", "messages")
    turns: list[tuple[str, str, int]] = []
    images: list[types_pb2.Image] = []
    for i, msg in enumerate(messages):
        content = msg.content if msg.content is not None else ""
        if isinstance(content, str):
            turns.append((msg.role, content, 0))
            continue
        texts, before = [], len(images)
        for j, part in enumerate(content):
            param = f"messages[{i}].content[{j}]"
            if not _is_image(part.type):
                texts.append(part.text)
                continue
            url = part.url
            if url is None:
                raise RequestError("image_url.url must be a string", f"{param}.image_url.url")
            if remote is not None and not url.startswith("data:"):
                remote.append((len(images), url, f"{param}.image_url.url"))
                images.append(types_pb2.Image())
            else:
                images.append(_image_from_data_url(url, f"{param}.image_url.url"))
        turns.append((msg.role, "\n".join(texts), len(images) - before))
    return turns, images


def conversation(inp: inference_service_pb2.InferenceInput, turns: list[tuple[str, str, int]]) -> None:
    """The messages as the model's conversation: system messages (joined) replace the default
    system prompt, the last message (a user's) is the prompt with its images, the ones between
    are the history the worker renders with the chat template."""
    system = [text for role, text, _ in turns if role in ("system", "developer")]
    rest = [t for t in turns if t[0] not in ("system", "developer")]
    for i, (role, text, n) in enumerate(rest):
        if role not in ("user", "assistant"):
            raise RequestError(
                f"role {role!r} is not supported (system, developer, user, assistant)", f"messages[{i}].role"
            )
        if n and role != "user":
            raise RequestError("only user messages may carry images", f"messages[{i}].content")
    if not rest or rest[-1][0] != "user":
        raise RequestError("the last message must be the user's", "messages")
    inp.system = "\n".join(system)
    inp.prompt = rest[-1][1]
    for role, text, n in rest[:-1]:
        inp.history.add(role=role, text=text, images=n)


def _assign(message: Any, field: str, value: Any, param: str) -> None:
    try:
        setattr(message, field, value)
    except (ValueError, TypeError):
        raise RequestError(f"{param} is out of range", param) from None


# Parameters OpenAI defines that the engine does not implement, with the values that mean "not
# used" (openai_models.parse: a 400 naming the parameter for any other value).
UNSUPPORTED = {
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "response_format": ({"type": "text"},),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "best_of": (1,),
    "echo": (False,),
    "suffix": (),
    "parallel_tool_calls": (),
    "store": (False,),
    "metadata": ({},),
    "service_tier": ("auto", "default"),
    "reasoning_effort": (),
    "verbosity": (),
    "web_search_options": (),
    "moderation": (),
    "prompt_cache_options": (),
    "prompt_cache_retention": (),
}


def build_input(
    body: Any, base_model: str, remote: list | None = None
) -> tuple[inference_service_pb2.InferenceInput, bool]:
    """The gRPC InferenceInput of a chat completion request, and whether to stream. `remote`:
    collects the remote image URLs to fetch (_message_parts)."""
    req = parse(ChatCompletionRequest, body, UNSUPPORTED)
    turns, images = _message_parts(req.messages, remote)
    inp = inference_service_pb2.InferenceInput()
    conversation(inp, turns)
    inp.images.extend(images)
    stream = _request_options(req, base_model, inp)
    if req.top_logprobs is not None and not req.logprobs:
        raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
    inp.params.logprobs = bool(req.logprobs)
    if req.top_logprobs is not None:
        _assign(inp.params, "top_logprobs", req.top_logprobs, "top_logprobs")
    return inp, stream


def build_completion_input(
    body: Any, base_model: str, remote: list | None = None
) -> tuple[inference_service_pb2.InferenceInput, bool]:
    """The gRPC InferenceInput of a (legacy) completion request, and whether to stream: the
    prompt, text or token ids, is the model's whole input, without the chat template (`raw_prompt`)."""
    req = parse(CompletionRequest, body, UNSUPPORTED)
    prompt = req.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise RequestError(
            f"a batch of {len(prompt)} prompts is not supported: send one request per prompt",
            "prompt",
            code="unsupported_parameter",
        )
    inp = inference_service_pb2.InferenceInput(raw_prompt=True)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        try:  # token ids, sent on as they are (their bounds: the validation's and the worker's)
            inp.prompt_token_ids.extend(prompt)
        except ValueError:
            raise RequestError("prompt token ids must be 32-bit integers", "prompt") from None
    elif isinstance(prompt, str) and prompt:
        inp.prompt = prompt
    else:
        raise RequestError(
            "prompt must be a non-empty string or list of token ids (or a list of one of them)", "prompt"
        )
    stream = _request_options(req, base_model, inp)
    if req.logprobs is not None:  # the legacy API's logprobs: how many alternatives
        inp.params.logprobs = True
        _assign(inp.params, "top_logprobs", req.logprobs, "logprobs")
    return inp, stream


def _logit_bias(bias: dict[str, float] | None, p: types_pb2.GenerationParams) -> None:
    """OpenAI's logit_bias ({"token id": bias}, typed by openai_models) into
    GenerationParams.logit_bias; its bounds (how many, the biases' range, the vocabulary) are the
    validation's and the worker's."""
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit()):
            raise RequestError(f"logit_bias key {key!r} is not a token id (a non-negative integer)", "logit_bias")
        try:
            p.logit_bias[int(key)] = value
        except (ValueError, TypeError, OverflowError):
            raise RequestError(f"logit_bias key {key} is not a token id (out of range)", "logit_bias") from None


def _request_options(
    req: ChatCompletionRequest | CompletionRequest, base_model: str, inp: inference_service_pb2.InferenceInput
) -> bool:
    """What chat and text completions share, set on `inp`: the model (target), output kind, n,
    the generation parameters, stop; returns whether to stream."""
    model = req.model
    if not model:
        raise RequestError(
            f"model is required: an adapter (adapters/...), a task (tasks/...) or {base_model!r}", "model"
        )
    if model.startswith("adapters/"):
        inp.adapter = model
    elif model.startswith("tasks/"):
        inp.task = model
    elif model != base_model:
        raise errors.NotFound(
            f"model {model!r} does not exist: use adapters/..., tasks/... or {base_model!r}", reason="MODEL_NOT_FOUND"
        )
    inp.output_kind = types_pb2.OUTPUT_KIND_LABEL if req.output_kind == "label" else types_pb2.OUTPUT_KIND_TEXT
    if req.n not in (None, 1):
        raise RequestError("only n=1 is supported", "n")
    # Ranges (temperature, top_p, max_new_tokens …) are the gateway's validation's business;
    # here only what the mapping itself needs: 0 tokens would silently mean "the default", and
    # values must fit the proto fields.
    p = inp.params
    chosen = getattr(req, "max_completion_tokens", None)
    key, max_tokens = ("max_completion_tokens", chosen) if chosen is not None else ("max_tokens", req.max_tokens)
    if max_tokens is not None:
        if max_tokens <= 0:
            raise RequestError(f"{key} must be positive", key)
        _assign(p, "max_new_tokens", max_tokens, key)
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "adapter_release_fraction",
    ):
        value = getattr(req, name)
        if value is not None:
            _assign(p, name, value, name)
    if req.adapter_release_rule is not None:
        try:
            p.adapter_release_rule = ReleaseRule(req.adapter_release_rule).to_pb()
        except ValueError:
            raise RequestError(
                f"adapter_release_rule {req.adapter_release_rule!r} is not one of {', '.join(RULE_NAMES)}",
                "adapter_release_rule",
            ) from None
    _logit_bias(req.logit_bias, p)
    if isinstance(req.stop, str):
        p.stop.append(req.stop)
    elif req.stop is not None:
        p.stop.extend(req.stop)
    return bool(req.stream)


# -- the server -----------------------------------------------------------------------------------


class OpenAIHttpServer:
    """aiohttp app bound at construction (so the port is known, as with gRPC's port 0)."""

    def __init__(
        self,
        settings: GatewaySettings,
        grpc_target: str,
        auth: ApiKeyAuthInterceptor,
        store_admin: admin_service_pb2_grpc.AdminServiceStub,
        grpc_channel: grpc.aio.Channel,
        tracer_provider: trace.TracerProvider | None = None,
    ) -> None:
        self.settings = settings
        self.auth = auth
        self.store_admin = store_admin
        self.channel = grpc_channel
        self.grpc_target = grpc_target
        self.inference = inference_service_pb2_grpc.InferenceServiceStub(grpc_channel)
        self._tracer = trace.get_tracer("valora.http", tracer_provider=tracer_provider)
        self.sock = socket.create_server((settings.host, settings.http_port), reuse_port=False)
        self.port = self.sock.getsockname()[1]
        self.app = web.Application(client_max_size=settings.max_message_bytes, middlewares=[self._middleware])
        self.app.router.add_post("/v1/chat/completions", self.chat_completions)
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/v1/models/{model:.+}", self.model)
        self.app.router.add_get("/health", self.health)
        self.is_serving = lambda: True  # the gateway's health (gateway/server.py sets it)
        self._runner: web.AppRunner | None = None
        self._sweeper: asyncio.Task | None = None
        self.refused_connections = 0  # new connections answered 503 at the cap
        self.images = ImageFetcher(
            settings.image_url_hosts,
            settings.max_image_bytes,
            settings.image_url_timeout_s,
            settings.image_url_allow_http,
            settings.image_url_allow_private,
        )
        self._refused_logged = float("-inf")

    async def start(self) -> None:
        # handler_cancellation: a client that disconnects cancels its handler, and with it the
        # gRPC call and the work downstream; keep-alive: idle connections close after
        # http_keepalive_s (aiohttp's default is an hour); lingering_time 0: a body the handler
        # did not read (a request refused before it: no key, ...) is not read to its end after the
        # answer (aiohttp's default drains it for up to 10 s: 20 keyless 64 MiB uploads held an
        # authorized request for 1.6 s, tests/reliability/test_http_keyless_bodies.py); the
        # connection closes instead.
        self._runner = web.AppRunner(
            self.app,
            access_log=None,
            handle_signals=False,
            handler_cancellation=True,
            keepalive_timeout=self.settings.http_keepalive_s,
            lingering_time=0,
        )
        await self._runner.setup()
        self._sweeper = asyncio.create_task(self._sweep(min(1.0, self.settings.http_header_timeout_s / 2)))
        await _CappedSite(self._runner, self.sock, self.settings.http_max_connections, self._refused).start()
        log.info("http_serving", port=self.port, max_connections=self.settings.http_max_connections)

    def _refused(self) -> None:
        self.refused_connections += 1
        now = time.monotonic()
        if now - self._refused_logged >= 10.0:  # at most one line every 10 s under a flood
            self._refused_logged = now
            log.warning(
                "http_connections_full",
                max_connections=self.settings.http_max_connections,
                refused_total=self.refused_connections,
            )

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.images.close()
        await self.channel.close()

    async def _sweep(self, period_s: float) -> None:
        """Closes connections that have not sent a whole request head within http_header_timeout_s
        of being seen (idle or slowloris sockets; aiohttp itself waits for a first request
        forever). Relies on aiohttp's per-connection request count (`_request_count`)."""
        seen: dict[int, float] = {}
        timeout = self.settings.http_header_timeout_s
        while True:
            await asyncio.sleep(period_s)
            server = self._runner.server if self._runner is not None else None
            if server is None:
                continue
            now, alive = time.monotonic(), set()
            for conn in list(server.connections):
                alive.add(id(conn))
                if getattr(conn, "_request_count", 1):
                    continue
                first = seen.setdefault(id(conn), now)
                if now - first >= timeout:
                    conn.force_close()
            seen = {k: v for k, v in seen.items() if k in alive}

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        """A SERVER span per HTTP request (continuing a caller's traceparent); domain and
        request errors as OpenAI-style JSON."""
        parent = propagate.extract(dict(request.headers))
        with self._tracer.start_as_current_span(
            f"{request.method} {request.path}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"http.request.method": request.method, "url.path": request.path},
        ) as span:
            try:
                response = await handler(request)
            except RequestError as exc:
                response = error_response(400, exc.message, "invalid_request_error", exc.code, exc.param)
            except errors.ValoraError as exc:  # a completion's body (_complete) names its fields
                response = _from_valora_error(exc, *request.get(_BODY, (None, True)))
            except web.HTTPException as exc:
                response = error_response(exc.status, exc.reason, "invalid_request_error")
            except Exception as exc:  # a bug: logged, answered as OpenAI's 500
                log.error("http_bug", path=request.path, error=repr(exc))
                span.record_exception(exc)
                response = error_response(500, f"internal error: {type(exc).__name__}", "server_error")
            span.set_attribute("http.response.status_code", response.status)
            if response.status >= 500:
                span.set_status(Status(StatusCode.ERROR))
            return response

    def _metadata(self, request: web.Request, rid: str) -> tuple[tuple[str, str], ...]:
        md = [(REQUEST_ID_KEY, rid)]
        if AUTHORIZATION_KEY in {k.lower() for k in request.headers}:
            md.append((AUTHORIZATION_KEY, request.headers["Authorization"]))
        return tuple(md)

    def _authorize(self, request: web.Request) -> None:
        """The caller's key checked before the body is read (a keyless caller must not make the
        gateway read, gunzip and parse a large body); a header gRPC metadata cannot carry
        (non-ASCII) is an invalid key."""
        value = request.headers.get("Authorization")
        if value is not None and not (value.isascii() and value.isprintable()):
            raise errors.Unauthenticated("invalid API key", reason="INVALID_API_KEY")
        refused = self.auth.check(INFERENCE_PREFIX + "Infer", list(request.headers.items()))
        if refused is not None:
            raise refused

    async def _json(self, request: web.Request) -> Any:
        try:
            return await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RequestError("the body is not valid JSON") from None
        except RecursionError:
            raise RequestError("the body's JSON is nested too deeply") from None
        except web.HTTPRequestEntityTooLarge:
            raise RequestError(
                f"the body is larger than {self.settings.max_message_bytes} bytes", code="request_too_large"
            ) from None

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, build_input, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, build_completion_input, chat=False)

    async def _complete(self, request: web.Request, build, chat: bool) -> web.StreamResponse:
        """A chat (`chat`) or text completion: the body through `build`, then gRPC Infer or
        InferStream, answered in that API's shape."""
        self._authorize(request)
        body = await self._json(request)
        request[_BODY] = (body, chat)  # for the errors' `param` (http_param)
        remote: list | None = [] if self.images.enabled else None
        inp, stream = build(body, self.settings.served_model_name, remote)
        await self._fetch_images(inp, remote or [])
        rid = request.headers.get("X-Request-Id") or new_request_id()
        metadata = self._metadata(request, rid)
        shape = _Shape(chat, rid, body["model"], int(time.time()))
        if stream:
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return await self._stream(request, inp, rid, shape, metadata, include_usage)
        try:
            resp = await self.inference.Infer(
                inference_service_pb2.InferRequest(input=inp, request_id=rid), metadata=metadata
            )
        except grpc.RpcError as err:
            raise errors.from_rpc_error(err) from None
        r = resp.result
        content = r.label if inp.output_kind == types_pb2.OUTPUT_KIND_LABEL else r.text
        out = {
            **shape.head(),
            "choices": [
                shape.choice(content, _FINISH.get(r.finish_reason, "stop"), r.logprobs if inp.params.logprobs else None)
            ],
            "usage": _usage(r),
            "valora": _extension(r),
        }
        return web.json_response(out, headers={"X-Request-Id": rid})

    async def _stream(
        self, request: web.Request, inp, rid: str, shape: "_Shape", metadata, include_usage: bool
    ) -> web.StreamResponse:
        call = self.inference.InferStream(
            inference_service_pb2.InferStreamRequest(input=inp, request_id=rid), metadata=metadata
        )

        def event(data: dict) -> bytes:
            return b"data: " + json.dumps(data).encode() + b"\n\n"

        asked = inp.params.logprobs
        sent = 0  # tokens whose log-probabilities went out

        def chunk(text: str | None, finish: str | None = None, logprobs=(), **extra) -> bytes:
            nonlocal sent
            sent += len(logprobs)
            choice = shape.delta(text, finish, logprobs if asked else None)
            return event({**shape.head(chunk=True), "choices": [choice], **extra})

        response: web.StreamResponse | None = None
        try:
            messages = call.__aiter__()
            try:
                first = await messages.__anext__()  # errors before any byte: a plain JSON error
            except StopAsyncIteration:
                raise errors.WorkerUnavailable("the stream ended without a result", reason="NO_RESULT") from None
            except grpc.RpcError as err:
                raise errors.from_rpc_error(err) from None
            response = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Request-Id": rid}
            )
            await response.prepare(request)
            if shape.chat:
                await response.write(chunk(""))  # the role, first
            try:
                async for msg in _chain(first, messages):
                    if msg.text_delta:
                        await response.write(chunk(msg.text_delta, logprobs=msg.logprobs))
                    if msg.HasField("result"):
                        r = msg.result
                        if inp.output_kind == types_pb2.OUTPUT_KIND_LABEL and r.label:
                            await response.write(chunk(r.label))
                        await response.write(
                            chunk(None, _FINISH.get(r.finish_reason, "stop"), r.logprobs[sent:], valora=_extension(r))
                        )
                        if include_usage:
                            await response.write(event({**shape.head(chunk=True), "choices": [], "usage": _usage(r)}))
            except grpc.RpcError as err:  # after the first byte: an error event, then the end
                _, body, _ = _error_body(errors.from_rpc_error(err), *request[_BODY])
                await response.write(event(body))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        finally:
            call.cancel()  # no-op when finished; frees the request when the HTTP client left

    async def _fetch_images(self, inp: inference_service_pb2.InferenceInput, remote: list) -> None:
        """The request's remote images, fetched together (image_urls.py: the rules); a 400 naming
        the URL's field for the first that fails."""
        if len(remote) > self.settings.max_images:  # the gateway's count check would come after the fetches
            raise RequestError(f"{len(remote)} image URLs; at most {self.settings.max_images} images", "messages")
        got = await asyncio.gather(*(self.images.fetch(url) for _, url, _ in remote), return_exceptions=True)
        for (i, _, param), result in zip(remote, got):
            if isinstance(result, ImageUrlError):
                raise RequestError(result.message, param, code=result.code)
            if isinstance(result, BaseException):
                raise result
            data, mime = result
            inp.images[i].data = data
            if mime.startswith("image/"):
                inp.images[i].mime_type = mime

    async def health(self, request: web.Request) -> web.Response:
        """200 while the gateway serves, 503 from the moment it drains (no key needed: probes)."""
        return web.Response(status=200 if self.is_serving() else 503)

    async def model(self, request: web.Request) -> web.Response:
        """One entry of /v1/models by id (an adapter, adapter@alias, task or the base model)."""
        wanted = request.match_info["model"]
        for entry in await self._models(request):
            if entry["id"] == wanted:
                return web.json_response(entry)
        raise errors.NotFound(f"model {wanted!r} does not exist", reason="MODEL_NOT_FOUND")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": await self._models(request)})

    async def _models(self, request: web.Request) -> list[dict]:
        self._authorize(request)
        metadata = ((REQUEST_ID_KEY, request.headers.get("X-Request-Id") or new_request_id()),)
        timeout = self.settings.admin_deadline_s
        created = int(time.time())
        data = [{"id": self.settings.served_model_name, "object": "model", "created": created, "owned_by": "valora"}]
        try:
            async for a in _pages(
                lambda token: self.store_admin.ListAdapters(
                    admin_service_pb2.ListAdaptersRequest(page_size=_LIST_PAGE, page_token=token),
                    timeout=timeout,
                    metadata=metadata,
                ),
                "adapters",
            ):
                ts = a.create_time.seconds or created
                data.append({"id": a.name, "object": "model", "created": ts, "owned_by": "valora"})
                data.extend(
                    {
                        "id": f"{a.name}@{alias}",
                        "object": "model",
                        "created": ts,
                        "owned_by": "valora",
                        "parent": a.name,
                    }
                    for alias in sorted(a.aliases)
                )
            async for t in _pages(
                lambda token: self.store_admin.ListTasks(
                    admin_service_pb2.ListTasksRequest(page_size=_LIST_PAGE, page_token=token),
                    timeout=timeout,
                    metadata=metadata,
                ),
                "tasks",
            ):
                data.append(
                    {
                        "id": t.name,
                        "object": "model",
                        "created": t.create_time.seconds or created,
                        "owned_by": "valora",
                        "parent": t.adapter,
                    }
                )
        except grpc.RpcError as err:
            raise errors.from_rpc_error(err) from None
        return data


_FULL_BODY = json.dumps(
    {
        "error": {
            "message": "too many open connections; retry",
            "type": "service_unavailable",
            "param": None,
            "code": "too_many_connections",
        }
    }
).encode()
_FULL = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
    b"Connection: close\r\nContent-Length: " + str(len(_FULL_BODY)).encode() + b"\r\n\r\n" + _FULL_BODY
)


class _Refused(asyncio.Protocol):
    """A connection past the cap: a 503 written at once, then closed (its bytes are never read)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(_FULL)
        transport.close()


class _CappedSite(web.SockSite):
    """aiohttp's socket site with a cap on open connections (aiohttp has none): while `cap`
    connections are open (0: no cap), a new one gets _Refused instead of aiohttp's handler.
    Connections accepted in one burst may pass the cap by that burst, since aiohttp counts a
    connection from its first callback."""

    def __init__(self, runner: web.AppRunner, sock: socket.socket, cap: int, on_refuse) -> None:
        super().__init__(runner, sock)
        self._cap, self._on_refuse = cap, on_refuse

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with the runner (its cleanup stops it)
        server = self._runner.server

        def protocol() -> asyncio.Protocol:
            if self._cap and len(server.connections) >= self._cap:
                self._on_refuse()
                return _Refused()
            return server()

        self._server = await asyncio.get_running_loop().create_server(protocol, sock=self._sock, backlog=self._backlog)


@dataclasses.dataclass(frozen=True)
class _Shape:
    """The response objects of a chat completion (`chat`) or a text completion."""

    chat: bool
    rid: str
    model: str
    created: int

    def head(self, chunk: bool = False) -> dict[str, Any]:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {
            "id": f"{'chatcmpl' if self.chat else 'cmpl'}-{self.rid}",
            "object": kind,
            "created": self.created,
            "model": self.model,
        }

    def choice(self, content: str, finish: str, logprobs=None) -> dict[str, Any]:
        """The answer's choice; `logprobs`: its tokens' (TokenLogprob), None when not asked."""
        lp = self.logprobs(logprobs)
        if self.chat:
            return {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "finish_reason": finish,
                "logprobs": lp,
            }
        return {"index": 0, "text": content, "finish_reason": finish, "logprobs": lp}

    def delta(self, text: str | None, finish: str | None, logprobs=None) -> dict[str, Any]:
        """A stream chunk's choice: `text` new text ("" with chat: the role; None: none) and the
        log-probabilities of the tokens it shows (None when not asked)."""
        lp = self.logprobs(logprobs)
        if self.chat:
            delta = {} if text is None else {"role": "assistant", "content": ""} if text == "" else {"content": text}
            return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lp}
        return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": lp}

    def logprobs(self, entries) -> dict[str, Any] | None:
        """TokenLogprob entries in this API's shape: chat's `content` list, or the legacy
        completions' parallel lists (tokens, token_logprobs, top_logprobs as {token: logprob})."""
        if entries is None:
            return None
        if self.chat:

            def one(e) -> dict[str, Any]:
                return {"token": e.token, "logprob": e.logprob, "bytes": list(e.bytes)}

            return {
                "content": [{**one(e), "top_logprobs": [one(t) for t in e.top_logprobs]} for e in entries],
                "refusal": None,
            }
        offsets = list(itertools.accumulate((len(e.token) for e in entries), initial=0))[:-1]
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t.token: t.logprob for t in e.top_logprobs} for e in entries],
            "text_offset": offsets,
        }


async def _pages(call_page, field: str) -> AsyncIterator[Any]:
    token = ""
    while True:
        resp = await call_page(token)
        for item in getattr(resp, field):
            yield item
        token = resp.next_page_token
        if not token:
            return


async def _chain(first, rest) -> AsyncIterator[Any]:
    yield first
    async for item in rest:
        yield item


def _usage(r: inference_service_pb2.InferResult) -> dict[str, int]:
    prompt = r.usage.prompt_tokens + r.usage.image_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": r.usage.output_tokens,
        "total_tokens": prompt + r.usage.output_tokens,
    }


def _extension(r: inference_service_pb2.InferResult) -> dict[str, Any]:
    """valora's own fields: what served the request (ignored by OpenAI clients)."""
    out: dict[str, Any] = {
        "adapter_version": r.adapter_version,
        "worker": r.worker,
        "mode": types_pb2.InferenceMode.Name(r.mode),
    }
    if r.label:
        out["label"] = r.label
        out["scores"] = [{"label": s.label, "score": s.score} for s in r.scores]
    return out


def loopback_target(host: str, port: int) -> str:
    """Where the HTTP front reaches the gateway's own gRPC port."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"
