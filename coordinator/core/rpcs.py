"""The Coordinator service's unary RPCs as a table: each row says how its request is turned into a command (or a
read) of the state machine, how a call whose result is not decided yet waits, and how the result is answered.
The service runs every row through one pipeline (``CoordinatorService.unary``): parse, command, commit, apply,
answer. A new RPC is a row and pure functions."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import Message

from coordinator.core.agreement import LeftOut, LiveSetResolved
from coordinator.core.barriers import BarrierResolved
from coordinator.core.cluster import ClusterConfig
from coordinator.core.effects import Effect, KeyChanged
from coordinator.core.preemption import PreemptionResolved
from coordinator.core.state import ClusterState
from coordinator.core.waits import wait_s
from ifrt._generated import coordinator_pb2 as pb
from ifrt.errors import BarrierTimeout, IfrtError, KeyValueTimeout

DONE = True
"""The result of a call that answers nothing but success (a barrier passed)."""
PREEMPTION = ("preemption",)
# What waiting calls wait for, besides the one above: a barrier's end, a key's value, one call's agreement answer.
BARRIER, KEY, LIVE = "barrier", "key", "live"


@dataclass(frozen=True)
class Call:
    """What a command knows of its call besides the request: the time and the hash of the process secret it
    carries."""

    now: float
    proof: str


@dataclass(frozen=True)
class Wait:
    """How a call whose result is None (not decided yet) waits: for what, how long (the core's rule), how its answer
    is read off what woke it, and the error once its wait is over."""

    on: Callable[[Any], Hashable]
    seconds: Callable[[ClusterConfig, Any], float]
    answer: Callable[[Any, Any], Any]
    expired: Callable[[Any, str, float], IfrtError]
    recheck: Callable[[ClusterState, Any, Call], object] | None = None
    """Asked again (of durable state) before a woken call is answered: raises the caller's error when it may no
    longer have the answer (it failed or was replaced while it waited)."""
    quiet: bool = False
    """Whether an expired wait is logged only at debug level (a caller's own deadline, not a fault)."""
    logged: str = " waits"
    """How the (debug) log line that a call waits goes on after the call's description."""


@dataclass(frozen=True)
class Rpc:
    """One unary RPC. Exactly one of ``command`` (changes state: journaled, then its effects carried out) and
    ``query`` (reads durable state only) is given; a result that is an IfrtError is the call's error."""

    request: type[Message]
    what: Callable[[Any], str]
    encode: Callable[[Any], bytes]
    command: Callable[[ClusterState, Any, Call], tuple[Any, list[Effect]]] | None = None
    query: Callable[[ClusterState, Any, Call], Any] | None = None
    wait: Wait | None = None


def answers(effect: Effect) -> Iterable[tuple[Hashable, object]]:
    """The waiting calls an effect answers, by what they wait for, with what wakes them."""
    match effect:
        case BarrierResolved(name=name):
            return [((BARRIER, name), effect)]
        case KeyChanged(key=key, value=value) if value is not None:
            return [((KEY, key), value)]
        case LiveSetResolved(callers=callers, members=members, error=error):
            return [((LIVE, uid, call_id), members if error is None else error) for uid, call_id in callers]
        case LeftOut(client_uid=uid, call_id=call_id, error=error):
            return [((LIVE, uid, call_id), error)]
        case PreemptionResolved():
            return [(PREEMPTION, effect)]
    return ()


def _empty(_: object) -> bytes:
    return b""


def _no_result(effects: list[Effect]) -> tuple[None, list[Effect]]:
    return None, effects


def _kv_get(s: ClusterState, q: pb.KeyValueGetRequest | pb.KeyValueTryGetRequest, c: Call) -> bytes | None:
    return s.keys.get(q.client_uid, q.key, proof=c.proof)


def _first(keys: Sequence[str]) -> str:
    """The first of several keys, for messages."""
    return f" from {keys[0]!r}" if keys else ""


def _barrier_result(outcome: BarrierResolved | None) -> IfrtError | bool | None:
    return None if outcome is None else outcome.error or DONE


def _arrive(s: ClusterState, q: pb.BarrierRequest, c: Call) -> tuple[IfrtError | bool | None, list[Effect]]:
    outcome, effects = s.arrive(q.client_uid, q.name, frozenset(q.process_ids), q.timeout_ms / 1000, c.now,
                                        proof=c.proof, supersedes=q.supersedes)
    return _barrier_result(outcome), effects


def _tick_wait(config: ClusterConfig, q: Any) -> float:
    """A barrier's, agreement's or sync point's wait: its timeout (the tick resolves it then) and the stall slack."""
    return wait_s(config, q.timeout_ms / 1000, resolved_by_tick=True)


def _not_resolved(_: object, what: str, seconds: float) -> IfrtError:
    return BarrierTimeout(f"{what} did not resolve within {seconds:.1f}s")


def _sync_step(woke: PreemptionResolved, _: object) -> int | IfrtError | None:
    return woke.step if woke.step is not None else woke.error


RPCS: dict[str, Rpc] = {
    "Leave": Rpc(
        pb.LeaveRequest, lambda q: "leave", _empty,
        command=lambda s, q, c: _no_result(s.leave(q.client_uid, c.now, proof=c.proof))),
    "Barrier": Rpc(
        pb.BarrierRequest, lambda q: f"barrier {q.name!r}", _empty,
        command=_arrive,
        wait=Wait(lambda q: (BARRIER, q.name), _tick_wait,
                  lambda woke, q: _barrier_result(woke), _not_resolved, logged=": a process arrived and waits")),
    "CancelBarrier": Rpc(
        pb.CancelBarrierRequest, lambda q: f"cancel of barrier {q.name!r}",
        lambda cancelled: pb.CancelBarrierResponse(cancelled=cancelled).SerializeToString(),
        command=lambda s, q, c: s.cancel_barrier(q.client_uid, q.name, c.now,
                                                         process_ids=frozenset(q.process_ids), proof=c.proof)),
    "KeyValueSet": Rpc(
        pb.KeyValueSetRequest, lambda q: f"key-value set of {q.key!r}", _empty,
        command=lambda s, q, c: _no_result(s.keys.set(q.client_uid, q.key, q.value, q.allow_overwrite,
                                                              q.request_id, proof=c.proof))),
    "KeyValueGet": Rpc(
        pb.KeyValueGetRequest, lambda q: f"key-value get of {q.key!r}",
        lambda value: pb.KeyValueGetResponse(value=value).SerializeToString(),
        query=_kv_get,
        wait=Wait(lambda q: (KEY, q.key), lambda config, q: wait_s(config, q.wait_ms / 1000),
                  lambda value, q: value,
                  lambda q, what, seconds: KeyValueTimeout(f"key {q.key!r} was not set within {seconds:.1f}s"),
                  quiet=True, recheck=_kv_get)),
    "KeyValueTryGet": Rpc(
        pb.KeyValueTryGetRequest, lambda q: f"key-value try-get of {q.key!r}",
        lambda value: pb.KeyValueTryGetResponse(found=value is not None, value=value or b"").SerializeToString(),
        query=_kv_get),
    "KeyValueDir": Rpc(
        pb.KeyValueDirRequest, lambda q: f"key-value dir of {q.prefix!r}",
        lambda found: pb.KeyValueDirResponse(entries=[pb.KeyValueEntry(key=k, value=v)
                                                      for k, v in found]).SerializeToString(),
        query=lambda s, q, c: s.keys.dir(q.client_uid, q.prefix, proof=c.proof)),
    "KeyValueMultiGet": Rpc(
        pb.KeyValueMultiGetRequest, lambda q: f"key-value multi-get of {len(q.keys)} keys{_first(q.keys)}",
        lambda values: pb.KeyValueMultiGetResponse(values=[
            pb.KeyValueTryGetResponse(found=v is not None, value=v or b"") for v in values]).SerializeToString(),
        query=lambda s, q, c: s.keys.get_many(q.client_uid, list(q.keys), proof=c.proof)),
    "KeyValueMultiSet": Rpc(
        pb.KeyValueMultiSetRequest, lambda q: f"key-value multi-set of {len(q.entries)} keys"
                                              f"{_first([e.key for e in q.entries])}", _empty,
        command=lambda s, q, c: _no_result(s.keys.set_many(
            q.client_uid, [(e.key, e.value) for e in q.entries], q.allow_overwrite, q.request_id, proof=c.proof))),
    "KeyValueIncrement": Rpc(
        pb.KeyValueIncrementRequest, lambda q: f"key-value increment of {q.key!r}",
        lambda total: pb.KeyValueIncrementResponse(value=total).SerializeToString(),
        command=lambda s, q, c: s.keys.increment(q.client_uid, q.key, q.amount, q.request_id, proof=c.proof)),
    "KeyValueCompareSet": Rpc(
        pb.KeyValueCompareSetRequest, lambda q: f"key-value compare-set of {q.key!r}",
        lambda value: pb.KeyValueCompareSetResponse(value=value or b"", found=value is not None).SerializeToString(),
        command=lambda s, q, c: s.keys.compare_set(q.client_uid, q.key, q.expected, q.desired, q.request_id,
                                                           proof=c.proof)),
    "KeyValueDelete": Rpc(
        pb.KeyValueDeleteRequest, lambda q: f"key-value delete of {q.key!r}{' (prefix)' if q.prefix else ''}",
        lambda deleted: pb.KeyValueDeleteResponse(deleted=deleted).SerializeToString(),
        command=lambda s, q, c: s.keys.delete(q.client_uid, q.key, q.prefix, q.request_id, proof=c.proof)),
    "LiveProcesses": Rpc(
        pb.LiveProcessesRequest, lambda q: "live_processes",
        lambda members: pb.LiveProcessesResponse(processes=[pb.LiveProcess(process_id=pid, incarnation=incarnation)
                                                            for pid, incarnation in members]).SerializeToString(),
        command=lambda s, q, c: s.live_processes(q.client_uid, q.call_id, q.timeout_ms / 1000, c.now,
                                                 proof=c.proof),
        wait=Wait(lambda q: (LIVE, q.client_uid, q.call_id), _tick_wait, lambda answer, q: answer, _not_resolved)),
    "PreemptionNotice": Rpc(
        pb.PreemptionNoticeRequest, lambda q: "preemption notice", _empty,
        command=lambda s, q, c: _no_result(s.preemption_notice(q.client_uid, c.now, proof=c.proof))),
    "PreemptionSync": Rpc(
        pb.PreemptionSyncRequest, lambda q: f"preemption sync at step {q.step}",
        lambda step: pb.PreemptionSyncResponse(sync_step=step).SerializeToString(),
        command=lambda s, q, c: s.preemption_sync(q.client_uid, q.step, q.timeout_ms / 1000, c.now,
                                                          proof=c.proof),
        wait=Wait(lambda q: PREEMPTION, _tick_wait, _sync_step, _not_resolved)),
}
