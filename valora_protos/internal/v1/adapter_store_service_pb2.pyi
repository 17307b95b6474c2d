import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from valora_protos.v1 import resources_pb2 as _resources_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ResolveReferenceRequest(_message.Message):
    __slots__ = ("reference",)
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    reference: str
    def __init__(self, reference: _Optional[str] = ...) -> None: ...

class ResolveReferenceResponse(_message.Message):
    __slots__ = ("version", "task")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    version: _resources_pb2.AdapterVersion
    task: _resources_pb2.Task
    def __init__(self, version: _Optional[_Union[_resources_pb2.AdapterVersion, _Mapping]] = ..., task: _Optional[_Union[_resources_pb2.Task, _Mapping]] = ...) -> None: ...

class FetchAdapterRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: str
    def __init__(self, version: _Optional[str] = ...) -> None: ...

class FetchAdapterMetadata(_message.Message):
    __slots__ = ("version", "adapter_config_json")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    version: _resources_pb2.AdapterVersion
    adapter_config_json: str
    def __init__(self, version: _Optional[_Union[_resources_pb2.AdapterVersion, _Mapping]] = ..., adapter_config_json: _Optional[str] = ...) -> None: ...

class FetchAdapterResponse(_message.Message):
    __slots__ = ("metadata", "chunk")
    METADATA_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    metadata: FetchAdapterMetadata
    chunk: bytes
    def __init__(self, metadata: _Optional[_Union[FetchAdapterMetadata, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class FetchDatasetRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class FetchDatasetResponse(_message.Message):
    __slots__ = ("chunk",)
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    chunk: bytes
    def __init__(self, chunk: _Optional[bytes] = ...) -> None: ...

class ClaimGenerationJobRequest(_message.Message):
    __slots__ = ("runner",)
    RUNNER_FIELD_NUMBER: _ClassVar[int]
    runner: str
    def __init__(self, runner: _Optional[str] = ...) -> None: ...

class ClaimGenerationJobResponse(_message.Message):
    __slots__ = ("job", "lease_id", "lease_duration", "attempt", "max_attempts")
    JOB_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_DURATION_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    MAX_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    job: _resources_pb2.GenerationJob
    lease_id: str
    lease_duration: _duration_pb2.Duration
    attempt: int
    max_attempts: int
    def __init__(self, job: _Optional[_Union[_resources_pb2.GenerationJob, _Mapping]] = ..., lease_id: _Optional[str] = ..., lease_duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., attempt: _Optional[int] = ..., max_attempts: _Optional[int] = ...) -> None: ...

class UpdateGenerationJobRequest(_message.Message):
    __slots__ = ("name", "progress", "message", "state", "result", "error", "lease_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    progress: float
    message: str
    state: _resources_pb2.GenerationJobState
    result: _resources_pb2.GenerationJobResult
    error: str
    lease_id: str
    def __init__(self, name: _Optional[str] = ..., progress: _Optional[float] = ..., message: _Optional[str] = ..., state: _Optional[_Union[_resources_pb2.GenerationJobState, str]] = ..., result: _Optional[_Union[_resources_pb2.GenerationJobResult, _Mapping]] = ..., error: _Optional[str] = ..., lease_id: _Optional[str] = ...) -> None: ...

class UpdateGenerationJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: _resources_pb2.GenerationJob
    def __init__(self, job: _Optional[_Union[_resources_pb2.GenerationJob, _Mapping]] = ...) -> None: ...

class TileTable(_message.Message):
    __slots__ = ("gpu_name", "gpu_arch", "dtype", "table_json", "sha256", "create_time", "update_time")
    GPU_NAME_FIELD_NUMBER: _ClassVar[int]
    GPU_ARCH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TABLE_JSON_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    UPDATE_TIME_FIELD_NUMBER: _ClassVar[int]
    gpu_name: str
    gpu_arch: str
    dtype: str
    table_json: str
    sha256: str
    create_time: _timestamp_pb2.Timestamp
    update_time: _timestamp_pb2.Timestamp
    def __init__(self, gpu_name: _Optional[str] = ..., gpu_arch: _Optional[str] = ..., dtype: _Optional[str] = ..., table_json: _Optional[str] = ..., sha256: _Optional[str] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., update_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class PutTileTableRequest(_message.Message):
    __slots__ = ("gpu_name", "gpu_arch", "dtype", "table_json")
    GPU_NAME_FIELD_NUMBER: _ClassVar[int]
    GPU_ARCH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TABLE_JSON_FIELD_NUMBER: _ClassVar[int]
    gpu_name: str
    gpu_arch: str
    dtype: str
    table_json: str
    def __init__(self, gpu_name: _Optional[str] = ..., gpu_arch: _Optional[str] = ..., dtype: _Optional[str] = ..., table_json: _Optional[str] = ...) -> None: ...

class PutTileTableResponse(_message.Message):
    __slots__ = ("table",)
    TABLE_FIELD_NUMBER: _ClassVar[int]
    table: TileTable
    def __init__(self, table: _Optional[_Union[TileTable, _Mapping]] = ...) -> None: ...

class GetTileTableRequest(_message.Message):
    __slots__ = ("gpu_name", "gpu_arch", "dtype")
    GPU_NAME_FIELD_NUMBER: _ClassVar[int]
    GPU_ARCH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    gpu_name: str
    gpu_arch: str
    dtype: str
    def __init__(self, gpu_name: _Optional[str] = ..., gpu_arch: _Optional[str] = ..., dtype: _Optional[str] = ...) -> None: ...

class GetTileTableResponse(_message.Message):
    __slots__ = ("table",)
    TABLE_FIELD_NUMBER: _ClassVar[int]
    table: TileTable
    def __init__(self, table: _Optional[_Union[TileTable, _Mapping]] = ...) -> None: ...
