import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from valora_protos.internal.v1 import work_pb2 as _work_pb2
from valora_protos.v1 import inference_service_pb2 as _inference_service_pb2
from valora_protos.v1 import admin_service_pb2 as _admin_service_pb2
from valora_protos.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubmitRequest(_message.Message):
    __slots__ = ("item",)
    ITEM_FIELD_NUMBER: _ClassVar[int]
    item: _work_pb2.WorkItem
    def __init__(self, item: _Optional[_Union[_work_pb2.WorkItem, _Mapping]] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ("text_delta", "result", "logprobs")
    TEXT_DELTA_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text_delta: str
    result: _inference_service_pb2.InferResult
    logprobs: _containers.RepeatedCompositeFieldContainer[_types_pb2.TokenLogprob]
    def __init__(self, text_delta: _Optional[str] = ..., result: _Optional[_Union[_inference_service_pb2.InferResult, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_types_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class GetSchedulerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetSchedulerStatusResponse(_message.Message):
    __slots__ = ("workers", "queued_requests")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[_admin_service_pb2.WorkerStatus]
    queued_requests: int
    def __init__(self, workers: _Optional[_Iterable[_Union[_admin_service_pb2.WorkerStatus, _Mapping]]] = ..., queued_requests: _Optional[int] = ...) -> None: ...

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("address", "name", "device", "max_batch_size")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    address: str
    name: str
    device: str
    max_batch_size: int
    def __init__(self, address: _Optional[str] = ..., name: _Optional[str] = ..., device: _Optional[str] = ..., max_batch_size: _Optional[int] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("ttl",)
    TTL_FIELD_NUMBER: _ClassVar[int]
    ttl: _duration_pb2.Duration
    def __init__(self, ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DeregisterWorkerRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class DeregisterWorkerResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
