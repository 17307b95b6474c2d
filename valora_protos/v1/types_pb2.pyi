from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InferenceMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INFERENCE_MODE_UNSPECIFIED: _ClassVar[InferenceMode]
    INFERENCE_MODE_BASE: _ClassVar[InferenceMode]
    INFERENCE_MODE_MERGED: _ClassVar[InferenceMode]
    INFERENCE_MODE_UNMERGED: _ClassVar[InferenceMode]
    INFERENCE_MODE_MIXTURE: _ClassVar[InferenceMode]

class OutputKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTPUT_KIND_UNSPECIFIED: _ClassVar[OutputKind]
    OUTPUT_KIND_TEXT: _ClassVar[OutputKind]
    OUTPUT_KIND_LABEL: _ClassVar[OutputKind]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_STOP_SEQUENCE: _ClassVar[FinishReason]
    FINISH_REASON_LABEL: _ClassVar[FinishReason]

class AdapterReleaseRule(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ADAPTER_RELEASE_RULE_UNSPECIFIED: _ClassVar[AdapterReleaseRule]
    ADAPTER_RELEASE_RULE_SENTENCE_END: _ClassVar[AdapterReleaseRule]
INFERENCE_MODE_UNSPECIFIED: InferenceMode
INFERENCE_MODE_BASE: InferenceMode
INFERENCE_MODE_MERGED: InferenceMode
INFERENCE_MODE_UNMERGED: InferenceMode
INFERENCE_MODE_MIXTURE: InferenceMode
OUTPUT_KIND_UNSPECIFIED: OutputKind
OUTPUT_KIND_TEXT: OutputKind
OUTPUT_KIND_LABEL: OutputKind
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_STOP_SEQUENCE: FinishReason
FINISH_REASON_LABEL: FinishReason
ADAPTER_RELEASE_RULE_UNSPECIFIED: AdapterReleaseRule
ADAPTER_RELEASE_RULE_SENTENCE_END: AdapterReleaseRule

class Image(_message.Message):
    __slots__ = ("data", "mime_type")
    DATA_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    mime_type: str
    def __init__(self, data: _Optional[bytes] = ..., mime_type: _Optional[str] = ...) -> None: ...

class Video(_message.Message):
    __slots__ = ("frames",)
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    frames: _containers.RepeatedCompositeFieldContainer[Image]
    def __init__(self, frames: _Optional[_Iterable[_Union[Image, _Mapping]]] = ...) -> None: ...

class ChatTurn(_message.Message):
    __slots__ = ("role", "text", "images")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    role: str
    text: str
    images: int
    def __init__(self, role: _Optional[str] = ..., text: _Optional[str] = ..., images: _Optional[int] = ...) -> None: ...

class GenerationParams(_message.Message):
    __slots__ = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "adapter_release_fraction", "min_p", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "adapter_release_rule")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_RELEASE_FRACTION_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_RELEASE_RULE_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    adapter_release_fraction: float
    min_p: float
    logprobs: bool
    top_logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    adapter_release_rule: AdapterReleaseRule
    def __init__(self, max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., adapter_release_fraction: _Optional[float] = ..., min_p: _Optional[float] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., adapter_release_rule: _Optional[_Union[AdapterReleaseRule, str]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob", "bytes", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    bytes: bytes
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ..., bytes: _Optional[bytes] = ..., top_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class LabelScore(_message.Message):
    __slots__ = ("label", "score")
    LABEL_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    label: str
    score: float
    def __init__(self, label: _Optional[str] = ..., score: _Optional[float] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("image_tokens", "prompt_tokens", "output_tokens")
    IMAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    image_tokens: int
    prompt_tokens: int
    output_tokens: int
    def __init__(self, image_tokens: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("queue_ms", "first_token_ms", "total_ms")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    first_token_ms: float
    total_ms: float
    def __init__(self, queue_ms: _Optional[float] = ..., first_token_ms: _Optional[float] = ..., total_ms: _Optional[float] = ...) -> None: ...
