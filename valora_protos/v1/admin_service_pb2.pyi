from google.protobuf import field_mask_pb2 as _field_mask_pb2
from valora_protos.v1 import resources_pb2 as _resources_pb2
from valora_protos.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CreateAdapterRequest(_message.Message):
    __slots__ = ("adapter_id", "description", "request_id")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    description: str
    request_id: str
    def __init__(self, adapter_id: _Optional[str] = ..., description: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class CreateAdapterResponse(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: _resources_pb2.Adapter
    def __init__(self, adapter: _Optional[_Union[_resources_pb2.Adapter, _Mapping]] = ...) -> None: ...

class GetAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class GetAdapterResponse(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: _resources_pb2.Adapter
    def __init__(self, adapter: _Optional[_Union[_resources_pb2.Adapter, _Mapping]] = ...) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("adapters", "next_page_token")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[_resources_pb2.Adapter]
    next_page_token: str
    def __init__(self, adapters: _Optional[_Iterable[_Union[_resources_pb2.Adapter, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class DeleteAdapterRequest(_message.Message):
    __slots__ = ("name", "etag")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ETAG_FIELD_NUMBER: _ClassVar[int]
    name: str
    etag: str
    def __init__(self, name: _Optional[str] = ..., etag: _Optional[str] = ...) -> None: ...

class DeleteAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UploadAdapterVersionRequest(_message.Message):
    __slots__ = ("metadata", "chunk")
    METADATA_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    metadata: UploadAdapterVersionMetadata
    chunk: bytes
    def __init__(self, metadata: _Optional[_Union[UploadAdapterVersionMetadata, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class UploadAdapterVersionMetadata(_message.Message):
    __slots__ = ("parent", "adapter_config_json", "sha256", "request_id", "heads")
    PARENT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HEADS_FIELD_NUMBER: _ClassVar[int]
    parent: str
    adapter_config_json: str
    sha256: str
    request_id: str
    heads: _containers.RepeatedCompositeFieldContainer[_resources_pb2.TaskHead]
    def __init__(self, parent: _Optional[str] = ..., adapter_config_json: _Optional[str] = ..., sha256: _Optional[str] = ..., request_id: _Optional[str] = ..., heads: _Optional[_Iterable[_Union[_resources_pb2.TaskHead, _Mapping]]] = ...) -> None: ...

class UploadAdapterVersionResponse(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: _resources_pb2.AdapterVersion
    def __init__(self, version: _Optional[_Union[_resources_pb2.AdapterVersion, _Mapping]] = ...) -> None: ...

class GetAdapterVersionRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class GetAdapterVersionResponse(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: _resources_pb2.AdapterVersion
    def __init__(self, version: _Optional[_Union[_resources_pb2.AdapterVersion, _Mapping]] = ...) -> None: ...

class ListAdapterVersionsRequest(_message.Message):
    __slots__ = ("parent", "page_size", "page_token")
    PARENT_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    parent: str
    page_size: int
    page_token: str
    def __init__(self, parent: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListAdapterVersionsResponse(_message.Message):
    __slots__ = ("versions", "next_page_token")
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedCompositeFieldContainer[_resources_pb2.AdapterVersion]
    next_page_token: str
    def __init__(self, versions: _Optional[_Iterable[_Union[_resources_pb2.AdapterVersion, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class DeleteAdapterVersionRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteAdapterVersionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SetAliasRequest(_message.Message):
    __slots__ = ("adapter", "alias", "version", "etag")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    ALIAS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ETAG_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    alias: str
    version: str
    etag: str
    def __init__(self, adapter: _Optional[str] = ..., alias: _Optional[str] = ..., version: _Optional[str] = ..., etag: _Optional[str] = ...) -> None: ...

class SetAliasResponse(_message.Message):
    __slots__ = ("alias", "version", "etag")
    ALIAS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ETAG_FIELD_NUMBER: _ClassVar[int]
    alias: str
    version: str
    etag: str
    def __init__(self, alias: _Optional[str] = ..., version: _Optional[str] = ..., etag: _Optional[str] = ...) -> None: ...

class DeleteAliasRequest(_message.Message):
    __slots__ = ("adapter", "alias")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    ALIAS_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    alias: str
    def __init__(self, adapter: _Optional[str] = ..., alias: _Optional[str] = ...) -> None: ...

class DeleteAliasResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CreateTaskRequest(_message.Message):
    __slots__ = ("task_id", "task")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    task: _resources_pb2.Task
    def __init__(self, task_id: _Optional[str] = ..., task: _Optional[_Union[_resources_pb2.Task, _Mapping]] = ...) -> None: ...

class CreateTaskResponse(_message.Message):
    __slots__ = ("task",)
    TASK_FIELD_NUMBER: _ClassVar[int]
    task: _resources_pb2.Task
    def __init__(self, task: _Optional[_Union[_resources_pb2.Task, _Mapping]] = ...) -> None: ...

class GetTaskRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class GetTaskResponse(_message.Message):
    __slots__ = ("task",)
    TASK_FIELD_NUMBER: _ClassVar[int]
    task: _resources_pb2.Task
    def __init__(self, task: _Optional[_Union[_resources_pb2.Task, _Mapping]] = ...) -> None: ...

class ListTasksRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListTasksResponse(_message.Message):
    __slots__ = ("tasks", "next_page_token")
    TASKS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    tasks: _containers.RepeatedCompositeFieldContainer[_resources_pb2.Task]
    next_page_token: str
    def __init__(self, tasks: _Optional[_Iterable[_Union[_resources_pb2.Task, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class UpdateTaskRequest(_message.Message):
    __slots__ = ("task", "update_mask", "etag")
    TASK_FIELD_NUMBER: _ClassVar[int]
    UPDATE_MASK_FIELD_NUMBER: _ClassVar[int]
    ETAG_FIELD_NUMBER: _ClassVar[int]
    task: _resources_pb2.Task
    update_mask: _field_mask_pb2.FieldMask
    etag: str
    def __init__(self, task: _Optional[_Union[_resources_pb2.Task, _Mapping]] = ..., update_mask: _Optional[_Union[_field_mask_pb2.FieldMask, _Mapping]] = ..., etag: _Optional[str] = ...) -> None: ...

class UpdateTaskResponse(_message.Message):
    __slots__ = ("task",)
    TASK_FIELD_NUMBER: _ClassVar[int]
    task: _resources_pb2.Task
    def __init__(self, task: _Optional[_Union[_resources_pb2.Task, _Mapping]] = ...) -> None: ...

class DeleteTaskRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteTaskResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetClusterStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("address", "healthy", "mode", "merged_adapter", "resident_adapters", "host_adapters", "running_requests", "max_batch_size", "device", "kv_cache_bytes", "waiting_requests", "last_step_ms", "image_cache_hits", "image_cache_misses", "decode_step_ms_p50", "prefill_step_ms_p50")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    MERGED_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    HOST_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_MS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_CACHE_MISSES_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_MS_P50_FIELD_NUMBER: _ClassVar[int]
    PREFILL_STEP_MS_P50_FIELD_NUMBER: _ClassVar[int]
    address: str
    healthy: bool
    mode: _types_pb2.InferenceMode
    merged_adapter: str
    resident_adapters: _containers.RepeatedScalarFieldContainer[str]
    host_adapters: _containers.RepeatedScalarFieldContainer[str]
    running_requests: int
    max_batch_size: int
    device: str
    kv_cache_bytes: int
    waiting_requests: int
    last_step_ms: float
    image_cache_hits: int
    image_cache_misses: int
    decode_step_ms_p50: float
    prefill_step_ms_p50: float
    def __init__(self, address: _Optional[str] = ..., healthy: _Optional[bool] = ..., mode: _Optional[_Union[_types_pb2.InferenceMode, str]] = ..., merged_adapter: _Optional[str] = ..., resident_adapters: _Optional[_Iterable[str]] = ..., host_adapters: _Optional[_Iterable[str]] = ..., running_requests: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., device: _Optional[str] = ..., kv_cache_bytes: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., last_step_ms: _Optional[float] = ..., image_cache_hits: _Optional[int] = ..., image_cache_misses: _Optional[int] = ..., decode_step_ms_p50: _Optional[float] = ..., prefill_step_ms_p50: _Optional[float] = ...) -> None: ...

class GetClusterStatusResponse(_message.Message):
    __slots__ = ("workers", "queued_requests")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    queued_requests: int
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., queued_requests: _Optional[int] = ...) -> None: ...

class CreateGenerationJobRequest(_message.Message):
    __slots__ = ("job_id", "job", "request_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    job: _resources_pb2.GenerationJob
    request_id: str
    def __init__(self, job_id: _Optional[str] = ..., job: _Optional[_Union[_resources_pb2.GenerationJob, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class CreateGenerationJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: _resources_pb2.GenerationJob
    def __init__(self, job: _Optional[_Union[_resources_pb2.GenerationJob, _Mapping]] = ...) -> None: ...

class GetGenerationJobRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class GetGenerationJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: _resources_pb2.GenerationJob
    def __init__(self, job: _Optional[_Union[_resources_pb2.GenerationJob, _Mapping]] = ...) -> None: ...

class ListGenerationJobsRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListGenerationJobsResponse(_message.Message):
    __slots__ = ("jobs", "next_page_token")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[_resources_pb2.GenerationJob]
    next_page_token: str
    def __init__(self, jobs: _Optional[_Iterable[_Union[_resources_pb2.GenerationJob, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class CancelGenerationJobRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UploadDatasetRequest(_message.Message):
    __slots__ = ("metadata", "chunk")
    METADATA_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    metadata: UploadDatasetMetadata
    chunk: bytes
    def __init__(self, metadata: _Optional[_Union[UploadDatasetMetadata, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class UploadDatasetMetadata(_message.Message):
    __slots__ = ("sha256",)
    SHA256_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    def __init__(self, sha256: _Optional[str] = ...) -> None: ...

class UploadDatasetResponse(_message.Message):
    __slots__ = ("dataset",)
    DATASET_FIELD_NUMBER: _ClassVar[int]
    dataset: _resources_pb2.Dataset
    def __init__(self, dataset: _Optional[_Union[_resources_pb2.Dataset, _Mapping]] = ...) -> None: ...

class CancelGenerationJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: _resources_pb2.GenerationJob
    def __init__(self, job: _Optional[_Union[_resources_pb2.GenerationJob, _Mapping]] = ...) -> None: ...
