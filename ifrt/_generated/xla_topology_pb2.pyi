from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Device(_message.Message):
    __slots__ = ("local_device_ordinal", "name", "vendor", "global_device_id", "partition_index", "device_kind")
    LOCAL_DEVICE_ORDINAL_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    VENDOR_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    PARTITION_INDEX_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    local_device_ordinal: int
    name: str
    vendor: str
    global_device_id: int
    partition_index: int
    device_kind: str
    def __init__(self, local_device_ordinal: _Optional[int] = ..., name: _Optional[str] = ..., vendor: _Optional[str] = ..., global_device_id: _Optional[int] = ..., partition_index: _Optional[int] = ..., device_kind: _Optional[str] = ...) -> None: ...

class LocalTopology(_message.Message):
    __slots__ = ("process_id", "boot_id", "devices")
    PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    process_id: int
    boot_id: str
    devices: _containers.RepeatedCompositeFieldContainer[Device]
    def __init__(self, process_id: _Optional[int] = ..., boot_id: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[Device, _Mapping]]] = ...) -> None: ...

class GlobalTopology(_message.Message):
    __slots__ = ("processes",)
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    processes: _containers.RepeatedCompositeFieldContainer[LocalTopology]
    def __init__(self, processes: _Optional[_Iterable[_Union[LocalTopology, _Mapping]]] = ...) -> None: ...
