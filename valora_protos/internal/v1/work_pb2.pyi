from valora_protos.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AdapterRef(_message.Message):
    __slots__ = ("version", "sha256")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    version: str
    sha256: str
    def __init__(self, version: _Optional[str] = ..., sha256: _Optional[str] = ...) -> None: ...

class WorkItem(_message.Message):
    __slots__ = ("request_id", "images", "prompt", "adapter", "output_kind", "head", "params", "videos", "system", "history", "raw_prompt", "prompt_token_ids", "slo_ms", "slo_class", "slo_left_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_KIND_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    VIDEOS_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    RAW_PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SLO_MS_FIELD_NUMBER: _ClassVar[int]
    SLO_CLASS_FIELD_NUMBER: _ClassVar[int]
    SLO_LEFT_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    images: _containers.RepeatedCompositeFieldContainer[_types_pb2.Image]
    prompt: str
    adapter: AdapterRef
    output_kind: _types_pb2.OutputKind
    head: str
    params: _types_pb2.GenerationParams
    videos: _containers.RepeatedCompositeFieldContainer[_types_pb2.Video]
    system: str
    history: _containers.RepeatedCompositeFieldContainer[_types_pb2.ChatTurn]
    raw_prompt: bool
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    slo_ms: float
    slo_class: str
    slo_left_ms: float
    def __init__(self, request_id: _Optional[str] = ..., images: _Optional[_Iterable[_Union[_types_pb2.Image, _Mapping]]] = ..., prompt: _Optional[str] = ..., adapter: _Optional[_Union[AdapterRef, _Mapping]] = ..., output_kind: _Optional[_Union[_types_pb2.OutputKind, str]] = ..., head: _Optional[str] = ..., params: _Optional[_Union[_types_pb2.GenerationParams, _Mapping]] = ..., videos: _Optional[_Iterable[_Union[_types_pb2.Video, _Mapping]]] = ..., system: _Optional[str] = ..., history: _Optional[_Iterable[_Union[_types_pb2.ChatTurn, _Mapping]]] = ..., raw_prompt: _Optional[bool] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., slo_ms: _Optional[float] = ..., slo_class: _Optional[str] = ..., slo_left_ms: _Optional[float] = ...) -> None: ...
