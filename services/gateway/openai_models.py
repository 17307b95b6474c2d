"""The OpenAI HTTP requests as typed models (pydantic v2): what http_openai.py reads from a body.

`parse(model, body, unsupported)` checks a request's JSON object in three steps, each a 400:

1. a parameter OpenAI defines that the engine does not implement (`unsupported`: name -> the
   values that mean "not used") names itself: `tools is not supported by this server`;
2. a key neither OpenAI nor valora defines (a misspelling: `temprature`) is refused as OpenAI's
   API refuses it: `Unrecognized request argument supplied: temprature` (inside a message or a
   content part too: `messages[0].contnet`);
3. the rest is validated against the model's types (strict: `"0.5"` is not a number, `true` not
   an integer); the first error names its field (`messages[0].content`, `stream_options`).

The fields here are OpenAI's (openai's `CompletionCreateParams` types) plus valora's and vLLM's
extensions, sent with the SDK's `extra_body`: `top_k`, `min_p`, `repetition_penalty` (vLLM's) and
`output_kind` (`"label"`: a task's head), `adapter_release_fraction` and `adapter_release_rule`
(early adapter release, as GenerationParams'; the rule by name, `"sentence_end"`). `user`,
`safety_identifier` and `prompt_cache_key` are identifiers or hints that change no output:
accepted, not used. Ranges are the gateway's
validation's business (validation.py), after the request becomes gRPC; custom checks that keep
their own messages (model, messages, prompt, n, logit_bias keys) are http_openai.py's.
"""

from __future__ import annotations

import re

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError
from pydantic import ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

Number = StrictFloat | StrictInt  # strict: a bool or a string is not a number (an int is)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class ImageURL(_Strict):
    url: StrictStr
    # Images go to the model at its own resolution, which is what "high" asks for; "low" (a
    # cheaper downscaled image) is not offered.
    detail: Literal["auto", "high"] | None = None


class ContentPart(_Strict):
    """A message content part: {type: text, text} or {type: image_url, image_url: {url} | url}."""

    type: StrictStr
    text: StrictStr | None = None
    image_url: ImageURL | StrictStr | None = None

    @model_validator(mode="before")
    @classmethod
    def _kind(cls, data: Any) -> Any:
        if (
            not isinstance(data, dict)
            or data.get("type") not in ("text", "image_url")
            or (data["type"] == "text" and not isinstance(data.get("text"), str))
        ):
            raise ValueError("content parts must be {type: text} or {type: image_url}")
        return data

    @property
    def url(self) -> str | None:
        return self.image_url.url if isinstance(self.image_url, ImageURL) else self.image_url


class Message(_Strict):
    """A chat message; the roles' own checks (which roles, which may show images) are
    http_openai.conversation's. OpenAI's assistant fields a client sends back with its history
    (`refusal`, `tool_calls`, …) pass while empty; `name` is accepted and not shown to the model."""

    role: StrictStr
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    refusal: StrictStr | None = None
    tool_calls: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    tool_call_id: StrictStr | None = None

    @field_validator("tool_calls", "function_call", "audio")
    @classmethod
    def _unused(cls, value: Any, info: ValidationInfo) -> Any:
        if value not in (None, []):
            raise PydanticCustomError("unsupported_parameter", f"{info.field_name} is not supported by this server")
        return value


class StreamOptions(_Strict):
    include_usage: StrictBool | None = None
    include_obfuscation: Literal[False] | None = None  # no obfuscation padding in our chunks


class _Common(_Strict):
    """What chat and text completions share."""

    model: StrictStr | None = None  # required: http_openai's message names the choices
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    n: StrictInt | None = None
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[StrictStr, Number] | None = None
    user: StrictStr | None = None
    # valora's and vLLM's extensions (extra_body)
    top_k: StrictInt | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    output_kind: Literal["text", "label"] | None = None
    adapter_release_fraction: Number | None = None
    adapter_release_rule: StrictStr | None = None  # a release_rules.ReleaseRule's name: http_openai checks it


class ChatCompletionRequest(_Common):
    messages: list[Message] | None = None  # required and non-empty: http_openai's check
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    safety_identifier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None


class CompletionRequest(_Common):
    # a string, token ids, or a batch of one of them: http_openai.build_completion_input's checks
    prompt: StrictStr | list[Any] | None = None
    logprobs: StrictInt | None = None  # the legacy API's: how many alternatives per token


class RequestError(Exception):
    """A malformed HTTP request, answered 400 before anything reaches gRPC."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


_MODELS = (ImageURL, ContentPart, Message, StreamOptions, ChatCompletionRequest, CompletionRequest)
_FIELDS = {name for m in _MODELS for name in m.model_fields}
_OPAQUE = {"logit_bias"}  # maps: their keys are data, not fields


def _param(loc: tuple) -> str | None:
    """A pydantic error location as OpenAI's `param`: `messages[0].content`, without pydantic's
    union branch tags and stopping at a map (`logit_bias`)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _FIELDS:
            out += f".{part}" if out else part
            if part in _OPAQUE:
                break
    return out or None


def _refuse_unsupported(body: dict, unsupported: dict[str, tuple]) -> None:
    """A parameter the engine does not implement is a 400 naming it, never silently ignored;
    its neutral value (what OpenAI does without it) passes."""
    for key, neutral in unsupported.items():
        value = body.get(key)
        if value is not None and value not in neutral:
            raise RequestError(f"{key} is not supported by this server", key, code="unsupported_parameter")


def _unrecognized(names: list[str]) -> RequestError:
    many = len(names) > 1
    return RequestError(
        f"Unrecognized request argument{'s' if many else ''} supplied: {', '.join(names)}",
        names[0],
        code="unrecognized_argument",
    )


def parse(model: type[_Common], body: Any, unsupported: dict[str, tuple]) -> _Common:
    """The request `body` (parsed JSON) as `model`, or the RequestError that answers it."""
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    _refuse_unsupported(body, unsupported)
    unknown = [k for k in body if k not in model.model_fields and k not in unsupported]
    if unknown:
        raise _unrecognized(unknown)
    try:
        return model.model_validate({k: v for k, v in body.items() if k not in unsupported})
    except ValidationError as exc:
        errs = exc.errors(include_url=False)
        extra = [_param(e["loc"][:-1]) + f".{e['loc'][-1]}" for e in errs if e["type"] == "extra_forbidden"]
        if extra:  # a misspelled key inside a message or a part
            raise _unrecognized(extra) from None
        first = max(errs, key=lambda e: len(e["loc"]))  # of a union's branches, the one that got furthest
        param = _param(first["loc"])
        message = re.sub(r" or instance of \w+", "", first["msg"].removeprefix("Value error, "))
        code = "unsupported_parameter" if first["type"] == "unsupported_parameter" else "invalid_request"
        raise RequestError(f"{param}: {message}" if param else message, param, code) from None
