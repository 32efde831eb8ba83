from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TaskState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UNSPECIFIED: _ClassVar[TaskState]
    UNINITIALIZED: _ClassVar[TaskState]
    DISCONNECTED: _ClassVar[TaskState]
    CONNECTED: _ClassVar[TaskState]
    ERROR: _ClassVar[TaskState]
UNSPECIFIED: TaskState
UNINITIALIZED: TaskState
DISCONNECTED: TaskState
CONNECTED: TaskState
ERROR: TaskState

class CoordinationServiceError(_message.Message):
    __slots__ = ("is_reported_error", "source_task_id")
    IS_REPORTED_ERROR_FIELD_NUMBER: _ClassVar[int]
    SOURCE_TASK_ID_FIELD_NUMBER: _ClassVar[int]
    is_reported_error: bool
    source_task_id: int
    def __init__(self, is_reported_error: _Optional[bool] = ..., source_task_id: _Optional[int] = ...) -> None: ...

class BarrierError(_message.Message):
    __slots__ = ("barrier_id", "counter")
    BARRIER_ID_FIELD_NUMBER: _ClassVar[int]
    COUNTER_FIELD_NUMBER: _ClassVar[int]
    barrier_id: str
    counter: int
    def __init__(self, barrier_id: _Optional[str] = ..., counter: _Optional[int] = ...) -> None: ...

class Incarnations(_message.Message):
    __slots__ = ("task_id", "task_incarnation", "service_incarnation")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SERVICE_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    task_id: int
    task_incarnation: int
    service_incarnation: int
    def __init__(self, task_id: _Optional[int] = ..., task_incarnation: _Optional[int] = ..., service_incarnation: _Optional[int] = ...) -> None: ...

class ServiceMismatchError(_message.Message):
    __slots__ = ("service_incarnation",)
    SERVICE_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    service_incarnation: int
    def __init__(self, service_incarnation: _Optional[int] = ...) -> None: ...

class TaskInfo(_message.Message):
    __slots__ = ("task_id", "state", "error_code", "error_message", "error_payload", "incarnation")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    task_id: int
    state: TaskState
    error_code: int
    error_message: str
    error_payload: CoordinationServiceError
    incarnation: int
    def __init__(self, task_id: _Optional[int] = ..., state: _Optional[_Union[TaskState, str]] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ..., error_payload: _Optional[_Union[CoordinationServiceError, _Mapping]] = ..., incarnation: _Optional[int] = ...) -> None: ...

class RegisterTaskRequest(_message.Message):
    __slots__ = ("incarnation", "source_task_id")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_TASK_ID_FIELD_NUMBER: _ClassVar[int]
    incarnation: int
    source_task_id: int
    def __init__(self, incarnation: _Optional[int] = ..., source_task_id: _Optional[int] = ...) -> None: ...

class RegisterTaskResponse(_message.Message):
    __slots__ = ("service_incarnation",)
    SERVICE_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    service_incarnation: int
    def __init__(self, service_incarnation: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("incarnations", "incarnation", "source_task_id")
    INCARNATIONS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_TASK_ID_FIELD_NUMBER: _ClassVar[int]
    incarnations: Incarnations
    incarnation: int
    source_task_id: int
    def __init__(self, incarnations: _Optional[_Union[Incarnations, _Mapping]] = ..., incarnation: _Optional[int] = ..., source_task_id: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("service_incarnation",)
    SERVICE_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    service_incarnation: int
    def __init__(self, service_incarnation: _Optional[int] = ...) -> None: ...

class PollForErrorRequest(_message.Message):
    __slots__ = ("incarnations", "source_task_id")
    INCARNATIONS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_TASK_ID_FIELD_NUMBER: _ClassVar[int]
    incarnations: Incarnations
    source_task_id: int
    def __init__(self, incarnations: _Optional[_Union[Incarnations, _Mapping]] = ..., source_task_id: _Optional[int] = ...) -> None: ...

class PollForErrorResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShutdownTaskRequest(_message.Message):
    __slots__ = ("incarnations", "source_task_id")
    INCARNATIONS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_TASK_ID_FIELD_NUMBER: _ClassVar[int]
    incarnations: Incarnations
    source_task_id: int
    def __init__(self, incarnations: _Optional[_Union[Incarnations, _Mapping]] = ..., source_task_id: _Optional[int] = ...) -> None: ...

class ShutdownTaskResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchTasksRequest(_message.Message):
    __slots__ = ("incarnations", "version_number")
    INCARNATIONS_FIELD_NUMBER: _ClassVar[int]
    VERSION_NUMBER_FIELD_NUMBER: _ClassVar[int]
    incarnations: Incarnations
    version_number: int
    def __init__(self, incarnations: _Optional[_Union[Incarnations, _Mapping]] = ..., version_number: _Optional[int] = ...) -> None: ...

class WatchTasksResponse(_message.Message):
    __slots__ = ("task_state", "version_number")
    TASK_STATE_FIELD_NUMBER: _ClassVar[int]
    VERSION_NUMBER_FIELD_NUMBER: _ClassVar[int]
    task_state: _containers.RepeatedCompositeFieldContainer[TaskInfo]
    version_number: int
    def __init__(self, task_state: _Optional[_Iterable[_Union[TaskInfo, _Mapping]]] = ..., version_number: _Optional[int] = ...) -> None: ...

class KeyValueEntry(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: bytes
    def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...

class InsertKeyValueRequest(_message.Message):
    __slots__ = ("incarnations", "kv", "allow_overwrite")
    INCARNATIONS_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    ALLOW_OVERWRITE_FIELD_NUMBER: _ClassVar[int]
    incarnations: Incarnations
    kv: KeyValueEntry
    allow_overwrite: bool
    def __init__(self, incarnations: _Optional[_Union[Incarnations, _Mapping]] = ..., kv: _Optional[_Union[KeyValueEntry, _Mapping]] = ..., allow_overwrite: _Optional[bool] = ...) -> None: ...

class InsertKeyValueResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetKeyValueRequest(_message.Message):
    __slots__ = ("incarnations", "key")
    INCARNATIONS_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    incarnations: Incarnations
    key: str
    def __init__(self, incarnations: _Optional[_Union[Incarnations, _Mapping]] = ..., key: _Optional[str] = ...) -> None: ...

class GetKeyValueResponse(_message.Message):
    __slots__ = ("kv",)
    KV_FIELD_NUMBER: _ClassVar[int]
    kv: KeyValueEntry
    def __init__(self, kv: _Optional[_Union[KeyValueEntry, _Mapping]] = ...) -> None: ...

class TryGetKeyValueRequest(_message.Message):
    __slots__ = ("incarnations", "key")
    INCARNATIONS_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    incarnations: Incarnations
    key: str
    def __init__(self, incarnations: _Optional[_Union[Incarnations, _Mapping]] = ..., key: _Optional[str] = ...) -> None: ...

class TryGetKeyValueResponse(_message.Message):
    __slots__ = ("kv",)
    KV_FIELD_NUMBER: _ClassVar[int]
    kv: KeyValueEntry
    def __init__(self, kv: _Optional[_Union[KeyValueEntry, _Mapping]] = ...) -> None: ...

class IncrementKeyValueRequest(_message.Message):
    __slots__ = ("incarnations", "key", "increment")
    INCARNATIONS_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    INCREMENT_FIELD_NUMBER: _ClassVar[int]
    incarnations: Incarnations
    key: str
    increment: int
    def __init__(self, incarnations: _Optional[_Union[Incarnations, _Mapping]] = ..., key: _Optional[str] = ..., increment: _Optional[int] = ...) -> None: ...

class IncrementKeyValueResponse(_message.Message):
    __slots__ = ("kv",)
    KV_FIELD_NUMBER: _ClassVar[int]
    kv: KeyValueEntry
    def __init__(self, kv: _Optional[_Union[KeyValueEntry, _Mapping]] = ...) -> None: ...

class GetKeyValueDirRequest(_message.Message):
    __slots__ = ("incarnations", "directory_key")
    INCARNATIONS_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_KEY_FIELD_NUMBER: _ClassVar[int]
    incarnations: Incarnations
    directory_key: str
    def __init__(self, incarnations: _Optional[_Union[Incarnations, _Mapping]] = ..., directory_key: _Optional[str] = ...) -> None: ...

class GetKeyValueDirResponse(_message.Message):
    __slots__ = ("directory_key", "kv")
    DIRECTORY_KEY_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    directory_key: str
    kv: _containers.RepeatedCompositeFieldContainer[KeyValueEntry]
    def __init__(self, directory_key: _Optional[str] = ..., kv: _Optional[_Iterable[_Union[KeyValueEntry, _Mapping]]] = ...) -> None: ...

class DeleteKeyValueRequest(_message.Message):
    __slots__ = ("incarnations", "key", "is_directory")
    INCARNATIONS_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    IS_DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    incarnations: Incarnations
    key: str
    is_directory: bool
    def __init__(self, incarnations: _Optional[_Union[Incarnations, _Mapping]] = ..., key: _Optional[str] = ..., is_directory: _Optional[bool] = ...) -> None: ...

class DeleteKeyValueResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BarrierRequest(_message.Message):
    __slots__ = ("incarnations", "barrier_id", "barrier_timeout_in_ms", "task_ids", "source_task_id", "counter")
    INCARNATIONS_FIELD_NUMBER: _ClassVar[int]
    BARRIER_ID_FIELD_NUMBER: _ClassVar[int]
    BARRIER_TIMEOUT_IN_MS_FIELD_NUMBER: _ClassVar[int]
    TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_TASK_ID_FIELD_NUMBER: _ClassVar[int]
    COUNTER_FIELD_NUMBER: _ClassVar[int]
    incarnations: Incarnations
    barrier_id: str
    barrier_timeout_in_ms: int
    task_ids: _containers.RepeatedScalarFieldContainer[int]
    source_task_id: int
    counter: int
    def __init__(self, incarnations: _Optional[_Union[Incarnations, _Mapping]] = ..., barrier_id: _Optional[str] = ..., barrier_timeout_in_ms: _Optional[int] = ..., task_ids: _Optional[_Iterable[int]] = ..., source_task_id: _Optional[int] = ..., counter: _Optional[int] = ...) -> None: ...

class BarrierResponse(_message.Message):
    __slots__ = ("counter",)
    COUNTER_FIELD_NUMBER: _ClassVar[int]
    counter: int
    def __init__(self, counter: _Optional[int] = ...) -> None: ...

class CancelBarrierRequest(_message.Message):
    __slots__ = ("incarnations", "barrier_id", "counter", "source_task_id")
    INCARNATIONS_FIELD_NUMBER: _ClassVar[int]
    BARRIER_ID_FIELD_NUMBER: _ClassVar[int]
    COUNTER_FIELD_NUMBER: _ClassVar[int]
    SOURCE_TASK_ID_FIELD_NUMBER: _ClassVar[int]
    incarnations: Incarnations
    barrier_id: str
    counter: int
    source_task_id: int
    def __init__(self, incarnations: _Optional[_Union[Incarnations, _Mapping]] = ..., barrier_id: _Optional[str] = ..., counter: _Optional[int] = ..., source_task_id: _Optional[int] = ...) -> None: ...

class CancelBarrierResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetAliveTasksRequest(_message.Message):
    __slots__ = ("incarnations", "requesting_task_id", "task_ids")
    INCARNATIONS_FIELD_NUMBER: _ClassVar[int]
    REQUESTING_TASK_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    incarnations: Incarnations
    requesting_task_id: int
    task_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, incarnations: _Optional[_Union[Incarnations, _Mapping]] = ..., requesting_task_id: _Optional[int] = ..., task_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GetAliveTasksResponse(_message.Message):
    __slots__ = ("alive_task_ids", "incarnations")
    ALIVE_TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    INCARNATIONS_FIELD_NUMBER: _ClassVar[int]
    alive_task_ids: _containers.RepeatedScalarFieldContainer[int]
    incarnations: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, alive_task_ids: _Optional[_Iterable[int]] = ..., incarnations: _Optional[_Iterable[int]] = ...) -> None: ...
