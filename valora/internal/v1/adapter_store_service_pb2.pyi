from valora.v1 import resources_pb2 as _resources_pb2
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
