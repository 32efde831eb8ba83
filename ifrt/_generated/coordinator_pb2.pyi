from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Encoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENCODING_RAW: _ClassVar[Encoding]
    ENCODING_ZLIB: _ClassVar[Encoding]

class ClusterPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CLUSTER_PHASE_UNSPECIFIED: _ClassVar[ClusterPhase]
    CLUSTER_PHASE_WAITING: _ClassVar[ClusterPhase]
    CLUSTER_PHASE_PUBLISHED: _ClassVar[ClusterPhase]
    CLUSTER_PHASE_DEGRADED: _ClassVar[ClusterPhase]
    CLUSTER_PHASE_STANDBY: _ClassVar[ClusterPhase]

class ProcessPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROCESS_PHASE_UNSPECIFIED: _ClassVar[ProcessPhase]
    PROCESS_PHASE_JOINING: _ClassVar[ProcessPhase]
    PROCESS_PHASE_ALIVE: _ClassVar[ProcessPhase]
    PROCESS_PHASE_FAILED: _ClassVar[ProcessPhase]
    PROCESS_PHASE_LEFT: _ClassVar[ProcessPhase]
ENCODING_RAW: Encoding
ENCODING_ZLIB: Encoding
CLUSTER_PHASE_UNSPECIFIED: ClusterPhase
CLUSTER_PHASE_WAITING: ClusterPhase
CLUSTER_PHASE_PUBLISHED: ClusterPhase
CLUSTER_PHASE_DEGRADED: ClusterPhase
CLUSTER_PHASE_STANDBY: ClusterPhase
PROCESS_PHASE_UNSPECIFIED: ProcessPhase
PROCESS_PHASE_JOINING: ProcessPhase
PROCESS_PHASE_ALIVE: ProcessPhase
PROCESS_PHASE_FAILED: ProcessPhase
PROCESS_PHASE_LEFT: ProcessPhase

class WatchJobRequest(_message.Message):
    __slots__ = ("host", "agent_uid", "workers", "max_restarts", "recover", "spare_host", "replace_timeout_s")
    HOST_FIELD_NUMBER: _ClassVar[int]
    AGENT_UID_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    MAX_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    RECOVER_FIELD_NUMBER: _ClassVar[int]
    SPARE_HOST_FIELD_NUMBER: _ClassVar[int]
    REPLACE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    host: str
    agent_uid: str
    workers: int
    max_restarts: int
    recover: str
    spare_host: bool
    replace_timeout_s: float
    def __init__(self, host: _Optional[str] = ..., agent_uid: _Optional[str] = ..., workers: _Optional[int] = ..., max_restarts: _Optional[int] = ..., recover: _Optional[str] = ..., spare_host: _Optional[bool] = ..., replace_timeout_s: _Optional[float] = ...) -> None: ...

class AttemptFailure(_message.Message):
    __slots__ = ("attempt", "process_id", "host", "reason")
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    attempt: int
    process_id: int
    host: str
    reason: str
    def __init__(self, attempt: _Optional[int] = ..., process_id: _Optional[int] = ..., host: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class JobState(_message.Message):
    __slots__ = ("attempt", "failures", "exhausted", "max_restarts", "earlier_failures", "replacements")
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    EXHAUSTED_FIELD_NUMBER: _ClassVar[int]
    MAX_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    EARLIER_FAILURES_FIELD_NUMBER: _ClassVar[int]
    REPLACEMENTS_FIELD_NUMBER: _ClassVar[int]
    attempt: int
    failures: _containers.RepeatedCompositeFieldContainer[AttemptFailure]
    exhausted: bool
    max_restarts: int
    earlier_failures: int
    replacements: int
    def __init__(self, attempt: _Optional[int] = ..., failures: _Optional[_Iterable[_Union[AttemptFailure, _Mapping]]] = ..., exhausted: _Optional[bool] = ..., max_restarts: _Optional[int] = ..., earlier_failures: _Optional[int] = ..., replacements: _Optional[int] = ...) -> None: ...

class JobEvent(_message.Message):
    __slots__ = ("state", "process_failed", "attempt_started", "exhausted", "replaced", "taken_over", "went_on")
    STATE_FIELD_NUMBER: _ClassVar[int]
    PROCESS_FAILED_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_STARTED_FIELD_NUMBER: _ClassVar[int]
    EXHAUSTED_FIELD_NUMBER: _ClassVar[int]
    REPLACED_FIELD_NUMBER: _ClassVar[int]
    TAKEN_OVER_FIELD_NUMBER: _ClassVar[int]
    WENT_ON_FIELD_NUMBER: _ClassVar[int]
    state: JobState
    process_failed: AttemptFailure
    attempt_started: JobState
    exhausted: JobState
    replaced: AttemptFailure
    taken_over: HostTakeover
    went_on: AttemptFailure
    def __init__(self, state: _Optional[_Union[JobState, _Mapping]] = ..., process_failed: _Optional[_Union[AttemptFailure, _Mapping]] = ..., attempt_started: _Optional[_Union[JobState, _Mapping]] = ..., exhausted: _Optional[_Union[JobState, _Mapping]] = ..., replaced: _Optional[_Union[AttemptFailure, _Mapping]] = ..., taken_over: _Optional[_Union[HostTakeover, _Mapping]] = ..., went_on: _Optional[_Union[AttemptFailure, _Mapping]] = ...) -> None: ...

class HostTakeover(_message.Message):
    __slots__ = ("attempt", "failure", "agent_uid", "host", "process_ids", "explicit_ids")
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    AGENT_UID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PROCESS_IDS_FIELD_NUMBER: _ClassVar[int]
    EXPLICIT_IDS_FIELD_NUMBER: _ClassVar[int]
    attempt: int
    failure: AttemptFailure
    agent_uid: str
    host: str
    process_ids: _containers.RepeatedScalarFieldContainer[int]
    explicit_ids: bool
    def __init__(self, attempt: _Optional[int] = ..., failure: _Optional[_Union[AttemptFailure, _Mapping]] = ..., agent_uid: _Optional[str] = ..., host: _Optional[str] = ..., process_ids: _Optional[_Iterable[int]] = ..., explicit_ids: _Optional[bool] = ...) -> None: ...

class NextAttemptRequest(_message.Message):
    __slots__ = ("ended_attempt", "failure", "max_restarts", "request_id", "agent_uid", "replace", "shrink")
    ENDED_ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    MAX_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_UID_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    SHRINK_FIELD_NUMBER: _ClassVar[int]
    ended_attempt: int
    failure: AttemptFailure
    max_restarts: int
    request_id: str
    agent_uid: str
    replace: bool
    shrink: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ended_attempt: _Optional[int] = ..., failure: _Optional[_Union[AttemptFailure, _Mapping]] = ..., max_restarts: _Optional[int] = ..., request_id: _Optional[str] = ..., agent_uid: _Optional[str] = ..., replace: _Optional[bool] = ..., shrink: _Optional[_Iterable[int]] = ...) -> None: ...

class NextAttemptResponse(_message.Message):
    __slots__ = ("state", "shrink_refused", "shrink_wait_s")
    STATE_FIELD_NUMBER: _ClassVar[int]
    SHRINK_REFUSED_FIELD_NUMBER: _ClassVar[int]
    SHRINK_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    state: JobState
    shrink_refused: str
    shrink_wait_s: float
    def __init__(self, state: _Optional[_Union[JobState, _Mapping]] = ..., shrink_refused: _Optional[str] = ..., shrink_wait_s: _Optional[float] = ...) -> None: ...

class LocalDevice(_message.Message):
    __slots__ = ("local_id", "platform", "kind", "slice_key", "attributes", "coordinates")
    class AttributesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    LOCAL_ID_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SLICE_KEY_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    COORDINATES_FIELD_NUMBER: _ClassVar[int]
    local_id: int
    platform: str
    kind: str
    slice_key: str
    attributes: _containers.ScalarMap[str, str]
    coordinates: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, local_id: _Optional[int] = ..., platform: _Optional[str] = ..., kind: _Optional[str] = ..., slice_key: _Optional[str] = ..., attributes: _Optional[_Mapping[str, str]] = ..., coordinates: _Optional[_Iterable[int]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("cluster_id", "num_processes", "process_id", "client_uid", "hostname", "local_rank", "address", "devices", "wait_ms", "plugin", "attempt", "network", "opens_session", "os_pid")
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PROCESSES_FIELD_NUMBER: _ClassVar[int]
    PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_UID_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    PLUGIN_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    NETWORK_FIELD_NUMBER: _ClassVar[int]
    OPENS_SESSION_FIELD_NUMBER: _ClassVar[int]
    OS_PID_FIELD_NUMBER: _ClassVar[int]
    cluster_id: str
    num_processes: int
    process_id: int
    client_uid: str
    hostname: str
    local_rank: int
    address: str
    devices: _containers.RepeatedCompositeFieldContainer[LocalDevice]
    wait_ms: int
    plugin: str
    attempt: int
    network: _containers.RepeatedScalarFieldContainer[str]
    opens_session: bool
    os_pid: int
    def __init__(self, cluster_id: _Optional[str] = ..., num_processes: _Optional[int] = ..., process_id: _Optional[int] = ..., client_uid: _Optional[str] = ..., hostname: _Optional[str] = ..., local_rank: _Optional[int] = ..., address: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[LocalDevice, _Mapping]]] = ..., wait_ms: _Optional[int] = ..., plugin: _Optional[str] = ..., attempt: _Optional[int] = ..., network: _Optional[_Iterable[str]] = ..., opens_session: _Optional[bool] = ..., os_pid: _Optional[int] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("registered", "expected", "missing_process_ids", "registered_hosts", "waited_seconds")
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    MISSING_PROCESS_IDS_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_HOSTS_FIELD_NUMBER: _ClassVar[int]
    WAITED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    registered: int
    expected: int
    missing_process_ids: _containers.RepeatedScalarFieldContainer[int]
    registered_hosts: _containers.RepeatedScalarFieldContainer[str]
    waited_seconds: float
    def __init__(self, registered: _Optional[int] = ..., expected: _Optional[int] = ..., missing_process_ids: _Optional[_Iterable[int]] = ..., registered_hosts: _Optional[_Iterable[str]] = ..., waited_seconds: _Optional[float] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("process_id", "progress", "topology", "encoding", "fingerprint", "generation", "event_position", "attempt", "run")
    PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    EVENT_POSITION_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    process_id: int
    progress: Progress
    topology: bytes
    encoding: Encoding
    fingerprint: str
    generation: int
    event_position: int
    attempt: int
    run: int
    def __init__(self, process_id: _Optional[int] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., topology: _Optional[bytes] = ..., encoding: _Optional[_Union[Encoding, str]] = ..., fingerprint: _Optional[str] = ..., generation: _Optional[int] = ..., event_position: _Optional[int] = ..., attempt: _Optional[int] = ..., run: _Optional[int] = ...) -> None: ...

class Topology(_message.Message):
    __slots__ = ("cluster_id", "generation", "num_processes", "strings", "processes", "devices")
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    NUM_PROCESSES_FIELD_NUMBER: _ClassVar[int]
    STRINGS_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    cluster_id: str
    generation: int
    num_processes: int
    strings: _containers.RepeatedScalarFieldContainer[str]
    processes: ProcessColumns
    devices: DeviceColumns
    def __init__(self, cluster_id: _Optional[str] = ..., generation: _Optional[int] = ..., num_processes: _Optional[int] = ..., strings: _Optional[_Iterable[str]] = ..., processes: _Optional[_Union[ProcessColumns, _Mapping]] = ..., devices: _Optional[_Union[DeviceColumns, _Mapping]] = ...) -> None: ...

class ProcessColumns(_message.Message):
    __slots__ = ("process_ids", "hostname_shared", "hostname_suffixes", "address_shared", "address_suffixes", "device_counts", "plugins", "coordinate_ranks", "network_depths", "network_levels")
    PROCESS_IDS_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_SHARED_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_SUFFIXES_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_SHARED_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_SUFFIXES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_COUNTS_FIELD_NUMBER: _ClassVar[int]
    PLUGINS_FIELD_NUMBER: _ClassVar[int]
    COORDINATE_RANKS_FIELD_NUMBER: _ClassVar[int]
    NETWORK_DEPTHS_FIELD_NUMBER: _ClassVar[int]
    NETWORK_LEVELS_FIELD_NUMBER: _ClassVar[int]
    process_ids: IntColumn
    hostname_shared: IntColumn
    hostname_suffixes: _containers.RepeatedScalarFieldContainer[str]
    address_shared: IntColumn
    address_suffixes: _containers.RepeatedScalarFieldContainer[str]
    device_counts: IntColumn
    plugins: IntColumn
    coordinate_ranks: IntColumn
    network_depths: IntColumn
    network_levels: IntColumn
    def __init__(self, process_ids: _Optional[_Union[IntColumn, _Mapping]] = ..., hostname_shared: _Optional[_Union[IntColumn, _Mapping]] = ..., hostname_suffixes: _Optional[_Iterable[str]] = ..., address_shared: _Optional[_Union[IntColumn, _Mapping]] = ..., address_suffixes: _Optional[_Iterable[str]] = ..., device_counts: _Optional[_Union[IntColumn, _Mapping]] = ..., plugins: _Optional[_Union[IntColumn, _Mapping]] = ..., coordinate_ranks: _Optional[_Union[IntColumn, _Mapping]] = ..., network_depths: _Optional[_Union[IntColumn, _Mapping]] = ..., network_levels: _Optional[_Union[IntColumn, _Mapping]] = ...) -> None: ...

class DeviceColumns(_message.Message):
    __slots__ = ("local_ids", "platforms", "kinds", "slice_indices", "coordinates", "attributes")
    LOCAL_IDS_FIELD_NUMBER: _ClassVar[int]
    PLATFORMS_FIELD_NUMBER: _ClassVar[int]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    SLICE_INDICES_FIELD_NUMBER: _ClassVar[int]
    COORDINATES_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    local_ids: IntColumn
    platforms: IntColumn
    kinds: IntColumn
    slice_indices: IntColumn
    coordinates: _containers.RepeatedCompositeFieldContainer[IntColumn]
    attributes: _containers.RepeatedCompositeFieldContainer[AttributeColumn]
    def __init__(self, local_ids: _Optional[_Union[IntColumn, _Mapping]] = ..., platforms: _Optional[_Union[IntColumn, _Mapping]] = ..., kinds: _Optional[_Union[IntColumn, _Mapping]] = ..., slice_indices: _Optional[_Union[IntColumn, _Mapping]] = ..., coordinates: _Optional[_Iterable[_Union[IntColumn, _Mapping]]] = ..., attributes: _Optional[_Iterable[_Union[AttributeColumn, _Mapping]]] = ...) -> None: ...

class AttributeColumn(_message.Message):
    __slots__ = ("key", "values")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    key: int
    values: IntColumn
    def __init__(self, key: _Optional[int] = ..., values: _Optional[_Union[IntColumn, _Mapping]] = ...) -> None: ...

class IntColumn(_message.Message):
    __slots__ = ("deltas", "runs")
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    deltas: _containers.RepeatedScalarFieldContainer[int]
    runs: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, deltas: _Optional[_Iterable[int]] = ..., runs: _Optional[_Iterable[int]] = ...) -> None: ...

class HostProcess(_message.Message):
    __slots__ = ("request", "proof")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    request: RegisterRequest
    proof: str
    def __init__(self, request: _Optional[_Union[RegisterRequest, _Mapping]] = ..., proof: _Optional[str] = ...) -> None: ...

class RegisterHostRequest(_message.Message):
    __slots__ = ("agent_uid", "processes", "wait_ms")
    AGENT_UID_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    agent_uid: str
    processes: _containers.RepeatedCompositeFieldContainer[HostProcess]
    wait_ms: int
    def __init__(self, agent_uid: _Optional[str] = ..., processes: _Optional[_Iterable[_Union[HostProcess, _Mapping]]] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class HostRegistration(_message.Message):
    __slots__ = ("process_id", "code", "error", "message")
    PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    process_id: int
    code: int
    error: str
    message: str
    def __init__(self, process_id: _Optional[int] = ..., code: _Optional[int] = ..., error: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class RegisterHostResponse(_message.Message):
    __slots__ = ("processes", "answer")
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    processes: _containers.RepeatedCompositeFieldContainer[HostRegistration]
    answer: bytes
    def __init__(self, processes: _Optional[_Iterable[_Union[HostRegistration, _Mapping]]] = ..., answer: _Optional[bytes] = ...) -> None: ...

class HostSessionRequest(_message.Message):
    __slots__ = ("open", "attach", "detach", "exited", "watch", "unwatch")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    ATTACH_FIELD_NUMBER: _ClassVar[int]
    DETACH_FIELD_NUMBER: _ClassVar[int]
    EXITED_FIELD_NUMBER: _ClassVar[int]
    WATCH_FIELD_NUMBER: _ClassVar[int]
    UNWATCH_FIELD_NUMBER: _ClassVar[int]
    open: HostSessionOpen
    attach: WorkerSession
    detach: WorkerSession
    exited: WorkerExit
    watch: WatchKeys
    unwatch: WatchKeys
    def __init__(self, open: _Optional[_Union[HostSessionOpen, _Mapping]] = ..., attach: _Optional[_Union[WorkerSession, _Mapping]] = ..., detach: _Optional[_Union[WorkerSession, _Mapping]] = ..., exited: _Optional[_Union[WorkerExit, _Mapping]] = ..., watch: _Optional[_Union[WatchKeys, _Mapping]] = ..., unwatch: _Optional[_Union[WatchKeys, _Mapping]] = ...) -> None: ...

class HostSessionOpen(_message.Message):
    __slots__ = ("agent_uid", "generation", "since_event", "run", "attempt")
    AGENT_UID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SINCE_EVENT_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    agent_uid: str
    generation: int
    since_event: int
    run: int
    attempt: int
    def __init__(self, agent_uid: _Optional[str] = ..., generation: _Optional[int] = ..., since_event: _Optional[int] = ..., run: _Optional[int] = ..., attempt: _Optional[int] = ...) -> None: ...

class WorkerSession(_message.Message):
    __slots__ = ("client_uid", "proof")
    CLIENT_UID_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    client_uid: str
    proof: str
    def __init__(self, client_uid: _Optional[str] = ..., proof: _Optional[str] = ...) -> None: ...

class WorkerExit(_message.Message):
    __slots__ = ("client_uid", "proof", "reason")
    CLIENT_UID_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    client_uid: str
    proof: str
    reason: str
    def __init__(self, client_uid: _Optional[str] = ..., proof: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class WorkerSessionEnded(_message.Message):
    __slots__ = ("client_uid", "code", "error", "message")
    CLIENT_UID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    client_uid: str
    code: int
    error: str
    message: str
    def __init__(self, client_uid: _Optional[str] = ..., code: _Optional[int] = ..., error: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("open", "heartbeat", "watch", "unwatch")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    WATCH_FIELD_NUMBER: _ClassVar[int]
    UNWATCH_FIELD_NUMBER: _ClassVar[int]
    open: SessionOpen
    heartbeat: Heartbeat
    watch: WatchKeys
    unwatch: WatchKeys
    def __init__(self, open: _Optional[_Union[SessionOpen, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., watch: _Optional[_Union[WatchKeys, _Mapping]] = ..., unwatch: _Optional[_Union[WatchKeys, _Mapping]] = ...) -> None: ...

class WatchKeys(_message.Message):
    __slots__ = ("prefix",)
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    def __init__(self, prefix: _Optional[str] = ...) -> None: ...

class SessionOpen(_message.Message):
    __slots__ = ("client_uid", "generation", "since_event", "run", "attempt")
    CLIENT_UID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SINCE_EVENT_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    client_uid: str
    generation: int
    since_event: int
    run: int
    attempt: int
    def __init__(self, client_uid: _Optional[str] = ..., generation: _Optional[int] = ..., since_event: _Optional[int] = ..., run: _Optional[int] = ..., attempt: _Optional[int] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("client_uid",)
    CLIENT_UID_FIELD_NUMBER: _ClassVar[int]
    client_uid: str
    def __init__(self, client_uid: _Optional[str] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("attached", "process_failed", "process_restarted", "process_left", "topology_changed", "shutdown", "key_changed", "preemption_notice", "watching", "snapshot", "worker_ended", "watch_lapsed", "exit_noted", "event_number")
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    PROCESS_FAILED_FIELD_NUMBER: _ClassVar[int]
    PROCESS_RESTARTED_FIELD_NUMBER: _ClassVar[int]
    PROCESS_LEFT_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_CHANGED_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    KEY_CHANGED_FIELD_NUMBER: _ClassVar[int]
    PREEMPTION_NOTICE_FIELD_NUMBER: _ClassVar[int]
    WATCHING_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    WORKER_ENDED_FIELD_NUMBER: _ClassVar[int]
    WATCH_LAPSED_FIELD_NUMBER: _ClassVar[int]
    EXIT_NOTED_FIELD_NUMBER: _ClassVar[int]
    EVENT_NUMBER_FIELD_NUMBER: _ClassVar[int]
    attached: Attached
    process_failed: ProcessEvent
    process_restarted: ProcessEvent
    process_left: ProcessEvent
    topology_changed: RegisterResponse
    shutdown: Shutdown
    key_changed: KeyValueChange
    preemption_notice: ProcessEvent
    watching: WatchKeys
    snapshot: EventSnapshot
    worker_ended: WorkerSessionEnded
    watch_lapsed: WatchKeys
    exit_noted: WorkerSession
    event_number: int
    def __init__(self, attached: _Optional[_Union[Attached, _Mapping]] = ..., process_failed: _Optional[_Union[ProcessEvent, _Mapping]] = ..., process_restarted: _Optional[_Union[ProcessEvent, _Mapping]] = ..., process_left: _Optional[_Union[ProcessEvent, _Mapping]] = ..., topology_changed: _Optional[_Union[RegisterResponse, _Mapping]] = ..., shutdown: _Optional[_Union[Shutdown, _Mapping]] = ..., key_changed: _Optional[_Union[KeyValueChange, _Mapping]] = ..., preemption_notice: _Optional[_Union[ProcessEvent, _Mapping]] = ..., watching: _Optional[_Union[WatchKeys, _Mapping]] = ..., snapshot: _Optional[_Union[EventSnapshot, _Mapping]] = ..., worker_ended: _Optional[_Union[WorkerSessionEnded, _Mapping]] = ..., watch_lapsed: _Optional[_Union[WatchKeys, _Mapping]] = ..., exit_noted: _Optional[_Union[WorkerSession, _Mapping]] = ..., event_number: _Optional[int] = ...) -> None: ...

class EventSnapshot(_message.Message):
    __slots__ = ("failed", "left", "restarted", "preemption_notice")
    FAILED_FIELD_NUMBER: _ClassVar[int]
    LEFT_FIELD_NUMBER: _ClassVar[int]
    RESTARTED_FIELD_NUMBER: _ClassVar[int]
    PREEMPTION_NOTICE_FIELD_NUMBER: _ClassVar[int]
    failed: _containers.RepeatedCompositeFieldContainer[ProcessEvent]
    left: _containers.RepeatedCompositeFieldContainer[ProcessEvent]
    restarted: _containers.RepeatedCompositeFieldContainer[ProcessEvent]
    preemption_notice: ProcessEvent
    def __init__(self, failed: _Optional[_Iterable[_Union[ProcessEvent, _Mapping]]] = ..., left: _Optional[_Iterable[_Union[ProcessEvent, _Mapping]]] = ..., restarted: _Optional[_Iterable[_Union[ProcessEvent, _Mapping]]] = ..., preemption_notice: _Optional[_Union[ProcessEvent, _Mapping]] = ...) -> None: ...

class KeyValueChange(_message.Message):
    __slots__ = ("key", "value", "deleted")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    DELETED_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: bytes
    deleted: bool
    def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ..., deleted: _Optional[bool] = ...) -> None: ...

class Attached(_message.Message):
    __slots__ = ("heartbeat_interval_ms", "generation", "heartbeat_timeout_ms", "client_uid", "process_id", "hung_after_ms", "attempt", "run")
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_UID_FIELD_NUMBER: _ClassVar[int]
    PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
    HUNG_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_ms: int
    generation: int
    heartbeat_timeout_ms: int
    client_uid: str
    process_id: int
    hung_after_ms: int
    attempt: int
    run: int
    def __init__(self, heartbeat_interval_ms: _Optional[int] = ..., generation: _Optional[int] = ..., heartbeat_timeout_ms: _Optional[int] = ..., client_uid: _Optional[str] = ..., process_id: _Optional[int] = ..., hung_after_ms: _Optional[int] = ..., attempt: _Optional[int] = ..., run: _Optional[int] = ...) -> None: ...

class ProcessEvent(_message.Message):
    __slots__ = ("process_id", "reason", "incarnation")
    PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    process_id: int
    reason: str
    incarnation: int
    def __init__(self, process_id: _Optional[int] = ..., reason: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class Shutdown(_message.Message):
    __slots__ = ("reason", "ended_attempt", "next_attempt", "ended_run", "next_run")
    REASON_FIELD_NUMBER: _ClassVar[int]
    ENDED_ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    NEXT_ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    ENDED_RUN_FIELD_NUMBER: _ClassVar[int]
    NEXT_RUN_FIELD_NUMBER: _ClassVar[int]
    reason: str
    ended_attempt: int
    next_attempt: int
    ended_run: int
    next_run: int
    def __init__(self, reason: _Optional[str] = ..., ended_attempt: _Optional[int] = ..., next_attempt: _Optional[int] = ..., ended_run: _Optional[int] = ..., next_run: _Optional[int] = ...) -> None: ...

class BarrierRequest(_message.Message):
    __slots__ = ("client_uid", "name", "process_ids", "timeout_ms", "supersedes")
    CLIENT_UID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PROCESS_IDS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    SUPERSEDES_FIELD_NUMBER: _ClassVar[int]
    client_uid: str
    name: str
    process_ids: _containers.RepeatedScalarFieldContainer[int]
    timeout_ms: int
    supersedes: str
    def __init__(self, client_uid: _Optional[str] = ..., name: _Optional[str] = ..., process_ids: _Optional[_Iterable[int]] = ..., timeout_ms: _Optional[int] = ..., supersedes: _Optional[str] = ...) -> None: ...

class BarrierResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KeyValueSetRequest(_message.Message):
    __slots__ = ("client_uid", "key", "value", "allow_overwrite", "request_id")
    CLIENT_UID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    ALLOW_OVERWRITE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    client_uid: str
    key: str
    value: bytes
    allow_overwrite: bool
    request_id: str
    def __init__(self, client_uid: _Optional[str] = ..., key: _Optional[str] = ..., value: _Optional[bytes] = ..., allow_overwrite: _Optional[bool] = ..., request_id: _Optional[str] = ...) -> None: ...

class KeyValueSetResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KeyValueGetRequest(_message.Message):
    __slots__ = ("client_uid", "key", "wait_ms")
    CLIENT_UID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    client_uid: str
    key: str
    wait_ms: int
    def __init__(self, client_uid: _Optional[str] = ..., key: _Optional[str] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class KeyValueGetResponse(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: bytes
    def __init__(self, value: _Optional[bytes] = ...) -> None: ...

class KeyValueTryGetRequest(_message.Message):
    __slots__ = ("client_uid", "key")
    CLIENT_UID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    client_uid: str
    key: str
    def __init__(self, client_uid: _Optional[str] = ..., key: _Optional[str] = ...) -> None: ...

class KeyValueTryGetResponse(_message.Message):
    __slots__ = ("found", "value")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    found: bool
    value: bytes
    def __init__(self, found: _Optional[bool] = ..., value: _Optional[bytes] = ...) -> None: ...

class KeyValueIncrementRequest(_message.Message):
    __slots__ = ("client_uid", "key", "amount", "request_id")
    CLIENT_UID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    client_uid: str
    key: str
    amount: int
    request_id: str
    def __init__(self, client_uid: _Optional[str] = ..., key: _Optional[str] = ..., amount: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...

class KeyValueIncrementResponse(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: int
    def __init__(self, value: _Optional[int] = ...) -> None: ...

class KeyValueCompareSetRequest(_message.Message):
    __slots__ = ("client_uid", "key", "expected", "desired", "request_id")
    CLIENT_UID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    DESIRED_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    client_uid: str
    key: str
    expected: bytes
    desired: bytes
    request_id: str
    def __init__(self, client_uid: _Optional[str] = ..., key: _Optional[str] = ..., expected: _Optional[bytes] = ..., desired: _Optional[bytes] = ..., request_id: _Optional[str] = ...) -> None: ...

class KeyValueCompareSetResponse(_message.Message):
    __slots__ = ("value", "found")
    VALUE_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    value: bytes
    found: bool
    def __init__(self, value: _Optional[bytes] = ..., found: _Optional[bool] = ...) -> None: ...

class KeyValueDeleteRequest(_message.Message):
    __slots__ = ("client_uid", "key", "prefix", "request_id")
    CLIENT_UID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    client_uid: str
    key: str
    prefix: bool
    request_id: str
    def __init__(self, client_uid: _Optional[str] = ..., key: _Optional[str] = ..., prefix: _Optional[bool] = ..., request_id: _Optional[str] = ...) -> None: ...

class KeyValueDeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class CancelBarrierRequest(_message.Message):
    __slots__ = ("client_uid", "name", "process_ids")
    CLIENT_UID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PROCESS_IDS_FIELD_NUMBER: _ClassVar[int]
    client_uid: str
    name: str
    process_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, client_uid: _Optional[str] = ..., name: _Optional[str] = ..., process_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CancelBarrierResponse(_message.Message):
    __slots__ = ("cancelled",)
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    cancelled: bool
    def __init__(self, cancelled: _Optional[bool] = ...) -> None: ...

class LiveProcessesRequest(_message.Message):
    __slots__ = ("client_uid", "timeout_ms", "call_id")
    CLIENT_UID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    client_uid: str
    timeout_ms: int
    call_id: str
    def __init__(self, client_uid: _Optional[str] = ..., timeout_ms: _Optional[int] = ..., call_id: _Optional[str] = ...) -> None: ...

class LiveProcess(_message.Message):
    __slots__ = ("process_id", "incarnation")
    PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    process_id: int
    incarnation: int
    def __init__(self, process_id: _Optional[int] = ..., incarnation: _Optional[int] = ...) -> None: ...

class LiveProcessesResponse(_message.Message):
    __slots__ = ("processes",)
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    processes: _containers.RepeatedCompositeFieldContainer[LiveProcess]
    def __init__(self, processes: _Optional[_Iterable[_Union[LiveProcess, _Mapping]]] = ...) -> None: ...

class PreemptionNoticeRequest(_message.Message):
    __slots__ = ("client_uid",)
    CLIENT_UID_FIELD_NUMBER: _ClassVar[int]
    client_uid: str
    def __init__(self, client_uid: _Optional[str] = ...) -> None: ...

class PreemptionNoticeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PreemptionSyncRequest(_message.Message):
    __slots__ = ("client_uid", "step", "timeout_ms")
    CLIENT_UID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    client_uid: str
    step: int
    timeout_ms: int
    def __init__(self, client_uid: _Optional[str] = ..., step: _Optional[int] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class PreemptionSyncResponse(_message.Message):
    __slots__ = ("sync_step",)
    SYNC_STEP_FIELD_NUMBER: _ClassVar[int]
    sync_step: int
    def __init__(self, sync_step: _Optional[int] = ...) -> None: ...

class KeyValueDirRequest(_message.Message):
    __slots__ = ("client_uid", "prefix")
    CLIENT_UID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    client_uid: str
    prefix: str
    def __init__(self, client_uid: _Optional[str] = ..., prefix: _Optional[str] = ...) -> None: ...

class KeyValueEntry(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: bytes
    def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...

class KeyValueDirResponse(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[KeyValueEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[KeyValueEntry, _Mapping]]] = ...) -> None: ...

class KeyValueMultiGetRequest(_message.Message):
    __slots__ = ("client_uid", "keys")
    CLIENT_UID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    client_uid: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, client_uid: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ...) -> None: ...

class KeyValueMultiGetResponse(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedCompositeFieldContainer[KeyValueTryGetResponse]
    def __init__(self, values: _Optional[_Iterable[_Union[KeyValueTryGetResponse, _Mapping]]] = ...) -> None: ...

class KeyValueMultiSetRequest(_message.Message):
    __slots__ = ("client_uid", "entries", "allow_overwrite", "request_id")
    CLIENT_UID_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    ALLOW_OVERWRITE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    client_uid: str
    entries: _containers.RepeatedCompositeFieldContainer[KeyValueEntry]
    allow_overwrite: bool
    request_id: str
    def __init__(self, client_uid: _Optional[str] = ..., entries: _Optional[_Iterable[_Union[KeyValueEntry, _Mapping]]] = ..., allow_overwrite: _Optional[bool] = ..., request_id: _Optional[str] = ...) -> None: ...

class KeyValueMultiSetResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ProcessStatus(_message.Message):
    __slots__ = ("process_id", "hostname", "host_address", "local_rank", "address", "devices", "phase", "reason", "incarnation", "heartbeat_age_seconds", "attached", "network", "os_pid")
    PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    HOST_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    NETWORK_FIELD_NUMBER: _ClassVar[int]
    OS_PID_FIELD_NUMBER: _ClassVar[int]
    process_id: int
    hostname: str
    host_address: str
    local_rank: int
    address: str
    devices: int
    phase: ProcessPhase
    reason: str
    incarnation: int
    heartbeat_age_seconds: float
    attached: bool
    network: _containers.RepeatedScalarFieldContainer[str]
    os_pid: int
    def __init__(self, process_id: _Optional[int] = ..., hostname: _Optional[str] = ..., host_address: _Optional[str] = ..., local_rank: _Optional[int] = ..., address: _Optional[str] = ..., devices: _Optional[int] = ..., phase: _Optional[_Union[ProcessPhase, str]] = ..., reason: _Optional[str] = ..., incarnation: _Optional[int] = ..., heartbeat_age_seconds: _Optional[float] = ..., attached: _Optional[bool] = ..., network: _Optional[_Iterable[str]] = ..., os_pid: _Optional[int] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("cluster_id", "state", "generation", "fingerprint", "registered", "expected", "missing_process_ids", "missing", "processes", "leader", "replica", "store", "reason", "waited_seconds", "time_to_publish_seconds", "sessions_open", "heartbeat_timeout_seconds", "attempt", "slow_after_seconds", "agents")
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    MISSING_PROCESS_IDS_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    WAITED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_PUBLISH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_OPEN_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    SLOW_AFTER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    AGENTS_FIELD_NUMBER: _ClassVar[int]
    cluster_id: str
    state: ClusterPhase
    generation: int
    fingerprint: str
    registered: int
    expected: int
    missing_process_ids: _containers.RepeatedScalarFieldContainer[int]
    missing: int
    processes: _containers.RepeatedCompositeFieldContainer[ProcessStatus]
    leader: str
    replica: str
    store: str
    reason: str
    waited_seconds: float
    time_to_publish_seconds: float
    sessions_open: int
    heartbeat_timeout_seconds: float
    attempt: int
    slow_after_seconds: float
    agents: _containers.RepeatedCompositeFieldContainer[AgentStatus]
    def __init__(self, cluster_id: _Optional[str] = ..., state: _Optional[_Union[ClusterPhase, str]] = ..., generation: _Optional[int] = ..., fingerprint: _Optional[str] = ..., registered: _Optional[int] = ..., expected: _Optional[int] = ..., missing_process_ids: _Optional[_Iterable[int]] = ..., missing: _Optional[int] = ..., processes: _Optional[_Iterable[_Union[ProcessStatus, _Mapping]]] = ..., leader: _Optional[str] = ..., replica: _Optional[str] = ..., store: _Optional[str] = ..., reason: _Optional[str] = ..., waited_seconds: _Optional[float] = ..., time_to_publish_seconds: _Optional[float] = ..., sessions_open: _Optional[int] = ..., heartbeat_timeout_seconds: _Optional[float] = ..., attempt: _Optional[int] = ..., slow_after_seconds: _Optional[float] = ..., agents: _Optional[_Iterable[_Union[AgentStatus, _Mapping]]] = ...) -> None: ...

class AgentStatus(_message.Message):
    __slots__ = ("host", "address", "workers", "spare", "joined_unix_s", "watching")
    HOST_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    SPARE_FIELD_NUMBER: _ClassVar[int]
    JOINED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    WATCHING_FIELD_NUMBER: _ClassVar[int]
    host: str
    address: str
    workers: int
    spare: bool
    joined_unix_s: float
    watching: bool
    def __init__(self, host: _Optional[str] = ..., address: _Optional[str] = ..., workers: _Optional[int] = ..., spare: _Optional[bool] = ..., joined_unix_s: _Optional[float] = ..., watching: _Optional[bool] = ...) -> None: ...

class TransferKeyRequest(_message.Message):
    __slots__ = ("client_uid", "peer_process_id")
    CLIENT_UID_FIELD_NUMBER: _ClassVar[int]
    PEER_PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
    client_uid: str
    peer_process_id: int
    def __init__(self, client_uid: _Optional[str] = ..., peer_process_id: _Optional[int] = ...) -> None: ...

class TransferKeyResponse(_message.Message):
    __slots__ = ("key", "process_id", "peer_process_id", "incarnation")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    process_id: int
    peer_process_id: int
    incarnation: int
    def __init__(self, key: _Optional[bytes] = ..., process_id: _Optional[int] = ..., peer_process_id: _Optional[int] = ..., incarnation: _Optional[int] = ...) -> None: ...
