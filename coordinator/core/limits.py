"""What the coordinator accepts from a caller: every size and count it checks, each an ``ifrt-coordinator`` flag.

A request over a limit is refused with InvalidArgument naming the value, the limit and the flag that raises it,
and changes nothing. The id layout's own bound (a local id below 2**17) is not a setting: a flag may lower the
devices a process may register, never raise it past what a global id can encode.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ifrt.errors import InvalidArgument, ResourceExhausted
from ifrt.ids import MAX_LOCAL_DEVICES

FLAGS = {
    "request_bytes": "--max-request-bytes",
    "devices_per_process": "--max-devices-per-process",
    "attributes_per_device": "--max-attributes",
    "string_bytes": "--max-string-bytes",
    "kv_value_bytes": "--kv-max-value-bytes",
    "kv_keys": "--kv-max-keys",
    "kv_key_bytes": "--kv-max-key-bytes",
    "barrier_name_bytes": "--max-barrier-name-bytes",
    "concurrent_streams": "--max-concurrent-streams",
    "barriers": "--max-barriers",
    "watches_per_session": "--max-watches-per-session",
    "session_backlog_bytes": "--max-session-backlog-bytes",
    "health_name_bytes": "--max-health-name-bytes",
    "health_watches_per_connection": "--max-health-watches-per-connection",
    "health_watches": "--max-health-watches",
    "stranger_health_watches": "--max-stranger-health-watches",
    "first_message_seconds": "--first-message-timeout",
    "connection_idle_seconds": "--max-connection-idle",
    "connections": "--max-connections",
    "stranger_connections": "--max-stranger-connections",
    "event_history": "--max-event-history",
    "agents": "--max-agents",
    "kv_bytes": "--kv-max-bytes",
    "reply_bytes": "--max-reply-bytes",
    "answers_per_caller": "--max-answers-per-caller",
    "answer_bytes": "--max-answer-bytes",
    "barrier_bytes": "--max-barrier-bytes",
    "sessions_per_process": "--max-sessions-per-process",
    "backlog_bytes": "--max-backlog-bytes",
    "registration_bytes": "--max-registration-bytes",
    "pending_reply_bytes": "--max-pending-reply-bytes",
    "watch_bytes": "--max-watch-bytes",
}
"""The ``ifrt-coordinator`` flag that sets each limit (named in every error about it)."""


@dataclass(frozen=True)
class Limits:
    """Every limit on what callers send, with its default and the reason for it."""

    request_bytes: int = 16 << 20
    """Largest message of any call (gRPC refuses larger ones with RESOURCE_EXHAUSTED): 2**17 devices fit."""
    devices_per_process: int = MAX_LOCAL_DEVICES
    """Most devices one process registers: every local id below 2**17 (the id layout's bound, never raised)."""
    attributes_per_device: int = 64
    """Most attributes one device carries: a plugin's properties fit; thousands per device bloat every topology."""
    string_bytes: int = 1024
    """Longest hostname, address, cluster id, plugin, platform, kind, slice key, attribute key or value, and a
    call's request or call id (UTF-8)."""
    kv_value_bytes: int = 1 << 20
    """Largest key-value value: bootstrap values (a collective's unique id, an address) are far smaller."""
    kv_keys: int = 1 << 20
    """Most keys the store holds at once: 64 for each of 2**14 processes; the store lives in memory and its journal."""
    kv_key_bytes: int = 1024
    """Longest key-value key (UTF-8): keys are names, and every one is journaled and listed."""
    barrier_name_bytes: int = 1024
    """Longest barrier name (UTF-8): names are journaled and named in every barrier's errors."""
    concurrent_streams: int = 4096
    """Calls one client connection may have open at once (HTTP/2 streams); further calls wait for a free one.
    A process holds its Register call, its session and the calls its threads wait in: a few. A driver that carries
    many processes' calls on one connection (a host agent, a test harness of 2048) stays well inside it.
    0: gRPC's own default (no limit)."""
    barriers: int = 1 << 20
    """Most barriers kept (a name is used once and its result repeated to late callers; a cancel of a name nobody
    used yet is kept too): 64 for each of 2**14 processes. What one process holds alone (its cancels of barriers nobody
    arrived at, its barriers nobody else arrived at) is at most its share, this divided by the processes."""
    watches_per_session: int = 1024
    """Most key prefixes one session watches (each at most --kv-max-key-bytes long): a process watches a few."""
    session_backlog_bytes: int = 64 << 20
    """Most bytes of events a session may leave unread (64 values of the largest size); past it the session is
    ended and its process attaches again (kv_watch's changes meanwhile are re-read with kv_dir)."""
    health_name_bytes: int = 256
    """Longest service name a health check or watch may ask for: the names served are at most 28 bytes long."""
    health_watches_per_connection: int = 4
    """Health watches one connection may hold open (the health service needs no token)."""
    health_watches: int = 1024
    """Health watches held open at once, over all connections: a watching connection is never idle."""
    stranger_health_watches: int = 16
    """Health watches held open at once by callers whose connection made no call with the token (with
    --token-file): probes check, they do not watch; each such watch ends after --max-connection-idle."""
    first_message_seconds: int = 10
    """How long a Session or health call may take to send its first message before it is ended."""
    connection_idle_seconds: int = 30
    """A connection without a call in flight (or still in its handshake) for this long is closed; a process's
    session is a call in flight, so only connections that hold nothing are closed (clients reconnect at once)."""
    connections: int = 0
    """Most connections at once; further ones are refused at accept. 0: what the job needs, a connection for each
    process and each host's agent and SPARE_CONNECTIONS twice, within the descriptor limit less the descriptors the
    coordinator keeps for itself (see ``connection_cap``)."""
    stranger_connections: int = 64
    """With --token-file, connections of callers that made no call with the token (probes, strangers) held at
    once: past it, the oldest are closed (see ``coordinator.door``), and gRPC accepts twice this many connections
    beyond the job's --max-connections, so strangers never take the job's slots."""
    event_history: int = 1 << 16
    """Job events (failures, departures, restarts, generations, a preemption notice) kept for sessions that attach
    or reconnect late: four for each of 2**14 processes. A session further behind gets a snapshot of each process's
    state instead of the events it missed."""
    agents: int = 4096
    """Job watches (WatchJob) held open at once: one per host agent (``ifrt run``), so a job of 4096 hosts fits; each
    holds at most --max-session-backlog-bytes of unread events."""
    kv_bytes: int = 128 << 20
    """Most bytes the key-value store holds: every key and value, and KEY_OVERHEAD_BYTES a key for what holding it
    costs besides (its entry, objects and journal record). Its journal holds about as much again (see
    docs/security.md): the store's share of the coordinator's memory is a few times this."""
    reply_bytes: int = 16 << 20
    """Largest answer the coordinator builds for one call (a KeyValueDir of a prefix): a listing past it is refused
    with RESOURCE_EXHAUSTED instead of being built."""
    answers_per_caller: int = 64
    """Increments and swaps remembered per caller (client uid) for its retries: a client retries only its calls in
    flight."""
    answer_bytes: int = 16 << 20
    """Most bytes of remembered answers over all callers (see ``coordinator.core.retries``): each call's caller, request
    id and key, ANSWER_OVERHEAD_BYTES, and for a swap the value its journal entry keeps; and each caller's record of
    what it forgot (its uid and CALLER_OVERHEAD_BYTES). The oldest call is forgotten first; its retry, if one ever
    comes, is refused, never applied again."""
    barrier_bytes: int = 64 << 20
    """Most bytes barriers hold, cancelled and finished ones included (each name is kept to answer late arrivals):
    their names (in the barrier, its error and its journal entry), BARRIER_OVERHEAD_BYTES each and their participants
    (a set shared by barriers of the same processes is counted once). What one process holds alone (its cancels of
    barriers nobody arrived at, its barriers nobody else arrived at) is at most its share, this divided by the
    processes, so it cannot spend the others' room."""
    sessions_per_process: int = 2
    """Sessions one process may hold open at once (two overlap briefly while a client reconnects); a newer one ends
    the oldest."""
    backlog_bytes: int = 256 << 20
    """Most bytes of events all sessions together leave unread (an event sent to many sessions is one message, counted
    once); past it the session that holds the most is ended, and its process attaches again."""
    registration_bytes: int = 256 << 20
    """Most bytes of registrations one job attempt holds: each RegisterRequest admitted, a restarted process's and
    one forgotten before publication too (the journal keeps every one until the next attempt), with
    REGISTRATION_OVERHEAD_BYTES each and DEVICE_BYTES a device (its objects, in the registration and the topology).
    2**14 processes of 8 devices take about 57 MB."""
    watch_bytes: int = 32 << 20
    """Most bytes of key prefixes all sessions together watch (each prefix and WATCH_OVERHEAD_BYTES); a watch past it
    is not started and is logged, like one past --max-watches-per-session."""
    pending_reply_bytes: int = 128 << 20
    """Most bytes of large answers (64 KiB and more: listings, big values) built and not yet read by their callers,
    over all calls; an answer past it is refused with RESOURCE_EXHAUSTED, and the caller may ask again."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            least = 0 if f.name in ("concurrent_streams", "connections") else 1
            if not isinstance(value, int) or value < least:
                raise InvalidArgument(f"{FLAGS[f.name]} {value!r} is out of range: expected an integer >= {least}")
        if self.devices_per_process > MAX_LOCAL_DEVICES:
            raise InvalidArgument(f"{FLAGS['devices_per_process']} {self.devices_per_process} is out of range: "
                                  f"expected at most {MAX_LOCAL_DEVICES} (2**17), the local ids a global id encodes")


DEFAULT_LIMITS = Limits()
"""Every limit at its default."""


def shown(text: str, most: int = 64) -> str:
    """A caller's text as an error quotes it: its first ``most`` characters (errors travel in a status message,
    which gRPC clients refuse beyond 8 KiB of metadata)."""
    return repr(text) if len(text) <= most else f"{text[:most]!r}... ({len(text)} characters)"


KEY_OVERHEAD_BYTES = 256
"""What a key costs the coordinator besides its key's and value's bytes (dict entry, objects, journal record): counted
against --kv-max-bytes, so many tiny keys cannot hold more than the budget says."""
ANSWER_OVERHEAD_BYTES = 256
"""What a remembered answer costs besides its strings (its entries in two dicts, its tuple and digest)."""
CALLER_OVERHEAD_BYTES = 128
"""What a caller's record of its forgotten answers costs besides its uid (a dict entry, an object, two fields)."""
BARRIER_OVERHEAD_BYTES = 1024
"""What a kept barrier costs besides its name (its object, its error, its journal entry)."""
REGISTRATION_OVERHEAD_BYTES = 1024
"""What a registration costs besides its request's bytes and its devices (its objects, its journal record)."""
DEVICE_BYTES = 320
"""What one registered device costs besides its bytes in the request: its object, and its Device in the topology."""
WATCH_OVERHEAD_BYTES = 128
"""What a watched prefix costs besides its bytes (its entry in the session's set)."""
PARTICIPANT_BYTES = 72
"""What one process id costs in a barrier's set of participants (a set slot and an int; 8 more in its journal)."""


def exhausted(what: str, limit: int, name: str, hint: str, held: int | None = None) -> ResourceExhausted:
    """The RESOURCE_EXHAUSTED of a byte budget: what would pass it, the limit and its flag, and the bytes held."""
    holding = "" if held is None else f"; {held} bytes are held"
    return ResourceExhausted(f"{what} would pass the coordinator's {FLAGS[name]} of {limit} bytes{holding}: {hint}")


FD_RESERVE = 64
"""Descriptors the coordinator keeps for itself besides connections: its listening sockets and event loop, etcd's
connections, the metrics server, log files and a scrape or two."""
SPARE_CONNECTIONS = 64
"""Connections beyond one per process that a job needs room for: operators (``ifrt status``), probes, and
processes reconnecting while their old connection is not yet closed."""


def connection_cap(limits: Limits, descriptor_limit: int, num_processes: int) -> int:
    """The most connections accepted at once: ``--max-connections`` (0: ``jobs_connections``) within the
    descriptor limit less FD_RESERVE. A caller without the token can hold only connections: bounding them by the
    job's size bounds what strangers make the coordinator hold."""
    derived = max(1, descriptor_limit - FD_RESERVE)
    return min(limits.connections or jobs_connections(num_processes), derived)


def accept_cap(limits: Limits, descriptor_limit: int, num_processes: int) -> int:
    """The connections gRPC accepts at once where strangers' connections are closed past their budget: the job's
    ``connection_cap``, the strangers' --max-stranger-connections and as many again for a burst of newcomers (a
    stranger's connection is closed only once its grace is over), within the descriptor limit less FD_RESERVE."""
    derived = max(1, descriptor_limit - FD_RESERVE)
    return min(connection_cap(limits, descriptor_limit, num_processes) + 2 * limits.stranger_connections, derived)


def jobs_connections(num_processes: int) -> int:
    """The connections a job of ``num_processes`` uses at most: one for each process and each host's ``ifrt run``
    agent (at most one a process), and SPARE_CONNECTIONS twice (operators, probes, processes reconnecting)."""
    return 2 * (num_processes + SPARE_CONNECTIONS)


def descriptors_needed(num_processes: int) -> int:
    """The descriptor limit (``ulimit -n``) a job of ``num_processes`` needs: a connection per process, spare
    connections, and the coordinator's own descriptors."""
    return num_processes + SPARE_CONNECTIONS + FD_RESERVE


def check_call_id(what: str, value: str, limits: Limits) -> None:
    """InvalidArgument unless a caller's ``request_id`` or ``call_id`` fits in ``--max-string-bytes``: the
    coordinator keeps it (journaled) to answer the call's retries."""
    size = len(value.encode())
    if size > limits.string_bytes:
        raise InvalidArgument(f"{what} is {size} bytes long: expected at most {limits.string_bytes} (the "
                              f"coordinator's {FLAGS['string_bytes']})")
