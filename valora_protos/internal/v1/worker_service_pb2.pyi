from valora_protos.internal.v1 import work_pb2 as _work_pb2
from valora_protos.v1 import admin_service_pb2 as _admin_service_pb2
from valora_protos.v1 import inference_service_pb2 as _inference_service_pb2
from valora_protos.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("item",)
    ITEM_FIELD_NUMBER: _ClassVar[int]
    item: _work_pb2.WorkItem
    def __init__(self, item: _Optional[_Union[_work_pb2.WorkItem, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text_delta", "result", "logprobs")
    TEXT_DELTA_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text_delta: str
    result: _inference_service_pb2.InferResult
    logprobs: _containers.RepeatedCompositeFieldContainer[_types_pb2.TokenLogprob]
    def __init__(self, text_delta: _Optional[str] = ..., result: _Optional[_Union[_inference_service_pb2.InferResult, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_types_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("adapter", "to_device")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    TO_DEVICE_FIELD_NUMBER: _ClassVar[int]
    adapter: _work_pb2.AdapterRef
    to_device: bool
    def __init__(self, adapter: _Optional[_Union[_work_pb2.AdapterRef, _Mapping]] = ..., to_device: _Optional[bool] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ("already_loaded",)
    ALREADY_LOADED_FIELD_NUMBER: _ClassVar[int]
    already_loaded: bool
    def __init__(self, already_loaded: _Optional[bool] = ...) -> None: ...

class OffloadAdapterRequest(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: _work_pb2.AdapterRef
    def __init__(self, adapter: _Optional[_Union[_work_pb2.AdapterRef, _Mapping]] = ...) -> None: ...

class OffloadAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SetModeRequest(_message.Message):
    __slots__ = ("mode", "merged_adapter")
    MODE_FIELD_NUMBER: _ClassVar[int]
    MERGED_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    mode: _types_pb2.InferenceMode
    merged_adapter: _work_pb2.AdapterRef
    def __init__(self, mode: _Optional[_Union[_types_pb2.InferenceMode, str]] = ..., merged_adapter: _Optional[_Union[_work_pb2.AdapterRef, _Mapping]] = ...) -> None: ...

class SetModeResponse(_message.Message):
    __slots__ = ("switch_ms",)
    SWITCH_MS_FIELD_NUMBER: _ClassVar[int]
    switch_ms: float
    def __init__(self, switch_ms: _Optional[float] = ...) -> None: ...

class MergeRequest(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: _work_pb2.AdapterRef
    def __init__(self, adapter: _Optional[_Union[_work_pb2.AdapterRef, _Mapping]] = ...) -> None: ...

class MergeResponse(_message.Message):
    __slots__ = ("switch_ms", "already_merged")
    SWITCH_MS_FIELD_NUMBER: _ClassVar[int]
    ALREADY_MERGED_FIELD_NUMBER: _ClassVar[int]
    switch_ms: float
    already_merged: bool
    def __init__(self, switch_ms: _Optional[float] = ..., already_merged: _Optional[bool] = ...) -> None: ...

class UnmergeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UnmergeResponse(_message.Message):
    __slots__ = ("switch_ms", "already_unmerged")
    SWITCH_MS_FIELD_NUMBER: _ClassVar[int]
    ALREADY_UNMERGED_FIELD_NUMBER: _ClassVar[int]
    switch_ms: float
    already_unmerged: bool
    def __init__(self, switch_ms: _Optional[float] = ..., already_unmerged: _Optional[bool] = ...) -> None: ...

class SwitchRequest(_message.Message):
    __slots__ = ("from_adapter", "to_adapter")
    FROM_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    TO_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    from_adapter: _work_pb2.AdapterRef
    to_adapter: _work_pb2.AdapterRef
    def __init__(self, from_adapter: _Optional[_Union[_work_pb2.AdapterRef, _Mapping]] = ..., to_adapter: _Optional[_Union[_work_pb2.AdapterRef, _Mapping]] = ...) -> None: ...

class SwitchResponse(_message.Message):
    __slots__ = ("switch_ms", "already_switched", "mode")
    SWITCH_MS_FIELD_NUMBER: _ClassVar[int]
    ALREADY_SWITCHED_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    switch_ms: float
    already_switched: bool
    mode: _types_pb2.InferenceMode
    def __init__(self, switch_ms: _Optional[float] = ..., already_switched: _Optional[bool] = ..., mode: _Optional[_Union[_types_pb2.InferenceMode, str]] = ...) -> None: ...

class GetWorkerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetWorkerStatusResponse(_message.Message):
    __slots__ = ("status", "step_times", "decode_graphs", "prefill_graphs")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    STEP_TIMES_FIELD_NUMBER: _ClassVar[int]
    DECODE_GRAPHS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_GRAPHS_FIELD_NUMBER: _ClassVar[int]
    status: _admin_service_pb2.WorkerStatus
    step_times: WorkerStepTimes
    decode_graphs: WorkerDecodeGraphs
    prefill_graphs: WorkerDecodeGraphs
    def __init__(self, status: _Optional[_Union[_admin_service_pb2.WorkerStatus, _Mapping]] = ..., step_times: _Optional[_Union[WorkerStepTimes, _Mapping]] = ..., decode_graphs: _Optional[_Union[WorkerDecodeGraphs, _Mapping]] = ..., prefill_graphs: _Optional[_Union[WorkerDecodeGraphs, _Mapping]] = ...) -> None: ...

class WorkerDecodeGraphs(_message.Message):
    __slots__ = ("static_steps", "replays", "captures", "new_keys", "eager_steps", "capture_failures", "reference_steps")
    STATIC_STEPS_FIELD_NUMBER: _ClassVar[int]
    REPLAYS_FIELD_NUMBER: _ClassVar[int]
    CAPTURES_FIELD_NUMBER: _ClassVar[int]
    NEW_KEYS_FIELD_NUMBER: _ClassVar[int]
    EAGER_STEPS_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_STEPS_FIELD_NUMBER: _ClassVar[int]
    static_steps: int
    replays: int
    captures: int
    new_keys: int
    eager_steps: int
    capture_failures: int
    reference_steps: int
    def __init__(self, static_steps: _Optional[int] = ..., replays: _Optional[int] = ..., captures: _Optional[int] = ..., new_keys: _Optional[int] = ..., eager_steps: _Optional[int] = ..., capture_failures: _Optional[int] = ..., reference_steps: _Optional[int] = ...) -> None: ...

class WorkerStepTimes(_message.Message):
    __slots__ = ("steps", "decode_steps", "prefill_steps", "decode_step_ms_p50", "decode_step_ms_p90", "prefill_step_ms_p50", "prefill_step_ms_p90")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_STEPS_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_MS_P50_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_MS_P90_FIELD_NUMBER: _ClassVar[int]
    PREFILL_STEP_MS_P50_FIELD_NUMBER: _ClassVar[int]
    PREFILL_STEP_MS_P90_FIELD_NUMBER: _ClassVar[int]
    steps: int
    decode_steps: int
    prefill_steps: int
    decode_step_ms_p50: float
    decode_step_ms_p90: float
    prefill_step_ms_p50: float
    prefill_step_ms_p90: float
    def __init__(self, steps: _Optional[int] = ..., decode_steps: _Optional[int] = ..., prefill_steps: _Optional[int] = ..., decode_step_ms_p50: _Optional[float] = ..., decode_step_ms_p90: _Optional[float] = ..., prefill_step_ms_p50: _Optional[float] = ..., prefill_step_ms_p90: _Optional[float] = ...) -> None: ...

class WatchWorkerStatusRequest(_message.Message):
    __slots__ = ("interval_ms",)
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    interval_ms: int
    def __init__(self, interval_ms: _Optional[int] = ...) -> None: ...

class WatchWorkerStatusResponse(_message.Message):
    __slots__ = ("status", "step_times")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    STEP_TIMES_FIELD_NUMBER: _ClassVar[int]
    status: _admin_service_pb2.WorkerStatus
    step_times: WorkerStepTimes
    def __init__(self, status: _Optional[_Union[_admin_service_pb2.WorkerStatus, _Mapping]] = ..., step_times: _Optional[_Union[WorkerStepTimes, _Mapping]] = ...) -> None: ...
