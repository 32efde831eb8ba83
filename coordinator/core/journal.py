"""The durable decisions of the state machine, as records a store keeps in order and a new leader replays.

Only what must survive a coordinator restart is journaled: registrations, failures, departures, forgotten
registrations, key-values and their deletions, finished barriers (and a second participant arriving at one that
finished with one), live-set agreements, a preemption notice and its sync step, each decision of the job's next
attempt, the job's agents, a lost host taken over by a spare one, and the start of each run of the job. Liveness
(heartbeats, open calls) is not: after a replay, every process gets a grace period to re-attach.
"""

from __future__ import annotations

import base64
import json
import math
from dataclasses import asdict, dataclass
from json.encoder import encode_basestring_ascii as _string
from typing import Any

from coordinator.core.limits import Limits
from coordinator.core.registration import Registration, from_request, to_request
from ifrt._generated import coordinator_pb2 as pb
from ifrt.errors import ERROR_CLASSES, IfrtError
from ifrt.ids import MAX_LOCAL_DEVICES

_REPLAYED = Limits(devices_per_process=MAX_LOCAL_DEVICES, attributes_per_device=1 << 30, string_bytes=1 << 30)
"""Limits for replayed registrations: they passed the limits of the coordinator that admitted them."""


@dataclass(frozen=True)
class Registered:
    registration: Registration
    now: float


@dataclass(frozen=True)
class Failed:
    client_uid: str
    why: str


@dataclass(frozen=True)
class Left:
    client_uid: str


@dataclass(frozen=True)
class Forgot:
    client_uid: str
    why: str


@dataclass(frozen=True)
class KeySet:
    """A set that changed the key, and the call that made it (a request id: a retry is not applied twice)."""

    key: str
    value: bytes
    client_uid: str = ""
    request_id: str = ""


@dataclass(frozen=True)
class BarrierFinished:
    name: str
    participants: tuple[int, ...]
    error_type: str  # "" when it completed
    error: str
    forgot: str = ""
    """The barrier it superseded and the coordinator forgot as it completed ("": none); a replay forgets it too."""
    canceller: int | None = None
    """With no participants: a cancel before anyone arrived, by this process (None: written before cancels named
    their canceller; it takes effect whoever the participants are). It takes effect when the barrier starts only if
    the canceller is a participant then."""
    held_by: int | None = None
    """The only participant that had arrived when it finished, which holds it in its share of the barrier bounds until
    a second one arrives (``BarrierJoined``); None: two or more had (or a journal written before barriers were held
    by a process)."""


@dataclass(frozen=True)
class BarrierJoined:
    """A second participant, ``process_id``, arrived at barrier ``name`` after it finished held by another one: it is
    shared from now on (``coordinator.core.barriers``)."""

    name: str
    process_id: int


@dataclass(frozen=True)
class KeyIncremented:
    """An increment: the value it left, and the call that made it (so a retry is not applied twice)."""

    key: str
    value: int
    client_uid: str
    request_id: str


@dataclass(frozen=True)
class KeySwapped:
    """A compare-and-set that changed the key: the value it stored, and the call that made it (for retries)."""

    key: str
    value: bytes
    client_uid: str
    request_id: str


@dataclass(frozen=True)
class KeysDeleted:
    """A deletion that deleted ``count`` keys, and the call that made it (a request id: its retry's answer)."""

    key: str
    prefix: bool  # every key starting with ``key``
    client_uid: str = ""
    request_id: str = ""
    count: int = 0


@dataclass(frozen=True)
class AnswersForgotten:
    """A caller's answers pushed out of --max-answer-bytes (``coordinator.core.retries``): its retries of ordered
    request ids up to ``through``, and (``unordered``) of any other request id not remembered, are refused from now
    on."""

    client_uid: str
    through: int
    unordered: bool


@dataclass(frozen=True)
class LiveSetDecided:
    """One live-set agreement: who asked (client uid, call id) and the answer they all get."""

    callers: tuple[tuple[str, str], ...]
    members: tuple[tuple[int, int], ...]  # (process id, incarnation), sorted
    error_type: str  # "" when it was decided
    error: str


@dataclass(frozen=True)
class PreemptionNoticed:
    process_id: int


@dataclass(frozen=True)
class PreemptionSyncDecided:
    step: int


@dataclass(frozen=True)
class AttemptDecided:
    """NextAttempt's decision: job attempt ``ended`` ended with this failure (process -1: not known), and the next
    one started, unless the restarts were ``exhausted``. ``request_id``: the call that decided (for its retries)."""

    ended: int
    process_id: int
    host: str
    reason: str
    exhausted: bool
    request_id: str
    replace: bool = False
    """A replacement (``ifrt run --recover replace``): the attempt goes on, only ``process_id`` starts anew."""


@dataclass(frozen=True)
class AgentJoined:
    """An ``ifrt run`` agent joined the job (see ``coordinator.core.attempts``): its id, host, the address it called
    from, the sha256 of its secret, its worker count, the restart budget it stated (None: it stated none), whether it
    started a new run of the job, and the agents whose place it took."""

    agent_uid: str
    host: str
    host_address: str
    secret_hash: str
    workers: int
    max_restarts: int | None
    new_run: bool = False
    replaced: tuple[str, ...] = ()
    recover: str = ""
    """The ``ifrt run --recover`` mode it stated ("": none)."""
    spare: bool = False
    """A spare host (``ifrt run --spare-host``): no worker until it takes over a lost host's ids."""
    replace_timeout_s: float = 0.0
    """Its ``--replace-timeout``: a shrink of its own workers waits as long (``coordinator.core.shrink``)."""
    joined_unix_s: float = 0.0
    """When it joined, by the leader's clock (``ifrt status``)."""


@dataclass(frozen=True)
class HostTakenOver:
    """The coordinator's own decision (``coordinator.core.takeover``): the agent ``lost_uid`` is gone with its host, and
    the spare host ``spare_uid`` takes over every process id it ran (``process_ids``) in attempt ``attempt``, counted
    against the restart budget, unless the restarts were ``exhausted``."""

    attempt: int
    lost_uid: str
    spare_uid: str
    process_ids: tuple[int, ...]
    host: str
    reason: str
    exhausted: bool


@dataclass(frozen=True)
class Shrunk:
    """A shrink (``coordinator.core.shrink``): attempt ``attempt`` goes on without ``process_ids``, each declared failed
    and neither replaced nor taken over; ``request_id``: the agent's call that decided it (for its retries)."""

    attempt: int
    process_ids: tuple[int, ...]
    request_id: str


@dataclass(frozen=True)
class RunStarted:
    """Every process of the job's run before left or failed, and a registration started run ``run``: every
    sub-machine but the attempts starts empty (``coordinator.core.runs``)."""

    run: int


Entry = (Registered | Failed | Left | Forgot | KeySet | BarrierFinished | BarrierJoined | KeyIncremented | KeySwapped
         | KeysDeleted | LiveSetDecided | PreemptionNoticed | PreemptionSyncDecided | AttemptDecided | AgentJoined
         | RunStarted | HostTakenOver | Shrunk | AnswersForgotten)
_TYPES: dict[str, type] = {cls.__name__: cls for cls in (Registered, Failed, Left, Forgot, KeySet, BarrierFinished,
                                                         BarrierJoined, KeyIncremented, KeySwapped, KeysDeleted,
                                                         LiveSetDecided, PreemptionNoticed, PreemptionSyncDecided,
                                                         AttemptDecided, AgentJoined, RunStarted, HostTakenOver, Shrunk,
                                                         AnswersForgotten)}


def encode(entry: Entry) -> bytes:
    """One entry as compact JSON; a registration keeps its RegisterRequest (base64), the peer and the secret's hash."""
    fields: dict[str, Any]
    if isinstance(entry, Registered):
        r = entry.registration
        request = base64.b64encode(to_request(r)).decode()
        if type(entry.now) is float and math.isfinite(entry.now):  # one per process: what json.dumps writes, built
            return (f'{{"type":"Registered","request":"{request}","host_address":{_string(r.host_address)},'
                    f'"secret_hash":{_string(r.secret_hash)},"now":{entry.now!r}}}').encode()
        fields = {"request": request, "host_address": r.host_address, "secret_hash": r.secret_hash, "now": entry.now}
    elif isinstance(entry, KeySet | KeySwapped):
        fields = {**asdict(entry), "value": base64.b64encode(entry.value).decode()}
    else:
        fields = asdict(entry)
    if isinstance(entry, KeySet | KeysDeleted) and not entry.request_id:  # a call nobody retries: as written before
        for name in ("client_uid", "request_id", "count"):
            fields.pop(name, None)
    if isinstance(entry, BarrierFinished) and not entry.forgot:  # a barrier that forgot none: as written before
        del fields["forgot"]
    if isinstance(entry, BarrierFinished) and entry.canceller is None:  # a barrier that started: as written before
        del fields["canceller"]
    if isinstance(entry, BarrierFinished) and entry.held_by is None:  # a shared barrier: as written before
        del fields["held_by"]
    return json.dumps({"type": type(entry).__name__, **fields}, separators=(",", ":")).encode()


def decode(raw: bytes) -> Entry:
    """The entry ``encode`` wrote; ValueError if it is not one."""
    fields = json.loads(raw)
    kind = _TYPES.get(fields.pop("type", None))
    if kind is None:
        raise ValueError(f"unknown journal entry {raw[:80]!r}")
    if kind is Registered:
        raw = base64.b64decode(fields["request"])
        return Registered(from_request(pb.RegisterRequest.FromString(raw), fields["host_address"], _REPLAYED,
                                       fields["secret_hash"], raw, replayed=True), fields["now"])
    if kind is KeySet or kind is KeySwapped:
        return kind(**{**fields, "value": base64.b64decode(fields["value"])})
    if kind is BarrierFinished:
        fields["participants"] = tuple(fields["participants"])
    if kind is AgentJoined:
        fields["replaced"] = tuple(fields["replaced"])
    if kind is HostTakenOver or kind is Shrunk:
        fields["process_ids"] = tuple(fields["process_ids"])
    if kind is LiveSetDecided:
        fields["callers"] = tuple(tuple(c) for c in fields["callers"])
        fields["members"] = tuple(tuple(m) for m in fields["members"])
    return kind(**fields)


def error_fields(error: IfrtError | None) -> tuple[str, str]:
    """How the journal keeps an error: its class name and message ("", "" for none)."""
    return (type(error).__name__, str(error)) if error else ("", "")


def error_of(kind: str, message: str) -> IfrtError | None:
    """A journaled error back as its typed class (None for no error)."""
    return ERROR_CLASSES[kind](message) if kind else None
