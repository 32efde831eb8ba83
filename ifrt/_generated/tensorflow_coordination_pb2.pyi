from google.protobuf import any_pb2 as _any_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CoordinatedTaskState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TASKSTATE_UNSPECIFIED: _ClassVar[CoordinatedTaskState]
    TASKSTATE_UNINITIALIZED: _ClassVar[CoordinatedTaskState]
    TASKSTATE_DISCONNECTED: _ClassVar[CoordinatedTaskState]
    TASKSTATE_CONNECTED: _ClassVar[CoordinatedTaskState]
    TASKSTATE_ERROR: _ClassVar[CoordinatedTaskState]
TASKSTATE_UNSPECIFIED: CoordinatedTaskState
TASKSTATE_UNINITIALIZED: CoordinatedTaskState
TASKSTATE_DISCONNECTED: CoordinatedTaskState
TASKSTATE_CONNECTED: CoordinatedTaskState
TASKSTATE_ERROR: CoordinatedTaskState

class CoordinatedTask(_message.Message):
    __slots__ = ("job_name", "task_id", "recoverable")
    JOB_NAME_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    RECOVERABLE_FIELD_NUMBER: _ClassVar[int]
    job_name: str
    task_id: int
    recoverable: bool
    def __init__(self, job_name: _Optional[str] = ..., task_id: _Optional[int] = ..., recoverable: _Optional[bool] = ...) -> None: ...

class CoordinationServiceError(_message.Message):
    __slots__ = ("is_reported_error", "source_task")
    IS_REPORTED_ERROR_FIELD_NUMBER: _ClassVar[int]
    SOURCE_TASK_FIELD_NUMBER: _ClassVar[int]
    is_reported_error: bool
    source_task: CoordinatedTask
    def __init__(self, is_reported_error: _Optional[bool] = ..., source_task: _Optional[_Union[CoordinatedTask, _Mapping]] = ...) -> None: ...

class BarrierError(_message.Message):
    __slots__ = ("barrier_id", "counter")
    BARRIER_ID_FIELD_NUMBER: _ClassVar[int]
    COUNTER_FIELD_NUMBER: _ClassVar[int]
    barrier_id: str
    counter: int
    def __init__(self, barrier_id: _Optional[str] = ..., counter: _Optional[int] = ...) -> None: ...

class CoordinatedTaskStateInfo(_message.Message):
    __slots__ = ("task", "state", "error_code", "error_message", "error_payload", "incarnation")
    TASK_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    task: CoordinatedTask
    state: CoordinatedTaskState
    error_code: int
    error_message: str
    error_payload: CoordinationServiceError
    incarnation: int
    def __init__(self, task: _Optional[_Union[CoordinatedTask, _Mapping]] = ..., state: _Optional[_Union[CoordinatedTaskState, str]] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ..., error_payload: _Optional[_Union[CoordinationServiceError, _Mapping]] = ..., incarnation: _Optional[int] = ...) -> None: ...

class DeviceInfo(_message.Message):
    __slots__ = ("device",)
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    device: _containers.RepeatedCompositeFieldContainer[_any_pb2.Any]
    def __init__(self, device: _Optional[_Iterable[_Union[_any_pb2.Any, _Mapping]]] = ...) -> None: ...

class RegisterTaskRequest(_message.Message):
    __slots__ = ("incarnation", "source_task")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_TASK_FIELD_NUMBER: _ClassVar[int]
    incarnation: int
    source_task: CoordinatedTask
    def __init__(self, incarnation: _Optional[int] = ..., source_task: _Optional[_Union[CoordinatedTask, _Mapping]] = ...) -> None: ...

class RegisterTaskResponse(_message.Message):
    __slots__ = ("leader_incarnation",)
    LEADER_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    leader_incarnation: int
    def __init__(self, leader_incarnation: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("incarnation", "source_task")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_TASK_FIELD_NUMBER: _ClassVar[int]
    incarnation: int
    source_task: CoordinatedTask
    def __init__(self, incarnation: _Optional[int] = ..., source_task: _Optional[_Union[CoordinatedTask, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("leader_incarnation",)
    LEADER_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    leader_incarnation: int
    def __init__(self, leader_incarnation: _Optional[int] = ...) -> None: ...

class PollForErrorRequest(_message.Message):
    __slots__ = ("source_task",)
    SOURCE_TASK_FIELD_NUMBER: _ClassVar[int]
    source_task: CoordinatedTask
    def __init__(self, source_task: _Optional[_Union[CoordinatedTask, _Mapping]] = ...) -> None: ...

class PollForErrorResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WaitForAllTasksRequest(_message.Message):
    __slots__ = ("source_task", "device_info")
    SOURCE_TASK_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INFO_FIELD_NUMBER: _ClassVar[int]
    source_task: CoordinatedTask
    device_info: DeviceInfo
    def __init__(self, source_task: _Optional[_Union[CoordinatedTask, _Mapping]] = ..., device_info: _Optional[_Union[DeviceInfo, _Mapping]] = ...) -> None: ...

class WaitForAllTasksResponse(_message.Message):
    __slots__ = ("leader_incarnation", "device_info")
    LEADER_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INFO_FIELD_NUMBER: _ClassVar[int]
    leader_incarnation: int
    device_info: DeviceInfo
    def __init__(self, leader_incarnation: _Optional[int] = ..., device_info: _Optional[_Union[DeviceInfo, _Mapping]] = ...) -> None: ...

class ShutdownTaskRequest(_message.Message):
    __slots__ = ("source_task",)
    SOURCE_TASK_FIELD_NUMBER: _ClassVar[int]
    source_task: CoordinatedTask
    def __init__(self, source_task: _Optional[_Union[CoordinatedTask, _Mapping]] = ...) -> None: ...

class ShutdownTaskResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetTaskRequest(_message.Message):
    __slots__ = ("source_task",)
    SOURCE_TASK_FIELD_NUMBER: _ClassVar[int]
    source_task: CoordinatedTask
    def __init__(self, source_task: _Optional[_Union[CoordinatedTask, _Mapping]] = ...) -> None: ...

class ResetTaskResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReportErrorToTaskRequest(_message.Message):
    __slots__ = ("error_code", "error_message", "error_payload")
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    error_code: int
    error_message: str
    error_payload: CoordinationServiceError
    def __init__(self, error_code: _Optional[int] = ..., error_message: _Optional[str] = ..., error_payload: _Optional[_Union[CoordinationServiceError, _Mapping]] = ...) -> None: ...

class ReportErrorToTaskResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReportErrorToServiceRequest(_message.Message):
    __slots__ = ("error_code", "error_message", "error_origin")
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_ORIGIN_FIELD_NUMBER: _ClassVar[int]
    error_code: int
    error_message: str
    error_origin: CoordinatedTask
    def __init__(self, error_code: _Optional[int] = ..., error_message: _Optional[str] = ..., error_origin: _Optional[_Union[CoordinatedTask, _Mapping]] = ...) -> None: ...

class ReportErrorToServiceResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetTaskStateRequest(_message.Message):
    __slots__ = ("source_task",)
    SOURCE_TASK_FIELD_NUMBER: _ClassVar[int]
    source_task: _containers.RepeatedCompositeFieldContainer[CoordinatedTask]
    def __init__(self, source_task: _Optional[_Iterable[_Union[CoordinatedTask, _Mapping]]] = ...) -> None: ...

class GetTaskStateResponse(_message.Message):
    __slots__ = ("task_state",)
    TASK_STATE_FIELD_NUMBER: _ClassVar[int]
    task_state: _containers.RepeatedCompositeFieldContainer[CoordinatedTaskStateInfo]
    def __init__(self, task_state: _Optional[_Iterable[_Union[CoordinatedTaskStateInfo, _Mapping]]] = ...) -> None: ...

class WatchJobStateRequest(_message.Message):
    __slots__ = ("job_name", "version_number")
    JOB_NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_NUMBER_FIELD_NUMBER: _ClassVar[int]
    job_name: str
    version_number: int
    def __init__(self, job_name: _Optional[str] = ..., version_number: _Optional[int] = ...) -> None: ...

class WatchJobStateResponse(_message.Message):
    __slots__ = ("task_state", "version_number")
    TASK_STATE_FIELD_NUMBER: _ClassVar[int]
    VERSION_NUMBER_FIELD_NUMBER: _ClassVar[int]
    task_state: _containers.RepeatedCompositeFieldContainer[CoordinatedTaskStateInfo]
    version_number: int
    def __init__(self, task_state: _Optional[_Iterable[_Union[CoordinatedTaskStateInfo, _Mapping]]] = ..., version_number: _Optional[int] = ...) -> None: ...

class KeyValueEntry(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: bytes
    def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...

class InsertKeyValueRequest(_message.Message):
    __slots__ = ("kv", "allow_overwrite")
    KV_FIELD_NUMBER: _ClassVar[int]
    ALLOW_OVERWRITE_FIELD_NUMBER: _ClassVar[int]
    kv: KeyValueEntry
    allow_overwrite: bool
    def __init__(self, kv: _Optional[_Union[KeyValueEntry, _Mapping]] = ..., allow_overwrite: _Optional[bool] = ...) -> None: ...

class InsertKeyValueResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetKeyValueRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class GetKeyValueResponse(_message.Message):
    __slots__ = ("kv",)
    KV_FIELD_NUMBER: _ClassVar[int]
    kv: KeyValueEntry
    def __init__(self, kv: _Optional[_Union[KeyValueEntry, _Mapping]] = ...) -> None: ...

class TryGetKeyValueRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class TryGetKeyValueResponse(_message.Message):
    __slots__ = ("kv",)
    KV_FIELD_NUMBER: _ClassVar[int]
    kv: KeyValueEntry
    def __init__(self, kv: _Optional[_Union[KeyValueEntry, _Mapping]] = ...) -> None: ...

class IncrementKeyValueRequest(_message.Message):
    __slots__ = ("key", "increment")
    KEY_FIELD_NUMBER: _ClassVar[int]
    INCREMENT_FIELD_NUMBER: _ClassVar[int]
    key: str
    increment: int
    def __init__(self, key: _Optional[str] = ..., increment: _Optional[int] = ...) -> None: ...

class IncrementKeyValueResponse(_message.Message):
    __slots__ = ("kv",)
    KV_FIELD_NUMBER: _ClassVar[int]
    kv: KeyValueEntry
    def __init__(self, kv: _Optional[_Union[KeyValueEntry, _Mapping]] = ...) -> None: ...

class GetKeyValueDirRequest(_message.Message):
    __slots__ = ("directory_key",)
    DIRECTORY_KEY_FIELD_NUMBER: _ClassVar[int]
    directory_key: str
    def __init__(self, directory_key: _Optional[str] = ...) -> None: ...

class GetKeyValueDirResponse(_message.Message):
    __slots__ = ("directory_key", "kv")
    DIRECTORY_KEY_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    directory_key: str
    kv: _containers.RepeatedCompositeFieldContainer[KeyValueEntry]
    def __init__(self, directory_key: _Optional[str] = ..., kv: _Optional[_Iterable[_Union[KeyValueEntry, _Mapping]]] = ...) -> None: ...

class DeleteKeyValueRequest(_message.Message):
    __slots__ = ("key", "is_directory")
    KEY_FIELD_NUMBER: _ClassVar[int]
    IS_DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    key: str
    is_directory: bool
    def __init__(self, key: _Optional[str] = ..., is_directory: _Optional[bool] = ...) -> None: ...

class DeleteKeyValueResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BarrierRequest(_message.Message):
    __slots__ = ("barrier_id", "barrier_timeout_in_ms", "tasks", "source_task", "counter")
    BARRIER_ID_FIELD_NUMBER: _ClassVar[int]
    BARRIER_TIMEOUT_IN_MS_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_TASK_FIELD_NUMBER: _ClassVar[int]
    COUNTER_FIELD_NUMBER: _ClassVar[int]
    barrier_id: str
    barrier_timeout_in_ms: int
    tasks: _containers.RepeatedCompositeFieldContainer[CoordinatedTask]
    source_task: CoordinatedTask
    counter: int
    def __init__(self, barrier_id: _Optional[str] = ..., barrier_timeout_in_ms: _Optional[int] = ..., tasks: _Optional[_Iterable[_Union[CoordinatedTask, _Mapping]]] = ..., source_task: _Optional[_Union[CoordinatedTask, _Mapping]] = ..., counter: _Optional[int] = ...) -> None: ...

class BarrierResponse(_message.Message):
    __slots__ = ("counter",)
    COUNTER_FIELD_NUMBER: _ClassVar[int]
    counter: int
    def __init__(self, counter: _Optional[int] = ...) -> None: ...

class CancelBarrierRequest(_message.Message):
    __slots__ = ("barrier_id", "source_task", "counter")
    BARRIER_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_TASK_FIELD_NUMBER: _ClassVar[int]
    COUNTER_FIELD_NUMBER: _ClassVar[int]
    barrier_id: str
    source_task: CoordinatedTask
    counter: int
    def __init__(self, barrier_id: _Optional[str] = ..., source_task: _Optional[_Union[CoordinatedTask, _Mapping]] = ..., counter: _Optional[int] = ...) -> None: ...

class CancelBarrierResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetAliveTasksRequest(_message.Message):
    __slots__ = ("requesting_task", "tasks")
    REQUESTING_TASK_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    requesting_task: CoordinatedTask
    tasks: _containers.RepeatedCompositeFieldContainer[CoordinatedTask]
    def __init__(self, requesting_task: _Optional[_Union[CoordinatedTask, _Mapping]] = ..., tasks: _Optional[_Iterable[_Union[CoordinatedTask, _Mapping]]] = ...) -> None: ...

class GetAliveTasksResponse(_message.Message):
    __slots__ = ("alive_tasks", "incarnations")
    ALIVE_TASKS_FIELD_NUMBER: _ClassVar[int]
    INCARNATIONS_FIELD_NUMBER: _ClassVar[int]
    alive_tasks: _containers.RepeatedCompositeFieldContainer[CoordinatedTask]
    incarnations: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, alive_tasks: _Optional[_Iterable[_Union[CoordinatedTask, _Mapping]]] = ..., incarnations: _Optional[_Iterable[int]] = ...) -> None: ...

class PayloadContainer(_message.Message):
    __slots__ = ("payloads",)
    class PayloadsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    PAYLOADS_FIELD_NUMBER: _ClassVar[int]
    payloads: _containers.ScalarMap[str, bytes]
    def __init__(self, payloads: _Optional[_Mapping[str, bytes]] = ...) -> None: ...
