import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from valora_protos.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AdapterVersionState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ADAPTER_VERSION_STATE_UNSPECIFIED: _ClassVar[AdapterVersionState]
    ADAPTER_VERSION_STATE_PENDING: _ClassVar[AdapterVersionState]
    ADAPTER_VERSION_STATE_READY: _ClassVar[AdapterVersionState]
    ADAPTER_VERSION_STATE_RETIRED: _ClassVar[AdapterVersionState]

class GenerationJobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GENERATION_JOB_STATE_UNSPECIFIED: _ClassVar[GenerationJobState]
    GENERATION_JOB_STATE_PENDING: _ClassVar[GenerationJobState]
    GENERATION_JOB_STATE_RUNNING: _ClassVar[GenerationJobState]
    GENERATION_JOB_STATE_SUCCEEDED: _ClassVar[GenerationJobState]
    GENERATION_JOB_STATE_FAILED: _ClassVar[GenerationJobState]
    GENERATION_JOB_STATE_CANCELLED: _ClassVar[GenerationJobState]
ADAPTER_VERSION_STATE_UNSPECIFIED: AdapterVersionState
ADAPTER_VERSION_STATE_PENDING: AdapterVersionState
ADAPTER_VERSION_STATE_READY: AdapterVersionState
ADAPTER_VERSION_STATE_RETIRED: AdapterVersionState
GENERATION_JOB_STATE_UNSPECIFIED: GenerationJobState
GENERATION_JOB_STATE_PENDING: GenerationJobState
GENERATION_JOB_STATE_RUNNING: GenerationJobState
GENERATION_JOB_STATE_SUCCEEDED: GenerationJobState
GENERATION_JOB_STATE_FAILED: GenerationJobState
GENERATION_JOB_STATE_CANCELLED: GenerationJobState

class Adapter(_message.Message):
    __slots__ = ("name", "description", "create_time", "aliases", "latest_version", "etag")
    class AliasesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    ETAG_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    create_time: _timestamp_pb2.Timestamp
    aliases: _containers.ScalarMap[str, str]
    latest_version: int
    etag: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., aliases: _Optional[_Mapping[str, str]] = ..., latest_version: _Optional[int] = ..., etag: _Optional[str] = ...) -> None: ...

class AdapterVersion(_message.Message):
    __slots__ = ("name", "sha256", "rank", "lora_alpha", "target_modules", "base_model", "size_bytes", "state", "create_time", "heads")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    LORA_ALPHA_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    HEADS_FIELD_NUMBER: _ClassVar[int]
    name: str
    sha256: str
    rank: int
    lora_alpha: float
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    base_model: str
    size_bytes: int
    state: AdapterVersionState
    create_time: _timestamp_pb2.Timestamp
    heads: _containers.RepeatedCompositeFieldContainer[TaskHead]
    def __init__(self, name: _Optional[str] = ..., sha256: _Optional[str] = ..., rank: _Optional[int] = ..., lora_alpha: _Optional[float] = ..., target_modules: _Optional[_Iterable[str]] = ..., base_model: _Optional[str] = ..., size_bytes: _Optional[int] = ..., state: _Optional[_Union[AdapterVersionState, str]] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., heads: _Optional[_Iterable[_Union[TaskHead, _Mapping]]] = ...) -> None: ...

class TaskHead(_message.Message):
    __slots__ = ("name", "labels")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    name: str
    labels: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., labels: _Optional[_Iterable[str]] = ...) -> None: ...

class Task(_message.Message):
    __slots__ = ("name", "adapter", "head", "description", "accuracy_threshold", "measured_accuracy", "create_time", "slo_ms", "slo_class", "etag", "adapter_release_fraction", "adapter_release_rule")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    ACCURACY_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    MEASURED_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    SLO_MS_FIELD_NUMBER: _ClassVar[int]
    SLO_CLASS_FIELD_NUMBER: _ClassVar[int]
    ETAG_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_RELEASE_FRACTION_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_RELEASE_RULE_FIELD_NUMBER: _ClassVar[int]
    name: str
    adapter: str
    head: str
    description: str
    accuracy_threshold: float
    measured_accuracy: float
    create_time: _timestamp_pb2.Timestamp
    slo_ms: float
    slo_class: str
    etag: str
    adapter_release_fraction: float
    adapter_release_rule: _types_pb2.AdapterReleaseRule
    def __init__(self, name: _Optional[str] = ..., adapter: _Optional[str] = ..., head: _Optional[str] = ..., description: _Optional[str] = ..., accuracy_threshold: _Optional[float] = ..., measured_accuracy: _Optional[float] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., slo_ms: _Optional[float] = ..., slo_class: _Optional[str] = ..., etag: _Optional[str] = ..., adapter_release_fraction: _Optional[float] = ..., adapter_release_rule: _Optional[_Union[_types_pb2.AdapterReleaseRule, str]] = ...) -> None: ...

class GenerationSource(_message.Message):
    __slots__ = ("task", "accuracy_threshold", "dataset")
    TASK_FIELD_NUMBER: _ClassVar[int]
    ACCURACY_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    task: str
    accuracy_threshold: float
    dataset: str
    def __init__(self, task: _Optional[str] = ..., accuracy_threshold: _Optional[float] = ..., dataset: _Optional[str] = ...) -> None: ...

class Dataset(_message.Message):
    __slots__ = ("name", "sha256", "size_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    sha256: str
    size_bytes: int
    def __init__(self, name: _Optional[str] = ..., sha256: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class GenerationTaskResult(_message.Message):
    __slots__ = ("task", "adapter_version", "accuracy_threshold", "measured_accuracy")
    TASK_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    ACCURACY_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    MEASURED_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    task: str
    adapter_version: str
    accuracy_threshold: float
    measured_accuracy: float
    def __init__(self, task: _Optional[str] = ..., adapter_version: _Optional[str] = ..., accuracy_threshold: _Optional[float] = ..., measured_accuracy: _Optional[float] = ...) -> None: ...

class GenerationProbePair(_message.Message):
    __slots__ = ("first", "second", "first_accuracy", "second_accuracy", "first_drop", "second_drop")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    SECOND_FIELD_NUMBER: _ClassVar[int]
    FIRST_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    SECOND_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    FIRST_DROP_FIELD_NUMBER: _ClassVar[int]
    SECOND_DROP_FIELD_NUMBER: _ClassVar[int]
    first: str
    second: str
    first_accuracy: float
    second_accuracy: float
    first_drop: float
    second_drop: float
    def __init__(self, first: _Optional[str] = ..., second: _Optional[str] = ..., first_accuracy: _Optional[float] = ..., second_accuracy: _Optional[float] = ..., first_drop: _Optional[float] = ..., second_drop: _Optional[float] = ...) -> None: ...

class GenerationPlannedAdapter(_message.Message):
    __slots__ = ("tasks", "predicted_margins")
    class PredictedMarginsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TASKS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_MARGINS_FIELD_NUMBER: _ClassVar[int]
    tasks: _containers.RepeatedScalarFieldContainer[str]
    predicted_margins: _containers.ScalarMap[str, float]
    def __init__(self, tasks: _Optional[_Iterable[str]] = ..., predicted_margins: _Optional[_Mapping[str, float]] = ...) -> None: ...

class GenerationProbe(_message.Message):
    __slots__ = ("given_order", "alone", "pairs", "planned", "rule", "epochs", "batches_per_epoch", "batch_size", "trainings", "seconds")
    class AloneEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    GIVEN_ORDER_FIELD_NUMBER: _ClassVar[int]
    ALONE_FIELD_NUMBER: _ClassVar[int]
    PAIRS_FIELD_NUMBER: _ClassVar[int]
    PLANNED_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_PER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    TRAININGS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    given_order: _containers.RepeatedScalarFieldContainer[str]
    alone: _containers.ScalarMap[str, float]
    pairs: _containers.RepeatedCompositeFieldContainer[GenerationProbePair]
    planned: _containers.RepeatedCompositeFieldContainer[GenerationPlannedAdapter]
    rule: str
    epochs: int
    batches_per_epoch: int
    batch_size: int
    trainings: int
    seconds: float
    def __init__(self, given_order: _Optional[_Iterable[str]] = ..., alone: _Optional[_Mapping[str, float]] = ..., pairs: _Optional[_Iterable[_Union[GenerationProbePair, _Mapping]]] = ..., planned: _Optional[_Iterable[_Union[GenerationPlannedAdapter, _Mapping]]] = ..., rule: _Optional[str] = ..., epochs: _Optional[int] = ..., batches_per_epoch: _Optional[int] = ..., batch_size: _Optional[int] = ..., trainings: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class GenerationJobResult(_message.Message):
    __slots__ = ("adapter_versions", "tasks", "fused_order", "probe")
    ADAPTER_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    FUSED_ORDER_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    adapter_versions: _containers.RepeatedScalarFieldContainer[str]
    tasks: _containers.RepeatedCompositeFieldContainer[GenerationTaskResult]
    fused_order: _containers.RepeatedScalarFieldContainer[str]
    probe: GenerationProbe
    def __init__(self, adapter_versions: _Optional[_Iterable[str]] = ..., tasks: _Optional[_Iterable[_Union[GenerationTaskResult, _Mapping]]] = ..., fused_order: _Optional[_Iterable[str]] = ..., probe: _Optional[_Union[GenerationProbe, _Mapping]] = ...) -> None: ...

class GenerationJob(_message.Message):
    __slots__ = ("name", "base_model", "sources", "rank", "epochs", "adapter_prefix", "state", "progress", "message", "result", "error", "create_time", "update_time", "split_limit", "fusion_order")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_PREFIX_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    UPDATE_TIME_FIELD_NUMBER: _ClassVar[int]
    SPLIT_LIMIT_FIELD_NUMBER: _ClassVar[int]
    FUSION_ORDER_FIELD_NUMBER: _ClassVar[int]
    name: str
    base_model: str
    sources: _containers.RepeatedCompositeFieldContainer[GenerationSource]
    rank: int
    epochs: int
    adapter_prefix: str
    state: GenerationJobState
    progress: float
    message: str
    result: GenerationJobResult
    error: str
    create_time: _timestamp_pb2.Timestamp
    update_time: _timestamp_pb2.Timestamp
    split_limit: int
    fusion_order: str
    def __init__(self, name: _Optional[str] = ..., base_model: _Optional[str] = ..., sources: _Optional[_Iterable[_Union[GenerationSource, _Mapping]]] = ..., rank: _Optional[int] = ..., epochs: _Optional[int] = ..., adapter_prefix: _Optional[str] = ..., state: _Optional[_Union[GenerationJobState, str]] = ..., progress: _Optional[float] = ..., message: _Optional[str] = ..., result: _Optional[_Union[GenerationJobResult, _Mapping]] = ..., error: _Optional[str] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., update_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., split_limit: _Optional[int] = ..., fusion_order: _Optional[str] = ...) -> None: ...
