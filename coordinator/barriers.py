"""Barriers: wait until every named process arrived; fail at once when one of them fails. No I/O."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from coordinator.limits import (
    BARRIER_OVERHEAD_BYTES,
    DEFAULT_LIMITS,
    FLAGS,
    PARTICIPANT_BYTES,
    Limits,
    exhausted,
    shown,
)
from ifrt.errors import BarrierCancelled, BarrierFailed, BarrierTimeout, IfrtError, InvalidArgument


@dataclass
class Barrier:
    name: str
    participants: frozenset[int]
    started_at: float
    deadline: float
    arrived: set[int] = field(default_factory=set)
    done: bool = False
    error: IfrtError | None = None
    supersedes: str = ""
    """While pending, the barrier of the same series its arrivals name as the one it follows; once resolved, the one
    it forgot ("" when it forgot none)."""

    @property
    def pending(self) -> bool:
        return not self.done and self.error is None


@dataclass(frozen=True)
class BarrierResolved:
    """Effect: the barrier ``name`` completed (``error`` None) or failed."""

    name: str
    error: IfrtError | None


class Barriers:
    """All barriers of a cluster. A name is used once; arriving again at a resolved barrier repeats its result.
    Names are at most ``limits.barrier_name_bytes`` long. A barrier that names the one it follows (``supersedes``:
    a per-step series) forgets that one when it completes, so a series holds two barriers whatever its length."""

    def __init__(self, limits: Limits = DEFAULT_LIMITS) -> None:
        self.limits = limits
        self._by_name: dict[str, Barrier] = {}
        self._pending: set[str] = set()
        self._sets: dict[frozenset[int], frozenset[int]] = {}  # every set of participants a kept barrier has, once
        self._users: dict[frozenset[int], int] = {}  # how many kept barriers have each of those sets
        self.held = 0
        """Bytes barriers hold, as ``--max-barrier-bytes`` counts them (see ``cost``)."""

    def cost(self, name: str, participants: frozenset[int], supersedes: str = "") -> int:
        """What keeping one more barrier counts against ``--max-barrier-bytes``: its name (in the barrier, its error
        and its journal entry), what it supersedes (in the barrier and its journal entry), BARRIER_OVERHEAD_BYTES,
        8 bytes a participant in its journal entry, and its set of participants unless a kept barrier has the same
        set."""
        shared = participants in self._sets
        return _own_bytes(name, participants, supersedes) + (0 if shared else PARTICIPANT_BYTES * len(participants))

    def _keep(self, name: str, participants: frozenset[int], started_at: float, deadline: float, *,
              error: IfrtError | None = None, done: bool = False, supersedes: str = "") -> Barrier:
        """Keeps a new barrier, its set of participants shared with any kept barrier of the same processes."""
        self.held += self.cost(name, participants, supersedes)
        participants = self._sets.setdefault(participants, participants)
        self._users[participants] = self._users.get(participants, 0) + 1
        barrier = self._by_name[name] = Barrier(name, participants, started_at, deadline, done=done, error=error,
                                                supersedes=supersedes)
        return barrier

    def _forget(self, barrier: Barrier) -> None:
        """Drops a kept barrier and gives back what it counted; its set of participants too when no kept barrier
        has that set any more."""
        del self._by_name[barrier.name]
        self._pending.discard(barrier.name)
        self.held -= _own_bytes(barrier.name, barrier.participants, barrier.supersedes)
        users = self._users.pop(barrier.participants) - 1
        if users:
            self._users[barrier.participants] = users
        else:
            del self._sets[barrier.participants]
            self.held -= PARTICIPANT_BYTES * len(barrier.participants)

    def _supersedes(self, barrier: Barrier, value: str) -> None:
        """Sets what ``barrier`` supersedes (or forgot), counting the difference in bytes."""
        self.held += 2 * (len(value.encode()) - len(barrier.supersedes.encode()))
        barrier.supersedes = value

    def _complete(self, barrier: Barrier) -> None:
        """``barrier`` completed: the barrier it supersedes is forgotten if it is finished and has the same
        participants (every one of them called this barrier after that one answered), or none (cancelled before
        anyone arrived: a vote's no); else it is left alone."""
        barrier.done = True
        self._pending.discard(barrier.name)
        previous = self._by_name.get(barrier.supersedes)
        if previous is not None and not previous.pending and previous.participants in (barrier.participants,
                                                                                        frozenset()):
            self._forget(previous)
        else:
            self._supersedes(barrier, "")

    def get(self, name: str) -> Barrier | None:
        return self._by_name.get(name)

    def outcome(self, name: str) -> BarrierResolved | None:
        """How barrier ``name`` ended; None while it is pending or was never started."""
        barrier = self._by_name.get(name)
        if barrier is None or barrier.pending:
            return None
        return BarrierResolved(name, barrier.error)

    def restore(self, name: str, participants: frozenset[int], error: IfrtError | None, forgot: str = "") -> None:
        """Puts back a finished barrier (from the journal), so late arrivals get its result, and forgets the barrier
        it ``forgot`` when it finished, as the coordinator that journaled it did."""
        if name in self._by_name:  # a barrier finished once; nothing more to count
            self._by_name[name].error, self._by_name[name].done = error, error is None
            self._supersedes(self._by_name[name], forgot)
        else:
            self._keep(name, participants, 0.0, 0.0, error=error, done=error is None, supersedes=forgot)
        self._pending.discard(name)
        if forgot in self._by_name and forgot != name:
            self._forget(self._by_name[forgot])

    def arrive(self, name: str, process_id: int, participants: frozenset[int], timeout_s: float, now: float,
               unavailable: Mapping[int, str], *, supersedes: str = "") -> tuple[Barrier, list[BarrierResolved]]:
        """Records ``process_id``'s arrival; ``unavailable`` maps failed or departed participants to why.
        ``supersedes``: the barrier this one follows, forgotten once this one completes ("": none)."""
        if not name:
            raise InvalidArgument("barrier name is empty: expected a name unique to this barrier")
        if len(name.encode()) > self.limits.barrier_name_bytes:
            raise InvalidArgument(f"barrier name {shown(name)} is {len(name.encode())} bytes long: expected at "
                                  f"most {self.limits.barrier_name_bytes} (the coordinator's "
                                  f"{FLAGS['barrier_name_bytes']})")
        if len(supersedes.encode()) > self.limits.barrier_name_bytes:
            raise InvalidArgument(f"barrier {shown(name)} supersedes {shown(supersedes)} is "
                                  f"{len(supersedes.encode())} bytes long: expected at most "
                                  f"{self.limits.barrier_name_bytes} (the coordinator's {FLAGS['barrier_name_bytes']})")
        if supersedes == name:
            raise InvalidArgument(f"barrier {shown(name)} names itself in supersedes: expected the barrier it follows "
                                  f"(or none)")
        barrier = self._by_name.get(name)
        if barrier is not None and not barrier.participants:  # cancelled before anyone arrived: any caller hears it
            return barrier, []
        if barrier is not None and barrier.participants != participants:
            raise InvalidArgument(f"barrier {name!r} was started for processes {_ids(barrier.participants)}; "
                                  f"this call names {_ids(participants)}: use a new name for other participants")
        if process_id not in participants:
            raise InvalidArgument(f"process {process_id} is not a participant of barrier {name!r} "
                                  f"(processes {_ids(participants)})")
        if barrier is not None and barrier.pending and barrier.supersedes != supersedes:
            raise InvalidArgument(f"barrier {name!r} was started superseding {shown(barrier.supersedes)}; this call "
                                  f"names {shown(supersedes)}: every participant names the barrier it follows")
        if barrier is None:
            self._check_room(name, participants, supersedes)
            barrier = self._keep(name, participants, now, now + timeout_s, supersedes=supersedes)
            self._pending.add(name)
        if not barrier.pending:
            return barrier, []
        barrier.deadline = min(barrier.deadline, now + timeout_s)
        barrier.arrived.add(process_id)
        gone = sorted(participants & unavailable.keys())
        if gone:
            return barrier, self._fail(barrier, BarrierFailed(
                f"barrier {name!r} cannot complete: process {gone[0]} {unavailable[gone[0]]}"))
        if barrier.arrived == barrier.participants:
            self._complete(barrier)
            return barrier, [BarrierResolved(name, None)]
        return barrier, []

    def cancel(self, name: str, by: str, now: float) -> tuple[bool, list[BarrierResolved]]:
        """Fails barrier ``name`` with BarrierCancelled (naming ``by``) for every current and future waiter, also
        before anyone arrived; False, changing nothing, when it had completed or failed already."""
        if not name or len(name.encode()) > self.limits.barrier_name_bytes:
            raise InvalidArgument(f"barrier name {shown(name)} is {len(name.encode())} bytes long: expected 1 to "
                                  f"{self.limits.barrier_name_bytes} (the coordinator's {FLAGS['barrier_name_bytes']})")
        barrier = self._by_name.get(name)
        if barrier is None:
            self._check_room(name, frozenset())
            barrier = self._keep(name, frozenset(), now, now)
        elif not barrier.pending:
            return False, []
        return True, self._fail(barrier, BarrierCancelled(f"barrier {name!r} was cancelled by {by}"))

    def fail_including(self, process_id: int, why: str) -> list[BarrierResolved]:
        """Fails every pending barrier that ``process_id`` belongs to, with ``why`` in the message."""
        effects = []
        for barrier in self._pending_barriers():
            if process_id in barrier.participants:
                effects += self._fail(barrier, BarrierFailed(
                    f"barrier {barrier.name!r} cannot complete: process {process_id} {why}"))
        return effects

    def expire(self, now: float, describe: Callable[[int], str]) -> list[BarrierResolved]:
        """Fails every pending barrier whose deadline passed, naming who did not arrive."""
        effects = []
        for barrier in self._pending_barriers():
            if now >= barrier.deadline:
                missing = sorted(barrier.participants - barrier.arrived)
                effects += self._fail(barrier, BarrierTimeout(
                    f"barrier {barrier.name!r} timed out after {now - barrier.started_at:.1f}s: "
                    f"{len(missing)} of {len(barrier.participants)} processes did not arrive: "
                    f"{', '.join(describe(p) for p in missing[:16])}{' ...' if len(missing) > 16 else ''}"))
        return effects

    def _check_room(self, name: str, participants: frozenset[int], supersedes: str = "") -> None:
        """InvalidArgument unless one more barrier fits under ``limits.barriers``; ResourceExhausted unless its bytes
        fit under ``limits.barrier_bytes``."""
        if len(self._by_name) >= self.limits.barriers:
            raise InvalidArgument(f"barrier {shown(name)} would be barrier number {len(self._by_name) + 1}: expected "
                                  f"at most {self.limits.barriers} barriers (the coordinator's {FLAGS['barriers']})")
        cost = self.cost(name, participants, supersedes)
        if self.held + cost > self.limits.barrier_bytes:
            raise exhausted(f"keeping barrier {shown(name)} ({cost} bytes)",
                            self.limits.barrier_bytes, "barrier_bytes",
                            "every barrier is kept to answer late arrivals: use fewer (and shorter) names, name the "
                            "step a barrier follows in supersedes, or raise the flag", self.held)

    def _pending_barriers(self) -> list[Barrier]:
        return [self._by_name[name] for name in sorted(self._pending)]

    def _fail(self, barrier: Barrier, error: IfrtError) -> list[BarrierResolved]:
        """Fails ``barrier``; it forgets nothing (a participant that had not arrived may still retry the one before)."""
        barrier.error = error
        self._pending.discard(barrier.name)
        self._supersedes(barrier, "")
        return [BarrierResolved(barrier.name, error)]


def _own_bytes(name: str, participants: frozenset[int], supersedes: str) -> int:
    """What one barrier counts against ``--max-barrier-bytes`` besides its set of participants (see ``cost``)."""
    return 3 * len(name.encode()) + 2 * len(supersedes.encode()) + BARRIER_OVERHEAD_BYTES + 8 * len(participants)


def _ids(process_ids: frozenset[int], most: int = 16) -> str:
    """``[0, 1, 2]``, or the first ``most`` ids and how many there are in all (an error must stay small)."""
    ids = sorted(process_ids)
    return str(ids) if len(ids) <= most else f"{str(ids[:most])[:-1]}, ...] ({len(ids)} processes)"
