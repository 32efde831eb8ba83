"""Barriers: wait until every named process arrived; fail at once when one of them fails. No I/O."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from coordinator.core.limits import (
    BARRIER_OVERHEAD_BYTES,
    DEFAULT_LIMITS,
    FLAGS,
    PARTICIPANT_BYTES,
    Limits,
    exhausted,
    shown,
)
from ifrt.errors import (
    BarrierCancelled,
    BarrierFailed,
    BarrierTimeout,
    IfrtError,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
)

ALWAYS_HELD = 4
"""Barriers and early cancels a process may hold alone whatever its share: one barrier of every process of a large job
costs more than a share, and a voter may say no a few rounds before the others arrive at the first of them."""


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
    a per-step series) forgets that one when it completes, so a series holds two barriers whatever its length.

    A barrier belongs to its participants: only they may cancel it. A cancel of a barrier nobody arrived at yet
    (an early cancel: a vote's no) is kept for its canceller; the first arrival starts the barrier and drops the
    early cancels of its name, failing it with the first one whose canceller is a participant. What one process
    holds alone, its early cancels and the kept barriers only it arrived at (pending or finished: it started them,
    and no other participant arrived yet), fits in its share of ``limits.barriers`` and ``limits.barrier_bytes``
    (each divided by ``processes``), beyond ALWAYS_HELD of them; a barrier leaves its starter's share once a second
    participant arrives (also after it finished) or it is forgotten."""

    def __init__(self, limits: Limits = DEFAULT_LIMITS, processes: int = 1) -> None:
        self.limits = limits
        self.processes = max(1, processes)
        """How many processes share the bounds: what one process holds alone is at most 1/processes of each."""
        self._by_name: dict[str, Barrier] = {}
        self._pending: set[str] = set()
        self._sets: dict[frozenset[int], frozenset[int]] = {}  # every set of participants a kept barrier has, once
        self._users: dict[frozenset[int], int] = {}  # how many kept barriers have each of those sets
        self._early: dict[str, dict[int | None, BarrierCancelled]] = {}
        """Name -> canceller -> its error, for barriers nobody arrived at (None: a canceller a journal written before
        cancels named theirs did not record; its cancel takes effect whoever the participants are)."""
        self._early_total = 0
        self._holder: dict[str, int] = {}  # kept barrier -> the one process that arrived at it (it holds it alone)
        self._alone_count: dict[int, int] = {}  # process -> barriers and early cancels it holds alone
        self._alone_bytes: dict[int, int] = {}  # process -> bytes they count (see ``_held_bytes``)
        self.held = 0
        """Bytes barriers and early cancels hold, as ``--max-barrier-bytes`` counts them (see ``cost``)."""

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
        self._release(barrier.name)
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
        change = 2 * (len(value.encode()) - len(barrier.supersedes.encode()))
        self.held += change
        if (holder := self._holder.get(barrier.name)) is not None:
            self._count(holder, 0, change)
        barrier.supersedes = value

    def _complete(self, barrier: Barrier) -> None:
        """``barrier`` completed: the barrier it supersedes is forgotten if it is finished and has the same
        participants (every one of them called this barrier after that one answered); else it is left alone."""
        barrier.done = True
        self._pending.discard(barrier.name)
        previous = self._by_name.get(barrier.supersedes)
        if previous is not None and not previous.pending and previous.participants == barrier.participants:
            self._forget(previous)
        else:
            self._supersedes(barrier, "")

    def ended(self) -> dict[str, Barrier]:
        """The barriers kept that completed or failed, by name."""
        return {name: b for name, b in self._by_name.items() if not b.pending}

    def get(self, name: str) -> Barrier | None:
        return self._by_name.get(name)

    def holder(self, name: str) -> int | None:
        """The process that holds kept barrier ``name`` alone (the only one that arrived at it); None: shared."""
        return self._holder.get(name)

    def held_alone(self, process_id: int) -> tuple[int, int]:
        """How many barriers and early cancels ``process_id`` holds alone, and the bytes they count against its
        share."""
        return self._alone_count.get(process_id, 0), self._alone_bytes.get(process_id, 0)

    def _count(self, process_id: int, count: int, size: int) -> None:
        """Adds ``count`` items of ``size`` bytes in all to what ``process_id`` holds alone."""
        left = self._alone_count.get(process_id, 0) + count
        if left:
            self._alone_count[process_id] = left
            self._alone_bytes[process_id] = self._alone_bytes.get(process_id, 0) + size
        else:
            self._alone_count.pop(process_id, None)
            self._alone_bytes.pop(process_id, None)

    def _hold(self, barrier: Barrier, process_id: int) -> None:
        """``process_id`` is the only one that arrived at ``barrier``: it holds it in its share."""
        self._release(barrier.name)
        self._holder[barrier.name] = process_id
        self._count(process_id, 1, _held_bytes(barrier.name, barrier.participants, barrier.supersedes))

    def _release(self, name: str) -> None:
        """Barrier ``name`` is shared or forgotten: it leaves its holder's share, giving back what it counted."""
        holder = self._holder.pop(name, None)
        if holder is not None:
            barrier = self._by_name[name]
            self._count(holder, -1, -_held_bytes(name, barrier.participants, barrier.supersedes))

    def early_cancels(self, name: str) -> dict[int | None, BarrierCancelled]:
        """The cancels of barrier ``name`` kept before anyone arrived, by canceller (empty once it started)."""
        return dict(self._early.get(name, {}))

    def _keep_early(self, name: str, canceller: int | None, error: BarrierCancelled) -> None:
        cost = _own_bytes(name, frozenset(), "")
        self._early.setdefault(name, {})[canceller] = error
        self._early_total += 1
        self.held += cost
        if canceller is not None:
            self._count(canceller, 1, cost)

    def _drop_early(self, name: str) -> dict[int | None, BarrierCancelled]:
        """Drops the early cancels of ``name`` and gives back what they counted; returns them."""
        early = self._early.pop(name, {})
        cost = _own_bytes(name, frozenset(), "")
        self._early_total -= len(early)
        self.held -= cost * len(early)
        for canceller in early.keys() - {None}:
            self._count(canceller, -1, -cost)
        return early

    def outcome(self, name: str) -> BarrierResolved | None:
        """How barrier ``name`` ended; None while it is pending or was never started."""
        barrier = self._by_name.get(name)
        if barrier is None or barrier.pending:
            return None
        return BarrierResolved(name, barrier.error)

    def restore(self, name: str, participants: frozenset[int], error: IfrtError | None, forgot: str = "",
                canceller: int | None = None, *, held_by: int | None = None) -> None:
        """Puts back a finished barrier (from the journal), so late arrivals get its result, held alone by
        ``held_by`` (None: shared), and forgets the barrier it ``forgot`` when it finished, as the coordinator that
        journaled it did. No participants: an early cancel by ``canceller`` (None: a journal that did not name it),
        kept again until the barrier starts."""
        if not participants:
            if name not in self._by_name and canceller not in self._early.get(name, {}):
                self._keep_early(name, canceller, error if isinstance(error, BarrierCancelled)
                                 else BarrierCancelled(str(error)))
            return
        self._drop_early(name)
        if name in self._by_name:  # a barrier finished once; nothing more to count
            self._by_name[name].error, self._by_name[name].done = error, error is None
            self._supersedes(self._by_name[name], forgot)
        else:
            self._keep(name, participants, 0.0, 0.0, error=error, done=error is None, supersedes=forgot)
        if held_by is None:
            self._release(name)
        else:
            self._hold(self._by_name[name], held_by)
        self._pending.discard(name)
        if forgot in self._by_name and forgot != name:
            self._forget(self._by_name[forgot])
        elif forgot:  # a journal written before cancels named their canceller kept a vote's no as an early cancel
            self._drop_early(forgot)

    def restore_joined(self, name: str) -> None:
        """Puts back that a second participant arrived at finished barrier ``name`` (from the journal): it is shared."""
        if name in self._by_name:
            self._release(name)

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
            early = self._early.get(name, {})
            self._check_room(name, participants, supersedes, replaces=len(early))
            own = (1, _own_bytes(name, frozenset(), "")) if process_id in early else (0, 0)
            cost = _held_bytes(name, participants, supersedes)
            self._check_share(process_id, f"starting barrier {shown(name)} ({cost} bytes), which only process "
                                          f"{process_id} arrived at yet,", cost, gives_back=own,
                              advice="a barrier leaves this share once another participant arrives at it, so "
                                     "start only barriers others will arrive at, name the step a barrier follows in "
                                     "supersedes")
            self._drop_early(name)
            barrier = self._keep(name, participants, now, now + timeout_s, supersedes=supersedes)
            self._pending.add(name)
            self._hold(barrier, process_id)
            cancel = next((e for by, e in early.items() if by is None or by in participants), None)
            if cancel is not None:  # a participant cancelled it before anyone arrived; others' cancels change nothing
                return barrier, self._fail(barrier, cancel)
        elif self._holder.get(name, process_id) != process_id:  # a second participant: the barrier is shared
            self._release(name)
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

    def cancel(self, name: str, process_id: int, participants: frozenset[int], by: str
               ) -> tuple[bool, list[BarrierResolved]]:
        """Process ``process_id`` (described by ``by``) fails barrier ``name`` with BarrierCancelled for every current
        and future waiter. ``participants``: the barrier's as the caller names them (empty: not named). Before
        anyone arrived, the cancel is kept for the caller (True, no effects) and takes effect when the barrier
        starts only if the caller is a participant then. False, changing nothing, when the barrier had completed
        or failed already, or the caller had cancelled it early already. PermissionDenied, changing nothing, when
        the caller is not a participant; InvalidArgument or ResourceExhausted (see ``_check_early_room``)."""
        if not name or len(name.encode()) > self.limits.barrier_name_bytes:
            raise InvalidArgument(f"barrier name {shown(name)} is {len(name.encode())} bytes long: expected 1 to "
                                  f"{self.limits.barrier_name_bytes} (the coordinator's {FLAGS['barrier_name_bytes']})")
        barrier = self._by_name.get(name)
        started = barrier.participants if barrier is not None else participants
        if started and process_id not in started:
            raise PermissionDenied(f"process {process_id} may not cancel barrier {name!r}: only its participants "
                                   f"may (processes {_ids(started)})")
        if barrier is not None and participants and participants != barrier.participants:
            raise InvalidArgument(f"barrier {name!r} was started for processes {_ids(barrier.participants)}; this "
                                  f"cancel names {_ids(participants)}: name its participants, or none")
        error = BarrierCancelled(f"barrier {name!r} was cancelled by {by}")
        if barrier is None:
            if process_id in self._early.get(name, {}):
                return False, []
            self._check_early_room(name, process_id)
            self._keep_early(name, process_id, error)
            return True, []
        if not barrier.pending:
            return False, []
        return True, self._fail(barrier, error)

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

    def _check_room(self, name: str, participants: frozenset[int], supersedes: str = "", replaces: int = 0) -> None:
        """InvalidArgument unless one more barrier fits under ``limits.barriers``; ResourceExhausted unless its bytes
        fit under ``limits.barrier_bytes``. ``replaces``: how many early cancels of ``name`` it drops."""
        kept = len(self._by_name) + self._early_total - replaces
        if kept >= self.limits.barriers:
            raise InvalidArgument(f"barrier {shown(name)} would be barrier number {kept + 1}: expected "
                                  f"at most {self.limits.barriers} barriers (the coordinator's {FLAGS['barriers']})")
        cost = self.cost(name, participants, supersedes) - replaces * _own_bytes(name, frozenset(), "")
        if self.held + cost > self.limits.barrier_bytes:
            raise exhausted(f"keeping barrier {shown(name)} ({cost} bytes)",
                            self.limits.barrier_bytes, "barrier_bytes",
                            "every barrier is kept to answer late arrivals: use fewer (and shorter) names, name the "
                            "step a barrier follows in supersedes, or raise the flag", self.held)

    def _check_early_room(self, name: str, process_id: int) -> None:
        """``_check_room`` for an early cancel, then ``_check_share``."""
        self._check_room(name, frozenset())
        cost = _own_bytes(name, frozenset(), "")
        self._check_share(process_id, f"keeping process {process_id}'s cancel of barrier {shown(name)} ({cost} "
                                      f"bytes), which nobody arrived at yet,", cost,
                          advice="cancel only barriers this process takes part in, then arrive at them (the first "
                                 "arrival frees the cancel)")

    def _check_share(self, process_id: int, what: str, cost: int, advice: str, gives_back: tuple[int, int] = (0, 0)
                     ) -> None:
        """ResourceExhausted unless one more item of ``cost`` bytes that ``process_id`` holds alone fits in its share
        of ``limits.barriers`` and ``limits.barrier_bytes`` (each divided by ``processes``), or it holds fewer than
        ALWAYS_HELD: one process cannot spend the job's bounds, and only it is refused. ``gives_back``: the count
        and bytes of what it holds that the new item drops. A job of one process has only the job's bounds."""
        if self.processes == 1:
            return
        count, held = self.held_alone(process_id)
        count, held = count - gives_back[0], held - gives_back[1]
        most_count, most_bytes = self.limits.barriers // self.processes, self.limits.barrier_bytes // self.processes
        if count >= ALWAYS_HELD and (count + 1 > most_count or held + cost > most_bytes):
            raise ResourceExhausted(
                f"{what} would pass process {process_id}'s share of the coordinator's bounds on what "
                f"one process holds alone (the barriers only it arrived at, its cancels of barriers nobody arrived "
                f"at): {most_count} of them and {most_bytes} bytes a process ({FLAGS['barriers']} "
                f"{self.limits.barriers} and {FLAGS['barrier_bytes']} {self.limits.barrier_bytes} over "
                f"--num-processes {self.processes}); it holds {count} ({held} bytes): {advice}, or raise the flags")

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


def _held_bytes(name: str, participants: frozenset[int], supersedes: str) -> int:
    """What a barrier held alone counts against its holder's share: as ``Barriers.cost``, its set of participants
    counted as its own."""
    return _own_bytes(name, participants, supersedes) + PARTICIPANT_BYTES * len(participants)


def _ids(process_ids: frozenset[int], most: int = 16) -> str:
    """``[0, 1, 2]``, or the first ``most`` ids and how many there are in all (an error must stay small)."""
    ids = sorted(process_ids)
    return str(ids) if len(ids) <= most else f"{str(ids[:most])[:-1]}, ...] ({len(ids)} processes)"
