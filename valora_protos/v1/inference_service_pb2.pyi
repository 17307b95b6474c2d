from valora_protos.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InferenceInput(_message.Message):
    __slots__ = ("images", "prompt", "adapter", "task", "output_kind", "params", "videos", "system", "history", "raw_prompt", "prompt_token_ids")
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_KIND_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    VIDEOS_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    RAW_PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    images: _containers.RepeatedCompositeFieldContainer[_types_pb2.Image]
    prompt: str
    adapter: str
    task: str
    output_kind: _types_pb2.OutputKind
    params: _types_pb2.GenerationParams
    videos: _containers.RepeatedCompositeFieldContainer[_types_pb2.Video]
    system: str
    history: _containers.RepeatedCompositeFieldContainer[_types_pb2.ChatTurn]
    raw_prompt: bool
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, images: _Optional[_Iterable[_Union[_types_pb2.Image, _Mapping]]] = ..., prompt: _Optional[str] = ..., adapter: _Optional[str] = ..., task: _Optional[str] = ..., output_kind: _Optional[_Union[_types_pb2.OutputKind, str]] = ..., params: _Optional[_Union[_types_pb2.GenerationParams, _Mapping]] = ..., videos: _Optional[_Iterable[_Union[_types_pb2.Video, _Mapping]]] = ..., system: _Optional[str] = ..., history: _Optional[_Iterable[_Union[_types_pb2.ChatTurn, _Mapping]]] = ..., raw_prompt: _Optional[bool] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class InferRequest(_message.Message):
    __slots__ = ("input", "request_id")
    INPUT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    input: InferenceInput
    request_id: str
    def __init__(self, input: _Optional[_Union[InferenceInput, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class InferResult(_message.Message):
    __slots__ = ("request_id", "text", "label", "scores", "finish_reason", "usage", "timing", "mode", "adapter_version", "worker", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    label: str
    scores: _containers.RepeatedCompositeFieldContainer[_types_pb2.LabelScore]
    finish_reason: _types_pb2.FinishReason
    usage: _types_pb2.Usage
    timing: _types_pb2.Timing
    mode: _types_pb2.InferenceMode
    adapter_version: str
    worker: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_types_pb2.TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., label: _Optional[str] = ..., scores: _Optional[_Iterable[_Union[_types_pb2.LabelScore, _Mapping]]] = ..., finish_reason: _Optional[_Union[_types_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_types_pb2.Usage, _Mapping]] = ..., timing: _Optional[_Union[_types_pb2.Timing, _Mapping]] = ..., mode: _Optional[_Union[_types_pb2.InferenceMode, str]] = ..., adapter_version: _Optional[str] = ..., worker: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_types_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class InferResponse(_message.Message):
    __slots__ = ("result",)
    RESULT_FIELD_NUMBER: _ClassVar[int]
    result: InferResult
    def __init__(self, result: _Optional[_Union[InferResult, _Mapping]] = ...) -> None: ...

class InferStreamRequest(_message.Message):
    __slots__ = ("input", "request_id")
    INPUT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    input: InferenceInput
    request_id: str
    def __init__(self, input: _Optional[_Union[InferenceInput, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class InferStreamResponse(_message.Message):
    __slots__ = ("text_delta", "result", "logprobs")
    TEXT_DELTA_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text_delta: str
    result: InferResult
    logprobs: _containers.RepeatedCompositeFieldContainer[_types_pb2.TokenLogprob]
    def __init__(self, text_delta: _Optional[str] = ..., result: _Optional[_Union[InferResult, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_types_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...
